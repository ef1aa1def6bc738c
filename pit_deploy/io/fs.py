"""File-system helpers every stage shares: one atomic writer for files and one for
directories, sha256 digests, and the ``--out`` check. Standard library only.

Atomicity: a file is written to a temporary sibling and renamed over its target
(``os.replace`` is atomic on POSIX and Windows); a directory is built in a temporary sibling
and renamed into place when complete. A crash therefore never leaves a half-written file or a
directory that looks complete (``docs/conventions.md``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from ..errors import PitError


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def check_output_dir(out: str | os.PathLike, force: bool) -> Path:
    """Refuse to overwrite an existing non-empty directory unless ``force``."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise PitError(f"--out {out} exists and is not a directory; choose another path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise PitError(f"--out {out} exists and is not empty; pass --force to replace it")
    return out


@contextlib.contextmanager
def atomic_directory(out: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside ``out``; rename it to ``out`` only on success.

    On any exception the temporary directory is removed and ``out`` is untouched. With
    ``force`` an existing ``out`` is replaced only after the new one is complete.
    """
    out = check_output_dir(out, force).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            trash = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(trash)
            tmp.rename(out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str, mode: int = 0o644) -> Path:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json_atomic(path: str | os.PathLike, data: Any) -> Path:
    """:func:`write_text_atomic` of ``data`` as indented JSON with a final newline."""
    return write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False) + "\n")

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


def check_output_dir(out: str | os.PathLike, force: bool, protect: tuple[str | os.PathLike, ...] = ()) -> Path:
    """Refuse to overwrite an existing non-empty directory unless ``force``, and refuse an
    ``--out`` that ``--force`` could turn into data loss (:func:`check_replaceable`).

    Also checks, before any slow work, that ``--out`` can be created: not under a file, and
    in a writable directory.
    """
    out = Path(out)
    if out.is_symlink():
        raise PitError(f"--out {out} is a symbolic link; pass the real directory (pit-deploy never "
                       "replaces a link or what it points to)")
    if out.exists() and not out.is_dir():
        raise PitError(f"--out {out} exists and is not a directory; choose another path")
    check_replaceable(out, protect)
    if out.is_dir() and any(out.iterdir()) and not force:
        raise PitError(f"--out {out} exists and is not empty; pass --force to replace it")
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise PitError(f"--out {out} lies under {parent}, which is a file; choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PitError(f"--out {out}: {parent} is not writable; choose another path")
    return out


def check_replaceable(out: str | os.PathLike, protect: tuple[str | os.PathLike, ...] = ()) -> None:
    """Refuse an ``--out`` that is, contains or lies inside a protected path: the current
    directory, the home directory, a filesystem root, or any of ``protect`` (the source model).
    ``--force`` replaces only the directory the user named, never something they did not."""
    target = Path(out).expanduser().resolve()
    guarded: list[tuple[str, Path]] = [("the current directory", Path.cwd().resolve()),
                                       ("your home directory", Path.home().resolve())]
    guarded += [(f"the source {p}", Path(p).expanduser().resolve()) for p in protect if p and Path(p).expanduser().exists()]
    if target == Path(target.anchor):
        raise PitError(f"--out {out} is a filesystem root; choose a directory of its own")
    for what, path in guarded:
        if target == path:
            raise PitError(f"--out {out} is {what}; refusing to replace it (choose a new directory)")
        if path.is_relative_to(target):
            raise PitError(f"--out {out} contains {what}; refusing to replace it (choose a new directory)")
        if what.startswith("the source") and target.is_relative_to(path):
            raise PitError(f"--out {out} lies inside {what}; write the output elsewhere")


@contextlib.contextmanager
def atomic_directory(out: str | os.PathLike, force: bool = False,
                     protect: tuple[str | os.PathLike, ...] = ()) -> Iterator[Path]:
    """Yield a temporary directory beside ``out``; rename it to ``out`` only on success.

    On any exception the temporary directory is removed and ``out`` is untouched. With
    ``force`` an existing ``out`` is replaced only after the new one is complete.
    """
    out = check_output_dir(out, force, protect).absolute()
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


def confined(root: str | os.PathLike, relative: str, what: str) -> Path:
    """``root / relative``, refusing (as a tampered artifact) a path that resolves — after
    following symlinks — outside ``root``."""
    if not isinstance(relative, str) or not relative:
        raise PitError(f"{what}: expected a relative path, got {relative!r}; the manifest is malformed or tampered")
    base = Path(root).resolve()
    path = (base / relative).resolve()
    if not path.is_relative_to(base):
        raise PitError(f"{what} {relative!r} points outside {root}; the artifact was tampered with "
                       "(paths in a manifest must stay inside its directory)")
    return path

"""The user's cache of work that is slow to redo: one folder per entry, each file's digest recorded.

Entries live under ``$PIT_DEPLOY_CACHE`` (``off`` disables the cache), else
``$XDG_CACHE_HOME/pit_deploy``, else ``~/.cache/pit_deploy``, in a subfolder per kind (``gguf/``:
converted GGUF files, :mod:`.gguf_files`; ``gptq/``: calibrated rounding codes,
:mod:`pit_deploy.exporters.gptq_cache`). An entry is a folder written atomically, with a record
(``meta_name``) of what it was built from and the SHA-256 of every file in it; an entry whose
record does not match what is asked, or whose files do not match their digests, is never used —
it is rebuilt. A cache that cannot be written is skipped with a warning: the work is done again,
nothing fails.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

from .fs import atomic_directory, sha256_file, write_json_atomic

log = logging.getLogger(__name__)

CACHE_ENV = "PIT_DEPLOY_CACHE"


def cache_root() -> Path | None:
    """Where cached entries are kept, or ``None`` when ``$PIT_DEPLOY_CACHE`` is ``off``."""
    value = os.environ.get(CACHE_ENV)
    if value:
        return None if value.lower() == "off" else Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pit_deploy"


def entry_valid(folder: Path, meta_name: str, match: dict[str, Any]) -> bool:
    """The entry is complete, its record holds ``match``, and every file still has the digest
    recorded when it was written."""
    try:
        meta = json.loads((folder / meta_name).read_text())
        files = meta["files"]
        return all(meta.get(k) == v for k, v in match.items()) and bool(files) and all(
            sha256_file(folder / name) == digest for name, digest in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


class _BuiltMeanwhile(Exception):
    """Raised inside an entry's write when a concurrent process completed it first."""


def cached_folder(folder: Path, meta_name: str, record: dict[str, Any], match: dict[str, Any],
                  build: Callable[[Path], None], what: str) -> Path | None:
    """``folder`` (an entry under :func:`cache_root`) if it is valid for ``match``; else built by
    ``build(tmp)`` and recorded with ``record`` (which holds ``match``) and its files' digests.
    ``None`` when the entry cannot be written (a warning names ``what``: the caller does the work
    without the cache). An exception of ``build`` propagates and leaves no entry."""
    if folder.is_dir():
        if entry_valid(folder, meta_name, match):
            return folder
        log.warning("the cached %s in %s does not match its record; rebuilding it", what, folder)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(folder.parent, os.W_OK | os.X_OK):
            raise PermissionError(f"{folder.parent} is not writable")
        with atomic_directory(folder, force=True) as tmp:
            build(tmp)
            files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
            write_json_atomic(tmp / meta_name, {**record, "files": files})
            if entry_valid(folder, meta_name, match):
                # another process built the same entry meanwhile and may be reading it: keep that
                # one (replacing it would pull the files from under that reader)
                raise _BuiltMeanwhile
    except _BuiltMeanwhile:
        return folder
    except OSError as exc:
        log.warning("cannot write the cache under %s (%s); %s is not kept (set %s to a writable directory, "
                    "or to off)", folder.parent, exc, what, CACHE_ENV)
        return None
    return folder

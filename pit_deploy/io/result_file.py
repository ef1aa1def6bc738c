"""The one writer of result JSON for ``benchmarks/`` and ``studies/``: the folder, the format,
the message, and the provenance block that makes a result file re-runnable and comparable.

Every result written through :func:`write_result` carries ``provenance``:

* ``command``: how to run it again from the repository root (``python benchmarks/NAME.py ARGS``),
  and ``argv``, the same arguments as a list;
* ``code_version``: the repository's git commit and whether tracked files differed from it
  (``git_dirty``), or ``null`` for both outside a git checkout; the installed ``pit-deploy``
  package version either way;
* ``versions``: torch, transformers, onnx, onnxruntime, executorch, optimum, optimum-onnx,
  onnxruntime-genai (``null`` where not installed);
* ``timestamp`` (UTC, ISO 8601) and ``machine`` (platform, Python, CPU count).

Scripts import it as ``from pit_deploy.io.result_file import write_result``; the commit recorded
is the one of the git checkout that holds the running script, as it was when this module was
imported (the script's start): a benchmark runs for minutes to hours, and what its figures come
from is the code it started with, not a commit made while it ran.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any



def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _git(cwd: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def checkout_root(path: Path) -> Path | None:
    """The top folder of the git checkout that holds ``path`` (``None`` outside one)."""
    top = _git(path if path.is_dir() else path.parent, "rev-parse", "--show-toplevel")
    return Path(top.strip()) if top else None


def code_version(root: Path | None) -> dict[str, Any]:
    """The git commit of the checkout at ``root`` and whether tracked files differ from it (both
    ``None`` outside a git checkout), and the installed ``pit-deploy`` version."""
    commit = _git(root, "rev-parse", "HEAD") if root is not None else None
    status = _git(root, "status", "--porcelain", "--untracked-files=no") if commit else None
    return {"git_commit": commit.strip() if commit else None,
            "git_dirty": bool(status.strip()) if status is not None else None,
            "pit_deploy": _installed("pit-deploy")}


def library_versions() -> dict[str, str | None]:
    """The project's own record of the libraries that shape an artifact, plus onnxruntime-genai."""
    from pit_deploy.io.manifest import library_versions as shaping_libraries

    return {**shaping_libraries(), "onnxruntime-genai": _installed("onnxruntime-genai")}


def _checkout_at_start() -> tuple[Path, dict[str, Any]] | None:
    """``(checkout root, code_version)`` of the running script (``sys.argv[0]``) now; ``None``
    when it is no file in a git checkout (an interpreter prompt, ``python -c``)."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c", "-m") else None
    if script is None or not script.is_file():
        return None
    root = checkout_root(script.resolve())
    return (root, code_version(root)) if root is not None else None


#: the running script's checkout as it was when the script imported this module
_AT_START = _checkout_at_start()


def provenance(script: str | Path, argv: list[str] | None = None) -> dict[str, Any]:
    """What ran, from which code, with which libraries, when and where. ``script`` is the
    running script's ``__file__``; ``argv`` its arguments (``sys.argv[1:]`` when ``None``)."""
    args = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    path = Path(script).resolve()
    root = checkout_root(path)
    shown = path.relative_to(root).as_posix() if root is not None and path.is_relative_to(root) else str(path)
    return {
        "command": shlex.join(["python", shown, *args]),
        "argv": args,
        "code_version": _AT_START[1] if _AT_START is not None and _AT_START[0] == root else code_version(root),
        "versions": library_versions(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count()},
    }


def write_result(out: str | Path, result: dict[str, Any], script: str | Path, argv: list[str] | None = None) -> int:
    """Write ``result`` with its ``provenance`` (see :func:`provenance`) as indented JSON to
    ``out``, creating its folder; say where; return 0."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**result, "provenance": provenance(script, argv)}
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0

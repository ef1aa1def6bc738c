"""Stage records of a run directory: what each stage was given, what it produced, whether it
finished — so that a rerun skips what is up to date and an interrupted run resumes.

Layout of a run directory::

    run.json            the recipe name and its settings (a run belongs to one recipe)
    1-convert/ ... 6-report/
        stage.json      settings, input digests, status, outputs, output digests, wall time
    report.md, report.html

``stage.json`` says ``running`` while its stage runs and ``done``, ``skipped`` (disabled) or
``failed`` when it ends. A stage is *up to date* when its record says ``done`` (or ``skipped``),
records the same settings and input digests as the run would give it now, and its outputs are
still the files it produced: every product file's size, mtime and sha256 are recorded when the
stage finishes, and a rerun re-checks them (the sha256 only when size or mtime moved), so a
deleted or replaced artifact is redone, never reported as verified. Inputs are digests of files
(sha256), so a changed source model or a retrained checkpoint reruns everything downstream.

Paths in a record are relative to the run directory, so a copied or moved run directory works
on its own and never reads or writes the original's files.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

from ..errors import PitError
from ..io.fs import sha256_file, write_json_atomic
from .recipe import STAGES

RECORD_NAME = "stage.json"
STATUSES = ("running", "done", "failed", "skipped")
#: Keys of a stage's outputs whose values are paths in the run directory (a string or a list of
#: strings), at the top level or in one training job of ``runs``.
PATH_KEYS = ("model", "dir", "exports", "json", "png", "report", "html", "answers")
#: The path keys that name what a stage produced, digested when it finishes and re-checked on
#: every rerun. A training job's directory (``dir``: checkpoints, logs) is not among them:
#: deleting checkpoints to save space must not retrain a finished model.
PRODUCT_KEYS = tuple(k for k in PATH_KEYS if k != "dir")
#: Files that a later stage amends in place, and the keys it writes: verify records its results
#: in each export's ``manifest.json``. Their digest leaves those keys out.
AMENDED_KEYS: dict[str, tuple[str, ...]] = {"manifest.json": ("verification",)}


def stage_dir(run: Path, stage: str) -> Path:
    return run / f"{STAGES.index(stage) + 1}-{stage}"


def digest_path(path: str | Path) -> str:
    """sha256 of a file, or of a directory's sorted ``(relative path, sha256)`` list.

    Names starting with ``.`` are left out (temporary and partial files)."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    if not path.is_dir():
        return f"missing:{path.name}"
    h = hashlib.sha256()
    for f in _files_under(path):
        h.update(f.relative_to(path).as_posix().encode() + b"\0" + sha256_file(f).encode() + b"\n")
    return h.hexdigest()


def _files_under(path: Path) -> list[Path]:
    """The files of a directory, sorted, without dot-names (temporary and partial files)."""
    return sorted(f for f in path.rglob("*") if f.is_file()
                  and not any(part.startswith(".") for part in f.relative_to(path).parts))


# --------------------------------------------------------------------------------------
# Paths in outputs: relative in the record, absolute in the running pipeline
# --------------------------------------------------------------------------------------


def relative_outputs(value: Any, run: Path) -> Any:
    """``value`` with every absolute path inside ``run`` (anywhere in it) made relative to
    ``run``: what a record stores."""
    if isinstance(value, dict):
        return {k: relative_outputs(v, run) for k, v in value.items()}
    if isinstance(value, list):
        return [relative_outputs(v, run) for v in value]
    if isinstance(value, str) and os.path.isabs(value) and Path(value).is_relative_to(run):
        return Path(value).relative_to(run).as_posix() or "."
    return value


def _path_slots(outputs: dict[str, Any], keys: tuple[str, ...] = PATH_KEYS) -> Iterator[tuple[dict[str, Any], str]]:
    """``(container, key)`` of every path value of ``outputs``: its own ``keys`` and those of
    each training job in ``runs``."""
    runs = outputs.get("runs")
    jobs = [v for v in runs.values() if isinstance(v, dict)] if isinstance(runs, dict) else []
    for container in (outputs, *jobs):
        for key in keys:
            if isinstance(container.get(key), (str, list)):
                yield container, key


def _paths_in(container: dict[str, Any], key: str) -> list[str]:
    value = container[key]
    return [value] if isinstance(value, str) else [v for v in value if isinstance(v, str)]


def resolved_outputs(outputs: dict[str, Any], run: Path) -> dict[str, Any]:
    """A copy of recorded ``outputs`` with its paths absolute under ``run`` (what the stages
    and the report read). An absolute path (a record of an older pit-deploy) stays as it is."""
    resolved = copy.deepcopy(outputs)
    for container, key in _path_slots(resolved):
        value = container[key]
        container[key] = str(run / value) if isinstance(value, str) else [
            str(run / v) if isinstance(v, str) else v for v in value]
    return resolved


# --------------------------------------------------------------------------------------
# Output digests
# --------------------------------------------------------------------------------------


def _content_digest(path: Path) -> str:
    """sha256 of a file, or — for a file a later stage amends — of its JSON without the
    amended keys (an unreadable one digests as its bytes, so it differs)."""
    amended = AMENDED_KEYS.get(path.name)
    if amended:
        try:
            data = json.loads(path.read_bytes())
        except ValueError:
            data = None
        if isinstance(data, dict):
            kept = {k: v for k, v in data.items() if k not in amended}
            return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()
    return sha256_file(path)


def _file_entry(path: Path) -> dict[str, Any]:
    """What is recorded of one product file: size, mtime (a cheap unchanged-check) and sha256.
    A file a later stage amends has only its digest (its size and mtime move legitimately)."""
    if path.name in AMENDED_KEYS:
        return {"sha256": _content_digest(path)}
    st = path.stat()
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(path)}


def fingerprint(run: Path, outputs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{path relative to run: entry}`` of every file the product paths of recorded
    ``outputs`` name (a file, or every file of a directory)."""
    table: dict[str, dict[str, Any]] = {}
    for container, key in _path_slots(outputs, PRODUCT_KEYS):
        for rel in _paths_in(container, key):
            path = run / rel
            if not path.is_relative_to(run):
                continue
            for f in [path] if path.is_file() else _files_under(path) if path.is_dir() else []:
                table.setdefault(f.relative_to(run).as_posix(), _file_entry(f))
    return table


# --------------------------------------------------------------------------------------
# The record
# --------------------------------------------------------------------------------------

#: field → the JSON types it may hold (``None`` allowed where the default is ``None``)
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "stage": (str,), "settings": (dict,), "inputs": (dict,), "status": (str,), "outputs": (dict,),
    "seconds": (int, float), "error": (str, type(None)), "exit_code": (int,), "started_at": (str, type(None)),
    "finished_at": (str, type(None)), "files": (dict, type(None)),
}
_REQUIRED = ("stage", "settings", "inputs", "status")


@dataclass
class StageRecord:
    """The ``stage.json`` of one stage."""

    stage: str
    settings: dict[str, Any]
    inputs: dict[str, Any]
    status: str = "running"  # running | done | failed | skipped
    outputs: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None
    exit_code: int = 0
    started_at: str | None = None
    finished_at: str | None = None
    #: the product files and their digests when the stage finished (``None``: an older record)
    files: dict[str, dict[str, Any]] | None = None

    @classmethod
    def read(cls, folder: Path, stage: str | None = None) -> "StageRecord | None":
        """The record in ``folder``; ``None`` when there is none.

        Raises:
            PitError: the file is not a stage record (edited by hand, damaged): exit 2, naming
                it and what to do, before any stage runs.
        """
        path = folder / RECORD_NAME
        if not path.exists() and not path.is_symlink():
            return None
        stage = stage or folder.name.partition("-")[2]
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise _damaged(path, stage, "it is not JSON text") from None
        except IsADirectoryError:
            raise _damaged(path, stage, "it is a directory") from None
        problem = _schema_problem(data, stage)
        if problem:
            raise _damaged(path, stage, problem)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def write(self, folder: Path, stamp: bool = True) -> None:
        """Write ``stage.json`` atomically (``stamp``: with the time now as ``finished_at``,
        or ``started_at`` for a record of a stage that starts)."""
        folder.mkdir(parents=True, exist_ok=True)
        if stamp:
            now = time.strftime("%Y-%m-%dT%H:%M:%S")
            if self.status == "running":
                self.started_at = now
            else:
                self.finished_at = now
        write_json_atomic(folder / RECORD_NAME, jsonable(asdict(self)))

    def up_to_date(self, settings: dict[str, Any], inputs: dict[str, Any]) -> bool:
        return self.status in ("done", "skipped") and self.settings == jsonable(settings) and self.inputs == jsonable(inputs)

    def redo_reason(self, settings: dict[str, Any], inputs: dict[str, Any], run: Path) -> str | None:
        """Why the stage must run again, or ``None`` when it is up to date: interrupted, failed,
        other settings or inputs, or outputs that are gone, changed, or outside ``run``."""
        if self.status == "running":
            return "interrupted before it finished; resuming it"
        if self.status == "failed":
            return "failed before"
        if not self.up_to_date(settings, inputs):
            return "settings or inputs changed"
        return self.stale_outputs(run)

    def stale_outputs(self, run: Path) -> str | None:
        """Why the recorded outputs cannot be trusted in ``run``, or ``None``. A file whose size
        and mtime match its record is taken as unchanged; one whose mtime moved (a copied run
        directory) is re-hashed, and its new mtime kept in ``files`` (see :attr:`refreshed`)."""
        self.refreshed = False
        outside = [p for c, k in _path_slots(self.outputs) for p in _paths_in(c, k)
                   if not (run / p).absolute().is_relative_to(run)]
        outside += [p for p in self.files or {} if not (run / p).absolute().is_relative_to(run) or ".." in Path(p).parts]
        if outside:
            return (f"its record names {outside[0]}, outside this run directory (a record of a copied or moved run, "
                    "or of an older pit-deploy); running it here")
        if self.files is None:
            return "its record has no digests of its outputs (written by an older pit-deploy)"
        problems = [f"{p} is missing" for c, k in _path_slots(self.outputs, PRODUCT_KEYS)
                    for p in _paths_in(c, k) if not (run / p).exists()]
        for rel, entry in self.files.items():
            path = run / rel
            if not path.is_file():
                problems.append(f"{rel} is missing")
                continue
            st = path.stat()
            if "bytes" in entry and st.st_size == entry["bytes"] and st.st_mtime_ns == entry.get("mtime_ns"):
                continue
            if ("bytes" in entry and st.st_size != entry["bytes"]) or _content_digest(path) != entry.get("sha256"):
                problems.append(f"{rel} was changed")
            elif "bytes" in entry:
                entry["mtime_ns"], self.refreshed = st.st_mtime_ns, True
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            return f"its outputs changed since it finished: {problems[0]}{more}"
        return None

    #: set by :meth:`stale_outputs` when it re-hashed files whose mtime moved: write the record
    #: again so the next check is cheap (a class attribute, not a field: never in ``stage.json``)
    refreshed = False


def _schema_problem(data: Any, stage: str) -> str | None:
    """What makes ``data`` not a record of ``stage``, or ``None``."""
    if not isinstance(data, dict):
        return f"it holds a JSON {type(data).__name__}, not an object"
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        return f"it has no {', '.join(repr(k) for k in missing)}"
    for key, types in _FIELD_TYPES.items():
        if key in data and (not isinstance(data[key], types) or isinstance(data[key], bool)):
            return f"its {key!r} is {type(data[key]).__name__}, expected {' or '.join(t.__name__ for t in types)}"
    if data["stage"] != stage:
        return f"it is the record of stage {data['stage']!r}, not {stage!r}"
    if data["status"] not in STATUSES:
        return f"its status {data['status']!r} is not one of {', '.join(STATUSES)}"
    for rel, entry in (data.get("files") or {}).items():
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str) or not all(
                isinstance(entry.get(k, 0), int) and not isinstance(entry.get(k), bool) for k in ("bytes", "mtime_ns")):
            return f"its digest of {rel!r} is malformed"
    return None


def _damaged(path: Path, stage: str, problem: str) -> PitError:
    return PitError(f"{path} is not a stage record ({problem}); delete it to run the {stage} stage again, "
                    "or choose a new --out")


def jsonable(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists), for comparisons."""
    return json.loads(json.dumps(value, default=str))

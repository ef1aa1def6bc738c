"""Stage records of a run directory: what each stage was given, what it produced, whether it
finished — so that a rerun skips what is up to date and an interrupted run resumes.

Layout of a run directory::

    run.json            the recipe name and its settings (a run belongs to one recipe)
    1-convert/ ... 6-report/
        stage.json      settings, input digests, status, outputs, wall time (written last)
    report.md, report.html

A stage is *up to date* when its ``stage.json`` says ``done`` and records the same settings and
the same input digests as the run would give it now. Inputs are digests of files (sha256),
so a changed source model or a retrained checkpoint reruns everything downstream of it.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..io.fs import sha256_file, write_json_atomic
from .recipe import STAGES

RECORD_NAME = "stage.json"


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
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = f.relative_to(path)
        if any(part.startswith(".") for part in rel.parts):
            continue
        h.update(rel.as_posix().encode() + b"\0" + sha256_file(f).encode() + b"\n")
    return h.hexdigest()


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
    finished_at: str | None = None

    @classmethod
    def read(cls, folder: Path) -> "StageRecord | None":
        path = folder / RECORD_NAME
        if not path.is_file():
            return None
        try:
            return cls(**json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError):
            return None  # an unreadable record is treated as "not done"

    def write(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.finished_at = time.strftime("%Y-%m-%dT%H:%M:%S")
        write_json_atomic(folder / RECORD_NAME, _jsonable(asdict(self)))

    def up_to_date(self, settings: dict[str, Any], inputs: dict[str, Any]) -> bool:
        return self.status in ("done", "skipped") and self.settings == _jsonable(settings) and self.inputs == _jsonable(inputs)


def _jsonable(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists), for comparisons."""
    return json.loads(json.dumps(value, default=str))

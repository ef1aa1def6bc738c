"""``metrics.jsonl``: one JSON object per logged training step (``"kind": "train"``) or
evaluation (``"kind": "eval"``). The one writer and the one reader of that file (the training
loop, ``pit-deploy plot``, the run report and the benchmarks all read it through here)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from ..errors import PitError
from .fs import json_text, write_text_atomic

METRICS_NAME = "metrics.jsonl"


def read_metrics(run: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The records of run directory ``run`` (all, or those of ``kind``); ``[]`` when it has no
    metrics yet.

    Raises:
        PitError: a line that is not a JSON object (a damaged file; exit 2).
    """
    path = Path(run) / METRICS_NAME
    if not path.is_file():
        return []
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            raise PitError(f"{path}, line {number}, is not a JSON object; the file is damaged")
        records.append(record)
    return [r for r in records if kind is None or r.get("kind") == kind]


class MetricsLog:
    """Appends records to ``run/metrics.jsonl`` (and to TensorBoard when given a writer)."""

    def __init__(self, run: str | Path, enabled: bool = True, scalar_sink: Callable[[str, float, int], None] | None = None):
        self.path = Path(run) / METRICS_NAME
        self.enabled = enabled
        self.scalar_sink = scalar_sink

    def start(self) -> None:
        """An empty log for a new run."""
        if self.enabled:
            write_text_atomic(self.path, "")  # a link planted at the path is replaced, not followed

    def truncate_after(self, step: int) -> None:
        """Drop what was logged after ``step`` (a resumed run logs those steps again)."""
        if self.enabled:
            kept = [r for r in read_metrics(self.path.parent) if r["step"] <= step]
            write_text_atomic(self.path, "".join(json_text(r) + "\n" for r in kept))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        with os.fdopen(os.open(self.path, flags, 0o644), "a", encoding="utf-8") as fh:
            fh.write(json_text(record) + "\n")
        if self.scalar_sink is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.scalar_sink(f"{record['kind']}/{key}", value, record["step"])

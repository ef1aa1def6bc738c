"""Writing a benchmark's result JSON: one place for the folder, the format and the message."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_result(out: str | Path, result: dict[str, Any]) -> int:
    """Write ``result`` as indented JSON to ``out`` (creating its folder), say where, return 0."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0

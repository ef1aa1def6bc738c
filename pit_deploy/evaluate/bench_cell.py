"""One benchmark cell — one artifact, one thread count, one prompt length — in its own process,
so the peak resident memory it reports is that cell's alone.

``python -m pit_deploy.evaluate.bench_cell SPEC.json`` prints one JSON object: the measured row,
or ``{"error": ..., "exit_code": 2}`` for unusable input. The timing loop is
:func:`pit_deploy.runtime.standalone.time_generation`, the same one an edge bundle runs.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def run_cell(spec: dict[str, Any]) -> dict[str, Any]:
    """Load, warm up, measure through this package's driver; returns the row."""
    import torch

    from ..runtime.drivers import driver_class
    from ..runtime.standalone import measure_cell
    from ..targets import resolve

    # the cell names its target's driver: a target registered at run time is not known here
    cls = resolve(spec["driver"]) if spec.get("driver") else driver_class(spec["runtime"])
    return measure_cell(cls,
                        {**spec, "prompt_ids": torch.tensor(spec["prompt_ids"], dtype=torch.long)})


def main(argv: list[str] | None = None) -> int:
    from ..errors import PitError

    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0], encoding="utf-8") as fh:
        spec = json.load(fh)
    try:
        row = run_cell(spec)
    except PitError as exc:
        print(json.dumps({"error": str(exc), "exit_code": 2}))
        return 2
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())

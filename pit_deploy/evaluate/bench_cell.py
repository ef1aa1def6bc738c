"""One benchmark cell — one artifact, one thread count, one prompt length — in its own process,
so the peak resident memory it reports is that cell's alone.

``python -m pit_deploy.evaluate.bench_cell SPEC.json`` prints one JSON object: the measured row,
or ``{"error": ..., "exit_code": 2}`` for unusable input. The timing loop is
:func:`pit_deploy.runtime.standalone.time_generation`, the same one an edge bundle runs.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def run_cell(spec: dict[str, Any]) -> dict[str, Any]:
    """Load, warm up, measure; returns the row (see :mod:`pit_deploy.evaluate.bench`)."""
    import torch

    from ..runtime.base import driver_class
    from ..runtime.standalone import peak_rss_mb, time_generation

    baseline_rss = peak_rss_mb()
    t0 = time.perf_counter()
    driver = driver_class(spec["runtime"])(spec["folder"], threads=spec["threads"])
    load_s = time.perf_counter() - t0
    row = time_generation(driver, torch.tensor(spec["prompt_ids"], dtype=torch.long), int(spec["gen_len"]),
                          int(spec["reps"]))
    driver.close()
    row.update(load_s=load_s, peak_rss_mb=peak_rss_mb(), baseline_rss_mb=baseline_rss)
    return row


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

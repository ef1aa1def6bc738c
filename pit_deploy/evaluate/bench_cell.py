"""One benchmark cell — one artifact, one thread count, one prompt length — in its own process,
so the peak resident memory it reports is that cell's alone.

``python -m pit_deploy.evaluate.bench_cell SPEC.json`` prints one JSON object: the measured row,
or ``{"error": ..., "exit_code": 2}`` for unusable input. Timings exclude tokenization and
sampling (ids in, argmax out); one warm-up pass, then ``reps`` measured passes
(``docs/conventions.md``, "Benchmark conventions").
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def run_cell(spec: dict[str, Any]) -> dict[str, Any]:
    """Load, warm up, measure; returns the row (see :mod:`pit_deploy.evaluate.bench`)."""
    import torch

    from ..runtime.base import driver_class
    from .sysload import measure_load, peak_rss_mb

    baseline_rss = peak_rss_mb()
    ids = torch.tensor(spec["prompt_ids"], dtype=torch.long)
    gen_len = int(spec["gen_len"])
    t0 = time.perf_counter()
    driver = driver_class(spec["runtime"])(spec["folder"], threads=spec["threads"])
    load_s = time.perf_counter() - t0

    def one_pass() -> tuple[float, list[float], list[int]]:
        start = time.perf_counter()
        logits = driver.prefill(ids)
        token = int(logits[-1].argmax())
        ttft = time.perf_counter() - start
        tokens, step_s, pos = [token], [], len(ids)
        for _ in range(gen_len - 1):
            start = time.perf_counter()
            logits = driver.step(token, pos)
            token = int(logits.argmax())
            step_s.append(time.perf_counter() - start)
            tokens.append(token)
            pos += 1
        return ttft, step_s, tokens

    one_pass()  # warm-up
    ttfts: list[float] = []
    steps: list[float] = []
    decode_rates: list[float] = []
    tokens: list[int] = []
    with measure_load() as window:
        for _ in range(int(spec["reps"])):
            ttft, step_s, tokens = one_pass()
            ttfts.append(ttft)
            steps += step_s
            if step_s:
                decode_rates.append(len(step_s) / sum(step_s))
    driver.close()
    prefill_rates = [len(ids) / t for t in ttfts]
    pp, pp_std = _mean_std(prefill_rates)
    tg, tg_std = _mean_std(decode_rates)
    return {
        "prefill_tok_s": pp, "prefill_tok_s_std": pp_std,
        "decode_tok_s": tg, "decode_tok_s_std": tg_std,
        "ttft_ms": statistics.fmean(ttfts) * 1e3,
        "decode_ms_p50": _percentile(steps, 0.5) * 1e3, "decode_ms_p90": _percentile(steps, 0.9) * 1e3,
        "load_s": load_s, "peak_rss_mb": peak_rss_mb(), "baseline_rss_mb": baseline_rss,
        "tokens": tokens,
        "wall_s": window.wall_s, "process_cpu_s": window.process_cpu_s,
        "machine_busy_s": window.machine_busy_s, "foreign_load_cores": window.foreign_cores,
    }


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

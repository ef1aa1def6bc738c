"""How long ``verify``'s held-out KL takes per position, by vocabulary and by the number of float64
values worked on at a time (``pit_deploy.data.heldout.KL_ELEMENTS``).

Why: the KL, top-1 and perplexity figures of every quantized artifact are computed on the
runtime's and the reference's logits a few positions at a time, in float64. The work is a few
passes over each chunk (two log-softmaxes, the fused KL, two argmaxes), so its speed is set by how
the chunk sits in the caches, not by the arithmetic: this measures the chunk size that is fastest
at the vocabularies people deploy (49,152 for SmolLM2, 70,000 past 16-bit ids, 262,144 for
Gemma 3).

Synthetic logits (a standard normal times 3, and the same plus noise for the runtime), one
sequence of ``--positions`` rows per vocabulary; each size timed ``--rounds`` times in
interleaved order, the median kept; the figures are checked to be the same at every size.

Usage::

    python benchmarks/kl_chunk_size.py [--vocab 49152,70000,262144] [--elements 2^17,...]
        [--positions 128] [--rounds 5] [--out benchmarks/results/kl_chunk_size.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pit_deploy.io.result_file import write_result  # noqa: E402


def _ints(text: str) -> list[int]:
    """``"2^19,70000"`` -> ``[524288, 70000]``."""
    out = []
    for part in text.split(","):
        base, _, power = part.strip().partition("^")
        out.append(int(base) ** int(power) if power else int(base))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", default="49152,70000,262144")
    parser.add_argument("--elements", default="2^17,2^18,2^19,2^20,2^21")
    parser.add_argument("--positions", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kl_chunk_size.json"))
    args = parser.parse_args(argv)

    import torch

    from pit_deploy.data import heldout

    torch.set_num_threads(args.threads)
    sizes = _ints(args.elements)
    default = heldout.KL_ELEMENTS
    rows = []
    try:
        for vocab in _ints(args.vocab):
            gen = torch.Generator().manual_seed(0)
            ref = 3 * torch.randn(args.positions, vocab, generator=gen)
            got = ref + 0.05 * torch.randn(args.positions, vocab, generator=gen)
            ids = torch.randint(0, vocab, (args.positions,), generator=gen)
            seconds: dict[int, list[float]] = {size: [] for size in sizes}
            figures = {}
            for _ in range(args.rounds):
                for size in sizes:
                    heldout.KL_ELEMENTS = size
                    start = time.perf_counter()
                    figures[size] = heldout.kl_figures([(ids, ref, got)])
                    seconds[size].append(time.perf_counter() - start)
            first = figures[sizes[0]]
            for size in sizes:
                heldout.KL_ELEMENTS = size
                median = statistics.median(seconds[size])
                same = (abs(figures[size].kl_mean - first.kl_mean) <= 1e-12 * first.kl_mean
                        and figures[size].same_top1 == first.same_top1)
                rows.append({"vocab": vocab, "kl_elements": size, "positions_per_chunk": heldout.kl_rows(vocab),
                             "median_s": round(median, 4), "us_per_position": round(1e6 * median / args.positions, 1),
                             "seconds": [round(s, 4) for s in seconds[size]], "kl_mean": figures[size].kl_mean,
                             "same_figures": same})
                print(f"V={vocab:>7} elements={size:>8}: {median:.3f} s for {args.positions} positions")
    finally:
        heldout.KL_ELEMENTS = default
    fastest = {}
    for row in rows:
        best = fastest.get(row["vocab"])
        if best is None or row["median_s"] < best["median_s"]:
            fastest[row["vocab"]] = row
    result = {"rows": rows, "default_kl_elements": default, "threads": args.threads,
              "fastest": {str(v): r["kl_elements"] for v, r in fastest.items()}}
    return write_result(args.out, result, __file__, argv)


if __name__ == "__main__":
    sys.exit(main())

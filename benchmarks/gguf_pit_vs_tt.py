"""PIT against the transpose-tied baseline in llama.cpp: decode and prefill time of the GGUF
files of one scheme, interleaved so that a machine whose load drifts (a shared CI box) weighs on
both sides alike.

Why not ``pit-deploy bench`` alone: it runs one cell after another, each in its own process, so a
foreign job that starts between the PIT cell and the TT cell moves the ratio by more than the 1 %
this comparison is about. Here both files of a scheme are loaded in one process
(:class:`~pit_deploy.targets.gguf.decoder.LlamaCppDecoder`, the code ``bench`` and bundles
time), and each round times PIT then TT, or TT then PIT (alternating), one greedy generation each
(:func:`~pit_deploy.runtime.standalone.time_generation`: a warm-up, then ``--gen-len`` tokens after
the same ``--prompt-len`` prompt ids as ``pit-deploy bench``). The ratio is the median over rounds of the per-round
ratios of decode ms/token (and of prefill time).

Usage::

    pit-deploy export PIT_MODEL --out EXPORT --runtime gguf --mode materialized --dtype float32,q8_0,q4_0,q4_k_m
    pit-deploy export default --keep-tying --out TT_EXPORT --runtime gguf --dtype float32,q8_0,q4_0,q4_k_m
    python benchmarks/gguf_pit_vs_tt.py --pit EXPORT --tt TT_EXPORT [--schemes float32,q4_0] [--threads 2]
        [--rounds 7] [--prompt-len 64] [--gen-len 64] [--out benchmarks/results/gguf_pit_vs_tt.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from pit_deploy.io.result_file import write_result  # noqa: E402

from transformers import AutoTokenizer  # noqa: E402

from pit_deploy.evaluate.bench import prompt_ids  # noqa: E402
from pit_deploy.io.manifest import Manifest  # noqa: E402
from pit_deploy.targets.gguf.decoder import LlamaCppDecoder  # noqa: E402
from pit_deploy.runtime.standalone import time_generation  # noqa: E402


def gguf_files(directory: Path) -> dict[str, Path]:
    """scheme → GGUF file of a gguf export directory."""
    return {a.scheme_name: directory / a.path / a.details["file"] for a in Manifest.read(directory).artifacts
            if a.runtime == "gguf"}


def compare(pit: Path, tt: Path, ids: list[int], threads: int, rounds: int, gen_len: int) -> dict[str, Any]:
    """Interleaved rounds of one PIT file and one TT file (module docstring)."""
    decoders = {"pit": LlamaCppDecoder(pit, threads), "tt": LlamaCppDecoder(tt, threads)}
    per_round = []
    for r in range(rounds):
        order = ("pit", "tt") if r % 2 == 0 else ("tt", "pit")
        row = {}
        for side in order:
            timing = time_generation(decoders[side], ids, gen_len, reps=1)
            row[side] = {"decode_ms": timing["decode_ms_p50"], "ttft_ms": timing["ttft_ms"],
                         "tokens": timing["tokens"], "foreign_load_cores": timing["foreign_load_cores"]}
        per_round.append(row)
    for d in decoders.values():
        d.close()
    same = all(r["pit"]["tokens"] == r["tt"]["tokens"] for r in per_round)
    return {
        "decode_ms": {s: statistics.median(r[s]["decode_ms"] for r in per_round) for s in ("pit", "tt")},
        "ttft_ms": {s: statistics.median(r[s]["ttft_ms"] for r in per_round) for s in ("pit", "tt")},
        "decode_ratio": statistics.median(r["pit"]["decode_ms"] / r["tt"]["decode_ms"] for r in per_round),
        "prefill_ratio": statistics.median(r["pit"]["ttft_ms"] / r["tt"]["ttft_ms"] for r in per_round),
        "same_tokens_as_tt": same,
        "rounds": [{s: {k: v for k, v in r[s].items() if k != "tokens"} for s in r} for r in per_round],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pit", required=True)
    parser.add_argument("--tt", required=True)
    parser.add_argument("--schemes", default="float32,q8_0,q4_0,q4_k_m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/gguf_pit_vs_tt.json")
    args = parser.parse_args(argv)
    pit_dir, tt_dir = Path(args.pit), Path(args.tt)
    pit, tt = gguf_files(pit_dir), gguf_files(tt_dir)
    manifest = Manifest.read(pit_dir)
    tokenizer = AutoTokenizer.from_pretrained(pit_dir / manifest.reference["path"])
    ids = prompt_ids(tokenizer, len(tokenizer), args.prompt_len)  # the ids `pit-deploy bench` times
    result: dict[str, Any] = {"threads": args.threads, "rounds": args.rounds, "prompt_len": len(ids),
                              "gen_len": args.gen_len, "schemes": {}}
    for scheme in args.schemes.split(","):
        if scheme not in pit or scheme not in tt:
            print(f"skipping {scheme}: not in both exports", file=sys.stderr)
            continue
        figures = compare(pit[scheme], tt[scheme], ids, args.threads, args.rounds, args.gen_len)
        print(f"{scheme}: decode {figures['decode_ms']['pit']:.2f} / {figures['decode_ms']['tt']:.2f} ms/token, "
              f"PIT/TT {figures['decode_ratio']:.3f}; prefill PIT/TT {figures['prefill_ratio']:.3f}")
        result["schemes"][scheme] = figures
    return write_result(args.out, result, __file__, argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""Which ONNX artifact ships: the ``onnx`` target (optimum's decoder) against the ``onnx-genai``
target (the onnxruntime-genai builder's fused decoder) on the same PIT model, side by side.

Why: both targets run on onnxruntime and both are verified against PyTorch; the default run ships
one of them (``pit_deploy/recipes/run/default.toml``), and this is the measurement that chooses.
The builder's own int4 build of the *source* model, timed by onnxruntime-genai's generator, is
``benchmarks/genai_side_by_side.py``; here both targets' artifacts go through the same harness,
``pit-deploy bench`` (one process per cell, our standalone decoder on the folder's graph).

Runs the project's own commands in one go:

1. ``pit-deploy export MODEL --runtime onnx,onnx-genai --mode factorized --dtype SCHEMES``
   (skipped with ``--reuse`` when the export directory exists);
2. ``pit-deploy verify`` of it;
3. ``pit-deploy bench`` of it at ``--threads``;

then writes ``benchmarks/results/onnx_targets.json``: the bench rows, the verify results, and
per scheme and thread count the decode and prefill ratio ``onnx-genai / onnx`` (tokens per
second; above 1: the genai folder is faster), peak RSS and size.

Usage::

    python benchmarks/onnx_targets.py [--model default] [--work bench_work/onnx_targets]
        [--dtype float32,int4,int4-compact] [--threads 1,2] [--prompt-len 64] [--gen-len 64]
        [--reps 3] [--reuse] [--out benchmarks/results/onnx_targets.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench_default import pit_deploy
from pit_deploy.io.result_file import write_result

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("onnx", "onnx-genai")


def ratios(rows: list[dict]) -> list[dict]:
    """``onnx-genai`` over ``onnx`` for each scheme and thread count measured on both."""
    out = []
    by_key = {(r["runtime"], r.get("scheme") or r["dtype"], r["threads"]): r for r in rows}
    for (runtime, scheme, threads), genai in sorted(by_key.items()):
        base = by_key.get(("onnx", scheme, threads))
        if runtime != "onnx-genai" or base is None:
            continue
        out.append({"scheme": scheme, "threads": threads,
                    "decode_tok_s": {"onnx": base["decode_tok_s"], "onnx-genai": genai["decode_tok_s"],
                                     "genai_over_onnx": round(genai["decode_tok_s"] / base["decode_tok_s"], 3)},
                    "prefill_tok_s": {"onnx": base["prefill_tok_s"], "onnx-genai": genai["prefill_tok_s"],
                                      "genai_over_onnx": round(genai["prefill_tok_s"] / base["prefill_tok_s"], 3)},
                    "peak_rss_mb": {"onnx": base["peak_rss_mb"], "onnx-genai": genai["peak_rss_mb"]},
                    "size_mb": {"onnx": base["size_mb"], "onnx-genai": genai["size_mb"]}})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="anything `pit-deploy export` takes")
    parser.add_argument("--work", default="bench_work/onnx_targets", help="the export directory goes here")
    parser.add_argument("--dtype", default="float32,int4,int4-compact")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--prompt-len", default="64")
    parser.add_argument("--gen-len", default="64")
    parser.add_argument("--reps", default="3")
    parser.add_argument("--reuse", action="store_true", help="keep an export directory that already exists")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "onnx_targets.json"))
    args = parser.parse_args(argv)

    export = Path(args.work) / "export"
    if not (args.reuse and (export / "manifest.json").is_file()):
        pit_deploy("export", args.model, "--out", str(export), "--runtime", ",".join(TARGETS),
                   "--mode", "factorized", "--dtype", args.dtype, "--force")
    proc = pit_deploy("verify", str(export), "--json", check=False)
    verify = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {"error": proc.stderr[-2000:]}
    bench_json = Path(args.work) / "bench.json"
    pit_deploy("bench", str(export), "--threads", args.threads, "--prompt-len", args.prompt_len,
               "--gen-len", args.gen_len, "--reps", args.reps, "--out", str(bench_json))
    bench = json.loads(bench_json.read_text())
    verdicts = [{"runtime": a["runtime"], "scheme": a.get("scheme") or a["dtype"], "passed": a["passed"],
                 **{k: a.get(k) for k in ("logits_rel_l2", "kl_mean", "kl_p99", "same_top1", "ppl_ratio", "delta_ti")}}
                for a in verify.get("artifacts", [])]
    result = {"question": "which ONNX artifact decodes faster on onnxruntime: the onnx target or onnx-genai",
              "model": args.model, "threads": args.threads, "prompt_len": int(args.prompt_len),
              "gen_len": int(args.gen_len), "reps": int(args.reps), "ratios": ratios(bench["rows"]),
              "verify": verdicts, "rows": bench["rows"], "machine": bench.get("machine")}
    write_result(Path(args.out), result, __file__, sys.argv[1:] if argv is None else argv)
    for r in result["ratios"]:
        print(f"{r['scheme']:>14} {r['threads']} thread(s): decode genai/onnx {r['decode_tok_s']['genai_over_onnx']}×, "
              f"prefill {r['prefill_tok_s']['genai_over_onnx']}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

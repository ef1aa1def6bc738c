"""Quantized exports of the default model: parity (KL figures, delta_ti) and bench rows.

Why: what a quantized artifact costs in fidelity and buys in speed and size, measured side by side
with its fp32 twin in one run — the figures ``docs/quantization.md`` reports and the int8/int4
bounds of ``verify`` were set from. Re-run it after a change to the quantizers or the runtimes.

For the default model (SmolLM2-135M-Instruct, or ``--model``) this script runs the project's
own commands:

1. ``pit-deploy export MODEL --dtype float32,int8,int4`` (PIT, both modes) — ``pit/``;
2. the same for factorized without the PIT correction (``--no-pit-correction``) — ``uncorrected/``;
3. ``pit-deploy export MODEL --keep-tying --dtype float32,int8,int4`` (the TT baseline) — ``tied/``;
   with ``--baselines all4`` also factorized int4 with every body linear at 4 bits (a recipe with
   ``int4_8bit_layers = []``) — ``all4/``; with ``--baselines compact`` the shipped ``int4-compact``
   recipe (ONNX: 4-bit token table stored once, only ``v_proj`` at 8 bits) — ``compact/``; with
   ``--baselines f32head`` the factorized quantized exports with ``--head-activations float32``
   (the ONNX head on float32 activations instead of the schemes' int8 ones) — ``f32head/``;
4. ``pit-deploy verify`` of each (KL figures for quantized artifacts, logit bounds for fp32);
5. ``pit-deploy bench`` of every artifact, all in one run (side by side, same prompt);
6. with ``--pte-head-bits 8,4``: factorized ExecuTorch exports whose head is quantized behind a
   rotation (``--pte-head-bits``), one export directory each (``head8/``, ``head4/``), verified
   and benched beside the others; their ratios are taken against ``pit/``'s fp32 program;

and writes ``benchmarks/results/quantization.json``: the verify rows, the bench rows, and per
runtime and mode the decode speed-up and size of each quantized artifact over its fp32 twin.

Usage::

    python benchmarks/quantization.py [--model default] [--runtime onnx] [--work DIR]
        [--mode materialized,factorized] [--dtype float32,int8,int4] [--baselines uncorrected,tied]
        [--threads 2] [--prompt-len 64] [--gen-len 64] [--reps 3]

``--model`` takes anything ``pit-deploy export`` takes (a local checkpoint directory too).
``--mode``, ``--dtype`` and ``--baselines`` narrow the run where lowering is slow (an ExecuTorch
program of the default model takes minutes to lower on a laptop CPU), e.g. the ExecuTorch
figures of ``docs/quantization.md``::

    python benchmarks/quantization.py --runtime executorch --mode factorized --dtype float32,int4 \
        --baselines none --threads 1,2 --out benchmarks/results/quantization_executorch.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from pit_deploy.io.result_file import write_result

ROOT = Path(__file__).resolve().parents[1]
DTYPES = "float32,int8,int4"


def pit_deploy(*args: str) -> subprocess.CompletedProcess:
    """Run ``pit-deploy`` (this interpreter's) and return the finished process."""
    cmd = [sys.executable, "-m", "pit_deploy.cli", *args]
    print("$ pit-deploy " + " ".join(args), flush=True)
    return subprocess.run(cmd, text=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--runtime", default="onnx", help="comma list of runtimes to export")
    parser.add_argument("--work", default="bench_work/quantization", help="export directories go here")
    parser.add_argument("--mode", default="materialized,factorized", help="comma list of PIT export modes")
    parser.add_argument("--dtype", default=DTYPES, help="comma list of dtypes (float32 is the twin of the ratios)")
    parser.add_argument("--baselines", default="uncorrected,tied",
                        help="comma list of extra exports: uncorrected (factorized without the PIT correction), "
                             "tied (the transpose-tied source), all4 (factorized int4 without 8-bit layers), "
                             "compact (the int4-compact recipe); 'none' for neither")
    parser.add_argument("--pte-head-bits", default="",
                        help="comma list of 4, 8: extra factorized .pte exports with a rotated quantized head")
    parser.add_argument("--table-bits", default="", help="passed to every export (4 or 8; default: the recipe's)")
    parser.add_argument("--max-seq-len", default="256")
    parser.add_argument("--threads", default="2")
    parser.add_argument("--prompt-len", default="64")
    parser.add_argument("--gen-len", default="64")
    parser.add_argument("--reps", default="3")
    parser.add_argument("--reuse", action="store_true", help="keep export directories that already exist")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/quantization.json"))
    args = parser.parse_args(argv)

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    common = ["--runtime", args.runtime, "--max-seq-len", args.max_seq_len, "--force"]
    if args.table_bits:
        common += ["--table-bits", args.table_bits]
    quantized = ",".join(d for d in args.dtype.split(",") if d != "float32")
    exports = {
        "pit": ["export", args.model, "--out", str(work / "pit"), "--mode", args.mode, "--dtype", args.dtype, *common],
        "uncorrected": ["export", args.model, "--out", str(work / "uncorrected"), "--mode", "factorized",
                        "--dtype", quantized, "--no-pit-correction", *common],
        "tied": ["export", args.model, "--out", str(work / "tied"), "--keep-tying", "--dtype", args.dtype, *common],
        "all4": ["export", args.model, "--out", str(work / "all4"), "--mode", "factorized", "--dtype", "int4",
                 "--recipe", str(work / "all4.toml"), *common],
        "compact": ["export", args.model, "--out", str(work / "compact"), "--recipe", "int4-compact", *common],
        "f32head": ["export", args.model, "--out", str(work / "f32head"), "--mode", "factorized",
                    "--dtype", quantized, "--head-activations", "float32", *common],
    }
    for bits in (b for b in args.pte_head_bits.split(",") if b):
        exports[f"head{bits}"] = ["export", args.model, "--out", str(work / f"head{bits}"), "--mode", "factorized",
                                  "--dtype", quantized, "--pte-head-bits", bits, *common]
    wanted = {b for b in args.baselines.split(",") if b and b != "none"}
    unknown = wanted - {"uncorrected", "tied", "all4", "compact", "f32head"}
    if unknown:
        parser.error(f"--baselines: unknown {sorted(unknown)}; choose from uncorrected, tied, all4, compact, "
                     "f32head, none")
    if "all4" in wanted:
        (work / "all4.toml").write_text("int4_8bit_layers = []\n")
    if "factorized" not in args.mode.split(",") or not quantized:
        wanted -= {"uncorrected", "f32head"}
    exports = {k: v for k, v in exports.items() if k == "pit" or k.startswith("head") or k in wanted}
    timings, verify = {}, {}
    for name, cmd in exports.items():
        if args.reuse and (work / name / "manifest.json").is_file():
            continue
        start = time.perf_counter()
        done = pit_deploy(*cmd)
        timings[name] = round(time.perf_counter() - start, 1)
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
            return done.returncode
    for name in exports:
        done = pit_deploy("verify", str(work / name), "--json")
        print(done.stderr[-400:], file=sys.stderr)
        verify[name] = {"exit_code": done.returncode, **json.loads(done.stdout)}
        print(_table(verify[name]), flush=True)
    out_json = work / "bench.json"
    done = pit_deploy("bench", *(str(work / n) for n in exports), "--threads", args.threads,
                      "--prompt-len", args.prompt_len, "--gen-len", args.gen_len, "--reps", args.reps,
                      "--out", str(out_json))
    print(done.stdout[-6000:], flush=True)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return done.returncode
    bench = json.loads(out_json.read_text())
    result = {
        "model": args.model,
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        "commands": {k: "pit-deploy " + " ".join(v) for k, v in exports.items()},
        "export_seconds": timings,
        "verify": {k: [_verify_row(a) for a in v["artifacts"]] for k, v in verify.items()},
        "verify_passed": {k: v["passed"] for k, v in verify.items()},
        "bench_rows": bench["rows"],
        "ratios": ratios(bench["rows"]),
        "bench_warnings": bench.get("warnings", []),
    }
    print(json.dumps(result["ratios"], indent=1))
    return write_result(args.out, result, __file__, argv)


def _verify_row(a: dict) -> dict:
    keys = ("runtime", "mode", "dtype", "tying", "passed", "logits_rel_l2", "top1_agreement", "kl_mean", "kl_p99",
            "same_top1", "ppl_ratio", "delta_ti", "pit_correction", "failures")
    return {k: a.get(k) for k in keys}


def _table(report: dict) -> str:
    lines = []
    for a in report["artifacts"]:
        lines.append(f"  {a['runtime']}-{a['mode']}-{a['dtype']}: kl_mean={a.get('kl_mean')} kl_p99={a.get('kl_p99')} "
                     f"same_top1={a.get('same_top1')} ppl_ratio={a.get('ppl_ratio')} delta_ti={a.get('delta_ti'):.3e} "
                     f"passed={a['passed']}")
    return "\n".join(lines)


def ratios(rows: list[dict]) -> list[dict]:
    """Per (export, runtime, mode): each quantized row's decode speed-up and size vs its fp32 row
    (the ``pit`` export's, for an export without fp32 programs of its own)."""
    out = []
    by = {(r["artifact"].split("/")[0], r["runtime"], r["mode"], r["dtype"], r["threads"]): r for r in rows}
    for (export, runtime, mode, dtype, threads), r in sorted(by.items()):
        base = by.get((export, runtime, mode, "float32", threads)) or by.get(("pit", runtime, mode, "float32", threads))
        if dtype == "float32" or base is None:
            continue
        out.append({"export": export, "runtime": runtime, "mode": mode, "dtype": dtype, "threads": threads,
                    "decode_speedup": r["decode_tok_s"] / base["decode_tok_s"],
                    "prefill_speedup": r["prefill_tok_s"] / base["prefill_tok_s"],
                    "size_mb": r["size_mb"], "fp32_size_mb": base["size_mb"],
                    "rss_mb": r["peak_rss_mb"], "fp32_rss_mb": base["peak_rss_mb"]})
    return out


if __name__ == "__main__":
    raise SystemExit(main())

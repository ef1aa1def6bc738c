"""Parity of the ONNX artifacts on onnxruntime's aarch64 kernels: each artifact × ISA × CPU profile
× KleidiAI setting, judged by ``pit-deploy verify``'s bounds (docs/verify.md, "On aarch64 kernels").

Why: phones run onnxruntime's aarch64 build, whose int4 ``MatMulNBits`` goes through other kernels
(dotprod, i8mm, KleidiAI) than the x86 ones verify uses by default; this measures whether the
artifacts stay within their bounds there, and by how much their figures move.

For the default model (or ``--model``) this script

1. exports the ``onnx`` and ``onnx-genai`` targets' factorized fp32 and int4 artifacts (or reads
   an existing export directory given with ``--export``);
2. runs ``verify --isa x86_64,aarch64`` over them (aarch64 under qemu emulation: run
   ``bash scripts/setup_aarch64.sh`` once), on every ``--arm-cpu`` profile and ``--kleidiai`` setting;
3. writes ``benchmarks/results/verify_aarch64.json``: per row the figures (logits rel L2 and top-1
   for fp32, KL mean / p99, same top-1 and perplexity ratio for int4), ``delta_ti``, pass/fail with
   the failures, and the emulation's wall seconds (planning only: emulation is 50-100x slower
   than native code and says nothing about a phone's speed).

Usage::

    python benchmarks/verify_aarch64.py [--model default] [--export DIR] [--work DIR]
        [--runtime onnx,onnx-genai] [--dtype float32,int4] [--arm-cpu cortex-a53,cortex-a76,max]
        [--kleidiai on,off] [--out benchmarks/results/verify_aarch64.json]

Emulating the default model takes hours on two cores (each held-out pass and each interface
graph runs under qemu once per profile and setting); ``--arm-cpu`` and ``--dtype`` narrow it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pit_deploy.io.result_file import write_result

FIGURES = ("logits_rel_l2", "top1_agreement", "greedy_match", "kl_mean", "kl_p99", "same_top1", "ppl_ratio",
           "expected_kl_mean", "delta_ti", "emulated_s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--export", help="verify this export directory instead of exporting the model")
    parser.add_argument("--work", default="work-arm/export", help="where to write the export (kept)")
    parser.add_argument("--runtime", default="onnx,onnx-genai")
    parser.add_argument("--dtype", default="float32,int4")
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--arm-cpu", default="cortex-a53,cortex-a76,max")
    parser.add_argument("--kleidiai", default="on,off")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "verify_aarch64.json"))
    args = parser.parse_args(argv)

    from pit_deploy.evaluate.verify import verify_directory
    from pit_deploy.runtime.emulated import find_setup

    setup = find_setup()  # before an export that would be wasted without it
    export = Path(args.export) if args.export else Path(args.work)
    if not args.export:
        from pit_deploy.cli import main as cli

        code = cli(["export", args.model, "--out", str(export), "--runtime", args.runtime, "--mode", "factorized",
                    "--dtype", args.dtype, "--max-seq-len", str(args.max_seq_len), "--force"])
        if code:
            return code
    # one verify pass per artifact and (ISA, KleidiAI setting, CPU profile), in the order the
    # options list them, the result file rewritten after each: a run of hours that stops keeps
    # what it measured ("complete": false until the last pass)
    passes = [(dtype, runtime, isa, cpu, kleidiai)
              for dtype in args.dtype.split(",") for runtime in args.runtime.split(",")
              for isa, cpu, kleidiai in [("x86_64", None, None)] + [
                  ("aarch64", cpu, k) for k in args.kleidiai.split(",") for cpu in args.arm_cpu.split(",")]]
    start = time.perf_counter()
    rows: list[dict] = []
    passed = True
    code = 0
    for number, (dtype, runtime, isa, cpu, kleidiai) in enumerate(passes, 1):
        report = verify_directory(export, runtimes=runtime, modes="factorized", dtypes=dtype,
                                  record=False, isa=isa, arm_cpu=cpu, kleidiai=kleidiai)
        print(report, flush=True)
        for r in report.artifacts:
            rows.append({"artifact": r.key, "isa": r.isa, "arm_cpu": r.arm_cpu, "kleidiai": r.kleidiai,
                         "checked": r.checked, **{name: getattr(r, name) for name in FIGURES},
                         "passed": r.passed, "failures": r.failures})
        passed = passed and report.passed
        result = {"model": args.model, "export": str(export), "setup": setup.describe(),
                  "arm_cpu": args.arm_cpu.split(","), "kleidiai": args.kleidiai.split(","),
                  "complete": number == len(passes), "passes_done": number, "passes": len(passes),
                  "seconds": round(time.perf_counter() - start, 1), "passed": passed, "rows": rows}
        code = write_result(args.out, result, __file__, argv)
        if code:
            return code
    return code


if __name__ == "__main__":
    sys.exit(main())

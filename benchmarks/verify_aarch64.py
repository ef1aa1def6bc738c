"""The default model's shipped artifacts on the runtimes' aarch64 kernels: each artifact × CPU
profile × KleidiAI setting, checked by ``pit-deploy verify --isa aarch64`` (docs/verify.md, "On
aarch64 kernels").

Why: phones run onnxruntime's and ExecuTorch's aarch64 builds, whose kernels (NEON, dotprod,
i8mm, Arm's KleidiAI; XNNPACK's ARM micro-kernels) are not the x86 ones ``verify`` runs by
default. This measures whether what ``pit-deploy run default`` ships computes on them what it
computes on x86, within the compact check's bounds (or, with ``--full``, the whole verification).

For the default model this script

1. runs ``pit-deploy run default`` into ``--run`` (its stages are reused when already done there;
   verify and bench are left to that command) and takes the export folders it wrote, or reads
   the export folders given with ``--export``;
2. runs ``verify --isa aarch64`` over each folder's ONNX and ``.pte`` artifacts under qemu
   (``bash scripts/setup_aarch64.sh`` once), with as many emulated processes at once as there
   are cores, on every ``--arm-cpu`` profile with each ``--kleidiai`` setting where KleidiAI has
   kernels for the artifact (verify runs one setting where it has none: docs/verify.md);
3. writes ``benchmarks/results/verify_aarch64.json``: per row the figures (the x86 comparison,
   the reference figures), pass/fail with the failures and the emulated wall seconds (planning
   only: emulation is 50-100x slower than native code and says nothing about a phone's speed),
   the whole wall time, the versions.

Usage::

    python benchmarks/verify_aarch64.py [--run work-arm/run] [--export DIR ...]
        [--runtime onnx,onnx-genai,executorch] [--arm-cpu cortex-a53,cortex-a76,max] [--kleidiai on,off] [--full]
        [--out benchmarks/results/verify_aarch64.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pit_deploy.io.result_file import write_result

FIGURES = ("logits_rel_l2", "top1_agreement", "greedy_match", "kl_mean", "kl_p99", "same_top1", "ppl_ratio",
           "expected_kl_mean", "delta_ti", "emulated_s", "cross_isa")


def export_folders(run: Path) -> list[Path]:
    """The export folders of a ``pit-deploy run`` folder (running it first where needed)."""
    from pit_deploy.cli import main as cli

    code = cli(["run", "default", "--out", str(run), "--set", "verify.enabled=false", "--set", "bench.enabled=false"])
    if code:
        raise SystemExit(code)
    return sorted(p.parent for p in (run / "3-export").glob("*/manifest.json"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="work-arm/run", help="the `pit-deploy run default` folder (kept)")
    parser.add_argument("--export", nargs="+", help="verify these export folders instead")
    parser.add_argument("--runtime", default="onnx,onnx-genai,executorch",
                        help="comma list of the runtimes whose artifacts are checked")
    parser.add_argument("--arm-cpu", default="cortex-a53,cortex-a76,max")
    parser.add_argument("--kleidiai", default="on,off")
    parser.add_argument("--full", action="store_true", help="the whole verification emulated (hours)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "verify_aarch64.json"))
    args = parser.parse_args(argv)

    from pit_deploy.evaluate.verify import verify_directory
    from pit_deploy.runtime.emulated import find_setup
    from pit_deploy.targets import get_target

    setup = find_setup()  # before a run that would be wasted without it
    engines = dict.fromkeys(get_target(name).aarch64_engine for name in ("onnx", "executorch"))
    folders = [Path(p) for p in args.export] if args.export else export_folders(Path(args.run))
    cpus = args.arm_cpu.split(",")
    passes = [(folder, cpus, args.kleidiai) for folder in folders]  # the result file rewritten after each
    start = time.perf_counter()
    rows: list[dict] = []
    passed, code = True, 0
    for number, (folder, profiles, kleidiai) in enumerate(passes, 1):
        report = verify_directory(folder, runtimes=args.runtime, record=False, isa="aarch64",
                                  arm_cpu=profiles, kleidiai=kleidiai, full=args.full)
        print(report, flush=True)
        for r in report.artifacts:
            rows.append({"export": folder.name, "artifact": r.key, "arm_cpu": r.arm_cpu, "kleidiai": r.kleidiai,
                         "checked": r.checked, **{name: getattr(r, name) for name in FIGURES},
                         "passed": r.passed, "failures": r.failures, "notes": r.notes})
        passed = passed and report.passed
        result = {"model": "default", "check": "full" if args.full else "compact",
                  "exports": [str(f) for f in folders], "setup": {e.key: setup.describe(e) for e in engines},
                  "runtimes": args.runtime.split(","), "arm_cpu": cpus, "kleidiai": args.kleidiai.split(","),
                  "complete": number == len(passes), "passes_done": number, "passes": len(passes),
                  "seconds": round(time.perf_counter() - start, 1), "passed": passed, "rows": rows}
        code = write_result(args.out, result, __file__, argv)
        if code:
            return code
    return code


if __name__ == "__main__":
    sys.exit(main())

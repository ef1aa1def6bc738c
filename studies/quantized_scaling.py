"""How far is a quantized artifact's runtime KL from the error its weight rounding alone explains,
honest and with random bytes in every quantized body weight? The measurement behind the scaled
KL bound of ``verify`` (``QuantizedBounds.expected_factor`` and ``expected_floor``,
``docs/quantization.md``, "Verification bounds").

    python studies/quantized_scaling.py [--families llama,qwen3,granite,gpt2]
        [--runtimes onnx,executorch] [--dtypes int8,int4] [--default-export DIR ...]
        [--default-scrambled-pte PIT_DIR] [--work DIR] [--out studies/results/quantized_scaling.json]

Per tiny family (``pit_deploy.tiny``, a perturbed dense ``T``, ``--max-seq-len 64``; held-out
ids are seeded random ids, the tiny models have no tokenizer): one export of every runtime ×
mode × dtype, verified; a copy whose ONNX body weights are random bytes (digests re-recorded);
and a ``.pte`` export whose quantized body linears got random codes before lowering
(``tests/scramble.py`` says how). Each row: the runtime's ``kl_mean``/``kl_p99``, the expected
figures the export recorded (``details["expected"]``), their ratios, and whether ``verify``
passed. ``--default-export DIR ...``: exports of the default model made with ``pit-deploy export``
— their artifacts verified, and copies with their ONNX bodies scrambled;
``--default-scrambled-pte PIT_DIR``: the default model converted (``pit-deploy convert --model
default --out PIT_DIR``) exported as a factorized int4 ``.pte`` with scrambled body codes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the scrambling helpers the tests use
from pit_deploy.io.result_file import write_result  # noqa: E402
from scramble import rehash, scramble_onnx_body, scrambled_pte_linears  # noqa: E402

from pit_deploy.cli import main as cli  # noqa: E402
from pit_deploy.evaluate.verify import verify_directory  # noqa: E402
from pit_deploy.io.checkpoint import save_model  # noqa: E402
from pit_deploy.io.manifest import Manifest  # noqa: E402
from pit_deploy.tiny import FAMILIES, tiny_pit_model  # noqa: E402


def rows_of(directory: Path, model: str, case: str, runtimes: list[str] | None = None) -> list[dict]:
    """One row per quantized artifact of ``directory``, verified now (nothing recorded)."""
    report = verify_directory(directory, runtimes=runtimes, record=False)
    out = []
    for r in report.artifacts:
        if r.kl_mean is None:
            continue
        em, ep = r.expected_kl_mean, r.expected_kl_p99
        out.append({"model": model, "case": case, "runtime": r.runtime, "mode": r.mode, "scheme": r.scheme,
                    "kl_mean": r.kl_mean, "kl_p99": r.kl_p99, "expected_kl_mean": em, "expected_kl_p99": ep,
                    "ratio_mean": r.kl_mean / em if em else None, "ratio_p99": r.kl_p99 / ep if ep else None,
                    "same_top1": r.same_top1, "ppl_ratio": r.ppl_ratio, "passed": r.passed,
                    "failures": r.failures})
        print(f"{model:>8} {case:>9} {r.key:<32} kl {r.kl_mean:.3e} exp {em or 0:.3e} "
              f"x{out[-1]['ratio_mean'] or 0:7.2f}  p99 x{out[-1]['ratio_p99'] or 0:7.2f}  "
              f"{'pass' if r.passed else 'FAIL'}", flush=True)
    return out


def scrambled_onnx_copy(export: Path, target: Path) -> Path:
    """A copy of ``export`` whose quantized ONNX artifacts have random body weights."""
    shutil.copytree(export, target)
    for art in Manifest.read(target).artifacts:
        if art.runtime == "onnx" and art.quantized:
            scramble_onnx_body(target / art.path)
    rehash(target)
    return target


def export_once(argv: list[str], out: Path) -> bool:
    """``pit-deploy export ARGV --out OUT`` unless ``OUT`` holds a finished export (a rerun after
    an interruption keeps what was done); returns whether it exported now."""
    if (out / "manifest.json").is_file():
        return False
    assert cli(["export", *argv, "--out", str(out), "--force"]) == 0
    return True


def family_rows(family: str, work: Path, runtimes: list[str], dtypes: str) -> list[dict]:
    src = work / f"{family}-pit"
    if not (src / "config.json").is_file():  # seeded: the same model every run
        save_model(tiny_pit_model(family), src)
    honest = work / f"{family}-honest"
    common = ["--dtype", dtypes, "--max-seq-len", "64"]
    export_once([str(src), "--runtime", ",".join(runtimes), *common], honest)
    rows = rows_of(honest, family, "honest")
    if "onnx" in runtimes:
        target = work / f"{family}-scrambled-onnx"
        shutil.rmtree(target, ignore_errors=True)
        rows += rows_of(scrambled_onnx_copy(honest, target), family, "scrambled", ["onnx"])
    if "executorch" in runtimes:
        scrambled = work / f"{family}-scrambled-pte"
        record = work / f"{family}-scrambled-pte.txt"  # how many linears each export scrambled (a scratch file)
        with scrambled_pte_linears() as counts:
            if export_once([str(src), "--runtime", "executorch", *common], scrambled):
                record.write_text(" ".join(map(str, counts)))
        scrambled_counts = [int(n) for n in record.read_text().split()] if record.is_file() else None  # None: not recorded
        if scrambled_counts is None or any(scrambled_counts):
            rows += rows_of(scrambled, family, "scrambled")
        else:  # nothing quantized to scramble: GPT-2's Conv1D body stays fp32 on the .pte
            print(f"{family}: the .pte exporter quantized no body linear; no scrambled .pte rows", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--runtimes", default="onnx,executorch")
    parser.add_argument("--dtypes", default="int8,int4")
    parser.add_argument("--default-export", nargs="*", default=[],
                        help="export directories of the default model (pit-deploy export default ...)")
    parser.add_argument("--default-scrambled-pte", default=None, metavar="PIT_DIR",
                        help="also export PIT_DIR (the default model converted) as a factorized int4 .pte "
                             "with scrambled body codes, and verify it")
    parser.add_argument("--work", default="bench_work/quantized_scaling")
    parser.add_argument("--out", default="studies/results/quantized_scaling.json")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    runtimes = [r for r in args.runtimes.split(",") if r]
    rows: list[dict] = []
    start = time.perf_counter()
    for family in [f for f in args.families.split(",") if f]:
        rows += family_rows(family, work, runtimes, args.dtypes)
    for k, name in enumerate(args.default_export):
        export = Path(name)
        rows += rows_of(export, "default", "honest")
        if any(a.runtime == "onnx" and a.quantized for a in Manifest.read(export).artifacts):
            target = work / f"default-scrambled-onnx-{k}"
            shutil.rmtree(target, ignore_errors=True)
            rows += rows_of(scrambled_onnx_copy(export, target), "default", "scrambled", ["onnx"])
            shutil.rmtree(target)
    if args.default_scrambled_pte:
        scrambled = work / "default-scrambled-pte"
        with scrambled_pte_linears():
            export_once([args.default_scrambled_pte, "--runtime", "executorch", "--mode", "factorized",
                         "--dtype", "int4"], scrambled)
        rows += rows_of(scrambled, "default", "scrambled")
    summary = {}
    for case in ("honest", "scrambled"):
        ratios = [r["ratio_mean"] for r in rows if r["case"] == case and r["ratio_mean"] is not None]
        p99 = [r["ratio_p99"] for r in rows if r["case"] == case and r["ratio_p99"] is not None]
        summary[case] = {"rows": len(ratios), "ratio_mean_min": min(ratios, default=None),
                         "ratio_mean_max": max(ratios, default=None), "ratio_p99_min": min(p99, default=None),
                         "ratio_p99_max": max(p99, default=None),
                         "passed": sum(r["passed"] for r in rows if r["case"] == case)}
    print(json.dumps(summary, indent=1))
    return write_result(args.out, {"rows": rows, "summary": summary,
                                   "seconds": round(time.perf_counter() - start, 1)}, __file__, argv)


if __name__ == "__main__":
    sys.exit(main())

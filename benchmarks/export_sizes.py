"""Artifact sizes and export times: PIT (materialized, factorized) vs a plain tied (TT) export.

Why: PIT's claim on disk is that a factorized artifact costs only ``T`` and ``T⁻¹`` over the
model as the stock exporters write it; this measures that claim (and the export times) against
the stock way of exporting the same model, so it can be re-checked after exporter or library
changes.

For the default model (SmolLM2-135M-Instruct, or ``--model``) this script

1. exports the *plain tied* source model the stock way — optimum ONNX (which stores a tied
   table once) and an ExecuTorch/XNNPACK ``.pte`` with the same static-KV ``forward`` and
   metadata methods (which keeps two copies of a tied table) — as the TT baseline;
2. converts it to PIT and runs ``pit_deploy.exporters.export_model`` for every runtime × mode
   (or reads an existing export directory given with ``--pit-export``);
3. writes ``benchmarks/results/export_sizes.json``: bytes per artifact (all files of the
   artifact folder), export seconds, the ratio to the TT baseline of the same runtime, and the
   difference in units of ``V·d`` float32 weights.

Usage::

    python benchmarks/export_sizes.py [--model default] [--max-seq-len 64] [--pit-export DIR]
        [--runtime onnx,executorch] [--out benchmarks/results/export_sizes.json]

``--model`` takes a local checkpoint directory too; ``--runtime onnx`` measures the ONNX
artifacts only (the ``.pte`` lowering of the default model takes minutes).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

from pit_deploy.io.result_file import write_result


def dir_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-seq-len", type=int, default=64)
    parser.add_argument("--runtime", default="onnx,executorch", help="comma list of runtimes to export and compare")
    parser.add_argument("--pit-export", help="reuse this export directory instead of exporting PIT again")
    parser.add_argument("--pit-out", help="write the PIT export here (kept) instead of a temporary directory")
    parser.add_argument("--baseline-json", help="reuse the tt_baseline block of a previous result (skips the TT exports)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "export_sizes.json"))
    args = parser.parse_args(argv)

    from pit_deploy.exporters.pipeline import export_model, load_pit_source
    from pit_deploy.exporters.recipes import Recipe
    from pit_deploy.io.manifest import Manifest

    runtimes = tuple(r for r in args.runtime.split(",") if r)
    if not runtimes or set(runtimes) - {"onnx", "executorch"}:
        parser.error(f"--runtime: choose from onnx, executorch (got {args.runtime!r})")
    work = Path(tempfile.mkdtemp(prefix="pit-export-sizes-"))
    results: dict = {"model": args.model, "max_seq_len": args.max_seq_len,
                     "machine": {"platform": platform.platform(), "python": sys.version.split()[0]},
                     "notes": ["bytes: every file of the artifact folder (config, tokenizer included); "
                               "weight_bytes: the graph/weight files only (*.onnx, *.onnx_data, *.pte); "
                               "ratios and V·d differences are computed on weight_bytes"]}
    if args.baseline_json:
        baseline = json.loads(Path(args.baseline_json).read_text())["tt_baseline"]
        for b in baseline.values():  # results written before weight_bytes existed
            b.setdefault("weight_bytes", b.get("onnx_bytes", b["bytes"]))
    else:
        baseline = tt_baseline(args.model, args.max_seq_len, runtimes, work)
    results["tt_baseline"] = baseline

    # 2. PIT exports
    if args.pit_export:
        pit_dir = Path(args.pit_export)
    else:
        pit_dir = Path(args.pit_out) if args.pit_out else work / "pit"
        pit_loaded = load_pit_source(args.model)
        export_model(pit_loaded, pit_dir, Recipe(max_seq_len=args.max_seq_len, runtimes=runtimes), progress=print)
    manifest = Manifest.read(pit_dir)
    shapes = manifest.artifacts[0].shapes
    v, d = shapes["vocab_size"], shapes["hidden_size"]
    vd_bytes = v * d * 4
    results.update({"vocab_size": v, "hidden_size": d, "vd_float32_bytes": vd_bytes})
    rows = []
    for art in manifest.artifacts:
        base = baseline.get(art.runtime)
        if base is None:  # an artifact of a runtime left out with --runtime
            continue
        wbytes = sum(f["bytes"] for k, f in art.files.items() if k.endswith(WEIGHT_SUFFIXES))
        row = {
            "runtime": art.runtime, "mode": art.mode, "bytes": art.bytes, "weight_bytes": wbytes,
            "export_seconds": art.export_seconds,
            "ratio_to_tt": round(wbytes / base["weight_bytes"], 5),
            "delta_vs_tt_in_vd": round((wbytes - base["weight_bytes"]) / vd_bytes, 3),
            "files": {k: f["bytes"] for k, f in art.files.items()},
        }
        rows.append(row)
        print(row["runtime"], row["mode"], wbytes, row["ratio_to_tt"], row["delta_vs_tt_in_vd"], flush=True)
    results["pit"] = rows
    results["reference_bytes"] = sum(f["bytes"] for f in manifest.reference["files"].values())
    return write_result(args.out, results, __file__, argv)


WEIGHT_SUFFIXES = (".onnx", ".onnx_data", ".pte")


def tt_baseline(model: str, max_seq_len: int, runtimes: tuple[str, ...], work: Path) -> dict:
    """Export the plain tied source model the stock way; sizes and seconds per runtime."""
    import torch
    from optimum.exporters.onnx import onnx_export_from_model

    from pit_deploy.targets.executorch.export import export_pte
    from pit_deploy.io.sources import load_source

    plain = load_source(model).model.eval()
    baseline = {}
    for runtime in runtimes:
        folder = work / f"tt-{runtime}"
        start = time.perf_counter()
        if runtime == "onnx":
            onnx_export_from_model(copy.deepcopy(plain), folder, task="text-generation-with-past", do_validation=False)
        else:
            with torch.no_grad():
                export_pte(copy.deepcopy(plain), folder, max_seq_len, interface_methods=False)
        baseline[runtime] = {"bytes": dir_bytes(folder), "weight_bytes": weight_bytes(folder),
                             "export_seconds": round(time.perf_counter() - start, 2)}
        print(f"TT {runtime}", baseline[runtime], flush=True)
    return baseline


if __name__ == "__main__":
    sys.exit(main())

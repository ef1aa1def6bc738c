"""A float32 factorized ``.pte`` as one file against the same program with its constants in
``model.ptd``: size, load time, peak memory and speed, side by side in one bench run.

Why: a factorized program's gather and head read one ``Zᵀ``. In a lone ``.pte`` it is stored
twice — once among the program's constants for the gather, once among the XNNPACK delegate's
weights for the head — while ExecuTorch's named data store keeps byte-identical blobs once
within one data file, and XNNPACK serializes the head's ``Zᵀ`` as the very bytes of the
program's constant. With every constant in ``model.ptd`` the table is stored once (what the
export now writes, ``docs/export.md``); this measures what that costs or saves at run time,
the driver's cells and the stock runner's, each in its own process.

Usage::

    pit-deploy export MODEL --out ONE --runtime executorch --mode factorized --dtype float32   # an older version
    pit-deploy export MODEL --out PTD --runtime executorch --mode factorized --dtype float32
    python benchmarks/pte_data_file.py ONE PTD [--threads 1,2] [--reps 3]
        [--out benchmarks/results/pte_data_file.json]

``ONE`` and ``PTD`` are export directories whose ``executorch-factorized`` folder is the
single-file program and the one with ``model.ptd``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pit_deploy.io.result_file import write_result  # noqa: E402

FOLDER = "executorch-factorized"
#: the bench figures compared, and whether lower is better
FIGURES = {"decode_ms_p50": True, "ttft_ms": True, "load_s": True, "peak_rss_mb": True, "size_mb": True,
           "decode_tok_s": False, "prefill_tok_s": False}


def folder_files(export: Path) -> dict[str, int]:
    """The bytes of each file of the export's float32 factorized ``.pte`` folder."""
    folder = export / FOLDER
    if not (folder / "model.pte").is_file():
        raise SystemExit(f"error: {folder} holds no model.pte; export the float32 factorized .pte there first")
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("one_file", help="export directory with the single-file program")
    parser.add_argument("with_data", help="export directory with the program and its model.ptd")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pte_data_file.json"))
    args = parser.parse_args(argv)
    import pit_deploy

    exports = {"one-file": Path(args.one_file), "with-ptd": Path(args.with_data)}
    files = {name: folder_files(path) for name, path in exports.items()}
    if "model.ptd" in files["one-file"] or "model.ptd" not in files["with-ptd"]:
        parser.error("the first export's program must be one file and the second's have a model.ptd")
    result = pit_deploy.bench(*exports.values(), threads=args.threads, prompt_len=args.prompt_len,
                              gen_len=args.gen_len, reps=args.reps, say=None)
    rows = [r for r in result.rows if r["artifact"].endswith(f"/{FOLDER}")]
    by = {(r["artifact"].split("/")[0], r.get("variant") or "driver", r["threads"]): r for r in rows}
    names = {path.name: name for name, path in exports.items()}
    ratios = []
    for (export, variant, threads), row in sorted(by.items()):
        if names.get(export) != "with-ptd":
            continue
        base = by.get((exports["one-file"].name, variant, threads))
        if base is None:
            continue
        ratios.append({"variant": variant, "threads": threads,
                       **{f"{k}_ptd_over_one_file": (row[k] / base[k] if base.get(k) else None) for k in FIGURES}})
    def shown(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    for q in ratios:
        print(f"{q['variant']}, {q['threads']} threads: decode ×{shown(q['decode_ms_p50_ptd_over_one_file'])}, "
              f"peak RSS ×{shown(q['peak_rss_mb_ptd_over_one_file'])}, size ×{shown(q['size_mb_ptd_over_one_file'])}")
    return write_result(args.out, {"exports": {k: str(v) for k, v in exports.items()}, "files": files,
                                   "rows": rows, "ratios": ratios, "machine": result.machine,
                                   "warnings": result.warnings}, __file__, argv)


if __name__ == "__main__":
    sys.exit(main())

"""The weight bytes an ONNX decoder reads to decode one token, by kind, for several folders.

Why: a decode step of a small model on a CPU is bound by memory traffic — every linear's
weights are read once per token — so the ratio of two folders' decode times follows the ratio of
the bytes each reads per token, when both run the same kernels (``studies/onnx-genai-int4.md``,
"Decode time follows the bytes read per token"). This counts them from the graph alone, without
running it: every ``MatMulNBits``' codes, block scales and zero points (split by the node's
bits), every float ``MatMul``/``Gemm`` constant (a factorized graph's ``d×d`` factors), and one
row of every gathered table (its codes and scales, or its float32 row). Graph-level constants
that are not weights (shapes, rotary caches, norms' gains) are left out: they are the same for
folders of one model and small.

Usage::

    python benchmarks/decode_bytes.py NAME=FOLDER [NAME=FOLDER ...] [--baseline NAME]
        [--out benchmarks/results/decode_bytes.json]

``FOLDER``: an onnxruntime-genai folder (``model.onnx``, ours or the model builder's) or an ONNX
artifact folder (``onnx/model*.onnx``). With ``--baseline``, each row carries its ratio to that
folder's bytes, to be set beside a decode-time ratio measured side by side
(``genai_side_by_side.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pit_deploy.io.result_file import write_result  # noqa: E402


def decoder_graph(folder: Path) -> Path:
    """The decoder graph of an onnxruntime-genai folder (``model.onnx``) or of an ONNX artifact
    folder (its ``onnx/`` graph that is not the interface)."""
    if (folder / "model.onnx").is_file():
        return folder / "model.onnx"
    from pit_deploy.targets.onnx import decoder_file

    return decoder_file(folder)


def bytes_per_token(graph_path: Path) -> dict[str, float]:
    """MB read per decoded token, by kind (see the module docstring)."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(graph_path), load_external_data=True)
    inits = {i.name: i for i in model.graph.initializer}
    sizes: dict[str, int] = {}

    def size(name: str) -> int:
        if name not in inits:
            return 0
        if name not in sizes:
            sizes[name] = numpy_helper.to_array(inits[name]).nbytes
        return sizes[name]

    out = {"matmulnbits_4bit": 0.0, "matmulnbits_8bit": 0.0, "float_matmul": 0.0, "gathered_row": 0.0}
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            bits = {a.name: helper.get_attribute_value(a) for a in node.attribute}.get("bits", 4)
            out[f"matmulnbits_{bits}bit"] = out.get(f"matmulnbits_{bits}bit", 0.0) + sum(map(size, node.input[1:4]))
        elif node.op_type in ("MatMul", "Gemm"):
            out["float_matmul"] += sum(size(x) for x in node.input[:3])
        elif node.op_type in ("Gather", "GatherBlockQuantized") and node.input[0] in inits:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            axis = attrs.get("axis" if node.op_type == "Gather" else "gather_axis", 0)
            rows = numpy_helper.to_array(inits[node.input[0]]).shape[axis]  # a factorized Zᵀ is gathered along 1
            out["gathered_row"] += sum(size(x) for x in (node.input[0], *node.input[2:4])) / rows
    mb = {k: round(v / 1e6, 6) for k, v in out.items()}
    mb["total"] = round(sum(out.values()) / 1e6, 6)
    return mb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", metavar="NAME=FOLDER")
    parser.add_argument("--baseline", help="the NAME whose bytes the ratios divide by")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_bytes.json"))
    args = parser.parse_args(argv)
    named = []
    for item in args.folders:
        name, sep, folder = item.partition("=")
        if not sep or not name or not Path(folder).is_dir():
            parser.error(f"{item!r} is not NAME=FOLDER with an existing folder")
        named.append((name, Path(folder)))
    if args.baseline is not None and args.baseline not in dict(named):
        parser.error(f"--baseline {args.baseline!r} names none of the folders")
    rows = [{"folder": name, "graph": str(decoder_graph(folder)), **bytes_per_token(decoder_graph(folder))}
            for name, folder in named]
    base = next((r["total"] for r in rows if r["folder"] == args.baseline), None)
    for r in rows:
        r["total_over_baseline"] = round(r["total"] / base, 4) if base else None
        print(f"{r['folder']}: {r['total']:.1f} MB per token" + (f" ({r['total_over_baseline']:.3f}x)" if base else ""))
    return write_result(args.out, {"baseline": args.baseline, "rows": rows}, __file__, argv)


if __name__ == "__main__":
    sys.exit(main())

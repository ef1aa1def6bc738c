"""onnxruntime CPU time of the default model's head shape (576 → 49152) in each quantized form.

Why: the quantized ONNX exports' token table is 8-bit, and the head must keep fp32 activations
(the PIT identity; the KL of the materialized head). This measures, side by side in one run,
what each way of writing that head costs per call: fp32 ``MatMul``; ``MatMulNBits`` with 8-bit
and 4-bit weights at accuracy levels 0 (fp32 activations) and 4 (int8 activations); and the
8-bit table as two 4-bit nibble planes (``pit_deploy.exporters.onnx_tables.split_nibbles``),
which is what the exporter writes. Also checks that the planes compute the 8-bit product. The
exporter's choice of the nibble planes rests on onnxruntime's kernels as measured here: re-run
it when onnxruntime changes (a fast 8-bit kernel with fp32 activations would make them moot).

Usage::

    python benchmarks/onnx_head_kernels.py [--threads 1,2] [--reps 15]
        [--vocab 49152] [--hidden 576] [--out benchmarks/results/onnx_head_kernels.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np

from pit_deploy.io.result_file import write_result

ROOT = Path(__file__).resolve().parents[1]
VOCAB, HIDDEN, BLOCK = 49152, 576, 32


def _graph(nodes: list, inits: dict[str, np.ndarray], vocab: int, hidden: int) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", vocab])],
                              [numpy_helper.from_array(np.ascontiguousarray(a), n) for n, a in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model.SerializeToString()


def _nbits(table, acc: int, out: str, tag: str) -> tuple[list, dict[str, np.ndarray]]:
    from onnx import helper

    vocab, hidden = table.scales.shape[0], table.block * table.scales.shape[1]
    kwargs = {"K": hidden, "N": vocab, "bits": table.bits, "block_size": table.block}
    if acc:
        kwargs["accuracy_level"] = acc
    node = helper.make_node("MatMulNBits", ["x", f"{tag}.b", f"{tag}.s", f"{tag}.z"], [out], domain="com.microsoft",
                            **kwargs)
    return [node], {f"{tag}.b": table.packed, f"{tag}.s": table.scales, f"{tag}.z": table.zero_points}


def variants(rows: np.ndarray) -> tuple[dict[str, bytes], np.ndarray]:
    """The head graphs by name (``rows``: the ``(vocab, hidden)`` table), and the 8-bit table's
    dequantized rows."""
    from onnx import helper

    from pit_deploy.exporters.onnx_tables import block_quantize, split_nibbles

    shape = rows.shape
    q8, q4 = block_quantize(rows, 8, BLOCK), block_quantize(rows, 4, BLOCK)
    out = {"fp32 MatMul": _graph([helper.make_node("MatMul", ["x", "w"], ["y"])], {"w": rows.T}, *shape)}
    for acc in (0, 4):
        for table in (q8, q4):
            out[f"MatMulNBits {table.bits}-bit, accuracy_level {acc}"] = _graph(*_nbits(table, acc, "y", "t"), *shape)
    hi, lo = split_nibbles(q8)
    n_hi, i_hi = _nbits(hi, 0, "y_hi", "hi")
    n_lo, i_lo = _nbits(lo, 0, "y_lo", "lo")
    tail = [helper.make_node("Mul", ["y_hi", "sixteen"], ["y_hi16"]), helper.make_node("Add", ["y_hi16", "y_lo"], ["y"])]
    out["8-bit as two 4-bit nibble planes, accuracy_level 0"] = _graph(
        n_hi + n_lo + tail, {**i_hi, **i_lo, "sixteen": np.array(16.0, np.float32)}, *shape)
    return out, q8.dequantize()


def main(argv: list[str] | None = None) -> int:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--vocab", type=int, default=VOCAB, help="rows of the head (the default model's)")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help=f"its input width, a multiple of {BLOCK}")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/onnx_head_kernels.json"))
    args = parser.parse_args(argv)
    if args.hidden % BLOCK or args.vocab < args.hidden:
        parser.error(f"--hidden must be a multiple of {BLOCK} and at most --vocab")

    rng = np.random.default_rng(0)
    rows, _ = np.linalg.qr(rng.standard_normal((args.vocab, args.hidden)))  # an orthonormal Z, as PIT's
    rows = rows.astype(np.float32)
    graphs, deq8 = variants(rows)
    x1 = rng.standard_normal((1, args.hidden)).astype(np.float32)
    x64 = rng.standard_normal((64, args.hidden)).astype(np.float32)
    want = x1.astype(np.float64) @ deq8.astype(np.float64).T
    results = []
    for threads in (int(t) for t in args.threads.split(",")):
        for name, blob in graphs.items():
            opts = ort.SessionOptions()
            opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
            session = ort.InferenceSession(blob, opts, providers=["CPUExecutionProvider"])
            row = {"variant": name, "threads": threads}
            for label, x, reps in (("m1", x1, args.reps), ("m64", x64, max(3, args.reps // 3))):
                for _ in range(2):
                    session.run(None, {"x": x})
                times = []
                for _ in range(reps):
                    start = time.perf_counter()
                    y = session.run(None, {"x": x})[0]
                    times.append(time.perf_counter() - start)
                row[f"ms_{label}_p50"] = round(1e3 * float(np.median(times)), 3)
                if label == "m1":
                    row["max_abs_err_vs_8bit"] = float(np.abs(y - want).max())
            results.append(row)
            print(f"{threads} thr  {name:52s} 1 row {row['ms_m1_p50']:8.3f} ms   64 rows {row['ms_m64_p50']:8.3f} ms   "
                  f"|y - x·Ẑ8ᵀ| {row['max_abs_err_vs_8bit']:.2e}", flush=True)
    result = {"shape": {"vocab": args.vocab, "hidden": args.hidden, "block": BLOCK},
              "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                          "onnxruntime": ort.__version__},
              "rows": results}
    return write_result(args.out, result, __file__, argv)


if __name__ == "__main__":
    raise SystemExit(main())

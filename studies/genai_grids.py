"""Which ``MatMulNBits`` grid the onnx-genai body should take: rounding error and kernel time of
symmetric and asymmetric blocks of 32 and 64, side by side (128 does not divide the
default model's hidden size, 576).

Why: onnxruntime-genai's builder writes symmetric 4-bit blocks of 32 (a float32 scale a block, no
zero points), and the folder's decode time follows the bytes it reads a token. A grid that rounds
as well in fewer bytes, or better in the same, is worth having only if onnxruntime's int8-activation
kernel (``accuracy_level`` 4) reads it as fast. Two measurements:

1. **Rounding error.** Every body linear of a checkpoint rounded to nearest on each grid with the
   exporter's own scale search (:func:`pit_deploy.exporters.calibrated_rounding.round_to_nearest`,
   the starting point of GPTQ), the relative squared error ``‖Ŵ − W‖² / ‖W‖²`` averaged over the
   linears of each kind, and the bits a weight costs on that grid (codes, float32 scales, 4-bit
   zero points).
2. **Kernel time.** A chain of 30 layers of ``576 → 1536 → 576`` ``MatMulNBits`` (the default
   model's MLP shapes, 106 MB at 8 bits: far past the caches, as a decode step is), one row of
   activations, each grid timed in its own onnxruntime session, sessions interleaved over
   rounds, medians.

    python studies/genai_grids.py --pit runs/default/2-train/pit/model [--threads 1,2] [--rounds 7]
        [--out studies/results/genai_grids.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pit_deploy.io.result_file import write_result  # noqa: E402

#: (bits, block, symmetric) of each grid measured
GRIDS = [(4, 32, True), (4, 32, False), (4, 64, True), (4, 64, False), (8, 32, True), (8, 64, True), (8, 64, False)]
LAYERS, HIDDEN, INNER = 30, 576, 1536


def label(bits: int, block: int, symmetric: bool) -> str:
    return f"{bits}-bit, blocks of {block}, {'symmetric' if symmetric else 'zero points'}"


def bits_per_weight(bits: int, block: int, symmetric: bool) -> float:
    """Codes, a float32 scale a block and (asymmetric) a ``bits``-wide zero point a block."""
    return bits + 32 / block + (0 if symmetric else bits / block)


def rounding_error(pit: str) -> list[dict]:
    """Mean relative squared rounding error of each kind of body linear on each grid."""
    import torch
    from safetensors.torch import load_file

    from pit_deploy.exporters.calibrated_rounding import RoundingGrid, round_to_nearest

    weights: dict[str, torch.Tensor] = {}
    for f in sorted(Path(pit).glob("*.safetensors")):
        weights.update(load_file(str(f)))
    linear = re.compile(r"layers\.\d+\.(?:self_attn|mlp)\.(\w+_proj)\.weight$")
    rows = []
    for bits, block, symmetric in GRIDS:
        by_kind: dict[str, list[float]] = {}
        for name, w in sorted(weights.items()):
            match = linear.search(name)
            if match is None or w.ndim != 2:
                continue
            w = w.float()
            r = round_to_nearest(w, RoundingGrid(bits, block, symmetric))
            by_kind.setdefault(match.group(1), []).append(float((r.dequantize() - w).square().sum() / w.square().sum()))
        kinds = {k: float(np.mean(v)) for k, v in sorted(by_kind.items())}
        rows.append({"grid": label(bits, block, symmetric), "bits": bits, "block": block, "symmetric": symmetric,
                     "bits_per_weight": bits_per_weight(bits, block, symmetric),
                     "relative_sq_error_mean": float(np.mean(list(kinds.values()))), "by_kind": kinds})
        print(f"{rows[-1]['grid']:36s} {rows[-1]['bits_per_weight']:.3f} bits/weight  "
              f"error {rows[-1]['relative_sq_error_mean']:.5f}", flush=True)
    return rows


def chain(bits: int, block: int, symmetric: bool) -> tuple[bytes, int]:
    """The ``LAYERS``-layer chain on one grid (onnxruntime's own block quantizer), and its weight bytes."""
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    rng = np.random.default_rng(0)
    quantizer = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=symmetric,
                                                                        bits=bits))
    nodes, inits, x, stored = [], [], "x", 0
    for i in range(LAYERS):
        for j, (k, n) in enumerate(((HIDDEN, INNER), (INNER, HIDDEN))):
            packed, scales, zeros = quantizer.qbits_block_quant((rng.standard_normal((k, n)) * 0.03).astype(np.float32))
            names = [x, f"b{i}_{j}", f"s{i}_{j}"]
            arrays = [packed, scales] + ([] if symmetric else [zeros])
            if not symmetric:
                names.append(f"z{i}_{j}")
            inits += [numpy_helper.from_array(a, nm) for a, nm in zip(arrays, names[1:])]
            stored += sum(a.nbytes for a in arrays)
            x = f"y{i}_{j}"
            nodes.append(helper.make_node("MatMulNBits", names, [x], domain="com.microsoft", K=k, N=n, bits=bits,
                                          block_size=block, accuracy_level=4))
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, HIDDEN])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, HIDDEN])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model.SerializeToString(), stored


def kernel_time(threads: list[int], rounds: int) -> list[dict]:
    """Median time of one pass through each grid's chain, sessions interleaved."""
    import onnxruntime as ort

    graphs = {grid: chain(*grid) for grid in GRIDS}
    x = np.random.default_rng(1).standard_normal((1, HIDDEN)).astype(np.float32)
    rows = []
    for t in threads:
        sessions = {}
        for grid, (blob, _) in graphs.items():
            opts = ort.SessionOptions()
            opts.intra_op_num_threads, opts.inter_op_num_threads = t, 1
            sessions[grid] = ort.InferenceSession(blob, opts, providers=["CPUExecutionProvider"])
            for _ in range(5):
                sessions[grid].run(None, {"x": x})
        times: dict = {grid: [] for grid in GRIDS}
        for _ in range(rounds):
            for grid, session in sessions.items():
                start = time.perf_counter()
                for _ in range(20):
                    session.run(None, {"x": x})
                times[grid].append((time.perf_counter() - start) / 20)
        base = float(np.median(times[GRIDS[0]]))
        for grid in GRIDS:
            ms = 1e3 * float(np.median(times[grid]))
            rows.append({"grid": label(*grid), "threads": t, "weight_mb": graphs[grid][1] / 1e6, "ms_per_pass": ms,
                         "over_symmetric_32": ms / (1e3 * base)})
            print(f"{t} thr  {rows[-1]['grid']:36s} {rows[-1]['weight_mb']:6.1f} MB  {ms:7.3f} ms  "
                  f"{rows[-1]['over_symmetric_32']:.3f}x", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pit", required=True, help="a PIT checkpoint (the default run's: runs/default/2-train/pit/model)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="studies/results/genai_grids.json")
    args = ap.parse_args(argv)
    result = {
        "checkpoint": args.pit,
        "rounding_error": rounding_error(args.pit),
        "kernel": {"chain": f"{LAYERS} x ({HIDDEN} -> {INNER} -> {HIDDEN}) MatMulNBits, accuracy_level 4, one row",
                   "rows": kernel_time([int(t) for t in args.threads.split(",")], args.rounds)},
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "onnxruntime": ort.__version__},
    }
    return write_result(args.out, result, __file__, argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""Can onnxruntime's ``MatMulNBits`` hold a Q4_1 weight (``w = d·q + m``) exactly, and at what speed?

Q4_1's ``m`` is any half-precision number, so as ``(q − z)·d`` its zero point ``z = −m/d`` is no
integer. ``MatMulNBits`` takes zero points either as packed 4-bit integers or as floats of the
scales' type. One 576→1536 linear (the default model's ``gate_proj`` shape) with random Q4_1
blocks (``m`` near ``−7.5d``, as a centred block has), one token a call, one thread, three ways:
no zero points (the kernel's default ``8``), integer zero points (``round(−m/d)``), float zero
points (``−m/d``), at ``accuracy_level`` 0 (float activations) and 4 (int8 activations, what the
exporter's body uses). For each: the largest output error against the exact Q4_1 product
(relative to the largest output) and the median time of a call, the three interleaved.

    python studies/grid_onnx_zero_points.py [--reps 300] [--out studies/results/grid_onnx_zero_points.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from pit_deploy.io.result_file import write_result  # noqa: E402

K, N, BLOCK = 576, 1536, 32
FORMS = ("no zero points", "integer zero points", "float zero points")


def q41(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes ``(N, K/32, 32)``, ``d`` and ``m`` ``(N, K/32)`` of a random Q4_1 weight."""
    codes = rng.integers(0, 16, size=(N, K // BLOCK, BLOCK)).astype(np.uint8)
    d = rng.uniform(0.005, 0.02, size=(N, K // BLOCK)).astype(np.float32)
    m = (-7.5 * d + rng.normal(0, 0.003, size=d.shape)).astype(np.float32)
    return codes, d, m


def pack4(values: np.ndarray) -> np.ndarray:
    """Two 4-bit values a byte, low nibble first, along the last axis (padded to even)."""
    if values.shape[-1] % 2:
        values = np.concatenate([values, np.zeros(values.shape[:-1] + (1,), np.uint8)], -1)
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def session(form: str, accuracy: int, codes: np.ndarray, d: np.ndarray, m: np.ndarray):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(pack4(codes), "B"), numpy_helper.from_array(d.reshape(-1), "S")]
    inputs = ["A", "B", "S"]
    if form == "float zero points":
        inits.append(numpy_helper.from_array((-m / d).astype(np.float32).reshape(-1), "Z"))
        inputs.append("Z")
    elif form == "integer zero points":
        inits.append(numpy_helper.from_array(pack4(np.clip(np.round(-m / d), 0, 15).astype(np.uint8)).reshape(-1), "Z"))
        inputs.append("Z")
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain="com.microsoft", K=K, N=N, bits=4,
                            block_size=BLOCK, accuracy_level=accuracy)
    graph = helper.make_graph([node], "q41", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, K])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, N])], inits)
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17),
                                                                   helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out", default="studies/results/grid_onnx_zero_points.json")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    codes, d, m = q41(rng)
    weight = (codes * d[..., None] + m[..., None]).reshape(N, K).astype(np.float64)
    x = rng.normal(size=(1, K)).astype(np.float32)
    exact = x.astype(np.float64) @ weight.T
    rows = []
    for accuracy in (0, 4):
        sessions = {form: session(form, accuracy, codes, d, m) for form in FORMS}
        times: dict[str, list[float]] = {form: [] for form in FORMS}
        for rep in range(args.reps + 10):
            for form, sess in sessions.items():
                start = time.perf_counter()
                sess.run(None, {"A": x})
                if rep >= 10:
                    times[form].append((time.perf_counter() - start) * 1e6)
        for form, sess in sessions.items():
            y = sess.run(None, {"A": x})[0]
            rows.append({"accuracy_level": accuracy, "form": form,
                         "max_error_rel": float(np.abs(y - exact).max() / np.abs(exact).max()),
                         "median_call_us": round(statistics.median(times[form]), 1)})
            print(rows[-1], flush=True)
    return write_result(args.out, {"shape": [K, N], "block": BLOCK, "threads": 1, "reps": args.reps, "rows": rows},
                        script=__file__, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())

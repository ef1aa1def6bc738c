"""Where an ONNX artifact's decode step spends its time: onnxruntime's own profiler, by op type.

Why: a decode step's time is split between the matrix products, which quantization shrinks,
and everything else the exported graph runs (shape arithmetic, cache handling, dispatch), which
it does not; which of the two dominates decides what to work on next (``docs/quantization.md``:
why int4 decoding falls short of its speed goal). This runs a prompt, then ``--steps``
single-token decode steps of each artifact with ``SessionOptions.enable_profiling`` and sums the
profiler's per-node kernel times by op type over the decode steps: how many nodes one step
runs, how much of the step is matrix products and how much everything else.

Usage::

    python benchmarks/onnx_decode_profile.py DIR [DIR ...] [--threads 2] [--steps 32]
        [--prompt-len 64] [--out benchmarks/results/onnx_decode_profile.json]

``DIR``: an ONNX artifact folder (e.g. ``EXPORT/onnx-factorized-int4``), or an onnxruntime-genai
folder (``onnx-genai-*``, or the model builder's own output: the same ``model.onnx`` decoder,
run through the same standalone decoder). Profiling adds its
own overhead to each node; compare shares, not the step time with a bench row.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from pit_deploy.io.result_file import write_result

ROOT = Path(__file__).resolve().parents[1]
MATMULS = {"MatMul", "MatMulNBits", "FusedMatMul", "Gemm"}
#: how many of the costliest single nodes a result lists
TOP_NODES = 8


def profile(folder: str, threads: int, steps: int, prompt_len: int = 64) -> dict:
    """Per-op-type kernel time of ``steps`` decode steps of the artifact in ``folder``."""
    from pit_deploy.runtime import standalone
    from pit_deploy.targets.onnx import decoder_file

    workdir = tempfile.mkdtemp(prefix="ort-profile-")
    plain = standalone.ort_session_options

    def profiled(*args, **kwargs):
        opts = plain(*args, **kwargs)
        opts.enable_profiling = True
        opts.profile_file_prefix = os.path.join(workdir, "decode")
        return opts

    standalone.ort_session_options = profiled
    try:
        decoder = standalone.OrtDecoder(decoder_file(Path(folder)), threads)
    finally:
        standalone.ort_session_options = plain
    ids = np.arange(100, 100 + prompt_len)
    decoder.prefill(ids)
    start = time.perf_counter()
    for k in range(steps):
        decoder.step(int(ids[k % prompt_len]), prompt_len + k)
    wall = (time.perf_counter() - start) / steps
    events = json.loads(Path(decoder.session.end_profiling()).read_text())
    runs = [e for e in events if e.get("name") == "model_run"][-steps:]
    first = runs[0]["ts"]
    total, count, by_node = collections.Counter(), collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= first:
            op = e["args"].get("op_name", "?")
            total[op] += e["dur"]
            count[op] += 1
            by_node[e["name"][: -len("_kernel_time")]] += e["dur"]
    kernels = sum(total.values()) / steps / 1e3
    matmul = sum(v for k, v in total.items() if k in MATMULS) / steps / 1e3
    return {
        "artifact": folder, "threads": threads, "steps": steps, "prompt_len": prompt_len,
        "step_wall_ms": round(1e3 * wall, 3),
        "model_run_ms": round(float(np.mean([r["dur"] for r in runs])) / 1e3, 3),
        "kernel_sum_ms": round(kernels, 3), "matmul_ms": round(matmul, 3),
        "matmul_share_of_kernels": round(matmul / kernels, 3),
        "nodes_per_step": round(sum(count.values()) / steps),
        "by_op": [{"op": op, "ms": round(d / steps / 1e3, 3), "nodes": round(count[op] / steps)}
                  for op, d in total.most_common()],
        # the single nodes that cost most (a head, a layer kept at 8 bits), by name
        "top_nodes": [{"node": name, "ms": round(d / steps / 1e3, 3)} for name, d in by_node.most_common(TOP_NODES)],
    }


def main(argv: list[str] | None = None) -> int:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", help="ONNX artifact folders")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/onnx_decode_profile.json"))
    args = parser.parse_args(argv)
    rows = []
    for folder in args.dirs:
        row = profile(folder, args.threads, args.steps, args.prompt_len)
        rows.append(row)
        print(f"{folder}: {row['nodes_per_step']} nodes/step, run {row['model_run_ms']:.1f} ms, kernels "
              f"{row['kernel_sum_ms']:.1f} ms, of which matrix products {row['matmul_ms']:.1f} ms", flush=True)
        for entry in row["by_op"][:8]:
            print(f"    {entry['op']:30s} {entry['ms']:7.3f} ms  {entry['nodes']:5d} nodes")
    result = {"machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "onnxruntime": ort.__version__},
              "rows": rows}
    return write_result(args.out, result, __file__, argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""Can an ExecuTorch program hold a Q4_1-style body (``w = d·(q − 8) + c``, ``studies/source_grid.py``)
inside XNNPACK, and what does the offsets' second linear cost a decode step?

A stack of the default model's MLP shapes (``layers`` × a 576→1536 and a 1536→576 linear, ReLU
between) is exported three ways and run in the ExecuTorch runtime of the wheel, one token a call
(a decode step's shape), at 1 and 2 threads:

- ``plain``: each linear one ``8da4w`` linear (what the int4 `.pte` has now);
- ``offsets (mean)``: + the block sums of its input as a 4-D mean over the last two dimensions
  and an ``8da8w`` linear from them (weights ``32c``);
- ``offsets (sum)``: the block sums as ``sum(-1)``;
- ``offsets in the main linear``: no second linear: the block sums (4-D mean) appended twice to
  the input, each copy padded to a multiple of 32, one ``8da4w`` linear over the longer input (its
  extra columns would hold ``c`` split into two 4-bit parts, a coarse one and its residual, for
  8-bit precision).

For each: how many XNNPACK delegates and which ops run outside them, and the median time of a call
(side by side, interleaved, in one process; the weights are random: only the shapes matter here).

    python studies/grid_offsets_lowering.py [--layers 30] [--reps 200] \\
        [--out studies/results/grid_offsets_lowering.json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from pit_deploy.io.result_file import write_result  # noqa: E402

BLOCK = 32
FORMS = ("plain", "offsets (mean)", "offsets (sum)", "offsets in the main linear")


class OffsetLinear(nn.Module):
    """``main(x) + offset(block sums of x)``, or ``main(x)`` alone for ``plain``."""

    def __init__(self, cols: int, rows: int, form: str):
        super().__init__()
        self.form = form
        self.pad = -(-(cols // BLOCK) // BLOCK) * BLOCK - cols // BLOCK  # the block sums padded to 32s
        extra = 2 * (cols // BLOCK + self.pad) if form == "offsets in the main linear" else 0
        self.main = nn.Linear(cols + extra, rows, bias=False)
        self.offset = nn.Linear(cols // BLOCK, rows, bias=False) if form in ("offsets (mean)", "offsets (sum)") else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "plain":
            return self.main(x)
        if self.form == "offsets (sum)":
            return self.main(x) + self.offset(x.unflatten(-1, (-1, BLOCK)).sum(-1))
        tokens = x.shape[1]
        sums = x.reshape(tokens, -1, BLOCK, 1).mean((-2, -1), keepdim=True).reshape(1, tokens, -1)
        if self.offset is not None:
            return self.main(x) + self.offset(sums)
        sums = torch.nn.functional.pad(sums, (0, self.pad))
        return self.main(torch.cat([x, sums, sums], -1))


class Stack(nn.Module):
    def __init__(self, layers: int, form: str, dim: int = 576, hidden: int = 1536):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(OffsetLinear(dim, hidden, form), nn.ReLU(),
                                                  OffsetLinear(hidden, dim, form)) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def lower(form: str, layers: int, path: Path) -> dict:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from torchao.quantization import quantize_

    from pit_deploy.targets.executorch.head import xnnpack_linear_config

    torch.manual_seed(0)
    model = Stack(layers, form).eval()
    quantize_(model, xnnpack_linear_config(4, BLOCK), filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn.endswith("main"))
    quantize_(model, xnnpack_linear_config(8, BLOCK), filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn.endswith("offset"))
    start = time.perf_counter()
    edge = to_edge_transform_and_lower(torch.export.export(model, (torch.randn(1, 1, 576),)),
                                       partitioner=[XnnpackPartitioner()])
    program = edge.to_executorch()
    seconds = time.perf_counter() - start
    path.write_bytes(program.buffer)
    calls = [n for n in edge.exported_program().graph_module.graph.nodes if n.op == "call_function"]
    delegates = sum("call_delegate" in str(n.target).lower() for n in calls)
    outside = sorted({str(n.target) for n in calls if "delegate" not in str(n.target).lower()
                      and "getitem" not in str(n.target)})
    return {"delegates": delegates, "ops_outside_delegates": outside, "lowering_seconds": round(seconds, 1),
            "pte_mb": round(path.stat().st_size / 1e6, 2)}


def time_forms(paths: dict[str, Path], threads: int, reps: int) -> dict[str, float]:
    """Median ms of a one-token call of each program, the programs interleaved call by call."""
    from executorch.runtime import Runtime

    from pit_deploy.runtime.standalone import set_executorch_threads

    set_executorch_threads(threads)
    methods = {form: Runtime.get().load_program(str(p)).load_method("forward") for form, p in paths.items()}
    x = torch.randn(1, 1, 576)
    times: dict[str, list[float]] = {form: [] for form in paths}
    for rep in range(reps + 10):
        for form, method in methods.items():
            start = time.perf_counter()
            method.execute([x])
            if rep >= 10:  # warm-up calls are not timed
                times[form].append((time.perf_counter() - start) * 1e3)
    return {form: round(statistics.median(t), 4) for form, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default="studies/results/grid_offsets_lowering.json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {form: Path(tmp) / f"{i}.pte" for i, form in enumerate(FORMS)}
        forms = {form: lower(form, args.layers, paths[form]) for form in FORMS}
        for form in FORMS:
            print(form, forms[form], flush=True)
        timing = {f"{t} threads": time_forms(paths, t, args.reps) for t in (1, 2)}
    print(timing)
    return write_result(args.out, {"layers": args.layers, "reps": args.reps, "forms": forms, "median_call_ms": timing},
                        script=__file__, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""The default model's head shape (576 → 49152) as ExecuTorch/XNNPACK programs, side by side:
what storing the token table once, or quantizing the head, costs and saves.

Why: how a ``.pte`` stores and computes the token table (twice in fp32, once as a program
constant, or quantized behind a rotation) is decided by what XNNPACK does with each form — packs
it at load or on every call, keeps fp32 weights or not, computes what the eager module computes
or not. Those are properties of the ExecuTorch version; re-run this when it changes.

    python benchmarks/pte_head_kernels.py [--threads 1,2] [--calls 50] [--vocab 49152] \\
        [--hidden 576] [--out benchmarks/results/pte_head_kernels.json]

Each program holds a factorized interface — ``Zᵀ`` (d×V), ``T`` (d×d) — and computes the
embedding rows of 3 ids and the logits of one hidden row (a decode step's head). Variants:

* ``fp32``: the exporter's fp32 program; the gather runs outside the XNNPACK delegate and the
  head inside it, so the file holds the table twice;
* ``fp32-table-once``: the same lowered with the partitioner's
  ``force_non_static_weights_for_f32_linear``: ``Zᵀ`` is a program constant handed to the
  delegate at run time, stored once, and XNNPACK packs it on every call;
* ``int8-head`` / ``int4-head``: the head over ``Z R`` (a seeded random rotation) through
  torchao's ``8da8w`` / ``8da4w`` (group 32) linear, the gather over an 8-bit table
  (``pit_deploy.targets.executorch.head``, ``pit_deploy.targets.executorch.token_table``);
* ``int8-weight-only-head``: the fp32 program's head as an ``nn.Linear`` quantized by torchao's
  ``IntxWeightOnlyConfig`` (int8 per channel, fp32 activations), which is what a weight-only
  quantized head would need from XNNPACK.

Synthetic weights of the right shapes (the timing does not depend on their values). Writes the
file size, the relative L2 distance of the program's logits from the eager module's, and the
median milliseconds per call at each thread count.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from torch import nn

from pit_deploy.io.result_file import write_result

V, D, GROUP = 49152, 576, 32


class Interface(nn.Module):
    """``(ids, h) ↦ (E[ids], logits(h))`` with the factorized fp32 head."""

    def __init__(self, zt: torch.Tensor, t: torch.Tensor):
        super().__init__()
        self.register_buffer("Zt", zt)
        self.register_buffer("T", t)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.index_select(self.Zt, 1, ids).transpose(0, 1) @ self.T

    def forward(self, ids: torch.Tensor, h: torch.Tensor):
        return self.rows(ids), (h @ self.T) @ self.Zt


class QuantizedInterface(nn.Module):
    """The same with the 8-bit table and the rotated quantized head of a quantized program."""

    def __init__(self, zt: torch.Tensor, t: torch.Tensor, bits: int):
        super().__init__()
        from pit_deploy.targets.executorch.head import RotatedQuantizedHead
        from pit_deploy.targets.executorch.token_table import QuantizedRows, quantize_rows

        self.head = RotatedQuantizedHead(zt, t, bits, GROUP)
        q, scales = quantize_rows(self.head.rotated_rows(zt), GROUP)
        self.rows = QuantizedRows(q, scales, torch.linalg.inv(self.head.TR))

    def forward(self, ids: torch.Tensor, h: torch.Tensor):
        return self.rows(ids), self.head.logits(h)


class LinearHead(Interface):
    """The factorized interface with the head as an ``nn.Linear`` over ``Z`` (for torchao)."""

    def __init__(self, zt: torch.Tensor, t: torch.Tensor):
        super().__init__(zt, t)
        self.head = nn.Linear(zt.shape[0], zt.shape[1], bias=False)
        with torch.no_grad():
            self.head.weight.copy_(zt.T)

    def forward(self, ids: torch.Tensor, h: torch.Tensor):
        return self.rows(ids), self.head(h @ self.T)


def weight_only_int8(module: nn.Module) -> nn.Module:
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis

    quantize_(module, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)),
              filter_fn=lambda m, _fqn: isinstance(m, nn.Linear))
    return module


def lower(module: nn.Module, args: tuple, table_once: bool) -> bytes:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    exported = torch.export.export(module.eval(), args, strict=True)
    partitioner = XnnpackPartitioner(force_non_static_weights_for_f32_linear=table_once)
    edge = to_edge_transform_and_lower(exported, partitioner=[partitioner],
                                       compile_config=EdgeCompileConfig(_check_ir_validity=False))
    return edge.to_executorch().buffer


def logits_error(buffer: bytes, module: nn.Module, args: tuple) -> float:
    """Relative L2 distance of the program's logits from the eager module's."""
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    got = _load_for_executorch_from_buffer(buffer).forward(args)[1]
    with torch.no_grad():
        want = module(*args)[1]
    return float((got - want).norm() / want.norm())


def time_calls(buffer: bytes, args: tuple, threads: int, calls: int) -> float:
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    from pit_deploy.runtime.standalone import load_llm_custom_ops, set_executorch_threads

    load_llm_custom_ops()
    set_executorch_threads(threads)
    program = _load_for_executorch_from_buffer(buffer)
    for _ in range(3):
        program.forward(args)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        program.forward(args)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--vocab", type=int, default=V, help="rows of the token table (the default model's)")
    parser.add_argument("--hidden", type=int, default=D, help=f"its width, a multiple of {GROUP}")
    parser.add_argument("--out", default="benchmarks/results/pte_head_kernels.json")
    args = parser.parse_args(argv)
    if args.hidden % GROUP or args.vocab < args.hidden:
        parser.error(f"--hidden must be a multiple of {GROUP} and at most --vocab")
    threads = [int(t) for t in args.threads.split(",")]
    vocab, d = args.vocab, args.hidden
    gen = torch.Generator().manual_seed(0)
    z, _ = torch.linalg.qr(torch.randn(vocab, d, generator=gen, dtype=torch.float64))
    t = torch.eye(d, dtype=torch.float64) + 0.01 * torch.randn(d, d, generator=gen, dtype=torch.float64)
    t = t @ t.T
    zt, t32 = z.T.contiguous().float(), t.float()
    inputs = (torch.tensor([1, 2, 3]), torch.randn(1, d, generator=gen))
    variants = {
        "fp32": (Interface(zt, t32), False),
        "fp32-table-once": (Interface(zt, t32), True),
        "int8-head": (QuantizedInterface(zt, t32, 8), False),
        "int4-head": (QuantizedInterface(zt, t32, 4), False),
        "int8-weight-only-head": (weight_only_int8(LinearHead(zt, t32)), False),
    }
    rows = []
    for name, (module, table_once) in variants.items():
        buffer = lower(module, inputs, table_once)
        row = {"variant": name, "size_mb": round(len(buffer) / 1e6, 2),
               "logits_rel_l2_vs_eager": logits_error(buffer, module, inputs),
               "ms_per_call": {str(n): round(time_calls(buffer, inputs, n, args.calls), 3) for n in threads}}
        print(row, flush=True)
        rows.append(row)
    return write_result(args.out, {"shape": {"vocab": vocab, "hidden": d, "group": GROUP}, "rows": rows,
                                   "calls": args.calls, "machine": platform.platform(), "cpu_count": os.cpu_count(),
                                   "torch": torch.__version__}, __file__, argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""Where the Q4_1 grid of the default model's GGUF flatters int4 figures, measured on weights.

The default model comes from a Q4_1 GGUF: every block of 32 weights along a linear's input
dimension is ``q · d + m`` with ``q`` in 0..15 and float ``d``, ``m``. A 4-bit scheme that can
land on that grid reproduces those weights exactly, and its quantization figures on the default
model say nothing about other models. This script measures, per set of weight matrices:

* ``on_grid``: the fraction of blocks of 32 whose values sit on 16 evenly spaced levels from the
  block's minimum to its maximum (to 1e-3 of a level);
* ``rel_err_q4_1``: relative Frobenius error of Q4_1-style rounding (float minimum and scale
  ``(max − min) / 15``; what the GGUF itself used);
* ``rel_err_ort``: relative error of the exporter's own ONNX int4 rounding
  (``onnx_tables.block_quantize``: onnxruntime's asymmetric blocks, an *integer* zero point);
* ``rel_err_sym``: symmetric blocks with ``q`` in −8..7 and scale ``max|x| / 8`` (no zero point,
  like XNNPACK's 4-bit weights; the ExecuTorch programs' own scales come from torchao's HQQ
  search, so this is the kind of grid, not their exact rounding).

Sets: the source model's body linears (unconverted), the body of a ``preserve`` conversion of it
(which rotates the residual stream), the PIT table ``Z`` and the materialized head
``W_out = T Zᵀ`` (rows of 32 along ``d``), and the body linears of a tiny random model of each
family (Gaussian weights: no grid at all).

    python studies/quantization_grid.py --pit DIR/reference \\
        [--out studies/results/quantization_grid.json]

``DIR/reference`` is a converted default model (``pit-deploy export default --out DIR ...`` or
``pit-deploy convert --model default --out DIR``).
"""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

import numpy as np
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pit_deploy.errors import PitError  # noqa: E402
from pit_deploy.exporters.onnx_tables import block_quantize  # noqa: E402
from pit_deploy.io.checkpoint import load_pit_model  # noqa: E402
from pit_deploy.io.sources import load_source  # noqa: E402
from pit_deploy.model.inspect import find_interface  # noqa: E402
from pit_deploy.tiny import FAMILIES, tiny_model  # noqa: E402

from pit_deploy.io.result_file import write_result  # noqa: E402

BLOCK = 32


def blocks_of(rows: np.ndarray) -> np.ndarray:
    """``rows`` ``(N, K)`` as ``(N · K/32, 32)`` float64 blocks along ``K``."""
    return rows.astype(np.float64).reshape(-1, BLOCK)


def q4_1_levels(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per block: ``(min, step, level)`` with ``step = (max − min) / 15`` and each value's
    unrounded level ``(x − min) / step`` (Q4_1's grid; a constant block gets step 1)."""
    lo, hi = blocks.min(1, keepdims=True), blocks.max(1, keepdims=True)
    step = np.where(hi > lo, (hi - lo) / 15, 1.0)
    return lo, step, (blocks - lo) / step


def on_grid(blocks: np.ndarray, tol: float = 1e-3) -> np.ndarray:
    """Per block: whether every value is ``min + q · (max − min) / 15`` for an integer ``q``."""
    level = q4_1_levels(blocks)[2]
    return np.abs(level - np.round(level)).max(1) <= tol


def q4_1(blocks: np.ndarray) -> np.ndarray:
    lo, step, level = q4_1_levels(blocks)
    return np.clip(np.round(level), 0, 15) * step + lo


def symmetric(blocks: np.ndarray) -> np.ndarray:
    scale = np.abs(blocks).max(1, keepdims=True) / 8
    scale = np.where(scale > 0, scale, 1.0)
    return np.clip(np.round(blocks / scale), -8, 7) * scale


def measure(matrices: list[np.ndarray]) -> dict[str, float]:
    """Figures over ``matrices`` (each ``(N, K)``, blocks along ``K``), weighted by size."""
    total = {"sq": 0.0, "q4_1": 0.0, "ort": 0.0, "sym": 0.0, "grid": 0, "blocks": 0}
    for rows in matrices:
        b = blocks_of(rows)
        total["sq"] += float((b ** 2).sum())
        total["q4_1"] += float(((q4_1(b) - b) ** 2).sum())
        total["sym"] += float(((symmetric(b) - b) ** 2).sum())
        ort = block_quantize(rows.astype(np.float32), 4, BLOCK).dequantize().astype(np.float64)
        total["ort"] += float(((ort.reshape(-1, BLOCK) - b) ** 2).sum())
        total["grid"] += int(on_grid(b).sum())
        total["blocks"] += b.shape[0]
    return {"matrices": len(matrices), "weights": total["blocks"] * BLOCK,
            "on_grid": total["grid"] / total["blocks"],
            **{f"rel_err_{k}": (total[k] / total["sq"]) ** 0.5 for k in ("q4_1", "ort", "sym")}}


def body_linears(model: nn.Module) -> list[np.ndarray]:
    """The weights ``(out, in)`` of the decoder blocks' linears (blocks of 32 run along ``in``;
    GPT-2's ``Conv1D`` stores ``(in, out)``)."""
    from transformers.pytorch_utils import Conv1D

    out = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            weight = m.weight.detach()
        elif isinstance(m, Conv1D):
            weight = m.weight.detach().T
        else:
            continue
        if ("layers" in name.split(".") or "h" in name.split(".")) and weight.shape[1] % BLOCK == 0:
            out.append(weight.to(torch.float32).numpy())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="default", help="the unconverted model")
    parser.add_argument("--pit", required=True, help="a converted (PIT) checkpoint of --source")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "quantization_grid.json"))
    args = parser.parse_args(argv)

    sets: dict[str, dict] = {}
    try:  # a wrong path or model is the user's mistake: say so, exit 2
        source = load_source(args.source, with_tokenizer=False).model
        pit = load_pit_model(args.pit)
    except PitError as exc:
        parser.error(str(exc))
    sets["source body (unconverted)"] = measure(body_linears(source))
    del source
    sets["preserve-converted body"] = measure(body_linears(pit))
    interface = find_interface(pit)
    z = interface.Z.detach().to(torch.float32).numpy()
    sets["PIT Z (rows)"] = measure([z])
    _, w_out = interface.materialize()
    sets["materialized W_out (rows of W_outᵀ)"] = measure([w_out.T.to(torch.float32).numpy()])
    del pit, interface, z, w_out
    for family in FAMILIES:
        sets[f"tiny {family} body (random)"] = measure(body_linears(tiny_model(family)))
    for name, row in sets.items():
        print(f"{name:40s} on_grid {row['on_grid']:.3f}  q4_1 {row['rel_err_q4_1']:.4f}  "
              f"ort {row['rel_err_ort']:.4f}  sym {row['rel_err_sym']:.4f}")
    return write_result(args.out, {"source": args.source, "pit": args.pit, "block": BLOCK,
                                    "machine": {"platform": platform.platform()}, "sets": sets}, __file__, argv)


if __name__ == "__main__":
    raise SystemExit(main())

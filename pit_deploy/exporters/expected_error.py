"""The quantization error an artifact is *expected* to have, measured at export without it.

A quantized artifact is judged by the KL divergence of its runtime's next-token distributions
from the fp32 reference. Absolute bounds set on one model mean little on another: on a tiny
random model an artifact whose body weights are random bytes measured a smaller mean KL than
the default model's honest int4 artifact. So the export also measures, for every quantized
artifact, what its quantization grid alone costs on this very model: the fp32 model the
exporter was given (materialized or factorized), its weights rounded *in PyTorch* to the
scheme's grid by the code below, run in eager mode on the manifest's held-out blocks and
compared with the fp32 reference by the same figures ``verify`` uses
(:func:`pit_deploy.data.heldout.kl_parity`). ``verify`` then bounds the runtime's KL by a
multiple of it (:meth:`pit_deploy.schemes.QuantizedBounds.scaled_kl_bound`).

It is independent of the artifact on purpose: nothing here runs, reads or reuses the exported
file or the exporters' quantizers (onnxruntime's, torchao's), so a broken exporter cannot set
its own bar. What is reproduced, from the scheme and the target's
:class:`~pit_deploy.targets.base.WeightGrid`:

* every body linear (``nn.Linear``; GPT-2's ``Conv1D`` where the target quantizes it) at the scheme's bits — 8 for ``int8``
  and for the ``int4_8bit_layers`` of ``int4``, else 4 — in groups of ``group_size`` along the
  input dimension (one group per output channel for a target's 8-bit linears where
  ``per_channel_8bit``);
* the token tables: the embedding's at ``embed_bits``, the head's at ``head_bits`` (0: fp32),
  in groups along ``d``; a factorized model's embedding multiplies the rounded ``Ẑ`` by
  ``M = (Ẑ_hᵀ Ẑ_e)⁻¹ T⁻¹`` where the scheme has the PIT correction, as the exporters do;
* the codes: asymmetric with an integer zero point and the range widened to hold 0
  (onnxruntime's ``MatMulNBits`` blocks), or symmetric ``q ∈ [−2^(b−1), 2^(b−1) − 1]`` with
  ``scale = max|w| / (2^(b−1) − 1)`` (XNNPACK).

A model calibrated by GPTQ (:mod:`.calibrated_rounding`) already holds its rounded body
weights — codes the exporter writes as they are — so its body linears are taken as they are and
only its token tables are rounded here; the runtime's KL is then bounded relative to the
calibrated model's own.

What is not reproduced — the reasons the runtime's KL is a multiple of this one, which the
bounds' factor allows for (``docs/quantization.md``, "Verification bounds"): activations (both runtimes
quantize a linear's input to int8 per token or per block at run time); torchao's HQQ scale
search for 4-bit XNNPACK weights (min/max scales here, a slightly larger weight error); the
random rotation of a quantized ``.pte`` head and its GPTQ rounding (the head's table is rounded
unrotated and to nearest here, a larger error than the calibrated table's);
onnxruntime's and XNNPACK's storage of scales (bfloat16 group scales in XNNPACK).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from ..errors import PitError
from ..model.core import row_chunks
from ..model.modules import PITEmbedding, PITHead
from ..model.quantized_interface import correction_matrix
from ..schemes import Scheme
from ..targets.base import WeightGrid
from .passes import PITFactors
from .residual_rotation import rotation_of

#: bits of the body linears of each quantized dtype
BODY_BITS = {"int8": 8, "int4": 4}
METHOD = ("fp32 model with its weights rounded in PyTorch to the scheme's grid (body linears, "
          "token tables; activations not quantized), eager, against the fp32 reference on the "
          "manifest's held-out blocks")


def fake_quantize(weight: torch.Tensor, bits: int, group: int | None, symmetric: bool,
                  full_range: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``weight`` ``(rows, K)`` rounded to ``bits``-bit codes in groups of ``group`` along ``K``
    (``None``: one group a row) and dequantized, in ``dtype`` (default ``weight``'s; computed in
    float64, by chunks of rows, so a 262,144-token table never has a float64 copy whole).
    ``full_range`` (symmetric only): ``scale = max|w| / 2^(b−1)`` (onnxruntime) instead of
    ``max|w| / (2^(b−1) − 1)``.

    Raises:
        PitError: ``group`` does not divide ``K``.
    """
    rows, k = weight.shape
    g = k if group is None else group
    if k % g:
        raise PitError(f"group size {g} does not divide the input dimension {k}")
    out = torch.empty(rows, k, dtype=dtype or weight.dtype)
    for part, chunk in row_chunks(weight):
        out[part] = _fake_quantize_rows(chunk, bits, g, symmetric, full_range)
    return out


def _fake_quantize_rows(w: torch.Tensor, bits: int, g: int, symmetric: bool, full_range: bool) -> torch.Tensor:
    """:func:`fake_quantize` of float64 rows ``w``, in float64."""
    rows, k = w.shape
    blocks = w.reshape(rows, k // g, g)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = blocks.abs().amax(-1, keepdim=True) / (qmax + 1 if full_range else qmax)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        out = torch.round(blocks / scale).clamp(-qmax - 1, qmax) * scale
    else:
        levels = 2**bits - 1
        low = blocks.amin(-1, keepdim=True).clamp(max=0.0)
        high = blocks.amax(-1, keepdim=True).clamp(min=0.0)
        scale = (high - low) / levels
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.round(-low / scale).clamp(0, levels)
        out = ((torch.round(blocks / scale) + zero).clamp(0, levels) - zero) * scale
    return out.reshape(rows, k)


class _RoundedFactors(nn.Module):
    """A factorized interface with a table on each side: ``embed = Ẑ_e[ids] M``,
    ``logits = (h T) Ẑ_hᵀ`` (the token-interface protocol of :mod:`pit_deploy.model.modules`)."""

    def __init__(self, head_rows: torch.Tensor, embed_rows: torch.Tensor, t: torch.Tensor, m: torch.Tensor):
        super().__init__()
        self.register_buffer("Zh", head_rows)
        self.register_buffer("Ze", embed_rows)
        self.register_buffer("T", t)
        self.register_buffer("M", m)

    @property
    def vocab_size(self) -> int:
        return self.Zh.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.Zh.shape[1]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.Ze[input_ids] @ self.M

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.T) @ self.Zh.T


def _linear_group(bits: int, scheme: Scheme, grid: WeightGrid) -> int | None:
    return None if bits == 8 and grid.per_channel_8bit else scheme.group_size


def _table_grid(bits: int, scheme: Scheme, grid: WeightGrid, linear: bool) -> tuple[int, int | None]:
    """``(bits, group)`` of a token table's rounding (bits 0: unchanged); ``linear``: read by a
    linear (the head), whose 8-bit weights may take one scale a row."""
    return bits, (_linear_group(bits, scheme, grid) if linear else scheme.group_size) if bits else None


def _round_table(rows: torch.Tensor, bits: int, group: int | None, grid: WeightGrid) -> torch.Tensor:
    """A token table ``(V, d)`` rounded at ``bits`` in groups of ``group`` (bits 0: unchanged), a
    new tensor in ``rows``' dtype: the values the rounded model computes with (and the PIT
    correction is computed from), as a runtime holds its dequantized table."""
    if not bits:
        return rows.clone()
    return fake_quantize(rows, bits, group, grid.tables_symmetric, grid.full_range)


@torch.no_grad()
def rounded_model(prepared: PreTrainedModel, scheme: Scheme, grid: WeightGrid) -> PreTrainedModel:
    """A copy of the prepared fp32 model with its weights rounded to ``scheme`` on ``grid``
    (see the module docstring); ``prepared`` is not changed."""
    from transformers.pytorch_utils import Conv1D

    if scheme.dtype not in BODY_BITS:
        raise ValueError(f"rounded_model takes a quantized scheme, got {scheme.dtype!r}")
    from .calibrated_rounding import copy_for_rounding, rounded_weights

    model = copy_for_rounding(prepared).eval()
    calibrated = rounded_weights(model)
    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    for name, module in model.named_modules():
        if module is head or name in calibrated or not isinstance(module, (nn.Linear, Conv1D)) or \
                (isinstance(module, Conv1D) and not grid.conv1d):
            continue
        bits = BODY_BITS[scheme.dtype]
        if bits == 4 and scheme.keeps_8bit(name):
            bits = 8
        group = _linear_group(bits, scheme, grid)
        weight = module.weight  # nn.Linear (out, in); Conv1D (in, out)
        if isinstance(module, Conv1D):
            weight.copy_(fake_quantize(weight.T, bits, group, grid.symmetric, grid.full_range).T)
        else:
            weight.copy_(fake_quantize(weight, bits, group, grid.symmetric, grid.full_range))
    if isinstance(embedding, PITEmbedding) and isinstance(embedding.interface, PITFactors):
        factors = embedding.interface
        z = factors.Zt.T
        head_grid = _table_grid(grid.head_bits, scheme, grid, linear=True)
        embed_grid = _table_grid(grid.embed_bits, scheme, grid, linear=False)
        zh = _round_table(z, *head_grid, grid)
        ze = zh if embed_grid == head_grid else _round_table(z, *embed_grid, grid)  # one table where they agree
        t = factors.T.to(torch.float64)
        if scheme.pit_correction:
            m = torch.from_numpy(correction_matrix(zh.numpy(), ze.numpy(), t.numpy()))
            rotation = rotation_of(model)  # a rotated stream takes Q after the correction, as the exporter's
            if rotation is not None:
                m = m @ rotation.to(torch.float64)
        else:
            m = factors.T_inv.to(torch.float64)  # holds a rotation already
        dtype = factors.T.dtype
        tables = _RoundedFactors(zh, ze, factors.T.clone(), m.to(dtype))
        model.expected_error_factors = tables  # registered, so .to()/.eval() reach it
        model.set_input_embeddings(PITEmbedding(tables, embedding.multiplier))
        model.set_output_embeddings(PITHead(tables, head.multiplier, head.bias))
        return model
    if isinstance(embedding, nn.Embedding):
        rows = _round_table(embedding.weight, *_table_grid(grid.embed_bits, scheme, grid, linear=False), grid)
        embedding.weight = nn.Parameter(rows, requires_grad=False)  # unties a tied head
    if isinstance(head, nn.Linear):
        rows = _round_table(head.weight, *_table_grid(grid.head_bits, scheme, grid, linear=True), grid)
        head.weight = nn.Parameter(rows, requires_grad=False)
    return model


@torch.no_grad()
def expected_error(prepared: PreTrainedModel, reference: PreTrainedModel, blocks: list[list[int]],
                   scheme: Scheme, grid: WeightGrid) -> dict[str, Any] | None:
    """The manifest's ``expected`` entry of one quantized artifact: ``kl_mean``, ``kl_p99``,
    ``same_top1``, ``ppl_ratio`` of :func:`rounded_model` against ``reference`` on ``blocks``,
    and the ``method``; ``None`` if the rounded model's figures are not finite (nothing to
    scale a bound by: ``verify`` then keeps the scheme's absolute bounds and says so)."""
    from ..data.heldout import kl_parity
    from ..runtime.torch_driver import TorchDriver
    from .calibrated_rounding import rounded_weights

    figures = kl_parity(TorchDriver(model=rounded_model(prepared, scheme, grid)), reference, blocks)
    values = {"kl_mean": figures.kl_mean, "kl_p99": figures.kl_p99, "same_top1": figures.same_top1,
              "ppl_ratio": figures.ppl_ratio}
    if not all(math.isfinite(v) for v in values.values()):
        return None
    tables = grid.tables_symmetric
    grid_text = (f"{'symmetric' if grid.symmetric else 'asymmetric, integer zero point'}"
                 f"{' (max|w| at 2^(b-1))' if grid.symmetric and grid.full_range else ''}"
                 f"{'' if tables == grid.symmetric else '; tables ' + ('symmetric' if tables else 'asymmetric')}; groups of "
                 f"{scheme.group_size}{' (8-bit linears per channel)' if grid.per_channel_8bit else ''}; "
                 f"head table {grid.head_bits or 'fp32'} bits, embedding table {grid.embed_bits or 'fp32'} bits")
    if rounded_weights(prepared):
        grid_text += "; body linears: the GPTQ codes the artifact stores"
    return {**{k: float(v) for k, v in values.items()}, "tokens": figures.tokens,
            "method": f"{METHOD} ({grid_text})"}

"""A quantized head for factorized ExecuTorch programs, behind a rotation of the token memory.

XNNPACK lowers a quantized linear only with int8 *dynamic activations*: the input of each call is
quantized per token (one scale over all ``d`` channels) before the integer product
(``docs/quantization.md``; a weight-only quantized linear lowers without error and computes
wrong numbers). Such a head reads ``u = h T`` — a final hidden state with outlier channels —
so the rounding of ``u`` is what a quantized head costs, not the rounding of its weights.

PIT gives that problem a free remedy. For any orthogonal ``R`` (d×d),

    logits = h T Zᵀ = (h T R) (Z R)ᵀ,

and ``Z R`` still has orthonormal columns: the factorized head becomes one fp32 ``d×d`` matmul by
``T R`` followed by a quantized linear over the rotated table ``Z R``. A random rotation spreads
every outlier of ``u`` over all channels (QuaRot, Ashkboos et al. 2024, "Outlier-Free 4-Bit
Inference in Rotated LLMs"; SpinQuant, Liu et al. 2024), so one int8 scale per token loses
little: on the default model the rotation flattens the input's outliers and cuts the mean KL
a quantized head adds to its int4 program, at 8 and at 4 bits (PyTorch eager,
``studies/pte_head_rotation.py``; the lowered programs measure the same; figures in
``studies/pte-head-and-table.md``). With transpose tying the head reads the table the
embedding reads, so a rotation has to turn the whole residual stream (QuaRot folds the norms and
rotates every layer); in the factorized PIT head it is local: only ``T`` and ``Z`` change.

The interface identity then holds for the *weights*: with ``Ẑ_h`` the head's dequantized rows,
``Ẑ_e`` the embedding's rows and ``M = (Ẑ_hᵀ Ẑ_e)⁻¹ (T R)⁻¹`` on the input side,
``(T R) Ẑ_hᵀ Ẑ_e M = I`` (:func:`pit_deploy.model.quantized_interface.correction_matrix`).

It holds on the runtime too, because the ``d×d`` matrix is not exactly ``T R``. Any invertible
``S`` works in its place — ``h T Zᵀ = (h S)(Z T S⁻ᵀ)ᵀ`` — so ``S`` is ``T R`` with each row moved
onto the grid XNNPACK's dynamic quantization puts it on (:func:`int8_grid_rows`: ``c · n`` with
integers ``n`` spanning exactly 255 steps and including 0). XNNPACK quantizes each input row
asymmetrically over its range (``[min(x, 0), max(x, 0)]`` in 255 steps, an integer zero point), so
a row of ``S`` passes through that rounding unchanged: the head applied to a basis vector — what
``verify`` measures ``W_out`` with — is exactly ``S Ŷᵀ`` (measured 6e-8 relative through the
lowered linear), and ``W_out E = I`` holds on the runtime to float32 rounding. The table is
``Y = Z T S⁻ᵀ``, which is ``Z R`` up to that snapping (still well conditioned; ``T`` itself has a
large condition number, which is why the table cannot be ``Z T``: its rounding would erase the
directions ``T⁻¹`` amplifies). On a general hidden state the head still rounds ``h S`` per token:
that is a quantization error of the logits, measured by ``verify``'s KL figures, not of the
interface.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ...model.core import rotate_rows
from ...model.quantized_interface import table_map

#: seed of the rotation: the same model exports to the same program
ROTATION_SEED = 0


def int8_grid_rows(a: torch.Tensor) -> torch.Tensor:
    """``a`` (float64, ``n×d``) with each row moved to the nearest point ``c · k`` (``k`` integers)
    of the grid XNNPACK's asymmetric per-row int8 quantization represents exactly.

    XNNPACK quantizes a row ``x`` over ``[min(x, 0), max(x, 0)]`` in 255 steps with an integer zero
    point. With ``c`` that range over 255 and ``k = round(x / c)``, the row's extremes land on
    integers exactly 255 apart (``round(u) − round(u − 255) = 255``), 0 stays on the grid, and
    every entry moves by at most ``c / 2``: the quantizer's step is ``c`` again and its codes are
    ``k``, so nothing is rounded."""
    out = torch.zeros_like(a, dtype=torch.float64)
    for i, row in enumerate(a.to(torch.float64)):
        lo, hi = min(float(row.min()), 0.0), max(float(row.max()), 0.0)
        if hi > lo:  # a zero row stays zero (its scale is 1 by XNNPACK's convention)
            step = (hi - lo) / 255
            out[i] = torch.round(row / step) * step
    return out


def head_factors(t: torch.Tensor, seed: int | None = ROTATION_SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S, M)`` of the rotated head, float64: ``S = T R`` on the int8 grid of its rows (the
    head's ``d×d`` factor as the program stores it; ``R`` the seeded rotation, ``I`` for
    ``seed=None``) and ``M = T S⁻ᵀ`` (= ``R`` when ``S = T R`` exactly), the table's map from
    ``Z``: ``Y = Z M`` (:func:`rotated_table`), so ``h S Yᵀ = h T Zᵀ``."""
    d = t.shape[0]
    rotation = torch.eye(d, dtype=torch.float64) if seed is None else random_rotation(d, seed)
    s = int8_grid_rows(t.to(torch.float64) @ rotation)
    return s, table_map(s, t)


def rotated_table(zt: torch.Tensor, table_map: torch.Tensor) -> torch.Tensor:
    """``Y = Z M`` ``(V, d)`` in float64 from ``Zᵀ`` ``(d, V)`` and ``M`` of
    :func:`head_factors`: the table a rotated quantized head and its gather read. By row chunks
    (the same products, row for row): ``Zᵀ`` is never copied to float64 whole (1.3 GB at a
    262,144-token vocabulary)."""
    return rotate_rows(zt.T, table_map, dtype=torch.float64)


def random_rotation(d: int, seed: int = ROTATION_SEED) -> torch.Tensor:
    """A Haar-random orthogonal ``d×d`` matrix in float64 (QR of a seeded Gaussian, signs fixed
    by the diagonal of ``R`` so the draw is uniform; Mezzadri 2007)."""
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


class RotatedQuantizedHead(nn.Module):
    """``h ↦ (h · S) Yᵀ``: an fp32 ``d×d`` matmul by ``S`` (``T R`` on XNNPACK's int8 grid,
    :func:`int8_grid_rows`), then a torchao-quantized ``nn.Linear`` whose weight is
    ``Y = Z T S⁻ᵀ ≈ Z R`` (``V×d``), which XNNPACK runs with int8 dynamic activations.

    Implements the token-interface protocol's ``logits`` (the head side only: the embedding of a
    quantized program is :class:`pit_deploy.targets.executorch.token_table.QuantizedRows`).
    """

    def __init__(self, zt: torch.Tensor, t: torch.Tensor, bits: int, group_size: int,
                 seed: int | None = ROTATION_SEED):
        """``seed=None``: no rotation (``R = I``), to measure what the rotation buys."""
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"a quantized head has 4 or 8 bits, got {bits!r}")
        d, v = zt.shape
        self.bits, self.group_size, self.seed = int(bits), int(group_size), seed
        self.calibrated = False  # GPTQ codes (round_calibrated) in place of torchao's rounding
        s, self.rotation = head_factors(t, seed)  # (the map a plain attribute, not part of the program)
        self.register_buffer("TR", s.to(torch.float32))
        self.linear = nn.Linear(d, v, bias=False)
        with torch.no_grad():
            self.linear.weight.copy_(self.rotated_rows(zt).to(torch.float32))
        self.linear = _quantized(self.linear, bits, group_size)

    @property
    def hidden_size(self) -> int:
        return self.TR.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.linear.weight.shape[0]

    def rotated_rows(self, zt: torch.Tensor) -> torch.Tensor:
        """``Y = Z T S⁻ᵀ`` ``(V, d)`` in float64 from ``Zᵀ`` ``(d, V)``: the table the head
        quantizes (and the embedding's, so both sides read the same rows). Computed when asked,
        not kept: a ``V×d`` float64 table, twice the size of the fp32 ``Zᵀ``."""
        return rotated_table(zt, self.rotation)

    @torch.no_grad()
    def round_calibrated(self, zt: torch.Tensor, moments: torch.Tensor) -> None:
        """Re-round the table ``Y`` by GPTQ (:func:`pit_deploy.exporters.calibrated_rounding.gptq`)
        in place of torchao's round-to-nearest, on the same grid: symmetric 4-bit codes with a
        bfloat16 scale a group, or 8-bit codes with one scale a row.

        ``moments`` is ``Σ hᵀh`` of the hidden states the head reads on calibration text
        (:func:`~pit_deploy.exporters.calibrated_rounding.head_moments`); the linear reads ``u = h S``,
        so its inputs' second moments are ``Sᵀ (Σ hᵀh) S``. Each row's rounding error is moved
        along the directions ``u`` rarely takes, which leaves the logits on real text closer to
        the fp32 head's. The interface is unaffected: the embedding's correction is computed from
        whatever codes the head holds (:func:`pit_deploy.targets.executorch.token_table.quantize_token_table`).
        """
        from ...exporters.calibrated_rounding import RoundingGrid, gptq

        s = self.TR.to(torch.float64)
        grid = RoundingGrid(self.bits, self.group_size if self.bits == 4 else None, symmetric=True)
        rounded = gptq(self.rotated_rows(zt), s.T @ moments.to(torch.float64) @ s, grid)
        weight = self.linear.weight
        if weight.qdata.shape != rounded.codes.shape or weight.scale.numel() != rounded.scales.numel():
            raise RuntimeError(f"the head's GPTQ codes {tuple(rounded.codes.shape)} / scales "
                               f"{tuple(rounded.scales.shape)} do not fit its quantized linear")
        weight.qdata.copy_(rounded.codes.to(weight.qdata.dtype))
        weight.scale.copy_(rounded.scales.reshape(weight.scale.shape).to(weight.scale.dtype))
        weight.zero_point.zero_()
        self.calibrated = True

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden @ self.TR)

    def dequantized_rows(self) -> np.ndarray:
        """``q · s`` of the quantized weight in float64 (``V×d``) from :meth:`stored_codes`: what
        the kernel multiplies by."""
        q, scale = self.stored_codes()
        v, d = q.shape
        return (q.reshape(v, scale.shape[1], -1).astype(np.float64) * scale[..., None]).reshape(v, d)

    def stored_codes(self) -> tuple[np.ndarray, np.ndarray]:
        """The quantized weight as XNNPACK stores it: signed codes ``(V, d)`` (int8) and scales
        ``(V, groups)`` as float32 values, bfloat16-rounded for grouped (4-bit) weights (its
        serializer casts them: ``backends/xnnpack/operators/node_visitor.py``), float32 for
        per-channel ones (one a row)."""
        weight = self.linear.weight
        if bool((weight.zero_point != 0).any()):
            raise RuntimeError("the head's weights were quantized with a zero point; XNNPACK has none")
        scale = weight.scale.to(torch.bfloat16) if self.bits == 4 else weight.scale
        rows = weight.qdata.shape[0]
        return (weight.qdata.to(torch.int8).numpy(), scale.to(torch.float32).reshape(rows, -1).numpy())

    def transform(self) -> np.ndarray:
        """``S`` as the program stores it (float32 values, in float64)."""
        return self.TR.to(torch.float64).numpy()

    def describe(self) -> str:
        calibrated = "GPTQ against the head input's second moments"
        weights = (f"per-channel int8 weights (8da8w, {calibrated if self.calibrated else 'round to nearest'})"
                   if self.bits == 8 else f"symmetric int4 weights in groups of {self.group_size}, "
                   f"{calibrated if self.calibrated else 'HQQ scale-only scales'} (8da4w)")
        rotation = "R = I (no rotation)" if self.seed is None else f"R a seeded random rotation (seed {self.seed})"
        return (f"Y = Z T S⁻ᵀ through a quantized linear: {weights}, int8 dynamic activations per token; "
                f"S = T R on the int8 grid of its rows, float32; {rotation}")


def xnnpack_linear_config(bits: int, group_size: int):
    """torchao's ``Int8DynamicActivationIntxWeightConfig`` as the exporter uses it: int8 dynamic
    activations with per-channel int8 weights (``8da8w``) or symmetric int4 weights in groups of
    ``group_size`` with HQQ scale-only scales (``8da4w``; XNNPACK's 4-bit kernels have no zero
    point — ``docs/quantization.md``)."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quantize_.workflows import IntxChooseQParamsAlgorithm

    if bits == 8:
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))
    return Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4, weight_granularity=PerGroup(group_size),
        intx_choose_qparams_algorithm=IntxChooseQParamsAlgorithm.HQQ_SCALE_ONLY)


def _quantized(linear: nn.Linear, bits: int, group_size: int) -> nn.Module:
    """``linear`` with the scheme of the program's other linears
    (:func:`pit_deploy.targets.executorch.export.quantize_linears`)."""
    from torchao.quantization import quantize_

    holder = nn.Sequential(linear)
    quantize_(holder, xnnpack_linear_config(bits, group_size))
    return holder[0]

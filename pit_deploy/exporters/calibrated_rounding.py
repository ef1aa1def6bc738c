"""Calibrated rounding of a model's body linears (GPTQ), done once in PyTorch before export.

Plain round-to-nearest 4-bit weights cost the default model ≥ 0.3 nats/token whatever the grid
(``docs/quantization.md``). GPTQ (Frantar et al., 2023, "GPTQ: Accurate Post-Training
Quantization for Generative Pre-trained Transformers", arXiv:2210.17323) rounds a linear's input
columns one at a time and moves each column's rounding error onto the columns not yet rounded,
weighted by the inverse of the second moments ``H = Σ x xᵀ`` of the inputs the layer sees on
calibration text: the error left is the one the layer's *outputs* feel least. The columns are
visited in order, in lazy blocks of 128; a group's scale is chosen when its first column is
reached, from the weights as the earlier columns' errors have moved them, by a search over
clipping ratios.

Why here and not in a runtime's quantizer: the result is a set of integer codes and scales
(:class:`RoundedWeight`) that the exporter writes as they are (the ``.pte``'s 8da4w linears,
the ONNX ``MatMulNBits`` blocks), so the fp32 model with the dequantized weights is the eager
twin of the artifact. XNNPACK reads symmetric codes in ``[−2^(b−1), 2^(b−1) − 1]`` with
one scale per group of ``group`` input columns (one per row for XNNPACK's 8-bit linears), the
scales rounded to bfloat16 because XNNPACK stores them so; onnxruntime's ``MatMulNBits`` takes
unsigned codes with an integer zero point and float32 scales, so for the ONNX targets the grid is
that one (:class:`RoundingGrid`), and the two runtimes get the same *method*, each on its grid.

Calibration is sequential by decoder layer: the inputs of layer ``i``'s linears are collected
with layers ``< i`` already rounded, so each layer corrects for the error before it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from torch import nn

from ..errors import PitError

#: columns rounded between two updates of the columns after them (GPTQ's lazy batch)
BLOCK = 128
#: dampening added to the diagonal of ``H``, as a fraction of its mean
DAMP = 0.01
#: clipping ratios searched for each group's scale (``1.0``: the group's largest weight on the grid's end)
CLIP_RATIOS = (1.0, 0.96, 0.92, 0.88, 0.84, 0.80, 0.76)
#: rows GPTQ rounds at a time (:func:`gptq`): a 16,384-row chunk of float64 is 84 MB at d = 640
ROW_CHUNK = 16_384
#: where :func:`gptq` reports its progress over a matrix of more than one row chunk (a token
#: table: minutes at a 262k vocabulary), set for an export by :func:`rounding_progress`
_PROGRESS: ContextVar[Callable[[str], None] | None] = ContextVar("gptq_progress", default=None)


@contextmanager
def rounding_progress(log: Callable[[str], None] | None) -> Iterator[None]:
    """Within the block, :func:`gptq` of a matrix of more than :data:`ROW_CHUNK` rows (the token
    tables the exporters round deep inside a target's export) reports each chunk to ``log``:
    ``GPTQ of a 262,144-row table: 16,384/262,144 rows, 9 s, about 2 min 15 s left``."""
    token = _PROGRESS.set(log)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


@dataclass(frozen=True)
class RoundingGrid:
    """Where a linear's weights may land: ``bits`` (4 or 8), ``group`` input columns a scale
    (``None``: one scale a row); ``symmetric`` codes in ``[−2^(b−1), 2^(b−1) − 1]`` (``[−127,
    127]`` at 8 bits) with bfloat16 scales (XNNPACK), or unsigned codes ``[0, 2^b − 1]`` with
    an integer zero point and float32 scales (onnxruntime's ``MatMulNBits``)."""

    bits: int
    group: int | None
    symmetric: bool = True

    @property
    def qmin(self) -> int:
        if not self.symmetric:
            return 0
        return -(2 ** (self.bits - 1)) if self.bits == 4 else -(2 ** (self.bits - 1) - 1)

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1 if self.symmetric else 2 ** self.bits - 1


@dataclass
class RoundedWeight:
    """One linear's rounded weight: ``codes`` ``(out, in)`` on ``grid`` (int16), ``scales``
    float32 and ``zeros`` (integer zero points; 0 on a symmetric grid) ``(out, in / group)``
    (``(out, 1)`` per row). The weight is ``(codes − zero) · scale``."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    grid: RoundingGrid

    def dequantize(self) -> torch.Tensor:
        """``(codes − zero) · scale`` in float32 (what the runtimes compute from the stored codes)."""
        out, cols = self.codes.shape
        per = cols // self.scales.shape[1]
        q = self.codes.to(torch.float32).reshape(out, -1, per) - self.zeros.to(torch.float32)[..., None]
        return (q * self.scales[..., None]).reshape(out, cols)

    def rows(self, start: int, stop: int) -> "RoundedWeight":
        """Output rows ``start:stop`` (one part of a fused linear, such as Phi-3's gate of
        ``gate_up_proj``), on the same grid."""
        return RoundedWeight(self.codes[start:stop], self.scales[start:stop], self.zeros[start:stop], self.grid)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def _candidates(w: torch.Tensor, grid: RoundingGrid) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, zeros)`` ``(candidates, rows, 1)`` to search, all at once: each clipping ratio of
    :data:`CLIP_RATIOS`, and on a symmetric grid the largest weight on either end (candidate
    ``2k`` and ``2k + 1`` for ratio ``k``)."""
    if grid.symmetric:
        amax = w.abs().amax(1, keepdim=True).clamp(min=1e-12)
        ratio = torch.tensor([r for r in CLIP_RATIOS for _ in (0, 1)], dtype=w.dtype)[:, None, None]
        end = torch.tensor([e for _ in CLIP_RATIOS for e in (grid.qmax, -grid.qmin)], dtype=w.dtype)[:, None, None]
        scale = _bf16(ratio * amax / end).clamp(min=1e-30)
        return scale, torch.zeros_like(scale)
    low, high = w.amin(1, keepdim=True).clamp(max=0.0), w.amax(1, keepdim=True).clamp(min=0.0)
    ratio = torch.tensor(CLIP_RATIOS, dtype=w.dtype)[:, None, None]
    scale = (ratio * (high - low) / grid.qmax).to(torch.float32).to(w.dtype).clamp(min=1e-30)
    return scale, torch.clamp(torch.round(-ratio * low / scale), 0, grid.qmax)


def _codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, grid: RoundingGrid) -> torch.Tensor:
    return torch.clamp(torch.round(w / scale) + zero, grid.qmin, grid.qmax)


def choose_params(w: torch.Tensor, grid: RoundingGrid) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero)`` ``(rows, 1)`` for each row of ``w`` ``(rows, cols)``: of the candidates
    (:func:`_candidates`), the one with the smallest squared rounding error (the first of equals).
    Every candidate is scored in one pass over a ``(candidates, rows, cols)`` stack: GPTQ calls
    this once per group, thousands of times a model, where a loop over candidates cost more in
    per-call overhead than in arithmetic."""
    scale, zero = _candidates(w, grid)
    if grid.symmetric:  # zero points are 0: adding and taking away 0.0 changes no error's bits
        err = (w - torch.clamp(torch.round(w / scale), grid.qmin, grid.qmax) * scale).square().sum(2, keepdim=True)
    else:
        err = (w - (_codes(w, scale, zero, grid) - zero) * scale).square().sum(2, keepdim=True)
    pick = torch.argmin(err, 0, keepdim=True)
    return scale.gather(0, pick)[0], zero.gather(0, pick)[0]


def _groups(cols: int, grid: RoundingGrid) -> int:
    per = cols if grid.group is None else grid.group
    if cols % per:
        raise PitError(f"group size {per} does not divide the input dimension {cols}")
    return per


def round_to_nearest(weight: torch.Tensor, grid: RoundingGrid) -> RoundedWeight:
    """Plain rounding on ``grid`` with the same scale search (the baseline GPTQ is measured against)."""
    w = weight.detach().to(torch.float64)
    out, cols = w.shape
    per = _groups(cols, grid)
    blocks = w.reshape(out * (cols // per), per)
    scale, zero = choose_params(blocks, grid)
    codes = _codes(blocks, scale, zero, grid)
    return RoundedWeight(codes.to(torch.int16).reshape(out, cols), scale.to(torch.float32).reshape(out, -1),
                         zero.to(torch.int16).reshape(out, -1), grid)


def gptq(weight: torch.Tensor, hessian: torch.Tensor, grid: RoundingGrid, act_order: bool = False) -> RoundedWeight:
    """GPTQ rounding of ``weight`` ``(out, in)`` given its inputs' second moments ``hessian``
    ``(in, in)`` (see the module docstring). Computed in float64.

    ``act_order``: visit the columns by decreasing ``H`` diagonal (GPTQ's "act-order": the
    largest inputs rounded first, while every other column can still absorb their error); the
    runtimes' groups are runs of adjacent columns, so each group's scale is then chosen up front
    from the unrounded weights ("static groups"). On the default model it does not beat the
    in-order default (``studies/gptq_variants.py``), which the exporters use.

    The rows are rounded :data:`ROW_CHUNK` at a time: each output row's rounding depends only on
    that row and ``H``, so the codes are those of one pass over the whole matrix, while the
    float64 working copies stay a chunk's size (a 262,144-token table in float64 is 1.3 GB, and
    the scale search holds several such stacks)."""
    out, cols = weight.shape
    per = _groups(cols, grid)
    h = hessian.detach().to(torch.float64).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else torch.arange(cols)
    if act_order:
        h = h[order][:, order]
    h += DAMP * torch.diagonal(h).mean() * torch.eye(cols, dtype=h.dtype)
    try:
        hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    except RuntimeError:  # numerically singular even after dampening: no error feedback to give
        return round_to_nearest(weight, grid)
    if out <= ROW_CHUNK:
        return _gptq_rows(weight, hinv, dead, order, grid, act_order, per)
    log, start = _PROGRESS.get(), time.perf_counter()
    result = None
    for first in range(0, out, ROW_CHUNK):
        part = _gptq_rows(weight[first:first + ROW_CHUNK], hinv, dead, order, grid, act_order, per)
        if result is None:  # the whole result allocated once, each chunk written into it
            result = RoundedWeight(*(torch.empty((out, *t.shape[1:]), dtype=t.dtype)
                                     for t in (part.codes, part.scales, part.zeros)), grid)
        for whole, rows in ((result.codes, part.codes), (result.scales, part.scales), (result.zeros, part.zeros)):
            whole[first:first + rows.shape[0]] = rows
        if log is not None:
            done = min(out, first + ROW_CHUNK)
            log(f"GPTQ of a {out:,}-row table: {done:,}/{out:,} rows, "
                f"{_time_left(time.perf_counter() - start, done, out)}")
    return result


def _gptq_rows(weight: torch.Tensor, hinv: torch.Tensor, dead: torch.Tensor, order: torch.Tensor,
               grid: RoundingGrid, act_order: bool, per: int) -> RoundedWeight:
    """GPTQ of some rows of a matrix, given the upper Cholesky factor ``hinv`` of the inverse
    of the (dampened, act-order permuted) second moments and the column ``order``."""
    w = weight.detach().to(torch.float64).clone()
    out, cols = w.shape
    # a group's scale is chosen inside one lazy block: groups are powers of two, so a block of
    # max(BLOCK, group) columns holds whole groups
    block = BLOCK if grid.group is None else max(BLOCK, per)
    w[:, dead] = 0.0
    scales = torch.zeros(out, cols // per, dtype=torch.float64)
    zeros = torch.zeros(out, cols // per, dtype=torch.float64)
    if act_order:
        scale, zero = choose_params(w.reshape(out * (cols // per), per), grid)
        scales[:], zeros[:] = scale.reshape(out, -1), zero.reshape(out, -1)
        w = w[:, order]
    elif grid.group is None:
        scales[:, :1], zeros[:, :1] = choose_params(w, grid)
    group_of = order // per
    # The column loop runs in numpy on transposed blocks (a column is a contiguous row): each
    # step is a handful of small vector operations, where numpy's per-call cost is a fraction of
    # torch's. The arithmetic is the same elementwise IEEE float64 operations in the same order
    # (round half to even in both), so the codes are the same bits as a torch loop's; the
    # block-to-block update stays one torch product, as before.
    hinv_np, scales_np, zeros_np = hinv.numpy(), scales.numpy(), zeros.numpy()
    codes_t = np.zeros((cols, out), dtype=np.float64)  # row c: the codes of input column c
    group_np, order_np = group_of.numpy(), order.numpy()
    qmin, qmax = float(grid.qmin), float(grid.qmax)
    for start in range(0, cols, block):
        stop = min(start + block, cols)
        w1 = w[:, start:stop].T.contiguous().numpy()  # (columns, out)
        err1 = np.zeros_like(w1)
        hinv1 = hinv_np[start:stop, start:stop]
        for i in range(stop - start):
            col = start + i
            if grid.group is not None and not act_order and col % per == 0:
                scale, zero = choose_params(torch.from_numpy(w1[i:i + per].T), grid)
                scales_np[:, col // per], zeros_np[:, col // per] = scale[:, 0].numpy(), zero[:, 0].numpy()
            scale, zero = scales_np[:, group_np[col]], zeros_np[:, group_np[col]]
            q = np.clip(np.rint(w1[i] / scale) + zero, qmin, qmax)
            codes_t[order_np[col]] = q
            err = (w1[i] - (q - zero) * scale) / hinv1[i, i]
            w1[i + 1:] -= hinv1[i, i + 1:, None] * err
            err1[i] = err
        w[:, stop:] -= torch.from_numpy(np.ascontiguousarray(err1.T)) @ hinv[start:stop, stop:]
    codes = torch.from_numpy(np.ascontiguousarray(codes_t.T))
    return RoundedWeight(codes.to(torch.int16), scales.to(torch.float32), zeros.to(torch.int16), grid)


class _Moments:
    """Accumulates ``Σ x xᵀ`` of a linear's inputs (float64) from a forward hook.

    Linears that read one tensor (``q_proj``, ``k_proj`` and ``v_proj`` the attention's input,
    ``gate_proj`` and ``up_proj`` the MLP's) share a :class:`_Products`, which forms ``xᵀx`` once
    for them all: the float64 products are most of calibration's arithmetic."""

    def __init__(self, cols: int, products: "_Products | None" = None):
        self.h = torch.zeros(cols, cols, dtype=torch.float64)
        self.n = 0
        self.products = products or _Products()

    def __call__(self, _module: nn.Module, args: tuple, _output: torch.Tensor) -> None:
        xtx, rows = self.products.of(args[0])
        self.h += xtx
        self.n += rows


class _Products:
    """``xᵀx`` (float64) of the last input tensor seen, kept with the tensor itself: a linear
    called on the very same tensor object, unchanged since (its version counter), reuses it
    (holding the tensor keeps its identity from being reused by another)."""

    def __init__(self) -> None:
        self.last: tuple[torch.Tensor, int, torch.Tensor, int] | None = None

    def of(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        if self.last is None or self.last[0] is not x or self.last[1] != x._version:
            flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
            self.last = (x, x._version, flat.T @ flat, flat.shape[0])
        return self.last[2], self.last[3]


class _Stop(Exception):
    """Raised by a hook to end a calibration forward once the first decoder layer's inputs are known."""


def _run_until(model: nn.Module, module: nn.Module, blocks: Iterable[torch.Tensor],
               capture: Callable[..., None], with_kwargs: bool = False) -> None:
    """Run ``model`` on each calibration block as far as ``module``: ``capture`` gets what
    ``module`` is called with (``args``, and ``kwargs`` when ``with_kwargs``), and the forward
    stops there."""

    def stop(_module: nn.Module, *called) -> None:
        capture(*called)
        raise _Stop

    hook = module.register_forward_pre_hook(stop, with_kwargs=with_kwargs)
    try:
        for ids in blocks:
            try:
                model(input_ids=ids, use_cache=False)
            except _Stop:
                pass
    finally:
        hook.remove()


class _LayerInputs:
    """What the first decoder layer is called with, per calibration block: the hidden states
    and the rest (position embeddings, masks), which every later layer is called with too. The
    layers are then run one at a time on these, so calibrating ``L`` layers costs about two
    forwards of the model, not ``L``."""

    def __init__(self, model: nn.Module, first: nn.Module, blocks: list[torch.Tensor]):
        self.calls: list[tuple[tuple, dict]] = []
        _run_until(model, first, blocks, lambda args, kwargs: self.calls.append((args, kwargs)), with_kwargs=True)

    def run(self, layer: nn.Module, advance: bool) -> None:
        """Call ``layer`` on every block's inputs; with ``advance``, its outputs become the
        next layer's hidden states."""
        for index, (args, kwargs) in enumerate(self.calls):
            out = layer(*args, **kwargs)
            if advance:
                hidden = out[0] if isinstance(out, (tuple, list)) else out
                if args:
                    args = (hidden, *args[1:])
                else:
                    kwargs = {**kwargs, "hidden_states": hidden}
                self.calls[index] = (args, kwargs)


@torch.no_grad()
def calibrate(model: nn.Module, blocks: Iterable[torch.Tensor], grid_of: Callable[[str], RoundingGrid | None],
              method: str = "gptq", log: Callable[[str], None] | None = None,
              act_order: bool = False) -> dict[str, RoundedWeight]:
    """Round the body linears of ``model`` in place, layer by layer; returns the codes by module name.

    ``grid_of(name)`` gives a linear's grid, or ``None`` to leave it in float32. ``blocks``: the
    calibration token ids, ``(1, S)`` tensors. ``method``: ``"gptq"`` or ``"rtn"`` (no
    calibration forward at all). ``act_order``: :func:`gptq`'s.
    """
    if method not in ("gptq", "rtn"):
        raise PitError(f"calibrated rounding: method must be gptq or rtn, got {method!r}")
    from ..model.families import adapter_for

    names = {m: n for n, m in model.named_modules()}
    layers = list(adapter_for(model.config).layers(model))
    rounded_any = any(isinstance(m, nn.Linear) and grid_of(names[m]) is not None for x in layers for m in x.modules())
    if not rounded_any:  # GPT-2's Conv1D body: nothing here for calibrated rounding to round
        return {}
    inputs = _LayerInputs(model, layers[0], list(blocks)) if method == "gptq" else None
    result: dict[str, RoundedWeight] = {}
    start = time.perf_counter()
    for index, layer in enumerate(layers):
        linears = {names[m]: m for m in layer.modules() if isinstance(m, nn.Linear) and grid_of(names[m]) is not None}
        products = _Products()
        moments = {n: _Moments(m.in_features, products) for n, m in linears.items()}
        if inputs is not None and linears:
            hooks = [m.register_forward_hook(moments[n]) for n, m in linears.items()]
            try:
                inputs.run(layer, advance=False)
            finally:
                for hook in hooks:
                    hook.remove()
        for name, module in linears.items():
            grid = grid_of(name)
            rounded = gptq(module.weight, moments[name].h, grid, act_order) if method == "gptq" else \
                round_to_nearest(module.weight, grid)
            module.weight.copy_(rounded.dequantize().to(module.weight.dtype))
            result[name] = rounded
        if inputs is not None and index + 1 < len(layers):
            inputs.run(layer, advance=True)  # the next layer sees this one's rounded outputs
        if log:
            log(progress_line(method, index + 1, len(layers), len(linears), time.perf_counter() - start))
    return result


def progress_line(method: str, done: int, total: int, linears: int, seconds: float) -> str:
    """``GPTQ: layer 3/30 (7 linears), 12 s, about 1 min 48 s left`` — the time left is the mean
    time of the layers done so far times the layers left (the layers are alike)."""
    return f"{method.upper()}: layer {done}/{total} ({linears} linears), {_time_left(seconds, done, total)}"


def _time_left(seconds: float, done: int, total: int) -> str:
    """``12 s, about 1 min 48 s left`` (the mean pace so far over what is left), ``… done`` at the end."""
    if done >= total:
        return f"{seconds:.0f} s, done"
    minutes, secs = divmod(round(seconds / done * (total - done)), 60)
    return f"{seconds:.0f} s, " + (f"about {minutes} min {secs} s left" if minutes else f"about {secs} s left")


#: the attribute of a calibrated model holding its :class:`RoundedWeight` codes by module name
ROUNDED_ATTR = "pit_rounded_weights"
#: the attribute of a calibrated model holding its calibration blocks (for :func:`head_moments`)
BLOCKS_ATTR = "pit_calibration_blocks"


def scheme_grids(model: nn.Module, scheme, weight_grid) -> Callable[[str], RoundingGrid | None]:
    """``grid_of`` of :func:`calibrate` for a quantized scheme on a target's
    :class:`~pit_deploy.targets.base.WeightGrid`: the body's ``nn.Linear`` layers (not the head)
    at 4 bits in groups of ``group_size``, the scheme's 8-bit layers (all of an ``int8``
    scheme's) at 8 bits, with one scale a row where the target's 8-bit linears take one (the
    ``.pte``'s ``8da8w``), symmetric or not as the target's body."""
    head = model.get_output_embeddings()
    head_names = {n for n, m in model.named_modules() if m is head}

    def grid_of(name: str) -> RoundingGrid | None:
        if name in head_names:
            return None
        if scheme.dtype == "int8" or scheme.keeps_8bit(name):
            return RoundingGrid(8, None if weight_grid.per_channel_8bit else scheme.group_size, weight_grid.symmetric)
        return RoundingGrid(4, scheme.group_size, weight_grid.symmetric)

    return grid_of


#: a tensor this large that rounding does not write is shared between a model and its rounded copies
SHARE_MIN_ELEMENTS = 1 << 20


def copy_for_rounding(prepared: nn.Module) -> nn.Module:
    """A deep copy of ``prepared`` whose linears' weights (``nn.Linear``, GPT-2's ``Conv1D``) are
    its own — calibration and the expected-error model write rounded weights into them in place —
    and whose other large tensors, the token table above all, are ``prepared``'s: nothing writes
    those in place (a rounded table is a new tensor), and a 262,144-token table is 671 MB a copy."""
    import copy
    import itertools

    from transformers.pytorch_utils import Conv1D

    written = {id(m.weight) for m in prepared.modules() if isinstance(m, (nn.Linear, Conv1D))}
    memo: dict[int, Any] = {id(t): t for t in itertools.chain(prepared.parameters(), prepared.buffers())
                            if id(t) not in written and t.numel() >= SHARE_MIN_ELEMENTS}
    return copy.deepcopy(prepared, memo)


def calibrated_model(prepared: nn.Module, scheme, weight_grid, blocks: list[torch.Tensor],
                     codes: dict[str, RoundedWeight] | None = None,
                     log: Callable[[str], None] | None = None, act_order: bool = False) -> nn.Module:
    """A copy of ``prepared`` whose body linears hold their GPTQ-rounded weights (dequantized,
    float32), with the codes in ``model.pit_rounded_weights`` for the exporters; ``prepared``
    is not changed. ``codes`` from an earlier call are reused as they are (the body of the
    materialized and the factorized model is the same: one calibration serves both).
    ``act_order``: :func:`gptq`'s."""
    model = copy_for_rounding(prepared).eval()
    if codes is None:
        codes = calibrate(model, blocks, scheme_grids(model, scheme, weight_grid), "gptq", log, act_order)
    else:
        with torch.no_grad():
            for name, rounded in codes.items():
                weight = model.get_submodule(name).weight
                weight.copy_(rounded.dequantize().to(weight.dtype))
    setattr(model, ROUNDED_ATTR, codes)
    setattr(model, BLOCKS_ATTR, list(blocks))
    return model


def rounded_weights(model: nn.Module) -> dict[str, RoundedWeight]:
    """The codes a calibrated model carries (empty for any other model)."""
    return getattr(model, ROUNDED_ATTR, None) or {}


@torch.no_grad()
def head_moments(model: nn.Module) -> torch.Tensor | None:
    """``Σ hᵀh`` (float64, ``d×d``) of the hidden states a calibrated model's output head reads on
    its calibration blocks, the body as rounded; ``None`` for a model without calibration blocks.

    This is what GPTQ weighs a quantized head's table by (:meth:`pit_deploy.targets.executorch.head.
    RotatedQuantizedHead.round_calibrated`): the head's logits are a linear in ``h``, so the
    error the table's rounding leaves in them is smallest along the directions ``h`` takes on
    real text. The forward stops at the head, whose ``V``-wide product is not needed."""
    blocks = getattr(model, BLOCKS_ATTR, None)
    head = model.get_output_embeddings()
    if not blocks or head is None:
        return None
    moments = _Moments(model.config.hidden_size)
    _run_until(model, head, blocks, lambda args: moments(head, args, None))
    return moments.h


def head_moments_array(model: nn.Module):
    """:func:`head_moments` as a float64 numpy array (or ``None``), for the ONNX targets, whose
    token tables are rounded in numpy (:func:`pit_deploy.exporters.onnx_tables.calibrated_table`)."""
    moments = head_moments(model)
    return None if moments is None else moments.numpy()


def split_fused(codes: dict[str, RoundedWeight]) -> dict[str, RoundedWeight]:
    """``codes`` with each equal-split fused linear (Phi-3's ``…mlp.gate_up_proj``) replaced by its
    parts under their own names (``…mlp.gate_proj``, ``…mlp.up_proj``): what a runtime that holds
    the parts as tensors of their own stores (onnxruntime-genai's builder)."""
    from ..model.families import EQUAL_SPLITS, FUSED_PROJECTIONS

    out: dict[str, RoundedWeight] = {}
    for name, rounded in codes.items():
        parent, _, leaf = name.rpartition(".")
        if leaf not in EQUAL_SPLITS:
            out[name] = rounded
            continue
        parts = FUSED_PROJECTIONS[leaf]
        rows = rounded.codes.shape[0] // len(parts)
        for j, part in enumerate(parts):
            out[f"{parent}.{part}" if parent else part] = rounded.rows(j * rows, (j + 1) * rows)
    return out


def calibrated_codes_field(model: Any, split: bool = False) -> dict[str, Any] | None:
    """``details.weight_codes`` of an artifact exported from the calibrated ``model``: one entry
    per calibrated linear, by module name, the parts of an equal-split fused linear by their own
    names when ``split`` (:func:`split_fused`; ``None``: the model carries no calibrated codes)."""
    from ..io.weight_codes import CODES_DIGEST, rounded_entry

    codes = rounded_weights(model)
    if not codes:
        return None
    codes = split_fused(codes) if split else codes
    return {"digest": CODES_DIGEST, "tensors": {name: rounded_entry(r) for name, r in codes.items()}}

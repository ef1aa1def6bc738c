"""The bounds a set of verification figures misses, as one line each (NaN misses every bound:
every comparison is written ``not x <= b``). Shared by x86 ``verify`` (:mod:`.verify`), its
compact aarch64 check (:mod:`.cross_isa`) and the transformers.js check."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..schemes import ParityBounds, QuantizedBounds

if TYPE_CHECKING:
    import torch

#: rows of logits the checks below widen or mask at a time (4 MiB a float64 row at 262,144 tokens)
ROWS = 4


def rel_l2(a: "torch.Tensor", b: "torch.Tensor", rows: int | None = None) -> float:
    """``‖a − b‖ / ‖b‖`` in float64 (the logits figure every fp32 bound is written for), the sums
    of squares taken :data:`ROWS` rows at a time: widening a prompt's whole logits to float64 three
    times over held 190 MiB more at a 262,144-token vocabulary. NaN if any difference is NaN."""
    import torch

    a, b = (t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(1, -1) for t in (a, b))
    diff = torch.zeros((), dtype=torch.float64)
    ref = torch.zeros((), dtype=torch.float64)
    rows = rows or ROWS
    for i in range(0, len(a), rows):
        x, y = a[i:i + rows].double(), b[i:i + rows].double()
        diff += (x - y).square().sum()
        ref += y.square().sum()
    return float(diff.sqrt() / ref.sqrt().clamp_min(1e-300))


def finite_by_rows(a: "torch.Tensor", rows: int | None = None) -> tuple["torch.Tensor", int]:
    """Whether each row of ``a`` is all finite, and how many of its values are not, :data:`ROWS`
    rows at a time: ``torch.isfinite`` of a whole block makes a float copy and three masks of it."""
    import torch

    masks, count, rows = [], 0, rows or ROWS
    for i in range(0, len(a), rows):
        finite = torch.isfinite(a[i:i + rows])
        masks.append(finite.all(-1))
        count += int(finite.numel() - finite.sum())
    return (torch.cat(masks) if masks else torch.ones(0, dtype=torch.bool)), count


def max_abs_diff(a: "torch.Tensor", b: "torch.Tensor", rows: int | None = None) -> float:
    """``max |a − b|`` in float64 over rows of logits, :data:`ROWS` rows at a time: the whole block
    widened to float64 three times over was 460 MiB at a 262,144-token vocabulary. NaN if any
    difference is NaN."""
    import torch

    rows = rows or ROWS
    peaks = [(a[i:i + rows].double() - b[i:i + rows].double()).abs().max() for i in range(0, len(a), rows)]
    return float(torch.stack(peaks).max())


def logit_failures(b: ParityBounds, rel_l2: float, top1: float) -> list[str]:
    """The fp32 logit bounds a figure set misses (NaN misses every bound)."""
    fails = []
    if not rel_l2 <= b.logits_rel_l2:
        fails.append(f"logits_rel_l2 {rel_l2:.3e} > {b.logits_rel_l2:g}")
    if not top1 >= b.top1_agreement:
        fails.append(f"top1_agreement {top1:.4%} < {b.top1_agreement:.0%}")
    return fails


def kl_failures(b: QuantizedBounds, kl_mean: float, kl_p99: float) -> list[str]:
    """The absolute KL bounds a quantized artifact's figures miss."""
    fails = []
    if not kl_mean <= b.kl_mean:
        fails.append(f"kl_mean {kl_mean:.4g} > {b.kl_mean:g}")
    if not kl_p99 <= b.kl_p99:
        fails.append(f"kl_p99 {kl_p99:.4g} > {b.kl_p99:g}")
    return fails


def agreement_failures(b: QuantizedBounds, same_top1: float, ppl_ratio: float) -> list[str]:
    """The top-1 and perplexity-ratio bounds a quantized artifact's figures miss."""
    fails = []
    if not same_top1 >= b.same_top1:
        fails.append(f"same_top1 {same_top1:.2%} < {b.same_top1:.0%}")
    if not ppl_ratio <= b.ppl_ratio:
        fails.append(f"ppl_ratio {ppl_ratio:.4f} > {b.ppl_ratio:g}")
    return fails

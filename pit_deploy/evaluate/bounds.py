"""Parity bounds per export dtype: what an artifact must meet on its runtime to pass.

FP32 bounds (``docs/definitions.md``, "Parity"): full-sequence and step-by-step logits within
relative L2 ``1e-4`` of the PyTorch reference, 100 % top-1 agreement, an identical 32-token
greedy continuation, and ``delta_ti ≤ 1e-5`` from the runtime's own embedding and head.

Quantized bounds (``docs/quantization.md``): the KL divergence of the runtime's next-token
distribution from the fp32 reference on the held-out set (mean and 99th percentile), the
same-top-1 rate, the perplexity ratio and — for factorized artifacts with the PIT correction —
``delta_ti``. The built-in values were set from the default model's measurements with a
stated margin; a recipe's ``[bounds.<dtype>]`` table overrides them. A new dtype is one
:func:`register_bounds` call.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ..errors import PitError


@dataclass(frozen=True)
class ParityBounds:
    """Bounds of an fp32 artifact. ``None`` means the figure is reported but not bounded."""

    logits_rel_l2: float | None = 1e-4
    top1_agreement: float | None = 1.0
    greedy_tokens: int = 32
    greedy_identical: bool = True
    delta_ti: float | None = 1e-5

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class QuantizedBounds:
    """Bounds of a quantized artifact (KL figures against the fp32 reference).

    ``delta_ti`` applies where the export claims an exact interface (factorized with the PIT
    correction, or with an unquantized table); for the others (materialized, uncorrected,
    tied) ``delta_ti`` is reported, not bounded.
    """

    kl_mean: float = 0.1
    kl_p99: float = 1.0
    same_top1: float = 0.8
    ppl_ratio: float = 1.2
    delta_ti: float = 1e-4

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Default-model measurements behind these values: docs/quantization.md ("Bounds").
BOUNDS: dict[str, ParityBounds | QuantizedBounds] = {
    "float32": ParityBounds(),
    "int8": QuantizedBounds(kl_mean=0.05, kl_p99=0.5, same_top1=0.85, ppl_ratio=1.1),
    "int4": QuantizedBounds(kl_mean=0.5, kl_p99=4.0, same_top1=0.6, ppl_ratio=1.6),
}


def register_bounds(dtype: str, bounds: ParityBounds | QuantizedBounds) -> None:
    BOUNDS[dtype] = bounds


def bounds_for(dtype: str, overrides: dict[str, Any] | None = None) -> ParityBounds | QuantizedBounds:
    """The bounds of ``dtype``, with a recipe's ``[bounds.<dtype>]`` values applied.

    Raises:
        PitError: an unknown dtype, or an override naming a field the bounds do not have.
    """
    try:
        base = BOUNDS[dtype]
    except KeyError:
        raise PitError(f"no parity bounds for dtype {dtype!r}; known: {', '.join(BOUNDS)}") from None
    if not overrides:
        return base
    names = {f.name for f in fields(base)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise PitError(f"bounds for {dtype} have no field(s) {unknown}; allowed: {', '.join(sorted(names))}")
    for key, value in overrides.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PitError(f"bounds.{dtype}.{key} must be a number, got {value!r}")
    return replace(base, **overrides)

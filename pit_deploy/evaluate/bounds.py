"""Parity bounds per export dtype: what an artifact must meet on its runtime to pass.

FP32 bounds (``docs/definitions.md``, "Parity"): full-sequence and step-by-step logits within
relative L2 ``1e-4`` of the PyTorch reference, 100 % top-1 agreement, an identical 32-token
greedy continuation, and ``delta_ti ≤ 1e-5`` from the runtime's own embedding and head.
A new dtype is one :func:`register_bounds` call.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..errors import PitError


@dataclass(frozen=True)
class ParityBounds:
    """Bounds of one dtype. ``None`` means the figure is reported but not bounded."""

    logits_rel_l2: float | None = 1e-4
    top1_agreement: float | None = 1.0
    greedy_tokens: int = 32
    greedy_identical: bool = True
    delta_ti: float | None = 1e-5

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


BOUNDS: dict[str, ParityBounds] = {"float32": ParityBounds()}


def register_bounds(dtype: str, bounds: ParityBounds) -> None:
    BOUNDS[dtype] = bounds


def bounds_for(dtype: str) -> ParityBounds:
    try:
        return BOUNDS[dtype]
    except KeyError:
        raise PitError(f"no parity bounds for dtype {dtype!r}; known: {', '.join(BOUNDS)}") from None

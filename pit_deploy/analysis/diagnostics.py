"""Token-interface diagnostics, in float64, as defined in ``docs/definitions.md``.

For an effective input embedding ``E`` (V×d) and head ``W_out`` (d×V, ``logits = h W_out``):

* ``delta_ti = ‖W_out E − I_d‖_F``.
* ``B_in = E``, ``B_out = W_out⁺ = W_outᵀ (W_out W_outᵀ)⁻¹`` (Moore–Penrose, through a d×d
  Cholesky; an SVD of the d×V head only if that Gram matrix is singular). Nothing V×V.
* ``cosine_distance``: mean over tokens of ``1 − cos(B_in[t], B_out[t])``.
* ``procrustes_error``: both bases scaled to unit Frobenius norm, then
  ``min_R orthogonal ‖B̂_in R − B̂_out‖_F`` (``R`` from the SVD of the d×d ``B̂_inᵀ B̂_out``).
* ``principal_angle``: mean per-token angle, ``2·atan2(‖a−b‖, ‖a+b‖)`` on unit vectors.

Extra, not in the paper's tables, computed only when asked (``extended=True``, CLI
``--extended``; it costs two more polar decompositions): ``polar_distance = ‖U_E − U_{W_outᵀ}‖_F / √d``, the distance
between the orthonormal polar factors of ``E`` and ``W_outᵀ``. Under exact transpose tying it
is 0 by construction (so it cannot show TT's drift); it is reported for completeness. Rows
where either basis vector is zero (padded vocabulary) are left out of the per-token means
and counted in ``degenerate_rows``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..io.fs import json_text
from ..model.inspect import effective_interface, find_interface
from ..model.core import polar_factor
from ..model.quantized_interface import identity_defect

METRIC_KEYS = ("delta_ti", "cosine_distance", "procrustes_error", "principal_angle")


@dataclass
class InterfaceReport:
    """Diagnostics of one model's token interface; prints, serializes to JSON."""

    vocab_size: int
    hidden_size: int
    tying: str
    delta_ti: float
    cosine_distance: float
    procrustes_error: float
    principal_angle: float
    degenerate_rows: int
    polar_distance: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(data.pop("extra"))
        return data

    def to_json(self, **kwargs: Any) -> str:
        return json_text(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        rows = [
            ("tying", self.tying),
            ("vocab_size × hidden_size", f"{self.vocab_size} × {self.hidden_size}"),
            ("delta_ti  ‖W_out E − I‖_F", f"{self.delta_ti:.4e}"),
            ("cosine_distance", f"{self.cosine_distance:.4e}"),
            ("procrustes_error", f"{self.procrustes_error:.4e}"),
            ("principal_angle (rad)", f"{self.principal_angle:.4e}"),
        ]
        if self.polar_distance is not None:
            rows.append(("polar_distance (extra)", f"{self.polar_distance:.4e}"))
        rows += [(k, f"{v:.4e}" if isinstance(v, float) else str(v)) for k, v in self.extra.items()]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def pseudo_inverse_rows(w_out: torch.Tensor) -> torch.Tensor:
    """``W_out⁺`` (V×d) for a d×V head, via the d×d Gram matrix's Cholesky factor."""
    w = w_out.to(torch.float64)
    gram = w @ w.T
    chol, info = torch.linalg.cholesky_ex(gram)
    pivots = torch.diagonal(chol)
    # A (numerically) singular Gram matrix can still factor with a tiny positive pivot;
    # pivot ratio² bounds its condition number from below, so refuse beyond ~1e14.
    if int(info) == 0 and pivots.min() > pivots.max() * 1e-7:
        return torch.cholesky_solve(w, chol).T
    return torch.linalg.pinv(w)  # rank-deficient head: SVD of the d×V matrix, still no V×V


def interface_metrics(e: torch.Tensor, w_out: torch.Tensor, tying: str = "untied",
                      extra: dict[str, Any] | None = None, extended: bool = False) -> InterfaceReport:
    """Compute every metric of the module docstring for ``E`` (V×d) and ``W_out`` (d×V)."""
    e = e.to(torch.float64)
    w = w_out.to(torch.float64)
    v, d = e.shape
    if w.shape != (d, v):
        raise ValueError(f"W_out must be {d}×{v} for E of shape {v}×{d}, got {tuple(w.shape)}")
    delta = identity_defect(e, w)

    b_in, b_out = e, pseudo_inverse_rows(w)
    n_in, n_out = b_in.norm(dim=1), b_out.norm(dim=1)
    ok = (n_in > 0) & (n_out > 0)
    a = b_in[ok] / n_in[ok, None]
    b = b_out[ok] / n_out[ok, None]
    cosine = float((1.0 - (a * b).sum(dim=1)).mean())
    angle = float((2.0 * torch.atan2((a - b).norm(dim=1), (a + b).norm(dim=1))).mean())

    a_hat = b_in / torch.linalg.matrix_norm(b_in)
    b_hat = b_out / torch.linalg.matrix_norm(b_out)
    u, _, vh = torch.linalg.svd(a_hat.T @ b_hat)
    procrustes = float(torch.linalg.matrix_norm(a_hat @ (u @ vh) - b_hat))

    polar = _polar_distance(e, w) if extended else None
    return InterfaceReport(
        vocab_size=v,
        hidden_size=d,
        tying=tying,
        delta_ti=delta,
        cosine_distance=cosine,
        procrustes_error=procrustes,
        principal_angle=angle,
        polar_distance=polar,
        degenerate_rows=int((~ok).sum()),
        extra=extra or {},
    )


def _polar_distance(e: torch.Tensor, w: torch.Tensor) -> float:
    try:
        diff = polar_factor(e)[0] - polar_factor(w.T)[0]
    except ValueError:  # rank-deficient: the polar factor is not unique
        return float("nan")
    return float(torch.linalg.matrix_norm(diff) / math.sqrt(e.shape[1]))


def diagnose_model(model: torch.nn.Module, extended: bool = False) -> InterfaceReport:
    """:func:`interface_metrics` of a model's effective interface (PIT, tied or untied)."""
    e, w, tying = effective_interface(model)  # type: ignore[arg-type]
    extra: dict[str, Any] = {}
    interface = find_interface(model)
    if interface is not None:
        extra["z_orthogonality_error"] = interface.orthogonality_error()
        t = interface.transform().detach().to(torch.float64)
        extra["t_condition_number"] = float(torch.linalg.cond(t))
    return interface_metrics(e, w, tying, extra, extended)

"""Pseudo-Inverse Tying: the token interface ``E = Z T⁻¹``, ``W_out = T Zᵀ``.

This module is the only place in the project where ``T`` is applied to hidden states or
``T⁻¹`` to token memories. It imports nothing else of the project but the names of its choices
(:mod:`.choices`).

Paper: "Rethinking Weight Tying: Pseudo-Inverse Tying for LM Stable Training and Updates",
section *Approach* (Eq. 3–12) and Appendix *Implementation Details*:

* ``Z ∈ R^{V×d}`` with ``ZᵀZ = I`` (Stiefel), from the thin polar factor of a source embedding
  or of a Gaussian (thin QR is offered too). Frozen by default; when trainable, call
  :meth:`PITInterface.retract_` after every optimizer step (polar retraction, Eq. 13).
* ``T = L Lᵀ`` with ``L`` lower-triangular and a positive diagonal (softplus or exp, with an
  optional clamp), so ``T`` is SPD and ``W_out E = T ZᵀZ T⁻¹ = I`` by construction.
* Embedding rows ``e_t = z_t T⁻¹`` by Cholesky solves in FP32 (also under autocast);
  logits ``(h T) Zᵀ`` as two matmuls, never materializing ``W_out``.
* Conditioning (``docs/training.md``, "Keeping T well conditioned"): the stored ``Z`` is float32,
  so ``ZᵀZ = I + Δ`` with ``Δ`` of rounding size, and ``W_out E − I = T Δ T⁻¹`` grows with
  ``cond(T)``. :meth:`PITInterface.conditioning` measures that defect and ``T``'s spectrum with
  ``d×d`` work only; :meth:`PITInterface.floor_spectrum_` caps ``cond(T)`` after an optimizer step.

Conventions: row vectors, ``logits = h @ W_out`` with ``W_out`` of shape ``(d, V)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Iterator
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from .choices import DIAGONAL_MAPS, T_INITS  # noqa: F401  (re-exported: the names' one table)

DiagonalMap = Literal["softplus", "exp"]
TInit = Literal["identity", "input", "output"]
#: :meth:`PITInterface.floor_spectrum_` puts the floor this factor above ``λ_max / max_cond``
FLOOR_MARGIN = 1.01


# --------------------------------------------------------------------------------------
# Matrix helpers (float64 where the result must be exact to ~1e-12)
# --------------------------------------------------------------------------------------


def _sym_eig(gram: torch.Tensor, ridge: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decomposition of a symmetric PSD ``d×d`` matrix in float64."""
    g = gram.to(torch.float64)
    g = 0.5 * (g + g.T)
    if ridge:
        g = g + ridge * torch.eye(g.shape[0], dtype=g.dtype, device=g.device)
    return torch.linalg.eigh(g)


#: smallest eigenvalue ratio of ``AᵀA`` that :func:`polar_factor` accepts as full rank
RANK_RTOL = 1e-12


#: rows of a ``V×d`` matrix :func:`polar_factor` widens to float64 at a time (32 MiB at d = 640)
POLAR_CHUNK_ROWS = 8192


def row_chunks(a: torch.Tensor, scale: float = 1.0) -> Iterator[tuple[slice, torch.Tensor]]:
    """``(rows, scale·a[rows] in float64)`` for consecutive slices of ``POLAR_CHUNK_ROWS`` rows:
    float64 work on a ``V×d`` table without a float64 copy of the whole of it."""
    for start in range(0, a.shape[0], POLAR_CHUNK_ROWS):
        part = slice(start, start + POLAR_CHUNK_ROWS)
        chunk = a[part].detach().to(torch.float64)
        yield part, chunk * scale if scale != 1.0 else chunk


def table_rows(z: torch.Tensor, lf: torch.Tensor, dtype: torch.dtype, divisor: float = 1.0) -> torch.Tensor:
    """Rows ``z T⁻¹ / divisor`` of a materialized embedding, from float64 rows of ``Z`` and ``T``'s
    float64 Cholesky factor ``lf``, cast once to ``dtype``."""
    return (torch.cholesky_solve(z.T, lf, upper=False).T / divisor).to(dtype)


def head_rows(z: torch.Tensor, t: torch.Tensor, dtype: torch.dtype, divisor: float = 1.0) -> torch.Tensor:
    """Rows ``(T zᵀ)ᵀ / divisor`` of a materialized head ``W_outᵀ``, from float64 rows of ``Z``
    and ``T`` in float64, cast once to ``dtype``."""
    return ((t @ z.T).T / divisor).to(dtype)


def rotate_rows(u: torch.Tensor, r: torch.Tensor, dtype: torch.dtype = torch.float32,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``U R`` in ``dtype`` (``r`` float64, ``d×k``), each chunk of rows multiplied in float64;
    into ``out`` where given, which may be ``u`` itself (``d = k``; each chunk is read before it
    is written)."""
    if out is None:
        out = torch.empty(u.shape[0], r.shape[1], dtype=dtype)
    for part, chunk in row_chunks(u):
        out[part] = (chunk @ r).to(dtype)
    return out


def gram64(a: torch.Tensor, project: torch.Tensor | None = None, scale: float = 1.0,
           weight: torch.Tensor | None = None) -> torch.Tensor:
    """``(scale·A P)ᵀ diag(w) (scale·A P)`` in float64 (``P`` = ``project``, ``w`` = ``weight``
    over the rows; each optional), summed by row chunks."""
    d = a.shape[1] if project is None else project.shape[1]
    total = torch.zeros(d, d, dtype=torch.float64, device=a.device)
    for part, chunk in row_chunks(a, scale):
        chunk = chunk if project is None else chunk @ project
        weighted = chunk if weight is None else chunk * weight[part, None].to(torch.float64)
        total += weighted.T @ chunk
    return total


def polar_factor(a: torch.Tensor, ridge: float = 0.0, *, scale: float = 1.0,
                 dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Thin polar decomposition ``scale·A = U H`` of a tall ``V×d`` matrix, computed in float64.

    Computed through the ``d×d`` Gram matrix (``H = (AᵀA)^{1/2}``, ``U = A H⁻¹``) so that the
    cost is ``O(V d²)`` and nothing ``V×V`` is ever formed. One refinement step (the polar
    factor of ``U`` itself, ``U ← U (UᵀU)^{-1/2}``, ``H ← (UᵀU)^{1/2} H``) removes the rounding
    that squaring the condition number costs, which matters for real embeddings.

    ``A`` is read ``POLAR_CHUNK_ROWS`` rows at a time and widened to float64 only chunk by chunk,
    so a float32 table of a 262k-token vocabulary needs no float64 copy of itself (1.3 GB at
    d = 640): only ``U`` is allocated, in ``dtype``.

    Args:
        a: ``(V, d)`` with ``V ≥ d`` and full column rank, any float dtype.
        ridge: optional ``ε`` added to ``AᵀA`` for numerical safety.
        scale: a multiplier of ``A`` folded in (an embedding scale), as if ``A`` were scaled.
        dtype: the dtype of the returned ``U`` (``H`` is float64 either way).

    Returns:
        ``(U, H)``: ``U`` ``(V, d)`` with orthonormal columns, ``H`` ``(d, d)`` SPD, float64.

    Raises:
        ValueError: if ``A`` is not tall or is rank deficient.
    """
    if a.ndim != 2 or a.shape[0] < a.shape[1]:
        raise ValueError(f"polar_factor needs a tall V×d matrix, got shape {tuple(a.shape)}")

    evals, evecs = _sym_eig(gram64(a, scale=scale), ridge)
    # σ_min²/σ_max² below 1e-12 (cond(A) > 1e6) cannot be told apart from rank deficiency through
    # the Gram matrix: an exactly repeated column leaves an eigenvalue of rounding size, about
    # 1e-16 of the largest and of either sign (a real embedding sits far above: docs/definitions.md).
    if evals.min() <= evals.max() * RANK_RTOL:
        raise ValueError("matrix is rank deficient: its columns do not span d dimensions")
    h = (evecs * evals.sqrt()) @ evecs.T
    h_inv = (evecs * evals.rsqrt()) @ evecs.T
    # Refinement: U = A H⁻¹ is orthonormal up to ~cond(A)²·eps; polar of U is then ~I-close.
    ev2, evec2 = _sym_eig(gram64(a, h_inv, scale))
    correction = (evec2 * ev2.rsqrt()) @ evec2.T
    u = torch.empty(a.shape, dtype=dtype, device=a.device)
    for part, chunk in row_chunks(a, scale):
        u[part] = ((chunk @ h_inv) @ correction).to(dtype)
    h = torch.linalg.solve(correction, h)
    h = 0.5 * (h + h.T)
    return u, h


def orthonormalize(a: torch.Tensor, method: Literal["polar", "qr"] = "polar") -> torch.Tensor:
    """Orthonormal ``V×d`` factor of ``a`` by thin polar (default) or thin QR, in float64."""
    if method == "polar":
        return polar_factor(a)[0]
    if method == "qr":
        q, r = torch.linalg.qr(a.to(torch.float64), mode="reduced")
        # Fix signs so the factor is unique (positive diagonal of R).
        diag = torch.diagonal(r)
        return q * torch.where(diag != 0, torch.sign(diag), torch.ones_like(diag))
    raise ValueError(f"unknown orthonormalization method {method!r}; use 'polar' or 'qr'")


def random_stiefel(
    vocab_size: int,
    dim: int,
    generator: torch.Generator | None = None,
    method: Literal["polar", "qr"] = "qr",
) -> torch.Tensor:
    """A random ``V×d`` matrix with orthonormal columns (paper: from-scratch init), float64."""
    g = torch.randn(vocab_size, dim, generator=generator, dtype=torch.float64)
    return orthonormalize(g, method)


def _solve_dtype(t: torch.Tensor) -> torch.dtype:
    """FP32 for the solves, or float64 when the parameters already are (gradient checks)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _softplus_inverse(y: torch.Tensor) -> torch.Tensor:
    """``x`` with ``softplus(x) = y`` for ``y > 0``, stable for large and tiny ``y``."""
    return y + torch.log(-torch.expm1(-y))


def spd_and_inverse(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(H, H⁻¹)`` of an SPD matrix, symmetrized and in float64 (used by the T inits)."""
    h64 = 0.5 * (h.to(torch.float64) + h.to(torch.float64).T)
    evals, evecs = torch.linalg.eigh(h64)
    return (evecs * evals) @ evecs.T, (evecs / evals) @ evecs.T


# --------------------------------------------------------------------------------------
# The interface module
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PITSpec:
    """Hyper-parameters of the ``T`` parameterization, stored in the checkpoint config."""

    diagonal: str = "softplus"  #: map from free parameter to ``L_ii > 0``: softplus or exp
    clamp_min: float | None = None  #: optional lower clamp of ``L_ii`` (conditioning)
    clamp_max: float | None = None  #: optional upper clamp of ``L_ii``
    train_z: bool = False  #: ``Z`` trainable (then retract after each step)
    retraction_ridge: float = 0.0  #: ``ε`` in the polar retraction ``Z (ZᵀZ + εI)^{-1/2}``

    def __post_init__(self) -> None:
        if self.diagonal not in DIAGONAL_MAPS:
            raise ValueError(f"unknown diagonal map {self.diagonal!r}; choose one of {DIAGONAL_MAPS}")
        if self.clamp_min is not None and self.clamp_min <= 0:
            raise ValueError("clamp_min must be positive: L's diagonal must stay > 0")
        if (
            self.clamp_min is not None
            and self.clamp_max is not None
            and self.clamp_min > self.clamp_max
        ):
            raise ValueError("clamp_min must not exceed clamp_max")


@dataclass(frozen=True)
class Conditioning:
    """``T``'s extreme eigenvalues, the range of ``L``'s diagonal, and the interface defect
    ``delta_ti = ‖W_out E − I‖_F``."""

    eig_min: float
    eig_max: float
    delta_ti: float
    l_diag_min: float = math.nan
    l_diag_max: float = math.nan

    @property
    def cond(self) -> float:
        """``cond(T) = λ_max / λ_min`` (``inf`` when ``T`` is singular or not finite)."""
        if not (self.eig_min > 0 and math.isfinite(self.eig_max)):
            return math.inf
        return self.eig_max / self.eig_min


class PITInterface(nn.Module):
    """Shared token memory ``Z`` and SPD transform ``T = L Lᵀ`` of one model.

    Parameters (the whole checkpointed state of the interface):
        ``Z``: ``(V, d)``, orthonormal columns; ``requires_grad`` follows ``spec.train_z``.
        ``L_offdiag``: ``(d, d)`` free parameters; only the strict lower triangle is used.
        ``L_diag``: ``(d,)`` free parameters mapped to ``L_ii > 0`` by softplus or exp.

    The embedding and head modules of a converted model hold a reference to one instance of
    this class, which is registered once in the model (see ``pit_deploy.converters``).
    """

    def __init__(self, z: torch.Tensor, l_factor: torch.Tensor, spec: PITSpec = PITSpec(), copy: bool = True):
        """``copy=False`` makes ``Z`` the very tensor given (where it is in ``Z``'s dtype): for a
        caller whose ``z`` is its own fresh result, a second ``V×d`` table is 640 MiB at 262k tokens."""
        super().__init__()
        if z.ndim != 2 or l_factor.shape != (z.shape[1], z.shape[1]):
            raise ValueError(
                f"shape mismatch: Z {tuple(z.shape)} needs a d×d Cholesky factor, got {tuple(l_factor.shape)}"
            )
        self.spec = spec
        dtype = z.dtype if z.dtype.is_floating_point and z.dtype != torch.float64 else torch.float32
        z = z.to(dtype)
        self.Z = nn.Parameter(z.clone() if copy else z, requires_grad=spec.train_z)
        off, free_diag = self._free_parameters(l_factor)
        self.L_offdiag = nn.Parameter(off.to(torch.float32))
        self.L_diag = nn.Parameter(free_diag.to(torch.float32))
        self._gram: tuple[tuple, torch.Tensor] | None = None  # (key of Z's state, ZᵀZ in float64)

    def _free_parameters(self, l_factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(strict lower triangle, free diagonal)`` in float64 whose map gives ``l_factor``."""
        diag = torch.diagonal(l_factor).to(torch.float64)
        if not (diag > 0).all():
            raise ValueError("Cholesky factor must have a positive diagonal")
        free_diag = _softplus_inverse(diag) if self.spec.diagonal == "softplus" else diag.log()
        return torch.tril(l_factor.to(torch.float64), -1), free_diag

    # ---- shapes -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.Z.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.Z.shape[1]

    # ---- T and its factor ---------------------------------------------------------------
    def cholesky_factor(self) -> torch.Tensor:
        """``L`` ``(d, d)``: lower-triangular, positive diagonal, FP32 (autocast off).

        Float64 parameters stay float64 (used by gradient checks and exports).
        """
        dtype = _solve_dtype(self.L_diag)
        with torch.autocast(device_type=self.L_diag.device.type, enabled=False):
            off = torch.tril(self.L_offdiag.to(dtype), -1)
            raw = self.L_diag.to(dtype)
            diag = F.softplus(raw) if self.spec.diagonal == "softplus" else raw.exp()
            if self.spec.clamp_min is not None or self.spec.clamp_max is not None:
                diag = diag.clamp(self.spec.clamp_min, self.spec.clamp_max)
            return off + torch.diag_embed(diag)

    def transform(self) -> torch.Tensor:
        """``T = L Lᵀ`` ``(d, d)`` in FP32."""
        with torch.autocast(device_type=self.L_diag.device.type, enabled=False):
            lf = self.cholesky_factor()
            return lf @ lf.T

    # ---- forward pieces ------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows ``e_t = z_t T⁻¹`` for token ids of any shape; returns ``(*ids.shape, d)``.

        Computed as ``T⁻¹ z_tᵀ`` by two triangular solves with ``L`` (``torch.cholesky_solve``)
        in FP32 with autocast disabled, as the paper prescribes for mixed precision. The
        result is FP32, or ``Z``'s dtype when ``Z`` is stored in a lower precision without
        autocast, so it matches what an ``nn.Embedding`` of that dtype would return.
        """
        rows = self.Z[input_ids.reshape(-1)]
        with torch.autocast(device_type=rows.device.type, enabled=False):
            lf = self.cholesky_factor()
            solved = torch.cholesky_solve(rows.to(lf.dtype).T, lf, upper=False).T
        out_dtype = torch.float32 if torch.is_autocast_enabled() else self.Z.dtype
        return solved.to(out_dtype).reshape(*input_ids.shape, self.hidden_size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(h T) Zᵀ`` for hidden states ``(..., d)``; returns ``(..., V)``.

        ``T`` is built in FP32; the two matmuls run in whatever precision autocast chooses,
        like a plain ``lm_head``. ``W_out`` is never formed.
        """
        t = self.transform()
        if not torch.is_autocast_enabled():
            t = t.to(hidden.dtype)
        g = hidden @ t
        z = self.Z if torch.is_autocast_enabled() else self.Z.to(g.dtype)
        return g @ z.T

    # ---- materialization (float64) --------------------------------------------------------
    @torch.no_grad()
    def transform_float64(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(L, T = L Lᵀ)`` in float64, for materialization and exports."""
        lf = self.cholesky_factor().detach().to(torch.float64)
        return lf, lf @ lf.T

    @torch.no_grad()
    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(E, W_out)`` as float64 tensors ``(V, d)`` and ``(d, V)``: ``E = Z T⁻¹``, ``W_out = T Zᵀ``."""
        z = self.Z.detach().to(torch.float64)
        lf, t = self.transform_float64()
        e = torch.cholesky_solve(z.T, lf, upper=False).T
        return e, t @ z.T

    @torch.no_grad()
    def inverse_transform(self) -> torch.Tensor:
        """``T⁻¹`` ``(d, d)`` in float64, for exports that cannot run a solve on device."""
        lf = self.cholesky_factor().detach().to(torch.float64)
        eye = torch.eye(lf.shape[0], dtype=torch.float64, device=lf.device)
        return torch.cholesky_solve(eye, lf, upper=False)

    @torch.no_grad()
    def materialized_rows(self, dtype: torch.dtype, table_divisor: float = 1.0,
                          head_divisor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(E / table_divisor, W_outᵀ / head_divisor)``, both ``(V, d)`` in ``dtype``: what a
        materialized model stores. Each row is computed in float64 (as :meth:`materialize`) and
        cast once, ``POLAR_CHUNK_ROWS`` rows at a time, so no float64 ``V×d`` table is held
        (2.7 GB for both at a 262k-token vocabulary and d = 640)."""
        lf, t = self.transform_float64()
        vocab, dim = self.Z.shape
        table = torch.empty(vocab, dim, dtype=dtype, device=self.Z.device)
        head = torch.empty(vocab, dim, dtype=dtype, device=self.Z.device)
        for part, z in row_chunks(self.Z):
            table[part] = table_rows(z, lf, dtype, table_divisor)
            head[part] = head_rows(z, t, dtype, head_divisor)
        return table, head

    # ---- conditioning of T ----------------------------------------------------------------------
    @torch.no_grad()
    def gram(self) -> torch.Tensor:
        """``ZᵀZ`` ``(d, d)`` in float64: ``I`` up to the rounding of the stored ``Z``.

        Cached while ``Z`` is frozen and unchanged (same storage, same version counter; the
        retraction clears it), so the training loop's per-step checks cost ``d×d`` work only; a
        trainable ``Z`` is multiplied out every time (``O(V d²)``, like the retraction).
        """
        key = (self.Z.data_ptr(), self.Z._version, self.Z.dtype, self.Z.device)
        if self._gram is not None and self._gram[0] == key and not self.Z.requires_grad:
            return self._gram[1]
        gram = gram64(self.Z)
        self._gram = (key, gram)
        return gram

    @torch.no_grad()
    def conditioning(self) -> Conditioning:
        """``T``'s extreme eigenvalues, ``L``'s diagonal range and ``delta_ti``, from ``d×d``
        float64 work only.

        ``W_out E − I = T ZᵀZ T⁻¹ − I = T (ZᵀZ − I) T⁻¹`` exactly, so with ``ZᵀZ`` from
        :meth:`gram` this is the defect that :meth:`materialize` shows in float64 (``V×d``
        products), computed without forming ``E`` or ``W_out`` and without the cancellation of
        subtracting ``I`` from a product near ``I``. Non-finite factors give ``inf``.
        """
        lf = self.cholesky_factor().detach().to(torch.float64)
        if not torch.isfinite(lf).all():
            return Conditioning(math.nan, math.nan, math.inf)
        t = lf @ lf.T
        evals = torch.linalg.eigvalsh(t)
        gram = self.gram().to(t.device)
        m = t @ (gram - torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device))
        defect = torch.cholesky_solve(m.T, lf, upper=False).T  # (T Δ) T⁻¹, T symmetric
        diag = torch.diagonal(lf)
        return Conditioning(float(evals[0]), float(evals[-1]), float(torch.linalg.matrix_norm(defect)),
                            float(diag.min()), float(diag.max()))

    @torch.no_grad()
    def set_cholesky_factor_(self, l_factor: torch.Tensor) -> None:
        """Store ``l_factor`` (lower-triangular, positive diagonal) as the factor of ``T``."""
        off, free_diag = self._free_parameters(l_factor)
        self.L_offdiag.copy_(off.to(self.L_offdiag.dtype))
        self.L_diag.copy_(free_diag.to(self.L_diag.dtype))

    @torch.no_grad()
    def floor_spectrum_(self, max_cond: float) -> bool:
        """Raise ``T``'s eigenvalues below ``λ_max / max_cond`` to that floor, in place.

        A projection applied after an optimizer step, as the retraction is for ``Z``: ``T``'s
        eigenvectors and its eigenvalues above the floor are kept, the ones below are raised to
        it (:data:`FLOOR_MARGIN` inside the bound), and ``L`` becomes the Cholesky factor of the
        floored ``T`` (float64 ``d×d`` work). A ``T`` within the bound is not touched at all, so
        a model that never reaches the bound trains exactly as without it.

        Returns:
            whether ``T`` was changed.
        """
        if not max_cond > 1:
            raise ValueError(f"max_cond must exceed 1, got {max_cond}")
        lf = self.cholesky_factor().detach().to(torch.float64)
        evals, evecs = torch.linalg.eigh(lf @ lf.T)
        if evals[0] * max_cond >= evals[-1]:
            return False
        # 1 % inside the bound, so the float32 rounding of the new L (about 1e-7·λ_max·max_cond
        # relative to the floor) does not put T back above it and trigger another projection.
        floor = evals[-1] / max_cond * FLOOR_MARGIN
        t = (evecs * evals.clamp_min(floor)) @ evecs.T
        self.set_cholesky_factor_(torch.linalg.cholesky(0.5 * (t + t.T)))
        return True

    # ---- Stiefel constraint -----------------------------------------------------------------
    @torch.no_grad()
    def retract_(self) -> None:
        """Polar retraction ``Z ← Z̃ (Z̃ᵀZ̃ + εI)^{-1/2}`` in place (paper Eq. 13).

        Call once after every optimizer step when ``Z`` trains. The ``d×d`` eigen-problem runs
        in float64; the ``V×d`` products in FP32 or better.
        """
        z = self.Z.data
        work = z.to(torch.float64) if z.dtype != torch.float64 else z
        evals, evecs = _sym_eig(work.T @ work, self.spec.retraction_ridge)
        inv_sqrt = (evecs * evals.clamp_min(torch.finfo(torch.float64).tiny).rsqrt()) @ evecs.T
        self.Z.data.copy_((work @ inv_sqrt).to(z.dtype))
        self._gram = None

    @torch.no_grad()
    def orthogonality_error(self) -> float:
        """``‖ZᵀZ − I‖_F`` in float64."""
        z = self.Z.detach().to(torch.float64)
        return float(torch.linalg.matrix_norm(z.T @ z - torch.eye(z.shape[1], dtype=z.dtype)))

    def extra_repr(self) -> str:
        return f"V={self.vocab_size}, d={self.hidden_size}, diagonal={self.spec.diagonal}, train_z={self.spec.train_z}"


# --------------------------------------------------------------------------------------
# Initializations
# --------------------------------------------------------------------------------------


def init_from_embedding(
    e0: torch.Tensor, t_init: str = "identity", spec: PITSpec = PITSpec()
) -> PITInterface:
    """Build the interface from a source embedding ``E0 = U H`` (continued pretraining).

    ``Z = U`` always. ``t_init`` picks ``T``:

    * ``identity``: ``T = I`` (the paper's default).
    * ``input``: ``T = H⁻¹`` so ``E = U H = E0`` (the input side reproduces the source).
    * ``output``: ``T = H`` so ``W_out = H Uᵀ = E0ᵀ`` (the head reproduces the tied source).

    Args:
        e0: ``(V, d)`` effective source embedding (multipliers already applied).
        t_init: one of :data:`T_INITS`.
        spec: parameterization of ``T``.
    """
    if t_init not in T_INITS:
        raise ValueError(f"unknown T init {t_init!r}; choose one of {', '.join(T_INITS)}")
    u, h = polar_factor(e0)
    d = h.shape[0]
    if t_init == "identity":
        t = torch.eye(d, dtype=torch.float64)
    else:
        h_sym, h_inv = spd_and_inverse(h)
        t = h_inv if t_init == "input" else h_sym
    lf = torch.linalg.cholesky(0.5 * (t + t.T))
    return PITInterface(u.to(torch.float32), lf, spec, copy=False)


def init_random(
    vocab_size: int,
    hidden_size: int,
    generator: torch.Generator | None = None,
    method: Literal["polar", "qr"] = "qr",
    spec: PITSpec = PITSpec(),
) -> PITInterface:
    """From-scratch interface: ``Z`` from thin QR/polar of a Gaussian, ``T = I``."""
    z = random_stiefel(vocab_size, hidden_size, generator, method)
    return PITInterface(z.to(torch.float32), torch.eye(hidden_size, dtype=torch.float64), spec, copy=False)


"""The PIT token interface in numbers, once its tables are stored: the identity defect
``delta_ti = ‖W_out E − I‖_F``, the correction that keeps ``W_out E = I`` when the shared table is
quantized, and the token table that makes a quantized head's interface exact.

Every exporter and ``verify`` compute these here, so that what the ONNX and ``.pte`` exporters
correct, what the GGUF exporter writes and what ``verify`` measures are one definition
(``docs/definitions.md``). All of it is float64: the defects it measures are of float32 rounding
size, and ``T⁻¹``/Gram solves lose digits with ``cond(T)``.

Conventions as :mod:`.core`: row vectors, ``logits = h @ W_out``, ``W_out`` of shape ``(d, V)``,
tables ``(V, d)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import PitError

#: a quantized table whose Gram matrix is worse conditioned than this has lost rank
MAX_GRAM_COND = 1e12


def identity_defect(e: Any, w_out: Any) -> float:
    """``delta_ti = ‖W_out E − I_d‖_F`` in float64, for ``E`` ``(V, d)`` and ``W_out`` ``(d, V)``:
    torch tensors (on their device) or numpy arrays. A head stored as PyTorch stores it
    (``(V, d)``, ``logits = h @ head.T``) is ``W_out = head.T``."""
    if isinstance(e, torch.Tensor):
        e64, w64 = e.to(torch.float64), w_out.to(torch.float64)
        eye = torch.eye(e64.shape[1], dtype=torch.float64, device=e64.device)
        return float(torch.linalg.matrix_norm(w64 @ e64 - eye))
    e64, w64 = np.asarray(e).astype(np.float64), np.asarray(w_out).astype(np.float64)
    return float(np.linalg.norm(w64 @ e64 - np.eye(e64.shape[1])))


def correction_matrix(head_rows: np.ndarray, embed_rows: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``M = (Ẑ_hᵀ Ẑ_e)⁻¹ T⁻¹`` in float64, so that ``T Ẑ_hᵀ Ẑ_e M = I``: a factorized export
    whose head reads the quantized table ``Ẑ_h`` and whose embedding gathers ``Ẑ_e`` (the same
    table, or its own rounding of it) multiplies the gathered rows by ``M`` instead of ``T⁻¹``.

    Raises:
        PitError: the quantized table has lost rank (``Ẑᵀ Ẑ`` singular): use more bits.
    """
    zh, ze = head_rows.astype(np.float64), embed_rows.astype(np.float64)
    gram = zh.T @ ze
    cond = np.linalg.cond(gram)
    if not np.isfinite(cond) or cond > MAX_GRAM_COND:
        raise PitError(f"the quantized token table is (nearly) rank-deficient (cond {cond:.2e}); "
                       "the PIT correction needs ẐᵀẐ invertible — use int8 or a smaller group size")
    return np.linalg.solve(gram, np.linalg.inv(t))


def corrected_table(head: np.ndarray) -> np.ndarray:
    """The pseudo-inverse of a (dequantized) head as a token table: ``E = Ŵ (ŴᵀŴ)⁻¹``, in
    float64 by a Cholesky solve, so ``Ŵᵀ E = I_d`` (``head``: ``(V, d)`` as PyTorch stores it,
    full column rank). A materialized export whose head is quantized stores this table.

    Raises:
        PitError: the head has lost rank.
    """
    w = head.astype(np.float64)
    gram = w.T @ w
    try:
        chol = np.linalg.cholesky(gram)
    except np.linalg.LinAlgError:
        raise PitError("the quantized head is rank-deficient: no token table can make W_out E = I") from None
    inv = np.linalg.solve(chol.T, np.linalg.solve(chol, np.eye(gram.shape[0])))
    return w @ inv

"""The PIT token interface in numbers, once its tables are stored: the identity defect
``delta_ti = ‖W_out E − I‖_F``, the correction that keeps ``W_out E = I`` when the shared table is
quantized, the map of a table whose head's factor is stored on a kernel's grid, and the token table
that makes a quantized head's interface exact.

Every exporter and ``verify`` compute these here, so that what the ONNX and ``.pte`` exporters
correct, what the GGUF exporter writes and what ``verify`` measures are one definition
(``docs/definitions.md``). All of it is float64: the defects it measures are of float32 rounding
size, and ``T⁻¹``/Gram solves lose digits with ``cond(T)``.

Conventions as :mod:`.core`: row vectors, ``logits = h @ W_out``, ``W_out`` of shape ``(d, V)``,
tables ``(V, d)``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from ..errors import PitError
from . import core
from .core import rotate_rows, row_chunks

#: a quantized table whose Gram matrix is worse conditioned than this has lost rank
MAX_GRAM_COND = 1e12


def cross_gram(a: Any, b: Any, b_scale: float = 1.0, out: Any = None) -> Any:
    """``aᵀ (b · b_scale)`` in float64 for ``a`` ``(V, d₁)`` and ``b`` ``(V, d₂)`` (numpy arrays or
    torch tensors on one device, any float dtype), summed by row chunks
    (:func:`~pit_deploy.model.core.row_chunks`: a 262k-token table is never copied to float64
    whole, 1.3 GB per copy at d = 640); numpy in, numpy out. ``b_scale`` multiplies each chunk of
    ``b`` in ``b``'s own dtype, as a runtime that scales the gathered rows does (Gemma's ``√d``),
    without a scaled copy of the whole table. ``out`` (a float64 sum of the same kind, from an
    earlier call) is added to in place and returned: a sum over a table's consecutive parts."""
    as_numpy = not isinstance(a, torch.Tensor)
    ta = torch.from_numpy(np.asarray(a)) if as_numpy else a
    tb = torch.from_numpy(np.asarray(b)) if as_numpy else b
    if out is None:
        total = torch.zeros(ta.shape[1], tb.shape[1], dtype=torch.float64, device=ta.device)
    else:
        total = torch.from_numpy(out) if isinstance(out, np.ndarray) else out
    for part, chunk in row_chunks(ta):
        rows = tb[part] if b_scale == 1.0 else tb[part] * float(b_scale)
        total += chunk.T @ rows.to(torch.float64)
    return total.numpy() if as_numpy else total


def identity_defect(e: Any, w_out: Any, e_scale: float = 1.0) -> float:
    """``delta_ti = ‖W_out E − I_d‖_F`` in float64, for ``E`` ``(V, d)`` and ``W_out`` ``(d, V)``:
    torch tensors (on their device) or numpy arrays. A head stored as PyTorch stores it
    (``(V, d)``, ``logits = h @ head.T``) is ``W_out = head.T``. ``W_out E`` is summed by row
    chunks (:func:`cross_gram`); ``e_scale`` multiplies ``E`` in its own dtype first (a table
    whose runtime scales the gathered rows)."""
    return _off_identity(cross_gram(w_out.T, e, e_scale))


def identity_defect_by_parts(w_out: Any, parts: Iterable[tuple[int, Any]], e_scale: float = 1.0) -> float:
    """:func:`identity_defect` of ``W_out`` ``(d, V)`` and an ``E`` that arrives as consecutive
    ``(first id, rows (n, d))`` parts, so that a runtime's whole table is never held: the same
    float64 sum, term for term, where every part but the last has a multiple of
    :data:`~pit_deploy.model.core.POLAR_CHUNK_ROWS` rows (``e_scale`` as there).

    Raises:
        ValueError: the parts do not cover ``0 … V`` in order.
    """
    return _off_identity(_product_by_parts(w_out, parts, e_scale))


def _product_by_parts(w_out: Any, parts: Iterable[tuple[int, Any]], e_scale: float = 1.0) -> Any:
    """``W_out E`` in float64 (``(rows of W_out, d)``) summed over ``E``'s parts, as
    :func:`identity_defect_by_parts` takes them."""
    total, expected = None, 0
    for start, rows in parts:
        if start != expected:
            raise ValueError(f"the table's part starts at id {start}, expected {expected}")
        expected = start + len(rows)
        total = cross_gram(w_out[:, start:expected].T, rows, e_scale, out=total)
    if expected != w_out.shape[1]:
        raise ValueError(f"the table's parts cover {expected} ids of {w_out.shape[1]}")
    return total


#: rows of ``W_out`` (basis vectors through the head) a runtime's ``delta_ti`` holds at a time:
#: ``(128, V)`` float32 is 128 MiB at 262,144 tokens, where the whole ``(d, V)`` was 640 MiB
DEFECT_HEAD_ROWS = 128


def identity_defect_in_groups(head_rows: Callable[[slice], torch.Tensor],
                              embedding_parts: Callable[[], Iterable[tuple[int, torch.Tensor]]],
                              dim: int, group: int | None = None) -> float:
    """:func:`identity_defect` of a runtime's interface with neither table ever whole:
    ``head_rows(rows)`` gives the head's logits of those basis vectors (``(n, V)``, torch),
    ``embedding_parts()`` a fresh pass over ``E``'s consecutive parts, and ``W_out E`` is summed
    ``group`` rows (default :data:`DEFECT_HEAD_ROWS`) at a time, each group against a new pass
    over ``E`` (the runtime embeds every id once per group). Where ``dim`` fits in one group it is
    :func:`identity_defect_by_parts` of the whole ``W_out``, term for term; else the same sums row
    by row, to float64 rounding."""
    group = group or DEFECT_HEAD_ROWS
    total = torch.empty(dim, dim, dtype=torch.float64)
    for start in range(0, dim, group):
        rows = slice(start, min(dim, start + group))
        total[rows] = _product_by_parts(head_rows(rows), embedding_parts())
    return _off_identity(total)


def table_parts(rows: Callable[[slice], Any], count: int) -> Iterator[tuple[int, Any]]:
    """``(first row, rows(slice))`` over ``count`` rows, :data:`~pit_deploy.model.core.POLAR_CHUNK_ROWS`
    at a time: the parts :func:`identity_defect_by_parts` sums exactly as the whole table."""
    step = core.POLAR_CHUNK_ROWS
    for start in range(0, count, step):
        yield start, rows(slice(start, min(count, start + step)))


def _off_identity(product: Any) -> float:
    """``‖product − I‖_F`` of a float64 square matrix (torch or numpy)."""
    if isinstance(product, torch.Tensor):
        eye = torch.eye(product.shape[0], dtype=torch.float64, device=product.device)
        return float(torch.linalg.matrix_norm(product - eye))
    return float(np.linalg.norm(product - np.eye(product.shape[0])))


def correction_matrix(head_rows: np.ndarray, embed_rows: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``M = (Ẑ_hᵀ Ẑ_e)⁻¹ T⁻¹`` in float64, so that ``T Ẑ_hᵀ Ẑ_e M = I``: a factorized export
    whose head reads the quantized table ``Ẑ_h`` and whose embedding gathers ``Ẑ_e`` (the same
    table, or its own rounding of it) multiplies the gathered rows by ``M`` instead of ``T⁻¹``.

    Raises:
        PitError: the quantized table has lost rank (``Ẑᵀ Ẑ`` singular): use more bits.
    """
    gram = cross_gram(head_rows, embed_rows)
    cond = np.linalg.cond(gram)
    if not np.isfinite(cond) or cond > MAX_GRAM_COND:
        raise PitError(f"the quantized token table is (nearly) rank-deficient (cond {cond:.2e}); "
                       "the PIT correction needs ẐᵀẐ invertible — use int8 or a smaller group size")
    return np.linalg.solve(gram, np.linalg.inv(t))


def table_map(s: Any, t: Any) -> Any:
    """``A = (S⁻¹ T)ᵀ``, float64: the map a factorized token table takes when the head's ``d×d``
    factor ``T`` is stored as ``S`` (``T R`` moved onto a kernel's input grid, so that the head's
    basis-vector outputs pass that kernel's rounding unchanged). With the table ``Z A`` the head
    computes ``h S (Z A)ᵀ = h S S⁻¹ T Zᵀ = h T Zᵀ``, the same function; ``A = R`` when ``S = T R``
    exactly. The ``.pte``'s rotated quantized head and the ONNX targets' int8-activation head both
    take their table map from here; numpy in, numpy out, torch in, torch out (each library's own
    LAPACK solve, so that each exporter's bytes stay what they were)."""
    if isinstance(s, torch.Tensor):
        return torch.linalg.solve(s.to(torch.float64), t.to(torch.float64)).T
    return np.linalg.solve(np.asarray(s, np.float64), np.asarray(t, np.float64)).T


def pseudo_inverse_map(head_rows: Callable[[slice], Any], count: int, scale: float = 1.0) -> np.ndarray:
    """``(ŴᵀŴ)⁻¹ / scale`` in float64, from a (dequantized) head ``Ŵ`` ``(count, d)`` that arrives
    a part of rows at a time (``head_rows(rows)``, as :func:`table_parts` reads it): the Gram
    matrix summed by parts, its inverse from the Cholesky factor. The head's rows times this map
    are the rows of :func:`corrected_table`.

    Raises:
        PitError: the head has lost rank.
    """
    gram = None
    for _, rows in table_parts(head_rows, count):
        gram = cross_gram(rows, rows, out=gram)
    try:
        chol = np.linalg.cholesky(gram)
    except np.linalg.LinAlgError:
        raise PitError("the quantized head is rank-deficient: no token table can make W_out E = I") from None
    inv = np.linalg.solve(chol.T, np.linalg.solve(chol, np.eye(gram.shape[0])))
    return inv / scale if scale != 1.0 else inv


def corrected_rows(head_rows: Callable[[slice], Any], inverse: np.ndarray) -> Callable[[slice], np.ndarray]:
    """``rows -> those rows of the corrected table``, float32: the head's rows times ``inverse``
    (:func:`pseudo_inverse_map`) in float64, so that an exporter writes the table a part at a
    time, the same bytes as :func:`corrected_table` where the parts are :func:`table_parts`'."""
    inv = torch.from_numpy(inverse)
    return lambda rows: rotate_rows(torch.from_numpy(np.asarray(head_rows(rows))), inv).numpy()


def identity_defect_of_rows(head_rows: Callable[[slice], Any], table_rows: Callable[[slice], Any], count: int,
                            e_scale: float = 1.0) -> float:
    """:func:`identity_defect` of a head (``head_rows(rows)``: rows of ``W_outᵀ``, ``(n, d)``, as
    PyTorch stores a head) and a table that both arrive a part of rows at a time: the same
    float64 sums, term for term, as :func:`identity_defect_by_parts` of the whole head."""
    total = None
    for start, rows in table_parts(table_rows, count):
        total = cross_gram(np.asarray(head_rows(slice(start, start + len(rows)))), rows, e_scale, out=total)
    return _off_identity(total)


def corrected_table(head: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """The pseudo-inverse of a (dequantized) head as a float32 token table: ``E = Ŵ (ŴᵀŴ)⁻¹``,
    in float64 (:func:`pseudo_inverse_map`, then the rows by chunks), so ``Ŵᵀ E = I_d``
    (``head``: ``(V, d)`` as PyTorch stores it, full column rank). A materialized export whose
    head is quantized stores this table; a runtime that multiplies the gathered rows by
    ``scale`` (Gemma's ``√d``) stores ``E / scale``.

    Raises:
        PitError: the head has lost rank.
    """
    inv = pseudo_inverse_map(lambda rows: head[rows], len(head), scale)
    return rotate_rows(torch.from_numpy(np.asarray(head)), torch.from_numpy(inv)).numpy()

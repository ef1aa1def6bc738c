"""8-bit (or 4-bit) token tables for quantized ExecuTorch programs, and the PIT correction on them.

The embedding of a quantized ``.pte`` reads its table through ExecuTorch's quantized embedding
op ``quantized_decomposed::embedding_byte`` (int8 rows, one float scale per group of
``group_size`` values, dequantized ``q · s`` in the kernel; the op and its kernel ship in the
``executorch`` wheel: ``exir/passes/_quant_patterns_and_replacements.py`` defines it, the
``kernels/quantized`` library runs it — :func:`pit_deploy.runtime.standalone.load_llm_custom_ops`
loads that library for the runtime). The table is quantized symmetrically (``q ∈ [−127, 127]``,
``s = max|row group| / 127``); with ``table_bits`` 4 through ``embedding_4bit`` instead
(``q ∈ [−7, 7]``, two codes a byte, :func:`pack_nibbles`).

The head: the XNNPACK partitioner lowers a quantized linear only with int8 *activations*
(``docs/quantization.md``), so a quantized head rounds its input. By default a factorized head
therefore keeps reading the fp32 ``Zᵀ``, and the embedding reads the 8-bit ``Ẑ``: with
``M = (Zᵀ Ẑ)⁻¹ T⁻¹`` in place of ``T⁻¹`` (computed in float64 from the very numbers the kernel
produces) ``W_out E = T Zᵀ Ẑ M = I`` still holds on the runtime — the same correction as the ONNX
exports' (:func:`pit_deploy.model.quantized_interface.correction_matrix`), with different tables on
the two sides. ``head_bits`` 4 or 8 trades that exactness for size and speed: the head becomes
a quantized linear over a rotated table (:mod:`.head`), the correction is computed against
its dequantized weights, and only the head's rounding of its input is left in ``W_out E − I``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

from ...errors import PitError
from ...exporters.passes import FACTORS_ATTR, PITFactors
from ...exporters.residual_rotation import rotation_of
from ...io.weight_codes import CODES_DIGEST, CODES_FIELD, codes_entry
from ...model.modules import PITEmbedding, PITHead
from ...model.quantized_interface import correction_matrix
from .head import ROTATION_SEED, RotatedQuantizedHead

QMAX = 127
#: the quantized embedding op of each table width (its kernel ships in ``kernels/quantized``)
TABLE_OPS = {8: "embedding_byte", 4: "embedding_4bit"}


def register_embedding_op() -> None:
    """Make ``torch.ops.quantized_decomposed.embedding_byte`` / ``embedding_4bit`` (and their
    out variants, which ``to_executorch`` needs) exist in this process."""
    import executorch.exir.passes._quant_patterns_and_replacements  # noqa: F401  (defines the op)
    import executorch.kernels.quantized  # noqa: F401  (its out variant)


def quantize_rows(rows: torch.Tensor, group_size: int, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric ``bits``-bit quantization (8 or 4) of ``rows`` ``(V, d)`` in groups of
    ``group_size`` along ``d``: ``q ∈ [−qmax, qmax]`` with ``qmax = 2^(bits−1) − 1``.
    Returns ``(q int8 (V, d), scales float32 (V, d / group_size))``."""
    v, d = rows.shape
    if d % group_size:
        raise PitError(f"group size {group_size} does not divide the hidden size {d}")
    qmax = 2 ** (bits - 1) - 1
    groups = rows.detach().to(torch.float64).reshape(v, d // group_size, group_size)
    scales = (groups.abs().amax(-1) / qmax).to(torch.float32)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(groups / scales.to(torch.float64)[..., None]).clamp(-qmax, qmax)
    return q.to(torch.int8).reshape(v, d), scales


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``q ∈ [−8, 7]`` ``(V, d)`` as ``embedding_4bit`` reads them: ``uint8 (V, d/2)``,
    ``q + 8`` of an even column in the high nibble, of the odd column after it in the low one
    (the op's reference implementation in the ``executorch`` wheel,
    ``exir/passes/_quant_patterns_and_replacements.py``)."""
    biased = (q.to(torch.int16) + 8).to(torch.uint8)
    return (biased[:, 0::2] * 16 + biased[:, 1::2]).contiguous()


def nibble_pair_swap(d: int) -> torch.Tensor:
    """The column order ``1, 0, 3, 2, …`` of a ``d``-wide table (``d`` even).

    XNNPACK serializes 4-bit weights with the *odd* column of each pair in the high nibble
    (``backends/xnnpack/operators/node_visitor.py``, ``convert_to_qc4w``), ``embedding_4bit`` reads
    the *even* one there (:func:`pack_nibbles`). A gather over the head's codes in this column order
    therefore stores the very bytes the head's linear stores — which ExecuTorch's named data store
    keeps once — and returns the head's rows with each pair swapped, which the correction matrix
    after the gather undoes (it is computed from the swapped rows)."""
    if d % 2:
        raise PitError(f"a shared 4-bit token table needs an even hidden size, got {d}")
    return torch.arange(d).view(-1, 2).flip(1).reshape(-1)


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """``q · s`` in float64, the kernel's numbers before its float32 rounding."""
    v, d = q.shape
    groups = q.to(torch.float64).reshape(v, scales.shape[1], -1) * scales.to(torch.float64)[..., None]
    return groups.reshape(v, d).numpy()


class QuantizedRows(nn.Module):
    """``ids ↦ (q · s)[ids]`` through ``quantized_decomposed::embedding_byte`` (8 bits) or
    ``embedding_4bit`` (4 bits, two codes a byte), then ``@ M`` when a correction matrix is
    given, then ``/ multiplier`` (a factorized embedding's). ``q`` holds the codes unpacked."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, matrix: torch.Tensor | None = None,
                 multiplier: float = 1.0, bits: int = 8):
        super().__init__()
        register_embedding_op()
        if bits not in TABLE_OPS:
            raise ValueError(f"a quantized token table has 4 or 8 bits, got {bits!r}")
        self.bits = int(bits)
        self.register_buffer("packed", q.contiguous() if bits == 8 else pack_nibbles(q))
        self.q = q  # the unpacked codes, a plain attribute: read by tests, never exported
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("M", None if matrix is None else matrix.contiguous())
        self.multiplier = float(multiplier)

    @property
    def embedding_dim(self) -> int:
        return self.q.shape[1] if self.M is None else self.M.shape[1]

    @property
    def num_embeddings(self) -> int:
        return self.q.shape[0]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        if self.bits == 8:
            rows = torch.ops.quantized_decomposed.embedding_byte.default(self.packed, self.scales, None, -QMAX, QMAX, ids)
        else:
            rows = torch.ops.quantized_decomposed.embedding_4bit.default(self.packed, self.scales, None, -8, 7, ids)
        if self.M is not None:
            rows = rows @ self.M
        if self.multiplier != 1.0:
            rows = rows / self.multiplier
        return rows.reshape(*input_ids.shape, rows.shape[-1])


@torch.no_grad()
def quantize_token_table(model: PreTrainedModel, group_size: int, correct: bool = True, *,
                         table_bits: int = 8, head_bits: int = 0, rotate: bool = True,
                         shared: bool = False, head_moments: torch.Tensor | None = None) -> dict[str, Any]:
    """Give ``model`` (a quantized twin, changed in place) a ``table_bits``-bit (8 or 4) input
    embedding.

    Factorized (``PITEmbedding`` over :class:`PITFactors`): the embedding reads ``Ẑ`` and
    multiplies by ``M = (Ẑ_hᵀ Ẑ)⁻¹ T⁻¹`` (``correct``) or by ``T⁻¹``. With ``head_bits`` 0 the
    head keeps the fp32 ``Zᵀ`` (``Ẑ_h = Z``, the interface stays exact on the runtime); with 4 or
    8 it becomes a :class:`~.head.RotatedQuantizedHead` over ``Z R``, the table holds ``Z R``
    too and ``T`` becomes ``T R`` in ``M``. Materialized or tied (a plain ``nn.Embedding``): the
    table itself, the ``lm_head`` stays fp32 (``head_bits`` applies to factorized programs). Any
    other embedding module (one that computes more than a lookup) stays float32. ``rotate=False``
    (``R = I``) is for measuring what the rotation buys.

    ``shared`` (factorized, ``head_bits == table_bits``): the gather reads the head's own codes and
    scales (:func:`shared_rows`) instead of a table rounded on its own, so the program holds one
    token table (stored once when its constants go to a named data file:
    :func:`pit_deploy.targets.executorch.export.export_pte`).

    ``head_moments`` (``Σ hᵀh`` of the head's input on calibration text,
    :func:`~pit_deploy.exporters.calibrated_rounding.head_moments`): a quantized head's table is rounded by GPTQ
    against them (:meth:`~.head.RotatedQuantizedHead.round_calibrated`) instead of to nearest;
    with ``shared`` the gather reads those codes too.

    Returns:
        details for the manifest: the table's scheme and whether the interface stays exact.
    """
    embedding = model.get_input_embeddings()
    scheme = (f"{table_bits}-bit symmetric, groups of {group_size}, one float32 scale a group "
              f"(quantized_decomposed::{TABLE_OPS[table_bits]})")
    if isinstance(embedding, PITEmbedding) and isinstance(embedding.interface, PITFactors):
        factors = embedding.interface
        t = factors.T.to(torch.float64).numpy()
        if head_bits:
            head = install_quantized_head(model, factors, head_bits, group_size, rotate, head_moments)
            head_rows, t = head.dequantized_rows(), head.transform()
            head_text = f"head: {head.describe()}"
        else:
            head_rows = factors.Zt.T.to(torch.float64).numpy()  # what the head reads, as rows
            head_text = "head: float32 Zᵀ"
        if shared and head_bits:
            if head_bits != table_bits:
                raise PitError(f"a shared token table needs the head and the gather at the same bits, got "
                               f"pte_head_bits {head_bits} and table_bits {table_bits}")
            q, scales = shared_rows(head)
            scheme = (f"the head's own {table_bits}-bit codes and scales, one table for the gather and the head "
                      f"(quantized_decomposed::{TABLE_OPS[table_bits]})")
        else:  # a table of its own, rounded from what the head reads before the head's rounding
            rows = head.rotated_rows(factors.Zt) if head_bits else torch.from_numpy(head_rows)
            q, scales = quantize_rows(rows, group_size, table_bits)
        if correct:
            matrix = correction_matrix(head_rows, dequantize_rows(q, scales), t)
        else:
            matrix = np.linalg.inv(t) if head_bits else factors.T_inv.to(torch.float64).numpy()
        rotation = rotation_of(model)  # a rotated stream: factors.T_inv holds it already, the others take it
        if rotation is not None and (correct or head_bits):
            matrix = matrix @ rotation.to(torch.float64).numpy()
        module = QuantizedRows(q, scales, torch.from_numpy(matrix).to(factors.T.dtype), embedding.multiplier,
                               table_bits)
        model.set_input_embeddings(module)
        # a quantized head's matrix S makes its basis-vector outputs exact (:mod:`.head`)
        details = {"token_table": f"embedding: {scheme}; {head_text}", "head_bits": int(head_bits),
                   "shared_table": bool(shared and head_bits), "pit_correction": bool(correct),
                   "interface_exact": bool(correct)}
        if head_bits and head.calibrated:  # GPTQ codes: what verify's weight-level check compares
            codes = {"head": codes_entry(*head.stored_codes())}
            if shared:
                codes["token_table"] = codes_entry(q.numpy(), scales.numpy())
            details[CODES_FIELD] = {"digest": CODES_DIGEST, "tensors": codes}
        return details
    if type(embedding) is nn.Embedding:  # a subclass may scale its output (Gemma): left alone
        q, scales = quantize_rows(embedding.weight, group_size, table_bits)
        model.set_input_embeddings(QuantizedRows(q, scales, bits=table_bits))
        return {"token_table": f"embedding: {scheme}; head: the float32 lm_head linear"
                               + (" (head_bits and a shared table apply to factorized programs)"
                                  if head_bits or shared else ""),
                "shared_table": False, "interface_exact": False}
    return {"token_table": f"float32 (a {type(embedding).__name__} embedding is not quantized)",
            "shared_table": False, "interface_exact": False}


def shared_rows(head: RotatedQuantizedHead) -> tuple[torch.Tensor, torch.Tensor]:
    """The gather's codes and scales read from the quantized head's weight: ``(q int8 (V, d),
    scales float32 (V, groups))``, whose dequantized rows are the head's (as XNNPACK computes them).

    4 bits: the codes in :func:`nibble_pair_swap` order (byte-identical to XNNPACK's packing) and
    the grouped scales XNNPACK stores in bfloat16, as float32 values (the runtime's
    ``embedding_4bit`` reads float32 scales only; the bfloat16 values convert exactly). 8 bits:
    the per-channel codes as they are and one scale a row (a group of ``d``), the bytes XNNPACK
    stores for a per-channel int8 weight (:meth:`~.head.RotatedQuantizedHead.stored_codes`)."""
    q, scales = (torch.from_numpy(a) for a in head.stored_codes())
    if head.bits == 4:
        q = q[:, nibble_pair_swap(q.shape[1])]
    return q.contiguous(), scales.contiguous()


def install_quantized_head(model: PreTrainedModel, factors: PITFactors, bits: int,
                           group_size: int, rotate: bool = True,
                           moments: torch.Tensor | None = None) -> RotatedQuantizedHead:
    """Replace a factorized model's head by a :class:`RotatedQuantizedHead` (registered on the
    model as ``pit_quantized_head``, keeping the head's multiplier and bias; its table rounded by
    GPTQ against ``moments`` when given) and drop the fp32 factors, which nothing reads any more."""
    old = model.get_output_embeddings()
    head = RotatedQuantizedHead(factors.Zt, factors.T, bits, group_size, ROTATION_SEED if rotate else None)
    if moments is not None:
        head.round_calibrated(factors.Zt, moments)
    model.pit_quantized_head = head
    model.set_output_embeddings(PITHead(head, old.multiplier, old.bias))
    if getattr(model, FACTORS_ATTR, None) is factors:
        delattr(model, FACTORS_ATTR)
    return head

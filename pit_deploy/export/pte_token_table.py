"""8-bit token tables for quantized ExecuTorch programs, and the PIT correction on them.

The embedding of a quantized ``.pte`` reads its table through ExecuTorch's quantized embedding
op ``quantized_decomposed::embedding_byte`` (int8 rows, one float scale per group of
``group_size`` values, dequantized ``q · s`` in the kernel; the op and its kernel ship in the
``executorch`` wheel: ``exir/passes/_quant_patterns_and_replacements.py`` defines it, the
``kernels/quantized`` library runs it — :func:`pit_deploy.runtime.standalone.load_llm_custom_ops`
loads that library for the runtime). The table is quantized symmetrically (``q ∈ [−127, 127]``,
``s = max|row group| / 127``).

Why only the embedding: the XNNPACK partitioner lowers a quantized linear only with int8
*activations* (``docs/quantization.md``), so a quantized head would round its input. A
factorized head therefore keeps reading the fp32 ``Zᵀ``, and the embedding reads the 8-bit
``Ẑ``: with ``M = (Zᵀ Ẑ)⁻¹ T⁻¹`` in place of ``T⁻¹`` (computed in float64 from the very numbers
the kernel produces) ``W_out E = T Zᵀ Ẑ M = I`` still holds — the same correction as the ONNX
exports' (:func:`pit_deploy.export.quantize_onnx.correction_matrix`), with different tables on
the two sides.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

from ..errors import PitError
from ..model.modules import PITEmbedding
from .passes import PITFactors
from .quantize_onnx import correction_matrix

QMAX = 127


def register_embedding_op() -> None:
    """Make ``torch.ops.quantized_decomposed.embedding_byte`` (and its out variant, which
    ``to_executorch`` needs) exist in this process."""
    import executorch.exir.passes._quant_patterns_and_replacements  # noqa: F401  (defines the op)
    import executorch.kernels.quantized  # noqa: F401  (its out variant)


def quantize_rows(rows: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 8-bit quantization of ``rows`` ``(V, d)`` in groups of ``group_size`` along
    ``d``. Returns ``(q int8 (V, d), scales float32 (V, d / group_size))``."""
    v, d = rows.shape
    if d % group_size:
        raise PitError(f"group size {group_size} does not divide the hidden size {d}")
    groups = rows.detach().to(torch.float64).reshape(v, d // group_size, group_size)
    scales = (groups.abs().amax(-1) / QMAX).to(torch.float32)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(groups / scales.to(torch.float64)[..., None]).clamp(-QMAX, QMAX)
    return q.to(torch.int8).reshape(v, d), scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """``q · s`` in float64, the kernel's numbers before its float32 rounding."""
    v, d = q.shape
    groups = q.to(torch.float64).reshape(v, scales.shape[1], -1) * scales.to(torch.float64)[..., None]
    return groups.reshape(v, d).numpy()


class QuantizedRows(nn.Module):
    """``ids ↦ (q · s)[ids]`` through ``quantized_decomposed::embedding_byte``, then ``@ M``
    when a correction matrix is given, then ``/ multiplier`` (a factorized embedding's)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, matrix: torch.Tensor | None = None,
                 multiplier: float = 1.0):
        super().__init__()
        register_embedding_op()
        self.register_buffer("q", q.contiguous())
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
        rows = torch.ops.quantized_decomposed.embedding_byte.default(
            self.q, self.scales, None, -QMAX, QMAX, input_ids.reshape(-1))
        if self.M is not None:
            rows = rows @ self.M
        if self.multiplier != 1.0:
            rows = rows / self.multiplier
        return rows.reshape(*input_ids.shape, rows.shape[-1])


@torch.no_grad()
def quantize_token_table(model: PreTrainedModel, group_size: int, correct: bool = True) -> dict[str, Any]:
    """Give ``model`` (a quantized twin, changed in place) an 8-bit input embedding.

    Factorized (``PITEmbedding`` over :class:`PITFactors`): the embedding reads ``Ẑ`` and
    multiplies by ``M = (Zᵀ Ẑ)⁻¹ T⁻¹`` (``correct``) or by ``T⁻¹``; the head keeps the fp32
    ``Zᵀ``. Materialized or tied (a plain ``nn.Embedding``): the table itself. Any other
    embedding module (one that computes more than a lookup) stays float32.

    Returns:
        details for the manifest: the table's scheme and whether the interface stays exact.
    """
    embedding = model.get_input_embeddings()
    scheme = (f"8-bit symmetric, groups of {group_size}, one float32 scale a group "
              "(quantized_decomposed::embedding_byte)")
    if isinstance(embedding, PITEmbedding) and isinstance(embedding.interface, PITFactors):
        factors = embedding.interface
        head_rows = factors.Zt.T.to(torch.float64)  # what the head reads, as rows
        q, scales = quantize_rows(head_rows, group_size)
        if correct:
            matrix = correction_matrix(head_rows.numpy(), dequantize_rows(q, scales),
                                       factors.T.to(torch.float64).numpy())
        else:
            matrix = factors.T_inv.to(torch.float64).numpy()
        module = QuantizedRows(q, scales, torch.from_numpy(matrix).to(factors.T.dtype), embedding.multiplier)
        model.set_input_embeddings(module)
        return {"token_table": f"embedding: {scheme}; head: float32 Zᵀ",
                "pit_correction": bool(correct), "interface_exact": bool(correct)}
    if type(embedding) is nn.Embedding:  # a subclass may scale its output (Gemma): left alone
        q, scales = quantize_rows(embedding.weight, group_size)
        model.set_input_embeddings(QuantizedRows(q, scales))
        return {"token_table": f"embedding: {scheme}; head: the float32 lm_head linear",
                "interface_exact": False}
    return {"token_table": f"float32 (a {type(embedding).__name__} embedding is not quantized)",
            "interface_exact": False}

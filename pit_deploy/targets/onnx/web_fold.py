"""Quantized ONNX weights that the runtime turns back into float32 when it loads them (the
``int8-web`` and ``int4-web`` schemes): the artifact for onnxruntime-web.

Why not the ``onnx`` target's own int8/int4 graphs there: their operators (``MatMulNBits``,
``GatherBlockQuantized``) are contrib ops. onnxruntime-web's default WASM build has no
``GatherBlockQuantized`` at all, so the folder does not load in a browser, and its
``MatMulNBits`` is an order of magnitude slower than an fp32 ``MatMul`` at one token (measured in
headless Chromium: ``studies/web_int8.py``, ``docs/web.md``). Here every weight matrix is
stored as codes with block scales and zero points, and the
graph dequantizes it with standard operators (``BitShift``, ``Sub``, ``Cast``, ``Mul``,
``Reshape``, ``Transpose``) whose inputs are all initializers: onnxruntime's constant
folding computes the fp32 weight once, when the session is created, in native builds and in
onnxruntime-web alike. The file and the download are those of a quantized model; the session
holds fp32 weights and runs fp32 kernels (no memory saved, fp32 decode speed).

The codes are the ``onnx`` target's: onnxruntime's asymmetric block quantizer
(:func:`pit_deploy.exporters.onnx_tables.block_quantize`, blocks of ``group_size`` along the input
dimension), so the expected error recorded at export (the target's weight grid) describes these
weights too. The token table of a factorized model is stored once — the dequantized ``Zᵀ`` is
one folded tensor read by both the embedding ``Gather`` and the head ``MatMul`` — and the PIT
correction replaces ``T⁻¹`` by ``M = (ẐᵀẐ)⁻¹ T⁻¹`` computed from the very codes stored, so
``W_out E = I`` holds on the runtime to fp32 rounding. ``T`` and ``M`` stay fp32 (d×d).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...exporters.onnx_graph import (
    fill_pending,
    find_graph_interface,
    gather_axis,
    gemm_to_matmul,
    initializers,
    layer_matmuls,
    remove_unused_initializers,
)
from ...exporters.onnx_tables import BITS, BlockTable, block_quantize, fold_nodes
from ...model.quantized_interface import correction_matrix

STORAGE = ("codes and block scales in standard operators on initializers, folded to float32 by "
           "onnxruntime when the session is created (fp32 kernels at run time)")


def _fold(graph, init, rows: np.ndarray, bits: int, block: int, transpose: bool) -> tuple[BlockTable, list]:
    """Replace the initializer ``init`` by its quantized codes and folding nodes."""
    table = block_quantize(rows, bits, block)
    graph.initializer.remove(init)
    return table, fold_nodes(graph, init.name, table, transpose)


def fold_graph(model, dtype: str, block: int, vocab: int, hidden: int, correct: bool, body: bool,
               table_bits: int | None = None, keep_8bit: tuple[str, ...] = (),
               tables: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """Store ``model``'s token tables (``table_bits``, default the dtype's bits) and, with
    ``body``, every other constant 2-D ``MatMul`` weight (``BITS[dtype]``; for int4 the linears
    named by ``keep_8bit`` at 8 bits) as folded codes; in factorized mode with ``correct``,
    replace ``T⁻¹`` by ``M``. ``T`` and ``T⁻¹`` stay float32. ``tables``: the tables the graph's
    initializers stand for (:func:`~pit_deploy.exporters.onnx_graph.mark_pending`), given to the
    graph first: the fold rewrites initializers in place.

    Returns:
        ``(model, details)`` for the manifest.
    """
    from onnx import numpy_helper

    graph = model.graph
    fill_pending(graph, tables or {})
    gemm_to_matmul(graph)
    iface = find_graph_interface(graph, vocab, hidden)
    bits = table_bits or BITS[dtype]
    inits = initializers(graph)
    gather_table, head_b = iface.gather.input[0], iface.head.input[1]
    # the tensor each side reads: the factorized Zᵀ (d, V) and a tied E (V, d) are one tensor for both
    head_source = head_b if head_b in inits else None  # None: a tied head reads Transpose(E)
    folded: list = []
    codes: dict[str, BlockTable] = {}
    # Gather(Zᵀ, axis=1) reads the table as (d, V): fold it back to that shape
    codes[gather_table], nodes = _fold(graph, inits[gather_table], iface.embed_rows, bits, block,
                                        transpose=gather_axis(iface.gather) == 1)
    folded += nodes
    if head_source is not None and head_source != gather_table:
        codes[head_source], nodes = _fold(graph, inits[head_source], iface.head_rows, bits, block, transpose=True)
        folded += nodes
    shared = head_source is None or head_source == gather_table
    head_q = codes[gather_table if shared else head_source]
    details: dict[str, Any] = {"storage": STORAGE, "token_table_shared": bool(shared), "table_bits": bits,
                               "group_size": block, "head_activations": "float32",
                               "interface_exact": iface.t_inv_name is not None and correct}
    if iface.t_inv_name is not None:
        details["pit_correction"] = bool(correct)
        if correct:
            t = numpy_helper.to_array(inits[iface.t_name]).astype(np.float64)
            m = correction_matrix(head_q.dequantize(), codes[gather_table].dequantize(), t)
            inits[iface.t_inv_name].CopyFrom(numpy_helper.from_array(m.astype(np.float32), iface.t_inv_name))
    kept_fp32 = {n for n in (iface.t_name, iface.t_inv_name) if n}
    counts = {4: 0, 8: 0}
    if body:
        eight = set(layer_matmuls(graph, keep_8bit)) if dtype == "int4" else set()
        for node in list(graph.node):
            weight = node.input[1] if node.op_type == "MatMul" and len(node.input) > 1 else None
            if weight is None or weight not in inits or weight in kept_fp32 or weight in codes:
                continue
            array = numpy_helper.to_array(inits[weight])
            if array.ndim != 2:
                continue
            width = 8 if node.name in eight else BITS[dtype]
            codes[weight], nodes = _fold(graph, inits[weight], np.ascontiguousarray(array.T), width, block,
                                          transpose=True)
            folded += nodes
            counts[width] += 1
        details["body"] = (f"{counts[BITS[dtype]]} linears at {BITS[dtype]} bits"
                           + (f", {counts[8]} at 8 bits ({', '.join(keep_8bit)})" if dtype == "int4" else "")
                           + f", asymmetric blocks of {block}, folded to float32 at load")
    # the folding nodes read initializers only; put them first so the graph stays topologically sorted
    rest = list(graph.node)
    del graph.node[:]
    graph.node.extend(folded + rest)
    remove_unused_initializers(graph)
    details["interface_kept_fp32"] = sorted(kept_fp32)
    return model, details

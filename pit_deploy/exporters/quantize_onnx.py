"""Weight quantization of an exported ONNX decoder (int8, int4), and the PIT-exact correction.

Everything quantizes through onnxruntime's own tools (``onnxruntime.quantization``):

* **body** (every ``MatMul`` with a constant 2-D weight, except the token interface):
  ``MatMulNBitsQuantizer`` (``MatMulNBits``, asymmetric 8- or 4-bit weights in blocks of
  ``group_size`` along the input dimension, ``accuracy_level=4``: int8 activations per block
  on CPU). ``quantize_dynamic`` (per-tensor int8 activations) was measured and rejected.
* **token tables** (the embedding's ``Gather`` and the head's ``MatMul``): block-quantized
  (``table_bits``: 8 by default for both dtypes, as llama.cpp's Q4_K_M keeps its output
  matrix at 6 bits; a 4-bit table costs mean KL on the default model's factorized int4
  artifact and makes it the smallest, ``studies/onnx-quantized-decode.md``) with the same onnxruntime
  routine (``DefaultWeightOnlyQuantizer.qbits_block_quant``, blocks along ``d``), the embedding read by ``com.microsoft.GatherBlockQuantized`` and the head by
  ``MatMulNBits``. Both ops take the table in the same packed layout (rows = tokens, two 4-bit
  values per byte low nibble first), so where the head and the embedding read the same table
  (factorized ``Zᵀ``, a transpose-tied model) the bytes are identical and
  :func:`~pit_deploy.exporters.onnx_graph.save_deduplicated` stores them once, as onnxruntime-genai does for tied models
  (``docs/quantization.md``).

The graph surgery lives in :mod:`.onnx_graph`, the tables' codec, GPTQ rounding and rotation in
:mod:`.onnx_tables`; this module puts them together.

**PIT-exact factorized quantization.** In factorized mode the head computes ``(h T) Ẑᵀ`` and
the embedding ``Ẑ[ids] T⁻¹``. Quantizing ``Z`` breaks ``W_out E = I``; with the correction the
``T⁻¹`` constant is replaced by ``M = (ẐᵀẐ)⁻¹ T⁻¹``, computed in float64 from the very table the
runtime dequantizes (read back from the quantized bytes), so that
``W_out E = T ẐᵀẐ (ẐᵀẐ)⁻¹ T⁻¹ = I`` up to fp32 rounding. The head's ``MatMulNBits`` keeps fp32
activations (no ``accuracy_level``): with int8 activations the rows of ``T`` it is fed would
be rounded and the identity would hold only to about 1e-2. Every other head keeps them too
(measured: a larger KL with int8 activations), and an 8-bit table is read as two 4-bit
nibble planes, for which onnxruntime has a fast fp32-activation kernel (:func:`~pit_deploy.exporters.onnx_tables.split_nibbles`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import PitError
from ..model.quantized_interface import correction_matrix
from .onnx_graph import (
    Interface,
    add_initializer,
    consumers,
    ensure_ms_domain,
    fill_pending,
    find_graph_interface,
    gather_axis,
    gemm_to_matmul,
    initializers,
    layer_matmuls,
    remove_unused_initializers,
    replace_node,
    weight_digest,
)
from .onnx_tables import BITS, BlockTable, Planes, block_quantize, block_table_from_codes, calibrated_table, \
    fold_nodes, rotate_table, table_planes

#: ``accuracy_level`` of the body's ``MatMulNBits``: 4 = int8 activations (MLAS CompInt8)
BODY_ACCURACY_LEVEL = 4
#: ``accuracy_level`` of a head with int8 activations (``head_int8``)
HEAD_INT8_ACCURACY_LEVEL = 4


def _sum_nodes(graph, name: str, terms: list[tuple[str, float]], output: str) -> list:
    """Nodes computing ``Σ factor · term`` into ``output`` (``Mul`` by an exact power of two,
    then ``Add``)."""
    from onnx import helper

    if len(terms) == 1:
        return []
    nodes, scaled = [], []
    for k, (term, factor) in enumerate(terms):
        if factor != 1.0:
            const = add_initializer(graph, f"{name}.factor{k}", np.array(factor, np.float32))
            nodes.append(helper.make_node("Mul", [term, const], [f"{term}_x"], name=f"{name}_mul{k}"))
            term = f"{term}_x"
        scaled.append(term)
    acc = scaled[0]
    for k, term in enumerate(scaled[1:], 1):
        out = output if k == len(scaled) - 1 else f"{name}.sum{k}"
        nodes.append(helper.make_node("Add", [acc, term], [out], name=f"{name}_add{k}"))
        acc = out
    return nodes


def _plane_names(graph, prefix: str, planes: Planes, gather: bool) -> list[list[str]]:
    """Initializer names (packed data, scales, zero points) of each plane, the data shaped for
    ``GatherBlockQuantized`` (``(V, d·bits/8)``) or ``MatMulNBits`` (``(V, blocks, blob)``).
    Two ops reading the same table get equal bytes, which :func:`~pit_deploy.exporters.onnx_graph.save_deduplicated` stores once."""
    names = []
    for k, (table, _) in enumerate(planes):
        data = table.packed.reshape(table.packed.shape[0], -1) if gather else table.packed
        names.append([add_initializer(graph, f"{prefix}.p{k}.data", data), add_initializer(graph, f"{prefix}.p{k}.scales", table.scales),
                      add_initializer(graph, f"{prefix}.p{k}.zero_points", table.zero_points)])
    return names


def rewrite_interface(model, iface: Interface, bits: int, block: int, correct: bool,
                      head_moments: np.ndarray | None = None,
                      table_cache: dict[str, Any] | None = None, head_int8: bool = False) -> dict[str, Any]:
    """Replace the embedding Gather by ``GatherBlockQuantized`` and the head MatMul by
    ``MatMulNBits``; in factorized mode with ``correct``, replace ``T⁻¹`` by ``M``.

    ``head_moments`` (``Σ hᵀh`` of the head's input on calibration text): the head's table is
    rounded by GPTQ against them (:func:`~pit_deploy.exporters.onnx_tables.calibrated_table`,
    ``table_cache`` its cache) instead of to nearest; a shared embedding reads the same codes,
    and the correction is computed from them.

    The head keeps fp32 activations in every mode (no ``accuracy_level``): in factorized mode
    so that ``W_out E = I`` holds on the runtime, and everywhere because int8 activations in the
    head measured a larger mean KL on the default model's materialized exports, failing the
    bounds (``studies/onnx-quantized-decode.md``). An 8-bit table is stored as its two nibble
    planes (:func:`~pit_deploy.exporters.onnx_tables.split_nibbles`); where the embedding reads the same table it gathers both.

    Returns:
        details for the manifest: whether the tables are shared, the correction applied.
    """
    from onnx import helper

    graph = model.graph
    ensure_ms_domain(model)
    # the table's readers are replaced below: the turned rows need not go into the graph
    rotated, factor = rotate_table(graph, iface, int8_block=block if head_int8 else None, write_table=False)
    head_int8 = head_int8 and rotated  # only a turned factorized table has its factor on the grid
    shared = iface.embed_rows is iface.head_rows or np.array_equal(iface.embed_rows, iface.head_rows)
    head_q = block_quantize(iface.head_rows, bits, block) if head_moments is None else \
        calibrated_table(graph, iface, bits, block, head_moments, table_cache)
    emb_q = head_q if shared else block_quantize(iface.embed_rows, bits, block)
    v, d = iface.head_rows.shape
    prefix = "pit_q"
    # int8 activations have a fast 8-bit kernel, so an 8-bit table is read whole there
    head_planes = [(head_q, 1.0)] if head_int8 else table_planes(head_q)
    emb_planes = head_planes if shared else [(emb_q, 1.0)]
    head_names = _plane_names(graph, f"{prefix}.head", head_planes, gather=False)
    # head: MatMulNBits(A, B (N, kb, blob), scales, zero points) per plane, summed
    head_name = iface.head.name or "head"
    outs = [iface.head.output[0]] if len(head_planes) == 1 else \
        [f"{head_name}_plane{k}" for k in range(len(head_planes))]
    level = {"accuracy_level": HEAD_INT8_ACCURACY_LEVEL} if head_int8 else {}
    nodes = [helper.make_node("MatMulNBits", [iface.head.input[0], *names], [out], name=f"{head_name}_Q{k}",
                              domain="com.microsoft", K=d, N=v, bits=table.bits, block_size=table.block, **level)
             for k, ((table, _), names, out) in enumerate(zip(head_planes, head_names, outs))]
    nodes += _sum_nodes(graph, f"{head_name}_planes", list(zip(outs, [f for _, f in head_planes])),
                        iface.head.output[0])
    replace_node(graph, iface.head, nodes)
    # embedding: GatherBlockQuantized(data (V, d·bits/8), ids, scales, zero points) per plane
    emb_names = _plane_names(graph, f"{prefix}.embed", emb_planes, gather=True)
    target, remove = iface.gather.output[0], None
    if gather_axis(iface.gather) == 1:
        # Gather(Zᵀ, axis=1) gave (d, N), transposed next: gather rows (N, d) and keep the
        # Transpose's output name for its consumers.
        follow = consumers(graph, iface.gather.output[0])
        if len(follow) != 1 or follow[0].op_type != "Transpose":
            raise PitError("unexpected factorized embedding graph (Gather along axis 1 not followed by Transpose)")
        target, remove = follow[0].output[0], follow[0]
    gather_name = iface.gather.name or "embed"
    gouts = [target] if len(emb_planes) == 1 else [f"{gather_name}_plane{k}" for k in range(len(emb_planes))]
    nodes = [helper.make_node("GatherBlockQuantized", [names[0], iface.gather.input[1], names[1], names[2]], [out],
                              name=f"{gather_name}_Q{k}", domain="com.microsoft", gather_axis=0,
                              quantize_axis=1, block_size=table.block, bits=table.bits)
             for k, ((table, _), names, out) in enumerate(zip(emb_planes, emb_names, gouts))]
    nodes += _sum_nodes(graph, f"{gather_name}_planes", list(zip(gouts, [f for _, f in emb_planes])), target)
    replace_node(graph, iface.gather, nodes)
    if remove is not None:
        graph.node.remove(remove)
    details: dict[str, Any] = {"token_table_shared": bool(shared), "table_bits": bits, "group_size": block,
                               "head_activations": f"int8 per block of {block} (accuracy_level "
                                                   f"{HEAD_INT8_ACCURACY_LEVEL}), its d x d factor on that grid"
                                                   if head_int8 else "float32",
                               "table_planes": len(head_planes),
                               "table_rounding": "to nearest" if head_moments is None else
                               "GPTQ against the head input's second moments on the calibration text"}
    if head_moments is not None:  # GPTQ codes: verify's weight-level check compares them with this digest
        from ..io.weight_codes import CODES_DIGEST, CODES_FIELD, table_entry

        details[CODES_FIELD] = {"digest": CODES_DIGEST, "tensors": {"token_table": table_entry(head_q)}}
    if rotated:
        details["table_rotation"] = ("the table holds Z R (R a randomized Hadamard d x d); "
                                     "T R on the head's side, R^T T^-1 on the embedding's")
    details["interface_exact"] = iface.t_inv_name is not None and correct
    if iface.t_inv_name is not None:
        details["pit_correction"] = bool(correct)
        if correct:
            from onnx import numpy_helper

            inits = initializers(graph)
            t = numpy_helper.to_array(inits[iface.t_name]).astype(np.float64)
            z_head = head_q.dequantize()
            m = correction_matrix(z_head, z_head if emb_q is head_q else emb_q.dequantize(), t)
            inits[iface.t_inv_name].CopyFrom(numpy_helper.from_array(m.astype(np.float32), iface.t_inv_name))
    if head_int8 and factor is not None:
        store_factor_codes(graph, iface.t_name, factor)
        details["head_factor"] = (f"8-bit codes and a scale per block of {block} (the int8 activations' grid), "
                                  "folded to float32 when the session is created")
    remove_unused_initializers(graph)
    return details


def store_factor_codes(graph, name: str, factor: BlockTable) -> None:
    """Store the int8-activation head's ``d×d`` factor ``S`` (the initializer ``name``) as the
    codes it is made of (:func:`~pit_deploy.exporters.onnx_tables.int8_block_grid_table`) and
    nodes that fold them back to the same float32 values when the session is created
    (:func:`~pit_deploy.exporters.onnx_tables.fold_nodes`): a quarter of the bytes in the file
    (1.0 MB less at ``d = 576``), the same tensor in the session, so ``W_out E = I`` holds as
    before. Its codes are named ``{name}.grid8``: ``S`` is no weight of the reference (verify's
    weight check pairs ``.q8`` codes with one); the interface identity is what checks it."""
    from onnx import numpy_helper

    inits = initializers(graph)
    stored = numpy_helper.to_array(inits[name])
    if not np.array_equal(stored, factor.dequantize()):
        raise RuntimeError(f"the head's factor {name} is not what its codes fold back to")
    graph.initializer.remove(inits[name])
    folding = fold_nodes(graph, name, factor, transpose=False, codes_name=f"{name}.grid8")
    # the folding nodes read initializers only; first, so that the graph stays topologically sorted
    rest = list(graph.node)
    del graph.node[:]
    graph.node.extend(folding + rest)


def write_calibrated_matmuls(model, codes: dict[str, Any]) -> int:
    """Replace each ``MatMul`` whose constant weight is a calibrated linear's (``codes``: by
    :func:`~pit_deploy.exporters.onnx_graph.weight_digest` of the dequantized weight, transposed as the graph holds it) with a
    ``MatMulNBits`` over that linear's own codes (``accuracy_level`` as the body's); returns how
    many. The quantizer that runs next leaves them alone: they are no ``MatMul`` any more.

    Raises:
        RuntimeError: a calibrated linear has no ``MatMul`` in the graph (an internal error:
            its codes would be silently rounded again).
    """
    from onnx import helper, numpy_helper

    if not codes:
        return 0
    graph = model.graph
    ensure_ms_domain(model)
    inits = initializers(graph)
    found = 0
    for node in list(graph.node):
        if node.op_type != "MatMul" or node.input[1] not in inits:
            continue
        weight = numpy_helper.to_array(inits[node.input[1]])
        rounded = codes.get(weight_digest(weight)) if weight.ndim == 2 else None
        if rounded is None:
            continue
        table = block_table_from_codes(rounded)
        prefix = f"pit_gptq.{node.name or node.output[0]}"
        names = [add_initializer(graph, f"{prefix}.{part}", array) for part, array in
                 (("codes", table.packed), ("scales", table.scales), ("zero_points", table.zero_points))]
        k, n = weight.shape
        replace_node(graph, node, [helper.make_node(
            "MatMulNBits", [node.input[0], *names], [node.output[0]], name=f"{node.name}_Q{table.bits}",
            domain="com.microsoft", K=k, N=n, bits=table.bits, block_size=table.block,
            accuracy_level=BODY_ACCURACY_LEVEL)])
        found += 1
    if found != len(codes):
        raise RuntimeError(f"{len(codes) - found} of {len(codes)} calibrated linears have no MatMul with their "
                           "weights in the exported graph")
    remove_unused_initializers(graph)
    return found


def quantize_body(model, dtype: str, block: int, exclude: list[str], keep_8bit: tuple[str, ...] = (),
                  codes: dict[str, Any] | None = None):
    """Quantize every other constant-weight MatMul with onnxruntime's ``MatMulNBitsQuantizer``:
    asymmetric ``BITS[dtype]``-bit weights in blocks of ``block`` along the input dimension,
    ``accuracy_level=4`` (activations quantized to int8 per block at run time). For ``int4``,
    the linears named in ``keep_8bit`` (``v_proj``, ``down_proj`` by default, as in the
    ExecuTorch programs and llama.cpp's Q4_K_M) get 8-bit weights first.

    Not ``quantize_dynamic``: its per-tensor uint8 activations measured a far larger mean KL on
    the default model (SmolLM2's activation outliers) than 8-bit weights alone
    (``studies/onnx-quantized-decode.md``, "What is quantized, and how").

    ``codes``: a calibrated model's codes by weight digest (:func:`write_calibrated_matmuls`),
    written as they are before the quantizer rounds what is left.

    Returns:
        ``(model, number of linears kept at 8 bits)``.
    """
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    def quantize(graph_model, bits: int, skip: list[str]):
        # nodes_to_exclude, not nodes_to_include: the quantizer takes an included node *besides*
        # every node of op_types_to_quantize, so it cannot narrow a pass
        quant = MatMulNBitsQuantizer(graph_model, bits=bits, block_size=block, is_symmetric=False,
                                     accuracy_level=BODY_ACCURACY_LEVEL, nodes_to_exclude=skip,
                                     op_types_to_quantize=("MatMul",))
        quant.process()
        return quant.model.model

    gemm_to_matmul(model.graph)
    write_calibrated_matmuls(model, codes or {})
    calibrated_8bit = sum(r.grid.bits == 8 for r in (codes or {}).values()) if dtype == "int4" else 0
    kept = [n for n in layer_matmuls(model.graph, keep_8bit) if n not in exclude] if dtype == "int4" else []
    if kept:
        others = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name not in kept]
        model = quantize(model, 8, others)  # what it quantizes is no MatMul any more for the next pass
    return quantize(model, BITS[dtype], list(exclude)), len(kept) + calibrated_8bit


def quantize_graph(model, dtype: str, block: int, vocab: int, hidden: int, correct: bool,
                   body: bool, table_bits: int | None = None,
                   keep_8bit: tuple[str, ...] = (), codes: dict[str, Any] | None = None,
                   head_moments: np.ndarray | None = None,
                   table_cache: dict[str, Any] | None = None, head_int8: bool = False,
                   tables: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """Quantize one exported graph in memory: its token interface (``table_bits``, default
    the dtype's bits; ``head_moments``, ``table_cache``: see :func:`rewrite_interface`) and, with ``body``, every
    other weight matrix (``keep_8bit``, ``codes``: see :func:`quantize_body`). ``tables``: the
    :class:`~pit_deploy.exporters.onnx_graph.StoredTable` of each initializer that stands for one
    (:func:`~pit_deploy.exporters.onnx_graph.find_graph_interface` reads them from it).

    Returns:
        ``(model, details)``.
    """
    bits = table_bits or BITS[dtype]
    iface = find_graph_interface(model.graph, vocab, hidden, tables)
    keep_fp32 = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in
                 {iface.t_name, iface.t_inv_name}]
    details = rewrite_interface(model, iface, bits, block, correct, head_moments, table_cache, head_int8)
    iface.embed_rows = iface.head_rows = None  # the tables' rows are in the graph now, rounded
    fill_pending(model.graph, tables or {})  # a table the rewrite left in the graph: what the body reads
    kept = 0
    if body:
        model, kept = quantize_body(model, dtype, block, keep_fp32, keep_8bit, codes)
    details["body"] = (f"MatMulNBits {BITS[dtype]}-bit asymmetric weights, block {block}, "
                       f"accuracy_level {BODY_ACCURACY_LEVEL} (int8 activations per block)"
                       f"{'; GPTQ codes written as calibrated' if body and codes else ''}")
    if dtype == "int4":
        details["body_8bit"] = f"8-bit for {', '.join(keep_8bit) or 'none'} ({kept} linears)"
    details["interface_kept_fp32"] = sorted(n for n in [iface.t_name, iface.t_inv_name] if n)
    return model, details

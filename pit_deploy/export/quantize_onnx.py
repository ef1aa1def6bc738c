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
  :func:`save_deduplicated` stores them once, as onnxruntime-genai does for tied models
  (``docs/quantization.md``).

**PIT-exact factorized quantization.** In factorized mode the head computes ``(h T) Ẑᵀ`` and
the embedding ``Ẑ[ids] T⁻¹``. Quantizing ``Z`` breaks ``W_out E = I``; with the correction the
``T⁻¹`` constant is replaced by ``M = (ẐᵀẐ)⁻¹ T⁻¹``, computed in float64 from the very table the
runtime dequantizes (read back from the quantized bytes), so that
``W_out E = T ẐᵀẐ (ẐᵀẐ)⁻¹ T⁻¹ = I`` up to fp32 rounding. The head's ``MatMulNBits`` keeps fp32
activations (no ``accuracy_level``): with int8 activations the rows of ``T`` it is fed would
be rounded and the identity would hold only to about 1e-2. Every other head keeps them too
(measured: a larger KL with int8 activations), and an 8-bit table is read as two 4-bit
nibble planes, for which onnxruntime has a fast fp32-activation kernel (:func:`split_nibbles`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import PitError
from ..model.quantized_interface import correction_matrix
from ..schemes import names_linear

#: bits of each quantized dtype
BITS = {"int8": 8, "int4": 4}
#: ``accuracy_level`` of the body's ``MatMulNBits``: 4 = int8 activations (MLAS CompInt8)
BODY_ACCURACY_LEVEL = 4
#: initializers smaller than this stay inside the ``.onnx`` file
EXTERNAL_MIN_BYTES = 1024


@dataclass
class BlockTable:
    """A table of ``rows`` (tokens) × ``cols`` (d) in MatMulNBits/GatherBlockQuantized layout.

    ``packed``: ``(rows, cols / block, block · bits / 8)`` uint8; ``scales``: ``(rows, cols /
    block)`` float32; ``zero_points``: ``(rows, ⌈blocks · bits / 8⌉)`` uint8 (4-bit ones packed
    two per byte, low nibble first).
    """

    packed: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray
    bits: int
    block: int

    def dequantize(self) -> np.ndarray:
        """``(q − zero_point) · scale`` in float32, exactly as the runtime computes it."""
        n, kb = self.scales.shape
        q = np.empty((n, kb, self.block), np.float32)
        if self.bits == 4:
            q[..., 0::2] = self.packed & 0x0F
            q[..., 1::2] = self.packed >> 4
            zz = self.zero_points.reshape(n, -1)
            z = np.empty((n, 2 * zz.shape[1]), np.float32)
            z[:, 0::2], z[:, 1::2] = zz & 0x0F, zz >> 4
            z = z[:, :kb]
        else:
            q[:] = self.packed
            z = self.zero_points.reshape(n, kb).astype(np.float32)
        return ((q - z[..., None]) * self.scales[..., None]).reshape(n, kb * self.block)


def block_quantize(rows: np.ndarray, bits: int, block: int) -> BlockTable:
    """Asymmetric block quantization of ``rows`` ``(N, K)`` along ``K`` (onnxruntime's routine)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    if rows.shape[1] % block:
        raise PitError(f"group size {block} does not divide the hidden size {rows.shape[1]}")
    config = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=False, bits=bits)
    packed, scales, zp = DefaultWeightOnlyQuantizer(config).qbits_block_quant(
        np.ascontiguousarray(rows.T.astype(np.float32))  # MatMulNBits quantizes B (K, N) per column
    )
    return BlockTable(packed, scales, zp, bits, block)


# --------------------------------------------------------------------------------------
# Finding the token interface in an exported graph
# --------------------------------------------------------------------------------------


@dataclass
class Interface:
    """The nodes of the token interface of one graph (decoder or ``interface.onnx``)."""

    gather: Any  # the embedding's Gather node
    head: Any  # the MatMul that multiplies by the V-wide table
    embed_rows: np.ndarray  # (V, d) table the Gather reads, as rows
    head_rows: np.ndarray  # (V, d) table the head reads, as rows (W_out = head_rowsᵀ)
    t_name: str | None = None  # factorized: the T initializer the head multiplies by first
    t_inv_name: str | None = None  # factorized: the T⁻¹ initializer after the Gather


def _initializers(graph) -> dict[str, Any]:
    return {init.name: init for init in graph.initializer}


def _consumers(graph, name: str) -> list[Any]:
    return [n for n in graph.node if name in n.input]


def _producer(graph, name: str):
    for n in graph.node:
        if name in n.output:
            return n
    return None


def _gather_axis(node) -> int:
    for attr in node.attribute:
        if attr.name == "axis":
            return int(attr.i)
    return 0


def find_graph_interface(graph, vocab: int, hidden: int) -> Interface:
    """The embedding Gather and the head MatMul of ``graph`` (a tied head may read ``Eᵀ``
    through a ``Transpose`` node)."""
    from onnx import numpy_helper

    inits = _initializers(graph)
    gathers, head = [], None
    for node in graph.node:
        if node.op_type == "Gather" and node.input[0] in inits:
            if tuple(inits[node.input[0]].dims) in ((vocab, hidden), (hidden, vocab)):
                gathers.append(node)
        if node.op_type == "MatMul":
            b = node.input[1]
            if b in inits and tuple(inits[b].dims) == (hidden, vocab):
                head = node
            elif b not in inits:
                producer = _producer(graph, b)
                if (producer is not None and producer.op_type == "Transpose" and producer.input[0] in inits
                        and tuple(inits[producer.input[0]].dims) == (vocab, hidden)):
                    head = node
    gather = _token_gather(graph, gathers)
    if gather is None or head is None:
        raise PitError("the exported graph has no recognizable embedding Gather and head MatMul; "
                       "cannot quantize its token interface")
    table = numpy_helper.to_array(inits[gather.input[0]])
    embed_rows = table.T if _gather_axis(gather) == 1 else table
    b = head.input[1]
    if b in inits:
        head_rows = numpy_helper.to_array(inits[b]).T
    else:  # a tied head: MatMul(h, Transpose(E))
        head_rows = numpy_helper.to_array(inits[_producer(graph, b).input[0]])
    iface = Interface(gather, head, np.ascontiguousarray(embed_rows), np.ascontiguousarray(head_rows))
    # factorized: Gather(Zt, axis=1) -> Transpose -> MatMul(., T_inv); head = MatMul(MatMul(h, T), Zt)
    first = _producer(graph, head.input[0])
    if _gather_axis(gather) == 1 and first is not None and first.op_type == "MatMul" and first.input[1] in inits:
        iface.t_name = first.input[1]
        follow = _consumers(graph, gather.output[0])
        if len(follow) == 1 and follow[0].op_type == "Transpose":
            after = _consumers(graph, follow[0].output[0])
            if len(after) == 1 and after[0].op_type == "MatMul" and after[0].input[1] in inits:
                iface.t_inv_name = after[0].input[1]
    return iface


#: ops that pass their first input's values on unchanged, only reshaped or retyped
_PASS_THROUGH = ("Reshape", "Unsqueeze", "Squeeze", "Flatten", "Cast", "Identity")


def _reads_token_ids(graph, name: str) -> bool:
    """Does the tensor ``name`` hold the graph input ``input_ids`` (through reshapes and casts)?"""
    for _ in range(16):
        if name == "input_ids":
            return True
        producer = _producer(graph, name)
        if producer is None or producer.op_type not in _PASS_THROUGH:
            return False
        name = producer.input[0]
    return False


def _token_gather(graph, gathers: list):
    """The embedding ``Gather`` among those reading a ``V×d`` table: the one whose indices are
    the token ids. A model whose learned position table has as many rows as the vocabulary
    (GPT-2 with ``n_positions == vocab_size``) has two such Gathers; the one of ``position_ids``
    is not the token table."""
    if len(gathers) <= 1:
        return gathers[0] if gathers else None
    by_ids = [node for node in gathers if _reads_token_ids(graph, node.input[1])]
    if len(by_ids) != 1:
        raise PitError(f"the exported graph has {len(gathers)} Gathers of a vocabulary-by-hidden table and "
                       f"{len(by_ids)} of them read input_ids; cannot tell the token embedding apart")
    return by_ids[0]


# --------------------------------------------------------------------------------------
# Rewriting the interface
# --------------------------------------------------------------------------------------


def _replace_node(graph, old, new_nodes: list) -> None:
    index = list(graph.node).index(old)
    graph.node.remove(old)
    for offset, node in enumerate(new_nodes):
        graph.node.insert(index + offset, node)


def _add(graph, name: str, array: np.ndarray) -> str:
    from onnx import numpy_helper

    graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
    return name


def _remove_dead_nodes(graph) -> int:
    """Remove nodes none of whose outputs is read (by a node or as a graph output), until none
    is left: a tied head's ``Transpose(E)`` outlives the head it fed, and its fp32 table would
    otherwise stay in the file. Returns the number removed."""
    def reads(nodes) -> set[str]:  # inputs of nodes, and of the nodes of their subgraphs
        names = set()
        for n in nodes:
            names.update(n.input)
            for attr in n.attribute:
                for sub in [attr.g] * attr.HasField("g") + list(attr.graphs):
                    names |= reads(sub.node)
        return names

    removed = 0
    while True:
        read = reads(graph.node) | {o.name for o in graph.output}
        dead = [n for n in graph.node if not any(o in read for o in n.output if o)]
        if not dead:
            return removed
        for node in dead:
            graph.node.remove(node)
        removed += len(dead)


def _remove_unused_initializers(graph) -> None:
    _remove_dead_nodes(graph)
    used = {i for n in graph.node for i in n.input}
    keep = [init for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)


def _ensure_ms_domain(model) -> None:
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        entry = model.opset_import.add()
        entry.domain, entry.version = "com.microsoft", 1


def split_nibbles(table: BlockTable) -> tuple[BlockTable, BlockTable]:
    """An 8-bit table as two 4-bit tables with the same scales: ``q = 16·hi + lo`` and
    ``z = 16·z_hi + z_lo``, so ``(q − z)·s = 16·(hi − z_hi)·s + (lo − z_lo)·s`` exactly.

    Why: onnxruntime's ``MatMulNBits`` has no fused CPU kernel for 8-bit weights with fp32
    activations (it dequantizes the whole table on every call, far slower on the default model's
    head than a 4-bit table; ``benchmarks/onnx_head_kernels.py``, ``studies/onnx-quantized-decode.md``,
    "Measured on the default model"). Two 4-bit
    products of the nibble planes give the 8-bit product with fp32 activations, in the same
    bytes as the 8-bit table.
    """
    if table.bits != 8:
        raise ValueError("split_nibbles takes an 8-bit table")
    n, kb = table.scales.shape

    def pack(values: np.ndarray) -> np.ndarray:  # (..., 2k) of 0..15 -> (..., k), low nibble first
        return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)

    z = table.zero_points.reshape(n, kb)
    z = np.concatenate([z, np.zeros((n, kb % 2), np.uint8)], axis=1)  # pad to whole bytes
    planes = []
    for shift in (4, 0):
        q = (table.packed >> shift) & 0x0F
        planes.append(BlockTable(pack(q), table.scales, pack((z >> shift) & 0x0F), 4, table.block))
    return planes[0], planes[1]


#: (table, factor) terms whose factor-weighted sum is the dequantized table
Planes = list[tuple[BlockTable, float]]


def table_planes(table: BlockTable) -> Planes:
    """How the head (fp32 activations) reads ``table``: a 4-bit table whole, an 8-bit one as
    the two nibble planes of :func:`split_nibbles`."""
    if table.bits == 8:
        hi, lo = split_nibbles(table)
        return [(hi, 16.0), (lo, 1.0)]
    return [(table, 1.0)]


def _sum_nodes(graph, name: str, terms: list[tuple[str, float]], output: str) -> list:
    """Nodes computing ``Σ factor · term`` into ``output`` (``Mul`` by an exact power of two,
    then ``Add``)."""
    from onnx import helper

    if len(terms) == 1:
        return []
    nodes, scaled = [], []
    for k, (term, factor) in enumerate(terms):
        if factor != 1.0:
            const = _add(graph, f"{name}.factor{k}", np.array(factor, np.float32))
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
    Two ops reading the same table get equal bytes, which :func:`save_deduplicated` stores once."""
    names = []
    for k, (table, _) in enumerate(planes):
        data = table.packed.reshape(table.packed.shape[0], -1) if gather else table.packed
        names.append([_add(graph, f"{prefix}.p{k}.data", data), _add(graph, f"{prefix}.p{k}.scales", table.scales),
                      _add(graph, f"{prefix}.p{k}.zero_points", table.zero_points)])
    return names


#: weight of the embedding's term in a factorized table's GPTQ rounding, each term scaled to a
#: mean diagonal of 1 (default model, onnx-genai int4 with a 4-bit table, verify's mean KL:
#: 0.238 rounded to nearest, 0.201 / 0.184 / 0.189 at weights 0 / 1 / 4; studies/int4-frontier.md)
EMBEDDING_WEIGHT = 1.0


def calibrated_table(graph, iface: Interface, bits: int, block: int, moments: np.ndarray) -> BlockTable:
    """The head's table rounded by GPTQ (:func:`pit_deploy.export.calibrated_rounding.gptq`) on
    ``MatMulNBits``' grid (unsigned codes, an integer zero point and a float32 scale a block),
    weighted by the second moments of what the head multiplies: ``h T`` in a factorized graph,
    so ``tᵀ (Σ hᵀh) t`` with ``t`` the graph's own ``d×d`` factor, plus the embedding's term
    ``t⁻¹ t⁻ᵀ`` (the shared rows are multiplied by ``≈ T⁻¹`` there; :data:`EMBEDDING_WEIGHT`);
    else ``Σ hᵀh``. ``moments``: ``Σ hᵀh`` of the hidden states the head reads on calibration
    text (:func:`~pit_deploy.export.calibrated_rounding.head_moments`)."""
    import torch
    from onnx import numpy_helper

    from .calibrated_rounding import RoundingGrid, gptq

    h = np.asarray(moments, dtype=np.float64)
    if iface.t_name is not None:
        t = numpy_helper.to_array(_initializers(graph)[iface.t_name]).astype(np.float64)
        h = t.T @ h @ t
        # the embedding reads these rows too, through T⁻¹: an error along T's small directions,
        # cheap for the head, is what T⁻¹ amplifies; so that term weighs as much as the head's
        t_inv = np.linalg.inv(t)
        h_embed = t_inv @ t_inv.T
        h = h / np.diag(h).mean() + EMBEDDING_WEIGHT * h_embed / np.diag(h_embed).mean()
    # the onnx target quantizes two graphs with the same table (the decoder, interface.onnx):
    # the second asks for exactly the first's rounding
    key = (weight_digest(iface.head_rows), hashlib.sha256(h.tobytes()).hexdigest(), bits, block)
    if _LAST_TABLE.get("key") != key:
        rounded = gptq(torch.from_numpy(iface.head_rows.astype(np.float64)), torch.from_numpy(h),
                       RoundingGrid(bits, block, symmetric=False))
        _LAST_TABLE.update(key=key, table=block_table_from_codes(rounded))
    return _LAST_TABLE["table"]


#: the last table :func:`calibrated_table` rounded, by its inputs' digests (one entry)
_LAST_TABLE: dict[str, Any] = {}


def rotate_table(graph, iface: Interface) -> bool:
    """Turn a factorized graph's token table by ``R`` before it is quantized: the table's rows
    become ``Z R``, the head's factor ``T R`` and the embedding's ``Rᵀ T⁻¹`` (``R`` the
    randomized Hadamard matrix of :func:`.residual_rotation.rotation_matrix`), so that
    ``h T Zᵀ = (h T R)(Z R)ᵀ`` and ``z T⁻¹ = (z R)(Rᵀ T⁻¹)``: the graph computes the same
    function, with nothing added at run time (``T`` and ``T⁻¹`` are ``d×d`` products it has
    anyway), and the correction computed afterwards from the graph's own factor keeps
    ``W_out E = I``.

    Why: a token's row has a few large coordinates, and one 4-bit scale a block of 32 spends its
    range on them; ``R`` spreads them over every coordinate (incoherence processing, as in QuIP,
    Chee et al., 2023, arXiv:2307.13304, and QuaRot, Ashkboos et al., 2024, arXiv:2404.00456).
    Default model: ``studies/onnx-genai-int4.md``, "GPTQ in the builder's body".

    Returns:
        whether the table was turned: only a factorized graph whose table and factors no node
        but the interface's reads (a graph where something else reads them keeps them as they are).
    """
    import torch
    from onnx import numpy_helper

    from ..model.core import rotate_rows
    from .residual_rotation import rotation_matrix

    if iface.t_name is None or iface.t_inv_name is None:
        return False
    inits = _initializers(graph)
    table_names = {iface.gather.input[0], iface.head.input[1]}
    if not table_names <= set(inits):
        return False
    t_reader = _producer(graph, iface.head.input[0])
    transpose = _consumers(graph, iface.gather.output[0])
    t_inv_reader = _consumers(graph, transpose[0].output[0]) if len(transpose) == 1 else []
    own = {id(iface.gather), id(iface.head), id(t_reader), *(id(n) for n in t_inv_reader)}
    for name in (*table_names, iface.t_name, iface.t_inv_name):
        if any(id(n) not in own for n in _consumers(graph, name)):
            return False
    r = rotation_matrix(iface.head_rows.shape[1]).numpy()

    def put(name: str, value: np.ndarray) -> None:
        inits[name].CopyFrom(numpy_helper.from_array(value.astype(np.float32), name))

    t = numpy_helper.to_array(inits[iface.t_name]).astype(np.float64)
    t_inv = numpy_helper.to_array(inits[iface.t_inv_name]).astype(np.float64)
    put(iface.t_name, t @ r)
    put(iface.t_inv_name, r.T @ t_inv)
    r64 = torch.from_numpy(r).to(torch.float64)
    iface.embed_rows = rotate_rows(torch.from_numpy(np.ascontiguousarray(iface.embed_rows)), r64).numpy()
    iface.head_rows = rotate_rows(torch.from_numpy(np.ascontiguousarray(iface.head_rows)), r64).numpy()
    put(iface.gather.input[0], iface.embed_rows.T)  # factorized: the gather reads Zᵀ (d, V) along axis 1
    if iface.head.input[1] != iface.gather.input[0]:
        put(iface.head.input[1], iface.head_rows.T)
    return True


def rewrite_interface(model, iface: Interface, bits: int, block: int, correct: bool,
                      head_moments: np.ndarray | None = None) -> dict[str, Any]:
    """Replace the embedding Gather by ``GatherBlockQuantized`` and the head MatMul by
    ``MatMulNBits``; in factorized mode with ``correct``, replace ``T⁻¹`` by ``M``.

    ``head_moments`` (``Σ hᵀh`` of the head's input on calibration text): the head's table is
    rounded by GPTQ against them (:func:`calibrated_table`) instead of to nearest; a shared
    embedding reads the same codes, and the correction is computed from them.

    The head keeps fp32 activations in every mode (no ``accuracy_level``): in factorized mode
    so that ``W_out E = I`` holds on the runtime, and everywhere because int8 activations in the
    head measured a larger mean KL on the default model's materialized exports, failing the
    bounds (``studies/onnx-quantized-decode.md``). An 8-bit table is stored as its two nibble
    planes (:func:`split_nibbles`); where the embedding reads the same table it gathers both.

    Returns:
        details for the manifest: whether the tables are shared, the correction applied.
    """
    from onnx import helper

    graph = model.graph
    _ensure_ms_domain(model)
    rotated = rotate_table(graph, iface)
    shared = np.array_equal(iface.embed_rows, iface.head_rows)
    head_q = block_quantize(iface.head_rows, bits, block) if head_moments is None else \
        calibrated_table(graph, iface, bits, block, head_moments)
    emb_q = head_q if shared else block_quantize(iface.embed_rows, bits, block)
    v, d = iface.head_rows.shape
    prefix = "pit_q"
    head_planes = table_planes(head_q)
    emb_planes = head_planes if shared else [(emb_q, 1.0)]
    head_names = _plane_names(graph, f"{prefix}.head", head_planes, gather=False)
    # head: MatMulNBits(A, B (N, kb, blob), scales, zero points) per plane, summed
    head_name = iface.head.name or "head"
    outs = [iface.head.output[0]] if len(head_planes) == 1 else \
        [f"{head_name}_plane{k}" for k in range(len(head_planes))]
    nodes = [helper.make_node("MatMulNBits", [iface.head.input[0], *names], [out], name=f"{head_name}_Q{k}",
                              domain="com.microsoft", K=d, N=v, bits=table.bits, block_size=table.block)
             for k, ((table, _), names, out) in enumerate(zip(head_planes, head_names, outs))]
    nodes += _sum_nodes(graph, f"{head_name}_planes", list(zip(outs, [f for _, f in head_planes])),
                        iface.head.output[0])
    _replace_node(graph, iface.head, nodes)
    # embedding: GatherBlockQuantized(data (V, d·bits/8), ids, scales, zero points) per plane
    emb_names = _plane_names(graph, f"{prefix}.embed", emb_planes, gather=True)
    target, remove = iface.gather.output[0], None
    if _gather_axis(iface.gather) == 1:
        # Gather(Zᵀ, axis=1) gave (d, N), transposed next: gather rows (N, d) and keep the
        # Transpose's output name for its consumers.
        follow = _consumers(graph, iface.gather.output[0])
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
    _replace_node(graph, iface.gather, nodes)
    if remove is not None:
        graph.node.remove(remove)
    details: dict[str, Any] = {"token_table_shared": bool(shared), "table_bits": bits, "group_size": block,
                               "head_activations": "float32",
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

            inits = _initializers(graph)
            t = numpy_helper.to_array(inits[iface.t_name]).astype(np.float64)
            m = correction_matrix(head_q.dequantize(), emb_q.dequantize(), t)
            inits[iface.t_inv_name].CopyFrom(numpy_helper.from_array(m.astype(np.float32), iface.t_inv_name))
    _remove_unused_initializers(graph)
    return details


def gemm_to_matmul(graph) -> int:
    """Rewrite ``Gemm(A, B, C)`` with a constant ``B`` (α = β = 1, no transposed ``A``) as
    ``MatMul(A, B) + C``: GPT-2's ``Conv1D`` layers export as ``Gemm``, which the ``MatMulNBits``
    quantizer does not take. Returns the number of rewritten nodes."""
    from onnx import helper, numpy_helper

    inits = _initializers(graph)
    count = 0
    for node in list(graph.node):
        if node.op_type != "Gemm" or len(node.input) < 2 or node.input[1] not in inits:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0 or attrs.get("transA", 0):
            continue
        weight = node.input[1]
        if attrs.get("transB", 0):
            arr = numpy_helper.to_array(inits[weight]).T
            weight = _add(graph, weight + ".T", arr)
        product = node.output[0] + "_matmul" if len(node.input) > 2 else node.output[0]
        new = [helper.make_node("MatMul", [node.input[0], weight], [product], name=node.name + "_MatMul")]
        if len(node.input) > 2 and node.input[2]:
            new.append(helper.make_node("Add", [product, node.input[2]], list(node.output), name=node.name + "_Add"))
        _replace_node(graph, node, new)
        count += 1
    _remove_unused_initializers(graph)
    return count


def layer_matmuls(graph, names: tuple[str, ...]) -> list[str]:
    """Names of the ``MatMul`` nodes of the linears named by ``names``
    (:func:`~pit_deploy.schemes.names_linear`): optimum names a linear's node
    ``/model/layers.N/mlp/down_proj/MatMul``, whose module path is ``model.layers.N.mlp.down_proj``."""
    return [n.name for n in graph.node if n.op_type == "MatMul"
            and names_linear(".".join(n.name.split("/")[1:-1]), names)]


def weight_digest(matrix: np.ndarray) -> str:
    """The sha256 of a weight matrix ``(K, N)`` as the graph stores it (float32, C order): how a
    calibrated linear's codes find their ``MatMul`` whatever the exporter named the node."""
    return hashlib.sha256(np.ascontiguousarray(matrix, dtype=np.float32).tobytes()).hexdigest()


def block_table_from_codes(rounded) -> BlockTable:
    """A calibrated linear's codes (:class:`~pit_deploy.export.calibrated_rounding.RoundedWeight`,
    rows = output channels, groups along the input) in ``MatMulNBits`` layout: unsigned codes
    (a symmetric grid's moved up by ``2^(b−1)``, its zero points with them), 4-bit ones two a
    byte, low nibble first."""
    bits, offset = rounded.grid.bits, -rounded.grid.qmin
    codes = (rounded.codes.numpy().astype(np.int32) + offset).astype(np.uint8)
    zeros = (rounded.zeros.numpy().astype(np.int32) + offset).astype(np.uint8)
    n, k = codes.shape
    kb = zeros.shape[1]
    block = k // kb
    if bits == 4:
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(n, kb, block // 2)
        if kb % 2:
            zeros = np.concatenate([zeros, np.zeros((n, 1), np.uint8)], axis=1)
        zero_points = zeros[:, 0::2] | (zeros[:, 1::2] << 4)
    else:
        packed, zero_points = codes.reshape(n, kb, block), zeros
    return BlockTable(np.ascontiguousarray(packed), rounded.scales.numpy().astype(np.float32),
                      np.ascontiguousarray(zero_points), bits, block)


def write_calibrated_matmuls(model, codes: dict[str, Any]) -> int:
    """Replace each ``MatMul`` whose constant weight is a calibrated linear's (``codes``: by
    :func:`weight_digest` of the dequantized weight, transposed as the graph holds it) with a
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
    _ensure_ms_domain(model)
    inits = _initializers(graph)
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
        names = [_add(graph, f"{prefix}.{part}", array) for part, array in
                 (("codes", table.packed), ("scales", table.scales), ("zero_points", table.zero_points))]
        k, n = weight.shape
        _replace_node(graph, node, [helper.make_node(
            "MatMulNBits", [node.input[0], *names], [node.output[0]], name=f"{node.name}_Q{table.bits}",
            domain="com.microsoft", K=k, N=n, bits=table.bits, block_size=table.block,
            accuracy_level=BODY_ACCURACY_LEVEL)])
        found += 1
    if found != len(codes):
        raise RuntimeError(f"{len(codes) - found} of {len(codes)} calibrated linears have no MatMul with their "
                           "weights in the exported graph")
    _remove_unused_initializers(graph)
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
                   head_moments: np.ndarray | None = None) -> tuple[Any, dict[str, Any]]:
    """Quantize one exported graph in memory: its token interface (``table_bits``, default
    the dtype's bits; ``head_moments``: see :func:`rewrite_interface`) and, with ``body``, every
    other weight matrix (``keep_8bit``, ``codes``: see :func:`quantize_body`).

    Returns:
        ``(model, details)``.
    """
    bits = table_bits or BITS[dtype]
    iface = find_graph_interface(model.graph, vocab, hidden)
    keep_fp32 = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in
                 {iface.t_name, iface.t_inv_name}]
    details = rewrite_interface(model, iface, bits, block, correct, head_moments)
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


def save_deduplicated(model, path: Path, data_name: str) -> None:
    """Save ``model`` with its large initializers in ``data_name``, each distinct byte string
    once: initializers with equal bytes (a shared token table read by two ops under two
    shapes) point at the same range of the data file (ONNX external data ``location`` /
    ``offset`` / ``length``)."""
    import onnx
    from onnx import numpy_helper

    data_path = path.parent / data_name
    offsets: dict[str, tuple[int, int]] = {}
    with open(data_path, "wb") as fh:
        for init in model.graph.initializer:
            if init.data_location == onnx.TensorProto.EXTERNAL:
                raise PitError(f"initializer {init.name} still points at external data; load it first")
            raw = init.raw_data if init.HasField("raw_data") else numpy_helper.to_array(init).tobytes()
            if len(raw) < EXTERNAL_MIN_BYTES:
                continue
            digest = hashlib.sha256(raw).hexdigest()
            if digest not in offsets:
                pad = (-fh.tell()) % 64  # aligned ranges
                fh.write(b"\0" * pad)
                offsets[digest] = (fh.tell(), len(raw))
                fh.write(raw)
            offset, length = offsets[digest]
            for fieldname in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
                init.ClearField(fieldname)
            init.ClearField("raw_data")
            del init.external_data[:]
            init.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(length))):
                entry = init.external_data.add()
                entry.key, entry.value = key, value
    onnx.save_model(model, str(path))

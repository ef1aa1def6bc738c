"""Token tables in onnxruntime's block-quantized layout: the codec of the tables that
``MatMulNBits`` (the head) and ``com.microsoft.GatherBlockQuantized`` (the embedding) read,
an 8-bit table as two 4-bit nibble planes, GPTQ codes in that layout, and the rotation a
factorized graph's table gets before it is rounded (:func:`rotate_table`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import PitError
from .onnx_graph import Interface, add_initializer, consumers, initializers, producer, weight_digest

#: bits of each quantized dtype
BITS = {"int8": 8, "int4": 4}


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
        q = np.empty((n, kb, self.block), np.float32)  # worked on in place: one table-sized array
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
        q -= z[..., None]
        q *= self.scales[..., None]
        return q.reshape(n, kb * self.block)


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


def _zero_points(table: BlockTable) -> np.ndarray:
    """The table's zero points as one uint8 per block ``(rows, blocks)`` (4-bit ones unpacked)."""
    rows, blocks = table.scales.shape
    zp = table.zero_points.reshape(rows, -1)
    if table.bits == 4:
        zp = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(rows, -1)
    return np.ascontiguousarray(zp[:, :blocks])


def fold_nodes(graph, name: str, table: BlockTable, transpose: bool, codes_name: str | None = None) -> list:
    """Initializers for ``table`` and the nodes that compute the float32 tensor ``name`` from
    them: ``(q − zero point) · scale`` per block, reshaped to ``(rows, K)`` and transposed where
    the original weight was ``(K, rows)`` (a ``MatMul``'s B). 4-bit codes stay two a byte and are
    unpacked with ``BitShift``/``Sub``; 8-bit codes are cast as they are. Every input is an
    initializer, so onnxruntime's constant folding computes ``name`` once, when the session is
    created: the file holds the codes, the session the float32 tensor (the ``*-web`` schemes'
    weights, :mod:`pit_deploy.targets.onnx.web_fold`, and the int8-activation head's factor,
    :func:`rotate_table`). The values are :meth:`BlockTable.dequantize`'s, bit for bit: the same
    float32 subtraction and product.

    ``codes_name``: the codes' initializer (default ``{name}.q{bits}``, the name verify's weight
    check reads a folded weight of the reference by)."""
    from onnx import TensorProto, helper

    rows, blocks = table.scales.shape
    block = table.block

    def node(op: str, inputs: list[str], out: str, **attrs: Any):
        return helper.make_node(op, inputs, [out], name=out, **attrs)

    # (rows, blocks, block · bits / 8)
    data = add_initializer(graph, codes_name or f"{name}.q{table.bits}", table.packed)
    scale = add_initializer(graph, f"{name}.scales", table.scales.reshape(rows, blocks, 1))
    zero = add_initializer(graph, f"{name}.zero_points", _zero_points(table).reshape(rows, blocks, 1))
    nodes = []
    codes = data
    if table.bits == 4:
        four = add_initializer(graph, f"{name}.four", np.array(4, np.uint8))
        last = add_initializer(graph, f"{name}.last_axis", np.array([-1], np.int64))
        shape = add_initializer(graph, f"{name}.blocks_shape", np.array([rows, blocks, block], np.int64))
        # hi = q >> 4, lo = q − (hi << 4): BitShift and Sub exist from opset 11 (BitwiseAnd only from 18)
        nodes += [node("BitShift", [data, four], f"{name}.hi", direction="RIGHT"),
                  node("BitShift", [f"{name}.hi", four], f"{name}.hi_up", direction="LEFT"),
                  node("Sub", [data, f"{name}.hi_up"], f"{name}.lo"),
                  node("Unsqueeze", [f"{name}.lo", last], f"{name}.lo1"),
                  node("Unsqueeze", [f"{name}.hi", last], f"{name}.hi1"),
                  node("Concat", [f"{name}.lo1", f"{name}.hi1"], f"{name}.pairs", axis=-1),  # low nibble first
                  node("Reshape", [f"{name}.pairs", shape], f"{name}.codes")]
        codes = f"{name}.codes"
    full = add_initializer(graph, f"{name}.shape", np.array([rows, blocks * block], np.int64))
    nodes += [node("Cast", [codes], f"{name}.codes_f", to=TensorProto.FLOAT),
              node("Cast", [zero], f"{name}.zero_f", to=TensorProto.FLOAT),
              node("Sub", [f"{name}.codes_f", f"{name}.zero_f"], f"{name}.centred"),
              node("Mul", [f"{name}.centred", scale], f"{name}.blocks_f")]
    if transpose:
        nodes += [node("Reshape", [f"{name}.blocks_f", full], f"{name}.rows"),
                  node("Transpose", [f"{name}.rows"], name, perm=[1, 0])]
    else:
        nodes.append(node("Reshape", [f"{name}.blocks_f", full], name))
    return nodes


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


def block_table_from_codes(rounded) -> BlockTable:
    """A calibrated linear's codes (:class:`~pit_deploy.exporters.calibrated_rounding.RoundedWeight`,
    rows = output channels, groups along the input) in ``MatMulNBits`` layout: unsigned codes
    (a symmetric grid's moved up by ``2^(b−1)``, its zero points with them), 4-bit ones two a
    byte, low nibble first."""
    bits, offset = rounded.grid.bits, np.int16(-rounded.grid.qmin)
    # int16 (the codes' own type) until the bytes: an int32 copy of a 262k-token table is 671 MB
    codes = (rounded.codes.numpy().astype(np.int16, copy=False) + offset).astype(np.uint8)
    zeros = (rounded.zeros.numpy().astype(np.int16, copy=False) + offset).astype(np.uint8)
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


#: weight of the embedding's term in a factorized table's GPTQ rounding, each term scaled to a
#: mean diagonal of 1 (default model, onnx-genai int4 with a 4-bit table, verify's mean KL:
#: 0.238 rounded to nearest, 0.201 / 0.184 / 0.189 at weights 0 / 1 / 4; studies/int4-frontier.md)
EMBEDDING_WEIGHT = 1.0


def calibrated_table(graph, iface: Interface, bits: int, block: int, moments: np.ndarray,
                     cache: dict[str, Any] | None = None) -> BlockTable:
    """The head's table rounded by GPTQ (:func:`pit_deploy.exporters.calibrated_rounding.gptq`) on
    ``MatMulNBits``' grid (unsigned codes, an integer zero point and a float32 scale a block),
    weighted by the second moments of what the head multiplies: ``h T`` in a factorized graph,
    so ``tᵀ (Σ hᵀh) t`` with ``t`` the graph's own ``d×d`` factor, plus the embedding's term
    ``t⁻¹ t⁻ᵀ`` (the shared rows are multiplied by ``≈ T⁻¹`` there; :data:`EMBEDDING_WEIGHT`);
    else ``Σ hᵀh``. ``moments``: ``Σ hᵀh`` of the hidden states the head reads on calibration
    text (:func:`~pit_deploy.exporters.calibrated_rounding.head_moments`). ``cache``: a dict the
    caller keeps between the graphs of one export; a table already rounded from the same inputs
    is taken from it."""
    import torch
    from onnx import numpy_helper

    from .calibrated_rounding import RoundingGrid, gptq

    h = np.asarray(moments, dtype=np.float64)
    if iface.t_name is not None:
        t = numpy_helper.to_array(initializers(graph)[iface.t_name]).astype(np.float64)
        h = t.T @ h @ t
        # the embedding reads these rows too, through T⁻¹: an error along T's small directions,
        # cheap for the head, is what T⁻¹ amplifies; so that term weighs as much as the head's
        t_inv = np.linalg.inv(t)
        h_embed = t_inv @ t_inv.T
        h = h / np.diag(h).mean() + EMBEDDING_WEIGHT * h_embed / np.diag(h_embed).mean()
    # the onnx target quantizes two graphs with the same table (the decoder, interface.onnx):
    # the second asks for exactly the first's rounding, and finds it in the caller's ``cache``
    key = (weight_digest(iface.head_rows), hashlib.sha256(h.tobytes()).hexdigest(), bits, block)
    if cache is not None and cache.get("key") == key:
        return cache["table"]
    rounded = gptq(torch.from_numpy(iface.head_rows), torch.from_numpy(h),  # float64 by row chunks in gptq
                   RoundingGrid(bits, block, symmetric=False))
    table = block_table_from_codes(rounded)
    if cache is not None:
        cache.update(key=key, table=table)
    return table


def int8_block_grid_table(a: np.ndarray, block: int) -> BlockTable:
    """``a`` (``n×d``) with each block of ``block`` entries of each row moved to the nearest point
    ``c · k`` (``k`` integers, ``max |k| = 127``) of the grid that ``MatMulNBits``' int8 activations
    (``accuracy_level`` 4) represent exactly, as an 8-bit :class:`BlockTable` (codes ``k + 128``,
    zero point 128, scale ``c``): its :meth:`~BlockTable.dequantize` is the snapped ``a`` in
    float32, and a graph can store the rows as these codes (a quarter of the float32 bytes)
    and fold them back to exactly those values when the session is created.

    onnxruntime's int8-activation kernel quantizes its input per block of ``block_size`` entries,
    symmetrically: scale ``max |x| / 127``, codes ``round(x / scale)``. With ``c`` that block's
    ``max |x| / 127``, the block's largest entry is ``±127 c`` and every entry ``c k``, so the kernel
    finds the scale ``c`` again and the codes ``k``: nothing is rounded (measured: a row on the grid
    goes through the int8 kernel as through the float32 one, relative difference 2e-7, where an
    input off the grid differs by 7e-3). Each entry moves by at most ``c / 2``."""
    a = np.asarray(a, dtype=np.float64)
    n, d = a.shape
    if d % block:
        raise PitError(f"group size {block} does not divide the hidden size {d}")
    blocks = a.reshape(n, d // block, block)
    amax = np.abs(blocks).max(axis=2)
    step = np.where(amax > 0, amax / 127, 1.0).astype(np.float32)  # a zero block stays zero
    codes = np.clip(np.round(blocks / step.astype(np.float64)[..., None]), -127, 127)
    return BlockTable((codes + 128).astype(np.uint8), step, np.full((n, d // block), 128, np.uint8), 8, block)


def int8_block_grid_rows(a: np.ndarray, block: int) -> np.ndarray:
    """The rows of :func:`int8_block_grid_table` in float32: ``a`` on the int8 activations' grid."""
    return int8_block_grid_table(a, block).dequantize()


def rotate_table(graph, iface: Interface, int8_block: int | None = None,
                 write_table: bool = True) -> tuple[bool, BlockTable | None]:
    """Turn a factorized graph's token table by ``R`` before it is quantized: the table's rows
    become ``Z R``, the head's factor ``T R`` and the embedding's ``Rᵀ T⁻¹`` (``R`` the
    randomized Hadamard matrix of :func:`.residual_rotation.rotation_matrix`), so that
    ``h T Zᵀ = (h T R)(Z R)ᵀ`` and ``z T⁻¹ = (z R)(Rᵀ T⁻¹)``: the graph computes the same
    function, with nothing added at run time (``T`` and ``T⁻¹`` are ``d×d`` products it has
    anyway), and the correction computed afterwards from the graph's own factor keeps
    ``W_out E = I``.

    With ``int8_block`` (a head whose ``MatMulNBits`` rounds its input to int8 in blocks of that
    many entries), the head's factor is ``S``, ``T R`` with each row on that rounding's grid
    (:func:`int8_block_grid_rows`), and the table ``Z Tᵀ S⁻ᵀ`` (``Z R`` up to the snapping), so
    that ``h S (Z Tᵀ S⁻ᵀ)ᵀ = h T Zᵀ`` still; the embedding's factor is ``Sᵀ T⁻ᵀ T⁻¹``
    (``Rᵀ T⁻¹`` when ``S = T R``). A row of ``S`` — what the head is fed for a basis vector,
    which is how ``verify`` measures ``W_out`` — then passes the int8 rounding unchanged, and
    ``W_out E = I`` holds on the runtime; the same device as the ``.pte``'s quantized head
    (:mod:`pit_deploy.targets.executorch.head`), for onnxruntime's grid.

    Why: a token's row has a few large coordinates, and one 4-bit scale a block of 32 spends its
    range on them; ``R`` spreads them over every coordinate (incoherence processing, as in QuIP,
    Chee et al., 2023, arXiv:2307.13304, and QuaRot, Ashkboos et al., 2024, arXiv:2404.00456).
    Default model: ``studies/onnx-genai-int4.md``, "GPTQ in the builder's body".

    ``write_table=False``: the turned rows are left in ``iface`` only, and the graph's float32
    table as it was, for a caller that replaces the table's readers next (a quantizing one: a
    float32 table written into a graph only to be dropped costs a copy of it, 671 MB at a
    262k-token vocabulary, that the model's protobuf arena keeps until the graph is freed).

    Returns:
        ``(turned, factor)``: whether the table was turned — only a factorized graph whose table
        and factors no node but the interface's reads (a graph where something else reads them
        keeps them as they are) — and, with ``int8_block``, ``S`` as 8-bit codes
        (:func:`int8_block_grid_table`) that the caller may store instead of its float32 values.
    """
    import torch
    from onnx import numpy_helper

    from ..model.core import rotate_rows
    from ..model.quantized_interface import table_map
    from .residual_rotation import rotation_matrix

    if iface.t_name is None or iface.t_inv_name is None:
        return False, None
    inits = initializers(graph)
    table_names = {iface.gather.input[0], iface.head.input[1]}
    if not table_names <= set(inits):
        return False, None
    t_reader = producer(graph, iface.head.input[0])
    transpose = consumers(graph, iface.gather.output[0])
    t_inv_reader = consumers(graph, transpose[0].output[0]) if len(transpose) == 1 else []
    own = {id(iface.gather), id(iface.head), id(t_reader), *(id(n) for n in t_inv_reader)}
    for name in (*table_names, iface.t_name, iface.t_inv_name):
        if any(id(n) not in own for n in consumers(graph, name)):
            return False, None
    r = rotation_matrix(iface.head_rows.shape[1]).numpy()

    def put(name: str, value: np.ndarray) -> None:
        inits[name].CopyFrom(numpy_helper.from_array(value.astype(np.float32), name))

    t = numpy_helper.to_array(inits[iface.t_name]).astype(np.float64)
    t_inv = numpy_helper.to_array(inits[iface.t_inv_name]).astype(np.float64)
    factor = None
    if int8_block:
        # S exactly as its codes give it in float32, so that the kernel reads the snapped rows
        factor = int8_block_grid_table(t @ r, int8_block)
        s = factor.dequantize().astype(np.float64)
        r = table_map(s, t)  # the table's map A: Z -> Z A = Z Tᵀ S⁻ᵀ (= R when S = T R)
        put(iface.t_name, s)
        put(iface.t_inv_name, np.linalg.solve(r, t_inv))  # A⁻¹ T⁻¹ = Sᵀ T⁻ᵀ T⁻¹
    else:
        put(iface.t_name, t @ r)
        put(iface.t_inv_name, r.T @ t_inv)
    r64 = torch.from_numpy(r).to(torch.float64)
    shared = iface.embed_rows is iface.head_rows
    iface.embed_rows = rotate_rows(torch.from_numpy(np.ascontiguousarray(iface.embed_rows)), r64).numpy()
    iface.head_rows = iface.embed_rows if shared else \
        rotate_rows(torch.from_numpy(np.ascontiguousarray(iface.head_rows)), r64).numpy()
    if write_table:
        put(iface.gather.input[0], iface.embed_rows.T)  # factorized: the gather reads Zᵀ (d, V) along axis 1
        if iface.head.input[1] != iface.gather.input[0]:
            put(iface.head.input[1], iface.head_rows.T)
    return True, factor

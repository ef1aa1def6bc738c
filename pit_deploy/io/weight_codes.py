"""The codes of a block-quantized weight as the runtimes store them, and their digests.

Exporters that round by GPTQ record a digest of each calibrated tensor's codes and scales in the
manifest (``details.weight_codes``); ``verify``'s weight-level check
(:mod:`pit_deploy.evaluate.weight_check`) reads the artifact's codes back and compares. Both
sides unpack and digest codes here, so the two cannot disagree on the format. numpy only.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

#: the manifest's ``details`` key of the calibrated codes' digests
CODES_FIELD = "weight_codes"
#: how each digest of that field is computed (written beside the digests, for a reader of the manifest)
CODES_DIGEST = "sha256 of (codes − zero points) as int16 (rows × K) then the float32 block scales"


def code_digest(qz: np.ndarray, scales: np.ndarray) -> str:
    """sha256 of a tensor's codes minus zero points (int16, ``(rows, K)``) and its block scales
    (float32, ``(rows, blocks)``): the same for every layout the runtimes store them in."""
    h = hashlib.sha256(_bytes_of(np.ascontiguousarray(qz, dtype=np.int16)))
    h.update(_bytes_of(np.ascontiguousarray(scales, dtype=np.float32)))
    return h.hexdigest()


def _bytes_of(array: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes, read in place (``tobytes`` would copy a 262k-token table)."""
    return memoryview(array.reshape(-1).view(np.uint8))


def codes_entry(qz: Any, scales: Any) -> dict[str, Any]:
    """The manifest entry of one tensor's codes minus zero points ``(rows, K)`` and block scales:
    its shape and :func:`code_digest`."""
    qz = np.asarray(qz)
    return {"rows": int(qz.shape[0]), "cols": int(qz.shape[1]), "sha256": code_digest(qz, np.asarray(scales))}


def rounded_entry(rounded: Any) -> dict[str, Any]:
    """The manifest entry of one calibrated linear (a
    :class:`~pit_deploy.exporters.calibrated_rounding.RoundedWeight`: ``codes``, ``zeros``, ``scales``)."""
    qz = rounded.codes.numpy().astype(np.int32)
    per = qz.shape[1] // rounded.scales.shape[1]
    return codes_entry(qz - np.repeat(rounded.zeros.numpy().astype(np.int32), per, axis=1), rounded.scales.numpy())


def table_entry(table: Any) -> dict[str, Any]:
    """The manifest entry of a calibrated token table (a
    :class:`~pit_deploy.exporters.onnx_tables.BlockTable`: ``packed``, ``scales``, ``zero_points``,
    ``bits``, ``block``)."""
    return codes_entry(*table_codes(table.packed, table.scales, table.zero_points, table.bits, table.block))


def unpack_codes(packed: np.ndarray, bits: int, rows: int, blocks: int, block: int) -> np.ndarray:
    """Codes ``(rows, blocks, block)`` as int16 (every code and every code minus a zero point of
    up to 8 bits fits; half the memory of int32 at a 262k-token table) from packed bytes (4-bit:
    two a byte, low nibble first) or from an array that already holds one code an element."""
    flat = np.asarray(packed).reshape(-1)
    if flat.size == rows * blocks * block:
        return flat.astype(np.int16).reshape(rows, blocks, block)
    if bits == 4 and flat.size * 2 == rows * blocks * block:
        b = flat.view(np.uint8) if flat.dtype.itemsize == 1 else flat.astype(np.uint8)
        q = np.empty(b.size * 2, np.int16)
        # each nibble written into its place, no temporary the table's size
        np.bitwise_and(b, 0x0F, out=q[0::2], casting="unsafe")
        np.right_shift(b, 4, out=q[1::2], casting="unsafe")
        return q.reshape(rows, blocks, block)
    raise ValueError(f"{flat.size} code bytes for {rows}×{blocks} blocks of {block} at {bits} bits")


def zero_points(zp: np.ndarray | None, bits: int, rows: int, blocks: int) -> np.ndarray:
    """Zero points ``(rows, blocks)`` as int16: onnxruntime's default ``2^(b−1)`` where none are stored."""
    if zp is None:
        return np.full((rows, blocks), 2 ** (bits - 1), np.int16)
    flat = np.asarray(zp).reshape(-1)
    if flat.size == rows * blocks:
        return flat.astype(np.int16).reshape(rows, blocks)
    if bits == 4:
        per_row = flat.astype(np.uint8).reshape(rows, -1)
        z = np.empty((rows, per_row.shape[1] * 2), np.int16)
        z[:, 0::2], z[:, 1::2] = per_row & 0x0F, per_row >> 4
        return z[:, :blocks]
    raise ValueError(f"{flat.size} zero points for {rows}×{blocks} blocks")


def table_codes(packed, scales, zp, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """``(codes − zero points (rows, K) as int16, scales (rows, blocks))`` of a block-quantized tensor."""
    scales = np.asarray(scales, dtype=np.float32)
    rows = scales.shape[0] if scales.ndim >= 2 else None
    if rows is None:
        raise ValueError("scales without a row dimension")
    scales = scales.reshape(rows, -1)
    blocks = scales.shape[1]
    q = unpack_codes(packed, bits, rows, blocks, block)
    q -= zero_points(zp, bits, rows, blocks)[..., None]
    return q.reshape(rows, blocks * block), scales

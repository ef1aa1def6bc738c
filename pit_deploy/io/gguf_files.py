"""GGUF files, read once: a header scan for the tensor names, and a converted copy in a cache.

``transformers`` reads a GGUF file through gguf-py's ``GGUFReader``, which builds a NumPy view
for every element of every metadata array — the 49,152 tokens and 48,900 merges of the default
SmolLM2-135M file among them. One parse of that file is slow, and loading its config, weights
and tokenizer parsed it five times (before this module; timings: ``studies/gguf-loading.md``). Every stage that loads the default model paid that. So:

* :func:`gguf_tensor_names` reads only the file's header (the GGUF format: magic, version,
  counts, key/value metadata, tensor infos; the GGUF specification in the ggml repository), skipping the metadata
  values without building them;
* :func:`converted_gguf` converts a GGUF file once — config, de-quantized weights as
  safetensors, the fast tokenizer — into a cache directory keyed by the file's SHA-256 and the
  ``transformers`` version, with every file's digest recorded; later loads read that directory.
  A cache entry whose files do not match their digests is rebuilt, never trusted; where the
  cache lives and how it is written: :mod:`.cache_dir`.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .cache_dir import CACHE_ENV, cache_root, cached_folder  # noqa: F401 — CACHE_ENV: the cache's switch

CACHE_META = "pit_gguf_cache.json"

# GGUF metadata value types (the GGUF specification, ``gguf_metadata_value_type``): fixed sizes in
# bytes; 8 is a string (uint64 length + bytes), 9 an array (uint32 type, uint64 count, items).
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The file is not a well-formed GGUF (v2/v3) file."""


class _Cursor:
    """Little-endian reads over a memory map, with bounds checks."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFFormatError("file ends inside its header")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def skip(self, size: int) -> None:
        if size < 0 or self.pos + size > len(self.buf):
            raise GGUFFormatError("file ends inside its header")
        self.pos += size

    def string(self) -> bytes:
        size = self.take("Q")
        start = self.pos
        self.skip(size)
        return bytes(self.buf[start:self.pos])

    def skip_value(self, vtype: int) -> None:
        if vtype in _FIXED:
            self.skip(_FIXED[vtype])
        elif vtype == _STRING:
            self.skip(self.take("Q"))
        elif vtype == _ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item in _FIXED:
                self.skip(_FIXED[item] * count)
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            raise GGUFFormatError(f"unknown metadata value type {vtype}")


def _header(buf: Any) -> tuple["_Cursor", int, int]:
    """A cursor past a GGUF header's magic, version and counts, and the two counts (tensors,
    key/value pairs).

    Raises:
        GGUFFormatError: bad magic or an unsupported version (1).
    """
    cur = _Cursor(buf)
    if cur.take("4s") != b"GGUF":
        raise GGUFFormatError("bad magic bytes")
    version = cur.take("I")
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are)")
    return cur, cur.take("Q"), cur.take("Q")


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor a GGUF file declares: ``shape`` in ggml's order (``ne``, the row length
    first), its ggml type id, and the file offset its bytes start at."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int


#: where tensor data is aligned unless the file says otherwise (``general.alignment``)
DEFAULT_ALIGNMENT = 32


def gguf_tensor_infos(path: str | os.PathLike) -> list[GGUFTensorInfo]:
    """The tensors a GGUF file declares, read from its header only: a reader that builds the
    metadata arrays holds 0.5 GB for a 262,144-token vocabulary's strings while it is alive.

    Raises:
        GGUFFormatError: bad magic, an unsupported version (1), a truncated header, or an
            alignment that is not a power of two.
    """
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur, n_tensors, n_kv = _header(buf)
        align = _metadata(cur, n_kv).get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise GGUFFormatError(f"general.alignment {align!r} is not a power of two")
        declared = []
        for _ in range(n_tensors):
            name = cur.string().decode("utf-8", "replace")
            shape = tuple(cur.take("Q") for _ in range(cur.take("I")))
            declared.append((name, shape, cur.take("I"), cur.take("Q")))
        start = -(-cur.pos // align) * align  # the data section follows the header, aligned
        return [GGUFTensorInfo(name, shape, kind, start + offset) for name, shape, kind, offset in declared]


def gguf_tensor_names(path: str | os.PathLike) -> list[str]:
    """The tensor names a GGUF file declares, read from its header only.

    Raises:
        GGUFFormatError: bad magic, an unsupported version (1), or a truncated header.
    """
    return [info.name for info in gguf_tensor_infos(path)]


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The key/value metadata of a GGUF file's header: numbers, booleans and strings as they
    are, an array as its length (the tokenizer's 49,152 tokens are not built, only counted).

    Raises:
        GGUFFormatError: bad magic, an unsupported version (1), or a truncated header.
    """
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur, _, n_kv = _header(buf)
        return _metadata(cur, n_kv)


def _metadata(cur: _Cursor, n_kv: int) -> dict[str, Any]:
    """The ``n_kv`` key/value pairs at ``cur`` (see :func:`gguf_metadata`), the cursor left past them."""
    out: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string().decode("utf-8", "replace")
        vtype = cur.take("I")
        if vtype in _SCALARS:
            out[key] = cur.take(_SCALARS[vtype])
        elif vtype == _STRING:
            out[key] = cur.string().decode("utf-8", "replace")
        elif vtype == _ARRAY:
            start = cur.pos
            cur.take("I")
            out[key] = cur.take("Q")
            cur.pos = start
            cur.skip_value(vtype)
        else:
            raise GGUFFormatError(f"unknown metadata value type {vtype}")
    return out


def _entry(root: Path, sha256: str) -> Path:
    import transformers

    return root / "gguf" / f"{sha256[:24]}-transformers-{transformers.__version__}"


def converted_gguf(path: Path, sha256: str, build: Callable[[Path], None]) -> Path | None:
    """A directory holding ``path`` converted to a Hugging Face model (``build(folder)`` writes
    it on a miss), or ``None`` when the cache is off or cannot be written (load the GGUF itself).
    """
    root = cache_root()
    if root is None:
        return None
    return cached_folder(_entry(root, sha256), CACHE_META, {"gguf": path.name, "gguf_sha256": sha256},
                         {"gguf_sha256": sha256}, build, f"conversion of {path.name}")


def read_gguf_tensors(path: str | Path, names: tuple[str, ...]) -> dict[str, Any]:
    """The tensors ``names`` of the GGUF file ``path`` as float32 NumPy arrays in PyTorch's
    ``(out, in)`` layout, dequantized by gguf-py (``gguf.quants.dequantize``, the same block
    formulas as ggml's ``dequantize_row_*``); a name the file lacks is absent from the result.

    Why read the file: llama.cpp's API exposes logits and final hidden states, not the rows its
    embedding gathers nor its head applied to chosen vectors, so the effective ``E`` and
    ``W_out`` that ``delta_ti`` needs are the file's stored tables, dequantized exactly as
    llama.cpp dequantizes them (``docs/llama_cpp.md``).

    Raises:
        GGUFFormatError: the file cannot be parsed.
    """
    out: dict[str, Any] = {}
    for info in gguf_tensor_infos(path):
        if info.name in names:
            out[info.name] = gguf_tensor_rows(path, info).reshape([int(n) for n in reversed(info.shape)])
    return out


def ggml_type(path: str | Path, info: GGUFTensorInfo) -> Any:
    """gguf-py's ``GGMLQuantizationType`` of the tensor ``info`` of the file ``path``.

    Raises:
        GGUFFormatError: a type gguf-py does not know (nor how many bytes its blocks take).
    """
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    try:
        kind = GGMLQuantizationType(info.ggml_type)
    except ValueError:
        kind = None
    if kind not in GGML_QUANT_SIZES:
        raise GGUFFormatError(f"{path}: tensor {info.name} has ggml type {info.ggml_type}, which gguf-py does not know")
    return kind


#: rows gguf-py quantizes or dequantizes at a time: its temporaries for a whole 262k-token table
#: were half a GB beside the result; every ggml type here rounds each row on its own, so the bytes
#: and values are those of one call on the whole array
GGML_ROWS = 8192


def dequantize_by_rows(codes: Any, kind: Any, cols: int) -> Any:
    """gguf-py's ``dequantize`` of ``codes`` (``(n, row bytes)`` uint8 of the ggml type ``kind``)
    :data:`GGML_ROWS` rows at a time into one float32 ``(n, cols)`` array."""
    import numpy as np
    from gguf.quants import dequantize

    out = np.empty((len(codes), cols), dtype=np.float32)
    for start in range(0, len(codes), GGML_ROWS):
        part = slice(start, start + GGML_ROWS)
        out[part] = np.asarray(dequantize(np.asarray(codes[part]), kind), dtype=np.float32).reshape(-1, cols)
    return out


def quantize_by_rows(array: Any, kind: Any) -> Any:
    """gguf-py's ``quantize`` of a 2-D float32 ``array`` to the ggml type ``kind``,
    :data:`GGML_ROWS` rows at a time into one uint8 array of the whole."""
    import numpy as np
    from gguf.quants import quantize

    first = quantize(array[:GGML_ROWS], kind)
    out = np.empty((len(array), *first.shape[1:]), dtype=first.dtype)
    out[:len(first)] = first
    for start in range(GGML_ROWS, len(array), GGML_ROWS):
        out[start:start + GGML_ROWS] = quantize(array[start:start + GGML_ROWS], kind)
    return out


@dataclass(frozen=True)
class TensorByRows:
    """A ``(count, cols)`` tensor that a GGUF file is written from a part of rows at a time:
    ``rows_of(rows)`` gives float32 rows (a slice of at most :data:`GGML_ROWS`), rounded to the
    ggml type ``kind`` as they are written (``None``: float32 as they are).

    gguf-py's ``GGUFWriter`` takes it in place of an array (``add_tensor`` with ``raw_shape``
    :attr:`shape` and ``raw_dtype`` :attr:`kind`, then ``tofile`` while it writes the data): a
    materialized 262k-token table is computed and written 8192 rows at a time instead of being
    held whole, 671 MB of float32 at d = 640, and a quantized one never exists in float32. The
    bytes are those of the whole array: each ggml type rounds each row on its own."""

    rows_of: Callable[[slice], Any]
    count: int
    cols: int
    kind: Any = None

    @property
    def dtype(self) -> Any:
        import numpy as np

        return np.dtype(np.uint8 if self.kind is not None else np.float32)

    @property
    def shape(self) -> tuple[int, int]:
        """The stored shape: ``(count, bytes a row)`` of ``kind``, or ``(count, cols)`` float32s."""
        if self.kind is None:
            return self.count, self.cols
        from gguf.constants import GGML_QUANT_SIZES

        block_values, block_bytes = GGML_QUANT_SIZES[self.kind]
        return self.count, self.cols // block_values * block_bytes

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.dtype.itemsize

    def parts(self) -> Any:
        """``(rows, stored values)`` over the whole tensor, :data:`GGML_ROWS` rows at a time."""
        import numpy as np
        from gguf.quants import quantize

        for start in range(0, self.count, GGML_ROWS):
            rows = slice(start, min(self.count, start + GGML_ROWS))
            values = np.ascontiguousarray(self.rows_of(rows), dtype=np.float32)
            if values.shape != (rows.stop - start, self.cols):
                raise ValueError(f"rows {start}:{rows.stop} came as {values.shape}, not {(rows.stop - start, self.cols)}")
            yield rows, (values if self.kind is None else quantize(values, self.kind))

    def tofile(self, fh: Any) -> None:
        """Write the stored bytes to the open binary file ``fh``, a part at a time."""
        for _, values in self.parts():
            values.tofile(fh)


def same_stored_bytes(path_a: str | Path, path_b: str | Path, name: str, block: int = 1 << 24) -> bool:
    """Whether tensor ``name`` has the same ggml type and stored bytes in the GGUF files
    ``path_a`` and ``path_b``, compared ``block`` bytes at a time (two 262k-token BF16 heads are
    335 MB each).

    Raises:
        KeyError: a file has no such tensor.
        GGUFFormatError: a type gguf-py does not know, or bytes that run past a file's end.
    """
    spans = []
    for path in (path_a, path_b):
        infos = [i for i in gguf_tensor_infos(path) if i.name == name]
        if not infos:
            raise KeyError(f"{path} has no tensor {name}")
        _, _, count, row_bytes = _tensor_layout(path, infos[0])
        spans.append((infos[0].ggml_type, infos[0].offset, count * row_bytes))
    if spans[0][0] != spans[1][0] or spans[0][2] != spans[1][2]:
        return False
    with open(path_a, "rb") as fa, open(path_b, "rb") as fb:
        fa.seek(spans[0][1])
        fb.seek(spans[1][1])
        left = spans[0][2]
        while left:
            size = min(block, left)
            if fa.read(size) != fb.read(size):
                return False
            left -= size
    return True


def _tensor_layout(path: str | Path, info: GGUFTensorInfo) -> tuple[Any, int, int, int]:
    """``(ggml type, values a row, rows, bytes a row)`` of the tensor ``info`` (ggml's ``ne[0]`` is
    the row length), checked to lie within the file ``path``.

    Raises:
        GGUFFormatError: a type gguf-py does not know, or bytes that run past the end of the file.
    """
    from gguf.constants import GGML_QUANT_SIZES

    kind = ggml_type(path, info)
    block_values, block_bytes = GGML_QUANT_SIZES[kind]
    cols = int(info.shape[0]) if info.shape else 1
    count = 1
    for n in info.shape:
        count *= int(n)
    count //= max(cols, 1)
    row_bytes = cols // block_values * block_bytes
    if cols % block_values or info.offset + count * row_bytes > os.path.getsize(path):
        raise GGUFFormatError(f"{path}: tensor {info.name}, {count} rows of {cols} {kind.name} values, does not fit "
                              "the file")
    return kind, cols, count, row_bytes


def gguf_tensor_rows(path: str | Path, info: GGUFTensorInfo, rows: slice | Any = None) -> Any:
    """Rows ``rows`` (a slice or an index array; all where ``None``) of the tensor ``info`` of the
    GGUF file ``path``, ``(n, ne[0])``, dequantized to float32 by gguf-py. Only those rows' bytes
    are read, through a mapping of the tensor alone that is closed before this returns, and
    dequantized :data:`GGML_ROWS` at a time: a whole 262k-token table is never made unless asked
    for, then without a second copy, and no page of the file stays in the process.

    Raises:
        GGUFFormatError: a type gguf-py does not know, or bytes that run past the end of the file.
    """
    import numpy as np

    kind, cols, count, row_bytes = _tensor_layout(path, info)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", offset=info.offset, shape=(count, row_bytes))
    try:
        return dequantize_by_rows(mapped if rows is None else mapped[rows], kind, cols)
    finally:
        del mapped  # unmapped: the pages read leave the process with it

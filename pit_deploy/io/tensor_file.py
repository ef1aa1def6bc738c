"""Reading a safetensors file into tensors that already exist, one tensor at a time, with
ordinary reads.

Why not ``safetensors.torch.load_file``: it returns a second full copy of the weights beside the
model it is loaded into, and reading through the file's memory map leaves every page of the
file resident in the process as well (``ru_maxrss`` counts both): a 1 GB checkpoint peaked at
2.5 GB more than the model. Here each tensor's bytes go straight into the model's own storage
(``readinto``), so loading costs the model and nothing else.

The format (safetensors' own specification): an 8-byte little-endian header length, a JSON
header mapping each name to ``dtype``, ``shape`` and ``data_offsets`` (begin, end) relative to
the end of the header, then the data. ``safe_open`` checks the header and the file's length
first; this module only reads the byte ranges it validated.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterable

import torch

#: safetensors' dtype names
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


def read_header(path: Path) -> tuple[int, dict]:
    """``(where the data starts, the header without its metadata)`` of a safetensors file."""
    with path.open("rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(size))
    header.pop("__metadata__", None)
    return 8 + size, header


def read_into(path: Path, targets: dict[str, torch.Tensor], names: Iterable[str] | None = None) -> None:
    """Fill each tensor of ``targets`` (contiguous, on the CPU, of the stored shape) with the
    stored tensor of its name, converted to its dtype where the file's differs.

    Raises:
        OSError: the file ends before a tensor's bytes (a truncated file).
        KeyError: a name has no tensor in the file.
        ValueError: a stored tensor's dtype is not one safetensors writes for weights, or its
            byte range does not hold its shape.
    """
    start, header = read_header(path)
    with path.open("rb", buffering=0) as handle:
        for name in (targets if names is None else names):
            entry, target = header[name], targets[name]
            dtype = DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ValueError(f"tensor {name} has the dtype {entry['dtype']}, which is not read here")
            begin, end = entry["data_offsets"]
            stored = torch.empty(entry["shape"], dtype=dtype) if dtype != target.dtype or not target.is_contiguous() \
                else target
            if end - begin != stored.numel() * stored.element_size() or list(stored.shape) != list(target.shape):
                raise ValueError(f"tensor {name}: {end - begin} bytes stored for shape {entry['shape']} "
                                 f"({entry['dtype']}), the model's is {tuple(target.shape)}")
            handle.seek(start + begin)
            fill_from(handle, stored, f"{path} ends inside tensor {name}")
            if stored is not target:
                target.copy_(stored)


def fill_from(handle: Any, tensor: torch.Tensor, short: str) -> None:
    """Fill the contiguous CPU ``tensor`` with the next bytes of the binary file ``handle``, read
    straight into its storage (``readinto``, no second copy).

    Raises:
        OSError: ``short``, when the file ends first.
    """
    view = memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")
    read = 0
    while read < len(view):
        got = handle.readinto(view[read:])
        if not got:
            raise OSError(short)
        read += got

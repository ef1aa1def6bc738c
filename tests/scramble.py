"""Quantized artifacts whose body weights are random bytes, as a broken exporter would write them
(digests re-recorded, so only the numbers can give it away). Shared by
``tests/test_quantized_scaling.py`` and ``studies/quantized_scaling.py``.

* ONNX: every body ``MatMulNBits`` weight (4- and 8-bit; not the token table, whose
  initializers are named ``pit_q.*``) is overwritten with random bytes in the decoder's external
  data file, in place; scales and zero points are kept.
* ``.pte``: a flatbuffer with XNNPACK-packed weights is hard to edit faithfully, so the codes are
  scrambled one step earlier: :func:`scrambled_pte_linears` wraps the exporter's
  ``quantize_linears`` so that every torchao-quantized body linear gets random codes in its
  range (``[−8, 7]`` or ``[−128, 127]``) before lowering, scales kept. The expected error the
  export records is measured on the unquantized model, so it stays the honest one.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from pit_deploy.io.fs import sha256_file
from pit_deploy.io.manifest import MANIFEST_NAME
from pit_deploy.targets.onnx import data_name, decoder_file


def rehash(directory: Path) -> None:
    """Re-record every digest of ``directory``'s manifest and drop recorded verification."""
    data = json.loads((directory / MANIFEST_NAME).read_text())
    for table in [data["reference"]["files"]] + [a["files"] for a in data["artifacts"]]:
        for rel, info in table.items():
            info["sha256"] = sha256_file(directory / rel)
            info["bytes"] = (directory / rel).stat().st_size
    data["verification"] = None
    (directory / MANIFEST_NAME).write_text(json.dumps(data))


def scramble_onnx_body(folder: Path, seed: int = 0) -> int:
    """Random bytes in every body ``MatMulNBits`` weight of the ONNX artifact in ``folder``;
    returns how many weights were scrambled."""
    import onnx

    decoder = decoder_file(folder)
    data = decoder.with_name(data_name(decoder.name))
    graph = onnx.load(str(decoder), load_external_data=False).graph
    where = {i.name: {e.key: e.value for e in i.external_data} for i in graph.initializer}
    weights = [n.input[1] for n in graph.node
               if n.op_type == "MatMulNBits" and not n.input[1].startswith("pit_q.")]
    rng = np.random.default_rng(seed)
    raw = bytearray(data.read_bytes())
    for name in weights:
        offset, length = int(where[name]["offset"]), int(where[name]["length"])
        raw[offset:offset + length] = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
    data.write_bytes(bytes(raw))
    return len(weights)


def scramble_quantized_linears(model: torch.nn.Module, seed: int = 0) -> int:
    """Random codes in every torchao-quantized linear of ``model`` (in place); returns how many."""
    gen = torch.Generator().manual_seed(seed)
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        qdata = getattr(weight, "qdata", None)
        if qdata is None:
            continue
        low, high = (-8, 7) if weight.target_dtype == torch.int4 else (-128, 127)
        qdata.copy_(torch.randint(low, high + 1, qdata.shape, generator=gen, dtype=qdata.dtype))
        count += 1
    return count


@contextlib.contextmanager
def scrambled_pte_linears(seed: int = 0) -> Iterator[list[int]]:
    """While active, the ``.pte`` exporter's quantized body linears get random codes; yields the
    list of how many were scrambled in each quantized export."""
    from pit_deploy.targets.executorch import export as to_executorch

    original = to_executorch.quantize_linears
    counts: list[int] = []

    def scrambled(*args, **kwargs):
        twin, details = original(*args, **kwargs)
        counts.append(scramble_quantized_linears(twin, seed))
        return twin, details

    to_executorch.quantize_linears = scrambled
    try:
        yield counts
    finally:
        to_executorch.quantize_linears = original

"""Are an ONNX interface graph's weights the very bytes its decoder runs with? Each large
initializer is hashed where it lies (an external-data byte range read a piece at a time), for
the check ``verify`` makes on both ONNX targets' folders and for the exporter that points the
interface graph at the decoder's bytes."""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["initializer_digests", "range_digest", "shared_between"]


def initializer_digests(path: Path, min_elements: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """sha256 and shape of each initializer of at least ``min_elements`` elements, the external
    ones hashed from their byte range of the data file a piece at a time: loading the graph with
    its external data would hold a second copy of the model (1 GB at a 262k-token vocabulary)
    beside the runtime that ``verify`` has open."""
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import ExternalDataInfo

    from ..errors import PitError

    model = onnx.load(str(path), load_external_data=False)
    folder = path.parent.resolve()
    out = {}
    for init in model.graph.initializer:
        n = 1
        for dim in init.dims:
            n *= dim
        if n < min_elements:
            continue
        if init.data_location != onnx.TensorProto.EXTERNAL:
            arr = numpy_helper.to_array(init)
            out[init.name] = (hashlib.sha256(arr.tobytes()).hexdigest(), tuple(arr.shape))
            continue
        info = ExternalDataInfo(init)
        data = (folder / info.location).resolve()
        if not data.is_relative_to(folder):
            raise PitError(f"{path}: the initializer {init.name} points outside its folder ({info.location}); re-export")
        out[init.name] = (range_digest(data, info.offset or 0, info.length), tuple(init.dims))
    return out


def range_digest(data: Path, offset: int, length: int | None, piece: int = 1 << 24) -> str:
    """sha256 of ``length`` bytes of ``data`` from ``offset`` (to its end when ``length`` is unset)."""
    digest = hashlib.sha256()
    with data.open("rb") as handle:
        handle.seek(offset)
        left = length if length is not None else -1
        while left != 0:
            chunk = handle.read(piece if left < 0 else min(piece, left))
            if not chunk:
                break
            digest.update(chunk)
            left = left - len(chunk) if left > 0 else left
    return digest.hexdigest()


def shared_between(interface: Path, decoder: Path, min_elements: int) -> tuple[bool, str]:
    """Are the large weights of the graph ``interface`` byte-identical to some of ``decoder``'s?
    Both ONNX targets ask, with their own layouts of the two files; each weight's bytes are
    hashed where they lie, never loaded whole."""
    probe = initializer_digests(interface, min_elements)
    have = {digest for digest, _ in initializer_digests(decoder, min_elements).values()}
    missing = [f"{name}{shape}" for name, (digest, shape) in probe.items() if digest not in have]
    if not probe:
        return False, f"{interface.name} holds no interface weights to compare"
    if missing:
        return False, f"interface weights not found byte-identical in the decoder: {missing}"
    return True, f"{len(probe)} interface weight(s) byte-identical to the decoder's"

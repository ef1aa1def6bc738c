"""Reading the large initializers of ONNX files: are the interface graph's weights the very
bytes the decoder runs with? (A check verification makes on every ONNX artifact.)"""

from __future__ import annotations

import hashlib
from pathlib import Path

from . import decoder_file, interface_file


def _initializer_digests(path: Path, min_elements: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path), load_external_data=True)
    out = {}
    for init in model.graph.initializer:
        n = 1
        for dim in init.dims:
            n *= dim
        if n < min_elements:
            continue
        arr = numpy_helper.to_array(init)
        out[init.name] = (hashlib.sha256(arr.tobytes()).hexdigest(), tuple(arr.shape))
    return out


def shared_weights(artifact_dir: Path, min_elements: int) -> tuple[bool, str]:
    """Are the interface graph's large weights byte-identical to some of the decoder's?

    Args:
        artifact_dir: an ``onnx`` artifact folder (its decoder and interface graphs).
        min_elements: only initializers with at least this many elements are compared (the
            ``V×d`` / ``d×d`` interface constants, not small scalars).

    Returns:
        ``(ok, message)``.
    """
    probe = _initializer_digests(interface_file(artifact_dir), min_elements)
    decoder = _initializer_digests(decoder_file(artifact_dir), min_elements)
    have = {digest for digest, _ in decoder.values()}
    missing = [f"{name}{shape}" for name, (digest, shape) in probe.items() if digest not in have]
    if not probe:
        return False, "interface.onnx holds no interface weights to compare"
    if missing:
        return False, f"interface weights not found byte-identical in the decoder: {missing}"
    return True, f"{len(probe)} interface weight(s) byte-identical to the decoder's"


def large_initializers(path: Path, min_elements: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of initializers with at least ``min_elements`` elements."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    rows = []
    for init in model.graph.initializer:
        n = 1
        for dim in init.dims:
            n *= dim
        if n >= min_elements:
            rows.append((init.name, tuple(init.dims)))
    return rows

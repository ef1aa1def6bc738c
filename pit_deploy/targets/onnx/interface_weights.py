"""Reading the large initializers of ONNX files: are the interface graph's weights the very
bytes the decoder runs with? (A check verification makes on every ONNX artifact.)"""

from __future__ import annotations

from pathlib import Path

from ...runtime.onnx_shared_weights import shared_between
from . import decoder_file, interface_file

__all__ = ["large_initializers", "shared_weights"]


def shared_weights(artifact_dir: Path, min_elements: int) -> tuple[bool, str]:
    """Are the interface graph's large weights byte-identical to some of the decoder's?

    Args:
        artifact_dir: an ``onnx`` artifact folder (its decoder and interface graphs).
        min_elements: only initializers with at least this many elements are compared (the
            ``V×d`` / ``d×d`` interface constants, not small scalars).

    Returns:
        ``(ok, message)``.
    """
    return shared_between(interface_file(artifact_dir), decoder_file(artifact_dir), min_elements)


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

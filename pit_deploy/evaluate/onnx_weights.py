"""The weight-level check of an ONNX artifact (both ONNX targets, ``onnx`` and ``onnx-genai``):
its decoder's quantized tensors read back and paired with the reference's weights
(:mod:`pit_deploy.evaluate.weight_check` compares them).

* **What is read.** Every ``MatMulNBits`` (body linears, the head, an 8-bit table's two nibble
  planes summed back), every ``GatherBlockQuantized`` (the token table the embedding reads) and
  every folded weight of the web schemes (codes, block scales and zero points that the graph
  dequantizes at load).
* **Pairing** (:func:`onnx_pairing`): the module path the nodes that read the tensor are named
  for (optimum's ``/model/layers.0/self_attn/q_proj/MatMul_Q8``, the model builder's
  ``/model/layers.0/attn/q_proj/MatMul_Q4``; a folded web tensor by the ``MatMul`` or ``Gather``
  that reads its float32 value); the builder's fused ``qkv_proj`` and ``gate_up_proj`` as their
  parts' weights stacked in order. A token table no module holds (a factorized ``Z``, turned by
  the exporter's rotation: ``Z R``) by its role: the embedding's (read by a gather) or the head's.
  What the pairing trusts: the graph's node names; a graph whose nodes were renamed together
  with their weights is beyond the weight level, and the KL bounds judge it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..io.weight_codes import table_codes
from .weight_check import Pairing, ReferenceWeights, Stored, WeightCheck, artifact_mode, compare, from_codes, \
    table_candidates


_PLANE = re.compile(r"^(.*)\.p(\d+)\.data$")
_FOLDED = re.compile(r"^(.*)\.q(4|8)$")


def onnx_stored(path: Path) -> list[Stored]:
    """Every quantized tensor of the ONNX graph at ``path`` (see the module docstring), in graph
    order; an 8-bit table stored as two nibble planes is one tensor. Each tensor's ``places`` are
    the names of the nodes that read it (a folded tensor's: the nodes that read its float32
    value), which :func:`onnx_pairing` pairs it by."""
    import onnx
    from onnx import helper, numpy_helper

    # the graph without its weights; each tensor read from the data file when it is used, and a
    # tensor of codes let go once unpacked (at a 262k-token vocabulary the graph's bytes, their
    # arrays and the unpacked tables were each held at once: 1.3 GB above the reference model)
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    arrays: dict[str, np.ndarray] = {}

    def has(name: str) -> bool:
        return bool(name) and name in inits

    def arr(name: str, keep: bool = True) -> np.ndarray | None:
        if not has(name):
            return None
        if name in arrays:
            return arrays[name]
        array = numpy_helper.to_array(inits[name], base_dir=str(path.parent))
        if keep:
            arrays[name] = array
        return array

    out: list[Stored] = []
    planes: dict[str, dict[int, tuple[np.ndarray, np.ndarray, int, int]]] = {}
    plane_readers: dict[str, list[Any]] = {}
    seen: dict[str, Stored | str] = {}
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "MatMulNBits" and has(node.input[1]) and has(node.input[2]):
            data_name, bits, block, cols = node.input[1], int(attrs.get("bits", 4)), int(attrs["block_size"]), int(attrs["K"])
            zp = arr(node.input[3]) if len(node.input) > 3 else None
            scales = arr(node.input[2]).reshape(int(attrs["N"]), -1)
        elif node.op_type == "GatherBlockQuantized" and has(node.input[0]) and has(node.input[2]):
            data_name, bits, block = node.input[0], int(attrs.get("bits", 4)), int(attrs.get("block_size", 128))
            zp = arr(node.input[3]) if len(node.input) > 3 else None
            scales = arr(node.input[2])
            cols = scales.shape[-1] * block
        else:
            continue
        plane = _PLANE.match(data_name)
        if plane:
            plane_readers.setdefault(plane.group(1), []).append(node)
        if data_name in seen:  # a second node reading the same codes: one more place of that tensor
            known = seen[data_name]
            if isinstance(known, Stored):
                known.places += (node.name,)
                known.gather = known.gather or node.op_type == "GatherBlockQuantized"
            continue
        qz, scales = table_codes(arr(data_name, keep=False), scales, zp, bits, block)
        if plane:
            planes.setdefault(plane.group(1), {})[int(plane.group(2))] = (qz, scales, bits, block)
            seen[data_name] = plane.group(1)
            continue
        stored = from_codes(node.name or data_name, qz, scales, bits, block, cols)
        stored.places, stored.gather = (node.name,), node.op_type == "GatherBlockQuantized"
        seen[data_name] = stored
        out.append(stored)
    for prefix, parts in planes.items():
        n = len(parts)
        scales, block = parts[0][1], parts[0][3]
        # Σ plane_k · 16^(n−1−k) in place, each plane let go once added: at a 262k-token
        # vocabulary a plane's int16 codes are 335 MB, and a sum of products held three of them
        order = sorted(parts)
        qz = parts.pop(order[0])[0]
        for k in order[1:]:
            qz *= 16
            qz += parts.pop(k)[0]
        stored = from_codes(prefix, qz, scales, 4 * n, block, qz.shape[1])
        readers = plane_readers.get(prefix, [])
        stored.places = tuple(dict.fromkeys(r.name for r in readers))
        stored.gather = any(r.op_type == "GatherBlockQuantized" for r in readers)
        out.append(stored)
    for name in inits:
        folded = _FOLDED.match(name)
        if not folded or f"{folded.group(1)}.scales" not in inits:
            continue
        base, bits = folded.group(1), int(folded.group(2))
        scales = arr(f"{base}.scales")
        rows, blocks = scales.shape[0], scales.shape[1]
        codes = arr(name, keep=False)
        block = codes.reshape(-1).size * 8 // bits // (rows * blocks)
        qz, scales = table_codes(codes, scales.reshape(rows, blocks), arr(f"{base}.zero_points"), bits, block)
        del codes
        stored = from_codes(base, qz, scales, bits, block, qz.shape[1])
        readers = [n for n in graph.node if base in n.input]  # the nodes that read the folded float32 weight
        stored.places = tuple(dict.fromkeys(r.name for r in readers))
        stored.gather = any(r.op_type == "Gather" for r in readers)
        out.append(stored)
    return out


def _module_path(node_name: str) -> str:
    """The module path a node's name gives: optimum's and the model builder's nodes are named
    ``/<module path with '/'>/<op>`` (``/model/layers.0/self_attn/q_proj/MatMul_Q8`` →
    ``model.layers.0.self_attn.q_proj``); ``""`` for a name of another form."""
    if not node_name.startswith("/"):
        return ""
    return ".".join(node_name.strip("/").split("/")[:-1])


def onnx_pairing(reference: ReferenceWeights) -> Callable[[Stored], Pairing | str]:
    """How an ONNX artifact's tensors find their reference weights: by the module path the nodes
    that read them are named for (:func:`_module_path`; readers named for two different weights
    fail), the builder's fused projections as their parts stacked; a token table (``V`` rows)
    whose readers name no weight of the reference (a factorized model's ``Z``, which no module
    holds) by its role, the embedding's (a gather reads it) or the head's."""

    def pair(stored: Stored) -> Pairing | str:
        found = [(place, reference.linear(_module_path(place))) for place in stored.places]
        named = [(place, hit) for place, hit in found if hit is not None]
        if named:
            (where, first), reference_array = named[0], named[0][1].candidates[0][1]
            for place, hit in named[1:]:
                array = hit.candidates[0][1]
                if hit.names != first.names and not (array.shape == reference_array.shape
                                                     and np.array_equal(array, reference_array)):
                    return (f"its readers are named for different weights ({where}: {first.label}; "
                            f"{place}: {hit.label})")
            return first
        if stored.shape[0] == reference.vocab:
            return reference.table(stored.gather)
        where = ", ".join(p for p in stored.places if p) or "a node without a name"
        return f"read by {where}, named for no weight of the reference model"

    return pair


def check_onnx_weights(directory: Path, art: Any, reference: Any) -> WeightCheck:
    """An ONNX artifact (either ONNX target): each of its decoder's quantized tensors against the
    weight of the prepared reference its nodes are named for (:func:`onnx_pairing`)."""
    from ..exporters.passes import prepare
    from ..targets import get_target

    folder = directory / art.path
    stored = onnx_stored(folder / get_target(art.target).primary_path(folder))
    prepared = prepare(reference, artifact_mode(art))
    vocab = int(art.shapes["vocab_size"])

    def tables() -> list[tuple[str, np.ndarray]]:  # made only if a table is compared by value
        return table_candidates(prepared, vocab, artifact_mode(art) == "factorized")

    return compare(stored, onnx_pairing(ReferenceWeights(prepared, vocab, tables)), art.details)

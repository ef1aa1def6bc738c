"""Graph surgery on an exported ONNX decoder: find its token interface, add and replace nodes
and initializers, drop what nothing reads, and save with each distinct large initializer once.

Shared by the ONNX quantizer (:mod:`pit_deploy.exporters.quantize_onnx`) and the targets that
rewrite an exported graph (``targets/onnx/web_fold.py``). Everything here takes an ``onnx``
``GraphProto``/``ModelProto`` and changes it in place.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import PitError
from ..schemes import names_linear

#: initializers smaller than this stay inside the ``.onnx`` file
EXTERNAL_MIN_BYTES = 1024


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


def initializers(graph) -> dict[str, Any]:
    return {init.name: init for init in graph.initializer}


def consumers(graph, name: str) -> list[Any]:
    return [n for n in graph.node if name in n.input]


def producer(graph, name: str):
    for n in graph.node:
        if name in n.output:
            return n
    return None


def gather_axis(node) -> int:
    for attr in node.attribute:
        if attr.name == "axis":
            return int(attr.i)
    return 0


def find_graph_interface(graph, vocab: int, hidden: int, tables: dict[str, StoredTable] | None = None) -> Interface:
    """The embedding Gather and the head MatMul of ``graph`` (a tied head may read ``Eᵀ``
    through a ``Transpose`` node). An initializer that stands for one of ``tables``
    (:func:`mark_pending`) is read from it: one copy of the rows, not the graph's bytes and then
    their transpose."""
    from onnx import numpy_helper

    def rows(init, transpose: bool) -> np.ndarray:
        if tables and init.name in tables and is_pending(init):
            return tables[init.name].array(transpose)
        arr = numpy_helper.to_array(init)
        return np.ascontiguousarray(arr.T if transpose else arr)

    inits = initializers(graph)
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
                source = producer(graph, b)
                if (source is not None and source.op_type == "Transpose" and source.input[0] in inits
                        and tuple(inits[source.input[0]].dims) == (vocab, hidden)):
                    head = node
    gather = _token_gather(graph, gathers)
    if gather is None or head is None:
        raise PitError("the exported graph has no recognizable embedding Gather and head MatMul; "
                       "cannot quantize its token interface")
    embed_rows = rows(inits[gather.input[0]], gather_axis(gather) == 1)
    b = head.input[1]
    if b == gather.input[0] and gather_axis(gather) == 1:  # factorized: both read the one Zᵀ
        head_rows = embed_rows  # one array (a 262k-token table is 671 MB a copy)
    elif b in inits:
        head_rows = rows(inits[b], True)
    else:  # a tied head: MatMul(h, Transpose(E))
        head_rows = rows(inits[producer(graph, b).input[0]], False)
    iface = Interface(gather, head, embed_rows, head_rows)
    # factorized: Gather(Zt, axis=1) -> Transpose -> MatMul(., T_inv); head = MatMul(MatMul(h, T), Zt)
    first = producer(graph, head.input[0])
    if gather_axis(gather) == 1 and first is not None and first.op_type == "MatMul" and first.input[1] in inits:
        iface.t_name = first.input[1]
        follow = consumers(graph, gather.output[0])
        if len(follow) == 1 and follow[0].op_type == "Transpose":
            after = consumers(graph, follow[0].output[0])
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
        source = producer(graph, name)
        if source is None or source.op_type not in _PASS_THROUGH:
            return False
        name = source.input[0]
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
# Nodes and initializers
# --------------------------------------------------------------------------------------


def replace_node(graph, old, new_nodes: list) -> None:
    index = list(graph.node).index(old)
    graph.node.remove(old)
    for offset, node in enumerate(new_nodes):
        graph.node.insert(index + offset, node)


def add_initializer(graph, name: str, array: np.ndarray) -> str:
    from onnx import numpy_helper

    graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
    return name


def remove_dead_nodes(graph) -> int:
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


def remove_unused_initializers(graph) -> None:
    """Remove dead nodes (:func:`remove_dead_nodes`), then every initializer no node reads, in
    place and in order. In place: rebuilding the list would copy every kept tensor, and under the
    upb protobuf runtime a removed message's memory stays in its model's arena until the model
    is freed, so each rebuild of a decoder's initializers held its weights once more (three
    rebuilds in a quantized export of Gemma 3 270M's shape: 2.1 GB)."""
    remove_dead_nodes(graph)
    used = {i for n in graph.node for i in n.input}
    delete_initializers(graph, {init.name for init in graph.initializer} - used)


def delete_initializers(graph, names: set[str]) -> None:
    """Delete the initializers named ``names`` in place, the others kept in order
    (:func:`remove_unused_initializers` says why in place)."""
    for index in range(len(graph.initializer) - 1, -1, -1):
        if graph.initializer[index].name in names:
            del graph.initializer[index]


def ensure_ms_domain(model) -> None:
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        entry = model.opset_import.add()
        entry.domain, entry.version = "com.microsoft", 1


def gemm_to_matmul(graph) -> int:
    """Rewrite ``Gemm(A, B, C)`` with a constant ``B`` (α = β = 1, no transposed ``A``) as
    ``MatMul(A, B) + C``: GPT-2's ``Conv1D`` layers export as ``Gemm``, which the ``MatMulNBits``
    quantizer does not take. Returns the number of rewritten nodes."""
    from onnx import helper, numpy_helper

    inits = initializers(graph)
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
            weight = add_initializer(graph, weight + ".T", arr)
        product = node.output[0] + "_matmul" if len(node.input) > 2 else node.output[0]
        new = [helper.make_node("MatMul", [node.input[0], weight], [product], name=node.name + "_MatMul")]
        if len(node.input) > 2 and node.input[2]:
            new.append(helper.make_node("Add", [product, node.input[2]], list(node.output), name=node.name + "_Add"))
        replace_node(graph, node, new)
        count += 1
    remove_unused_initializers(graph)
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


#: the external-data ``location`` of an initializer whose bytes a :class:`StoredTable` holds
PENDING_LOCATION = "pit-pending-table"


class StoredTable:
    """A float32 table an initializer stands for, written a part of rows at a time, so that a
    671 MB token table is never copied whole into the ``ModelProto``.

    ``source`` is ``(N, C)`` rows (or ``(N,)``): a tensor of any strides (``Zᵀ`` is a transposed
    view of ``Z``) or a :class:`~pit_deploy.converters.materialize.TableRows`, which computes the
    rows it is asked for. With ``transposed`` the graph stores ``sourceᵀ`` (a head's
    ``W_outᵀ``): the parts are the source's rows, each written to its column of the file.
    Two initializers standing for one source in one layout share a :attr:`key`.
    """

    #: bytes of one part
    PART_BYTES = 16 << 20

    def __init__(self, source, transposed: bool = False):
        self.source, self.transposed = source, transposed

    @property
    def key(self) -> tuple[int, bool]:
        return id(self.source), self.transposed

    @property
    def shape(self) -> tuple[int, ...]:
        shape = tuple(self.source.shape)
        return shape[::-1] if self.transposed else shape

    @property
    def nbytes(self) -> int:
        return 4 * int(np.prod(self.shape))

    def _rows(self, source):
        """``(start, rows)``: ``source``'s rows as float32 arrays, a part at a time."""
        count = source.shape[0]
        width = int(np.prod(source.shape[1:])) if len(source.shape) > 1 else 1
        step = max(1, self.PART_BYTES // (4 * width))
        for start in range(0, count, step):
            rows = source[start:start + step]
            rows = rows.detach().numpy() if hasattr(rows, "detach") else rows
            yield start, np.ascontiguousarray(rows, dtype=np.float32)

    def write(self, fh) -> None:
        """Write the stored layout's C-order bytes at ``fh``'s position, which it ends past."""
        import os

        start = fh.tell()
        if not self.transposed or len(self.source.shape) == 1 or hasattr(self.source, "detach"):
            # a tensor's transpose is a view: its rows are read in order like any tensor's
            layout = self.source.T if self.transposed and len(self.source.shape) > 1 else self.source
            for _, rows in self._rows(layout):
                fh.write(rows.data)
            return
        fh.flush()
        count, cols = self.source.shape
        for first, rows in self._rows(self.source):  # row r of the source is column r of what is stored
            for j in range(cols):
                os.pwrite(fh.fileno(), np.ascontiguousarray(rows[:, j]).data, start + 4 * (j * count + first))
        fh.seek(start + self.nbytes)

    def array(self, transpose: bool = False) -> np.ndarray:
        """The stored layout (its transpose with ``transpose``), whole: a copy of its own, which
        a quantizer may write into."""
        rows = self.source[0:self.source.shape[0]]
        rows = rows.detach().numpy() if hasattr(rows, "detach") else rows
        layout = rows.T if self.transposed != transpose and rows.ndim > 1 else rows
        return np.array(layout, dtype=np.float32, order="C", copy=True)


def mark_pending(init, table: StoredTable) -> None:
    """Make ``init`` stand for ``table``: its dims, no bytes of its own, and the
    :data:`PENDING_LOCATION` that :func:`save_deduplicated` and :func:`fill_pending` resolve."""
    import onnx

    init.ClearField("raw_data")
    del init.dims[:]
    init.dims.extend(table.shape)
    init.data_type = onnx.TensorProto.FLOAT
    del init.external_data[:]
    init.data_location = onnx.TensorProto.EXTERNAL
    entry = init.external_data.add()
    entry.key, entry.value = "location", PENDING_LOCATION


def is_pending(init) -> bool:
    """Whether ``init`` still stands for a :class:`StoredTable` (:func:`mark_pending`), not
    replaced since by values of its own."""
    import onnx

    return init.data_location == onnx.TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == PENDING_LOCATION for e in init.external_data)


def fill_pending(graph, pending: dict[str, StoredTable]) -> None:
    """Give each initializer :func:`mark_pending` marked its table's bytes, for a rewrite that
    reads arrays (the quantizers)."""
    import onnx

    for init in graph.initializer:
        if init.name in pending and is_pending(init):
            del init.external_data[:]
            init.data_location = onnx.TensorProto.DEFAULT
            init.raw_data = pending[init.name].array().tobytes()


def save_deduplicated(model, path: Path, data_name: str, pending: dict[str, StoredTable] | None = None) -> None:
    """Save ``model`` with its large initializers in ``data_name``, each distinct byte string
    once: initializers with equal bytes (a shared token table read by two ops under two
    shapes) point at the same range of the data file (ONNX external data ``location`` /
    ``offset`` / ``length``). An initializer marked by :func:`mark_pending` is written from its
    ``pending`` table a part at a time."""
    import onnx
    from onnx import numpy_helper

    pending = pending or {}
    data_path = path.parent / data_name
    offsets: dict[str, tuple[int, int]] = {}
    with open(data_path, "wb") as fh:
        for init in model.graph.initializer:
            table = pending.get(init.name) if is_pending(init) else None
            if table is not None:
                digest = repr(table.key)  # one source in one layout: written once
                if digest not in offsets:
                    fh.write(b"\0" * ((-fh.tell()) % 64))
                    start = fh.tell()
                    table.write(fh)
                    offsets[digest] = (start, fh.tell() - start)
            else:
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

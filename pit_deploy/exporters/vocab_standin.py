"""Trace the ONNX graphs of a model with a few rows of its token tables, then give the graphs the
real tables as the file is written.

Why: torch.onnx's TorchScript exporter, which optimum's export runs, holds every weight two or
three times over while it builds, constant-folds and serializes a graph. At a 262,144-token
vocabulary and d = 640 one token table is 671 MB of float32, and the export of a 270M model
peaked near five times the model. The graph itself does not depend on how many rows the tables
have: the embedding is a ``Gather``, the head a ``MatMul``, and the vocabulary size appears only
in the tables' dims and in the shapes of the logits. So the model is traced with each
vocabulary-sized tensor cut to its first ``size`` rows (:class:`VocabStandin`), and in the
written graph those small initializers are swapped for the model's own tensors
(:meth:`VocabStandin.restore`), which :func:`~pit_deploy.exporters.onnx_graph.save_deduplicated`
writes a part at a time (:class:`~pit_deploy.exporters.onnx_graph.StoredTable`). The exporter
only ever sees the body.

The swap is checked, not assumed: every initializer with the stand-in's size in its dims must be
a stand-in table's bytes (as stored or transposed), and the size may appear nowhere else in the
graph as a value (a ``Constant``, an integer initializer, a node attribute). A graph that fails
the check is exported again at full size (:func:`pit_deploy.targets.onnx.export.export_onnx`).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from .onnx_graph import StoredTable, mark_pending
from .passes import TABLE_ROWS_ATTR

#: the smallest stand-in vocabulary tried (a prime: an unlikely size for any other axis)
FIRST_SIZE = 61


def _primes_from(start: int) -> Iterator[int]:
    n = start
    while True:
        if n > 1 and all(n % k for k in range(2, int(n ** 0.5) + 1)):
            yield n
        n += 1


def _config_ints(value: Any) -> set[int]:
    """Every integer in a config's dict, nested lists and dicts included."""
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, dict):
        return set().union(*(_config_ints(v) for v in value.values())) if value else set()
    if isinstance(value, (list, tuple)):
        return set().union(*(_config_ints(v) for v in value)) if value else set()
    return set()


def _tensor_slots(model: nn.Module) -> Iterator[tuple[nn.Module, str, str, torch.Tensor]]:
    """``(module, kind, name, tensor)`` for every parameter and buffer slot, shared ones repeated."""
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(module, kind).items():
                if tensor is not None:
                    yield module, kind, name, tensor


def standin_size(model: nn.Module, vocab: int, hidden: int) -> int | None:
    """A stand-in vocabulary size for ``model``: a prime from :data:`FIRST_SIZE` that is no dim
    of any of its tensors and no integer of its config, at most half the vocabulary; ``None``
    where the vocabulary is too small to gain anything or equals the hidden size."""
    if vocab == hidden:
        return None
    taken = {int(s) for *_, t in _tensor_slots(model) for s in t.shape}
    taken |= _config_ints(model.config.to_dict())
    for size in _primes_from(FIRST_SIZE):
        if 2 * size > vocab:
            return None
        if size not in taken:
            return size


class VocabStandin:
    """The model's vocabulary-sized tensors cut to ``size`` rows while a graph is traced.

    A tensor is vocabulary-sized when it is ``(V, d)``, ``(d, V)`` or ``(V,)``: the token table,
    the head (or ``Zᵀ`` of a factorized model, which both read) and a head bias. A tensor two
    slots share (a tied model's table) is cut once and stays shared.
    """

    def __init__(self, model: nn.Module, vocab: int, hidden: int, size: int):
        self.model, self.vocab, self.hidden, self.size = model, vocab, hidden, size
        #: id of an original tensor -> (the rows it stands for, the stand-in)
        self.tables: dict[int, tuple[Any, torch.Tensor]] = {}
        #: id of a table weight never written (:func:`~pit_deploy.exporters.passes.materialize_by_rows`)
        #: -> the rows that compute it
        self.computed: dict[int, Any] = {}
        rows = getattr(model, TABLE_ROWS_ATTR, None)
        if rows is not None:
            self.computed = {id(model.get_input_embeddings().weight): rows[0],
                             id(model.get_output_embeddings().weight): rows[1]}
        self._swapped: list[tuple[nn.Module, str, str, torch.Tensor]] = []
        self._padding: list[tuple[nn.Module, int]] = []

    def _axis(self, tensor: torch.Tensor) -> int | None:
        """The vocabulary axis of a vocabulary-sized tensor, else ``None``."""
        shape = tuple(tensor.shape)
        if shape in ((self.vocab,), (self.vocab, self.hidden)):
            return 0
        return 1 if shape == (self.hidden, self.vocab) else None

    @contextmanager
    def applied(self) -> Iterator["VocabStandin"]:
        """Inside: the cut tensors in the model's slots, ``config.vocab_size`` the stand-in's
        (optimum draws its sample token ids below it), an embedding's ``padding_idx`` past the cut
        dropped (it changes no value of a forward pass). Everything is put back on exit."""
        config = self.model.config
        old_vocab = config.vocab_size
        try:
            for module, kind, name, tensor in list(_tensor_slots(self.model)):
                axis = self._axis(tensor)
                if axis is None:
                    continue
                if id(tensor) not in self.tables:
                    source = self.computed.get(id(tensor), tensor)
                    if source is tensor:
                        cut = tensor.detach().narrow(axis, 0, self.size).contiguous()
                    else:  # computed rows, (V, d)
                        cut = torch.from_numpy(np.ascontiguousarray(source[0:self.size])).to(tensor.dtype)
                    if isinstance(tensor, nn.Parameter):
                        cut = nn.Parameter(cut, requires_grad=False)
                    self.tables[id(tensor)] = (source if source is not tensor else tensor.detach(), cut)
                getattr(module, kind)[name] = self.tables[id(tensor)][1]
                self._swapped.append((module, kind, name, tensor))
            for module in self.model.modules():
                padding = getattr(module, "padding_idx", None)
                if isinstance(module, nn.Embedding) and padding is not None and padding >= self.size:
                    self._padding.append((module, padding))
                    module.padding_idx = None
            config.vocab_size = self.size
            yield self
        finally:
            config.vocab_size = old_vocab
            for module, kind, name, tensor in reversed(self._swapped):
                getattr(module, kind)[name] = tensor
            for module, padding in self._padding:
                module.padding_idx = padding
            self._swapped.clear()
            self._padding.clear()

    def restore(self, graph) -> dict[str, StoredTable] | None:
        """Point each stand-in initializer of ``graph`` at the model's rows it was cut from,
        marked for :func:`~pit_deploy.exporters.onnx_graph.save_deduplicated` to write a part at
        a time, and give every shape the real vocabulary (:func:`give_vocab`). Returns the tables
        by initializer name, or ``None`` where some initializer of the stand-in's size is no
        stand-in table or the size shows up anywhere else (the graph is then of no use)."""
        from onnx import numpy_helper

        found: dict[str, StoredTable] = {}
        for init in graph.initializer:
            if self.size in init.dims:
                table = self._match(numpy_helper.to_array(init))
                if table is None:
                    return None
                found[init.name] = table
        for init in graph.initializer:
            if init.name in found:
                mark_pending(init, found[init.name])
        return found if found and give_vocab(graph, self.size, self.vocab) else None

    def _match(self, stored: np.ndarray) -> StoredTable | None:
        """The model's tensor whose stand-in ``stored`` is, in the layout the graph stores."""
        for source, cut in self.tables.values():
            small = cut.detach().numpy()
            if stored.shape == small.shape and np.array_equal(stored, small):
                return StoredTable(source)
            if stored.ndim == 2 and stored.shape == small.T.shape and np.array_equal(stored, small.T):
                return StoredTable(source, transposed=True)
        return None

    def fix_config(self, folder: Path) -> None:
        """The exporter saved the model's config while it said the stand-in's vocabulary."""
        path = folder / "config.json"
        if path.is_file():
            config = json.loads(path.read_text(encoding="utf-8"))
            if config.get("vocab_size") == self.size:
                config["vocab_size"] = self.vocab
                path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def give_vocab(graph, size: int, vocab: int) -> bool:
    """Give the shapes of ``graph``'s inputs, outputs and values the real ``vocab`` where they say
    the stand-in's ``size``; ``False`` (nothing changed) where ``size`` is still in an
    initializer's dims or is a value of the graph (an integer initializer, a ``Constant``, a
    node attribute), which no shape edit could make right."""
    from onnx import TensorProto

    for init in graph.initializer:
        if size in init.dims:
            return False
        if init.data_type in (TensorProto.INT64, TensorProto.INT32) and _holds(init, size):
            return False
    if _in_nodes(graph, size):
        return False
    for value in (*graph.input, *graph.output, *graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_value") and dim.dim_value == size:
                dim.dim_value = vocab
    return True


def _holds(init, value: int) -> bool:
    from onnx import numpy_helper

    return bool(np.any(numpy_helper.to_array(init) == value))


def _in_nodes(graph, value: int) -> bool:
    """Whether ``value`` is an integer attribute or an integer ``Constant`` of some node,
    subgraphs included."""
    from onnx import AttributeProto, TensorProto, numpy_helper

    for node in graph.node:
        for attr in node.attribute:
            if attr.type == AttributeProto.INT and attr.i == value:
                return True
            if attr.type == AttributeProto.INTS and value in attr.ints:
                return True
            if attr.type == AttributeProto.TENSOR and attr.t.data_type in (TensorProto.INT32, TensorProto.INT64):
                if np.any(numpy_helper.to_array(attr.t) == value):
                    return True
            for sub in [attr.g] * attr.HasField("g") + list(attr.graphs):
                if _in_nodes(sub, value):
                    return True
    return False

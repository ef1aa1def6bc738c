"""The ONNX targets trace a model with a few rows of its token tables and write the real tables
from the model (:mod:`pit_deploy.exporters.vocab_standin`). What they write must be what a trace
of the whole tables writes: byte for byte for the ``onnx`` target, node for node and value for
value for ``onnx-genai`` (whose data file is laid out by our writer, not onnx's). A graph in
which the stand-in's size shows up beside the tables is traced again at the full size.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np
import pytest

from pit_deploy.exporters import vocab_standin
from pit_deploy.exporters.passes import TABLE_ROWS_ATTR, prepare
from pit_deploy.tiny import tiny_model, tiny_pit_model, tiny_sentencepiece_tokenizer, tiny_tokenizer


def _files(folder: Path) -> dict[str, str]:
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


def _whole(monkeypatch) -> None:
    """Trace the whole tables, as the exporters did before the stand-in."""
    from pit_deploy.targets.onnx import export as onnx_export
    from pit_deploy.targets.onnx_genai import export as genai_export

    for module in (vocab_standin, onnx_export, genai_export):  # imported before any is patched
        monkeypatch.setattr(module, "standin_size", lambda *_: None)


def _tokenizer(family: str, vocab: int):
    return tiny_sentencepiece_tokenizer(vocab) if family.startswith("gemma") else tiny_tokenizer(vocab)


def _prepared(family: str, mode: str, by_rows: bool = False):
    if mode == "tied":
        return prepare(tiny_model(family), "tied")
    return prepare(tiny_pit_model(family), mode, tables_by_rows=by_rows)


@pytest.mark.parametrize("family, mode, dtype, by_rows", [
    ("llama", "factorized", "float32", False),
    ("llama", "materialized", "float32", True),
    ("gpt2", "tied", "float32", False),
    ("gemma3", "factorized", "int4", False),
])
def test_an_onnx_export_of_a_stand_in_is_the_export_of_the_whole_tables(tmp_path, monkeypatch, family, mode,
                                                                        dtype, by_rows):
    """Every file, decoder data and interface graph included, is the same bytes as an export
    that traces the whole tables; the exporter saw only the stand-in's rows; a model whose tables
    are computed by rows (``materialize_by_rows``) writes its head transposed from its rows."""
    from pit_deploy.targets.onnx import export as onnx_export

    seen: list[int] = []
    trace = onnx_export._trace_graphs

    def recorded(model, out_dir, opset, standin):
        seen.append(None if standin is None else standin.size)
        trace(model, out_dir, opset, standin)

    monkeypatch.setattr(onnx_export, "_trace_graphs", recorded)
    model = _prepared(family, mode, by_rows)
    assert hasattr(model, TABLE_ROWS_ATTR) == by_rows
    vocab = model.config.vocab_size
    ours = tmp_path / "standin"
    onnx_export.export_onnx(model, ours, _tokenizer(family, vocab), dtype=dtype)
    assert seen and seen[0] is not None and seen[0] < vocab // 2, seen
    assert model.config.vocab_size == vocab  # put back
    with monkeypatch.context() as m:
        _whole(m)
        whole = tmp_path / "whole"
        onnx_export.export_onnx(_prepared(family, mode), whole, _tokenizer(family, vocab), dtype=dtype)
    assert seen[-1] is None
    assert _files(ours) == _files(whole)


def test_a_graph_where_the_stand_in_size_shows_up_is_traced_again_whole(tmp_path, monkeypatch, caplog):
    """A stand-in size that is also a dim of the body (here the head size, in every attention
    reshape) cannot be told apart from the tables: the export is traced again at the full
    vocabulary and is the export of the whole tables."""
    from pit_deploy.targets.onnx import export as onnx_export

    model = _prepared("llama", "materialized", by_rows=True)
    head = model.config.hidden_size // model.config.num_attention_heads
    monkeypatch.setattr(onnx_export, "standin_size", lambda *_: head)
    with caplog.at_level(logging.INFO):
        onnx_export.export_onnx(model, tmp_path / "again", tiny_tokenizer(model.config.vocab_size))
    assert "could not take their tables back" in caplog.text
    assert not hasattr(model, TABLE_ROWS_ATTR)  # traced whole: its tables were written into it
    with monkeypatch.context() as m:
        _whole(m)
        onnx_export.export_onnx(_prepared("llama", "materialized"), tmp_path / "whole",
                                tiny_tokenizer(model.config.vocab_size))
    assert _files(tmp_path / "again") == _files(tmp_path / "whole")


def _graphs(folder: Path) -> dict:
    """Each graph's nodes, inputs, outputs, shapes and initializer values; the other files' bytes."""
    import onnx
    from onnx import numpy_helper

    out: dict = {}
    for name in ("model.onnx", "interface.onnx"):
        graph = onnx.load(str(folder / name)).graph
        out[name] = ([(n.op_type, list(n.input), list(n.output), str(n.attribute)) for n in graph.node],
                     str(graph.input), str(graph.output), str(graph.value_info),
                     [i.name for i in graph.initializer],
                     {i.name: numpy_helper.to_array(i, base_dir=str(folder)) for i in graph.initializer})
    out["files"] = {k: v for k, v in _files(folder).items() if not k.endswith((".onnx", ".data"))}
    return out


@pytest.mark.parametrize("family, dtype", [("llama", "float32"), ("gemma3", "int4")])
def test_an_onnx_genai_folder_of_a_stand_in_is_the_folder_of_the_whole_tables(tmp_path, monkeypatch, family, dtype):
    """The builder reads a twin of the stand-in's rows (its tables are replaced by ``Zᵀ`` anyway):
    the factorized folder has the same graphs, values and other files as when the builder reads
    the whole tables, ``genai_config.json`` included."""
    from pit_deploy.targets.onnx_genai import export as genai_export

    built: list[int] = []
    run = genai_export.run_builder

    def recorded(hf_dir, *args, **kwargs):
        import json

        built.append(json.loads((hf_dir / "config.json").read_text())["vocab_size"])
        run(hf_dir, *args, **kwargs)

    monkeypatch.setattr(genai_export, "run_builder", recorded)
    model = _prepared(family, "factorized")
    vocab = model.config.vocab_size
    genai_export.export_genai(model, tmp_path / "standin", _tokenizer(family, vocab), dtype=dtype)
    with monkeypatch.context() as m:
        _whole(m)
        genai_export.export_genai(_prepared(family, "factorized"), tmp_path / "whole", _tokenizer(family, vocab),
                                  dtype=dtype)
    assert built[0] < vocab // 2 and built[1] == vocab
    ours, whole = _graphs(tmp_path / "standin"), _graphs(tmp_path / "whole")
    assert ours["files"] == whole["files"]
    for name in ("model.onnx", "interface.onnx"):
        assert ours[name][:5] == whole[name][:5], name  # initializers in the same order too
        a, b = ours[name][5], whole[name][5]
        assert set(a) == set(b)
        for key in a:
            assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), (name, key)


def test_a_stored_table_writes_a_transposed_source_by_its_rows(tmp_path):
    """A table whose rows are computed (no tensor to transpose) is written column by column at
    its place in the file: the bytes of the transposed array, after and before other data."""
    from pit_deploy.exporters.onnx_graph import StoredTable

    class Rows:  # what TableRows offers: a shape and a slice of rows as an array
        def __init__(self, array):
            self.array, self.shape = array, array.shape

        def __getitem__(self, rows):
            return self.array[rows]

    values = np.random.default_rng(0).standard_normal((1000, 24)).astype(np.float32)
    table = StoredTable(Rows(values), transposed=True)
    table.PART_BYTES = 24 * 4 * 7  # 7 rows a part: parts that do not divide the rows
    path = tmp_path / "data"
    with open(path, "wb") as fh:
        fh.write(b"x" * 13)
        table.write(fh)
        fh.write(b"y")
    raw = path.read_bytes()
    assert raw[:13] == b"x" * 13 and raw[-1:] == b"y"
    assert raw[13:-1] == np.ascontiguousarray(values.T).tobytes()
    assert table.shape == (24, 1000) and np.array_equal(table.array(), values.T)

"""The ONNX targets' check that the interface graph reads the decoder's own weight bytes,
hashed from the external-data file a byte range at a time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pit_deploy.errors import PitError
from pit_deploy.targets.onnx.interface_weights import shared_weights
from pit_deploy.targets.onnx_genai.driver import shared_interface_weights


def _graph(name: str, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(w, k) for k, w in weights.items()]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])
    nodes = [helper.make_node("MatMul", ["x", next(iter(weights))], ["y"])]
    return helper.make_model(helper.make_graph(nodes, name, [x], [y], inits))


def _folder(tmp_path: Path, interface_weight: np.ndarray, location: str | None = None) -> Path:
    """A legacy-layout folder: ``model.onnx`` with its weights in ``model.onnx_data``, and
    ``interface.onnx`` pointing at the decoder's bytes (or holding ``interface_weight`` inline)."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((8, 8)).astype(np.float32)
    other = rng.standard_normal((8, 8)).astype(np.float32)
    decoder = _graph("decoder", {"other": other, "table": table})
    onnx.save_model(decoder, str(tmp_path / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx_data", size_threshold=0)
    interface = _graph("interface", {"table": interface_weight})
    if location is not None:  # point the interface's table at the decoder's data file's byte range
        saved = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
        source = next(i for i in saved.graph.initializer if i.name == "table")
        init = interface.graph.initializer[0]
        init.ClearField("raw_data")
        init.data_location = TensorProto.EXTERNAL
        for entry in source.external_data:
            kept = init.external_data.add()
            kept.key, kept.value = entry.key, location if entry.key == "location" else entry.value
    onnx.save_model(interface, str(tmp_path / "interface.onnx"))
    return tmp_path


def _table() -> np.ndarray:
    """The decoder's ``table`` as :func:`_folder` draws it."""
    rng = np.random.default_rng(0)
    return rng.standard_normal((8, 8)).astype(np.float32)


def test_an_interface_reading_the_decoders_byte_range_is_shared(tmp_path) -> None:
    folder = _folder(tmp_path, np.zeros((8, 8), np.float32), location="model.onnx_data")
    ok, message = shared_weights(folder, min_elements=64)
    assert ok, message


@pytest.mark.parametrize("check", [shared_weights, shared_interface_weights], ids=["onnx", "onnx-genai"])
@pytest.mark.parametrize("changed", [False, True])
def test_an_inline_copy_is_compared_by_its_bytes(changed: bool, check, tmp_path, monkeypatch) -> None:
    weight = _table()
    if changed:
        weight[3, 3] += 1.0
    folder = _folder(tmp_path, weight)
    plain_load = onnx.load

    def graph_only(path, *args, **kwargs):  # the data file is hashed in pieces, never loaded whole
        assert kwargs.get("load_external_data") is False, "a graph was loaded with its external data"
        return plain_load(path, *args, **kwargs)

    monkeypatch.setattr(onnx, "load", graph_only)
    ok, message = check(folder, min_elements=64)
    assert ok is not changed, message
    if changed:
        assert "not found byte-identical" in message


def test_an_interface_pointing_outside_its_folder_is_refused(tmp_path) -> None:
    (tmp_path / "art").mkdir()
    folder = _folder(tmp_path / "art", np.zeros((8, 8), np.float32), location="../model.onnx_data")
    (tmp_path / "model.onnx_data").write_bytes((tmp_path / "art" / "model.onnx_data").read_bytes())
    with pytest.raises(PitError, match="outside its folder"):
        shared_weights(folder, min_elements=64)

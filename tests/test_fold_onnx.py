"""The web schemes (``int8-web``, ``int4-web``): quantized codes in standard ONNX operators that
onnxruntime folds to float32 when a session is created. Native onnxruntime here; the browser
and Node runs are in ``tests/test_web_clients.py``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pit_deploy.cli import main
from pit_deploy.evaluate.verify import verify_directory
from pit_deploy.targets.onnx import data_name, decoder_file
from pit_deploy.tiny import FAMILIES
from pit_models import dense_t_pit_dir
from scramble import rehash

WEB = ("int8-web", "int4-web")


_pit_dir = dense_t_pit_dir


@pytest.fixture(scope="module", params=FAMILIES)
def web_export(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp(f"fold-{request.param}")
    out = root / "exp"
    assert main(["export", str(_pit_dir(request.param, root)), "--out", str(out), "--runtime", "onnx",
                 "--dtype", "float32,int8-web,int4-web"]) == 0
    return out


def _graph(folder: Path):
    import onnx

    return onnx.load(str(decoder_file(folder)), load_external_data=False).graph


def test_every_web_artifact_verifies_with_the_exact_interface(web_export):
    report = verify_directory(web_export, record=False)
    assert report.passed, str(report)
    for mode in ("materialized", "factorized"):
        for scheme in WEB:
            r = report.result("onnx", mode, scheme)
            assert r.kl_mean is not None and r.heldout_tokens >= 2048
            if mode == "factorized":
                assert r.delta_ti <= 1e-5  # M = (ẐᵀẐ)⁻¹T⁻¹ from the stored codes


def test_web_graphs_use_standard_operators_only_and_store_codes(web_export):
    """No contrib op (onnxruntime-web's default build lacks ``GatherBlockQuantized``), every
    weight matrix stored as uint8 codes, the files far smaller than fp32's."""
    fp32_bytes = (web_export / "onnx-factorized" / "onnx" / data_name("model.onnx")).stat().st_size
    for scheme, ratio in (("int8-web", 0.4), ("int4-web", 0.4)):
        folder = web_export / f"onnx-factorized-{scheme}"
        graph = _graph(folder)
        assert {n.domain for n in graph.node} <= {"", "ai.onnx"}, {n.op_type for n in graph.node if n.domain}
        assert not {"MatMulNBits", "GatherBlockQuantized"} & {n.op_type for n in graph.node}
        float_matrices = [i.name for i in graph.initializer if i.data_type == 1 and len(i.dims) == 2
                          and min(i.dims) > 16 and not i.name.startswith("pit_factors.T")
                          and "wpe" not in i.name]  # GPT-2's position table: a Gather, kept fp32
        assert float_matrices == []
        data = decoder_file(folder).with_name(data_name(decoder_file(folder).name))
        assert data.stat().st_size < ratio * fp32_bytes
        config = json.loads((folder / "config.json").read_text())
        assert config["transformers.js_config"]["use_external_data_format"] is True


def test_the_factorized_table_is_stored_once_and_read_by_both_sides(web_export):
    import onnx

    model = onnx.load(str(decoder_file(web_export / "onnx-factorized-int8-web")), load_external_data=True)
    graph = model.graph
    config = json.loads((web_export / "reference" / "config.json").read_text())
    vocab = config["vocab_size"]
    tables = [i for i in graph.initializer if i.dims and i.dims[0] == vocab and i.data_type == onnx.TensorProto.UINT8
              and len(i.dims) == 3 and i.dims[2] > 1]  # codes, not the (V, blocks, 1) zero points
    assert len(tables) == 1  # one code table (V, blocks, block) in the file
    (table,) = tables
    folded = table.name.rsplit(".q", 1)[0]
    readers = {n.op_type for n in graph.node if folded in n.input}
    assert readers == {"Gather", "MatMul"}  # the embedding and the head read the one folded Zᵀ


def test_onnxruntime_folds_the_codes_when_the_session_is_created(web_export, tmp_path):
    """After onnxruntime's graph optimizations no dequantizing node is left: the decoder runs
    fp32 kernels on folded weights."""
    import onnx
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(decoder_file(web_export / "onnx-factorized-int4-web")), opts,
                         providers=["CPUExecutionProvider"])
    nodes = onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False).graph.node
    assert "BitShift" not in {n.op_type for n in nodes}
    assert not [n.name for n in nodes if any(i.endswith((".q4", ".q8")) for i in n.input)]


def test_int4_web_keeps_the_int4_schemes_8bit_layers(web_export):
    if json.loads((web_export / "reference" / "config.json").read_text())["model_type"] == "gpt2":
        pytest.skip("GPT-2 has no v_proj/down_proj (fused c_attn, c_proj): nothing is kept at 8 bits")
    graph = _graph(web_export / "onnx-factorized-int4-web")
    eight = {i.name.rsplit(".q8", 1)[0] for i in graph.initializer if i.name.endswith(".q8")}
    four = {i.name.rsplit(".q4", 1)[0] for i in graph.initializer if i.name.endswith(".q4")}
    readers = {i: [n.name for n in graph.node if n.op_type == "MatMul" and i in n.input] for i in eight | four}
    for name in four:
        assert not any(k in r for r in readers[name] for k in ("v_proj", "down_proj")), readers[name]
    layers = {k for name in eight for r in readers[name] for k in ("v_proj", "down_proj") if k in r}
    assert layers == {"v_proj", "down_proj"}


def test_a_corrupted_code_fails_verification(web_export, tmp_path, capsys):
    """Random bytes in the body's 4-bit codes (digests re-recorded): verify fails (exit 1)."""
    d = tmp_path / "exp"
    shutil.copytree(web_export, d)
    folder = d / "onnx-factorized-int4-web"
    decoder = decoder_file(folder)
    graph = _graph(folder)
    data = decoder.with_name(data_name(decoder.name))
    raw = bytearray(data.read_bytes())
    rng = np.random.default_rng(0)
    hit = 0
    for init in graph.initializer:
        where = {e.key: e.value for e in init.external_data}
        if init.name.endswith(".q4") and "offset" in where:
            start, length = int(where["offset"]), int(where["length"])
            raw[start:start + length] = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
            hit += 1
    assert hit > 0
    data.write_bytes(bytes(raw))
    rehash(d)
    code = main(["verify", str(d), "--no-record", "--mode", "factorized", "--dtype", "int4-web"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "FAIL" in out and "kl_mean" in out


@pytest.mark.parametrize("runtime", ["executorch", "onnx-genai"])
def test_web_schemes_are_refused_on_other_targets(tmp_path, capsys, runtime):
    pit = _pit_dir("llama", tmp_path)
    assert main(["export", str(pit), "--out", str(tmp_path / "e"), "--runtime", runtime, "--dtype", "int4-web"]) == 2
    err = capsys.readouterr().err
    assert "int4-web scheme is meant for onnx only" in err
    assert not (tmp_path / "e").exists()

"""The ``onnx-genai`` target: folders that ``onnxruntime_genai.Model`` loads, built by the
onnxruntime-genai model builder from tiny models, exported and verified through the generic
commands (``pit-deploy export``/``verify``), and a family the builder lacks refused up front."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (requirements/cpu.txt pins it)")

from pit_deploy.cli import main  # noqa: E402
from pit_deploy.io.checkpoint import save_model  # noqa: E402
from pit_deploy.io.manifest import Manifest  # noqa: E402
from pit_deploy.tiny import tiny_pit_model, tiny_tokenizer  # noqa: E402


CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


def _source(tmp_path: Path, family: str) -> Path:
    src = tmp_path / f"{family}-src"
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE  # the folder must carry it to onnxruntime_genai's tokenizer
    save_model(tiny_pit_model(family), src, tokenizer)
    return src


def _verify(out: Path, capsys) -> dict:
    capsys.readouterr()
    assert main(["verify", str(out), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("family, mode", [("llama", "materialized"), ("qwen3", "materialized"), ("qwen3", "factorized")])
def test_fp32_folder_loads_in_genai_and_matches_pytorch(family, mode, tmp_path, capsys):
    out = tmp_path / "exp"
    assert main(["export", str(_source(tmp_path, family)), "--out", str(out), "--runtime", "onnx-genai",
                 "--mode", mode, "--dtype", "float32"]) == 0
    (art,) = Manifest.read(out).artifacts
    folder = out / art.path
    for name in ("model.onnx", "model.onnx.data", "genai_config.json", "tokenizer.json", "interface.onnx"):
        assert (folder / name).is_file(), name
    assert art.details["decoder_ops"].get("GroupQueryAttention") == 2  # the builder's fused decoder
    if mode == "factorized":  # one V×d tensor, read by the gather and by the head
        assert art.details["factorized"]["tables"] == ["pit.Zt"]
        assert art.details["interface_tensors_shared"] == ["pit.Zt", "pit.M", "pit.T"]
    (result,) = _verify(out, capsys)["artifacts"]
    assert result["passed"], result["failures"]
    assert result["logits_rel_l2"] <= 1e-4 and result["delta_ti"] <= 1e-5 and result["weights_shared"] is True
    assert any(n.startswith("onnxruntime_genai generator vs decoder session") for n in result["notes"])
    import onnxruntime_genai as og

    chat = og.Tokenizer(og.Model(str(folder))).apply_chat_template(
        json.dumps([{"role": "user", "content": "hi"}]), add_generation_prompt=False)
    assert chat == "<s>user: hi</s>"
    # the builder's indented tokenizer.json is shipped compact: the same JSON, read the same way
    shipped = (folder / "tokenizer.json").read_text(encoding="utf-8")
    source = tmp_path / f"{family}-src" / "tokenizer.json"
    assert "\n" not in shipped and json.loads(shipped) == json.loads(source.read_text(encoding="utf-8"))
    assert art.details["tokenizer_json"].startswith("written without indentation")
    pretty = tmp_path / "pretty"
    shutil.copytree(folder, pretty)
    shutil.copy(source, pretty / "tokenizer.json")
    text = "Hello world, the quick brown fox <s> naïve 123"
    assert list(og.Tokenizer(og.Model(str(folder))).encode(text)) == \
        list(og.Tokenizer(og.Model(str(pretty))).encode(text))


def test_a_family_the_builder_lacks_is_exit_2_before_export(tmp_path, capsys):
    out = tmp_path / "exp"
    assert main(["export", str(_source(tmp_path, "gpt2")), "--out", str(out), "--runtime", "onnx-genai"]) == 2
    err = capsys.readouterr().err
    assert "\nerror: " in "\n" + err and "'gpt2' is not one of them" in err
    assert not out.exists()


def test_factorized_int4_reads_one_quantized_table_and_keeps_the_identity(tmp_path, capsys):
    """The builder quantizes the body; the token table is one block-quantized Ẑ read by
    GatherBlockQuantized and MatMulNBits, stored once, with M = (ẐᵀẐ)⁻¹T⁻¹ (W_out E = I)."""
    out = tmp_path / "exp"
    assert main(["export", str(_source(tmp_path, "llama")), "--out", str(out), "--runtime", "onnx-genai",
                 "--mode", "factorized", "--dtype", "int4,int4-compact"]) == 0
    art, compact = Manifest.read(out).artifacts
    ops = art.details["decoder_ops"]
    # two layers × (q, k, v, o, gate, up, down) by the builder (q/k/v unfused so that v_proj can
    # stay at 8 bits), and the head's 8-bit table, read whole with int8 activations
    assert ops["GatherBlockQuantized"] == 1 and ops["MatMulNBits"] == 2 * 7 + 1 and "GroupQueryAttention" in ops
    # the scheme's int4_8bit_layers (v_proj, down_proj) are 8-bit in the builder's body
    import onnx

    decoder = onnx.load(str(out / art.path / "model.onnx"), load_external_data=False)
    bits = {n.name: next(a.i for a in n.attribute if a.name == "bits") for n in decoder.graph.node
            if n.op_type == "MatMulNBits" and n.name.startswith("/model/layers.")}
    assert {n for n, b in bits.items() if b == 8} == {f"/model/layers.{i}/{p}/MatMul_Q8" for i in range(2)
                                                     for p in ("attn/v_proj", "mlp/down_proj")}
    # GPTQ's codes are asymmetric: every body node reads the zero points they bring
    assert all(len(n.input) > 3 and n.input[3] for n in decoder.graph.node if n.name in bits)
    assert art.details["builder_int8_layers"] == ["v_proj", "down_proj"]
    assert art.details["factorized"]["table_byte_ranges"] == 1  # the 8-bit table, once
    # the table holds Z R: the head's factor is T R (an orthogonal turn of T: about the same T Tᵀ,
    # not T itself) moved onto the grid of the head's int8 activations, blocks of 32 as k·max/127
    from onnx import numpy_helper

    from pit_deploy.io.checkpoint import load_pit_model

    reference = load_pit_model(out / "reference")
    t = reference.get_input_embeddings().interface.transform().detach().double().numpy()
    # the factor is stored as its 8-bit codes (k + 128, one scale a block), folded at load
    inits = {i.name: i for i in onnx.load(str(out / art.path / "model.onnx")).graph.initializer}
    assert "pit.T" not in inits and inits["pit.T.grid8"].data_type == onnx.TensorProto.UINT8
    q, scales = (numpy_helper.to_array(inits[f"pit.T.{part}"]).astype("float64") for part in ("grid8", "scales"))
    tr = ((q - 128) * scales).reshape(q.shape[0], -1)
    assert "Z R" in art.details["quantization"]["table_rotation"]
    assert "folded" in art.details["quantization"]["head_factor"]
    assert abs(tr @ tr.T - t @ t.T).max() < 2e-2 * abs(t @ t.T).max() and abs(tr - t).max() > 1e-3 * abs(t).max()
    blocks = tr.reshape(tr.shape[0], -1, 32)
    codes = blocks / (abs(blocks).max(axis=2, keepdims=True) / 127)
    assert abs(codes - codes.round()).max() < 1e-4
    assert "int8" in art.details["quantization"]["head_activations"]
    assert art.details["quantization"]["interface_exact"] is True
    # int4 rounds by GPTQ: the calibrated codes replace the builder's rounding of the body, and
    # the table we write is calibrated on the same text
    assert art.details["quantization"]["table_rounding"].startswith("GPTQ") and "seed" in art.details["calibration"]
    assert art.details["body_rounding"].startswith("GPTQ codes of 14 linears")
    # int4-compact: a 4-bit table (one plane, read whole by the head) and only v_proj at 8 bits
    assert compact.path == "onnx-genai-factorized-int4-compact" and compact.details["factorized"]["table_byte_ranges"] == 1
    assert compact.details["builder_int8_layers"] == ["v_proj"] and compact.details["decoder_ops"]["MatMulNBits"] == 2 * 7 + 1
    for result in _verify(out, capsys)["artifacts"]:
        assert result["passed"], result["failures"]
        assert result["interface_exact"] is True and result["delta_ti"] <= 1e-5 and result["weights_shared"] is True
    # a bench bundle runs the folder with numpy + onnxruntime only (the bundle's own OrtDecoder)
    bundle = tmp_path / "b.tar.gz"
    assert main(["bench", str(out), "--prompt-len", "6", "--gen-len", "4", "--reps", "1", "--bundle", str(bundle)]) == 0
    with tarfile.open(bundle) as tar:
        tar.extractall(tmp_path / "device", filter="data")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    rows_path = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(tmp_path / "device" / "pit-bench" / "run_bench.py"), "--threads", "1",
                           "--out", str(rows_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(rows_path.read_text())["rows"]
    assert len(rows) == 2 and all(r["first_divergence"] is None and "pit_deploy" not in r["imported"] for r in rows)


def test_genai_group_size_sets_the_genai_blocks_and_leaves_the_other_targets_at_group_size(tmp_path, capsys):
    """``--genai-group-size 64``: the onnx-genai folder's body (GPTQ codes with zero points) and
    token table in blocks of 64, recorded so in its manifest entry and verified; the ``onnx``
    artifact of the same export keeps ``group_size`` (32)."""
    import onnx

    out = tmp_path / "exp"
    assert main(["export", str(_source(tmp_path, "llama")), "--out", str(out), "--runtime", "onnx-genai,onnx",
                 "--mode", "factorized", "--dtype", "int4", "--genai-group-size", "64"]) == 0
    arts = {a.target: a for a in Manifest.read(out).artifacts}
    assert arts["onnx-genai"].details["scheme"]["group_size"] == 64
    assert arts["onnx-genai"].details["scheme"]["genai_group_size"] == 64
    assert arts["onnx"].details["scheme"]["group_size"] == 32
    for target, block in (("onnx-genai", 64), ("onnx", 32)):
        graph = out / arts[target].path / ("model.onnx" if target == "onnx-genai" else "onnx/model_q4.onnx")
        decoder = onnx.load(str(graph), load_external_data=False)
        blocks = {next(a.i for a in n.attribute if a.name == "block_size") for n in decoder.graph.node
                  if n.op_type in ("MatMulNBits", "GatherBlockQuantized")}
        assert blocks == {block}, (target, blocks)
    genai = onnx.load(str(out / arts["onnx-genai"].path / "model.onnx"), load_external_data=False)
    assert all(len(n.input) > 3 and n.input[3] for n in genai.graph.node
               if n.op_type == "MatMulNBits" and n.name.startswith("/model/layers."))
    for result in _verify(out, capsys)["artifacts"]:
        assert result["passed"], result["failures"]
        assert result["interface_exact"] is True and result["delta_ti"] <= 1e-4


def test_a_corrupted_decoder_weight_fails_verify(tmp_path, capsys):
    """One body weight of the builder's decoder overwritten (digests re-recorded, so only the
    numbers can give it away): the runtime's logits leave the reference, verify exits 1."""
    import numpy as np
    import onnx

    from pit_deploy.targets.onnx_genai import BUILDER_DATA, DECODER_NAME
    from scramble import rehash

    out = tmp_path / "exp"
    assert main(["export", str(_source(tmp_path, "llama")), "--out", str(out), "--runtime", "onnx-genai",
                 "--mode", "factorized", "--dtype", "float32"]) == 0
    folder = out / Manifest.read(out).artifacts[0].path
    graph = onnx.load(str(folder / DECODER_NAME), load_external_data=False).graph
    body = [i for i in graph.initializer if "layers.0" in i.name and i.data_location == onnx.TensorProto.EXTERNAL
            and len(i.dims) == 2]
    assert body, "no external body weight of the first layer"
    where = {e.key: e.value for e in body[0].external_data}
    offset, length = int(where["offset"]), int(where["length"])
    raw = bytearray((folder / BUILDER_DATA).read_bytes())
    noise = np.random.default_rng(0).standard_normal(length // 4).astype(np.float32)
    raw[offset:offset + length] = noise.tobytes()
    (folder / BUILDER_DATA).write_bytes(bytes(raw))
    rehash(out)
    capsys.readouterr()
    assert main(["verify", str(out), "--no-record", "--json"]) == 1
    (result,) = json.loads(capsys.readouterr().out)["artifacts"]
    assert not result["passed"] and any("rel_l2" in f for f in result["failures"]), result["failures"]


def test_int8_layers_become_exact_builder_overrides():
    from pit_deploy.errors import PitError
    from pit_deploy.targets.onnx_genai.export import int8_overrides

    extra, target = int8_overrides(("v_proj", "down_proj"), 2)
    assert extra == {"fuse_qkv": "false"}  # fused, v_proj has no node of its own
    names = [o["match"]["name"] for o in target["quant_config"]["weights"]["overrides"]]
    assert names == ["/model/layers.0/attn/v_proj/MatMul", "/model/layers.0/mlp/down_proj/MatMul",
                     "/model/layers.1/attn/v_proj/MatMul", "/model/layers.1/mlp/down_proj/MatMul"]
    assert int8_overrides(("down_proj",), 1)[0] == {}  # q/k/v stay fused
    extra, target = int8_overrides(("layers.1.mlp.down_proj",), 12)  # one layer's, not layers.11's
    assert extra == {} and [o["match"]["name"] for o in target["quant_config"]["weights"]["overrides"]] == \
        ["/model/layers.1/mlp/down_proj/MatMul"]
    with pytest.raises(PitError, match="no such projection"):
        int8_overrides(("c_fc",), 1)


def test_quantized_folders_record_their_expected_error_and_a_scrambled_body_fails_the_scaled_bound(tmp_path, capsys):
    """The body's grid (int4's GPTQ codes with zero points, in the builder's blocks) and our
    asymmetric table: an honest int4 folder sits near its expected error; random bytes in every body
    ``MatMulNBits`` weight (digests re-recorded) fail verify on the scaled bound."""
    import numpy as np
    import onnx

    from pit_deploy.targets.onnx_genai import BUILDER_DATA, DECODER_NAME
    from scramble import rehash

    out = tmp_path / "exp"
    assert main(["export", str(_source(tmp_path, "llama")), "--out", str(out), "--runtime", "onnx-genai",
                 "--mode", "factorized", "--dtype", "int4"]) == 0
    (art,) = _verify(out, capsys)["artifacts"]
    assert art["expected_kl_mean"] > 0 and art["kl_mean"] <= 2 * art["expected_kl_mean"], art
    folder = out / Manifest.read(out).artifacts[0].path
    graph = onnx.load(str(folder / DECODER_NAME), load_external_data=False).graph
    where = {i.name: {e.key: e.value for e in i.external_data} for i in graph.initializer}
    body = [n.input[1] for n in graph.node if n.op_type == "MatMulNBits" and "layers." in n.name
            and "offset" in where.get(n.input[1], {})]
    assert body, "no external body MatMulNBits weight"
    raw = bytearray((folder / BUILDER_DATA).read_bytes())
    rng = np.random.default_rng(0)
    for name in body:
        offset, length = int(where[name]["offset"]), int(where[name]["length"])
        raw[offset:offset + length] = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
    (folder / BUILDER_DATA).write_bytes(bytes(raw))
    rehash(out)
    capsys.readouterr()
    assert main(["verify", str(out), "--no-record", "--json"]) == 1
    (result,) = json.loads(capsys.readouterr().out)["artifacts"]
    assert any("the error its weight rounding explains" in f for f in result["failures"]), result["failures"]


def _builder_weight(node, inits) -> "np.ndarray":
    """A body ``MatMulNBits``'s weight as onnxruntime computes it, rows = output channels: the
    node alone (its attributes, codes, scales and zero points if any) in a session of its own,
    fed the identity. Every row of the identity is exact on the int8 kernel's per-block grid, so
    the output is the weight the kernel reads, not one rounded by this helper's own reading."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    attrs = {a.name: a.i for a in node.attribute}
    k = attrs["K"]
    single = helper.make_node("MatMulNBits", ["x", *node.input[1:]], ["y"], domain="com.microsoft",
                              **{a.name: helper.get_attribute_value(a) for a in node.attribute})
    graph = helper.make_graph([single], "one", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [k, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [k, attrs["N"]])],
                              [inits[name] for name in node.input[1:] if name])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": np.eye(k, dtype=np.float32)})[0].T


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero-points"])
def test_calibrated_codes_replace_the_builders_rounding_exactly(symmetric, tmp_path):
    """The codes of a calibrated model, written into a folder the builder rounded by itself,
    are the weights onnxruntime's kernels compute with (4- and 8-bit nodes alike; symmetric codes
    on the builder's layout, asymmetric ones with the zero points they bring), where the
    builder's own rounding was not; a body node without codes is an internal error, not a
    silently twice-rounded linear, and so are codes on another block size than the node's."""
    import numpy as np
    import onnx
    import torch

    from pit_deploy.exporters.calibrated_rounding import RoundingGrid, round_to_nearest
    from pit_deploy.targets.onnx_genai.export import write_calibrated_body
    from pit_deploy.targets.onnx_genai import DECODER_NAME

    out = tmp_path / "exp"
    src = _source(tmp_path, "llama")
    assert main(["export", str(src), "--out", str(out), "--runtime", "onnx-genai", "--mode", "factorized",
                 "--dtype", "int4", "--rounding", "rtn"]) == 0
    folder = out / Manifest.read(out).artifacts[0].path
    model = tiny_pit_model("llama")
    eight = ("v_proj", "down_proj")  # the int4 scheme's 8-bit linears, as the builder was asked

    def rounded(group: int) -> dict:
        codes = {}
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                grid = RoundingGrid(8 if name.endswith(eight) else 4, group, symmetric=symmetric)
                # weights scaled column by column: codes the builder's rounding of the source never gives
                weight = module.weight.detach() * torch.linspace(0.5, 2.0, module.weight.shape[1])
                codes[name] = round_to_nearest(weight, grid)
        return codes

    codes = rounded(32)
    assert symmetric or any(bool((r.zeros != 0).any()) for r in codes.values())
    decoder = onnx.load(str(folder / DECODER_NAME), load_external_data=True)

    def body() -> dict[str, np.ndarray]:
        inits = {i.name: i for i in decoder.graph.initializer}
        return {n.name: _builder_weight(n, inits) for n in decoder.graph.node
                if n.op_type == "MatMulNBits" and n.name.startswith("/model/layers.")}

    def expected(node: str) -> np.ndarray:
        layer, proj = node.split("/")[2].split(".")[1], node.split("/")[4]
        parent = "self_attn" if node.split("/")[3] == "attn" else "mlp"
        return codes[f"model.layers.{layer}.{parent}.{proj}"].dequantize().numpy()

    before = body()
    assert len(before) == 14 and not all(np.allclose(w, expected(n), rtol=1e-6, atol=1e-7) for n, w in before.items())
    with pytest.raises(RuntimeError, match="in blocks of 16"):
        write_calibrated_body(copy.deepcopy(decoder), rounded(16))
    with pytest.raises(RuntimeError, match="no calibrated codes"):
        write_calibrated_body(copy.deepcopy(decoder), {k: v for k, v in codes.items()
                                                       if k != "model.layers.1.mlp.up_proj"})
    assert write_calibrated_body(decoder, codes) == 14
    after = body()
    assert {n for n in after if n.endswith("_Q8")} == {n for n in before if n.endswith("_Q8")}
    for node, weight in after.items():
        # the int8 kernel's own float32 product of the two scales: a few ulps
        np.testing.assert_allclose(weight, expected(node), rtol=1e-6, atol=1e-7, err_msg=node)

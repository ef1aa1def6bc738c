"""The ``onnx-genai`` target: folders that ``onnxruntime_genai.Model`` loads, built by the
onnxruntime-genai model builder from tiny models, exported and verified through the generic
commands (``pit-deploy export``/``verify``), and a family the builder lacks refused up front."""

from __future__ import annotations

import json
import os
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
    assert art.details["builder_int8_layers"] == ["v_proj", "down_proj"]
    assert art.details["factorized"]["table_byte_ranges"] == 1  # the 8-bit table, once
    # the table holds Z R: the head's factor is T R (an orthogonal turn of T: about the same T Tᵀ,
    # not T itself) moved onto the grid of the head's int8 activations, blocks of 32 as k·max/127
    from onnx import numpy_helper

    from pit_deploy.io.checkpoint import load_pit_model

    reference = load_pit_model(out / "reference")
    t = reference.get_input_embeddings().interface.transform().detach().double().numpy()
    inits = {i.name: i for i in onnx.load(str(out / art.path / "model.onnx")).graph.initializer}
    tr = numpy_helper.to_array(inits["pit.T"]).astype("float64")
    assert "Z R" in art.details["quantization"]["table_rotation"]
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
    """The builder's body grid (symmetric blocks, ``max|w|`` at 2^(b−1)) and our asymmetric table:
    an honest int4 folder sits near its expected error; random bytes in every body
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
    """A builder ``MatMulNBits``'s weight as onnxruntime computes it: ``(code − 2^(b−1)) · scale``,
    rows = output channels (symmetric blocks carry no zero points)."""
    import numpy as np
    from onnx import numpy_helper

    attrs = {a.name: a.i for a in node.attribute}
    bits, block, n = attrs["bits"], attrs["block_size"], attrs["N"]
    packed = numpy_helper.to_array(inits[node.input[1]]).reshape(n, -1)
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1) if bits == 4 else packed
    scales = numpy_helper.to_array(inits[node.input[2]]).reshape(n, -1)
    q = codes.astype(np.float32).reshape(n, scales.shape[1], block) - 2 ** (bits - 1)
    return (q * scales[..., None]).reshape(n, -1)


def test_calibrated_codes_replace_the_builders_rounding_exactly(tmp_path):
    """The codes of a calibrated model, written into a folder the builder rounded by itself,
    dequantize on onnxruntime's arithmetic to exactly the calibrated weights (4- and 8-bit
    nodes alike), where the builder's own rounding did not; a body node without codes is an
    internal error, not a silently twice-rounded linear."""
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
    codes = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            grid = RoundingGrid(8 if name.endswith(eight) else 4, 32, symmetric=True)
            # weights scaled column by column: codes the builder's rounding of the source never gives
            codes[name] = round_to_nearest(module.weight.detach() * torch.linspace(0.5, 2.0, module.weight.shape[1]),
                                           grid)

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
    assert len(before) == 14 and not all(np.array_equal(w, expected(n)) for n, w in before.items())
    assert write_calibrated_body(decoder, codes) == 14
    after = body()
    assert {n for n in after if n.endswith("_Q8")} == {n for n in before if n.endswith("_Q8")}
    for node, weight in after.items():
        assert np.array_equal(weight, expected(node)), node
    codes.pop("model.layers.1.mlp.up_proj")
    with pytest.raises(RuntimeError, match="no calibrated codes"):
        write_calibrated_body(decoder, codes)

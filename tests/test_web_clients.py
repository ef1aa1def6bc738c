"""The onnx target's folders in transformers.js, as a web developer loads them: Node
(onnxruntime-node) and headless Chromium (onnxruntime-web, WASM), through ``verify --web``.

Needs ``bash scripts/setup_web.sh`` (the test command runs it): the pinned npm packages in
``web/node_modules`` and Debian's ``chromium``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pit_deploy.cli import main
from pit_deploy.io.checkpoint import save_model
from pit_deploy.runtime.web_clients import WEB_DIR_ENV
from pit_deploy.targets.onnx import data_name, decoder_file
from pit_deploy.tiny import FAMILIES, tiny_pit_model, tiny_tokenizer
from scramble import rehash

CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}" \
                "{% if add_generation_prompt %}<s>assistant:{% endif %}"


@pytest.fixture(scope="module")
def web_exports(tmp_path_factory):
    """Per family: an export of both modes in fp32 and the factorized int4 artifact."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            root = tmp_path_factory.mktemp(f"web-{family}")
            tok = tiny_tokenizer()
            tok.chat_template = CHAT_TEMPLATE
            save_model(tiny_pit_model(family), root / "pit", tok)
            out = root / "exp"
            assert main(["export", str(root / "pit"), "--out", str(out), "--runtime", "onnx",
                         "--mode", "factorized,materialized", "--dtype", "float32,int4"]) == 0
            made[family] = out
        return made[family]

    return get


def _verify(directory: Path, capsys, *args: str) -> tuple[int, dict]:
    code = main(["verify", str(directory), "--json", "--no-record", *args])
    return code, json.loads(capsys.readouterr().out)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_the_folder_is_laid_out_as_transformers_js_loads_it(web_exports):
    out = web_exports("llama")
    fp32, int4 = out / "onnx-factorized", out / "onnx-factorized-int4"
    assert decoder_file(fp32) == fp32 / "onnx" / "model.onnx" and (fp32 / "onnx" / "model.onnx_data").is_file()
    assert decoder_file(int4) == int4 / "onnx" / "model_q4.onnx" and (int4 / "onnx" / "model_q4.onnx_data").is_file()
    for folder, dtype in ((fp32, "fp32"), (int4, "q4")):
        config = json.loads((folder / "config.json").read_text())
        assert config["transformers.js_config"] == {"dtype": dtype, "use_external_data_format": True}
        assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
        assert not (folder / "model.onnx").exists()
    import onnx

    # the browser hands the data file to onnxruntime-web under transformers.js's name for it
    graph = onnx.load(str(decoder_file(int4)), load_external_data=False).graph
    locations = {e.value for i in graph.initializer for e in i.external_data if e.key == "location"}
    assert locations == {data_name("model_q4.onnx")}


#: Llama in the default tier (the other tests here run on it too), every other family in the full one
WEB_FAMILIES = [f if f == "llama" else pytest.param(f, marks=pytest.mark.full) for f in FAMILIES]


@pytest.mark.parametrize("family", WEB_FAMILIES)
def test_node_reproduces_pytorch_on_every_family(web_exports, family, capsys):
    """fp32: transformers.js's logits within the fp32 bound and its own greedy loop identical;
    int4: within the int4 KL bounds (onnxruntime-node has every operator native builds have)."""
    code, data = _verify(web_exports(family), capsys, "--web", "node", "--mode", "factorized")
    assert code == 0, [a["failures"] for a in data["artifacts"]]
    by_dtype = {a["dtype"]: a["web"]["node"] for a in data["artifacts"]}
    fp32, int4 = by_dtype["float32"], by_dtype["int4"]
    assert fp32["passed"] and fp32["greedy_match"] and fp32["greedy_tokens"] == 32
    assert fp32["logits_rel_l2"] <= 1e-4 and fp32["top1_agreement"] == 1.0 and fp32["dtype"] == "fp32"
    assert int4["passed"] and int4["dtype"] == "q4" and int4["kl_mean"] is not None
    assert fp32["versions"]["transformers.js"] == "4.3.1"


def test_chromium_reproduces_pytorch_in_both_modes(web_exports, capsys):
    code, data = _verify(web_exports("llama"), capsys, "--web", "chromium", "--dtype", "float32")
    assert code == 0, [a["failures"] for a in data["artifacts"]]
    assert {a["mode"] for a in data["artifacts"]} == {"factorized", "materialized"}
    for art in data["artifacts"]:
        web = art["web"]["chromium"]
        assert web["passed"] and web["greedy_match"] and web["logits_rel_l2"] <= 1e-4
        assert web["decode_ms_per_token"] > 0 and "onnxruntime-web" in web["versions"]


def test_a_corrupted_weight_fails_in_the_web_clients_too(web_exports, tmp_path, capsys):
    """One body weight scaled in the decoder's data file: native onnxruntime and transformers.js
    (which reads the same file) both fail the fp32 bounds."""
    import onnx

    d = _copy(web_exports("llama"), tmp_path / "exp")
    folder = d / "onnx-factorized"
    decoder = decoder_file(folder)
    graph = onnx.load(str(decoder), load_external_data=False).graph
    init = next(i for i in graph.initializer if list(i.dims) == [128, 64])  # an MLP down-projection
    where = {e.key: e.value for e in init.external_data}
    data = folder / "onnx" / where["location"]
    raw = bytearray(data.read_bytes())
    start, length = int(where["offset"]), int(where["length"])
    raw[start:start + length] = (np.frombuffer(raw[start:start + length], dtype="<f4") * 3).astype("<f4").tobytes()
    data.write_bytes(bytes(raw))
    rehash(d)
    code, report = _verify(d, capsys, "--web", "node,chromium", "--mode", "factorized", "--dtype", "float32")
    assert code == 1
    (art,) = report["artifacts"]
    for client in ("node", "chromium"):
        web = art["web"][client]
        assert not web["passed"] and any("logits_rel_l2" in f for f in web["failures"])
        assert any(f.startswith(f"transformers.js in {client}: logits_rel_l2") for f in art["failures"])


def test_an_operator_the_browser_lacks_fails_verify_with_the_browsers_message(web_exports, capsys):
    """The int4 artifact's 4-bit table gather (``GatherBlockQuantized``) has no kernel in
    onnxruntime-web's default WASM build: the browser check fails with its own error line, quickly."""
    code, data = _verify(web_exports("llama"), capsys, "--web", "chromium", "--mode", "factorized",
                         "--dtype", "int4")
    assert code == 1
    (art,) = data["artifacts"]
    assert "GatherBlockQuantized" in art["web"]["chromium"]["error"]
    assert any("GatherBlockQuantized" in f for f in art["failures"])


def test_the_web_schemes_run_in_the_browser_and_in_node(tmp_path, capsys):
    """``int8-web`` / ``int4-web``: standard operators only, so onnxruntime-web's default WASM
    build loads them; both clients stay within the KL bounds."""
    tok = tiny_tokenizer()
    save_model(tiny_pit_model("llama"), tmp_path / "pit", tok)
    out = tmp_path / "exp"
    assert main(["export", str(tmp_path / "pit"), "--out", str(out), "--runtime", "onnx", "--mode", "factorized",
                 "--dtype", "int8-web,int4-web"]) == 0
    code, data = _verify(out, capsys, "--web", "node,chromium")
    assert code == 0, [a["failures"] for a in data["artifacts"]]
    assert {a["scheme"] for a in data["artifacts"]} == {"int8-web", "int4-web"}
    for art in data["artifacts"]:
        assert art["delta_ti"] <= 1e-5
        for client in ("node", "chromium"):
            web = art["web"][client]
            # (the held-out blocks fill the tiny model's positions: no decode rate to record here)
            assert web["passed"] and web["kl_mean"] is not None and web["error"] is None


def test_a_folder_of_the_layout_before_the_web_one_still_verifies(web_exports, tmp_path, capsys):
    d = _copy(web_exports("llama"), tmp_path / "exp")
    folder = d / "onnx-factorized"
    for name in ("model.onnx", "model.onnx_data", "interface.onnx"):
        (folder / "onnx" / name).rename(folder / name)
    (folder / "onnx").rmdir()
    manifest = json.loads((d / "manifest.json").read_text())
    for art in manifest["artifacts"]:
        art["files"] = {rel.replace("onnx-factorized/onnx/", "onnx-factorized/"): info
                        for rel, info in art["files"].items()}
    (d / "manifest.json").write_text(json.dumps(manifest))
    rehash(d)
    code, data = _verify(d, capsys, "--mode", "factorized", "--dtype", "float32")
    assert code == 0 and data["artifacts"][0]["passed"]


def test_web_checks_that_cannot_run_are_exit_2_before_any_work(web_exports, tmp_path, capsys, monkeypatch):
    out = web_exports("llama")
    assert main(["verify", str(out), "--no-record", "--web", "safari"]) == 2
    assert "unknown web client 'safari'" in capsys.readouterr().err
    monkeypatch.setenv(WEB_DIR_ENV, str(tmp_path / "no-web"))
    assert main(["verify", str(out), "--no-record", "--web", "node"]) == 2
    assert "scripts/setup_web.sh" in capsys.readouterr().err

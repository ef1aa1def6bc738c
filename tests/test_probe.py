"""Logit-lens traces through the head and both token interfaces."""

from __future__ import annotations

import json

import torch

from pit_deploy.cli import main
from pit_deploy.io.checkpoint import save_model
from pit_deploy.convert.conversion import convert_model
from pit_deploy.analysis.probe import logit_lens
from pit_deploy.tiny import tiny_model

IDS = torch.tensor([[5, 17, 300, 41, 99, 7]])


def test_pit_anchors_agree_at_every_layer(family: str) -> None:
    model = convert_model(tiny_model(family), "output")
    trace = logit_lens(model, IDS)
    assert len(trace.layers) == model.config.num_hidden_layers + 1
    assert trace.tying == "pit"
    assert trace.anchor_agreement == 1.0
    with torch.no_grad():
        final = model(IDS).logits[0, -1]
    assert trace.layers[-1].top_tokens[0] == f"<{int(final.argmax())}>"


def test_intermediate_readings_use_the_final_norm_and_head(family: str) -> None:
    """The last hidden state is already normed; the lens of an un-normed copy must match it."""
    model = tiny_model(family)
    trace = logit_lens(model, IDS, top_k=3)
    with torch.no_grad():
        out = model(IDS, output_hidden_states=True)
    probs = torch.softmax(out.logits[0, -1], -1)
    assert abs(trace.layers[-1].top_probs[0] - float(probs.max())) < 1e-6
    assert all(0.0 <= r.top_probs[0] <= 1.0 for r in trace.layers)


def test_cli_probe_json_and_plot(tmp_path, capsys) -> None:
    src = save_model(convert_model(tiny_model("llama")), tmp_path / "pit")
    png = tmp_path / "lens.png"
    assert main(["probe", str(src), "--ids", "5,17,300,41", "--json", "--plot", str(png)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["anchor_agreement"] == 1.0 and data["tying"] == "pit"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["probe", str(src), "--ids", "5,99999"]) == 2
    assert "within" in capsys.readouterr().err
    assert main(["probe", str(src)]) == 2  # no tokenizer saved: --prompt cannot be used
    assert "--ids" in capsys.readouterr().err

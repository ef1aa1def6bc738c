"""Logit-lens traces through the head and both token interfaces."""

from __future__ import annotations

import json

import pytest
import torch

from pit_deploy.cli import main
from pit_deploy.io.checkpoint import save_model
from pit_deploy.converters.conversion import convert_model
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


def test_every_reading_equals_the_model_cut_after_that_layer(family: str) -> None:
    """Reading ``i`` of the lens is what the model itself outputs when only its first ``i``
    blocks run (final norm, head and any logit scaling applied by the model's own forward)."""
    model = tiny_model(family).eval()
    trace = logit_lens(model, IDS, top_k=3)
    body = model.model if hasattr(model, "model") else model.transformer
    name = "layers" if hasattr(body, "layers") else "h"
    blocks = getattr(body, name)
    assert len(trace.layers) == len(blocks) + 1
    try:
        for i in range(len(blocks) + 1):
            setattr(body, name, torch.nn.ModuleList(list(blocks)[:i]))
            with torch.no_grad():
                top = torch.softmax(model(IDS).logits[0, -1].float(), -1).topk(3)
            assert trace.layers[i].top_probs == pytest.approx(top.values.tolist(), abs=1e-5), f"layer {i}"
            assert trace.layers[i].top_tokens == [f"<{t}>" for t in top.indices.tolist()], f"layer {i}"
    finally:
        setattr(body, name, blocks)


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

"""Conversion of every family into PIT models that still behave as PreTrainedModels."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from pit_deploy.io.checkpoint import WEIGHTS_NAME, load_pit_model, save_model
from pit_deploy.model.modules import PITEmbedding, PITHead
from pit_deploy.converters.conversion import convert_model
from pit_deploy.model.inspect import effective_interface, find_interface
from pit_deploy.converters.materialize import materialize_model
from pit_deploy.errors import PitError
from pit_deploy.tiny import tiny_model

IDS = torch.tensor([[5, 17, 300, 2, 41, 99, 7], [1, 1, 400, 3, 8, 256, 511]])


def _logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("t_init", ["identity", "input", "output"])
def test_effective_interface_is_exact(tiny, t_init: str) -> None:
    e0, _, tying = effective_interface(tiny)
    assert tying == "tied"
    convert_model(tiny, t_init)
    e, w, tying = effective_interface(tiny)
    assert tying == "pit"
    assert torch.linalg.matrix_norm(w @ e - torch.eye(e.shape[1], dtype=torch.float64)) < 1e-5
    if t_init == "input":  # multipliers (Granite) are folded in: the model sees E0 again
        assert (e - e0).norm() / e0.norm() < 1e-6
    if t_init == "output":
        assert (w - e0.T).norm() / e0.norm() < 1e-6


def test_input_init_reproduces_the_source_forward_input_side(tiny) -> None:
    """With T = H⁻¹ the embedding the decoder sees is the source one (multipliers included)."""
    source_emb = tiny.get_input_embeddings()(IDS).detach()
    convert_model(tiny, "input")
    pit_emb = tiny.get_input_embeddings()(IDS)
    assert torch.allclose(pit_emb, source_emb, atol=1e-5 * float(source_emb.abs().max()))


def test_modules_are_replaced_and_shared(tiny) -> None:
    convert_model(tiny)
    emb, head = tiny.get_input_embeddings(), tiny.get_output_embeddings()
    assert isinstance(emb, PITEmbedding) and isinstance(head, PITHead)
    assert emb.interface is head.interface is find_interface(tiny)
    keys = [k for k in tiny.state_dict() if "pit_interface" in k]
    assert sorted(keys) == ["pit_interface.L_diag", "pit_interface.L_offdiag", "pit_interface.Z"]
    assert tiny.config.tie_word_embeddings is False
    assert tiny.config.pit["t_init"] == "identity"


def test_generate_still_works(tiny) -> None:
    convert_model(tiny, "output")
    out = tiny.generate(IDS[:1, :4], max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 10)
    plain = materialize_model(tiny)
    out_plain = plain.generate(IDS[:1, :4], max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, out_plain)


def test_save_load_round_trip_is_bit_exact(tiny, tmp_path) -> None:
    convert_model(tiny, "output")
    save_model(tiny, tmp_path / "pit")
    loaded = load_pit_model(tmp_path / "pit")
    assert torch.equal(_logits(tiny), _logits(loaded))


def test_save_pretrained_round_trips_through_the_loader(tiny, tmp_path) -> None:
    convert_model(tiny, "input")
    tiny.save_pretrained(tmp_path / "hf")
    loaded = load_pit_model(tmp_path / "hf")
    assert torch.equal(_logits(tiny), _logits(loaded))


def test_checkpoint_stores_z_once(tiny, tmp_path) -> None:
    convert_model(tiny)
    save_model(tiny, tmp_path / "pit")
    v, d = 512, 64
    with safe_open(str(tmp_path / "pit" / WEIGHTS_NAME), "pt") as fh:
        shapes = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    big = [k for k, s in shapes.items() if s in ((v, d), (d, v))]
    assert big == ["pit_interface.Z"], f"V×d tensors on disk: {big}"
    config = json.loads((tmp_path / "pit" / "config.json").read_text())
    assert config["pit"]["family"] and config["tie_word_embeddings"] is False


@pytest.mark.parametrize("edit", ["drop", "extra", "reshape", "truncate"])
def test_a_checkpoint_that_does_not_match_its_config_is_refused(edit: str, tmp_path) -> None:
    """The loader reads tensor by tensor into the model; a tensor missing, extra, of another
    shape, or cut short is still a PitError naming the file, never a half-filled model."""
    from safetensors.torch import load_file, save_file

    model = tiny_model("llama")
    convert_model(model)
    save_model(model, tmp_path / "pit")
    weights = tmp_path / "pit" / WEIGHTS_NAME
    if edit == "truncate":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) - 4096])
    else:
        state = load_file(str(weights))
        name = next(k for k in state if k.endswith("mlp.up_proj.weight"))
        if edit == "drop":
            del state[name]
        elif edit == "extra":
            state["model.extra.weight"] = torch.zeros(2)
        else:
            state[name] = state[name][:-1].contiguous()
        save_file(state, str(weights), metadata={"format": "pt"})
    with pytest.raises(PitError, match=str(WEIGHTS_NAME)):
        load_pit_model(tmp_path / "pit")


def test_a_checkpoint_loads_every_tensor_as_saved(tmp_path) -> None:
    from safetensors.torch import load_file

    model = tiny_model("qwen3")
    convert_model(model)
    save_model(model, tmp_path / "pit")
    saved = load_file(str(tmp_path / "pit" / WEIGHTS_NAME))
    loaded = load_pit_model(tmp_path / "pit").state_dict()
    assert set(saved) == set(loaded)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert torch.equal(_logits(model), _logits(load_pit_model(tmp_path / "pit")))


def test_materialized_checkpoint_loads_with_plain_transformers(tiny, tmp_path) -> None:
    convert_model(tiny, "output")
    plain = materialize_model(tiny)
    assert find_interface(plain) is None
    save_model(plain, tmp_path / "plain")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", use_safetensors=True)
    assert not hasattr(reloaded.config, "pit")
    assert torch.equal(_logits(plain), _logits(reloaded))
    pit_logits, mat_logits = _logits(tiny), _logits(plain)
    rel = (pit_logits - mat_logits).norm() / pit_logits.norm()
    assert rel < 1e-5, f"materialized vs factorized PIT logits differ by {rel:.2e} (relative L2)"
    e, w, tying = effective_interface(reloaded)
    assert tying == "untied"
    assert torch.linalg.matrix_norm(w @ e - torch.eye(64, dtype=torch.float64)) < 1e-5


def test_untied_source_converts_from_input_embedding(caplog) -> None:
    model = tiny_model("llama", tie_word_embeddings=False)
    e0, _, tying = effective_interface(model)
    assert tying == "untied"
    with caplog.at_level("WARNING"):
        convert_model(model, "input")
    assert "untied" in caplog.text
    assert model.config.pit["source_tying"] == "untied"
    e, _, _ = effective_interface(model)
    assert (e - e0).norm() / e0.norm() < 1e-6


def test_non_finite_embedding_is_refused() -> None:
    model = tiny_model("llama")
    with torch.no_grad():
        model.get_input_embeddings().weight[3, 5] = float("nan")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(PitError, match="non-finite"):
        convert_model(model)
    assert find_interface(model) is None
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k].nan_to_num(), after[k].nan_to_num()) for k in before)


def test_converting_twice_is_refused(tiny) -> None:
    convert_model(tiny)
    with pytest.raises(PitError, match="already a PIT model"):
        convert_model(tiny)


def test_bf16_model_runs_under_autocast(tiny) -> None:
    convert_model(tiny)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        logits = tiny(IDS).logits
    assert torch.isfinite(logits).all()
    ref = _logits(tiny)
    rel = (logits.float() - ref).norm() / ref.norm()
    assert rel < 5e-2


@pytest.mark.parametrize("model_type", ["gemma", "mistral", "qwen2"])
def test_other_registered_layouts_convert(model_type: str) -> None:
    """Adapters registered beyond the four tested families convert exactly as well."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        model_type, vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = IDS.clamp(max=299)
    before = model.get_input_embeddings()(ids).detach()
    e0, _, _ = effective_interface(model)
    convert_model(model, "input")
    e, w, _ = effective_interface(model)
    assert (e - e0).norm() / e0.norm() < 1e-6
    assert torch.allclose(model.get_input_embeddings()(ids).detach(), before, atol=1e-5)
    assert torch.linalg.matrix_norm(w @ e - torch.eye(32, dtype=torch.float64)) < 1e-5
    assert torch.isfinite(_logits(model, ids)).all()

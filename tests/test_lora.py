"""LoRA through PEFT on a PIT model: trains, merges, merged logits equal the PEFT model's,
reload-then-compare, T trainable or frozen, bad targets."""

from __future__ import annotations

import pytest
import torch
from train_fixtures import config, make_corpus, make_pairs, read_metrics

from pit_deploy.io.checkpoint import load_pit_model, save_model
from pit_deploy.converters.conversion import convert_model
from pit_deploy.errors import PitError
from pit_deploy.training.lora import apply_lora, default_targets, merge
from pit_deploy.tiny import tiny_model, tiny_tokenizer
from pit_deploy.training.loop import train


@pytest.fixture(scope="module")
def pit_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    path = root / "pit"
    save_model(convert_model(tiny_model("llama"), "output"), path, tiny_tokenizer())
    return path, make_corpus(root), make_pairs(root)


def test_default_targets_are_attention_and_mlp():
    assert default_targets(tiny_model("llama")) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert default_targets(tiny_model("gpt2")) == ["c_attn", "c_fc", "c_proj"]


def test_merge_equals_peft_logits_and_reload(tmp_path):
    model = convert_model(tiny_model("llama"), "output")
    peft_model = apply_lora(model, rank=4, alpha=8, train_t=True)
    with torch.no_grad():  # give the adapters non-zero weights so the check means something
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    ids = torch.randint(3, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    peft_model.eval()
    with torch.no_grad():
        ref = peft_model(input_ids=ids).logits
        base_only = peft_model.get_base_model()
        with peft_model.disable_adapter():
            plain = peft_model(input_ids=ids).logits
    assert (ref - plain).abs().max() > 1e-3  # adapters change the output
    merged = merge(peft_model)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        got = merged(input_ids=ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    save_model(merged, tmp_path / "merged", tiny_tokenizer())
    reloaded = load_pit_model(tmp_path / "merged")
    with torch.no_grad():
        again = reloaded(input_ids=ids).logits
    torch.testing.assert_close(again, ref, rtol=1e-5, atol=1e-5)
    del base_only


def test_lora_trains_and_merges_through_train(tmp_path, pit_dir):
    path, corpus, pairs = pit_dir
    out = tmp_path / "lora"
    train(config(out, path, pairs, lora=True, lora_rank=4, lora_alpha=8, lora_train_t=True, merge=True,
                 steps=12, lr=1e-2, eval_every=12, val_fraction=0.25))
    evals = [r["val_loss"] for r in read_metrics(out) if r["kind"] == "eval"]
    assert evals[-1] < evals[0] - 0.3
    assert all(r["delta_ti"] <= 1e-5 for r in read_metrics(out) if r["kind"] == "train")
    merged = load_pit_model(out / "model")
    src = load_pit_model(path)
    # T trained, Z frozen, the linear layers changed by the merge, the rest as before
    assert not torch.equal(merged.pit_interface.L_diag, src.pit_interface.L_diag)
    assert torch.equal(merged.pit_interface.Z, src.pit_interface.Z)
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight, src.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(merged.model.norm.weight, src.model.norm.weight)


def test_lora_frozen_t_and_adapter_output(tmp_path, pit_dir):
    path, corpus, _ = pit_dir
    out = tmp_path / "adapter"
    train(config(out, path, corpus, lora=True, lora_rank=2, steps=2, eval_every=0, lora_targets=["q_proj", "v_proj"]))
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert not (out / "adapter" / "pit_interface.safetensors").exists()  # T frozen: nothing to add
    assert not (out / "model").exists()
    # merged, with T frozen: T (L), Z and the untargeted layers are bit for bit the source's
    merged_out = tmp_path / "merged"
    train(config(merged_out, path, corpus, lora=True, lora_rank=2, steps=2, eval_every=0, lr=1e-2,
                 lora_targets=["q_proj", "v_proj"], merge=True))
    merged, src = load_pit_model(merged_out / "model"), load_pit_model(path)
    for name in ("L_diag", "L_offdiag", "Z"):
        assert torch.equal(getattr(merged.pit_interface, name), getattr(src.pit_interface, name)), name
    attn, attn0 = merged.model.layers[0].self_attn, src.model.layers[0].self_attn
    assert not torch.equal(attn.q_proj.weight, attn0.q_proj.weight)
    assert not torch.equal(attn.v_proj.weight, attn0.v_proj.weight)
    assert torch.equal(attn.k_proj.weight, attn0.k_proj.weight)


def test_lora_target_matching_nothing(tmp_path, pit_dir):
    path, corpus, _ = pit_dir
    with pytest.raises(PitError, match="match no linear layer.*available: down_proj"):
        train(config(tmp_path / "x", path, corpus, lora=True, lora_targets=["qkv_proj"]))
    with pytest.raises(PitError, match="LM head"):
        apply_lora(tiny_model("llama"), targets=["lm_head"])

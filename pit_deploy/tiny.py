"""Tiny random models of each supported family, built in code (no network, no files).

Used by the test suites and by users who want to try the pipeline in seconds. Sizes are
small but keep the structure that matters: GQA for Llama/Qwen3/Granite/Gemma, Granite's
multipliers, Gemma's ``√d`` embedding scale and ``1 + w`` norms, GPT-2's learned positions,
tied embeddings.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    GPT2Config,
    GraniteConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
)

#: the families the export suites run on every runtime (ONNX, ExecuTorch, quantized ONNX)
FAMILIES: tuple[str, ...] = ("llama", "qwen3", "granite", "gpt2")
#: the families of the compact models people deploy on phones, with the structure that sets each
#: apart: SmolLM3 (a layer without rotary embeddings in every four), Phi-3/Phi-4-mini (fused
#: ``qkv_proj`` and ``gate_up_proj``, rotary on three quarters of each head, ``longrope``
#: scaling), Llama 3.2 (``llama`` with ``rope_type: llama3``)
DEPLOYED_FAMILIES: tuple[str, ...] = ("smollm3", "phi3", "llama3")
#: Gemma 2 and 3 in small: local (sliding-window) and global layers with a window the tests'
#: prompts pass, a norm on each block's outputs, Gemma 2's soft-capping, Gemma 3's query/key
#: norms and two rotary bases; their norms' gains are drawn away from 1, as trained ones are
#: (a fresh Gemma norm has gain exactly 1, which would hide what the post-norms do to a
#: conversion; :func:`_trained_scales`)
GEMMA_FAMILIES: tuple[str, ...] = ("gemma2", "gemma3")
#: every family :func:`tiny_config` builds. Gemma is tested by conversion (``--t-init
#: preserve`` included) but kept out of :data:`FAMILIES`: exporting it to ONNX and then to
#: ExecuTorch in one process fails (optimum's ONNX export leaves an instance ``forward`` on the
#: model, and torch.export then cannot resolve the constant Gemma builds in its forward, the
#: ``√d`` normalizer).
ALL_FAMILIES: tuple[str, ...] = FAMILIES + ("gemma",) + DEPLOYED_FAMILIES + GEMMA_FAMILIES


def tiny_config(
    family: str,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    max_positions: int = 128,
    tie_word_embeddings: bool = True,
) -> PretrainedConfig:
    """A small config of ``family`` (one of :data:`ALL_FAMILIES`)."""
    common = dict(vocab_size=vocab_size, tie_word_embeddings=tie_word_embeddings,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family in ("llama", "qwen3", "granite", "gemma"):
        llama_like = dict(
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max_positions,
            **common,
        )
        if family == "llama":
            return LlamaConfig(**llama_like)
        if family == "qwen3":
            return Qwen3Config(head_dim=hidden_size // 4, **llama_like)
        if family == "gemma":  # gelu_pytorch_tanh MLP, RMSNorm gain 1 + w, embeddings × √d
            return GemmaConfig(head_dim=hidden_size // 4, **llama_like)
        return GraniteConfig(
            embedding_multiplier=12.0, logits_scaling=4.0, residual_multiplier=0.22,
            attention_multiplier=0.0625, **llama_like,
        )
    if family in DEPLOYED_FAMILIES:
        return _deployed_config(family, vocab_size, hidden_size, num_layers, max_positions, common)
    if family in GEMMA_FAMILIES:
        return _gemma_config(family, hidden_size, num_layers, max_positions, common)
    if family == "gpt2":
        return GPT2Config(
            n_embd=hidden_size, n_layer=num_layers, n_head=4, n_positions=max_positions,
            **common,
        )
    raise ValueError(f"unknown tiny family {family!r}; choose one of {ALL_FAMILIES}")


def _deployed_config(family: str, vocab_size: int, hidden_size: int, num_layers: int, max_positions: int,
                     common: dict) -> PretrainedConfig:
    """The tiny configs of :data:`DEPLOYED_FAMILIES` (at least four layers, so that SmolLM3 has a
    layer without rotary embeddings where llama.cpp expects it, the fourth)."""
    from transformers import Phi3Config, SmolLM3Config

    layers = max(num_layers, 4)
    llama_like = dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions, **common)
    if family == "smollm3":
        return SmolLM3Config(no_rope_layer_interval=4, no_rope_layers=[int((i + 1) % 4 != 0) for i in range(layers)],
                             **llama_like)
    if family == "llama3":  # Llama 3.2 1B's rotary scaling, with an original context the prompts pass
        return LlamaConfig(rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                           **llama_like)
    # Phi-4-mini's shape in small: head size 64 (onnxruntime's GroupQueryAttention needs the rotary
    # half, 24, to be a multiple of 8), rotary on 3/4 of each head, longrope whose original context
    # is longer than what llama.cpp's default context and the tests use (below it, every runtime
    # takes the short factors, as transformers does), an MLP width whose fused gate_up rows differ
    # from the vocabulary (the onnxruntime-genai builder finds the head as the linear with V rows)
    rotary_half = 24
    return Phi3Config(
        **{**llama_like, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
           "intermediate_size": 192, "max_position_embeddings": 8192},
        partial_rotary_factor=0.75, original_max_position_embeddings=2048,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(rotary_half)],
                      "long_factor": [1.0 + 0.5 * i for i in range(rotary_half)]},
    )


#: the tiny Gemma models' sliding window: shorter than the verify prompts, so local layers mask
GEMMA_WINDOW = 16


def _gemma_config(family: str, hidden_size: int, num_layers: int, max_positions: int,
                  common: dict) -> PretrainedConfig:
    """The tiny configs of :data:`GEMMA_FAMILIES`: four layers or more, the last of every four
    global (Gemma 3 has one global layer in six, Gemma 2 one in two)."""
    from transformers import Gemma2Config, Gemma3TextConfig

    layers = max(num_layers, 4)
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)]
    shape = dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
                 query_pre_attn_scalar=hidden_size // 4, max_position_embeddings=max_positions,
                 sliding_window=GEMMA_WINDOW, layer_types=kinds, **common)
    if family == "gemma2":
        return Gemma2Config(attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **shape)
    return Gemma3TextConfig(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, **shape)


def _trained_scales(model: PreTrainedModel, seed: int) -> None:
    """Give a fresh Gemma 2/3 model norm gains away from 1, as training does: the pre-norms
    ``1 + w`` with ``w ~ U(−0.5, 1.5)``, the norms on the blocks' outputs ``U(0.03, 0.1)``, so
    that the token's own embedding row still carries the residual stream as in a tiny Llama. At
    unit post-norm gains the blocks' unit-size outputs swamp it and the tied head's logits are
    nearly flat (top-1 margins a tenth of a tiny Llama's): no quantized check could then say
    whether the top token survives."""
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
                param.copy_(torch.rand(param.shape, generator=gen) * 0.07 + 0.03 - 1.0)
            elif name.endswith("norm.weight"):
                param.copy_(torch.rand(param.shape, generator=gen) * 2.0 - 0.5)


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **kwargs) -> PreTrainedModel:
    """A randomly initialized tiny causal LM of ``family``, in eval mode."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **kwargs), dtype=dtype)
    if family in GEMMA_FAMILIES:
        _trained_scales(model, seed)
    return model.eval()


def tiny_pit_model(family: str, seed: int = 0, t_seed: int = 1, **kwargs) -> PreTrainedModel:
    """A tiny model of ``family`` converted to PIT with a perturbed, non-identity ``T``.

    A fresh conversion has ``T = I``, which would let a test pass that forgot to apply ``T``
    (or ``T⁻¹``) at all; the perturbation makes ``T`` dense and far from the identity.
    """
    from .converters.conversion import convert_model
    from .model.inspect import find_interface

    model = convert_model(tiny_model(family, seed=seed, **kwargs))
    interface = find_interface(model)
    gen = torch.Generator().manual_seed(t_seed)
    with torch.no_grad():
        interface.L_offdiag.add_(0.05 * torch.randn(interface.L_offdiag.shape, generator=gen))
        interface.L_diag.add_(0.3 * torch.randn(interface.L_diag.shape, generator=gen))
    return model


_WORDS = ("def class return import self for in if else while with as the of and to a is "
          "value name data model token train loss step print list dict").split()
#: the built-in text the tiny tokenizers are trained on
_CORPUS = [" ".join(_WORDS[(i * 7 + j) % len(_WORDS)] for j in range(12)) + "\n" for i in range(200)]


def tiny_tokenizer(vocab_size: int = 512, spread_to: int | None = None):
    """A byte-level BPE tokenizer trained in memory on a fixed built-in text (no files).

    Ids 0, 1, 2 are ``<pad>``, ``<s>``, ``</s>``, matching :func:`tiny_config`. Every byte is
    in the alphabet, so any text encodes. With ``spread_to``, the learned tokens move to the top
    ids of a ``spread_to``-entry vocabulary (the ids between are unused entries no text encodes
    to), so that text encodes to ids as large as a 262k-token vocabulary's: a model of
    ``vocab_size=spread_to`` then exercises ids past 65,535 (16 bits) in every runtime.
    Returns a ``PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    if spread_to is not None:
        tok = _spread(tok, spread_to)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def tiny_sentencepiece_tokenizer(vocab_size: int = 600):
    """A tokenizer in the form of Gemma's (a SentencePiece BPE model as Hugging Face converts it):
    spaces normalized to ``▁``, no pre-tokenizer, byte fallback to ``<0xNN>`` tokens, and a merge
    for every split of every piece into two pieces, in the pieces' order (what the conversion of
    a SentencePiece model lists). Ids 0–3 are ``<pad>``, ``<eos>``, ``<bos>``, ``<unk>``; the
    256 byte tokens follow. Trained in memory on the built-in text; returns a
    ``PreTrainedTokenizerFast`` that puts ``<bos>`` in front, as Gemma's does."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    merges = [[piece[:k], piece[k:]] for piece, _ in sorted(vocab.items(), key=lambda item: item[1])
              if piece not in specials for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
    spec["model"]["merges"] = merges
    spec["added_tokens"] = [t for t in spec["added_tokens"] if not t["content"].startswith("<0x")]
    for byte_token in specials[4:]:  # plain vocabulary entries, as in Gemma's tokenizer.json
        vocab.setdefault(byte_token, len(vocab))
    spec["decoder"] = json.loads(decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                                    decoders.Fuse()]).__getstate__())
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>")


def _spread(tok, size: int):
    """``tok`` with its non-special tokens renumbered to the top of a ``size``-entry vocabulary."""
    import json

    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    specials = {t["id"] for t in spec["added_tokens"]}
    learned = sorted((i, t) for t, i in vocab.items() if i not in specials)
    if size < len(vocab):
        raise ValueError(f"spread_to={size} is smaller than the tokenizer's {len(vocab)} tokens")
    first = size - len(learned)
    spread = {t: i for t, i in vocab.items() if i in specials}
    spread.update({t: first + k for k, (_, t) in enumerate(learned)})
    spread.update({f"<unused{i}>": i for i in range(len(specials), first)})
    spec["model"]["vocab"] = spread
    return Tokenizer.from_str(json.dumps(spec))


def widen_embedding_spectrum(model: PreTrainedModel, low: float = 5.0, high: float = 500.0,
                             final_gain: float = 0.01) -> PreTrainedModel:
    """Give a tiny Llama-layout model an input embedding of the default model's scale, in place.

    The embedding keeps its singular vectors; its singular values become geometrically spaced
    from ``high`` down to ``low`` (a tiny model's random table is nearly flat, about unit scale
    over ``√V``). After conversion ``T`` then has the scale and the spread of the default
    model's (``T = Rᵀ H⁻¹ R``: small eigenvalues), the regime where AdamW's fixed-size steps on
    ``L`` can drive ``T`` towards singular (``docs/training.md``, "Keeping T well conditioned").
    The final norm's gain is set to ``final_gain`` so that the tied head, now as large as the
    embedding, gives logits of a trained model's size rather than a loss in the hundreds.
    """
    from .model.families import adapter_for

    with torch.no_grad():
        weight = model.get_input_embeddings().weight
        u, s, vh = torch.linalg.svd(weight.detach().to(torch.float64), full_matrices=False)
        spread = torch.logspace(torch.log10(torch.tensor(high)), torch.log10(torch.tensor(low)), s.numel(),
                                dtype=torch.float64)
        weight.copy_(((u * spread) @ vh).to(weight.dtype))
        adapter_for(model.config).final_norm(model).weight.fill_(final_gain)
    return model

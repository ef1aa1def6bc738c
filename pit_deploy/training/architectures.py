"""From-scratch architectures: the paper's Llama-like models (Appendix, architecture table).

All share V = 32 000, gated GQA with ``d_head = 64`` and ``n_kv = n_h / 4``, a SwiGLU MLP and
a *parallel* block (attention and MLP read the same normalized input and both add to the
residual). Transformers' Cohere architecture is exactly that block shape (GQA, SwiGLU-style
gated MLP, ``x + attn(ln(x)) + mlp(ln(x))``), so the models are ``CohereForCausalLM`` with
``logit_scale = 1`` and tied embeddings (TT) — or a random-Stiefel PIT interface.

Deviation from the paper, stated plainly: its attention output is modulated by a learnable
*channel-wise* gate. A constant per-channel gate applied to the attention output before the
output projection is a diagonal matrix that ``o_proj`` absorbs (``W_o diag(g)``), so the model
family is unchanged and only the optimization parameterization differs; we do not add it
(it would need a custom module that stock ``transformers`` could not load). Cohere's
LayerNorm has a scale but no shift.

``llama-135m`` has the default model's sizes in the same block (from-scratch runs with the
default tokenizer); ``tiny`` is a small variant of the same shape for tests and quick trials.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from transformers import AutoModelForCausalLM, CohereConfig, PreTrainedModel

from ..errors import PitError

PAPER_VOCAB_SIZE = 32_000


@dataclass(frozen=True)
class ArchSpec:
    """Sizes of one Llama-like model (paper Appendix, architecture table)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 64
    max_positions: int = 1024  # the paper trains with 1K context
    vocab_size: int = PAPER_VOCAB_SIZE


ARCHITECTURES: dict[str, ArchSpec] = {
    a.name: a
    for a in (
        ArchSpec("llama-0.3b", 24, 1024, 16, 4, 2816),
        ArchSpec("llama-0.6b", 32, 1280, 20, 5, 3584),
        ArchSpec("llama-1.2b", 40, 1600, 24, 6, 4480),
        # the default model's sizes (SmolLM2-135M: 30 layers, d = 576, 9 heads of 64, 3 KV heads,
        # 49 152 tokens) in the paper's block, for from-scratch runs with the default tokenizer
        ArchSpec("llama-135m", 30, 576, 9, 3, 1536, max_positions=2048, vocab_size=49_152),
        ArchSpec("tiny", 2, 64, 4, 1, 192, head_dim=16, max_positions=256, vocab_size=512),
    )
}


def arch_config(name: str, vocab_size: int | None = None, **special_ids) -> CohereConfig:
    """The ``CohereConfig`` of architecture ``name``.

    Args:
        name: a key of :data:`ARCHITECTURES`.
        vocab_size: override (e.g. to fit a tokenizer larger than the paper's 32 000).
        special_ids: ``bos_token_id``/``eos_token_id``/``pad_token_id`` of the tokenizer.
    """
    try:
        a = ARCHITECTURES[name]
    except KeyError:
        raise PitError(f"unknown --arch {name!r}; choose one of {', '.join(ARCHITECTURES)}") from None
    return CohereConfig(
        vocab_size=vocab_size or a.vocab_size,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        head_dim=a.head_dim,
        max_position_embeddings=a.max_positions,
        logit_scale=1.0,
        tie_word_embeddings=True,
        use_qk_norm=False,
        hidden_act="silu",
        **{"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **special_ids},
    )


def build_model(name: str, vocab_size: int | None = None, seed: int = 0, **special_ids) -> PreTrainedModel:
    """A freshly initialized (seeded) model of architecture ``name``, FP32, tied embeddings."""
    config = arch_config(name, vocab_size, **special_ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.pit_arch = asdict(ARCHITECTURES[name])
    return model


def parameter_count(model: PreTrainedModel) -> int:
    """Number of distinct parameters (shared tensors counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())

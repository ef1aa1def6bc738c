"""One small adapter per model family, registered by ``config.model_type``.

An adapter knows what a generic ``PreTrainedModel`` API does not say: which multipliers turn
the stored embedding and head into the *effective* token interface, and where the final norm
and the decoder blocks live (for logit-lens probes). The embedding and head modules
themselves are found through ``get_input_embeddings`` / ``get_output_embeddings``.

Effective interface, in the row-vector convention ``logits = h W_out``::

    E_eff     = embedding_multiplier · E_stored
    W_out_eff = logits_multiplier · W_headᵀ

e.g. Granite multiplies embeddings by ``config.embedding_multiplier`` and divides logits by
``config.logits_scaling`` (``GraniteModel.forward`` / ``GraniteForCausalLM.forward`` in
transformers); Gemma scales embeddings by ``sqrt(hidden_size)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel


def _one(_: PretrainedConfig) -> float:
    return 1.0


def _llama_norm(model: PreTrainedModel) -> nn.Module:
    return model.model.norm


def _llama_layers(model: PreTrainedModel) -> nn.ModuleList:
    return model.model.layers


@dataclass(frozen=True)
class FamilyAdapter:
    """What pit_deploy needs to know about one architecture family."""

    name: str
    model_types: tuple[str, ...]
    embedding_multiplier: Callable[[PretrainedConfig], float] = field(default=_one)
    logits_multiplier: Callable[[PretrainedConfig], float] = field(default=_one)
    final_norm: Callable[[PreTrainedModel], nn.Module] = field(default=_llama_norm)
    layers: Callable[[PreTrainedModel], nn.ModuleList] = field(default=_llama_layers)


LLAMA = FamilyAdapter("llama", ("llama", "mistral", "qwen2"))
QWEN3 = FamilyAdapter("qwen3", ("qwen3",))
GRANITE = FamilyAdapter(
    "granite",
    ("granite",),
    embedding_multiplier=lambda c: float(getattr(c, "embedding_multiplier", 1.0)),
    logits_multiplier=lambda c: 1.0 / float(getattr(c, "logits_scaling", 1.0)),
)
GEMMA = FamilyAdapter(
    "gemma", ("gemma",), embedding_multiplier=lambda c: math.sqrt(c.hidden_size)
)
GPT2 = FamilyAdapter(
    "gpt2",
    ("gpt2",),
    final_norm=lambda m: m.transformer.ln_f,
    layers=lambda m: m.transformer.h,
)

# Cohere multiplies logits by ``config.logit_scale`` (CohereForCausalLM.forward); it is the
# base of the paper's parallel-block Llama-like models (pit_deploy.train.architectures).
COHERE = FamilyAdapter(
    "cohere", ("cohere",), logits_multiplier=lambda c: float(getattr(c, "logit_scale", 1.0))
)

_REGISTRY: dict[str, FamilyAdapter] = {}


def register_family(adapter: FamilyAdapter) -> FamilyAdapter:
    """Register ``adapter`` for each of its ``model_types`` (a new family is one call)."""
    for model_type in adapter.model_types:
        _REGISTRY[model_type] = adapter
    return adapter


for _adapter in (LLAMA, QWEN3, GRANITE, GEMMA, GPT2, COHERE):
    register_family(_adapter)


def supported_model_types() -> list[str]:
    """Sorted ``model_type`` values that have an adapter."""
    return sorted(_REGISTRY)


def adapter_for(config: PretrainedConfig) -> FamilyAdapter:
    """The adapter registered for ``config.model_type``.

    Raises:
        KeyError: with a message naming the supported types, when there is none.
    """
    model_type = getattr(config, "model_type", None)
    try:
        return _REGISTRY[model_type]
    except KeyError:
        raise KeyError(
            f"unsupported architecture {model_type!r}: pit_deploy supports "
            f"{', '.join(supported_model_types())}"
        ) from None


def max_positions(config: PretrainedConfig) -> int | None:
    """The longest sequence the architecture supports (its position table), or ``None`` if the
    config names no limit."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None

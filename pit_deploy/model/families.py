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
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # the registry itself loads no torch: `pit-deploy list` reads it at once
    from torch import nn
    from transformers import PretrainedConfig, PreTrainedModel


#: the body linears of a Llama-layout block, by name (what the quantization schemes name)
LLAMA_ROLES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: fused projections (Phi-3's own linears; onnxruntime-genai's builder packs ``qkv_proj`` for
#: Llama-layout models too) and the Llama-layout linears whose output rows each stacks, in order
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                                 "gate_up_proj": ("gate_proj", "up_proj")}
#: the fused projections whose parts are equal shares of their rows (``qkv_proj``'s are not under
#: grouped-query attention), so a runtime may hold each part as a tensor of its own
EQUAL_SPLITS: tuple[str, ...] = ("gate_up_proj",)


def split_part(name: str) -> tuple[str, int, int] | None:
    """``(fused linear path, index, parts)`` when ``name`` names one part of an equal-split fused
    projection (``model.layers.0.mlp.gate_proj`` → ``("model.layers.0.mlp.gate_up_proj", 0, 2)``),
    else ``None``."""
    parent, _, leaf = name.rpartition(".")
    for fused in EQUAL_SPLITS:
        parts = FUSED_PROJECTIONS[fused]
        if leaf in parts:
            return (f"{parent}.{fused}" if parent else fused), parts.index(leaf), len(parts)
    return None


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
    #: this family's name of each body linear named by its Llama-layout role (``q_proj``,
    #: ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``) where it
    #: differs (a last name or a dotted suffix of the module path, as ``int4_8bit_layers`` takes
    #: them); a role missing from a family that renames its linears has no linear of its own there
    projections: dict[str, str] = field(default_factory=dict)
    #: the models a user would bring, in words (``pit-deploy list families``, the README)
    covers: str = ""
    #: the source's embedding *module* applies ``embedding_multiplier`` itself (Gemma 3's scaled
    #: word embedding) instead of the model's forward: the PIT embedding that replaces it then
    #: returns the effective rows, while exported tables stay ``E_eff / multiplier`` as the
    #: runtimes' Gemma graphs multiply by it
    scale_in_embedding: bool = False
    #: each block normalizes its attention and MLP outputs with a gain of their own before they
    #: join the residual stream (Gemma 2 and 3), so no residual rotation is a symmetry of the body
    post_norms: bool = False

    def module_embedding_multiplier(self, config: PretrainedConfig) -> float:
        """What the model's forward multiplies its embedding module's output by: the family's
        ``embedding_multiplier``, or 1 where the module applies it itself
        (:attr:`scale_in_embedding`). A module that stands in for the embedding divides the
        effective rows by this."""
        return 1.0 if self.scale_in_embedding else self.embedding_multiplier(config)

    def linear_names(self, roles: tuple[str, ...] | list[str]) -> tuple[str, ...]:
        """``roles`` (the quantization schemes' Llama-layout names, ``("v_proj", "down_proj")``) as
        this family names those linears (GPT-2: ``("attn.c_attn", "mlp.c_proj")``), de-duplicated;
        a name that is not a bare role (``layers.3.mlp.down_proj``) is kept as it is."""
        if not self.projections:
            return tuple(dict.fromkeys(roles))
        out = [self.projections.get(name) if name in LLAMA_ROLES else name for name in roles]
        return tuple(dict.fromkeys(name for name in out if name))


LLAMA = FamilyAdapter("llama", ("llama", "mistral", "qwen2"),
                      covers="Llama 2 to 3.2 with Llama 3's llama3 rotary scaling, Mistral, Qwen2 and 2.5, SmolLM2")
QWEN3 = FamilyAdapter("qwen3", ("qwen3",), covers="Qwen3, dense")
GRANITE = FamilyAdapter(
    "granite",
    ("granite",),
    embedding_multiplier=lambda c: float(getattr(c, "embedding_multiplier", 1.0)),
    logits_multiplier=lambda c: 1.0 / float(getattr(c, "logits_scaling", 1.0)),
    covers="Granite 3, dense",
)
GEMMA = FamilyAdapter(
    "gemma", ("gemma",), embedding_multiplier=lambda c: math.sqrt(c.hidden_size),
    covers="the first Gemma (Gemma 2 and 3 are the gemma2 and gemma3 families)",
)
#: Gemma 2: local/global sliding-window layers, attention and final-logit soft-capping, and a norm
#: on each block's attention and MLP output before the residual add
GEMMA2 = FamilyAdapter(
    "gemma2", ("gemma2",), embedding_multiplier=lambda c: math.sqrt(c.hidden_size), post_norms=True,
    covers="Gemma 2 (2B, 9B)",
)
#: Gemma 3's text decoder: Gemma 2's blocks with per-head query/key norms instead of soft-capping,
#: two rotary bases (local and global layers), and the √d scale inside the embedding module
GEMMA3 = FamilyAdapter(
    "gemma3", ("gemma3_text",), embedding_multiplier=lambda c: math.sqrt(c.hidden_size), post_norms=True,
    scale_in_embedding=True, covers="Gemma 3 text models (270M, 1B)",
)
SMOLLM3 = FamilyAdapter("smollm3", ("smollm3",), covers="SmolLM3")
#: Phi-3 and Phi-4-mini: a Llama-layout block with query, key and value in one ``qkv_proj`` and the
#: MLP's gate and up projections in one ``gate_up_proj`` (``Phi3MLP``: gate rows first)
PHI3 = FamilyAdapter(
    "phi3", ("phi3",),
    projections={"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
                 "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"},
    covers="Phi-3-mini and -medium, Phi-3.5-mini, Phi-4-mini, with longrope",
)
GPT2 = FamilyAdapter(
    "gpt2",
    ("gpt2",),
    final_norm=lambda m: m.transformer.ln_f,
    layers=lambda m: m.transformer.h,
    # GPT-2's Conv1D linears: query, key and value in one ``attn.c_attn``, the attention output
    # ``attn.c_proj``, the MLP ``mlp.c_fc`` (no gate) and ``mlp.c_proj``
    projections={"q_proj": "attn.c_attn", "k_proj": "attn.c_attn", "v_proj": "attn.c_attn",
                 "o_proj": "attn.c_proj", "up_proj": "mlp.c_fc", "down_proj": "mlp.c_proj"},
    covers="GPT-2",
)

# Cohere multiplies logits by ``config.logit_scale`` (CohereForCausalLM.forward); it is the
# base of the paper's parallel-block Llama-like models (pit_deploy.training.architectures).
COHERE = FamilyAdapter(
    "cohere", ("cohere",), logits_multiplier=lambda c: float(getattr(c, "logit_scale", 1.0)),
    covers="Cohere-layout parallel blocks, the training studies' from-scratch models",
)

_REGISTRY: dict[str, FamilyAdapter] = {}


def register_family(adapter: FamilyAdapter) -> FamilyAdapter:
    """Register ``adapter`` for each of its ``model_types`` (a new family is one call)."""
    for model_type in adapter.model_types:
        _REGISTRY[model_type] = adapter
    return adapter


for _adapter in (LLAMA, QWEN3, GRANITE, GEMMA, GEMMA2, GEMMA3, SMOLLM3, PHI3, GPT2, COHERE):
    register_family(_adapter)


def families() -> list[FamilyAdapter]:
    """Every registered adapter, once each, in registration order."""
    return list({id(a): a for a in _REGISTRY.values()}.values())


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
            f"unsupported architecture {model_type!r}: pit_deploy supports the model types "
            f"{', '.join(supported_model_types())} (`pit-deploy list families` says which models each covers)"
        ) from None


def max_positions(config: PretrainedConfig) -> int | None:
    """The longest sequence the architecture supports (its position table), or ``None`` if the
    config names no limit."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def body_linears(model: nn.Module) -> list[str]:
    """Module paths of the model's body linears (``nn.Linear`` and GPT-2's ``Conv1D``; not the
    head, not the PIT interface): what ``int4_8bit_layers`` names."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [name for name, module in model.named_modules()
            if isinstance(module, (nn.Linear, Conv1D)) and module is not head and "pit_" not in name]


def skeleton(config: PretrainedConfig) -> PreTrainedModel:
    """The plain model of ``config`` built on the meta device (no memory, no weights): its module
    names without loading a checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


"""Assembling a PIT model: install the interface into a Hugging Face causal LM, the ``pit``
block of its config, and an empty PIT model for loaders to fill.

The ``pit`` config block is part of the checkpoint format (``docs/conventions.md``): it records
the family, the ``T`` init, how ``Z`` was made, the source's tying and the :class:`PITSpec`.
"""

from __future__ import annotations

import copy
from dataclasses import asdict
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.modeling_utils import no_init_weights

from .core import PITInterface, PITSpec
from .families import FamilyAdapter, adapter_for
from .modules import INTERFACE_ATTR, PIT_CONFIG_KEY, PITEmbedding, PITHead

PIT_FORMAT_VERSION = 1


def install_interface(
    model: PreTrainedModel, interface: PITInterface, adapter: FamilyAdapter, pit_block: dict
) -> PreTrainedModel:
    """Replace embedding and head of ``model`` (in place) by PIT modules sharing ``interface``."""
    cfg = model.config
    old_head = model.get_output_embeddings()
    bias = getattr(old_head, "bias", None) if old_head is not None else None
    setattr(model, INTERFACE_ATTR, interface)
    model.set_input_embeddings(PITEmbedding(interface, adapter.module_embedding_multiplier(cfg)))
    model.set_output_embeddings(PITHead(interface, adapter.logits_multiplier(cfg), bias))
    # Never let transformers re-tie the head to the embedding (it would assign a `.weight`).
    cfg.tie_word_embeddings = False
    if getattr(cfg, "text_config", None) is not None:
        cfg.text_config.tie_word_embeddings = False
    setattr(cfg, PIT_CONFIG_KEY, pit_block)
    return model


def pit_config_block(
    spec: PITSpec,
    *,
    t_init: str,
    init: str,
    source_tying: str,
    source: dict[str, Any] | None,
    adapter: FamilyAdapter,
) -> dict[str, Any]:
    """The ``pit`` block stored in ``config.json`` of a PIT checkpoint."""
    return {
        "format_version": PIT_FORMAT_VERSION,
        "family": adapter.name,
        "t_init": t_init,
        "init": init,
        "source_tying": source_tying,
        "source": source or {},
        **asdict(spec),
    }


def spec_from_block(block: dict[str, Any]) -> PITSpec:
    """Rebuild the :class:`PITSpec` recorded in a ``pit`` config block."""
    fields = PITSpec.__dataclass_fields__
    return PITSpec(**{k: block[k] for k in fields if k in block})


def empty_pit_model(config, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A PIT model with the architecture of ``config`` (which has a ``pit`` block), weights
    uninitialized; for loaders that fill it from a state dict."""
    block = getattr(config, PIT_CONFIG_KEY)
    config = copy.deepcopy(config)
    adapter = adapter_for(config)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    v, d = model.get_input_embeddings().weight.shape
    spec = spec_from_block(block)
    interface = PITInterface(torch.empty(v, d, dtype=dtype), torch.eye(d), spec, copy=False)
    return install_interface(model, interface, adapter, block)

"""Run in a child process by :func:`pit_deploy.targets.onnx_genai.export.run_builder`: correct
four gaps of onnxruntime-genai's model builder 0.18.0 under transformers 4.57, then run the
builder's ``__main__`` with the arguments given.

* The builder iterates ``config.rope_scaling``, which is ``None`` for the default rotary
  embedding: the builder's copy of the config is given ``{"rope_type": "default"}``, the same
  rotary embedding (written into ``config.json`` instead, Phi-3's config class would refuse it).

* The builder imports ``Qwen3_5ForConditionalGeneration`` and
  ``Qwen3_5MoeForConditionalGeneration``, which transformers 4.57 does not have (they are used
  only for those architectures): stand-ins are put in their place.
* SmolLM3's layers without rotary embeddings (``no_rope_layers[i] == 0``): the builder turns
  off the rotation fused into ``GroupQueryAttention`` there, then adds a separate
  ``RotaryEmbedding`` node reading a ``position_ids`` input that the fused setting removed, so
  the build fails on the CPU (and would rotate a layer the model does not rotate). The layer's
  rotary embedding is turned off as a whole, which is what the model computes.
* Phi-3's ``longrope`` settings: transformers 4.57 keeps the rotary type under ``type`` (its
  ``Phi3Config`` refuses any fourth key), the builder reads ``rope_type``: the builder's copy of
  the settings is given both.

Standard library and the builder only; this file is executed as a script's text, not imported.
"""

import runpy
import sys

import transformers

for _name in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
    if not hasattr(transformers, _name):
        setattr(transformers, _name, type(_name, (), {}))

import onnxruntime_genai.models  # noqa: E402,F401 — puts the builder's own folder on sys.path
import builders.base as base  # noqa: E402 — the builder's modules, as the builder imports them
import builders.phi as phi  # noqa: E402
import builders.smollm as smollm  # noqa: E402

_config_init = base.Model.make_config_init


def _default_rope_config_init(self, config):
    if getattr(config, "rope_scaling", {}) is None:
        config.rope_scaling = {"rope_type": "default"}
    _config_init(self, config)


_smollm3_attention = smollm.SmolLM3Model.make_attention
_longrope_init = phi.Phi3MiniLongRoPEModel.make_rope_init


def _nope_attention(self, layer_id, attention, root_input, **kwargs):
    rope = self.attention_attrs["rope"]
    self.attention_attrs["rope"] = rope and bool(self.no_rope_layers[layer_id])
    try:
        _smollm3_attention(self, layer_id, attention, root_input, **kwargs)
    finally:
        self.attention_attrs["rope"] = rope


def _longrope_rope_init(self, config):
    params = config.rope_parameters
    if "rope_type" not in params and "type" in params:
        params["rope_type"] = params["type"]
    _longrope_init(self, config)


base.Model.make_config_init = _default_rope_config_init
smollm.SmolLM3Model.make_attention = _nope_attention
phi.Phi3MiniLongRoPEModel.make_rope_init = _longrope_rope_init
sys.argv = ["onnxruntime_genai.models.builder", *sys.argv[1:]]
runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)

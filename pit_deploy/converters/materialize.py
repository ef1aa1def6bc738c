"""Materialization: a PIT model back to a vanilla, untied Hugging Face model.

``E = Z T⁻¹`` and ``W_out = T Zᵀ`` are computed in float64 and stored as plain weights
(``docs/export.md``, "materialized" mode): any standard tool loads the result.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.modeling_utils import no_init_weights

from ..errors import PitError
from ..model.families import adapter_for
from ..model.inspect import find_interface, unwrap_model
from ..model.modules import INTERFACE_ATTR, PIT_CONFIG_KEY


@torch.no_grad()
def materialize_model(model: PreTrainedModel, dtype: torch.dtype | None = None,
                      share_body: bool = False) -> PreTrainedModel:
    """A new, vanilla untied model with ``E = Z T⁻¹`` and ``W_out = T Zᵀ`` as plain weights.

    Computed in float64 from ``(Z, T)`` by row chunks and cast once to ``dtype`` (default: the model's), with
    the family multipliers undone so that the *effective* interface is exactly PIT's. The
    result has no project modules: plain ``transformers`` saves and loads it.

    The new model takes the two tables as they are computed (no second copy of either) and
    copies the body, unless ``share_body``: then each body tensor already in ``dtype`` is the
    model's own data under the new model's ``Parameter`` — for an exporter, which never writes
    into its input's weights, not for a model that is trained or edited afterwards.
    """
    base = unwrap_model(model)
    interface = find_interface(base)
    if interface is None:
        raise PitError("materialize needs a PIT model; this one has plain embeddings")
    dtype = dtype or interface.Z.dtype
    config = copy.deepcopy(base.config)
    if hasattr(config, PIT_CONFIG_KEY):
        delattr(config, PIT_CONFIG_KEY)
    config.tie_word_embeddings = False
    adapter = adapter_for(config)
    with no_init_weights():
        plain = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    def body(v: torch.Tensor) -> torch.Tensor:  # the model's tensor where shared and already right, else a copy
        if not v.is_floating_point():
            return v if share_body else v.clone()
        return v.to(dtype, copy=not share_body)

    state = {k: body(v) for k, v in base.state_dict().items() if not k.startswith(INTERFACE_ATTR + ".")}
    emb_name = _param_name(plain, plain.get_input_embeddings().weight)
    head_name = _param_name(plain, plain.get_output_embeddings().weight)
    state[emb_name], state[head_name] = interface.materialized_rows(
        dtype, adapter.embedding_multiplier(config), adapter.logits_multiplier(config))
    head_bias = getattr(base.get_output_embeddings(), "bias", None)
    if head_bias is not None:
        state[head_name.rsplit(".", 1)[0] + ".bias"] = head_bias.detach().to(dtype, copy=not share_body)
    # assign: the new model's (never written, so never resident) tensors are replaced, not copied into
    plain.load_state_dict(state, strict=True, assign=True)
    plain.eval()
    return plain


def _param_name(model: nn.Module, param: torch.Tensor) -> str:
    for name, p in model.named_parameters(remove_duplicate=False):
        if p is param:
            return name
    raise LookupError("parameter not found in model")

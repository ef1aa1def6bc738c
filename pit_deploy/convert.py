"""Turn a Hugging Face causal LM into a PIT model, and a PIT model back into a vanilla one.

A converted model is still the same ``PreTrainedModel`` class (``generate`` and the rest keep
working): its input embedding is replaced by :class:`PITEmbedding`, its head by
:class:`PITHead`, and one :class:`~pit_deploy.core.PITInterface` is registered on the model as
``pit_interface``. Embedding and head keep an unregistered reference to it, so the state dict
holds ``Z`` and ``L`` exactly once and no ``V×d`` tensor is duplicated on disk.

Family multipliers (see :mod:`pit_deploy.families`) are folded in so that the *effective*
interface is the PIT one: the embedding module returns ``Z T⁻¹ / m`` because the model then
multiplies by ``m``; the head returns ``(h T) Zᵀ / c`` because the model then multiplies
logits by ``c``.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import asdict
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.modeling_utils import no_init_weights

from .core import PITInterface, PITSpec, identity_defect, init_from_embedding, init_random
from .errors import PitError
from .families import FamilyAdapter, adapter_for

log = logging.getLogger(__name__)

INTERFACE_ATTR = "pit_interface"
PIT_CONFIG_KEY = "pit"
PIT_FORMAT_VERSION = 1


class PITEmbedding(nn.Module):
    """Drop-in for ``nn.Embedding``: ``ids ↦ (Z T⁻¹)[ids] / m`` through the shared interface."""

    def __init__(self, interface: PITInterface, multiplier: float = 1.0):
        super().__init__()
        object.__setattr__(self, "_interface", interface)  # shared, registered on the model
        self.multiplier = float(multiplier)

    @property
    def interface(self) -> PITInterface:
        return self._interface

    @property
    def num_embeddings(self) -> int:
        return self._interface.vocab_size

    @property
    def embedding_dim(self) -> int:
        return self._interface.hidden_size

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self._interface.embed(input_ids)
        return out if self.multiplier == 1.0 else out / self.multiplier

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, multiplier={self.multiplier}"


class PITHead(nn.Module):
    """Drop-in for the LM head: ``h ↦ (h T) Zᵀ / c (+ bias)`` through the shared interface."""

    def __init__(
        self, interface: PITInterface, multiplier: float = 1.0, bias: torch.Tensor | None = None
    ):
        super().__init__()
        object.__setattr__(self, "_interface", interface)
        self.multiplier = float(multiplier)
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None

    @property
    def interface(self) -> PITInterface:
        return self._interface

    @property
    def in_features(self) -> int:
        return self._interface.hidden_size

    @property
    def out_features(self) -> int:
        return self._interface.vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self._interface.logits(hidden)
        if self.multiplier != 1.0:
            out = out / self.multiplier
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, multiplier={self.multiplier}, bias={self.bias is not None}"


# --------------------------------------------------------------------------------------
# Inspecting a model
# --------------------------------------------------------------------------------------


def find_interface(model: nn.Module) -> PITInterface | None:
    """The model's :class:`PITInterface`, or ``None`` for a plain model (PEFT wrappers too)."""
    for module in model.modules():
        if isinstance(module, PITInterface):
            return module
    return None


def tying_of(model: PreTrainedModel) -> str:
    """``pit``, ``tied`` (embedding and head share storage) or ``untied``."""
    if find_interface(model) is not None:
        return "pit"
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        return "tied"
    return "tied" if head.weight is emb or head.weight.data_ptr() == emb.data_ptr() else "untied"


@torch.no_grad()
def effective_interface(model: PreTrainedModel) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``(E_eff (V, d), W_out_eff (d, V), tying)`` in float64, multipliers folded in.

    For a PIT model ``E`` and ``W_out`` come from ``(Z, T)`` (float64 solve); for a plain model
    from its stored weights. Works on PEFT-wrapped models.
    """
    base = unwrap_model(model)
    interface = find_interface(base)
    if interface is not None:
        e, w = interface.materialize()
        return e, w, "pit"
    adapter = adapter_for(base.config)
    m = adapter.embedding_multiplier(base.config)
    c = adapter.logits_multiplier(base.config)
    emb = _whole(base.get_input_embeddings().weight).to(torch.float64) * m
    head_w = _whole(base.get_output_embeddings().weight).to(torch.float64)
    return emb, head_w.T * c, tying_of(base)


def interface_delta_ti(model: PreTrainedModel) -> float:
    """``‖W_out E − I‖_F`` of a model's effective interface (float64); ~1e-7 for PIT."""
    e, w, _ = effective_interface(model)
    return identity_defect(e, w)


def _whole(weight: torch.Tensor) -> torch.Tensor:
    """The full tensor of a parameter, gathering it if FSDP sharded it (a collective call:
    every process must reach it)."""
    weight = weight.detach()
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight


def unwrap_model(model: nn.Module) -> PreTrainedModel:
    """The underlying ``PreTrainedModel`` of a PEFT ``PeftModel`` (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model  # type: ignore[return-value]


# --------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Raise :class:`PitError` if ``tensor`` holds NaN or Inf."""
    if not torch.isfinite(tensor).all():
        bad = int((~torch.isfinite(tensor)).sum())
        raise PitError(
            f"{name} has {bad} non-finite value(s) (NaN/Inf); the checkpoint is corrupt or was "
            "saved after a diverged run — use an earlier checkpoint"
        )


def install_interface(
    model: PreTrainedModel, interface: PITInterface, adapter: FamilyAdapter, pit_block: dict
) -> PreTrainedModel:
    """Replace embedding and head of ``model`` (in place) by PIT modules sharing ``interface``."""
    cfg = model.config
    old_head = model.get_output_embeddings()
    bias = getattr(old_head, "bias", None) if old_head is not None else None
    setattr(model, INTERFACE_ATTR, interface)
    model.set_input_embeddings(PITEmbedding(interface, adapter.embedding_multiplier(cfg)))
    model.set_output_embeddings(PITHead(interface, adapter.logits_multiplier(cfg), bias))
    # Never let transformers re-tie the head to the embedding (it would assign a `.weight`).
    cfg.tie_word_embeddings = False
    if getattr(cfg, "text_config", None) is not None:
        cfg.text_config.tie_word_embeddings = False
    setattr(cfg, PIT_CONFIG_KEY, pit_block)
    return model


def convert_model(
    model: PreTrainedModel,
    t_init: str = "identity",
    spec: PITSpec = PITSpec(),
    source: dict[str, Any] | None = None,
) -> PreTrainedModel:
    """Convert a plain causal LM (tied or untied) into a PIT model, in place.

    ``Z`` is the polar factor of the *effective* input embedding ``E0`` and ``T`` follows
    ``t_init`` (see :func:`pit_deploy.core.init_from_embedding`). An untied source converts
    from its input embedding; its separate head is discarded, which is logged and recorded
    in the ``pit`` config block as ``source_tying: untied``.

    Raises:
        PitError: unsupported architecture, non-finite or rank-deficient embedding, a model
            that is already PIT.
    """
    if find_interface(model) is not None:
        raise PitError("the model is already a PIT model; nothing to convert")
    try:
        adapter = adapter_for(model.config)
    except KeyError as exc:
        raise PitError(str(exc.args[0])) from None
    e_eff, w_eff, tying = effective_interface(model)
    check_finite("the input embedding", e_eff)
    if tying == "untied":
        check_finite("the output head", w_eff)
        log.warning(
            "source model has an untied head: converting from its input embedding; the "
            "separate head weights are discarded"
        )
    try:
        interface = init_from_embedding(e_eff, t_init, spec)
    except ValueError as exc:
        raise PitError(f"cannot convert the embedding: {exc}") from None
    interface = interface.to(model.get_input_embeddings().weight.dtype)
    block = pit_config_block(
        spec, t_init=t_init, init="polar", source_tying=tying, source=source, adapter=adapter
    )
    install_interface(model, interface, adapter, block)
    interface.to(next(model.parameters()).device)
    return model


def from_scratch(model: PreTrainedModel, generator: torch.Generator | None = None,
                 spec: PITSpec = PITSpec(), method: str = "qr") -> PreTrainedModel:
    """Give a freshly initialized model a random-Stiefel PIT interface (``T = I``), in place."""
    adapter = adapter_for(model.config)
    v, d = model.get_input_embeddings().weight.shape
    interface = init_random(v, d, generator, method, spec)  # type: ignore[arg-type]
    block = pit_config_block(spec, t_init="identity", init=f"random-{method}",
                             source_tying="none", source=None, adapter=adapter)
    return install_interface(model, interface, adapter, block)


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
    interface = PITInterface(torch.empty(v, d, dtype=dtype), torch.eye(d), spec)
    return install_interface(model, interface, adapter, block)


# --------------------------------------------------------------------------------------
# Materialization: a vanilla untied Hugging Face model
# --------------------------------------------------------------------------------------


@torch.no_grad()
def materialize_model(model: PreTrainedModel, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """A new, vanilla untied model with ``E = Z T⁻¹`` and ``W_out = T Zᵀ`` as plain weights.

    Computed in float64 from ``(Z, T)`` and cast once to ``dtype`` (default: the model's), with
    the family multipliers undone so that the *effective* interface is exactly PIT's. The
    result has no project modules: plain ``transformers`` saves and loads it.
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
    state = {
        k: v
        for k, v in base.state_dict().items()
        if not k.startswith(INTERFACE_ATTR + ".")
    }
    e, w = interface.materialize()
    emb_name = _param_name(plain, plain.get_input_embeddings().weight)
    head_name = _param_name(plain, plain.get_output_embeddings().weight)
    state[emb_name] = (e / adapter.embedding_multiplier(config)).to(dtype)
    state[head_name] = (w.T / adapter.logits_multiplier(config)).to(dtype)
    head_bias = getattr(base.get_output_embeddings(), "bias", None)
    if head_bias is not None:
        state[head_name.rsplit(".", 1)[0] + ".bias"] = head_bias.detach().to(dtype)
    plain.load_state_dict(state, strict=True)
    plain.eval()
    return plain


def _param_name(model: nn.Module, param: torch.Tensor) -> str:
    for name, p in model.named_parameters(remove_duplicate=False):
        if p is param:
            return name
    raise LookupError("parameter not found in model")

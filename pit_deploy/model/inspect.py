"""Inspecting a model's token interface: is it PIT, tied or untied, and what are its
effective ``E`` and ``W_out`` (multipliers folded in, float64)?

Definitions: ``docs/definitions.md``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from ..errors import PitError
from .core import PITInterface
from .quantized_interface import identity_defect
from .families import adapter_for
from .modules import PITEmbedding


def find_interface(model: nn.Module) -> PITInterface | None:
    """The model's :class:`PITInterface`, or ``None`` for a plain model (PEFT wrappers too)."""
    for module in model.modules():
        if isinstance(module, PITInterface):
            return module
    return None


def is_pit(model: nn.Module) -> bool:
    """Whether ``model`` (or the model a PEFT wrapper holds) has a trainable PIT interface.

    The one test of "is this PIT?" for a model in memory; a directory on disk is tested by
    :func:`pit_deploy.io.checkpoint.is_pit_directory` (its config has a ``pit`` block).
    """
    return find_interface(model) is not None


def tying_of(model: PreTrainedModel) -> str:
    """``pit``, ``tied`` (embedding and head share storage) or ``untied``."""
    if is_pit(model) or isinstance(model.get_input_embeddings(), PITEmbedding):
        return "pit"  # trainable, or the export-time factorized constants
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
    """``‖W_out E − I‖_F`` of a model's effective interface (float64); ~1e-7 for PIT.

    A PIT model's is computed from ``d×d`` work (``T (ZᵀZ − I) T⁻¹``,
    :meth:`~pit_deploy.model.core.PITInterface.conditioning`): materializing ``E`` and
    ``W_out`` in float64 would take 2.7 GB for a 262k-token vocabulary at d = 640."""
    interface = find_interface(unwrap_model(model))
    if interface is not None and hasattr(interface, "conditioning"):
        return interface.conditioning().delta_ti
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


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Raise :class:`PitError` if ``tensor`` holds NaN or Inf."""
    if not torch.isfinite(tensor).all():
        bad = int((~torch.isfinite(tensor)).sum())
        raise PitError(
            f"{name} has {bad} non-finite value(s) (NaN/Inf); the checkpoint is corrupt or was "
            "saved after a diverged run — use an earlier checkpoint"
        )


#: elements a finiteness check looks at per step: ``torch.isfinite`` of a whole 262k-token table
#: made temporaries of 1.1 GB
FINITE_CHUNK = 1 << 22


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds no NaN/Inf, looked at :data:`FINITE_CHUNK` elements at a time."""
    flat = tensor.detach().reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + FINITE_CHUNK]).all()) for i in range(0, flat.numel(), FINITE_CHUNK))


def check_model_finite(model: nn.Module) -> None:
    """Raise :class:`PitError` naming the first parameter or buffer with NaN/Inf."""
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point() and not all_finite(tensor):
            check_finite(name, tensor.detach())

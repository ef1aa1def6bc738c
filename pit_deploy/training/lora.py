"""LoRA adaptation of a (PIT or plain) causal LM through PEFT.

LoRA goes on the attention and MLP linear layers only. The token interface is never put in
``modules_to_save``: PEFT would copy the embedding and head and silently untie them. For a
PIT model, ``T`` (the ``L`` factors) and optionally ``Z`` can be trained next to the adapters
as ordinary parameters of the base model; merging folds the adapters into the linear weights
and leaves the PIT interface (with its trained ``T``) as it is, so the merged model is a
plain PIT checkpoint.
"""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel

from ..model.inspect import find_interface
from ..errors import PitError
from ..model.families import adapter_for


def _is_linear(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

    return isinstance(module, (nn.Linear, Conv1D))


def default_targets(model: PreTrainedModel) -> list[str]:
    """Names (last path component) of every linear layer inside the decoder blocks.

    For Llama-like models: ``q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj``;
    for GPT-2: ``c_attn, c_proj, c_fc``. The embedding and head are never included.
    """
    layers = adapter_for(model.config).layers(model)
    names = {name.rsplit(".", 1)[-1] for name, m in layers.named_modules() if name and _is_linear(m)}
    return sorted(names)


def apply_lora(
    model: PreTrainedModel,
    rank: int = 8,
    alpha: float = 16.0,
    targets: list[str] | None = None,
    dropout: float = 0.0,
    train_t: bool = False,
    train_z: bool = False,
):
    """Wrap ``model`` in a PEFT LoRA model; returns the ``PeftModel``.

    Args:
        model: a causal LM, PIT or plain.
        rank, alpha, dropout: LoRA hyper-parameters.
        targets: module names to adapt (default: :func:`default_targets`).
        train_t: keep the PIT ``L`` factors (``T``) trainable.
        train_z: keep ``Z`` trainable (retract after each step).

    Raises:
        PitError: a target that matches no linear layer, or ``train_t``/``train_z`` on a
            model without a PIT interface.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise PitError("--lora needs the package peft: pip install 'pit-deploy[train]'") from None
    if rank < 1:
        raise PitError(f"--lora-rank must be at least 1, got {rank}")
    available = default_targets(model)
    targets = list(targets) if targets else available
    linear_names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if _is_linear(m)}
    missing = [t for t in targets if t not in linear_names]
    if missing:
        raise PitError(
            f"LoRA target(s) {', '.join(missing)} match no linear layer of this model; "
            f"available: {', '.join(available)}"
        )
    head = model.get_output_embeddings()
    for t in targets:  # refuse anything that would wrap the token interface
        for name, m in model.named_modules():
            if name.rsplit(".", 1)[-1] == t and m is head:
                raise PitError(f"LoRA target {t!r} is the LM head; adapt attention/MLP layers only")
    interface = find_interface(model)
    if (train_t or train_z) and interface is None:
        raise PitError("--lora-train-t/--train-z need a PIT model; convert it first or use --tying pit")
    config = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    if interface is not None:
        interface.L_offdiag.requires_grad_(train_t)
        interface.L_diag.requires_grad_(train_t)
        interface.Z.requires_grad_(train_z)
    return peft_model


def merge(peft_model) -> PreTrainedModel:
    """Fold the adapters into the base weights; returns the plain (or PIT) base model."""
    return peft_model.merge_and_unload()

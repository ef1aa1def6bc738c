"""FSDP for models that do not fit one device: ``pit-deploy train --fsdp`` under torchrun.

Uses PyTorch's per-parameter sharding (``torch.distributed.fsdp.fully_shard``, "FSDP2"): each
decoder block is one shard group and the root module another, so a block's weights are
gathered only while it runs.

The PIT interface (``Z``, ``L``) is *not* sharded (``ignored_params``): the polar retraction of
``Z``, the ``d×d`` Cholesky factor and the logged ``delta_ti`` need it whole, and ``Z`` is frozen
by default (no optimizer state). Its gradients are averaged across processes by hand
(:func:`average_replicated_grads`). Gradient clipping therefore sees a mix of sharded
(``DTensor``) and replicated gradients: :func:`clip_grad_norm` sums the squared norms of the
shards over processes and adds the replicated ones once.

Checkpoints and the final model are written from *full* state dicts gathered on every process
(``torch.distributed.checkpoint.state_dict``), so a checkpoint of an FSDP run is an ordinary
safetensors file.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from ..model.families import adapter_for


def shard_model(model: nn.Module, keep_whole: Iterable[nn.Parameter] = ()) -> nn.Module:
    """Shard ``model`` in place: every decoder block, then the root; ``keep_whole`` replicated."""
    from torch.distributed.fsdp import fully_shard

    for block in adapter_for(model.config).layers(model):
        fully_shard(block)
    ignored = set(keep_whole)
    fully_shard(model, ignored_params=ignored or None)
    return model


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


def average_replicated_grads(params: Iterable[nn.Parameter], world: int) -> None:
    """All-reduce (mean) the gradients of parameters FSDP does not manage."""
    for p in params:
        if p.grad is not None and not _is_dtensor(p.grad):
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(world)


@torch.no_grad()
def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients (sharded and replicated), clipped to ``max_norm``.

    Returns the norm before clipping, like ``torch.nn.utils.clip_grad_norm_``.
    """
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g.to_local() for g in grads if _is_dtensor(g)]
    replicated = [g for g in grads if not _is_dtensor(g)]
    sq_sharded = sum((g.float().pow(2).sum() for g in sharded), torch.zeros(()))
    dist.all_reduce(sq_sharded, op=dist.ReduceOp.SUM)
    sq_replicated = sum((g.float().pow(2).sum() for g in replicated), torch.zeros(()))
    total = (sq_sharded + sq_replicated).sqrt()
    if math.isfinite(max_norm) and float(total) > max_norm:
        scale = max_norm / (float(total) + 1e-6)
        for g in grads:
            g.mul_(scale)
    return total


def full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Full (unsharded) model and optimizer state dicts on CPU; every process must call it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (get_model_state_dict(model, options=options),
            get_optimizer_state_dict(model, optimizer, options=options))


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a full optimizer state dict written by :func:`full_state_dicts` into a sharded run."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def unsharded_model(config, state: dict[str, torch.Tensor]) -> nn.Module:
    """An ordinary (unsharded) model of ``config`` holding the full ``state`` (PIT or plain)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import no_init_weights

    from ..model.modules import PIT_CONFIG_KEY
    from ..model.pit_model import empty_pit_model

    if hasattr(config, PIT_CONFIG_KEY):
        model = empty_pit_model(config)
    else:
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state, strict=True)
    return model.eval()

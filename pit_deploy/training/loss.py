"""Training losses, as sums over trained tokens.

The loop divides by the number of trained tokens of the whole accumulated (and, under
``torchrun``, global) batch, as torchtune does: with prompt/completion masks micro-batches hold
different numbers of trained tokens, and a per-micro-batch mean would weigh a micro-batch with
three trained tokens like one with three hundred (``docs/training.md``, "Batches").
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def token_nll_sum(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over tokens with ``mask = 1``; logits ``(B, L, V)``,
    targets/mask ``(B, L)``."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    return (ce * mask.flatten()).sum()


def token_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean cross-entropy (nats per trained token)."""
    return token_nll_sum(logits, targets, mask) / mask.sum().clamp_min(1.0)


def distill_kl_sum(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor,
                   temperature: float) -> torch.Tensor:
    """Sum over masked tokens of ``KL(p_teacher ‖ p_student)`` at ``temperature``, times ``T²``
    (Hinton et al., 2015, so gradients keep their scale as the temperature changes)."""
    s = F.log_softmax(student.float() / temperature, dim=-1)
    t = F.log_softmax(teacher.float() / temperature, dim=-1)
    kl = (t.exp() * (t - s)).sum(-1)
    return (kl * mask).sum() * temperature**2

"""The embedding and head modules of a PIT model: one pair, used by training and by export.

:class:`PITEmbedding` and :class:`PITHead` replace a model's input embedding and LM head. Both
keep an *unregistered* reference to one :class:`~pit_deploy.model.core.PITInterface`, which is
registered once on the model as ``pit_interface``; the state dict therefore holds ``Z`` and
``L`` exactly once and no ``V×d`` tensor is duplicated on disk.

Family multipliers (see :mod:`pit_deploy.model.families`) are folded in so that the
*effective* interface is the PIT one: the embedding module returns ``Z T⁻¹ / m`` because the
model then multiplies by ``m``; the head returns ``(h T) Zᵀ / c`` because the model then
multiplies logits by ``c``.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

INTERFACE_ATTR = "pit_interface"
PIT_CONFIG_KEY = "pit"


class TokenInterface(Protocol):
    """What the embedding and head read: the trainable :class:`~pit_deploy.model.core.PITInterface`
    or the export-time constants (``pit_deploy.exporters.passes.PITFactors``)."""

    vocab_size: int
    hidden_size: int

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...



class PITEmbedding(nn.Module):
    """Drop-in for ``nn.Embedding``: ``ids ↦ (Z T⁻¹)[ids] / m`` through the shared interface."""

    def __init__(self, interface: TokenInterface, multiplier: float = 1.0):
        super().__init__()
        object.__setattr__(self, "_interface", interface)  # shared, registered on the model
        self.multiplier = float(multiplier)

    @property
    def interface(self) -> TokenInterface:
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
        self, interface: TokenInterface, multiplier: float = 1.0, bias: torch.Tensor | None = None
    ):
        super().__init__()
        object.__setattr__(self, "_interface", interface)
        self.multiplier = float(multiplier)
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None

    @property
    def interface(self) -> TokenInterface:
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

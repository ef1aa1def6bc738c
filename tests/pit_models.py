"""Tiny PIT checkpoints with a dense, non-identity ``T`` (a converted tiny model's ``T`` is close
to the identity, which would hide a wrong correction), shared by the quantized-export tests."""

from __future__ import annotations

from pathlib import Path

import torch

from pit_deploy.convert.conversion import convert_model
from pit_deploy.io.checkpoint import save_model
from pit_deploy.model.inspect import find_interface
from pit_deploy.tiny import tiny_model


def dense_t_pit_dir(family: str, root: Path) -> Path:
    """A tiny PIT checkpoint of ``family`` with a dense, non-identity ``T``, saved under ``root``."""
    model = convert_model(tiny_model(family))
    it = find_interface(model)
    with torch.no_grad():
        it.L_diag.add_(0.3 * torch.randn(it.L_diag.shape, generator=torch.Generator().manual_seed(0)))
        it.L_offdiag.add_(0.05 * torch.tril(torch.randn(it.L_offdiag.shape,
                                                        generator=torch.Generator().manual_seed(1)), -1))
    out = root / f"pit-{family}"
    save_model(model, out)
    return out

"""Tiny PIT checkpoints shared by the tests: with a dense, non-identity ``T`` (a converted tiny
model's ``T`` is close to the identity, which would hide a wrong correction) for the
quantized-export tests, and each family converted as ``convert`` does by default, with the
export-then-verify step, for the family tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pit_deploy.converters.conversion import convert_model
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


def converted_families(root: Path, families) -> dict:
    """Each family's tiny source (with the tiny tokenizer) converted under ``root`` as ``convert``
    does by default: ``{family: Conversion}``."""
    from pit_deploy.api import convert
    from pit_deploy.tiny import tiny_tokenizer

    out = {}
    for family in families:
        save_model(tiny_model(family), root / family, tiny_tokenizer())
        out[family] = convert(root / family, root / f"{family}-pit", calib_tokens=512, say=None)
    return out


def export_verify(src: Path, out: Path, runtime: str, *args: str) -> dict:
    """``export`` (tiny-ci recipe) then ``verify``, both exit 0; the manifest written."""
    from pit_deploy.cli import main

    assert main(["export", str(src), "--out", str(out), "--runtime", runtime, "--recipe", "tiny-ci", *args]) == 0
    assert main(["verify", str(out)]) == 0
    return json.loads((out / "manifest.json").read_text())

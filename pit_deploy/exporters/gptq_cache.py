"""Calibrated rounding codes kept between exports, keyed by everything that determines them.

GPTQ of the default model's body takes about a minute per weight grid on two cores
(:mod:`.calibrated_rounding`); an export of the same checkpoint again — another target, a run
resumed after an interruption, a second `run` with other bench settings — would redo it for the
same codes. So the codes of each grid are kept in the user's cache (:mod:`pit_deploy.io.cache_dir`,
subfolder ``gptq/``), one entry per :func:`codes_key`:

* the body GPTQ rounds — every parameter and buffer of the model as given (after the residual
  rotation where the scheme rotates it), by name, dtype, shape and bytes;
* the calibration blocks (their token ids);
* the grid and the scheme's settings that choose it (bits, group, 8-bit layers, symmetry);
* the code of :mod:`.calibrated_rounding` itself (its source's SHA-256) and the torch and NumPy
  versions that computed the codes.

A change in any of them is another entry, so a cached entry is only ever the codes this checkout
would compute. An entry holds one safetensors file (codes as int8/uint8, scales float32, zero
points) and a record of the key and the file's digest; one that does not match is recomputed,
never used. ``PIT_DEPLOY_CACHE=off`` turns the cache off.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..io.cache_dir import cache_root, cached_folder, entry_valid
from . import calibrated_rounding
from .calibrated_rounding import RoundedWeight, RoundingGrid

META = "pit_gptq_cache.json"
CODES = "codes.safetensors"


@functools.lru_cache(maxsize=1)
def _code_version() -> str:
    return hashlib.sha256(Path(calibrated_rounding.__file__).read_bytes()).hexdigest()


def codes_key(body: nn.Module, blocks: list[torch.Tensor], setting: str) -> str:
    """SHA-256 of what determines the codes (see the module's docstring); ``setting`` names the
    grid and the scheme's settings that choose it."""
    h = hashlib.sha256()
    h.update(json.dumps({"code": _code_version(), "torch": torch.__version__, "numpy": np.__version__,
                         "setting": setting}, sort_keys=True).encode())
    for name, tensor in sorted({**dict(body.named_parameters()), **dict(body.named_buffers())}.items()):
        t = tensor.detach().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        _hash_bytes(h, t)
    for block in blocks:
        h.update(b"block|")
        h.update(block.detach().to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()


def _hash_bytes(h, t: torch.Tensor, part_bytes: int = 16 << 20) -> None:
    """Feed ``t``'s C-order bytes to ``h`` a slice of its first axis at a time: a transposed view
    (a factorized model's ``Zᵀ``, 671 MB at a 262k vocabulary) is never copied whole, and a
    contiguous slice is read in place."""
    if t.numel() == 0:
        return
    t = t.reshape(1) if t.dim() == 0 else t
    step = max(1, part_bytes // max(1, t[0].numel() * t.element_size()))
    for part in torch.split(t, step, dim=0):
        h.update(part.contiguous().reshape(-1).view(torch.uint8).numpy())


def _folder(root: Path, key: str) -> Path:
    return root / "gptq" / key[:32]


def load_codes(key: str) -> dict[str, RoundedWeight] | None:
    """The codes cached under ``key``, or ``None`` (no cache, no entry, or one that does not match)."""
    root = cache_root()
    if root is None:
        return None
    folder = _folder(root, key)
    if not folder.is_dir() or not entry_valid(folder, META, {"key": key}):
        return None
    from safetensors import SafetensorError, safe_open

    codes = {}
    try:
        meta = json.loads((folder / META).read_text())
        with safe_open(str(folder / CODES), framework="pt") as f:
            for name, grid in meta["grids"].items():
                codes[name] = RoundedWeight(
                    codes=f.get_tensor(f"{name}.codes").to(torch.int16), scales=f.get_tensor(f"{name}.scales"),
                    zeros=f.get_tensor(f"{name}.zeros"), grid=RoundingGrid(**grid))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, SafetensorError):
        return None  # a record that does not describe its file: computed again, never used
    return codes


def store_codes(key: str, codes: dict[str, RoundedWeight]) -> Path | None:
    """Keep ``codes`` under ``key``; the entry, or ``None`` when the cache is off or not writable."""
    root = cache_root()
    if root is None or not codes:
        return None
    from safetensors.torch import save_file

    def build(tmp: Path) -> None:
        tensors = {}
        for name, r in codes.items():
            small = torch.int8 if r.grid.qmin >= -128 and r.grid.qmax <= 127 else torch.uint8
            tensors[f"{name}.codes"] = r.codes.to(small).contiguous()
            tensors[f"{name}.scales"] = r.scales.contiguous()
            tensors[f"{name}.zeros"] = r.zeros.contiguous()
        save_file(tensors, str(tmp / CODES))

    grids = {name: {"bits": r.grid.bits, "group": r.grid.group, "symmetric": r.grid.symmetric}
             for name, r in codes.items()}
    return cached_folder(_folder(root, key), META, {"key": key, "grids": grids}, {"key": key}, build,
                         "calibrated rounding codes")

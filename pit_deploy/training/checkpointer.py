"""Run state on disk: ``OUT/checkpoints/step-NNNNNNN/`` and the ``LATEST`` pointer.

A checkpoint holds what a resumed run needs to continue bit for bit: the weights
(``model.safetensors``), the optimizer state (``optimizer.pt``, tensors only), the random
generators and gradient scaler (``rng.pt``) and ``state.json`` (step, tokens, the data stream's
position, the run's options). Each is written into a temporary directory that is renamed into
place when complete (``io.fs.atomic_directory``), so a killed process never leaves a checkpoint
that looks complete. Resuming still checks every file: the newest checkpoint that loads
completely wins, and each one skipped is named with the reason (a disk that filled up, a file
truncated by hand).

``torch.load`` is always called with ``weights_only=True``: a checkpoint never runs code.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import PitError
from ..io.fs import atomic_directory, write_text_atomic

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LATEST = "LATEST"
FILES = ("model.safetensors", "optimizer.pt", "rng.pt", "state.json")


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class LoadedCheckpoint:
    """A checkpoint read completely into memory (weights stay on disk: safetensors maps them)."""

    path: Path
    state: dict[str, Any]  # state.json
    optimizer: dict[str, Any]
    extra: dict[str, Any]  # rng.pt: {"rng": ..., "scaler": ...}

    @property
    def weights(self) -> Path:
        return self.path / "model.safetensors"


def _candidates(run: Path) -> list[Path]:
    """Checkpoints of ``run``, newest first: the one ``LATEST`` names, then every other by step.
    A ``LATEST`` that points outside ``checkpoints/`` is a tampered run (exit 2)."""
    root = run / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    steps = sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True)
    pointer = root / LATEST
    if pointer.is_file():
        named = (root / pointer.read_text(encoding="utf-8", errors="replace").strip()).resolve()
        if named.parent != root.resolve():
            raise PitError(f"{pointer} points outside {root} ({named}); the run directory was tampered "
                           "with: fix or delete LATEST")
        if named.is_dir():
            steps = [named] + [p for p in steps if p.resolve() != named]
    return steps


def _read(path: Path, device: torch.device | str) -> LoadedCheckpoint:
    """Every file of one checkpoint, or an exception that says what is wrong with it."""
    for name in FILES:
        if not (path / name).is_file():
            raise ValueError(f"{name} is missing")
    state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    if not isinstance(state, dict) or not {"step", "tokens", "data", "config"} <= state.keys():
        raise ValueError("state.json lacks step, tokens, data or config")
    size = (path / "model.safetensors").stat().st_size
    with open(path / "model.safetensors", "rb") as fh:
        header = int.from_bytes(fh.read(8), "little")
        meta = json.loads(fh.read(header))
    end = max((v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"), default=0)
    if 8 + header + end > size:
        raise ValueError(f"model.safetensors is truncated ({size} of {8 + header + end} bytes)")
    optimizer = torch.load(path / "optimizer.pt", map_location=device, weights_only=True)
    extra = torch.load(path / "rng.pt", weights_only=True)
    return LoadedCheckpoint(path=path, state=state, optimizer=optimizer, extra=extra)


def latest_checkpoint(run: str | Path) -> Path | None:
    """The newest checkpoint directory with a ``state.json`` (no full read), or ``None``."""
    return next((p for p in _candidates(Path(run)) if (p / "state.json").is_file()), None)


def load_latest(run: str | Path, device: torch.device | str = "cpu") -> LoadedCheckpoint:
    """The newest checkpoint of ``run`` that loads completely; warns about each one skipped.

    Raises:
        PitError: no checkpoint loads (each one's problem is named).
    """
    run = Path(run)
    problems = []
    for path in _candidates(run):
        try:
            loaded = _read(path, device)
        except Exception as exc:  # any unreadable file: try the next older checkpoint
            problems.append(f"{path.name}: {exc}")
            log.warning("skipping checkpoint %s: %s", path.name, exc)
            continue
        if problems:
            log.warning("resuming from the older checkpoint %s", path.name)
        return loaded
    if not problems:
        raise PitError(f"--resume: {run} holds no checkpoint (expected {run}/{CHECKPOINT_DIR}/step-*/); "
                       "start a new run without --resume")
    raise PitError(f"--resume: no checkpoint of {run} loads completely ({'; '.join(problems)}); "
                   "start a new run without --resume")


def save_checkpoint(run: Path, step: int, weights: dict[str, torch.Tensor] | torch.nn.Module,
                    optimizer_state: dict[str, Any], extra: dict[str, Any], state: dict[str, Any],
                    keep: int) -> Path:
    """Write ``step-NNNNNNN`` atomically, point ``LATEST`` at it, keep the newest ``keep``."""
    from safetensors.torch import save_file, save_model

    from ..io.checkpoint import unique_tensors

    root = run / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:07d}"
    with atomic_directory(root / name, force=True) as tmp:
        if isinstance(weights, torch.nn.Module):
            save_model(weights, str(tmp / "model.safetensors"))
        else:  # gathered copies of tied weights no longer share storage: keep the first name
            save_file(unique_tensors(weights), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(extra, tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step, **state}))
    write_text_atomic(root / LATEST, name)
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return root / name

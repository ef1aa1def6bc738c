"""Saving and loading model directories: safetensors only, atomic writes, file digests.

A PIT checkpoint is a Hugging Face-style directory: ``config.json`` with a ``pit`` block,
``model.safetensors`` holding ``pit_interface.Z``, ``pit_interface.L_offdiag``,
``pit_interface.L_diag`` and the transformer weights (no embedding or head tensor), the
generation config and the tokenizer. Directories are written to a temporary sibling and
renamed into place, so an interrupted save never leaves a directory that looks complete.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, PreTrainedModel

from ..errors import PitError
from ..model.modules import PIT_CONFIG_KEY
from ..model.pit_model import empty_pit_model
from .config_sizes import check_config_sizes
from .fs import atomic_directory
from .tensor_file import read_into

WEIGHTS_NAME = "model.safetensors"


def save_model(
    model: PreTrainedModel,
    out: str | os.PathLike,
    tokenizer=None,
    force: bool = False,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write ``model`` (PIT or plain) and its tokenizer to ``out`` atomically, as safetensors.

    Tensors that share storage (a tied plain model) are stored once, under the embedding's
    name; ``tie_word_embeddings`` in the config restores the sharing on load.
    """
    with atomic_directory(out, force) as tmp:
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(tmp)
        save_file(unique_tensors(model.state_dict()), str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)
        for fname, text in (extra_files or {}).items():
            (tmp / fname).write_text(text)
    return Path(out)


def save_tokenizer(tokenizer, out: str | os.PathLike) -> None:
    """``tokenizer.save_pretrained(out)``, without copying a GGUF file as ``tokenizer.model``.

    A tokenizer loaded from a GGUF file keeps that file as its ``vocab_file``; the default
    save then writes the whole GGUF (weights included: the whole model file) as a "slow"
    ``tokenizer.model`` that is not a SentencePiece model at all. For such tokenizers only the
    fast ``tokenizer.json`` format is written (``legacy_format=False``), which is what
    ``AutoTokenizer`` loads.
    """
    vocab_file = getattr(tokenizer, "vocab_file", None)
    from_gguf = False
    if isinstance(vocab_file, (str, os.PathLike)) and Path(vocab_file).is_file():
        with open(vocab_file, "rb") as fh:
            from_gguf = fh.read(4) == b"GGUF"
    if from_gguf and getattr(tokenizer, "is_fast", False):
        tokenizer.save_pretrained(out, legacy_format=False)
    else:
        tokenizer.save_pretrained(out)


def compact_tokenizer_json(folder: str | os.PathLike) -> int:
    """Rewrite ``folder/tokenizer.json`` without the indentation ``save_pretrained`` gives it;
    returns the bytes saved (0 when the folder has no such file or it is kept as it is).

    The same JSON value, so every tokenizer reads the same vocabulary, merges and rules; a
    byte-level BPE vocabulary's pretty-printed form is more than half whitespace (SmolLM2's
    3.5 MB file is 1.6 MB without it), and an artifact folder ships the file to the device. A
    file that does not parse, or whose strings cannot be written back as UTF-8 (an escaped lone
    surrogate), is left alone: the runtime's own check reports what is wrong with it.
    """
    from .fs import write_text_atomic

    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return 0
    old = path.read_bytes()
    try:
        text = json.dumps(json.loads(old), ensure_ascii=False, separators=(",", ":"))
        new = text.encode("utf-8")
    except (ValueError, UnicodeError):
        return 0
    if len(new) >= len(old):
        return 0
    write_text_atomic(path, text)
    return len(old) - len(new)


def unique_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with tensors that share storage (tied weights) kept once, contiguous, on CPU.

    safetensors refuses shared tensors; the first name wins (the embedding, in module order).
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().contiguous().cpu()
    return out


def read_config_dict(path: str | os.PathLike) -> dict | None:
    """``config.json`` of a directory as a dict, or ``None`` if absent."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return None
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except ValueError as exc:  # not JSON, or not text at all (UnicodeDecodeError)
        raise PitError(f"{cfg} is not valid JSON ({exc}); the checkpoint is corrupt") from None
    if not isinstance(data, dict):
        raise PitError(f"{cfg} is not a JSON object; the checkpoint is corrupt")
    return data


def load_config(path: str | os.PathLike, trust_remote_code: bool = False, require_adapter: bool = True) -> Any:
    """The ``AutoConfig`` of model directory ``path`` (with ``require_adapter``: of a family
    pit-deploy supports). The sizes of a supported family's config are checked against the
    checkpoint's safetensors headers before anything is built (:mod:`.config_sizes`).

    Raises:
        PitError: a ``config.json`` that transformers cannot read (an unknown ``model_type``,
            a malformed value) or of a family without an adapter — unusable input, naming the
            supported families; a size that is not a positive integer or disagrees with the
            checkpoint, naming the field.
    """
    from ..model.families import adapter_for, supported_model_types

    where = Path(path) / "config.json"
    model_type = (read_config_dict(path) or {}).get("model_type")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        said = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0][:200]
        raise PitError(f"{where}: transformers cannot read this config of model_type {model_type!r} ({said}); "
                       f"pass a model of a family pit-deploy supports: {', '.join(supported_model_types())}") from None
    try:
        adapter_for(config)
    except KeyError as exc:
        if require_adapter:
            raise PitError(f"{where}: {exc.args[0]}") from None
        return config  # the caller refuses the family with its own message
    check_config_sizes(config, path)
    return config


def is_pit_directory(path: str | os.PathLike) -> bool:
    cfg = read_config_dict(path)
    return bool(cfg and PIT_CONFIG_KEY in cfg)


def load_pit_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a PIT checkpoint written by :func:`save_model` (or ``save_pretrained``).

    The state dict must match the architecture exactly; a missing or extra tensor is an
    error, not a silently re-initialized weight.
    """
    path = Path(path)
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise PitError(f"{path} has no {WEIGHTS_NAME}; it is not a complete PIT checkpoint")
    config = load_config(path)
    model = empty_pit_model(config, dtype)
    expected = model.state_dict()
    try:
        # safe_open checks the header and the file's length; the bytes then go straight into the
        # model's own storage (tensor_file): a second copy, or the file's pages mapped, would cost
        # the model's size again (1 GB at a 262k-token vocabulary)
        with safe_open(str(weights), framework="pt") as handle:
            names = list(handle.keys())
            missing, unexpected = sorted(set(expected) - set(names)), sorted(set(names) - set(expected))
            if missing or unexpected:
                raise PitError(
                    f"{weights} does not match its config: missing {missing[:3]}, unexpected "
                    f"{unexpected[:3]}; the checkpoint is incomplete or from another model"
                )
            shapes = {k: tuple(handle.get_slice(k).get_shape()) for k in names}
            wrong = [f"{k} {shapes[k]} (config says {tuple(expected[k].shape)})"
                     for k in names if shapes[k] != tuple(expected[k].shape)]
            if wrong:
                raise PitError(f"{weights} does not match {path / 'config.json'}: {', '.join(wrong[:3])}; "
                               "the config or the weights were edited or come from another model")
        with torch.no_grad():
            read_into(weights, expected, names)
    except (SafetensorError, OSError, ValueError) as exc:
        raise PitError(f"cannot read {weights}: {exc}; the file is corrupt or truncated") from None
    model.eval()
    return model

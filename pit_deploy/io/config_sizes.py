"""The sizes a model directory's ``config.json`` declares, checked before anything is built.

A config is what transformers builds a model from: a negative layer count builds no layer, a
million layers over a two-layer checkpoint build for minutes, a zero head count divides by
zero, and a width that disagrees with the weights surfaces as a ``state_dict`` error of torch's.
:func:`check_config_sizes` reads the sizes (layers, hidden size, heads, key/value heads,
``head_dim``, MLP width, vocabulary, positions) and the tensor shapes the checkpoint's
safetensors headers declare (no tensor data is read), and refuses, naming the ``config.json``
field, its value and what the checkpoint holds:

* a size that is not a positive integer;
* a layer count other than the checkpoint's;
* a size that makes a tensor of another shape than the checkpoint's (found by the one field
  whose change makes every tensor agree; otherwise the tensor is named);
* a vocabulary smaller than the hidden size: PIT's token memory ``Z`` (``vocab_size ×
  hidden_size``) has orthonormal columns, which needs at least as many rows as columns.

Expected shapes come from a one-layer skeleton of the config on the meta device (no memory):
the layers of every supported family share their shapes, so layer ``i`` of the checkpoint is
compared with layer 0 of the skeleton.
"""

from __future__ import annotations

import copy
import json
import os
import re
import struct
from pathlib import Path
from typing import Any

from ..errors import PitError

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
#: safetensors refuses headers above 100 MB; so does this reader
MAX_HEADER_BYTES = 100 * 2**20
#: the sizes checked, by their transformers name: (required, what it is)
SIZE_FIELDS: dict[str, tuple[bool, str]] = {
    "num_hidden_layers": (True, "decoder layers"),
    "hidden_size": (True, "hidden size"),
    "num_attention_heads": (True, "attention heads"),
    "num_key_value_heads": (False, "key/value heads"),
    "head_dim": (False, "width of an attention head"),
    "intermediate_size": (False, "MLP width"),
    "n_inner": (False, "MLP width"),
    "vocab_size": (True, "vocabulary size"),
    "max_position_embeddings": (False, "positions"),
}
#: the fields whose single change may explain a shape that disagrees, in the order tried
_EXPLAINING = ("vocab_size", "hidden_size", "intermediate_size", "n_inner", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings")


def json_key(config: Any, name: str) -> str:
    """The ``config.json`` key of the transformers size ``name`` (GPT-2: ``n_layer`` for
    ``num_hidden_layers``)."""
    return dict(getattr(type(config), "attribute_map", {}) or {}).get(name, name)


def _declared(config: Any) -> dict[str, Any]:
    """The size fields the config has, by their ``config.json`` key (``None``: unset, optional)."""
    out: dict[str, Any] = {}
    for name in SIZE_FIELDS:
        key = json_key(config, name)
        if key in out:
            continue
        if key in vars(config) or hasattr(config, key):
            out[key] = getattr(config, key, None)
    return out


def _say_value(raw: dict[str, Any] | None, key: str, value: Any) -> str:
    if raw is not None and key not in raw:
        return f"{value!r} (transformers' default: config.json does not set it)"
    return repr(value)


def check_config_sizes(config: Any, path: str | os.PathLike | None, where: str | None = None) -> None:
    """Refuse sizes that are not positive integers, that disagree with the checkpoint's tensors
    (read from the safetensors headers of directory ``path``), or a vocabulary smaller than the
    hidden size — before any model is built.

    ``where`` names the config in messages (default: ``path/config.json``).

    Raises:
        PitError: naming the ``config.json`` field, its value and what the checkpoint holds.
    """
    folder = Path(path) if path is not None else None
    where = where or (str(folder / "config.json") if folder is not None else "the model's config")
    raw = _raw_config(folder)
    sizes = _declared(config)
    for key, value in sizes.items():
        canonical = next((n for n in SIZE_FIELDS if json_key(config, n) == key), key)
        required, what = SIZE_FIELDS[canonical]
        if value is None and not required:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PitError(f"{where}: {key} ({what}) must be a positive integer, got "
                           f"{_say_value(raw, key, value)}; fix {key} in config.json (or use the config saved "
                           "with these weights)")
    hidden_key, heads_key = json_key(config, "hidden_size"), json_key(config, "num_attention_heads")
    if getattr(config, "head_dim", None) is None and config.hidden_size % config.num_attention_heads:
        raise PitError(f"{where}: {hidden_key} {config.hidden_size} is not a multiple of {heads_key} "
                       f"{config.num_attention_heads}: the attention heads split the hidden size evenly; fix one of "
                       "them in config.json")
    shapes, files = _checkpoint_shapes(folder) if folder is not None else ({}, [])
    if shapes:
        _check_against_checkpoint(config, shapes, files, where, raw)
    vocab, hidden = config.vocab_size, config.hidden_size
    if vocab < hidden:
        raise PitError(f"{where}: {json_key(config, 'vocab_size')} {vocab} is smaller than "
                       f"{json_key(config, 'hidden_size')} {hidden}: PIT's token memory Z ({json_key(config, 'vocab_size')}"
                       f" × {json_key(config, 'hidden_size')}) has orthonormal columns, which needs at least as many "
                       "tokens as hidden dimensions; this model cannot be converted to PIT")
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if isinstance(kv, int) and heads % kv:
        raise PitError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}: each "
                       "key/value head serves a whole group of query heads; fix one of them in config.json")


def _raw_config(folder: Path | None) -> dict[str, Any] | None:
    if folder is None:
        return None
    try:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# --------------------------------------------------------------------------------------
# safetensors headers
# --------------------------------------------------------------------------------------


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files transformers loads from ``folder``: ``model.safetensors``, else the
    shards its index names (empty: neither)."""
    single = folder / WEIGHTS_NAME
    if single.is_file():
        return [single]
    index = folder / INDEX_NAME
    if not index.is_file():
        return []
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted({str(v) for v in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise PitError(f"{index} is not a readable safetensors index (no weight_map of tensor → file); the "
                       "checkpoint is corrupt") from None
    bad = [n for n in names if Path(n).name != n]
    if bad:
        raise PitError(f"{index} names {bad[0]!r}, not a file beside it; the checkpoint is corrupt")
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise PitError(f"{index} names {missing[0]}, which {folder} does not hold; the checkpoint is incomplete")
    return [folder / n for n in names]


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape as the header of safetensors file ``path`` declares it (no data read).

    Raises:
        PitError: a file too short or whose header is not a safetensors header.
    """
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            size = os.fstat(fh.fileno()).st_size
            if len(head) < 8:
                raise ValueError("shorter than a header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(fh.read(n).decode("utf-8"))
    except OSError as exc:
        raise PitError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, too deep, too short
        raise PitError(f"cannot read {path}: not a safetensors file ({str(exc)[:120]}); the file is corrupt or "
                       "truncated") from None
    if not isinstance(header, dict):
        raise PitError(f"cannot read {path}: not a safetensors header; the file is corrupt or truncated")
    shapes: dict[str, tuple[int, ...]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                  for s in shape):
            raise PitError(f"cannot read {path}: tensor {name!r} has no valid shape in the header; the file is "
                           "corrupt")
        shapes[name] = tuple(shape)
    return shapes


def _checkpoint_shapes(folder: Path) -> tuple[dict[str, tuple[int, ...]], list[Path]]:
    files = weight_files(folder)
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        shapes.update(safetensors_shapes(f))
    return shapes, files


# --------------------------------------------------------------------------------------
# config ↔ checkpoint
# --------------------------------------------------------------------------------------


def _strip(name: str, prefix: str) -> str:
    return name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".") else name


def _skeleton_shapes(config: Any, where: str) -> tuple[dict[str, tuple[int, ...]], str, str]:
    """The tensor shapes of a one-layer model of ``config`` (names without the base model's
    prefix; PIT's interface tensors added), the name of its layer list, and that prefix (the
    base model's attribute, ``model`` or ``transformer``, which transformers strips from or adds
    to a checkpoint's names).

    Raises:
        PitError: a config transformers cannot build a model from.
    """
    from ..model.families import adapter_for, skeleton
    from ..model.modules import INTERFACE_ATTR

    one = copy.deepcopy(config)
    setattr(one, json_key(one, "num_hidden_layers"), 1)
    try:
        model = skeleton(one)
    except (ValueError, TypeError, ZeroDivisionError, RuntimeError, AttributeError, KeyError, IndexError) as exc:
        said = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise PitError(f"{where}: transformers cannot build a model of these sizes ({type(exc).__name__}: {said}); "
                       "fix them in config.json (or use the config saved with these weights)") from None
    prefix = getattr(model, "base_model_prefix", "") or ""
    layers = adapter_for(one).layers(model)
    layer_list = next((n for n, m in model.named_modules() if m is layers), "")
    shapes = {_strip(k, prefix): tuple(v.shape) for k, v in model.state_dict().items()}
    d, v = int(config.hidden_size), int(config.vocab_size)
    shapes[f"{INTERFACE_ATTR}.Z"] = (v, d)
    shapes[f"{INTERFACE_ATTR}.L_offdiag"] = (d, d)
    shapes[f"{INTERFACE_ATTR}.L_diag"] = (d,)
    return shapes, _strip(layer_list, prefix), prefix


def _layer_indices(names: list[str], layer_list: str) -> list[int]:
    pattern = re.compile(re.escape(layer_list) + r"\.(\d+)\.")
    return sorted({int(m.group(1)) for n in names for m in [pattern.match(n)] if m})


def _as_layer_zero(name: str, layer_list: str) -> str:
    return re.sub("^" + re.escape(layer_list) + r"\.\d+\.", f"{layer_list}.0.", name) if layer_list else name


def _disagreements(expected: dict[str, tuple[int, ...]], held: dict[str, tuple[int, ...]],
                   layer_list: str) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(checkpoint name, expected shape, held shape) of every tensor whose shapes differ."""
    out = []
    for name, shape in held.items():
        want = expected.get(_as_layer_zero(name, layer_list))
        if want is not None and tuple(want) != tuple(shape):
            out.append((name, want, shape))
    return out


def _check_against_checkpoint(config: Any, shapes: dict[str, tuple[int, ...]], files: list[Path], where: str,
                              raw: dict[str, Any] | None) -> None:
    weights, holds = (files[0].name, "holds") if len(files) == 1 else (f"the {len(files)} safetensors shards", "hold")
    expected, layer_list, prefix = _skeleton_shapes(config, where)
    held = {_strip(k, prefix): v for k, v in shapes.items()}
    key = json_key(config, "num_hidden_layers")
    declared = getattr(config, key)
    indices = _layer_indices(list(held), layer_list) if layer_list else []
    gap = next((i for i, n in enumerate(indices) if n != i), None)  # the first number missing
    if gap is not None:
        raise PitError(f"{where}: {weights} {holds} layers numbered up to {indices[-1]} but not layer {gap}; the "
                       "checkpoint is incomplete")
    count = len(indices)
    if layer_list and count != declared:
        raise PitError(f"{where}: {key} is {_say_value(raw, key, declared)}, but {weights} {holds} {count} layer"
                       f"{'s' if count != 1 else ''}; set {key} to {count} (or use the config.json saved with these "
                       "weights)")
    wrong = _disagreements(expected, held, layer_list)
    if not wrong:
        return
    name, want, got = wrong[0]
    blamed = _explain(config, held, layer_list, wrong, where)
    shown = next((k for k in shapes if _strip(k, prefix) == name), name)
    if blamed is not None:
        field, value, fix = blamed
        raise PitError(f"{where}: {field} is {_say_value(raw, field, value)}, but {weights} {holds} {fix} ({shown} has "
                       f"shape {_shape(got)}, which {field} {value} makes {_shape(want)}); set {field} to {fix} (or "
                       "use the config.json saved with these weights)")
    fields = ", ".join(json_key(config, n) for n in _EXPLAINING if json_key(config, n) in _declared(config))
    raise PitError(f"{where} does not match {weights}: {shown} has shape {_shape(got)}, and the config makes it "
                   f"{_shape(want)}; check its sizes ({fields}) or use the config.json saved with these weights")


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _explain(config: Any, held: dict[str, tuple[int, ...]], layer_list: str,
             wrong: list[tuple[str, tuple[int, ...], tuple[int, ...]]], where: str) -> tuple[str, int, int] | None:
    """``(field, its value, the value the checkpoint holds)``: the one size field whose change
    makes every tensor's shape agree with the checkpoint, or ``None`` when none does."""
    declared = _declared(config)
    for canonical in _EXPLAINING:
        key = json_key(config, canonical)
        value = declared.get(key)
        if not isinstance(value, int) or key not in declared:
            continue
        candidates = set()
        for _, want, got in wrong:
            for e, g in zip(want, got):
                if e != g and e and (g * value) % e == 0 and g * value // e >= 1:
                    candidates.add(g * value // e)
        for candidate in sorted(candidates):
            trial = copy.deepcopy(config)
            setattr(trial, key, candidate)
            try:
                expected, _, _ = _skeleton_shapes(trial, where)
            except PitError:
                continue
            if not _disagreements(expected, held, layer_list):
                return key, value, candidate
    return None

"""Rotary embeddings whose frequencies follow the sequence length, held fixed for export.

Two of transformers' rotary types change their frequencies with the length of the sequence
(``dynamic_rope_update`` in ``transformers.modeling_rope_utils``): ``longrope`` (Phi-3's long
context models, Phi-4-mini) switches from its short factors to its long ones once a position
passes ``original_max_position_embeddings``, and ``dynamic`` (dynamic NTK) rescales past the
length cached. Both decide with ``torch.max(position_ids)``, a data-dependent branch:
``torch.export`` cannot trace it, and an ONNX trace keeps the branch its example input took.

Below ``original_max_position_embeddings`` both types compute the frequencies the rotary module
was built with (``inv_freq`` at construction: the short factors for ``longrope``), so a graph
whose positions cannot pass that length — a ``.pte``, whose static cache bounds them — computes
exactly what the model computes with those frequencies held fixed (:func:`fixed_frequencies`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

from ..errors import PitError

#: rotary types whose frequencies depend on the sequence length (``rope_type`` or, in older
#: configs, ``type``; transformers matches ``dynamic`` as a substring)
LENGTH_DEPENDENT = ("longrope", "dynamic")


def rope_type(config: Any) -> str:
    """The config's rotary type (``default`` without ``rope_scaling``)."""
    scaling = getattr(config, "rope_scaling", None) or {}
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def fixed_length(config: Any) -> int | None:
    """The longest sequence whose rotary frequencies are those the model was built with, when
    they change with the length (:data:`LENGTH_DEPENDENT`); ``None`` when they never change."""
    kind = rope_type(config)
    if not any(t in kind for t in LENGTH_DEPENDENT):
        return None
    return int(getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings)


@contextlib.contextmanager
def fixed_frequencies(model: nn.Module, max_len: int) -> Iterator[None]:
    """Within the block, ``model``'s rotary modules keep the frequencies they were built with,
    for graphs whose positions stay below ``max_len``.

    Raises:
        PitError: ``max_len`` passes the length where the frequencies change (the graph would
            compute the short factors where the model uses the long ones).
    """
    limit = fixed_length(model.config)
    if limit is None:
        yield
        return
    if max_len > limit:
        raise PitError(f"this model's {rope_type(model.config)!r} rotary embedding changes its frequencies past "
                       f"{limit} positions (original_max_position_embeddings), which an exported graph cannot "
                       f"follow; export it for at most {limit} positions (--max-seq-len {limit})")
    modules = [m for m in model.modules() if hasattr(m, "rope_type") and hasattr(m, "original_inv_freq")]
    saved = [m.rope_type for m in modules]
    for module in modules:
        module.inv_freq = module.original_inv_freq
        module.rope_type = "default"  # dynamic_rope_update calls no update for it
    try:
        yield
    finally:
        for module, kind in zip(modules, saved):
            module.rope_type = kind

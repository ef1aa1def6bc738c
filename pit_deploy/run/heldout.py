"""Held-out loss of a model on the validation split of a corpus: the number a run compares
before and after conversion and training, to warn when a model is not ready."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from ..model.families import max_positions


@torch.no_grad()
def heldout_nll(model, tokenizer, data: str, seq_len: int, n_blocks: int, batch_size: int = 4) -> float | None:
    """Mean next-token NLL (nats/token) on the first ``n_blocks`` validation blocks of ``data``.

    Returns ``None`` when the split holds no text or there is no tokenizer.

    Raises:
        PitError: a non-finite loss (the model's weights or its conversion are broken).
    """
    from ..errors import PitError
    from ..train.data import DataConfig, TextSource, validation_blocks

    if tokenizer is None:
        return None
    limit = max_positions(model.config)
    if limit is not None:
        seq_len = min(seq_len, limit - 1)
    cfg = DataConfig(spec=data, seq_len=seq_len)
    block = validation_blocks(TextSource(cfg), tokenizer, cfg, n_blocks)
    if block is None:
        return None
    was_training = model.training
    model.eval()
    total, count = 0.0, 0.0
    for i in range(0, block.ids.shape[0], batch_size):
        ids = block.ids[i : i + batch_size]
        mask = block.mask[i : i + batch_size, 1:]
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits
        ce = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        total += float((ce * mask.flatten()).sum())
        count += float(mask.sum())
    model.train(was_training)
    nll = total / max(count, 1.0)
    if not math.isfinite(nll):
        raise PitError(f"the held-out loss is {nll}: the model produces non-finite logits")
    return nll

"""Held-out loss: mean next-token NLL over packed validation blocks. The one computation the
training loop's evaluations, the run's before/after comparison and ``convert``'s report share."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, ContextManager

import torch

from ..errors import PitError
from ..model.families import max_positions
from ..data.corpus import Block, DataConfig, TextSource, validation_blocks
from .loss import token_nll_sum


#: bytes of float32 logits one held-out batch may hold (:func:`block_nll`): one row of 256 tokens
#: at a 262,144-token vocabulary (the loss makes two more copies of them, a soft cap one more)
LOGITS_BUDGET = 256 * 2**20


@torch.no_grad()
def block_nll(model: Any, block: Block, batch_size: int, device: torch.device | str = "cpu",
              autocast: Callable[[], ContextManager] = contextlib.nullcontext) -> float:
    """Mean NLL (nats/token) of ``model`` on ``block``'s learned tokens (mask = 1), in batches of
    at most ``batch_size`` rows, fewer where a batch's logits would pass :data:`LOGITS_BUDGET`
    (a 262k-token vocabulary's logits are 256 MiB per row of 256 tokens)."""
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)  # 0: a wrapper without one
    per_row = max(1, 4 * vocab * (block.ids.shape[1] - 1))
    batch_size = max(1, min(batch_size, LOGITS_BUDGET // per_row))
    total, count = 0.0, 0.0
    for i in range(0, block.ids.shape[0], batch_size):
        ids = block.ids[i : i + batch_size].to(device)
        mask = block.mask[i : i + batch_size, 1:].to(device)
        with autocast():
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits
        total += float(token_nll_sum(logits, ids[:, 1:], mask))
        count += float(mask.sum())
    return total / max(count, 1.0)


def prose_blocks(tokenizer: Any, seq_len: int, max_blocks: int | None = None) -> Block:
    """The package's held-out English prose (``data/heldout_text/prose.txt``, none of it in the
    default corpus) as blocks of ``seq_len + 1`` ids, at most ``max_blocks`` of them; the last
    block is padded and its padding masked out, so every token it holds is a target once
    (``--eval-prose``)."""
    from ..data.calibration import HELDOUT_TEXT

    text = (HELDOUT_TEXT / "prose.txt").read_text(encoding="utf-8")
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    rows, masks = [], []
    for start in range(0, max(len(ids) - 1, 1), seq_len):
        row = ids[start:start + seq_len + 1]
        rows.append(row + [pad] * (seq_len + 1 - len(row)))
        masks.append([1.0] * len(row) + [0.0] * (seq_len + 1 - len(row)))
        if max_blocks is not None and len(rows) >= max_blocks:
            break
    return Block(torch.tensor(rows, dtype=torch.int64), torch.tensor(masks, dtype=torch.float32))


def heldout_nll(model: Any, tokenizer: Any, data: str, seq_len: int, n_blocks: int, batch_size: int = 4) -> float | None:
    """Mean next-token NLL on the first ``n_blocks`` validation blocks of ``data``.

    Returns ``None`` when the split holds no text or there is no tokenizer.

    Raises:
        PitError: a non-finite loss (the model's weights or its conversion are broken).
    """
    if tokenizer is None:
        return None
    from ..converters.conversion import check_tokenizer_fits

    check_tokenizer_fits(tokenizer, model.config)  # an id past the table would index out of range
    limit = max_positions(model.config)
    if limit is not None:
        seq_len = min(seq_len, limit - 1)
    cfg = DataConfig(spec=data, seq_len=seq_len)
    block = validation_blocks(TextSource(cfg), tokenizer, cfg, n_blocks)
    if block is None:
        return None
    was_training = model.training
    model.eval()
    nll = block_nll(model, block, batch_size)
    model.train(was_training)
    if not math.isfinite(nll):
        raise PitError(f"the held-out loss is {nll}: the model produces non-finite logits")
    return nll

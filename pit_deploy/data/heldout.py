"""The held-out token set of quantized parity, chosen once at export time and recorded in the
manifest (``heldout``), so every later ``verify`` measures on the same tokens: blocks of the
default corpus's validation split when the model has a tokenizer, seeded random ids otherwise
(``docs/quantization.md``)."""

from __future__ import annotations

import math
from typing import Any

import torch

#: held-out tokens in all (at least), and the longest block (a .pte prefills < max_seq_len)
HELDOUT_TOKENS = 2048
HELDOUT_BLOCK = 256
HELDOUT_SEED = 0


def heldout_blocks(tokenizer: Any, config: Any, recipe: Any) -> dict[str, Any]:
    """The held-out ids of an export: ``{"source", "blocks": [[id, ...], ...]}``.

    Block length ``min(256, max_seq_len − 1, max_positions − 1)``; as many blocks as make at
    least :data:`HELDOUT_TOKENS` tokens.
    """
    from ..model.families import max_positions
    from .corpus import DataConfig, TextSource, validation_blocks

    length = min(HELDOUT_BLOCK, recipe.max_seq_len - 1)
    limit = max_positions(config)
    if limit is not None:
        length = min(length, limit - 1)
    n_blocks = math.ceil(HELDOUT_TOKENS / length)
    if tokenizer is not None:
        cfg = DataConfig(spec="default", seq_len=length - 1)
        block = validation_blocks(TextSource(cfg), tokenizer, cfg, n_blocks)
        if block is not None and block.ids.shape[0] == n_blocks and int(block.ids.max()) < config.vocab_size:
            return {"source": "default corpus, validation split", "blocks": block.ids.tolist()}
    gen = torch.Generator().manual_seed(HELDOUT_SEED)
    ids = torch.randint(0, config.vocab_size, (n_blocks, length), generator=gen)
    return {"source": f"seeded random ids (seed {HELDOUT_SEED}; no tokenizer)", "blocks": ids.tolist()}

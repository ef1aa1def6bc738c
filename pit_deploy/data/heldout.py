"""The held-out token set of quantized parity, and the figures measured on it.

The set is chosen once at export time and recorded in the manifest (``heldout``), so every later
``verify`` measures on the same tokens: blocks of the default corpus's validation split when the
model has a tokenizer, seeded random ids otherwise (``docs/quantization.md``).

Exact logit bounds make no sense for a quantized artifact; what llama.cpp's ``perplexity
--kl-divergence`` reports does. Per position ``t`` of each held-out block, with ``P`` the
reference's and ``Q`` the compared model's softmax (float64):

* ``KL(P‖Q) = Σ_v P_v (log P_v − log Q_v)`` — reported as its mean and 99th percentile;
* ``same_top1``: the fraction of positions where both argmaxes agree;
* ``ppl_ratio = exp(mean NLL_Q − mean NLL_P)`` of the next tokens of the blocks.

:func:`kl_parity` lives here, below both stages that use it: ``verify`` compares a runtime with
the fp32 reference, and the export measures the error its quantization grid is expected to
cost (:mod:`pit_deploy.exporters.expected_error`) on the same tokens with the same figures.
"""


from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
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


@dataclass
class KLFigures:
    kl_mean: float
    kl_p99: float
    same_top1: float
    ppl_ratio: float
    nonfinite_outputs: int
    tokens: int


@torch.no_grad()
def kl_parity(driver: Any, reference: Any, blocks: list[list[int]]) -> KLFigures:
    """Prefill each block on ``driver`` and in ``reference``; compare the distributions, one
    block's logits at a time (all of them at once are 4.8 GB for 9 × 255 tokens of a
    262k-token vocabulary)."""
    def rows() -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        for row in blocks:
            ids = torch.tensor(row, dtype=torch.long)
            yield ids, reference(input_ids=ids[None]).logits[0], driver.prefill(ids)

    return kl_figures(rows())


#: positions of one sequence whose float64 distributions are worked on at a time: a 256-token
#: block of a 262k-token vocabulary is 537 MB a float64 copy, and the KL takes several
KL_ROWS = 32


@torch.no_grad()
def kl_figures(rows: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> KLFigures:
    """The figures of ``(ids, P's logits, Q's logits)`` per sequence (logits ``(len(ids), V)``,
    row ``t`` predicting ``ids[t + 1]``), as the module docstring defines them; each sequence
    :data:`KL_ROWS` positions at a time (every figure is a per-position one, summed or pooled
    after)."""
    kls: list[torch.Tensor] = []
    agree = positions = nonfinite = 0
    nll_q = nll_p = 0.0
    targets_n = 0
    for ids, ref_all, got_all in rows:
        nxt = ids[1:]
        picked_p: list[torch.Tensor] = []
        picked_q: list[torch.Tensor] = []
        for first in range(0, ids.numel(), KL_ROWS):
            part = slice(first, first + KL_ROWS)
            ref, got = ref_all[part].double(), got_all[part].double()
            bad = ~torch.isfinite(got)
            nonfinite += int(bad.sum())
            logp = torch.log_softmax(ref, -1)
            logq = torch.log_softmax(got, -1)
            kl = (logp.exp() * (logp - logq)).sum(-1)
            kl = torch.where(bad.any(-1), torch.full_like(kl, math.inf), kl)  # a non-finite row is unbounded
            kls.append(kl)
            agree += int(((got.argmax(-1) == ref.argmax(-1)) & ~bad.any(-1)).sum())
            targets = nxt[part]  # the positions of this part that predict a next token
            picked_p.append(logp[:targets.numel()].gather(1, targets[:, None]))
            picked_q.append(logq[:targets.numel()].gather(1, targets[:, None]))
        positions += ids.numel()
        nll_p -= float(torch.cat(picked_p).sum())
        nll_q -= float(torch.cat(picked_q).sum())
        targets_n += nxt.numel()
    every = torch.cat(kls)
    finite = bool(torch.isfinite(every).all())
    gap = (nll_q - nll_p) / max(targets_n, 1)
    # a damaged artifact can be worse than exp's range (a few flipped exponents in T): unbounded
    ratio = math.exp(gap) if math.isfinite(gap) and gap < 700.0 else math.inf
    return KLFigures(
        kl_mean=float(every.mean()) if finite else math.inf,
        kl_p99=float(torch.quantile(every, 0.99)) if finite else math.inf,
        same_top1=agree / max(positions, 1),
        ppl_ratio=ratio if finite else math.inf,
        nonfinite_outputs=nonfinite,
        tokens=positions,
    )

"""Quantized parity: KL divergence of a runtime's next-token distributions from the fp32
PyTorch reference on a fixed held-out token set.

Exact logit bounds make no sense for a quantized artifact; what llama.cpp's ``perplexity
--kl-divergence`` reports does (``docs/quantization.md``). Per position ``t`` of each held-out
block, with ``P`` the reference's and ``Q`` the runtime's softmax (float64):

* ``KL(P‖Q) = Σ_v P_v (log P_v − log Q_v)`` — reported as its mean and 99th percentile;
* ``same_top1``: the fraction of positions where both argmaxes agree;
* ``ppl_ratio = exp(mean NLL_Q − mean NLL_P)`` of the next tokens of the blocks.

The held-out set is chosen at export time (:mod:`pit_deploy.data.heldout`) and its ids are
recorded in the manifest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

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
    """Prefill each block on ``driver`` and in ``reference``; compare the distributions."""
    kls: list[torch.Tensor] = []
    agree = positions = nonfinite = 0
    nll_q = nll_p = 0.0
    targets_n = 0
    for row in blocks:
        ids = torch.tensor(row, dtype=torch.long)
        ref = reference(input_ids=ids[None]).logits[0].double()
        got = driver.prefill(ids).double()
        bad = ~torch.isfinite(got)
        nonfinite += int(bad.sum())
        logp = torch.log_softmax(ref, -1)
        logq = torch.log_softmax(got, -1)
        kl = (logp.exp() * (logp - logq)).sum(-1)
        kl = torch.where(bad.any(-1), torch.full_like(kl, math.inf), kl)  # a non-finite row is unbounded
        kls.append(kl)
        agree += int(((got.argmax(-1) == ref.argmax(-1)) & ~bad.any(-1)).sum())
        positions += ids.numel()
        nxt = ids[1:]
        nll_p -= float(logp[:-1].gather(1, nxt[:, None]).sum())
        nll_q -= float(logq[:-1].gather(1, nxt[:, None]).sum())
        targets_n += nxt.numel()
    every = torch.cat(kls)
    finite = bool(torch.isfinite(every).all())
    ratio = math.exp((nll_q - nll_p) / max(targets_n, 1)) if math.isfinite(nll_q) else math.inf
    return KLFigures(
        kl_mean=float(every.mean()) if finite else math.inf,
        kl_p99=float(torch.quantile(every, 0.99)) if finite else math.inf,
        same_top1=agree / max(positions, 1),
        ppl_ratio=ratio if finite else math.inf,
        nonfinite_outputs=nonfinite,
        tokens=positions,
    )

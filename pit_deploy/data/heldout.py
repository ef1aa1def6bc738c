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
from collections.abc import Iterable, Iterator, Sequence
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


class ReferenceLogits:
    """The reference's logits of each held-out block, computed once and kept in an unnamed
    temporary file (Python's ``tempfile``: the directory ``TMPDIR`` names, deleted when closed or
    when the process ends), read back one block at a time.

    Why: ``verify`` compares a runtime with the reference block by block, and the reference model
    sat beside the runtime's session throughout (1 GB at a 262,144-token vocabulary, the largest
    part of the check's peak). With its logits on disk the model is let go before any session
    opens, and every quantized artifact of an export is compared with the same logits, computed
    once. The file holds ``blocks × length × V`` float32 values (2.4 GB for 9 × 255 tokens at
    262,144 ids; 0.45 GB at 49,152).
    """

    def __init__(self, model: Any, blocks: list[list[int]]) -> None:
        import tempfile

        self._file = tempfile.TemporaryFile(prefix="pit-deploy-reference-logits-")
        self._where: dict[tuple[int, ...], tuple[int, tuple[int, ...]]] = {}
        try:
            offset = 0
            for row in blocks:
                key = tuple(row)
                if key in self._where:
                    continue
                logits = model(input_ids=torch.tensor(row, dtype=torch.long)[None]).logits[0]
                data = logits.detach().float().contiguous().numpy()
                self._file.write(memoryview(data.reshape(-1).view("uint8")))
                self._where[key] = (offset, tuple(data.shape))
                offset += data.nbytes
            self._file.flush()
        except BaseException:
            self._file.close()
            raise

    def __contains__(self, row: Sequence[int]) -> bool:
        return tuple(row) in self._where

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The stored logits ``(len(ids), V)`` of one block."""
        offset, shape = self._where[tuple(ids.tolist())]
        from ..io.tensor_file import fill_from

        out = torch.empty(shape, dtype=torch.float32)
        self._file.seek(offset)
        fill_from(self._file, out, "the temporary file of the reference's logits ends early")
        return out

    def close(self) -> None:
        self._file.close()


@torch.no_grad()
def kl_parity(driver: Any, reference: Any, blocks: list[list[int]]) -> KLFigures:
    """Prefill each block on ``driver`` and in ``reference`` (a model, or its
    :class:`ReferenceLogits` of these blocks); compare the distributions, one block's logits at a
    time (all of them at once are 4.8 GB for 9 × 255 tokens of a 262k-token vocabulary)."""
    def reference_logits(ids: torch.Tensor) -> torch.Tensor:
        if isinstance(reference, ReferenceLogits):
            return reference.logits(ids)
        return reference(input_ids=ids[None]).logits[0]

    def rows() -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        for row in blocks:  # no local holds a block's logits while the next block's are made
            ids = torch.tensor(row, dtype=torch.long)
            yield ids, reference_logits(ids), driver.prefill(ids)

    return kl_figures(rows())


#: float64 values of one distribution worked on at a time: the KL of a chunk of positions holds
#: about seven such arrays, so 2^19 values (4 MiB each) keep it near 30 MiB whatever the vocabulary
#: (2 positions at 262,144 ids, 10 at 49,152); of 2^17 to 2^21 this size was the fastest at 49,152,
#: 70,000 and 262,144 ids, 1.3-2.5x faster than 2^21 (benchmarks/results/kl_chunk_size.json)
KL_ELEMENTS = 2**19


def kl_rows(vocab: int) -> int:
    """Positions of one sequence whose float64 distributions are worked on at a time."""
    return max(1, KL_ELEMENTS // max(vocab, 1))


@dataclass
class _Chunk:
    """One chunk's per-position figures, as Python values (see :func:`kl_figures`)."""
    kls: list[float]
    agree: int
    nonfinite: int
    picked_p: list[float]
    picked_q: list[float]


def _chunk_figures(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> _Chunk:
    """The figures of a few positions' logits ``(n, V)``; ``targets`` the next ids of the first
    ``len(targets)`` of them. Nothing of the chunk outlives the call, so the caller's ``del`` of a
    block's logits frees them."""
    # a float32 sum is finite only if every value is: the element-wise test (a tenth of the chunk's
    # time) runs only for a chunk that may hold a NaN or an infinity
    bad_rows = None
    nonfinite = 0
    if not bool(torch.isfinite(got.sum())):
        bad = ~torch.isfinite(got)
        nonfinite = int(bad.sum())
        bad_rows = bad.any(-1)
    logp = torch.log_softmax(ref.double(), -1)
    logq = torch.log_softmax(got.double(), -1)
    # sum_v p_v (log p_v - log q_v) in one fused pass: the values of the written-out form
    kl = torch.nn.functional.kl_div(logq, logp, reduction="none", log_target=True).sum(-1)
    same = got.argmax(-1) == ref.argmax(-1)  # float32 -> float64 is exact: the same argmax
    if bad_rows is not None:  # a non-finite row is unbounded and never agrees
        kl = torch.where(bad_rows, torch.full_like(kl, math.inf), kl)
        same &= ~bad_rows
    n = targets.numel()
    return _Chunk(kls=kl.tolist(), agree=int(same.sum()), nonfinite=nonfinite,
                  picked_p=logp[:n].gather(1, targets[:, None]).reshape(-1).tolist(),
                  picked_q=logq[:n].gather(1, targets[:, None]).reshape(-1).tolist())


@torch.no_grad()
def kl_figures(rows: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> KLFigures:
    """The figures of ``(ids, P's logits, Q's logits)`` per sequence (logits ``(len(ids), V)``,
    row ``t`` predicting ``ids[t + 1]``), as the module docstring defines them; each sequence
    :func:`kl_rows` positions at a time (every figure is a per-position one, summed or pooled
    after). Per-position values are kept as Python floats: thousands of small tensors kept between
    the chunks' large ones fragment the heap (at a 262k-token vocabulary the process grew by
    1.5 GB over nine blocks)."""
    kls: list[float] = []
    agree = positions = nonfinite = 0
    nll_q = nll_p = 0.0
    targets_n = 0
    for ids, ref_all, got_all in rows:
        nxt = ids[1:]
        picked_p: list[float] = []
        picked_q: list[float] = []
        step = kl_rows(ref_all.shape[-1])
        for first in range(0, ids.numel(), step):
            part = slice(first, first + step)
            chunk = _chunk_figures(ref_all[part], got_all[part], nxt[part])
            nonfinite += chunk.nonfinite
            kls.extend(chunk.kls)
            agree += chunk.agree
            picked_p.extend(chunk.picked_p)
            picked_q.extend(chunk.picked_q)
        positions += ids.numel()
        nll_p -= float(torch.tensor(picked_p, dtype=torch.float64).sum())
        nll_q -= float(torch.tensor(picked_q, dtype=torch.float64).sum())
        targets_n += nxt.numel()
        # let this block's logits go before the next block's are made (two blocks at a 262k-token
        # vocabulary are 0.5 GB more at the peak)
        del ref_all, got_all
    every = torch.tensor(kls, dtype=torch.float64)
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

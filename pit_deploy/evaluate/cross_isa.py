"""The compact check of ``verify --isa aarch64``: does an artifact compute on ARM kernels what it
computes on x86?

The whole verification emulated (``--full``) replays every call x86 ``verify`` makes; for the
default model that is over an hour of a core per artifact and CPU profile, most of it the
interface graph over the whole vocabulary and the held-out set's 2,000+ tokens. This check asks
the narrower question an emulated row exists for, on a fixed, compact set of calls that exercises
both kinds of kernels a phone runs (:class:`Plan`):

* each verify prompt prefilled, then :data:`PROMPT_STEPS` decode steps fed the x86 artifact's own
  greedy tokens (so that the ARM kernels' argmax at each step says whether greedy decoding on the
  phone would pick the same tokens);
* one held-out sequence of up to :data:`HELDOUT_TOKENS` tokens: prefilled, then its last
  :data:`HELDOUT_STEPS` tokens fed one decode step at a time (matrix-vector kernels as well as the
  prefill's matrix-matrix ones);
* the interface graph on a seeded sample of :data:`INTERFACE_IDS` token ids and
  :data:`INTERFACE_ROWS` basis vectors of the head.

The same artifact runs the same calls on x86 (natively, seconds) and on the emulated aarch64
runtime; the PyTorch reference runs the same sequences. A row passes when (:func:`judge`):

* **fp32**: the ARM logits' relative L2 distance to the x86 logits, and the sampled interface
  outputs' to x86's, are within the fp32 logits bound; the greedy tokens are identical; and the
  ARM logits are within the fp32 bounds of the PyTorch reference (rel L2, top-1);
* **quantized**: the mean KL divergence from the x86 artifact's next-token distribution to the ARM
  one is at most :data:`KL_FRACTION` of the artifact's expected quantization KL (the error its
  weight rounding alone costs, measured at export): what the phone adds must be small against
  what quantization already costs; the sampled interface is within the fp32 logits bound of x86's;
  and the ARM logits meet the reference's KL bounds (mean and p99, absolute and scaled by the
  expected error) on the held-out sequence. Top-1 agreement and the perplexity ratio of one short
  sequence say as much about the text as about the artifact (the x86 artifact's own are reported
  beside them); x86 ``verify`` bounds them on the whole held-out set.

The comparison with the reference is what makes a damaged artifact fail here too: a scrambled body
computes the same garbage on both ISAs. ``delta_ti`` needs the interface over the whole
vocabulary (minutes per row under emulation): the compact row does not measure it, and says so;
x86 ``verify`` and ``--isa aarch64 --full`` do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .bound_checks import rel_l2

#: greedy tokens per verify prompt (decode steps fed the x86 artifact's choices)
PROMPT_STEPS = 8
#: the held-out sequence: at most this many tokens, of which the last ``HELDOUT_STEPS`` are decode steps
HELDOUT_TOKENS = 160
HELDOUT_STEPS = 32
#: the interface graph's sample: token ids and head basis rows (seeded)
INTERFACE_IDS = 2048
INTERFACE_ROWS = 32
INTERFACE_SEED = 0
#: a quantized artifact's cross-ISA KL bound, as a fraction of its expected quantization KL
KL_FRACTION = 0.1


@dataclass
class Plan:
    """The compact set of one artifact: ``(ids, prefill length)`` per sequence (the rest of
    ``ids`` are decode steps), the first ``prompts`` of them prompts with their greedy tokens
    ``greedy[i]``; the last one the held-out sequence (if any); the interface sample."""

    sequences: list[tuple[list[int], int]]
    prompts: int
    greedy: list[list[int]]
    ids: list[int]
    rows: list[int]

    @property
    def positions(self) -> int:
        return sum(len(ids) for ids, _ in self.sequences)


@dataclass
class Outputs:
    """What one runtime answered to a plan: logits per sequence, the sampled interface."""

    logits: list[torch.Tensor]
    emb: torch.Tensor
    head: torch.Tensor


def heldout_sequence(blocks: Sequence[Sequence[int]] | None, vocab: int, length: int) -> list[int]:
    """The held-out sequence: the first block of the export's held-out set (quantized exports
    record one), else seeded random ids; at most ``length`` tokens."""
    if blocks:
        return [int(t) for t in blocks[0][:length]]
    gen = torch.Generator().manual_seed(INTERFACE_SEED)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def corpus_block(tokenizer: Any, vocab: int, length: int) -> list[list[int]] | None:
    """One block of the default corpus's validation split (what quantized exports record as their
    held-out set), for an export that records none; ``None`` without a tokenizer."""
    from ..data.corpus import DataConfig, TextSource, validation_blocks

    if tokenizer is None:
        return None
    cfg = DataConfig(spec="default", seq_len=length - 1)
    block = validation_blocks(TextSource(cfg), tokenizer, cfg, 1)
    if block is None or int(block.ids.max()) >= vocab:
        return None
    return block.ids.tolist()


def make_plan(driver: Any, prompts: Sequence[torch.Tensor], heldout: Sequence[int], vocab: int, dim: int,
              max_seq: int | None) -> Plan:
    """The plan of one artifact: greedy tokens from the x86 ``driver`` (its own choices), the
    held-out sequence cut to the artifact's cache, the interface sample."""
    from ..runtime.base import greedy

    limit = max_seq if max_seq else 10**9
    sequences, chosen = [], []
    for prompt in prompts:
        prompt = prompt[: max(1, limit - PROMPT_STEPS)]
        tokens = greedy(driver, prompt, PROMPT_STEPS, context=limit)
        chosen.append(tokens)
        sequences.append(([int(t) for t in prompt] + tokens[:-1], len(prompt)))
    held = list(heldout[: min(HELDOUT_TOKENS, limit)])
    if len(held) >= 2:
        steps = min(HELDOUT_STEPS, len(held) // 4)
        sequences.append((held, len(held) - steps))
    gen = torch.Generator().manual_seed(INTERFACE_SEED)
    ids = torch.randperm(vocab, generator=gen)[: min(vocab, INTERFACE_IDS)].sort().values.tolist()
    rows = torch.randperm(dim, generator=gen)[: min(dim, INTERFACE_ROWS)].sort().values.tolist()
    return Plan(sequences, len(prompts), chosen, ids, rows)


def execute(plan: Plan, driver: Any, interface: Callable[[list[int], list[int]], tuple[torch.Tensor, torch.Tensor]]
            ) -> Outputs:
    """Run ``plan`` on ``driver``: each sequence's prefill, then its decode steps (logits of every
    position), then ``interface(ids, rows)``."""
    logits = []
    for ids, prefill in plan.sequences:
        pre = driver.prefill(torch.tensor(ids[:prefill], dtype=torch.long)).float()
        steps = [driver.step(ids[j], j).float() for j in range(prefill, len(ids))]
        logits.append(torch.cat([pre, torch.stack(steps)]) if steps else pre)
    emb, head = interface(plan.ids, plan.rows)
    return Outputs(logits, emb.float(), head.float())


def sampled_interface(driver: Any, vocab: int, dim: int) -> Callable[[list[int], list[int]], tuple[Any, Any]]:
    """The interface sample from a runtime's whole interface (natively, x86 computes it in seconds)."""
    def run(ids: list[int], rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        emb, head = driver.interface(vocab, dim)
        return emb[ids], head[rows]
    return run


@torch.no_grad()
def reference_logits(reference: Any, plan: Plan) -> list[torch.Tensor]:
    """The PyTorch reference's logits of every plan sequence (one forward pass each)."""
    return [reference(input_ids=torch.tensor(ids, dtype=torch.long)[None]).logits[0].float()
            for ids, _ in plan.sequences]




def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """``KL(P‖Q)`` per row (float64); a row of ``Q`` that is not finite is unbounded."""
    logp = torch.log_softmax(p_logits.double(), -1)
    logq = torch.log_softmax(q_logits.double(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return torch.where(~torch.isfinite(q_logits).all(-1), torch.full_like(kl, math.inf), kl)


@dataclass
class CrossIsa:
    """The figures of one compact row (``ArtifactResult.cross_isa``) and its failures."""

    positions: int
    #: ARM vs x86 (same artifact)
    rel_l2: float
    kl_mean: float
    kl_max: float
    same_top1: float
    greedy_identical: bool
    interface_rel_l2: float
    #: the quantized bound (``KL_FRACTION`` × expected KL); ``None`` for fp32
    kl_bound: float | None = None
    #: quantized: the x86 artifact's own top-1 agreement and perplexity ratio on the held-out sequence
    x86_same_top1: float | None = None
    x86_ppl_ratio: float | None = None
    failures: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def compare(plan: Plan, x86: Outputs, arm: Outputs) -> CrossIsa:
    """The cross-ISA figures of ``arm`` against ``x86`` on one plan."""
    a, x = torch.cat(arm.logits), torch.cat(x86.logits)
    kl = _kl(x, a)
    finite = bool(torch.isfinite(kl).all())
    greedy_ok = True
    for i in range(plan.prompts):
        ids, prefill = plan.sequences[i]
        picked = arm.logits[i][prefill - 1:].argmax(-1).tolist()
        greedy_ok &= picked == plan.greedy[i] and bool(torch.isfinite(arm.logits[i][prefill - 1:]).all())
    iface = max(rel_l2(arm.emb, x86.emb), rel_l2(arm.head, x86.head))
    return CrossIsa(positions=int(a.shape[0]), rel_l2=rel_l2(a, x),
                    kl_mean=float(kl.mean()) if finite else math.inf, kl_max=float(kl.max()) if finite else math.inf,
                    same_top1=float((a.argmax(-1) == x.argmax(-1)).double().mean()),
                    greedy_identical=greedy_ok, interface_rel_l2=iface)


def judge(result: Any, plan: Plan, x86: Outputs, arm: Outputs, reference: list[torch.Tensor], bounds: Any,
          quantized: bool) -> Any:
    """Fill ``result`` (verify's ``ArtifactResult`` of an aarch64 row) with the compact figures
    and judge them (module docstring); returns it."""
    from ..data.heldout import kl_figures
    from .bound_checks import kl_failures, logit_failures

    cross = compare(plan, x86, arm)
    fails: list[str] = []
    got = torch.cat(arm.logits)
    result.nonfinite_outputs = int((~torch.isfinite(got)).sum())
    if result.nonfinite_outputs:
        fails.append(f"the runtime produced {result.nonfinite_outputs} non-finite logit(s)")
    fp32_bound = bounds_fp32rel_l2()
    if not cross.interface_rel_l2 <= fp32_bound:
        fails.append(f"interface sample differs from x86's: rel L2 {cross.interface_rel_l2:.3e} > {fp32_bound:g}")
    if quantized:
        expected = result.expected_kl_mean
        base = expected if expected is not None else bounds.kl_mean
        cross.kl_bound = KL_FRACTION * base
        if not cross.kl_mean <= cross.kl_bound:
            fails.append(f"KL from x86 to aarch64 {cross.kl_mean:.4g} > {cross.kl_bound:.4g} = {KL_FRACTION:g} × "
                         + (f"the expected KL {expected:.4g}" if expected is not None else f"kl_mean bound {base:g}"))
        if plan.prompts < len(plan.sequences):  # the held-out sequence against the reference
            ids, _ = plan.sequences[-1]
            fig = kl_figures([(torch.tensor(ids), reference[-1], arm.logits[-1])])
            result.kl_mean, result.kl_p99, result.same_top1, result.ppl_ratio = (
                fig.kl_mean, fig.kl_p99, fig.same_top1, fig.ppl_ratio)
            result.heldout_tokens = fig.tokens
            fails += kl_failures(bounds, fig.kl_mean, fig.kl_p99)
            if result.expected_kl_mean is not None and result.expected_kl_p99 is not None:
                mean, p99 = bounds.scaled_kl_bound(result.expected_kl_mean, result.expected_kl_p99)
                result.scaled_bounds = {"kl_mean": mean, "kl_p99": p99}
                if not fig.kl_mean <= mean:
                    fails.append(f"kl_mean {fig.kl_mean:.4g} > {mean:.4g}, the error its weight rounding explains")
                if not fig.kl_p99 <= p99:
                    fails.append(f"kl_p99 {fig.kl_p99:.4g} > {p99:.4g}, the error its weight rounding explains")
            # top-1 agreement and the perplexity ratio of one short sequence measure the text as much
            # as the artifact: reported beside the x86 artifact's own on it, bounded by x86 verify
            x86_fig = kl_figures([(torch.tensor(ids), reference[-1], x86.logits[-1])])
            cross.x86_same_top1, cross.x86_ppl_ratio = x86_fig.same_top1, x86_fig.ppl_ratio
    else:
        if not cross.rel_l2 <= bounds.logits_rel_l2:
            fails.append(f"logits differ from x86's: rel L2 {cross.rel_l2:.3e} > {bounds.logits_rel_l2:g}")
        if not cross.greedy_identical:
            fails.append(f"greedy tokens differ from x86's ({PROMPT_STEPS} per prompt)")
        ref = torch.cat(reference)
        result.logits_rel_l2 = rel_l2(got, ref)
        result.logits_max_abs = float((got.double() - ref.double()).abs().max())
        result.top1_agreement = float((got.argmax(-1) == ref.argmax(-1)).double().mean())
        result.greedy_match = cross.greedy_identical
        fails += logit_failures(bounds, result.logits_rel_l2, result.top1_agreement)
    result.prompts, result.greedy_tokens = plan.prompts, PROMPT_STEPS
    cross.failures = fails
    result.cross_isa = cross.to_dict()
    result.notes.append(f"compact cross-ISA check: {cross.positions} positions ({plan.prompts} prompts + "
                        f"{PROMPT_STEPS} greedy tokens each, {len(plan.sequences) - plan.prompts} held-out sequence), "
                        f"interface on {len(plan.ids)} ids and {len(plan.rows)} head rows; delta_ti is not "
                        "measured on aarch64 here (verify on x86 measures it; --isa aarch64 --full here)")
    return result.judge(bounds)


def bounds_fp32rel_l2() -> float:
    """The fp32 logits bound (the interface sample's bound for every dtype: its graph computes in fp32)."""
    from ..schemes import bounds_for

    return float(bounds_for("float32").logits_rel_l2)


@dataclass
class Case:
    """One artifact's compact check, prepared on x86: the plan, the x86 runtime's and the
    reference's answers, and how it is judged."""

    plan: Plan
    x86: Outputs
    reference: list[torch.Tensor]
    bounds: Any
    quantized: bool
    #: the export's expected quantization KL (``{"kl_mean", "kl_p99"}``), ``None`` for fp32 or an old export
    expected: dict[str, float] | None = None


def prepare(directory: Any, art: Any, reference: Any, tokenizer: Any, heldout: dict | None, bounds: Any,
            quantized: bool, prompts: Sequence[torch.Tensor], expected: dict[str, float] | None) -> Case:
    """Run the artifact's compact set on its x86 runtime and in the reference; ``prompts`` are
    verify's, ``expected`` the export's expected quantization KL (``None`` for fp32)."""
    from ..runtime.drivers import driver_class

    vocab, dim = int(art.shapes["vocab_size"]), int(art.shapes["hidden_size"])
    max_seq = art.shapes.get("max_seq_len")
    length = min(HELDOUT_TOKENS, max_seq or HELDOUT_TOKENS)
    blocks = heldout.get("blocks") if isinstance(heldout, dict) else None
    held = heldout_sequence(blocks or corpus_block(tokenizer, vocab, length), vocab, length)
    driver = driver_class(art.target)(directory / art.path)
    try:
        plan = make_plan(driver, prompts, held, vocab, dim, max_seq)
        x86 = execute(plan, driver, sampled_interface(driver, vocab, dim))
    finally:
        driver.close()
    return Case(plan, x86, reference_logits(reference, plan), bounds, quantized, expected)

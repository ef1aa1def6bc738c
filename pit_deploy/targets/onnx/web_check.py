"""``verify --web``: what transformers.js computes from an ONNX folder, in Node and in a browser,
judged by the artifact's own bounds against the PyTorch reference.

Native onnxruntime passing ``verify`` says little about the web: transformers.js picks the graph
file by its own rules, onnxruntime-web's WASM build lacks some operators that native builds have
(``GatherBlockQuantized``), and its kernels differ (it ignores ``accuracy_level``). So the folder
is run, as it is, by transformers.js itself (:mod:`pit_deploy.runtime.web_clients`):

* fp32 artifacts: the verify prompts; transformers.js's full-prompt logits against the
  reference's (``logits_rel_l2`` and ``top1_agreement`` bounds) and its own greedy ``generate``
  loop against the reference's greedy continuation (identical, ``GREEDY_TOKENS`` tokens);
* quantized artifacts: the manifest's held-out blocks, the same KL figures and absolute bounds
  as the native check (:func:`pit_deploy.data.heldout.kl_parity`), plus a short greedy run for
  the decode rate.

A client that is not set up is the user's to fix (exit 2 before any work); a folder that fails
to load or run there fails the artifact, with the client's own error line.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...schemes import ParityBounds, QuantizedBounds

#: new tokens after each held-out block when a quantized artifact is run (a decode rate only)
QUANTIZED_DECODE_TOKENS = 16


@dataclass
class WebCheck:
    """One client's figures for one artifact (``error`` set when it did not run there)."""

    client: str
    passed: bool = False
    failures: list[str] = field(default_factory=list)
    error: str | None = None
    logits_rel_l2: float | None = None
    top1_agreement: float | None = None
    greedy_match: bool | None = None
    greedy_tokens: int = 0
    kl_mean: float | None = None
    kl_p99: float | None = None
    same_top1: float | None = None
    ppl_ratio: float | None = None
    load_ms: float | None = None
    prefill_ms: float | None = None
    decode_ms_per_token: float | None = None
    dtype: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Replay:
    """A driver-shaped view of logits a client already returned (``prefill`` by block), so the
    KL figures come from the very function the native check uses."""

    def __init__(self, logits: dict[tuple[int, ...], Any]):
        self.logits = logits

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.logits[tuple(int(t) for t in ids)])


def check_web_client(client: str, folder: Path, reference: Any, prompts: list[torch.Tensor],
                     bounds: ParityBounds | QuantizedBounds, greedy_tokens: int, ref_runs: dict,
                     heldout_blocks: list[list[int]] | None = None, threads: int = 1) -> WebCheck:
    """Run ``folder`` in ``client`` and judge it (see the module docstring).

    Raises:
        PitError: the client is not set up (a :class:`~pit_deploy.runtime.web_clients.WebClientFailed`
            — the folder failing there — is caught and recorded instead).
    """
    from ...data.heldout import kl_parity
    from ...runtime.web_clients import WebClientFailed, run_web_client
    from ...evaluate.bound_checks import agreement_failures, kl_failures, logit_failures, rel_l2
    from ...evaluate.verify import reference_run

    quantized = isinstance(bounds, QuantizedBounds)
    check = WebCheck(client=client)
    if quantized:
        rows = [list(map(int, row)) for row in heldout_blocks or []]
        # no position past the model's (GPT-2's position table ends there)
        config = getattr(reference, "config", None)
        positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        longest = max((len(r) for r in rows), default=0)
        n_new = QUANTIZED_DECODE_TOKENS if not positions else max(0, min(QUANTIZED_DECODE_TOKENS, positions - longest))
    else:
        rows = [[int(t) for t in p] for p in prompts]
        n_new = greedy_tokens
    try:
        run = run_web_client(client, folder, rows, n_new, threads=threads)
    except WebClientFailed as exc:
        check.error = str(exc)
        check.failures = [str(exc)]
        return check
    check.load_ms, check.prefill_ms, check.decode_ms_per_token = run.load_ms, run.prefill_ms, run.decode_ms_per_token
    check.dtype, check.versions, check.notes = run.dtype, run.versions, list(run.notes)
    fails: list[str] = []
    if quantized:
        figures = kl_parity(_Replay({tuple(r): lg for r, lg in zip(rows, run.logits)}), reference, rows)
        check.kl_mean, check.kl_p99 = figures.kl_mean, figures.kl_p99
        check.same_top1, check.ppl_ratio = figures.same_top1, figures.ppl_ratio
        fails += kl_failures(bounds, check.kl_mean, check.kl_p99)
        fails += agreement_failures(bounds, check.same_top1, check.ppl_ratio)
    else:
        errs, agree, total, same = [], 0, 0, True
        for i, prompt in enumerate(prompts):
            key = (i, len(prompt), n_new)
            if key not in ref_runs:
                ref_runs[key] = reference_run(reference, prompt, n_new)
            greedy, ref_logits = ref_runs[key]
            got = torch.from_numpy(run.logits[i])
            ref = ref_logits[: len(prompt)]
            errs.append(rel_l2(got, ref))
            agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
            total += len(prompt)
            same &= run.greedy[i] == [int(t) for t in greedy]
        check.logits_rel_l2 = max(errs) if errs else float("nan")
        check.top1_agreement = agree / max(total, 1)
        check.greedy_match, check.greedy_tokens = same, n_new
        fails += logit_failures(bounds, check.logits_rel_l2, check.top1_agreement)
        if not same:
            fails.append(f"transformers.js's greedy continuation of {n_new} tokens differs from PyTorch's")
    check.failures = [f"transformers.js in {client}: {f}" for f in fails]
    check.passed = not fails
    return check


def verify_web(ctx: Any, art: Any, result: Any) -> None:
    """Run the artifact in each of ``ctx.web_clients`` and record the checks on ``result`` (an
    ``ArtifactResult``, judged after this): the onnx target's ``verify --web`` extra."""
    from ...schemes import bounds_for
    from ...evaluate.verify import make_prompts

    bounds = bounds_for(art.scheme_name, ctx.bound_overrides.get(art.scheme_name), art.rounding)
    heldout = ctx.cache.get("heldout") or {}
    prompts = make_prompts(ctx.tokenizer, art.shapes["vocab_size"], 10**9)
    result.web = {}
    for client in ctx.web_clients:
        check = check_web_client(client, ctx.directory / art.path, ctx.reference, prompts, bounds,
                                 ctx.greedy_tokens, ctx.cache.setdefault("ref_runs", {}),
                                 heldout_blocks=heldout.get("blocks") if isinstance(heldout, dict) else None)
        result.web[client] = check.to_dict()
        if check.decode_ms_per_token:
            result.notes.append(f"transformers.js in {client}: decode {check.decode_ms_per_token:.1f} ms/token "
                                f"(prefill {check.prefill_ms or 0:.0f} ms, load {check.load_ms or 0:.0f} ms)")

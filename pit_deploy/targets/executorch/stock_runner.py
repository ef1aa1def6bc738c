"""Does ExecuTorch's stock LLM runner generate what PyTorch generates from an artifact?

``verify`` runs every ``.pte`` artifact through ``TextLLMRunner`` (the C++ runner behind
``llama_main``, :mod:`pit_deploy.targets.executorch.llm_runner`) on fixed text prompts — the
verification prompts plus, when the tokenizer has a chat template, a chat-formatted question —
greedy, with the folder's own ``tokenizer.json``. The reference encodes the same text with the
export's Hugging Face tokenizer (no special tokens added: the runner adds no BOS), decodes
greedily up to the same number of tokens (stopping at an end-of-sequence id, as the runner
does) and the two texts must be identical, as must the number of prompt tokens the two
tokenizers produce. This checks what the Python drivers cannot: the tokenizer file, the
metadata methods and the runner's own prefill/decode loop.

The runner's Python binding hands each generated piece over as ``str``: a token whose bytes are
not whole UTF-8 (a byte-level BPE token holding part of a multi-byte character) ends its
``generate`` with a ``UnicodeDecodeError``, and an id past the tokenizer's vocabulary has no
piece at all. So each prompt is compared over the reference's greedy tokens before the first
such token; the count compared is in the check's record, and a
prompt whose first token is already partial is listed as not compared, never as a match.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from .llm_runner import RUNNER_TOKENIZER, LLMRunnerError, generate

CHAT_QUESTION = "What is the capital of France?"


@dataclass
class StockRunnerCheck:
    """The stock runner's greedy texts against the reference's, prompt by prompt."""

    prompts: int = 0
    new_tokens: int = 0
    #: per compared prompt, the greedy tokens compared (fewer than ``new_tokens`` where the
    #: reference reaches a token that is not whole UTF-8 first: module docstring)
    compared_tokens: list[int] = field(default_factory=list)
    #: prompts not compared: the reference's first greedy token is already not whole UTF-8
    not_compared: list[str] = field(default_factory=list)
    identical: bool | None = None
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    answers: list[dict[str, str]] = field(default_factory=list)
    error: str | None = None
    skipped: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def runner_prompts(tokenizer: Any, text_prompts: Sequence[str]) -> list[str]:
    """The verification prompts, plus :data:`CHAT_QUESTION` in the chat template if there is one."""
    prompts = list(text_prompts)
    if getattr(tokenizer, "chat_template", None):
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": CHAT_QUESTION}],
                                                     tokenize=False, add_generation_prompt=True))
    return prompts


def eos_ids(model: Any) -> set[int]:
    """The model config's end-of-sequence ids: what the exported program's metadata declares and
    the stock runner stops at (a GGUF-converted tokenizer's own ``eos_token`` can differ)."""
    eos = getattr(model.config, "eos_token_id", None)
    ids = set() if eos is None else ({int(eos)} if isinstance(eos, int) else {int(e) for e in eos})
    return ids


def whole_utf8_prefix(tokenizer: Any, ids: Sequence[int]) -> int:
    """How many of ``ids`` come before the first token the runner cannot hand over as text: one
    whose piece is not whole UTF-8 (its decoding alone holds U+FFFD, the replacement for bytes
    that do not form a character), or an id past the tokenizer's vocabulary (a model whose
    embedding has more rows than its tokenizer has tokens: no piece to compare)."""
    size = len(tokenizer)
    for i, token in enumerate(ids):
        if int(token) >= size or "\ufffd" in tokenizer.decode([int(token)], skip_special_tokens=False):
            return i
    return len(ids)


@torch.no_grad()
def reference_text(model: Any, ids: list[int], new_tokens: int, eos: set[int]) -> list[int]:
    """Greedy ids after ``ids`` (at most ``new_tokens``; an end-of-sequence id ends it, included)."""
    out: list[int] = []
    seq = torch.tensor([ids], dtype=torch.long)
    past = None
    for _ in range(new_tokens):
        result = model(input_ids=seq, past_key_values=past, use_cache=True)
        past = result.past_key_values
        nxt = int(result.logits[0, -1].argmax())
        out.append(nxt)
        if nxt in eos:
            break
        seq = torch.tensor([[nxt]], dtype=torch.long)
    return out


def check_stock_runner(folder: Path, reference: Any, tokenizer: Any, text_prompts: Sequence[str],
                       new_tokens: int, max_seq_len: int | None,
                       reference_cache: dict[tuple[str, int], list[int]] | None = None) -> StockRunnerCheck:
    """Run the folder's ``model.pte`` through the stock runner and compare with the reference.

    ``reference_cache`` keeps the reference's greedy ids by (prompt, tokens) across the artifacts
    of one export, which all share the reference: its greedy decode runs once per prompt."""
    if tokenizer is None:
        return StockRunnerCheck(skipped="the export has no tokenizer, so the stock runner has nothing to read")
    if not (folder / RUNNER_TOKENIZER).is_file():
        return StockRunnerCheck(skipped=f"{folder.name} has no {RUNNER_TOKENIZER} (exported before the "
                                        "stock-runner tokenizer was added: re-export)")
    prompts = runner_prompts(tokenizer, text_prompts)
    encoded = [list(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    if max_seq_len:
        keep = [i for i, ids in enumerate(encoded) if len(ids) + 2 <= max_seq_len]
        prompts, encoded = [prompts[i] for i in keep], [encoded[i] for i in keep]
        new_tokens = min([new_tokens] + [max_seq_len - len(ids) for ids in encoded])
    if not prompts:
        return StockRunnerCheck(skipped="no verification prompt fits the artifact's static cache")
    check = StockRunnerCheck(prompts=len(prompts), new_tokens=new_tokens)
    eos = eos_ids(reference)
    cache = {} if reference_cache is None else reference_cache
    limits: dict[int, list[int]] = {}  # tokens comparable -> the prompts (by index) with that limit
    for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
        if (prompt, new_tokens) not in cache:
            cache[(prompt, new_tokens)] = reference_text(reference, ids, new_tokens, eos)
        limit = whole_utf8_prefix(tokenizer, cache[(prompt, new_tokens)])
        if limit == 0:
            check.not_compared.append(prompt)
        else:
            limits.setdefault(limit, []).append(i)
    if not limits:
        check.skipped = ("the reference's first greedy token of every prompt is not whole UTF-8, which the "
                         "runner's Python binding cannot pass over")
        return check
    for limit, members in sorted(limits.items()):
        try:
            results = generate(folder, [prompts[i] for i in members], limit)["results"]
        except LLMRunnerError as exc:
            check.error, check.identical = str(exc), False
            return check
        for i, got in zip(members, results):
            prompt, ids = prompts[i], encoded[i]
            want_ids = cache[(prompt, new_tokens)][:limit]
            want = tokenizer.decode(want_ids, skip_special_tokens=False)
            check.compared_tokens.append(len(want_ids))
            runner_tokens = got["runs"][0]["prompt_tokens"] if got.get("runs") else None
            check.answers.append({"prompt": prompt, "runner": got["text"], "reference": want})
            if got.get("partial_utf8") or got["text"] != want or (runner_tokens is not None and runner_tokens != len(ids)):
                at = next((k for k, (a, b) in enumerate(zip(got["text"], want)) if a != b),
                          min(len(got["text"]), len(want)))
                check.mismatches.append({"prompt": prompt, "runner_prompt_tokens": runner_tokens,
                                         "reference_prompt_tokens": len(ids), "first_differing_char": at,
                                         "runner": got["text"], "reference": want,
                                         "runner_stopped_on_partial_utf8": bool(got.get("partial_utf8"))})
    check.identical = not check.mismatches
    return check


def measure_runner_cell(cell: dict[str, Any], timeout: float) -> dict[str, Any] | None:
    """One stock-runner cell: a warm-up then ``reps`` generations in one child process; ``None``
    when the runner generated a piece that is not whole UTF-8, which ends its run before it
    reports its figures."""
    from ...errors import PitError
    from .llm_runner import pass_figures
    from ...evaluate.bench_rows import runner_row

    try:
        out = generate(cell["folder"], [cell["prompt_text"]], cell["gen_len"], threads=cell["threads"],
                       reps=cell["reps"] + 1, timeout=timeout)
    except LLMRunnerError as exc:
        raise PitError(f"{cell['label']}: {exc}") from None
    if out["results"][0].get("partial_utf8"):
        return None  # no Stats: the runner stopped inside its generate (module docstring)
    runs = out["results"][0]["runs"][1:]
    row = runner_row(cell["meta"], [pass_figures(r) for r in runs], [out["peak_rss_mb"] * 1024.0])
    # no first_divergence: the runner reports text, not token ids (verify compares its text)
    return {**row, "runner_text": out["results"][0]["text"]}

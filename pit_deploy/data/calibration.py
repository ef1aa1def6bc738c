"""The calibration text of calibrated rounding (:mod:`pit_deploy.exporters.calibrated_rounding`).

Calibrated rounding fits the rounding to the inputs each layer sees, so what it sees must be
text the model will read, and never the held-out text quantization is judged on: blocks of the
default corpus's *training* split (Python source and its docstrings; the held-out set is the
validation split, :mod:`.heldout`) in a seeded order, and a few chat turns through the model's
chat template, so the chat format's tokens are seen too. A model without a tokenizer gets seeded
random ids (a seed other than the held-out set's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: calibration tokens in all (at least); measured on the default model: studies/gptq.md
CALIBRATION_TOKENS = 8192
CALIBRATION_SEED = 1
#: chat turns (user question, no answer: the prompt format the runner feeds)
CHAT_TURNS = (
    "Write a short poem about the sea.",
    "How do I reverse a list in Python?",
    "Summarize the causes of the French Revolution in three sentences.",
    "What is the difference between a process and a thread?",
    "Give me three tips for a job interview.",
    "Translate 'good morning' into Spanish and German.",
    "Explain photosynthesis to a ten-year-old.",
    "What should I pack for a weekend of hiking?",
)


def chat_ids(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> list[int]:
    """``messages`` through the tokenizer's chat template (its ids, whatever container the
    tokenizer returns them in); a tokenizer without a template gets a lone message's text as it
    is, several messages' one a line."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    text = messages[0]["content"] if len(messages) == 1 else "".join(f"{m['content']}\n" for m in messages)
    return list(tokenizer(text)["input_ids"])


def encode_prompt(tokenizer: Any, text: str) -> torch.Tensor:
    """A user prompt as the model expects it: through its chat template when it has one (the
    format the runners and the run report feed)."""
    return torch.tensor(chat_ids(tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True),
                        dtype=torch.long)


def calibration_blocks(tokenizer: Any, config: Any, length: int) -> tuple[list[torch.Tensor], str]:
    """``(blocks, source)``: ``(1, ≤ length)`` id tensors, :data:`CALIBRATION_TOKENS` in all."""
    from .corpus import DataConfig, TextSource, TrainStream

    n_blocks = max(1, -(-CALIBRATION_TOKENS // length))
    blocks: list[torch.Tensor] = []
    if tokenizer is not None:
        cfg = DataConfig(spec="default", seq_len=length - 1, seed=CALIBRATION_SEED)
        source = TextSource(cfg)
        if source.train_refs:
            chat = [encode_prompt(tokenizer, text).tolist() for text in CHAT_TURNS]
            chat = [ids for ids in chat if ids and max(ids) < config.vocab_size]
            stream = TrainStream(source, tokenizer, cfg)
            blocks = [torch.tensor(ids[:length])[None] for ids in chat]
            blocks += [torch.tensor(stream.next_block()[0])[None] for _ in range(n_blocks)]
            if all(int(b.max()) < config.vocab_size for b in blocks):
                return blocks, (f"default corpus, training split ({n_blocks} × {length} tokens, seed "
                                f"{CALIBRATION_SEED}) and {len(chat)} chat prompts")
    gen = torch.Generator().manual_seed(CALIBRATION_SEED)
    ids = torch.randint(0, config.vocab_size, (n_blocks, length), generator=gen)
    return [row[None] for row in ids], f"seeded random ids (seed {CALIBRATION_SEED}; no tokenizer)"

#: held-out text of kinds the calibration text does not hold, shipped with the package
HELDOUT_TEXT = Path(__file__).resolve().parent / "heldout_text"


def heldout_sets(tokenizer: Any, length: int = 256) -> dict[str, list[list[int]]]:
    """Blocks of ``≤ length`` ids of three held-out kinds for judging a rounding: ``code`` (the
    default corpus's validation split — the same kind as the training split the calibration
    reads, other files), ``prose`` (English stories and explanations, ``heldout_text/prose.txt``)
    and ``chat`` (user/assistant turns through the chat template, ``heldout_text/chat.jsonl``);
    written for this project, none of it in the calibration text."""
    import json

    from .corpus import DataConfig, TextSource, validation_blocks

    cfg = DataConfig(spec="default", seq_len=length - 1)
    code = validation_blocks(TextSource(cfg), tokenizer, cfg, 8)
    sets = {"code": code.ids.tolist() if code is not None else []}
    prose = tokenizer((HELDOUT_TEXT / "prose.txt").read_text(encoding="utf-8"))["input_ids"]
    chat: list[int] = []
    for line in (HELDOUT_TEXT / "chat.jsonl").read_text(encoding="utf-8").splitlines():
        turn = json.loads(line)
        chat += chat_ids(tokenizer, [{"role": "user", "content": turn["user"]},
                                     {"role": "assistant", "content": turn["assistant"]}])
    sets["prose"] = [list(prose[i:i + length]) for i in range(0, len(prose) - 16, length)]
    sets["chat"] = [chat[i:i + length] for i in range(0, len(chat) - 16, length)]
    return sets

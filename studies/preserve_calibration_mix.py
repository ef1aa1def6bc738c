"""How the calibration mix of the `preserve` conversion (corpus tokens, number of chat prompts)
moves its held-out KL on the default model: the measurement behind the default calibration
(studies/conversion-preserve.md). Fits from token-weighted mixes of calibration statistics;
held-out code and chat sets as in ``studies/conversion.py``.

    python studies/preserve_calibration_mix.py [--out studies/results/preserve_calibration_mix.json]
"""
import argparse, os, sys, time
from pathlib import Path
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent))
from conversion import chat_sequences  # noqa
from pit_deploy.converters.preserve import calibration_set, calibration_stats, fit_symmetric, chat_rows, CALIB_PROMPTS
from preserve_probe import SourceHead  # noqa
from pit_deploy.data.corpus import DataConfig, TextSource, validation_blocks
from pit_deploy.io.result_file import write_result  # noqa

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", default="studies/results/preserve_calibration_mix.json")
args = parser.parse_args()
FIRST8, MORE = CALIB_PROMPTS[:8], CALIB_PROMPTS[8:32]  # the first default, and the 24 prompts added
torch.set_num_threads(2)
head = SourceHead()
model, tok, u, h_inv, a, K = head.model, head.tokenizer, head.u, head.h_inv, head.a, head.k
states, kl = head.states, head.kl


cfg = DataConfig(spec="default", seq_len=256)
block = validation_blocks(TextSource(cfg), tok, cfg, 8)
n_code, lp_code = states([(r, 1) for r in block.ids])
n_chat, lp_chat = states(chat_sequences(model, tok))
t0 = time.time()
chat8 = chat_rows(model, tok, FIRST8)
chat24 = chat_rows(model, tok, MORE)
print("chat rows", time.time() - t0, flush=True)
code8k = calibration_set(model, tok, tokens=8192, chat=False).rows
print("code rows", len(code8k), flush=True)
stats_cache = {}


def stats_of(name, rows):
    if name not in stats_cache:
        stats_cache[name] = calibration_stats(model, rows, u)
    return stats_cache[name]


def combine(parts):
    """token-weighted mix of calibration statistics"""
    tot = sum(s.tokens for s in parts)
    c = sum(s.second_moment * s.tokens for s in parts) / tot
    f = sum(s.fisher * s.tokens for s in parts) / tot
    return c, f, tot


parts = {
    "code2k": stats_of("code2k", code8k[:6]),  # ~1.6k tokens code (what the default mixes with 8 chat rows)
    "code8k": stats_of("code8k", code8k),
    "chat8": stats_of("chat8", chat8),
    "chat24": stats_of("chat24", chat24),
}
mixes = {
    "default(code2k+chat8)": ["code2k", "chat8"],
    "code8k+chat8": ["code8k", "chat8"],
    "code2k+chat8+chat24": ["code2k", "chat8", "chat24"],
    "code8k+chat8+chat24": ["code8k", "chat8", "chat24"],
    "chat8+chat24": ["chat8", "chat24"],
}
res = {}
for name, keys in mixes.items():
    c, f, tot = combine([parts[k] for k in keys])
    gm = fit_symmetric(a, c, h_inv @ f @ h_inv)
    res[name] = {"tokens": tot, "code": kl(gm, n_code, lp_code), "chat": kl(gm, n_chat, lp_chat)}
    print(name, res[name], flush=True)
write_result(args.out, res, __file__)

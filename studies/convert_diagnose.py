"""Time conversion and diagnosis of the default model, and measure how much each T init
disturbs the source model. Writes JSON.

    python studies/convert_diagnose.py [--model default] [--out studies/results/convert_diagnose.json]

Measured per run, side by side on one machine:
* load time of the source (GGUF de-quantization included);
* interface metrics of the source (TT) and their wall time;
* for each T init (identity, input, output): conversion time (polar decomposition + install),
  PIT interface metrics and their wall time;
* disturbance of the source: mean next-token NLL on blocks of the Python standard library's
  source (the default corpus) for the source model and each converted model, and the mean
  KL(source ‖ PIT) of the next-token distributions.
"""

from __future__ import annotations

import argparse
import copy
import platform
import sysconfig
import time
from pathlib import Path

import torch

from pit_deploy.analysis.diagnostics import diagnose_model
from pit_deploy.converters.conversion import convert_model
from pit_deploy.io.sources import load_source
from pit_deploy.model.core import T_INITS

from pit_deploy.io.result_file import write_result  # noqa: E402

# A fixed, small slice of the stdlib: the same files on every CPython 3.x.
SAMPLE_FILES = ("textwrap.py", "heapq.py", "bisect.py", "fnmatch.py", "colorsys.py", "shlex.py")


def stdlib_blocks(tokenizer, n_blocks: int, block: int) -> torch.Tensor:
    """``(n_blocks, block)`` token ids from :data:`SAMPLE_FILES`, concatenated in order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    text = "\n\n".join((root / name).read_text(encoding="utf-8") for name in SAMPLE_FILES)
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    need = n_blocks * block
    if ids.numel() < need:
        raise SystemExit(f"sample has {ids.numel()} tokens, need {need}")
    return ids[:need].view(n_blocks, block)


@torch.no_grad()
def nll_and_logprobs(model, blocks: torch.Tensor) -> tuple[float, torch.Tensor]:
    logits = model(blocks).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    nll = -logp.gather(-1, blocks[:, 1:, None]).mean()
    return float(nll), logp


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--out", default="studies/results/convert_diagnose.json")
    args = parser.parse_args(argv)

    loaded, load_s = timed(lambda: load_source(args.model))
    source = loaded.model
    blocks = stdlib_blocks(loaded.tokenizer, args.blocks, args.block_size)
    src_nll, src_logp = nll_and_logprobs(source, blocks)
    tt_report, tt_diag_s = timed(lambda: diagnose_model(source))
    result: dict = {
        "model": args.model,
        "source": loaded.source,
        "machine": {"platform": platform.platform(), "torch_threads": torch.get_num_threads()},
        "load_seconds": load_s,
        "eval_tokens": int(blocks.numel()),
        "source_tt": {"metrics": tt_report.to_dict(), "diagnose_seconds": tt_diag_s, "nll": src_nll},
        "pit": {},
    }
    for t_init in T_INITS:
        model = copy.deepcopy(source)
        _, convert_s = timed(lambda: convert_model(model, t_init))
        report, diag_s = timed(lambda: diagnose_model(model))
        nll, logp = nll_and_logprobs(model, blocks)
        kl = float((src_logp.exp() * (src_logp - logp)).sum(-1).mean())
        result["pit"][t_init] = {
            "convert_seconds": convert_s,
            "diagnose_seconds": diag_s,
            "metrics": report.to_dict(),
            "nll": nll,
            "kl_from_source": kl,
        }
        print(f"{t_init:>8}: convert {convert_s:.2f}s diagnose {diag_s:.2f}s "
              f"delta_ti {report.delta_ti:.2e} nll {nll:.3f} (source {src_nll:.3f}) KL {kl:.3f}")
    result["least_disturbing_t_init"] = min(result["pit"], key=lambda k: result["pit"][k]["kl_from_source"])
    return write_result(args.out, result, __file__, argv)


if __name__ == "__main__":
    raise SystemExit(main())

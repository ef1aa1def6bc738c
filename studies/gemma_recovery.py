"""How far a Gemma 2/3 PIT model is from its source after ``convert`` and after distillation:
held-out KL from the source and the change of held-out NLL on code, prose and chat text, the
same blocks and scores as ``studies/gemma_conversion.py`` (four BOS-led blocks of 256 tokens of
each kind), for each PIT model given.

    python studies/gemma_recovery.py --source DIR --model NAME=PIT_DIR [--model NAME=PIT_DIR …]
        [--out studies/results/gemma_recovery.json]

``DIR`` is the Hugging Face folder of the source (with its tokenizer); each ``PIT_DIR`` a PIT
model made from it, e.g. ``pit-deploy convert DIR --out PIT_DIR --accept-loss`` or the ``model``
folder of ``pit-deploy train --model DIR --distill --distill-weight 1 …``. The run's commands
and the reading are in ``studies/gemma-conversion.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemma_conversion import blocks, logprobs, scores  # noqa: E402

from pit_deploy.io.result_file import write_result  # noqa: E402
from pit_deploy.io.sources import load_source  # noqa: E402
from pit_deploy.model.inspect import interface_delta_ti  # noqa: E402


def named(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise SystemExit(f"error: --model takes NAME=PIT_DIR, got {spec!r}")
    return name, path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", required=True, help="the Hugging Face folder of the Gemma 2/3 source")
    ap.add_argument("--model", action="append", required=True, type=named, help="NAME=PIT_DIR (repeatable)")
    ap.add_argument("--out", default="studies/results/gemma_recovery.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    src = load_source(args.source)
    sets = blocks(src.tokenizer)
    ref = logprobs(src.model, sets)
    del src
    results: dict = {"source": os.path.basename(os.path.normpath(args.source)), "models": {}}
    for name, path in args.model:
        loaded = load_source(path)
        row = {"delta_ti": interface_delta_ti(loaded.model), "pit": {k: loaded.model.config.pit.get(k)
                                                                     for k in ("t_init", "init")},
               "scores": scores(ref, logprobs(loaded.model, sets), sets)}
        train = Path(path).parent / "summary.json"
        if train.is_file():
            summary = json.loads(train.read_text())
            row["train"] = {k: summary.get(k) for k in ("steps", "tokens", "final_train_loss", "median_step_time_s")}
        results["models"][name] = row
        print(name, json.dumps(row["scores"]), flush=True)
        del loaded
    return write_result(args.out, results, __file__, argv)


if __name__ == "__main__":
    raise SystemExit(main())

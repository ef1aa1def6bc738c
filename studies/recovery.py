"""Recovery after conversion: LM-only vs distillation, for each ``T`` init, same budget.

Converting a pretrained tied model to PIT disturbs it (its loss jumps from the source's ~2.5
to ~9–10 on code). This script converts the default model (SmolLM2-135M-Instruct) with each
``T`` init (identity, input = H⁻¹, output = H), trains all weights (``Z`` frozen, AdamW at
``--lr``, ``T`` at ``--lr-t``) for the same token budget once with the LM loss only and once
with ``--distill`` (KL to the frozen source model's logits, mixed with the LM loss by
``--distill-weight``), and writes the step-0 and final validation loss of every run next to
the source model's validation loss on the same held-out blocks.

    python studies/recovery.py --steps 6 --seq-len 128 --batch-size 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from pit_deploy.io.result_file import write_result  # noqa: E402


@torch.no_grad()
def source_val_loss(args) -> float:
    """Validation loss of the unconverted source (TT) model on the runs' held-out blocks."""
    from pit_deploy.data.corpus import DataConfig, TextSource, validation_blocks
    from pit_deploy.io.sources import load_source
    from pit_deploy.training.loss import token_loss

    loaded = load_source(args.model)
    dcfg = DataConfig(args.data, seq_len=args.seq_len, seed=args.seed)
    val = validation_blocks(TextSource(dcfg), loaded.tokenizer, dcfg, args.eval_blocks)
    total, count = 0.0, 0.0
    for i in range(0, val.ids.shape[0], args.batch_size):
        ids, mask = val.ids[i : i + args.batch_size], val.mask[i : i + args.batch_size, 1:]
        logits = loaded.model(input_ids=ids[:, :-1], use_cache=False).logits
        total += float(token_loss(logits, ids[:, 1:], mask)) * float(mask.sum())
        count += float(mask.sum())
    return total / count


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--data", default="default")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lr-t", type=float, default=1e-3)
    p.add_argument("--distill-weight", type=float, default=0.5)
    p.add_argument("--eval-blocks", type=int, default=4)
    p.add_argument("--t-inits", default="identity,input,output")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--out", default="studies/results/recovery_cpu.json")
    args = p.parse_args(argv)

    from pit_deploy.analysis.plotting import RunLog, plot_runs
    from pit_deploy.training.loop import TrainConfig, train

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="pit-recovery-"))
    report = {
        "benchmark": "recovery",
        "torch": torch.__version__,
        "settings": vars(args),
        "tokens_per_run": args.steps * args.batch_size * args.seq_len,
    }
    print("[recovery] source model validation loss", file=sys.stderr, flush=True)
    report["source_tt_val_loss"] = source_val_loss(args)
    runs, logs = {}, []
    for t_init in args.t_inits.split(","):
        for mode in ("lm", "distill"):
            name = f"{t_init}-{mode}"
            print(f"[recovery] {name}", file=sys.stderr, flush=True)
            cfg = TrainConfig(
                out=str(work / name), model=args.model, tying="pit", data=args.data, t_init=t_init,
                seq_len=args.seq_len, batch_size=args.batch_size, steps=args.steps, lr=args.lr,
                lr_t=args.lr_t, warmup_steps=0, distill=mode == "distill",
                distill_weight=args.distill_weight, eval_every=args.steps, eval_blocks=args.eval_blocks,
                seed=args.seed, device=args.device, force=True, plot=False, progress=False,
            )
            res = train(cfg)
            log = RunLog.load(work / name, label=name)
            logs.append(log)
            runs[name] = {"t_init": t_init, "mode": mode, "step0_val_loss": res.initial_val_loss,
                          "final_val_loss": res.final_val_loss, "final_train_loss": res.final_train_loss,
                          "recovered": res.initial_val_loss - res.final_val_loss,
                          "median_step_time_s": res.median_step_time_s, "curves": log.curves(),
                          "summary": asdict(res)}
    report["runs"] = runs
    report["table"] = [
        {"t_init": t, **{f"{m}_final_val_loss": runs[f"{t}-{m}"]["final_val_loss"] for m in ("lm", "distill")},
         "step0_val_loss": runs[f"{t}-lm"]["step0_val_loss"]}
        for t in args.t_inits.split(",")
    ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot_runs(logs, out.with_suffix(".png"), title="recovery after conversion: LM-only vs distill")
    report["plot"] = out.with_suffix(".png").name
    print(json.dumps({"source_tt_val_loss": report["source_tt_val_loss"], "table": report["table"]}, indent=2))
    return write_result(out, report, __file__, argv)


if __name__ == "__main__":
    sys.exit(main())

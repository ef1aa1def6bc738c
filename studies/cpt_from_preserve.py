"""Continued pretraining from the source's own loss: PIT (``--t-init preserve``) against TT
(the source model, tied as it ships), same data, budget and seed, over a grid of learning rates
and warm-ups; writes JSON + PNG.

The question (issue: training from the preserved start): at which learning rate and warm-up do
PIT and TT continued pretraining *both* end below their step-0 validation loss, so the defaults
never undo what the conversion kept? Each run is ``pit_deploy.training.loop.train`` on the default
model and corpus (LM loss only, all weights, ``Z`` frozen for PIT), evaluated on the same
held-out blocks every ``--eval-every`` steps.

    python studies/cpt_from_preserve.py --steps 32 --lrs 3e-6,1e-5,3e-5 --warmups 4
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from pit_deploy.io.result_file import write_result  # noqa: E402


def run_one(args, tying: str, lr: float, warmup: int, work: Path) -> dict:
    from pit_deploy.analysis.plotting import RunLog
    from pit_deploy.training.loop import TrainConfig, train

    name = f"{tying}-lr{lr:g}-wu{warmup}"
    cfg = TrainConfig(
        out=str(work / name), model=args.model, tying=tying, data=args.data, seq_len=args.seq_len,
        batch_size=args.batch_size, steps=args.steps, lr=lr, warmup_steps=warmup, weight_decay=0.0,
        t_init="preserve", eval_every=args.eval_every, eval_blocks=args.eval_blocks, seed=args.seed,
        device="cpu", force=True, plot=False, progress=False,
    )
    start = time.perf_counter()
    summary = work / name / "summary.json"
    if args.reuse_runs and summary.is_file():  # a finished run of an earlier invocation
        from pit_deploy.training.loop import TrainResult

        res = TrainResult(**json.loads(summary.read_text()))
    else:
        res = train(cfg)
    log = RunLog.load(work / name, label=f"{tying.upper()} lr {lr:g} warm-up {warmup}")
    curves = log.curves()
    return {"tying": tying, "lr": lr, "warmup_steps": warmup, "wall_s": time.perf_counter() - start,
            "median_step_time_s": res.median_step_time_s,
            "initial_val_loss": res.initial_val_loss, "final_val_loss": res.final_val_loss,
            "best_val_loss": min(curves["val_loss"]) if curves["val_loss"] else None,
            "peak_rise": (max(curves["val_loss"]) - res.initial_val_loss) if curves["val_loss"] else None,
            "improved": res.final_val_loss is not None and res.final_val_loss < res.initial_val_loss,
            "change": None if res.final_val_loss is None else res.final_val_loss - res.initial_val_loss,
            "summary": asdict(res), "curves": curves, "_log": log}


def plot_validation(runs: list[dict], png: Path, title: str) -> None:
    """Validation curves only (the training loss follows each batch's content and hides them):
    one colour per learning rate, TT solid, PIT dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    rates = sorted({(r["lr"], r["warmup_steps"]) for r in runs})
    for r in runs:
        c = r["curves"]
        ax.plot(c["eval_tokens"], c["val_loss"], color=f"C{rates.index((r['lr'], r['warmup_steps']))}",
                ls="-" if r["tying"] == "tt" else "--", marker="o", ms=3,
                label=f"{r['tying'].upper()} lr {r['lr']:g}, warm-up {r['warmup_steps']}")
    ax.set_xlabel("tokens")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--data", default="default")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lrs", default="3e-6,1e-5,3e-5")
    p.add_argument("--warmups", default="4")
    p.add_argument("--eval-every", type=int, default=8)
    p.add_argument("--eval-blocks", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--reuse-runs", action="store_true", help="keep finished runs found in --work-dir")
    p.add_argument("--out", default="studies/results/cpt_from_preserve_cpu.json")
    args = p.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="cpt-preserve-"))
    lrs = [float(x) for x in args.lrs.split(",")]
    warmups = [int(x) for x in args.warmups.split(",")]
    runs = []
    for lr in lrs:
        for warmup in warmups:
            for tying in ("tt", "pit"):
                print(f"[bench] {tying} lr {lr:g} warm-up {warmup}", file=sys.stderr, flush=True)
                runs.append(run_one(args, tying, lr, warmup, work))
                r = runs[-1]
                print(f"[bench]   val {r['initial_val_loss']:.4f} -> {r['final_val_loss']:.4f}", file=sys.stderr, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    plot_validation(runs, png, f"validation loss, PIT (preserve) vs TT, {args.steps} steps of "
                               f"{args.batch_size}x{args.seq_len} tokens (CPU)")
    table = [{k: r[k] for k in ("tying", "lr", "warmup_steps", "initial_val_loss", "final_val_loss", "best_val_loss",
                                "peak_rise", "change", "improved")} for r in runs]
    both = sorted({(r["lr"], r["warmup_steps"]) for r in runs
                   if all(o["improved"] for o in runs if (o["lr"], o["warmup_steps"]) == (r["lr"], r["warmup_steps"]))})
    report = {
        "benchmark": "cpt_from_preserve",
        "device": f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__, "settings": vars(args),
        "tokens_per_run": args.steps * args.batch_size * args.seq_len,
        "both_improve": [{"lr": lr, "warmup_steps": wu} for lr, wu in both],
        "table": table,
        "runs": [{k: v for k, v in r.items() if k != "_log"} for r in runs],
        "plot": png.name,
    }
    for row in table:
        print(json.dumps(row))
    print(f"both improve at: {report['both_improve']}")
    return write_result(out, report, __file__, argv)


if __name__ == "__main__":
    sys.exit(main())

"""PIT against transpose tying (TT): same model, data, budget and seed; writes JSON + PNG.

Why: training a PIT model should cost about what training the tied model costs (the paper
claims comparable runtime; goal: step time PIT/TT ≤ 1.03); this measures it on the training
loop as shipped, so a change to the loop, the PIT layers or torch can be re-checked.

Runs ``pit_deploy.training.train`` twice (``--tying tt`` and ``--tying pit``) on the real default
model (SmolLM2-135M-Instruct) and the default corpus (stdlib sources), then times both
training steps *interleaved* on the same batch (PIT, TT, PIT, TT, ...) so that a noisy shared
machine slows both alike. Reports the step-time ratio PIT/TT (the paper claims comparable
runtime; goal ≤ 1.03), final train and validation loss of both, and the loss curves.

    python benchmarks/train_pit_vs_tt.py --tokens 8192 --seq-len 256 --batch-size 2
    python benchmarks/train_pit_vs_tt.py --device cuda --tokens 2000000 --batch-size 16 \\
        --precision bf16 --out benchmarks/results/train_pit_vs_tt_cuda.json

``--model`` and ``--data`` take what ``pit-deploy train`` takes (a local checkpoint directory,
local text files).

Speed is measured here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from pit_deploy.io.result_file import write_result


def interleaved_step_times(args, device: torch.device) -> dict:
    """Median training-step time of PIT and TT, alternating on one fixed batch. Each step is
    the training loop's own ``TrainingRecipe.train_step`` (accumulation, clipping, AdamW,
    retraction), on recipes built without a run directory."""
    from pit_deploy.training.loop import TrainConfig, TrainingRecipe

    runs = {}
    for tying in ("pit", "tt"):
        cfg = TrainConfig(out="-", model=args.model, tying=tying, data=args.data, seq_len=args.seq_len,
                          batch_size=args.batch_size, steps=1, lr=args.lr, lr_t=args.lr_t, t_init=args.t_init,
                          precision=args.precision, seed=args.seed, device=str(device), progress=False)
        runs[tying] = TrainingRecipe(cfg).setup(write=False)
    batch = runs["pit"].stream.next_batch(runs["pit"].blocks_per_step)

    times = {"pit": [], "tt": []}
    for i in range(args.timing_steps + 1):
        order = ("pit", "tt") if i % 2 == 0 else ("tt", "pit")
        for name in order:
            dt = runs[name].train_step(batch).seconds
            if i > 0:  # first round is warm-up
                times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    # On a shared CPU other jobs only ever add time: the minimum is the least disturbed
    # estimate; the median is reported next to it.
    return {"pit_median_s": med["pit"], "tt_median_s": med["tt"], "ratio_pit_over_tt": med["pit"] / med["tt"],
            "pit_min_s": best["pit"], "tt_min_s": best["tt"], "ratio_of_min_pit_over_tt": best["pit"] / best["tt"],
            "pit_times_s": times["pit"], "tt_times_s": times["tt"],
            "tokens_per_step": args.batch_size * args.seq_len}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--data", default="default")
    p.add_argument("--tokens", type=int, default=8192, help="token budget of each run")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lr-t", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--t-init", default="output")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--eval-blocks", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--timing-steps", type=int, default=6, help="interleaved timing rounds (0: skip)")
    p.add_argument("--work-dir", default=None, help="where the two runs go (default: a temp dir)")
    p.add_argument("--reuse-runs", action="store_true", help="keep finished runs found in --work-dir (re-time only)")
    p.add_argument("--out", default="benchmarks/results/train_pit_vs_tt_cpu.json")
    args = p.parse_args(argv)

    from pit_deploy.analysis.plotting import RunLog, plot_runs
    from pit_deploy.training.loop import TrainConfig, train

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="pit-vs-tt-"))
    results, runs = {}, []
    for tying in ("tt", "pit"):
        cfg = TrainConfig(
            out=str(work / tying), model=args.model, tying=tying, data=args.data, seq_len=args.seq_len,
            batch_size=args.batch_size, grad_accum=args.grad_accum, tokens=args.tokens, lr=args.lr,
            lr_t=args.lr_t, warmup_steps=args.warmup_steps, t_init=args.t_init, precision=args.precision,
            eval_every=args.eval_every, eval_blocks=args.eval_blocks, seed=args.seed, device=str(device),
            force=True, plot=False, progress=sys.stderr.isatty(),
        )
        summary = work / tying / "summary.json"
        if args.reuse_runs and summary.is_file():
            from pit_deploy.training.loop import TrainResult

            res = TrainResult(**json.loads(summary.read_text()))
        else:
            print(f"[bench] training {tying} for {args.tokens} tokens", file=sys.stderr, flush=True)
            res = train(cfg)
        log = RunLog.load(work / tying, label=tying.upper())
        runs.append(log)
        results[tying] = {**asdict(res), "curves": log.curves(),
                          "delta_ti_logged_max": max(r["delta_ti"] for r in log.train)}
    timing = None
    if args.timing_steps > 0:
        print("[bench] interleaved step timing", file=sys.stderr, flush=True)
        timing = interleaved_step_times(args, device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    plot_runs(runs, png, title=f"{args.model}: PIT vs TT, {args.tokens} tokens ({device.type})")
    report = {
        "benchmark": "train_pit_vs_tt",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "settings": vars(args),
        "step_time_ratio_pit_over_tt": timing["ratio_pit_over_tt"] if timing else None,
        "step_time_ratio_of_min_pit_over_tt": timing["ratio_of_min_pit_over_tt"] if timing else None,
        "step_time_ratio_from_runs": results["pit"]["median_step_time_s"] / results["tt"]["median_step_time_s"],
        "interleaved_timing": timing,
        "final": {k: {"train_loss": v["final_train_loss"], "val_loss": v["final_val_loss"],
                      "initial_val_loss": v["initial_val_loss"]} for k, v in results.items()},
        "runs": results,
        "plot": png.name,
    }
    keys = ("step_time_ratio_pit_over_tt", "step_time_ratio_of_min_pit_over_tt", "step_time_ratio_from_runs", "final")
    print(json.dumps({k: report[k] for k in keys}, indent=2))
    return write_result(out, report, __file__, argv)


if __name__ == "__main__":
    sys.exit(main())

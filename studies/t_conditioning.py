"""Which remedy keeps ``T`` well conditioned, and so ``W_out E = I``, at the least cost in loss?

The question (issue "The core promise"): PIT training from the ``preserve`` conversion of a tiny
Llama whose embedding has the default model's scale and 100× spread of singular values lets
``T``'s smallest eigenvalue collapse within 30 steps at lr 3e-3 while ``L``'s diagonal stays
put, and ``delta_ti`` grows by three orders of magnitude. Each candidate below trains the same
converted model on the same data with the same seeds; a candidate differs from ``none`` only in
how ``T`` is parameterized, clamped or floored, or in its learning rate:

* ``none``: the Cholesky parameterization as the paper gives it, no clamp;
* ``paper-clamp``: the paper's optional clamp of ``L``'s diagonal, ``L_ii ≥ ½ min L_ii`` at the start;
* ``relative-diag``: ``L_ii ≥ 0.01 · max L_ii``, the floor relative to the current scale;
* ``lr-t/10``: ``T``'s factor at a tenth of the rate (``--lr-t``);
* ``expm``: ``T = exp(S)`` with ``S`` symmetric, a parameterization whose additive steps are
  multiplicative in ``T`` (``L`` is then the Cholesky factor of ``exp(S)``);
* ``cap-K``: ``cond(T) ≤ K`` by raising ``T``'s smallest eigenvalues after every step
  (``--t-max-cond K``, ``PITInterface.floor_spectrum_``).

Per run: the held-out loss at the end, the mean training loss of the last ten steps, the largest
``delta_ti`` and ``cond(T)``, the smallest eigenvalue of ``T``, the steps at which the floor
acted and the median step time. Figures: ``studies/t-conditioning.md``.

    python studies/t_conditioning.py --seeds 10 --lrs 3e-3,1e-2
    python studies/t_conditioning.py --families     # every tiny family at lr 0.1, floor off / on
    python studies/t_conditioning.py --table studies/results/t_conditioning.json   # the docs' tables
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from pit_deploy.io.result_file import write_result  # noqa: E402

from pit_deploy.io.checkpoint import save_model  # noqa: E402
from pit_deploy.model.core import PITInterface  # noqa: E402
from pit_deploy.training.loop import TrainConfig, TrainingRecipe  # noqa: E402
from pit_deploy.io.metrics import read_metrics  # noqa: E402

Hook = Callable[[PITInterface], None]


def paper_clamp(interface: PITInterface) -> None:
    """The paper's clamp of ``L``'s diagonal, set at half its smallest starting value."""
    floor = float(torch.diagonal(interface.cholesky_factor().detach()).min()) / 2
    interface.spec = replace(interface.spec, clamp_min=floor)


def relative_diag(interface: PITInterface, eps: float = 0.01) -> None:
    """``L_ii ≥ eps · max L_ii`` (the maximum not differentiated through)."""
    base = interface.cholesky_factor

    def floored() -> torch.Tensor:
        lf = base()
        diag = torch.diagonal(lf)
        return torch.tril(lf, -1) + torch.diag_embed(torch.maximum(diag, eps * diag.max().detach()))

    interface.cholesky_factor = floored  # type: ignore[method-assign]


def matrix_exp(interface: PITInterface) -> None:
    """``T = exp(S)``: ``S = log T`` at the start, trained instead of ``L``'s entries."""
    lf = interface.cholesky_factor().detach().to(torch.float64)
    evals, evecs = torch.linalg.eigh(lf @ lf.T)
    interface.register_parameter("S", torch.nn.Parameter(((evecs * evals.log()) @ evecs.T).float()))
    interface.L_diag.requires_grad_(False)
    interface.L_offdiag.requires_grad_(False)

    def factor() -> torch.Tensor:
        with torch.autocast(device_type=interface.S.device.type, enabled=False):
            t = torch.linalg.matrix_exp(0.5 * (interface.S + interface.S.T))
            return torch.linalg.cholesky(0.5 * (t + t.T))

    interface.cholesky_factor = factor  # type: ignore[method-assign]


#: candidate → (interface hook, TrainConfig overrides given the learning rate)
CANDIDATES: dict[str, tuple[Hook | None, Callable[[float], dict]]] = {
    "none": (None, lambda lr: {"t_max_cond": 0.0}),
    "paper-clamp": (paper_clamp, lambda lr: {"t_max_cond": 0.0}),
    "relative-diag": (relative_diag, lambda lr: {"t_max_cond": 0.0}),
    "lr-t/10": (None, lambda lr: {"t_max_cond": 0.0, "lr_t": lr / 10}),
    "expm": (matrix_exp, lambda lr: {"t_max_cond": 0.0}),
    "cap-1e4": (None, lambda lr: {"t_max_cond": 1e4}),
    "cap-1e3": (None, lambda lr: {"t_max_cond": 1e3}),
    "cap-1e2": (None, lambda lr: {"t_max_cond": 1e2}),
}


class Candidate(TrainingRecipe):
    """The recipe with ``hook`` applied to the interface before the optimizer is built."""

    hook: Hook | None = None

    def _setup_model(self) -> None:
        super()._setup_model()
        if self.hook is not None:
            self.hook(self.interface)


def converted_model(work: Path) -> Path:
    """The tiny Llama with the default model's embedding scale, converted with ``preserve``
    once and saved, so every run starts from the same PIT checkpoint."""
    from pit_deploy.converters.conversion import convert_model
    from pit_deploy.tiny import tiny_model, tiny_tokenizer, widen_embedding_spectrum

    path = work / "tiny-llama-pit"
    tokenizer = tiny_tokenizer()
    model = convert_model(widen_embedding_spectrum(tiny_model("llama")), "preserve", tokenizer=tokenizer)
    save_model(model, path, tokenizer)
    return path


def run(args: argparse.Namespace, model: Path, work: Path, name: str, lr: float, seed: int) -> dict:
    hook, overrides = CANDIDATES[name]
    out = work / f"{name.replace('/', '-')}-{lr:g}-{seed}"
    cfg = TrainConfig(out=str(out), model=str(model), data=args.data, seq_len=args.seq_len,
                      batch_size=args.batch_size, steps=args.steps, lr=lr, eval_every=args.steps,
                      eval_blocks=args.eval_blocks, seed=seed, device="cpu", max_delta_ti=0.0, force=True,
                      progress=False, plot=False, **overrides(lr))
    recipe = Candidate(cfg)
    recipe.hook = hook
    start = time.perf_counter()
    try:
        recipe.setup()
        recipe.train()
    finally:
        recipe.cleanup()
    train = read_metrics(out, "train")
    evals = read_metrics(out, "eval")
    return {
        "candidate": name, "seed": seed, "seconds": round(time.perf_counter() - start, 2),
        "val_loss_start": evals[0]["val_loss"], "val_loss_end": evals[-1]["val_loss"],
        "train_loss_last10": statistics.fmean(r["loss"] for r in train[-10:]),
        "max_delta_ti": max(r["delta_ti"] for r in train),
        "max_cond": max(r["t_cond"] for r in train),
        "min_eig": min(r["t_eig_min"] for r in train),
        "floored_steps": sum(r["t_floored"] for r in train),
        "median_step_s": statistics.median(r["step_time"] for r in train),
        "delta_ti": [r["delta_ti"] for r in train], "cond": [r["t_cond"] for r in train],
        "l_diag_min": [r["l_diag_min"] for r in train], "l_diag_max": [r["l_diag_max"] for r in train],
    }


def summarize(runs: list[dict], baseline: list[dict] | None) -> dict:
    """Means over seeds, extremes over runs, and the held-out loss paired with ``none``'s run
    of the same seed (same data order), which the seed-to-seed spread would otherwise hide."""

    def stat(key: str, fn=statistics.fmean) -> float:
        return fn(r[key] for r in runs)

    def sd(values: list[float]) -> float:
        return statistics.stdev(values) if len(values) > 1 else 0.0

    paired = [r["val_loss_end"] - b["val_loss_end"] for r, b in zip(runs, baseline or [])]
    return {"val_loss_end_mean": stat("val_loss_end"), "val_loss_end_sd": sd([r["val_loss_end"] for r in runs]),
            "val_loss_vs_none_mean": statistics.fmean(paired) if paired else None,
            "val_loss_vs_none_sd": sd(paired) if paired else None,
            "train_loss_last10_mean": stat("train_loss_last10"), "max_delta_ti": stat("max_delta_ti", max),
            "max_cond": stat("max_cond", max), "min_eig": stat("min_eig", min),
            "floored_steps_mean": stat("floored_steps"), "median_step_s": stat("median_step_s", statistics.median),
            "l_diag_min_first_step": min(r["l_diag_min"][0] for r in runs),
            "l_diag_min_last_step": min(r["l_diag_min"][-1] for r in runs),
            "l_diag_max_last_step": max(r["l_diag_max"][-1] for r in runs)}


def families(args: argparse.Namespace, work: Path) -> dict:
    """Every tiny family as built (``pit_deploy.tiny``), default conversion, ``--family-steps``
    steps at ``--family-lr`` without warm-up, with and without the floor: what the tests'
    high-rate check guards against."""
    from pit_deploy.tiny import ALL_FAMILIES, tiny_model, tiny_tokenizer
    from pit_deploy.training.loop import train

    rows: dict[str, dict] = {}
    for family in ALL_FAMILIES:
        source = work / f"tiny-{family}"
        save_model(tiny_model(family), source, tiny_tokenizer())
        for floor in ("off", "1e3"):
            out = work / f"{family}-{floor}"
            train(TrainConfig(out=str(out), model=str(source), data=args.data, seq_len=32, batch_size=4,
                              steps=args.family_steps, lr=args.family_lr, warmup_steps=0, eval_every=0, seed=0,
                              device="cpu", t_max_cond=0.0 if floor == "off" else 1e3, max_delta_ti=0.0, force=True,
                              progress=False, plot=False))
            records = read_metrics(out, "train")
            rows.setdefault(family, {})[floor] = {
                "max_delta_ti": max(r["delta_ti"] for r in records), "max_cond": max(r["t_cond"] for r in records),
                "floored_steps": sum(r["t_floored"] for r in records),
                "loss_first": records[0]["loss"], "loss_last": records[-1]["loss"]}
            row = rows[family][floor]
            print(f"{family:8s} floor {floor:4s} max delta_ti {row['max_delta_ti']:.2e}  max cond {row['max_cond']:.3g}  "
                  f"floored {row['floored_steps']}  loss {row['loss_first']:.2f} → {row['loss_last']:.2f}", flush=True)
    return rows


def table(result: dict) -> str:
    """The markdown tables of ``studies/t-conditioning.md`` from a result file: per learning rate, each
    candidate's held-out loss and its difference from ``none``'s run of the same seed (median,
    and mean ± sd, over the seeds: one seed's divergence moves the mean a lot)."""
    lines = []
    for lr, block in result["by_lr"].items():
        base = [r["val_loss_end"] for r in block["none"]["runs"]]
        lines += [f"lr {lr}:", "",
                  "| candidate | held-out loss | vs `none`: median (mean ± sd) | seeds lower | train loss, "
                  "last 10 steps | max `delta_ti` | max `cond(T)` | min `λ(T)` | floored steps |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, c in block.items():
            s = c["summary"]
            diff = [r["val_loss_end"] - b for r, b in zip(c["runs"], base)]
            versus = ("—" if name == "none" else f"{statistics.median(diff):+.3f} ({statistics.fmean(diff):+.3f} ± "
                      f"{statistics.stdev(diff) if len(diff) > 1 else 0.0:.3f})")
            below = "—" if name == "none" else f"{sum(x < -1e-4 for x in diff)}/{len(diff)}"
            lines.append(f"| `{name}` | {s['val_loss_end_mean']:.3f} ± {s['val_loss_end_sd']:.3f} | {versus} | {below} | "
                         f"{s['train_loss_last10_mean']:.3f} | {s['max_delta_ti']:.1e} | {s['max_cond']:.2g} | "
                         f"{s['min_eig']:.1e} | {s['floored_steps_mean']:.1f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10, help="data-order seeds 0..N-1 per candidate")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lrs", default="3e-3", help="comma-separated peak learning rates")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--eval-blocks", type=int, default=32)
    parser.add_argument("--data", default="default", help="training text (default: the stdlib corpus)")
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help="comma-separated subset")
    parser.add_argument("--families", action="store_true",
                        help="instead: every tiny family at --family-lr with and without the floor")
    parser.add_argument("--family-lr", type=float, default=0.1)
    parser.add_argument("--family-steps", type=int, default=5)
    parser.add_argument("--out", help="result JSON (default: studies/results/t_conditioning[_families].json)")
    parser.add_argument("--table", metavar="JSON", help="instead: print the docs' tables of a result file")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return 0
    results = Path(__file__).parent / "results"
    command = "python studies/t_conditioning.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.families:
        with tempfile.TemporaryDirectory() as tmp:
            rows = families(args, Path(tmp))
        setup = {"lr": args.family_lr, "steps": args.family_steps, "seq_len": 32, "batch_size": 4, "data": args.data}
        return write_result(args.out or results / "t_conditioning_families.json",
                            {"study": "t_conditioning --families", "command": command.strip(), "setup": setup,
                             "families": rows}, __file__)
    names = [n for n in args.candidates.split(",") if n]
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        parser.error(f"unknown candidates {unknown}; choose from {', '.join(CANDIDATES)}")
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = converted_model(work)
        for lr in (float(x) for x in args.lrs.split(",")):
            block: dict[str, dict] = {}
            for name in names:
                runs = [run(args, model, work, name, lr, seed) for seed in range(args.seeds)]
                baseline = block["none"]["runs"] if "none" in block else None
                block[name] = {"summary": summarize(runs, baseline), "runs": runs}
                s = block[name]["summary"]
                paired = ("" if s["val_loss_vs_none_mean"] is None else
                          f" (vs none {s['val_loss_vs_none_mean']:+.3f} ± {s['val_loss_vs_none_sd']:.3f})")
                print(f"lr {lr:g} {name:14s} val {s['val_loss_end_mean']:.3f} ± {s['val_loss_end_sd']:.3f}{paired}  "
                      f"train {s['train_loss_last10_mean']:.3f}  max delta_ti {s['max_delta_ti']:.2e}  max cond "
                      f"{s['max_cond']:.3g}  min eig {s['min_eig']:.3g}  floored {s['floored_steps_mean']:.1f}",
                      flush=True)
            rows[f"{lr:g}"] = block
    setup = {k: getattr(args, k) for k in ("seeds", "steps", "lrs", "seq_len", "batch_size", "eval_blocks", "data")}
    return write_result(args.out or results / "t_conditioning.json",
                        {"study": "t_conditioning", "command": command.strip(), "setup": setup,
                         "model": "tiny Llama (pit_deploy.tiny), widen_embedding_spectrum(), preserve",
                         "by_lr": rows}, __file__)


if __name__ == "__main__":
    sys.exit(main())

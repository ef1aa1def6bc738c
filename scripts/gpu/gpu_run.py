#!/usr/bin/env python3
"""The prepared GPU runs, through the same commands a user runs (``pit-deploy train``,
``diagnose``, ``probe``, ``export``, ``verify``; called in this process through the CLI's
``main``), written as one JSON file of results and curves.

``cpt``      continued pretraining from a source model: PIT (from the ``preserve`` conversion)
             against transpose tying (the source as it is), same token stream and seeds; held-out
             code (the corpus's validation split) and prose (``--eval-prose``) every few hundred
             steps; ``delta_ti``, ``cond(T)``, tokens/s, MFU and peak memory every logged step;
             the diagnostics of both final models; the PIT model exported to ONNX and verified on
             the CPU when the export's packages are there (recorded as skipped otherwise).
``scratch``  from-scratch pretraining of the default model's shape (``--arch llama-135m``), PIT
             (random orthonormal ``Z``, ``T = I``) against TT from the same initial body and seed,
             on the default corpus without its ``test/`` package; then LoRA of each final model
             on that held-apart ``test/`` package; diagnostics of both ends, a logit-lens probe of
             both final models.

Settings come from the run recipes ``gpu-cpt-offline`` and ``gpu-scratch`` (their ``[train]`` and
``[lora]`` tables; ``--set TABLE.KEY=VALUE`` overrides a key as ``pit-deploy run`` does). A wall
budget (``--budget-s``) shortens every run's ``max_seconds`` so that the whole script ends in
time; a run that stops on it says so in its summary (``stopped_early``).

``PIT_GPU_SMOKE=1`` (or ``--smoke``) runs everything on a tiny random model for a few steps on the
CPU: the test suite's check that this script still works (``tests/test_gpu_scripts.py``).

Usage (``scripts/gpu/README.md`` has the device commands)::

    python scripts/gpu/gpu_run.py cpt --out OUT --model build/gpu-carry/SmolLM2-135M-Instruct.Q4_1.gguf
    python scripts/gpu/gpu_run.py scratch --out OUT --tokenizer build/gpu-a/tokenizer
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import math
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the checkout itself is the package (no install on the GPU machine)
    sys.path.insert(0, str(ROOT))

RECIPES = {"cpt": "gpu-cpt-offline", "scratch": "gpu-scratch"}
#: what the issues aim at, recorded beside the measurements
TARGETS = {"tokens_per_s": 300_000, "pit_tt_step_time_ratio": 1.02, "delta_ti": 1e-5}
#: seconds kept for model loading, compilation and evaluations around each run's training time
RUN_OVERHEAD_S = {"cpt": 75.0, "scratch": 60.0, "lora": 30.0}
#: seconds kept at the end for diagnostics, probes, export and verification
TAIL_S = {"cpt": 75.0, "scratch": 40.0}
#: the smoke run's overrides: a tiny model, a few steps, the CPU
SMOKE_TRAIN = {"seq_len": 32, "batch_size": 2, "grad_accum": 1, "steps": 3, "tokens": 0, "eval_every": 3,
               "eval_blocks": 2, "log_every": 1, "save_every": 0, "precision": "fp32", "device": "cpu",
               "compile": False, "max_seconds": 0.0, "warmup_steps": 1, "val_fraction": 0.3}
SMOKE_LORA = {"steps": 2}
PROBE_PROMPT = "def fibonacci(n):\n    return"
#: modules whose versions the result records (imported only to read the version)
VERSIONED = ("torch", "transformers", "peft", "safetensors", "tokenizers", "numpy", "gguf", "onnx",
             "onnxruntime", "optimum", "matplotlib")


def smoke_mode(flag: bool) -> bool:
    return flag or os.environ.get("PIT_GPU_SMOKE", "") not in ("", "0")


def say(message: str) -> None:
    print(f"[gpu_run {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def clean(value: Any) -> Any:
    """``value`` with non-finite floats as strings (``"inf"``, ``"nan"``): always valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "unknown")
        except Exception:  # absent, or broken on this machine
            out[name] = None
    return out


def environment(argv: list[str]) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"command": " ".join(["python", "scripts/gpu/gpu_run.py", *argv]),
                           "versions": versions(), "platform": platform.platform(),
                           "cpu_count": os.cpu_count(), "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["device"] = {"name": torch.cuda.get_device_name(0), "cuda": torch.version.cuda,
                         "memory_gb": round(props.total_memory / 1e9, 1), "count": torch.cuda.device_count(),
                         "capability": list(torch.cuda.get_device_capability(0))}
    else:
        env["device"] = {"name": f"CPU ({platform.processor() or platform.machine()})", "cuda": None}
    return env


def cli(*args: str) -> tuple[int, str]:
    """``pit-deploy ARGS`` in this process: its exit code and what it printed to stdout."""
    from pit_deploy.cli import main

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main(list(args))
    return code, buffer.getvalue()


def cli_json(*args: str) -> dict[str, Any]:
    code, text = cli(*args)
    result: dict[str, Any] = {"exit_code": code}
    try:
        result["result"] = json.loads(text[text.index("{"):]) if "{" in text else None
    except (ValueError, json.JSONDecodeError):
        result["output"] = text[-2000:]
    return result


def columns(records: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, list]:
    """Records as one list per key (compact curves); keys no record has are left out."""
    present = [k for k in keys if any(k in r for r in records)]
    return {k: [r.get(k) for r in records] for k in present}


TRAIN_KEYS = ("step", "tokens", "loss", "lr", "grad_norm", "step_time", "tokens_per_s", "mfu", "peak_memory_mb",
              "delta_ti", "t_cond", "t_eig_min", "t_eig_max", "t_floored")
EVAL_KEYS = ("step", "tokens", "val_loss", "val_prose_loss")


def run_summary(out: Path) -> dict[str, Any]:
    """Curves, summary and interface figures of one training run directory."""
    from pit_deploy.io.metrics import read_metrics

    train = read_metrics(out, "train") if (out / "metrics.jsonl").exists() else []
    evals = read_metrics(out, "eval") if (out / "metrics.jsonl").exists() else []
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else None
    deltas = [r["delta_ti"] for r in train if isinstance(r.get("delta_ti"), (int, float))]
    conds = [r["t_cond"] for r in train if isinstance(r.get("t_cond"), (int, float))]
    steady = [r["step_time"] for r in train[1:]] or [r["step_time"] for r in train]
    tps = [r["tokens_per_s"] for r in train[1:]] or [r["tokens_per_s"] for r in train]
    mfus = [r["mfu"] for r in train if r.get("mfu") is not None]
    return {
        "summary": summary,
        "curves": {"train": columns(train, TRAIN_KEYS), "eval": columns(evals, EVAL_KEYS)},
        "median_step_time_s": sorted(steady)[len(steady) // 2] if steady else None,
        "median_tokens_per_s": sorted(tps)[len(tps) // 2] if tps else None,
        "median_mfu": sorted(mfus)[len(mfus) // 2] if mfus else None,
        "peak_memory_mb": max((r["peak_memory_mb"] for r in train if r.get("peak_memory_mb") is not None),
                              default=None),
        "interface": {"max_delta_ti": max(deltas) if deltas else None, "logged_steps": len(deltas),
                      "max_t_cond": max(conds) if conds else None,
                      "t_floored_steps": sum(1 for r in train if r.get("t_floored")),
                      "delta_ti_within_target": (max(deltas) <= TARGETS["delta_ti"]) if deltas else None},
    }


class Driver:
    """One prepared run: settings, the wall budget, the results file written after every stage."""

    def __init__(self, args: argparse.Namespace, argv: list[str]):
        from pit_deploy.workflow.recipe import load_run_recipe

        self.args = args
        self.mode = args.mode
        self.smoke = smoke_mode(args.smoke)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work) if args.work else ROOT / "build" / "gpu-work" / self.mode
        if self.work.exists():
            shutil.rmtree(self.work)
        self.work.mkdir(parents=True)
        overrides = list(args.set)
        if self.smoke:
            overrides = [f"train.{k}={json.dumps(v)}" for k, v in SMOKE_TRAIN.items()] + \
                        [f"lora.{k}={json.dumps(v)}" for k, v in SMOKE_LORA.items()] + overrides
            if self.mode == "scratch":
                overrides.insert(0, 'train.arch="tiny"')
        self.recipe_name = args.recipe or RECIPES[self.mode]
        self.recipe = load_run_recipe(self.recipe_name, overrides)
        self.started = time.monotonic()
        self.deadline = self.started + args.budget_s if args.budget_s > 0 else None
        self.result: dict[str, Any] = {
            "kind": f"gpu-{self.mode}", "smoke": self.smoke, "recipe": self.recipe_name, "overrides": overrides,
            **environment(argv), "targets": TARGETS, "runs": {}, "status": "running",
        }
        self.name = f"gpu_{self.mode}" + ("_smoke" if self.smoke else "")

    # ---- bookkeeping ------------------------------------------------------------------------

    def write(self) -> Path:
        self.result["wall_s"] = round(time.monotonic() - self.started, 1)
        path = self.out / f"{self.name}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(clean(self.result), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        return path

    def seconds_for(self, runs_left: int, overhead: float, tail: float) -> float | None:
        """Training seconds one run may take so that the runs left and the tail fit the budget."""
        if self.deadline is None:
            return None
        remaining = self.deadline - time.monotonic() - tail
        return max(10.0, remaining / max(runs_left, 1) - overhead)

    def train_options(self) -> dict[str, Any]:
        """The ``[train]`` table as training options (what ``pit-deploy run`` passes, same rules)."""
        from pit_deploy.training.config import TrainConfig

        table = self.recipe.effective("train")
        owned = {"out", "model", "data", "tying", "resume", "force", "progress", "plot"}
        known = {f.name for f in fields(TrainConfig)} - owned
        options = {k: v for k, v in table.items() if k in known}
        if options.get("tokens"):
            options["steps"] = None
        else:
            options["tokens"] = None
        if isinstance(options.get("betas"), list):
            options["betas"] = tuple(options["betas"])
        return options

    def train(self, key: str, cfg: Any, budget: float | None, keep: dict[str, Any] | None = None) -> dict[str, Any]:
        """``pit-deploy train --config FILE`` for ``cfg`` (its ``max_seconds`` capped by ``budget``)."""
        from pit_deploy.training.config import write_config

        if budget is not None:
            cfg = replace(cfg, max_seconds=min(cfg.max_seconds, budget) if cfg.max_seconds else budget)
        config_file = write_config(cfg, self.work / f"{key}.config.json")
        say(f"training {key}: {cfg.tying}, max {cfg.max_seconds:g} s → {cfg.out}")
        t0 = time.monotonic()
        code, _ = cli("train", "--config", str(config_file))
        wall = time.monotonic() - t0
        say(f"training {key}: exit {code} after {wall:.0f} s")
        entry = {"exit_code": code, "wall_s": round(wall, 1), "config": asdict(cfg),
                 "command": f"pit-deploy train --config {config_file.name}", **run_summary(Path(cfg.out)),
                 **(keep or {})}
        self.result["runs"][key] = entry
        self.write()
        return entry

    # ---- the two runs ---------------------------------------------------------------------------

    def source_model(self) -> str:
        if self.args.model:
            return self.args.model
        if self.smoke:
            return str(tiny_model_dir(self.work))
        return str(self.recipe["run"]["model"])

    def run_cpt(self) -> None:
        from pit_deploy.training.config import TrainConfig

        options = self.train_options()
        model, data = self.source_model(), self.args.data or str(self.recipe["run"]["data"])
        if self.smoke and not self.args.data:
            data = str(smoke_corpus(self.work))
        t_init = self.recipe["convert"]["t_init"]
        tyings = [t for t in ("pit", "tt") if t in self.recipe["train"]["tying"]]
        self.result["budget"] = budget_record(options, self.recipe)
        self.result["source_model"] = model
        for i, tying in enumerate(tyings):
            cfg = TrainConfig(out=str(self.work / tying), model=model, data=data, tying=tying, force=True,
                              progress=False, plot=False, **{**options, "t_init": t_init if tying == "pit" else None})
            self.train(tying, cfg, self.seconds_for(len(tyings) - i, RUN_OVERHEAD_S["cpt"], TAIL_S["cpt"]))
        for tying in tyings:
            final = self.work / tying / "model"
            if final.is_dir():
                self.result["runs"][tying]["diagnose_end"] = cli_json("diagnose", str(final), "--json")
        self.result["comparison"] = compare(self.result["runs"])
        self.write()
        if "pit" in tyings and (self.work / "pit" / "model").is_dir() and not self.args.no_verify:
            self.result["verify"] = export_and_verify(self.work / "pit" / "model", self.work / "export")
            self.write()

    def run_scratch(self) -> None:
        from pit_deploy.training.config import TrainConfig

        options = self.train_options()
        data_root = self.args.data_root or (str(smoke_corpus(self.work)) if self.smoke else None)
        pretrain, adapt = split_corpus(self.work / "corpus", data_root)
        tokenizer = self.args.tokenizer or (str(tiny_model_dir(self.work)) if self.smoke else None)
        if tokenizer:
            options["tokenizer"] = tokenizer
        options["from_scratch"] = True
        tyings = [t for t in ("pit", "tt") if t in self.recipe["train"]["tying"]]
        lora = self.recipe["lora"]
        lora_seconds = self.args.lora_seconds
        self.result["budget"] = budget_record(options, self.recipe)
        self.result["data"] = {"pretrain": "the default corpus without its test/ package",
                               "lora": "the default corpus's test/ package (held apart from pretraining)",
                               **corpus_sizes(pretrain, adapt)}
        cfgs = {t: TrainConfig(out=str(self.work / t), model="default", data=str(pretrain), tying=t, force=True,
                               progress=False, plot=False, **options) for t in tyings}
        for tying, cfg in cfgs.items():  # the start of each run: the same seeded body, the interface differs
            self.result["runs"].setdefault(tying, {})["diagnose_start"] = start_diagnostics(cfg)
        self.write()
        lora_total = len(tyings) * (lora_seconds + RUN_OVERHEAD_S["lora"])
        for i, (tying, cfg) in enumerate(cfgs.items()):
            start = self.result["runs"][tying]
            self.train(tying, cfg, self.seconds_for(len(tyings) - i, RUN_OVERHEAD_S["scratch"],
                                                   TAIL_S["scratch"] + lora_total),
                       keep={"diagnose_start": start.get("diagnose_start")})
        for tying in tyings:
            final = self.work / tying / "model"
            if final.is_dir():
                self.result["runs"][tying]["diagnose_end"] = cli_json("diagnose", str(final), "--json")
                self.result["runs"][tying]["probe"] = cli_json("probe", str(final), "--json", "--prompt", PROBE_PROMPT)
        self.result["comparison"] = compare(self.result["runs"])
        self.write()
        self.result["lora"] = {}
        for i, tying in enumerate(tyings):
            final = self.work / tying / "model"
            if not final.is_dir():
                continue
            base = cfgs[tying]
            lora_cfg = TrainConfig(
                out=str(self.work / f"lora-{tying}"), model=str(final), data=str(adapt), tying=tying, lora=True,
                lora_rank=int(lora["rank"]), lora_alpha=float(lora["alpha"]),
                lora_train_t=bool(lora["train_t"]) and tying == "pit", steps=int(lora["steps"]), lr=float(lora["lr"]),
                seq_len=base.seq_len, batch_size=base.batch_size, precision=base.precision, device=base.device,
                seed=base.seed, compile=base.compile, eval_every=max(1, int(lora["steps"]) // 4),
                eval_blocks=base.eval_blocks, eval_prose=True, log_every=base.log_every, warmup_steps=0,
                val_fraction=base.val_fraction,
                peak_tflops=base.peak_tflops, max_seconds=0.0 if self.smoke else lora_seconds,
                force=True, progress=False, plot=False)
            entry = self.train(f"lora-{tying}", lora_cfg,
                               self.seconds_for(len(tyings) - i, RUN_OVERHEAD_S["lora"], TAIL_S["scratch"]))
            self.result["lora"][tying] = self.result["runs"].pop(f"lora-{tying}")
            del entry
        self.write()


def budget_record(options: dict[str, Any], recipe: Any) -> dict[str, Any]:
    tokens_per_step = options["seq_len"] * options["batch_size"] * options.get("grad_accum", 1)
    return {"tokens": options.get("tokens"), "steps": options.get("steps"), "seq_len": options["seq_len"],
            "batch_size": options["batch_size"], "grad_accum": options.get("grad_accum", 1),
            "tokens_per_step": tokens_per_step, "max_seconds": options.get("max_seconds"),
            "precision": options.get("precision"), "compile": options.get("compile")}


def compare(runs: dict[str, Any]) -> dict[str, Any]:
    """PIT against TT: step-time ratio, throughput, final held-out losses, the interface."""
    pit, tt = runs.get("pit") or {}, runs.get("tt") or {}

    def final(run: dict[str, Any], key: str) -> float | None:
        values = [v for v in (run.get("curves", {}).get("eval", {}).get(key) or []) if v is not None]
        return values[-1] if values else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    return {
        "pit_tt_step_time_ratio": ratio(pit.get("median_step_time_s"), tt.get("median_step_time_s")),
        "tokens_per_s": {"pit": pit.get("median_tokens_per_s"), "tt": tt.get("median_tokens_per_s")},
        "mfu": {"pit": pit.get("median_mfu"), "tt": tt.get("median_mfu")},
        "final_val_loss": {"pit": final(pit, "val_loss"), "tt": final(tt, "val_loss")},
        "final_val_prose_loss": {"pit": final(pit, "val_prose_loss"), "tt": final(tt, "val_prose_loss")},
        "tokens_trained": {k: (r.get("summary") or {}).get("tokens") for k, r in (("pit", pit), ("tt", tt))},
        "pit_max_delta_ti": (pit.get("interface") or {}).get("max_delta_ti"),
        "pit_t_floored_steps": (pit.get("interface") or {}).get("t_floored_steps"),
    }


def start_diagnostics(cfg: Any) -> dict[str, Any]:
    """Interface diagnostics of the model a from-scratch run starts from (built as ``train`` builds it)."""
    import torch

    from pit_deploy.analysis.diagnostics import diagnose_model
    from pit_deploy.training.loop import TrainingRecipe

    recipe = TrainingRecipe(replace(cfg, compile=False, eval_every=0))
    try:
        recipe.setup(write=False)
        return json.loads(diagnose_model(recipe.raw_model).to_json())
    except Exception as exc:  # recorded, the run goes on
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        del recipe
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def export_and_verify(model: Path, out: Path) -> dict[str, Any]:
    """ONNX fp32 export of the PIT model and ``pit-deploy verify`` on this machine's CPU, when the
    export's packages (optimum-onnx, onnx, onnxruntime) are installed; skipped with the reason otherwise."""
    missing = []
    for name in ("onnx", "onnxruntime", "optimum.exporters.onnx"):
        try:
            importlib.import_module(name)
        except Exception as exc:
            missing.append(f"{name} ({type(exc).__name__})")
    if missing:
        return {"skipped": f"the ONNX export needs {', '.join(missing)}, not importable here"}
    t0 = time.monotonic()
    code, text = cli("export", str(model), "--out", str(out), "--recipe", "onnx-fp32", "--mode", "factorized")
    result: dict[str, Any] = {"export_exit_code": code, "export_s": round(time.monotonic() - t0, 1)}
    if code == 0:
        result["verify"] = cli_json("verify", str(out), "--json")
    else:
        result["export_output"] = text[-2000:]
    return result


def tiny_model_dir(work: Path) -> Path:
    """The smoke run's source: a tiny random Llama with the tiny tokenizer (built once)."""
    from pit_deploy.io.checkpoint import save_model
    from pit_deploy.tiny import tiny_model, tiny_tokenizer

    path = work / "tiny-llama"
    if not path.exists():
        save_model(tiny_model("llama"), path, tiny_tokenizer())
    return path


def smoke_corpus(work: Path, n_docs: int = 24, chars: int = 1500) -> Path:
    """The smoke run's corpus: the beginnings of a few standard-library modules and of a few of
    its tests (a ``test/`` package, which the from-scratch run holds apart for LoRA)."""
    from pit_deploy.data.corpus import stdlib_root

    path = work / "smoke-corpus"
    if path.exists():
        return path
    root = stdlib_root()
    for sub, files in (("", sorted(root.glob("*.py"))[:n_docs]), ("test", sorted((root / "test").glob("test_*.py"))[:8])):
        folder = path / sub
        folder.mkdir(parents=True, exist_ok=True)
        for f in files:
            (folder / f.name).write_text(f.read_bytes()[:chars].decode("utf-8", "ignore"), encoding="utf-8")
    return path


def split_corpus(root: Path, data_root: str | None) -> tuple[Path, Path]:
    """The default corpus (the standard library's ``*.py``) as two folders of links: ``pretrain``
    (all but the ``test/`` package) and ``lora`` (the ``test/`` package), same relative paths,
    so pretraining's validation split is the default corpus's. Files that are not UTF-8 text
    (a few test fixtures) are left out, since a folder is read strictly."""
    from pit_deploy.data.corpus import stdlib_root

    source = Path(data_root) if data_root else stdlib_root()
    pretrain, adapt = root / "pretrain", root / "lora"
    for path in sorted(source.rglob("*.py")):
        rel = path.relative_to(source)
        if "site-packages" in rel.parts:
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if "\x00" in text or not text.strip():
            continue
        target = (adapt if rel.parts[0] == "test" else pretrain) / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(path.resolve())
    return pretrain, adapt


def corpus_sizes(*folders: Path) -> dict[str, Any]:
    sizes = {}
    for folder in folders:
        files = [p for p in folder.rglob("*.py")]
        sizes[f"{folder.name}_files"] = len(files)
        sizes[f"{folder.name}_mb"] = round(sum(p.stat().st_size for p in files) / 1e6, 2)
    return sizes


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=sorted(RECIPES), help="cpt: continued pretraining; scratch: from scratch, then LoRA")
    p.add_argument("--out", required=True, help="folder for the result JSON (the folder that comes back)")
    p.add_argument("--work", default=None, help="folder for the runs (default: build/gpu-work/MODE)")
    p.add_argument("--recipe", default=None, help="run recipe (default: gpu-cpt-offline / gpu-scratch)")
    p.add_argument("--model", default=None, help="cpt: the source model (default: the recipe's run.model)")
    p.add_argument("--data", default=None, help="cpt: training data (default: the recipe's run.data)")
    p.add_argument("--tokenizer", default=None, help="scratch: tokenizer folder (default: that of the default model)")
    p.add_argument("--data-root", default=None, help="scratch: the corpus to split (default: the standard library)")
    p.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE", help="override a recipe key")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="wall seconds the whole script may take (shortens each run's max_seconds; 0: none)")
    p.add_argument("--lora-seconds", type=float, default=40.0, help="scratch: training seconds of each LoRA run")
    p.add_argument("--no-verify", action="store_true", help="cpt: skip the ONNX export and verify")
    p.add_argument("--smoke", action="store_true", help="a tiny model for a few steps on the CPU (or PIT_GPU_SMOKE=1)")
    args = p.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    driver = Driver(args, argv)
    say(f"{driver.name}: recipe {driver.recipe_name}, results in {driver.write()}")
    try:
        driver.run_cpt() if args.mode == "cpt" else driver.run_scratch()
    except BaseException as exc:
        driver.result["status"] = f"failed: {type(exc).__name__}: {exc}"
        driver.write()
        raise
    codes = [r.get("exit_code", 0) for r in driver.result["runs"].values()]
    codes += [r.get("exit_code", 0) for r in (driver.result.get("lora") or {}).values()]
    driver.result["status"] = "done" if not any(codes) else "a run failed"
    path = driver.write()
    say(f"wrote {path} ({driver.result['status']}, {driver.result['wall_s']} s)")
    return max(codes, default=0)


if __name__ == "__main__":
    sys.exit(main())

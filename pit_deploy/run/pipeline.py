"""``pit-deploy run``: convert → train → export → verify → bench → report in one run directory.

Each stage lives in its own sub-directory with a ``stage.json`` record (:mod:`.stages`). The
pipeline walks the stages in order; a stage whose settings and input digests are unchanged
since it last finished is skipped (and says so), ``from_stage`` redoes a stage and everything
after it, and a stage that was interrupted runs again — training resumes from its last
checkpoint. A stage that fails stops the run: the report still gets written, listing what
failed, and the run's exit code is the failed stage's (1 a verification bound, 2 unusable input,
3 an internal error; ``docs/conventions.md``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from ..errors import PitError
from ..io.fs import write_json_atomic
from .recipe import STAGES, RunRecipe
from .report import REPORT_NAME
from .stages import StageRecord, digest_path, stage_dir

log = logging.getLogger(__name__)
Say = Callable[[str], None]
RUN_FORMAT = "pit-deploy-run"


class StageFailed(Exception):
    """A stage ended without its result; ``exit_code`` follows the exit-code contract."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class RunResult:
    """What ``run`` did: per stage ``ran`` / ``skipped`` / ``failed``, the exit code, the report."""

    out: str
    stages: dict[str, str] = field(default_factory=dict)
    exit_code: int = 0
    report: str | None = None
    failed_stage: str | None = None
    message: str | None = None


# --------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------


def run_pipeline(recipe: RunRecipe, out: str | Path, from_stage: str | None = None, force: bool = False,
                 say: Say = print) -> RunResult:
    """Run (or resume, or skip through) every stage of ``recipe`` into ``out``."""
    if from_stage is not None and from_stage not in STAGES:
        raise PitError(f"--from {from_stage!r}: choose one of {', '.join(STAGES)}")
    out = Path(out)
    claim_run_directory(out, recipe, force)
    result = RunResult(out=str(out))
    ctx: dict[str, dict[str, Any]] = {}
    redo_from = STAGES.index(from_stage) if from_stage else len(STAGES)
    for i, stage in enumerate(STAGES):
        folder = stage_dir(out, stage)
        settings, inputs = plan(stage, recipe, ctx)
        previous = StageRecord.read(folder)
        if i < redo_from and previous is not None and previous.up_to_date(settings, inputs):
            say(f"{stage}: up to date (same settings and inputs as the finished stage) — skipped")
            ctx[stage] = previous.outputs
            result.stages[stage] = "skipped"
            continue
        reason = ("--from " + from_stage) if i >= redo_from else (
            "first run" if previous is None else
            "interrupted before" if previous.status == "running" else
            "failed before" if previous.status == "failed" else "settings or inputs changed")
        say(f"{stage}: running ({reason})")
        record = StageRecord(stage=stage, settings=settings, inputs=inputs)
        (folder / "stage.json").unlink(missing_ok=True)  # not "done" while it runs
        folder.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        try:
            outputs = STAGE_FUNCTIONS[stage](folder, recipe, ctx, say, fresh=i >= redo_from)
            record.status = "skipped" if outputs.get("disabled") else "done"
            record.outputs = outputs
        except StageFailed as exc:
            record.status, record.error, record.exit_code = "failed", str(exc), exc.exit_code
        except PitError as exc:  # 2, or 1 for a bound that failed (training's IdentityLost)
            record.status, record.error, record.exit_code = "failed", str(exc), exc.exit_code
        except Exception as exc:  # an internal error: one line here, the traceback in the log
            (folder / "error.log").write_text(traceback.format_exc())
            record.status, record.error, record.exit_code = "failed", f"internal error: {exc!r} (traceback in {folder / 'error.log'})", 3
        record.seconds = round(time.perf_counter() - start, 2)
        record.write(folder)
        ctx[stage] = record.outputs
        result.stages[stage] = "ran" if record.status == "done" else record.status
        if record.status == "failed":
            say(f"{stage}: FAILED — {record.error}")
            result.exit_code, result.failed_stage, result.message = record.exit_code, stage, record.error
            if stage != "report":
                write_report_safely(out, recipe, say)
            break
        say(f"{stage}: {record.status} in {record.seconds:.1f} s")
    report = out / REPORT_NAME
    result.report = str(report) if report.is_file() else None
    return result


def claim_run_directory(out: Path, recipe: RunRecipe, force: bool) -> None:
    """Make ``out`` this recipe's run directory, refusing someone else's."""
    meta = out / "run.json"
    if meta.is_file():
        try:
            data = json.loads(meta.read_text())
        except json.JSONDecodeError:
            data = {}
        if data.get("format") != RUN_FORMAT:
            raise PitError(f"{meta} is not a pit-deploy run record; choose another --out")
        if data.get("recipe") != recipe.name and not force:
            raise PitError(f"{out} is a run of recipe {data.get('recipe')!r}, not {recipe.name!r}; choose "
                           "another --out, or pass --force to reuse it (stages whose settings differ rerun)")
    elif out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise PitError(f"--out {out} exists and is not a pit-deploy run directory; choose another path "
                       "(or --force to use it anyway)")
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(meta, {"format": RUN_FORMAT, "recipe": recipe.name, "settings": recipe.to_dict()})


def plan(stage: str, recipe: RunRecipe, ctx: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The settings and input digests a stage would get now (what makes it up to date)."""
    run = recipe["run"]
    if stage == "convert":
        return {**recipe["convert"], "model": run["model"], "data": run["data"]}, {"model": source_fingerprint(run["model"])}
    if stage == "train":
        return ({**recipe["train"], "lora": recipe["lora"], "model": run["model"], "data": run["data"]},
                {"converted": ctx.get("convert", {}).get("digest")})
    if stage == "export":
        return recipe["export"], {"model": ctx.get("train", {}).get("digest")}
    if stage == "verify":
        return recipe["verify"], {"exports": ctx.get("export", {}).get("digests")}
    if stage == "bench":
        return recipe["bench"], {"exports": ctx.get("export", {}).get("digests"),
                                 "verified": ctx.get("verify", {}).get("passed")}
    return recipe["report"], {s: ctx.get(s, {}).get("digest") or ctx.get(s, {}).get("digests") for s in STAGES[:-1]}


def source_fingerprint(spec: str) -> str:
    """A digest of the source model: its file(s) when local, the bundled GGUF for ``default``,
    the id itself for a hub id (a hub model is not downloaded just to be fingerprinted)."""
    if spec == "default":
        from ..io.sources import default_gguf_path

        return digest_path(default_gguf_path())
    path = Path(spec).expanduser()
    if path.exists():
        return digest_path(path)
    return f"hub:{spec}"


# --------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------


def stage_convert(folder: Path, recipe: RunRecipe, ctx: dict, say: Say, fresh: bool = False) -> dict[str, Any]:
    """Load the source, measure it, convert it to PIT, measure again, save the checkpoint."""
    from ..analysis.diagnostics import diagnose_model
    from ..convert import convert_model
    from ..io.checkpoint import save_model
    from ..io.sources import load_source
    from ..model.core import PITSpec
    from ..train.evaluation import heldout_nll

    run, conv, train = recipe["run"], recipe["convert"], recipe["train"]
    say(f"  loading {run['model']}")
    loaded = load_source(run["model"])
    before = diagnose_model(loaded.model).to_dict()
    blocks = int(train["eval_blocks"])
    seq_len = int(train["seq_len"])
    source_nll = heldout_nll(loaded.model, loaded.tokenizer, run["data"], seq_len, blocks)
    if loaded.is_pit:
        say("  the source is already a PIT model: kept as is")
    else:
        say(f"  converting (T init: {conv['t_init']})")
        convert_model(loaded.model, conv["t_init"], PITSpec(diagonal=conv["diagonal"], train_z=conv["train_z"]),
                      loaded.source, tokenizer=loaded.tokenizer, calib=conv["calib"], calib_tokens=int(conv["calib_tokens"]))
    after = diagnose_model(loaded.model).to_dict()
    converted_nll = heldout_nll(loaded.model, loaded.tokenizer, run["data"], seq_len, blocks)
    model_dir = folder / "model"
    save_model(loaded.model, model_dir, loaded.tokenizer, force=True)
    return {
        "model": str(model_dir), "digest": digest_path(model_dir), "source": loaded.source,
        "interface_before": before, "interface_after": after,
        "source_val_nll": source_nll, "converted_val_nll": converted_nll,
    }


def stage_train(folder: Path, recipe: RunRecipe, ctx: dict, say: Say, fresh: bool = False) -> dict[str, Any]:
    """Continued pretraining (PIT, and TT when asked) and then LoRA when the recipe asks."""
    train = recipe["train"]
    converted = ctx["convert"]["model"]
    runs: dict[str, Any] = {}
    final = converted
    if train["enabled"]:
        for tying in _as_list(train["tying"]):
            model = converted if tying == "pit" else recipe["run"]["model"]
            if tying == "pit" and train.get("distill"):
                model = recipe["run"]["model"]  # distillation needs the plain source as teacher
            runs[tying] = train_one(folder / tying, model, recipe["run"]["data"], train, say, fresh,
                                    t_init=recipe["convert"]["t_init"], tying=tying)
        final = runs["pit"]["model"] if "pit" in runs else converted
    lora = recipe["lora"]
    if lora["enabled"]:
        settings = {**{k: train[k] for k in ("seq_len", "batch_size", "precision", "device", "seed", "eval_blocks")},
                    "lora": True, "merge": True, "lora_rank": lora["rank"], "lora_alpha": lora["alpha"],
                    "lora_train_t": lora["train_t"], "steps": lora["steps"], "lr": lora["lr"]}
        runs["lora"] = train_one(folder / "lora", final, lora["data"], settings, say, fresh, tying="pit")
        final = runs["lora"]["model"]
    if not runs:
        return {"disabled": True, "model": converted, "digest": ctx["convert"]["digest"], "runs": {}}
    return {"model": final, "digest": digest_path(final), "runs": runs}


def train_one(out: Path, model: str, data: str, settings: dict[str, Any], say: Say, fresh: bool,
              tying: str = "pit", t_init: str | None = None) -> dict[str, Any]:
    """One training job; resumes from its last checkpoint when an earlier attempt was cut off."""
    from ..train.loop import TrainConfig, latest_checkpoint, train

    owned = {"out", "model", "data", "tying", "resume", "force", "progress", "plot"}
    known = {f.name for f in fields(TrainConfig)} - owned
    options = {k: v for k, v in settings.items() if k in known}
    # a recipe budget is steps or tokens: tokens (> 0) wins, 0 or absent means "use steps"
    if options.get("tokens"):
        options["steps"] = None
    else:
        options["tokens"] = None
    if t_init is not None:
        options["t_init"] = t_init
    resume = not fresh and out.is_dir() and latest_checkpoint(out) is not None
    if fresh and out.exists():
        shutil.rmtree(out)
    cfg = TrainConfig(out=str(out), model=str(model), data=data, tying=tying, resume=resume,
                      force=not resume, progress=False, plot=True, **options)
    say(f"  training {tying} → {out.name}/" + (" (resuming from its last checkpoint)" if resume else ""))
    nproc = int(settings.get("nproc", 1))
    if nproc > 1:
        run_distributed(cfg, nproc)
    else:
        train(cfg)
    summary = json.loads((out / "summary.json").read_text())
    return {"dir": str(out), "model": str(out / "model"), "summary": summary}


def run_distributed(cfg: Any, nproc: int) -> None:
    """``torchrun --nproc-per-node N -m pit_deploy train …`` with the config as flags."""
    from ..cli import train_argv

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "pit_deploy", "train", *train_argv(cfg)]
    proc = subprocess.run(cmd, env=os.environ.copy())
    if proc.returncode != 0:
        raise StageFailed(f"torchrun training exited with {proc.returncode}",
                          proc.returncode if proc.returncode in (1, 2) else 3)


def stage_export(folder: Path, recipe: RunRecipe, ctx: dict, say: Say, fresh: bool = False) -> dict[str, Any]:
    """Export the final model: runtimes × modes, one export directory per dtype."""
    from ..export.pipeline import export_model, load_pit_source
    from ..export.recipes import Recipe

    exp = recipe["export"]
    loaded = load_pit_source(ctx["train"]["model"])
    dirs, digests = [], {}
    for dtype in _as_list(exp["dtypes"]):
        target = folder / f"export-{dtype}"
        export_recipe = Recipe(runtimes=tuple(_as_list(exp["runtimes"])), modes=tuple(_as_list(exp["modes"])),
                               dtype=dtype, max_seq_len=int(exp["max_seq_len"]), name=f"run-{recipe.name}",
                               pte_head_bits=exp["pte_head_bits"])
        export_model(loaded, target, export_recipe, force=True, progress=lambda m: say("  " + m))
        dirs.append(str(target))
        digests[target.name] = digest_path(target / "manifest.json")
    return {"exports": dirs, "digests": digests}


def stage_verify(folder: Path, recipe: RunRecipe, ctx: dict, say: Say, fresh: bool = False) -> dict[str, Any]:
    """Run every artifact on its runtime against the PyTorch reference."""
    from ..evaluate.verify import verify_directory

    if not recipe["verify"]["enabled"]:
        return {"disabled": True, "passed": None, "reports": []}
    reports = []
    for directory in ctx["export"]["exports"]:
        report = verify_directory(directory)
        say(str(report))
        reports.append(report.to_dict())
    write_json_atomic(folder / "verify.json", {"reports": reports})
    passed = all(r["passed"] for r in reports)
    if not passed:
        failed = [f"{Path(r['directory']).name}/{a['runtime']}-{a['mode']}: {'; '.join(a['failures'])}"
                  for r in reports for a in r["artifacts"] if not a["passed"]]
        raise StageFailed("verification failed: " + " | ".join(failed), 1)
    return {"passed": passed, "reports": reports}


def stage_bench(folder: Path, recipe: RunRecipe, ctx: dict, say: Say, fresh: bool = False) -> dict[str, Any]:
    """Latency, memory and size of every artifact (``pit-deploy bench``)."""
    b = recipe["bench"]
    if not b["enabled"]:
        return {"disabled": True, "rows": []}
    from ..evaluate.bench import BenchOptions, bench_directories

    opts = BenchOptions(threads=tuple(_as_list(b["threads"])), prompt_lens=(int(b["prompt_len"]),),
                        gen_len=int(b["gen_len"]), reps=int(b["reps"]))
    result = bench_directories(ctx["export"]["exports"], opts, progress=lambda m: say("  " + m))
    data = result.to_dict()
    write_json_atomic(folder / "bench.json", data)
    try:
        result.plot(folder / "bench.png")
    except Exception as exc:  # a chart is a nicety; the numbers are in bench.json
        log.warning("bench chart not drawn: %s", exc)
    return {"rows": data["rows"], "json": str(folder / "bench.json"), "png": str(folder / "bench.png")}


def stage_report(folder: Path, recipe: RunRecipe, ctx: dict, say: Say, fresh: bool = False) -> dict[str, Any]:
    from .report import write_report

    answers = folder / "answers.json"
    if not answers.is_file() or fresh:
        from .answers import greedy_answers

        try:
            write_json_atomic(answers, greedy_answers(recipe, ctx))
        except PitError as exc:
            write_json_atomic(answers, {"error": str(exc)})
    md = write_report(folder.parent, recipe)
    say(f"report: {md}")
    return {"report": str(md)}


def write_report_safely(out: Path, recipe: RunRecipe, say: Say) -> None:
    """The report of a run that stopped early (what ran, what failed)."""
    from .report import write_report

    try:
        md = write_report(out, recipe)
        say(f"report (partial): {md}")
    except Exception as exc:  # never hide the stage's own failure behind a report failure
        say(f"report could not be written: {exc}")


STAGE_FUNCTIONS: dict[str, Callable[..., dict[str, Any]]] = {
    "convert": stage_convert, "train": stage_train, "export": stage_export,
    "verify": stage_verify, "bench": stage_bench, "report": stage_report,
}


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]

"""``pit-deploy run``: convert → train → export → verify → bench → report in one run directory.

Each stage lives in its own sub-directory with a ``stage.json`` record (:mod:`.stage_records`). The
pipeline walks the stages in order; a stage whose settings, input digests and outputs are
unchanged since it last finished is skipped (and says so), ``from_stage`` redoes a stage and
everything after it, and a stage that was interrupted runs again — training resumes from its
last checkpoint. A stage that fails stops the run: the report still gets written, listing what
failed, and the run's exit code is the failed stage's (1 a verification bound, 2 unusable input
— a full disk included —, 3 an internal error; ``docs/conventions.md``).

One process at a time: the run holds an exclusive lock on its directory while it works, and
never writes where its source model or data live.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from ..errors import PitError, WriteError, as_write_error
from ..io.fs import (LOCK_NAME, RUN_FORMAT, check_apart, json_text, lock_directory, remove_stale_partials,
                     write_json_atomic, write_text_atomic)
from .recipe import STAGES, RunRecipe
from .report import REPORT_NAME, isa_tag
from .stage_records import StageRecord, digest_path, fingerprint, jsonable, relative_outputs, resolved_outputs, stage_dir

log = logging.getLogger(__name__)
Say = Callable[[str], None]


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
    """Run (or resume, or skip through) every stage of ``recipe`` into ``out``.

    Raises:
        PitError: ``out`` cannot be this run's directory (another recipe's, someone else's, the
            source's, held by another run, a damaged record in it), or a write the user can fix
            failed outside a stage (a :class:`~pit_deploy.errors.WriteError`).
    """
    if from_stage is not None and from_stage not in STAGES:
        raise PitError(f"--from {from_stage!r}: choose one of {', '.join(STAGES)}")
    from .validate import check_run_fits

    check_run_fits(recipe)  # the recipe fits the model (its config only), before any stage runs
    out = Path(out).absolute()
    try:
        with claim_run_directory(out, recipe, force, say):
            return _run_stages(recipe, out, from_stage, say)
    except OSError as exc:  # a record, a folder: writes outside a stage's own error handling
        mapped = as_write_error(exc, under=out)
        if mapped is None or mapped is exc:
            raise
        raise mapped from exc


def _run_stages(recipe: RunRecipe, out: Path, from_stage: str | None, say: Say) -> RunResult:
    """The stages in order, in the claimed directory ``out``."""
    result = RunResult(out=str(out))
    # every record is read (and a damaged one refused) before any stage does any work
    records = {stage: StageRecord.read(stage_dir(out, stage), stage) for stage in STAGES}
    summary = resume_summary(records)
    if summary:
        say(summary)
    ctx: dict[str, dict[str, Any]] = {}
    redo_from = STAGES.index(from_stage) if from_stage else len(STAGES)
    for i, stage in enumerate(STAGES):
        folder = stage_dir(out, stage)
        settings, inputs = plan(stage, recipe, ctx, out)
        previous = records[stage]
        why = None if previous is None or i >= redo_from else previous.redo_reason(settings, inputs, out)
        if i < redo_from and previous is not None and why is None:
            if previous.refreshed:  # same files, new mtimes (a copied run): keep the next check cheap
                previous.write(folder, stamp=False)
            say(f"{stage}: up to date (same settings, inputs and outputs as the finished stage) — skipped")
            ctx[stage] = resolved_outputs(previous.outputs, out)
            result.stages[stage] = "skipped"
            continue
        reason = (("--from " + from_stage) if i >= redo_from else why if previous is not None else
                  "first run" if not any(records.values()) else "not run before")
        say(f"{stage}: running ({reason})")
        record = run_stage(stage, folder, recipe, ctx, say, settings, inputs, fresh=i >= redo_from)
        ctx[stage] = resolved_outputs(record.outputs, out)
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


def run_stage(stage: str, folder: Path, recipe: RunRecipe, ctx: dict[str, dict[str, Any]], say: Say,
              settings: dict[str, Any], inputs: dict[str, Any], fresh: bool) -> StageRecord:
    """Run one stage and write its record: ``running`` first (what an interrupt leaves, so the
    next run knows to resume it), then ``done``/``skipped`` with its outputs (paths relative to
    the run directory) and their digests, or ``failed`` with the error and its exit code."""
    run = folder.parent
    record = StageRecord(stage=stage, settings=settings, inputs=inputs)
    record.write(folder)
    start = time.perf_counter()
    try:
        outputs = STAGE_FUNCTIONS[stage](folder, recipe, ctx, say, fresh=fresh)
        record.status = "skipped" if outputs.get("disabled") else "done"
        record.outputs = relative_outputs(jsonable(outputs), run)
        record.files = fingerprint(run, record.outputs)
    except StageFailed as exc:
        record.status, record.error, record.exit_code = "failed", str(exc), exc.exit_code
    except PitError as exc:  # 2 (a full disk included: WriteError), or 1 for a bound (training's IdentityLost)
        record.status, record.error, record.exit_code = "failed", str(exc), exc.exit_code
    except Exception as exc:
        mapped = as_write_error(exc, under=folder)
        if mapped is not None:  # a write failed for a reason the user can fix: not a bug
            record.status, record.error, record.exit_code = "failed", str(mapped), 2
        else:  # an internal error: one line here, the traceback in the log
            log_path = folder / "error.log"
            with contextlib.suppress(OSError):
                write_text_atomic(log_path, traceback.format_exc())
            record.status, record.error, record.exit_code = "failed", f"internal error: {exc!r} (traceback in {log_path})", 3
    record.seconds = round(time.perf_counter() - start, 2)
    record.write(folder)
    return record


def resume_summary(records: dict[str, StageRecord | None]) -> str | None:
    """One line on what an earlier run left: which stages finished and where this one resumes
    (``None`` for a new run directory)."""
    if not any(records.values()):
        return None
    finished: list[str] = []
    for stage, rec in records.items():
        if rec is not None and rec.status in ("done", "skipped"):
            finished.append(stage)
            continue
        state = "has not run" if rec is None else "was interrupted" if rec.status == "running" else "failed"
        return (f"resuming this run: {', '.join(finished) or 'no stage'} finished before; {stage} {state} and "
                "runs now (a finished stage is redone only if its settings, inputs or outputs changed)")
    return "every stage finished before; each is redone only if its settings, inputs or outputs changed"


@contextlib.contextmanager
def claim_run_directory(out: Path, recipe: RunRecipe, force: bool, say: Say = print) -> Iterator[None]:
    """Make ``out`` this recipe's run directory and hold it, locked, for the block.

    Refuses (before writing anything) a directory of another recipe or someone else's unless
    ``force``, and always one that is, contains or lies inside the source model or the data.
    The lock makes a second process on the same directory fail at once (exit 2, naming the
    holder's PID) instead of interleaving its writes; the OS drops it when the holder exits.
    Partial files and directories left in ``out`` by killed processes are removed.
    """
    check_run_directory(out, recipe, force)
    out.mkdir(parents=True, exist_ok=True)
    with lock_directory(out, "run"):
        check_run_directory(out, recipe, force)  # again: a run that held the lock may have changed it
        removed = [p for d in _directories(out) for p in remove_stale_partials(d)]
        if removed:
            say(f"removed {len(removed)} partial file(s) left by killed processes: "
                + ", ".join(str(p.relative_to(out)) for p in removed[:3]) + (" …" if len(removed) > 3 else ""))
        write_json_atomic(out / "run.json", {"format": RUN_FORMAT, "recipe": recipe.name, "settings": recipe.to_dict()})
        yield


def check_run_directory(out: Path, recipe: RunRecipe, force: bool) -> None:
    """Refuse an ``out`` that cannot be this recipe's run directory (see
    :func:`claim_run_directory`)."""
    run, lora = recipe["run"], recipe["lora"]
    sources = [("the source model " + str(run["model"]), run["model"]), ("the data " + str(run["data"]), run["data"])]
    if lora["enabled"] and lora["data"]:
        sources.append(("the LoRA data " + str(lora["data"]), lora["data"]))
    check_apart(out, sources, "refusing to write the run there (choose a new directory)")
    if out.exists() and not out.is_dir():
        raise PitError(f"--out {out} exists and is not a directory; choose another path")
    meta = out / "run.json"
    if meta.exists():
        try:
            data = json.loads(meta.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, ValueError, IsADirectoryError):
            data = None
        if not isinstance(data, dict) or data.get("format") != RUN_FORMAT:
            raise PitError(f"{meta} is not a pit-deploy run record; choose another --out")
        if data.get("recipe") != recipe.name and not force:
            raise PitError(f"{out} is a run of recipe {data.get('recipe')!r}, not {recipe.name!r}; choose "
                           "another --out, or pass --force to reuse it (stages whose settings differ rerun)")
    elif out.is_dir() and any(p.name != LOCK_NAME for p in out.iterdir()):
        # --force reuses a run of another recipe; it never turns someone's folder into a run
        raise PitError(f"--out {out} exists and is not a pit-deploy run directory (no run.json); choose a new "
                       "directory, or an earlier run's")


def _directories(root: Path) -> list[Path]:
    """``root`` and its sub-directories, without dot-named ones (partials themselves)."""
    return [root] + sorted(p for p in root.rglob("*") if p.is_dir()
                           and not any(part.startswith(".") for part in p.relative_to(root).parts))


def plan(stage: str, recipe: RunRecipe, ctx: dict[str, dict[str, Any]],
         run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The settings and input digests a stage would get now (what makes it up to date). Paths
    are digested relative to ``run_dir``, so a copied or moved run is still up to date."""
    run = recipe["run"]
    if stage == "convert":
        return {**recipe["convert"], "model": run["model"], "data": run["data"]}, {"model": source_fingerprint(run["model"])}
    if stage == "train":
        return ({**recipe.effective("train"), "lora": recipe["lora"], "model": run["model"], "data": run["data"]},
                {"converted": ctx.get("convert", {}).get("digest")})
    if stage == "export":
        return recipe.export_recipe().to_dict(), {"model": ctx.get("train", {}).get("digest")}
    if stage == "verify":
        return recipe["verify"], {"exports": ctx.get("export", {}).get("digests")}
    if stage == "bench":
        return recipe["bench"], {"exports": ctx.get("export", {}).get("digests"),
                                 "verified": ctx.get("verify", {}).get("passed")}
    return recipe["report"], {s: _outputs_digest(relative_outputs(ctx.get(s, {}), run_dir)) for s in STAGES[:-1]}


def _outputs_digest(outputs: dict[str, Any]) -> Any:
    """What the report depends on of a stage: the digest(s) of what it wrote where it records
    them (convert, train, export), else a digest of its outputs (verify's rows, bench's timings),
    so that a stage that ran again with other settings also brings the report up to date."""
    if not outputs:
        return None
    recorded = outputs.get("digest") or outputs.get("digests")
    if recorded:
        return recorded
    # as the record stores them (strict JSON: a NaN figure is null there), so that outputs read back
    # from the record digest like the ones the stage just returned
    return hashlib.sha256(json_text(outputs, sort_keys=True, default=str).encode()).hexdigest()


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
    from ..converters import convert_model
    from ..io.checkpoint import save_model
    from ..io.sources import load_source
    from ..model.core import PITSpec
    from ..training.evaluation import heldout_nll

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
    train = recipe.effective("train")
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
    from ..training.loop import TrainConfig, latest_checkpoint, train

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
    if fresh and out.exists():
        shutil.rmtree(out)
    cfg = TrainConfig(out=str(out), model=str(model), data=data, tying=tying, resume=False,
                      force=True, progress=False, plot=True, **options)
    checkpoint = latest_checkpoint(out) if out.is_dir() else None
    changed = checkpoint_mismatch(checkpoint, cfg) if checkpoint is not None else []
    resume = checkpoint is not None and not changed
    cfg = replace(cfg, resume=resume, force=not resume)
    say(f"  training {tying} → {out.name}/" + (" (resuming from its last checkpoint)" if resume else
        f" (starting over: its last checkpoint was saved with another {', '.join(changed)})" if changed else ""))
    nproc = int(settings.get("nproc", 1))
    if nproc > 1:
        run_distributed(cfg, nproc)
    else:
        train(cfg, say=lambda line: say("    " + line))
    summary = json.loads((out / "summary.json").read_text())
    return {"dir": str(out), "model": str(out / "model"), "summary": summary}


def checkpoint_mismatch(checkpoint: Path, cfg: Any) -> list[str]:
    """The options a resumed run must keep (``RESUME_KEYS``) on which ``cfg`` differs from the
    run that saved ``checkpoint``: changed training settings, or the converted model's path in
    a copied or moved run directory. Such a checkpoint cannot be resumed; the job starts over.
    An unreadable ``state.json`` is left to the loader, which skips damaged checkpoints."""
    from ..training.config import changed_resume_keys

    try:
        saved = json.loads((checkpoint / "state.json").read_text(encoding="utf-8"))["config"]
        return changed_resume_keys(saved, jsonable(asdict(cfg)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def run_distributed(cfg: Any, nproc: int) -> None:
    """``torchrun --nproc-per-node N -m pit_deploy train --config FILE``: the training config
    travels as a JSON file of its fields (:func:`pit_deploy.training.config.write_config`)."""
    from ..training.config import write_config

    path = write_config(cfg, Path(cfg.out).with_name(Path(cfg.out).name + ".config.json"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "pit_deploy", "train", "--config", str(path)]
    proc = subprocess.run(cmd, env=os.environ.copy())
    if proc.returncode != 0:
        raise StageFailed(f"torchrun training exited with {proc.returncode}",
                          proc.returncode if proc.returncode in (1, 2) else 3)


def stage_export(folder: Path, recipe: RunRecipe, ctx: dict, say: Say, fresh: bool = False) -> dict[str, Any]:
    """Export the final model: runtimes × modes, one export directory per dtype."""
    from ..exporters.pipeline import export_model, load_pit_source

    exp = recipe.export_recipe()
    loaded = load_pit_source(ctx["train"]["model"])
    dirs, digests = [], {}
    for scheme in exp.dtype:  # one export directory per scheme
        target = folder / f"export-{scheme}"
        export_model(loaded, target, exp.only(scheme), force=True, progress=lambda m: say("  " + m))
        dirs.append(str(target))
        digests[target.name] = digest_path(target / "manifest.json")
    return {"exports": dirs, "digests": digests}


def stage_verify(folder: Path, recipe: RunRecipe, ctx: dict, say: Say, fresh: bool = False) -> dict[str, Any]:
    """Run every artifact on its runtime against the PyTorch reference."""
    from ..evaluate.verify import verify_directory

    if not recipe["verify"]["enabled"]:
        return {"disabled": True, "passed": None, "reports": []}
    v = recipe.effective("verify")
    aarch64 = "aarch64" in v["isa"]
    reports = []
    for directory in ctx["export"]["exports"]:
        report = verify_directory(directory, isa=v["isa"], arm_cpu=v["arm_cpu"] if aarch64 else None,
                                  kleidiai=v["kleidiai"] if aarch64 else None, full=aarch64 and v["full"])
        say(str(report))
        reports.append(report.to_dict())
    write_json_atomic(folder / "verify.json", {"reports": reports})
    passed = all(r["passed"] for r in reports)
    if not passed:
        failed = [f"{Path(r['directory']).name}/{a['runtime']}-{a['mode']}{isa_tag(a)}: {'; '.join(a['failures'])}"
                  for r in reports for a in r["artifacts"] if not a["passed"] and a.get("checked", True)]
        raise StageFailed("verification failed: " + " | ".join(failed), 1)
    return {"passed": passed, "reports": reports, "json": str(folder / "verify.json")}


def stage_bench(folder: Path, recipe: RunRecipe, ctx: dict, say: Say, fresh: bool = False) -> dict[str, Any]:
    """Latency, memory and size of every artifact (``pit-deploy bench``)."""
    b = recipe["bench"]
    if not b["enabled"]:
        return {"disabled": True, "rows": []}
    from ..evaluate.bench import bench_directories, bench_options

    opts = bench_options(b)
    result = bench_directories(ctx["export"]["exports"], opts, progress=lambda m: say("  " + m))
    data = result.to_dict()
    write_json_atomic(folder / "bench.json", data)
    png = folder / "bench.png"
    try:
        result.plot(png)
    except Exception as exc:  # a chart is a nicety; the numbers are in bench.json
        log.warning("bench chart not drawn: %s", exc)
    return {"rows": data["rows"], "json": str(folder / "bench.json"), **({"png": str(png)} if png.is_file() else {})}


def stage_report(folder: Path, recipe: RunRecipe, ctx: dict, say: Say, fresh: bool = False) -> dict[str, Any]:
    """Greedy answers of the shipped artifact beside the source's, then ``report.md`` and
    ``report.html``. The answers are asked again whenever the stage runs: it runs because
    something it reports on changed."""
    from .answers import greedy_answers
    from .report import write_report

    answers = folder / "answers.json"
    try:
        write_json_atomic(answers, greedy_answers(recipe, ctx))
    except WriteError:  # the answers could not be saved (full disk): the stage fails
        raise
    except PitError as exc:  # no answers to show: the report says why
        write_json_atomic(answers, {"error": str(exc)})
    md = write_report(folder.parent, recipe)
    say(f"report: {md}")
    return {"report": str(md), "html": str(md.with_suffix(".html")), "answers": str(answers)}


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

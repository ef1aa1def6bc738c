"""``pit-deploy run`` trusts nothing it cannot check: a finished stage whose outputs
are gone or changed is redone; records hold paths relative to the run directory, so a copied
or moved run works alone; one process per run directory; never a run inside its own source;
a rerun says what it resumes; partial files of killed processes are removed; a full disk or an
unwritable target is a one-line exit 2 that leaves nothing half-written; a damaged record is a
one-line exit 2.

The stage-record logic is exercised with fake stages that write small files (milliseconds per
run); the write-failure checks run the real convert, run, export and verify commands on a tiny
model under a file size limit, in one subprocess."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from pit_deploy.cli import main
from pit_deploy.errors import WriteError, as_write_error
from pit_deploy.io.fs import atomic_directory, remove_stale_partials, write_json_atomic, write_text_atomic
from pit_deploy.workflow import pipeline, validate
from pit_deploy.workflow.pipeline import StageFailed
from pit_deploy.workflow.recipe import STAGES
from pit_deploy.workflow.stage_records import StageRecord, digest_path, stage_dir

from train_fixtures import make_corpus

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


# --------------------------------------------------------------------------------------
# Fake stages: the pipeline's contract (paths in, paths and digests out) in a few files
# --------------------------------------------------------------------------------------


def _convert(folder: Path, recipe, ctx, say, fresh=False) -> dict[str, Any]:
    model = folder / "model"
    with atomic_directory(model, force=True) as tmp:
        (tmp / "weights.bin").write_bytes(b"converted " + digest_path(recipe["run"]["model"]).encode())
        (tmp / "config.json").write_text("{}")
    return {"model": str(model), "digest": digest_path(model), "source": {"path": recipe["run"]["model"]}}


def _train(folder: Path, recipe, ctx, say, fresh=False) -> dict[str, Any]:
    job = folder / "pit"
    (job / "checkpoints").mkdir(parents=True, exist_ok=True)
    (job / "checkpoints" / "step-1").write_text("state")
    with atomic_directory(job / "model", force=True) as tmp:
        (tmp / "weights.bin").write_bytes(b"trained " + (Path(ctx["convert"]["model"]) / "weights.bin").read_bytes())
    return {"model": str(job / "model"), "digest": digest_path(job / "model"),
            "runs": {"pit": {"dir": str(job), "model": str(job / "model"), "summary": {"out": str(job), "steps": 1}}}}


def _export(folder: Path, recipe, ctx, say, fresh=False) -> dict[str, Any]:
    target = folder / "export-float32"
    with atomic_directory(target, force=True) as tmp:
        (tmp / "onnx-factorized").mkdir()
        weights = (Path(ctx["train"]["model"]) / "weights.bin").read_bytes()
        (tmp / "onnx-factorized" / "model.onnx").write_bytes(b"onnx " + weights)
        write_json_atomic(tmp / "manifest.json", {"artifacts": ["onnx-factorized/model.onnx"], "created": time.time_ns(),
                                                  "verification": None})  # like the real one: a new digest each time
    return {"exports": [str(target)], "digests": {target.name: digest_path(target / "manifest.json")}}


def _verify(folder: Path, recipe, ctx, say, fresh=False) -> dict[str, Any]:
    """Like the real verify: checks every artifact and records the verdict in its manifest."""
    reports = []
    for directory in map(Path, ctx["export"]["exports"]):
        manifest = json.loads((directory / "manifest.json").read_text())
        missing = [a for a in manifest["artifacts"] if not (directory / a).is_file()]
        if missing:
            raise StageFailed(f"verification failed: {missing} missing", 1)
        manifest["verification"] = {"passed": True, "at": time.time_ns()}
        write_json_atomic(directory / "manifest.json", manifest)
        reports.append({"directory": str(directory), "passed": True})
    write_json_atomic(folder / "verify.json", {"reports": reports})
    return {"passed": True, "reports": reports, "json": str(folder / "verify.json")}


def _bench(folder: Path, recipe, ctx, say, fresh=False) -> dict[str, Any]:
    write_json_atomic(folder / "bench.json", {"rows": []})
    return {"rows": [], "json": str(folder / "bench.json")}


def _report(folder: Path, recipe, ctx, say, fresh=False) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    md = write_text_atomic(folder.parent / "report.md", f"verified: {ctx['verify']['passed']}\n")
    write_text_atomic(md.with_suffix(".html"), "<p>verified</p>")
    return {"report": str(md), "html": str(md.with_suffix(".html"))}


FAKES: dict[str, Callable[..., dict[str, Any]]] = {
    "convert": _convert, "train": _train, "export": _export, "verify": _verify, "bench": _bench, "report": _report}
#: one product file of each stage, relative to the run directory
PRODUCTS = {"convert": "1-convert/model/weights.bin", "train": "2-train/pit/model/weights.bin",
            "export": "3-export/export-float32/onnx-factorized/model.onnx", "verify": "4-verify/verify.json",
            "bench": "5-bench/bench.json", "report": "report.md"}


@pytest.fixture
def fake(monkeypatch, tmp_path, capsys):
    """The fake stages in place of the real ones, a source model and data directory, and
    ``fake.run(out, *flags) -> (exit code, stderr)`` with the stages each call ran in ``fake.calls``."""
    calls: list[str] = []

    def logged(name: str, fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
        def stage(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return stage

    for name, fn in FAKES.items():
        monkeypatch.setitem(pipeline.STAGE_FUNCTIONS, name, logged(name, fn))
    # the source is a stand-in, not a model: the up-front fit check (its own tests are in
    # test_own_model.py) would refuse it before the record logic under test runs
    monkeypatch.setattr(validate, "check_run_fits", lambda recipe: None)
    src = tmp_path / "src"
    (src / "model").mkdir(parents=True)
    (src / "model" / "config.json").write_text('{"hidden_size": 8}')
    (src / "data").mkdir()
    (src / "data" / "a.txt").write_text("some text")

    def run(out: Path, *flags: str) -> tuple[int, str]:
        calls.clear()
        capsys.readouterr()
        code = main(["run", "smoke", "--model", str(src / "model"), "--data", str(src / "data"), "--out", str(out), *flags])
        return code, capsys.readouterr().err

    return SimpleNamespace(run=run, calls=calls, model=src / "model", data=src / "data", tmp=tmp_path)


def _records(out: Path) -> dict[str, StageRecord]:
    return {s: StageRecord.read(stage_dir(out, s), s) for s in STAGES}


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


# --------------------------------------------------------------------------------------
# 1. outputs are re-checked, not trusted
# --------------------------------------------------------------------------------------


def _delete(path: Path) -> str:
    path.unlink()
    return "is missing"


def _rewrite(path: Path) -> str:  # same size, other bytes: only the digest can tell
    path.write_bytes(bytes(255 - b for b in path.read_bytes()))
    return "was changed"


def _replace_folder(path: Path) -> str:  # the whole folder swapped for another one
    shutil.rmtree(path.parent)
    path.parent.mkdir()
    (path.parent / "other.bin").write_text("someone else's")
    return "is missing"


@pytest.mark.parametrize("stage, mutate", [
    pytest.param(stage, mutate, id=f"{stage}-{mutate.__name__[1:]}") for stage in STAGES
    for mutate in (_delete, _rewrite, _replace_folder)
    if mutate is not _replace_folder or stage in ("convert", "train", "export")])  # folders of their own
def test_a_stage_whose_outputs_are_gone_or_changed_is_redone_and_says_why(fake, stage, mutate):
    out = fake.tmp / "run"
    assert fake.run(out)[0] == 0
    said = mutate(out / PRODUCTS[stage])
    code, err = fake.run(out)
    assert code == 0, err
    changed = PRODUCTS[stage] if mutate is not _replace_folder else PRODUCTS[stage].rsplit("/", 1)[0] + "/"
    assert re.search(rf"{stage}: running \(its outputs changed since it finished: {re.escape(changed)}\S* {said}", err), err
    earlier = STAGES[:STAGES.index(stage)]
    assert fake.calls[:1] == [stage] and not set(earlier) & set(fake.calls)
    for name, record in _records(out).items():  # what the run now reports on is what is on disk
        assert record.status == "done" and record.stale_outputs(out) is None, name
    assert fake.run(out)[0] == 0 and fake.calls == []  # and it is up to date again


def test_an_export_deleted_after_verification_is_exported_and_verified_again(fake):
    """The original symptom: an artifact deleted after a finished run, and the report still
    said every artifact passed."""
    out = fake.tmp / "run"
    assert fake.run(out)[0] == 0
    shutil.rmtree(out / "3-export" / "export-float32")
    code, err = fake.run(out)
    assert code == 0, err
    assert fake.calls == ["export", "verify", "bench", "report"]
    assert (out / PRODUCTS["export"]).is_file()


def test_a_touched_or_amended_output_is_not_redone_and_a_rerun_writes_nothing(fake):
    """Only content counts: a file whose mtime moved (a copy) is re-hashed once and its record
    refreshed; a manifest that verify amended after the export is the export's own."""
    out = fake.tmp / "run"
    assert fake.run(out)[0] == 0
    manifest = json.loads((out / "3-export" / "export-float32" / "manifest.json").read_text())
    assert manifest["verification"]["passed"]  # amended by verify, after the export stage finished
    before = {p: p.stat().st_mtime_ns for p in out.rglob("stage.json")}
    code, err = fake.run(out)
    assert code == 0 and fake.calls == [] and err.count("up to date") == 6
    assert {p: p.stat().st_mtime_ns for p in out.rglob("stage.json")} == before
    product = out / PRODUCTS["train"]
    os.utime(product, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert fake.run(out)[0] == 0 and fake.calls == []
    entry = _records(out)["train"].files[PRODUCTS["train"]]
    assert entry["mtime_ns"] == product.stat().st_mtime_ns  # refreshed: the next check is a stat


# --------------------------------------------------------------------------------------
# 2. paths relative to the run directory
# --------------------------------------------------------------------------------------


def test_records_name_no_absolute_path_of_the_run(fake):
    out = fake.tmp / "run"
    assert fake.run(out)[0] == 0
    for record in out.rglob("stage.json"):
        assert str(out) not in record.read_text(), record


def test_a_copied_or_moved_run_directory_works_alone_and_never_touches_the_original(fake):
    out = fake.tmp / "run"
    assert fake.run(out)[0] == 0
    original = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}
    copy = fake.tmp / "copy"
    shutil.copytree(out, copy)
    code, err = fake.run(copy)
    assert code == 0 and fake.calls == [], err
    code, err = fake.run(copy, "--from", "verify")
    assert code == 0 and fake.calls == ["verify", "bench", "report"], err
    for r in _records(copy)["verify"].outputs["reports"]:
        assert (copy / r["directory"]).is_dir()
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()} == original
    moved = fake.tmp / "moved"
    copy.rename(moved)
    assert fake.run(moved)[0] == 0 and fake.calls == []


def test_an_old_record_naming_a_path_outside_the_run_is_redone_and_says_so(fake):
    """A record of an older pit-deploy held absolute paths; in a copied run they point at the
    original, which must be neither trusted nor written."""
    out = fake.tmp / "run"
    assert fake.run(out)[0] == 0
    copy = fake.tmp / "copy"
    shutil.copytree(out, copy)
    path = stage_dir(copy, "export") / "stage.json"
    data = json.loads(path.read_text())
    data["outputs"]["exports"] = [str(out / "3-export" / "export-float32")]  # as older records held them
    data.pop("files")
    path.write_text(json.dumps(data))
    before = (out / "3-export" / "export-float32" / "manifest.json").read_bytes()
    code, err = fake.run(copy)
    assert code == 0, err
    assert f"export: running (its record names {out / '3-export' / 'export-float32'}, outside this run directory" in err
    assert fake.calls == ["export", "verify", "bench", "report"]
    assert (out / "3-export" / "export-float32" / "manifest.json").read_bytes() == before
    data["outputs"]["exports"] = ["3-export/export-float32"]  # relative, but no digests: an older record too
    path.write_text(json.dumps(data))
    code, err = fake.run(copy)
    assert "export: running (its record has no digests of its outputs" in err


def test_a_checkpoint_of_other_settings_or_of_a_copied_run_is_not_resumed(tmp_path):
    """Training resumes only from a checkpoint saved with the options a resumed run must keep;
    in a copied run directory the converted model's path differs, so the job starts over
    instead of failing ("--resume with different options")."""
    from dataclasses import asdict, replace

    from pit_deploy.workflow.pipeline import checkpoint_mismatch
    from pit_deploy.workflow.stage_records import jsonable
    from pit_deploy.training.loop import TrainConfig

    cfg = TrainConfig(out=str(tmp_path / "2-train" / "pit"), model=str(tmp_path / "1-convert" / "model"), data="default")
    checkpoint = tmp_path / "step-0000004"
    checkpoint.mkdir()
    saved = jsonable(asdict(cfg))
    (checkpoint / "state.json").write_text(json.dumps({"step": 4, "config": saved}))
    assert checkpoint_mismatch(checkpoint, cfg) == []
    # a checkpoint saved before an option existed ran with its default: it still resumes
    older = {k: v for k, v in saved.items() if k != "train_body"}
    (checkpoint / "state.json").write_text(json.dumps({"step": 4, "config": older}))
    assert checkpoint_mismatch(checkpoint, cfg) == []
    assert checkpoint_mismatch(checkpoint, replace(cfg, train_body=False)) == ["train_body"]
    saved.update(model="/elsewhere/1-convert/model", seq_len=7)
    (checkpoint / "state.json").write_text(json.dumps({"step": 4, "config": saved}))
    assert checkpoint_mismatch(checkpoint, cfg) == ["model", "seq_len"]


# --------------------------------------------------------------------------------------
# 3. one process per run directory
# --------------------------------------------------------------------------------------

HOLDER = """
import sys
from pit_deploy.io.fs import lock_directory
with lock_directory(sys.argv[1]):
    print("locked", flush=True)
    sys.stdin.read()
"""


def test_a_second_run_on_a_held_directory_exits_2_naming_the_holder(fake):
    out = fake.tmp / "run"
    assert fake.run(out)[0] == 0
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != ".pit-deploy.lock"}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=ENV)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, err = fake.run(out, "--from", "convert")
        assert code == 2 and fake.calls == []
        assert _error_lines(err) == [f"error: another pit-deploy run (pid {holder.pid}) is using {out}; wait for it "
                                     "to finish, or choose another --out"]
        assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != ".pit-deploy.lock"} == before
    finally:
        holder.kill()  # a holder that dies without cleaning up: the OS drops its lock
        holder.wait(timeout=30)
    assert fake.run(out)[0] == 0


# --------------------------------------------------------------------------------------
# 4. never inside the source
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("where", ["model", "inside-model", "contains-model", "data", "inside-data", "contains-data"])
def test_out_that_is_contains_or_lies_inside_the_source_or_data_is_refused(fake, where, force):
    out = {"model": fake.model, "inside-model": fake.model / "run", "contains-model": fake.model.parent,
           "data": fake.data, "inside-data": fake.data / "sub" / "run", "contains-data": fake.tmp}[where]
    before = sorted((p, p.stat().st_mtime_ns) for p in fake.tmp.rglob("*"))
    code, err = fake.run(out, *(["--force"] if force else []))
    assert code == 2 and fake.calls == []
    (line,) = _error_lines(err)
    assert "refusing to write the run there" in line or "write the output elsewhere" in line
    assert f"the source model {fake.model}" in line or f"the data {fake.data}" in line
    assert sorted((p, p.stat().st_mtime_ns) for p in fake.tmp.rglob("*")) == before


# --------------------------------------------------------------------------------------
# 5. a rerun says what it resumes
# --------------------------------------------------------------------------------------


def test_a_rerun_after_an_interrupt_says_what_finished_and_what_it_resumes(fake, monkeypatch):
    out = fake.tmp / "run"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setitem(pipeline.STAGE_FUNCTIONS, "export", interrupted)
    code, err = fake.run(out)
    assert code == 130 and "first run" in err
    assert _records(out)["export"].status == "running"
    monkeypatch.setitem(pipeline.STAGE_FUNCTIONS, "export", FAKES["export"])
    code, err = fake.run(out)
    assert code == 0, err
    assert "first run" not in err
    assert "resuming this run: convert, train finished before; export was interrupted and runs now" in err
    assert "export: running (interrupted before it finished; resuming it)" in err
    assert "verify: running (not run before)" in err


# --------------------------------------------------------------------------------------
# 6. partial files of killed processes
# --------------------------------------------------------------------------------------


posix_only = pytest.mark.skipif(os.name == "nt", reason="PIDs are checked for liveness on POSIX only")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def live_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield proc.pid
    proc.kill()
    proc.wait()


def _leave_partials(parent: Path, name: str, live: int) -> tuple[Path, Path, Path]:
    """A killed writer's partial directory and temporary file of ``name``, and a live one's."""
    parent.mkdir(parents=True, exist_ok=True)
    dead = _dead_pid()
    dead_dir = parent / f".{name}.partial-{dead}-abc123"
    dead_dir.mkdir()
    (dead_dir / "model.safetensors").write_bytes(b"half")
    dead_file = parent / f".{name}.partial-{dead}"
    dead_file.write_text("half")
    live_dir = parent / f".{name}.partial-{live}-def456"
    live_dir.mkdir()
    return dead_dir, dead_file, live_dir


@posix_only
@pytest.mark.parametrize("writer", ["directory", "file"])
def test_the_next_write_of_a_target_removes_its_partials_of_dead_processes_only(tmp_path, live_pid, writer):
    target = tmp_path / ("model" if writer == "directory" else "run.json")
    dead_dir, dead_file, live_dir = _leave_partials(tmp_path, target.name, live_pid)
    other = tmp_path / f".other.partial-{_dead_pid()}"
    other.write_text("another target's")
    if writer == "directory":
        with atomic_directory(target) as tmp:
            (tmp / "config.json").write_text("{}")
    else:
        write_text_atomic(target, "{}")
    assert not dead_dir.exists() and not dead_file.exists()
    assert live_dir.is_dir() and other.exists()
    assert target.exists()


@posix_only
def test_a_run_removes_partials_of_killed_processes_anywhere_in_its_directory(fake, live_pid):
    out = fake.tmp / "run"
    assert fake.run(out)[0] == 0
    dead_dir, dead_file, live_dir = _leave_partials(out / "3-export", "export-int4", live_pid)
    code, err = fake.run(out)
    assert code == 0 and "removed 2 partial file(s) left by killed processes" in err
    assert not dead_dir.exists() and not dead_file.exists() and live_dir.is_dir()
    assert remove_stale_partials(out / "3-export") == []


# --------------------------------------------------------------------------------------
# 7. a write the user can fix: exit 2, one line, nothing half-written
# --------------------------------------------------------------------------------------

FAILURES = {
    "ENOSPC": (OSError(errno.ENOSPC, "No space left on device"), "no space left on device"),
    "EFBIG": (OSError(errno.EFBIG, "File too large"), "file too large"),
    "EACCES": (PermissionError(errno.EACCES, "Permission denied"), "permission denied"),
    "EROFS": (OSError(errno.EROFS, "Read-only file system"), "read-only file system"),
    "safetensors": (RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),
                    "no space left on device"),
}


@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize("writer", ["directory", "file"])
def test_a_failed_write_names_the_target_and_cause_and_leaves_the_old_one(tmp_path, monkeypatch, writer, failure):
    exc, cause = FAILURES[failure]
    target = tmp_path / ("model" if writer == "directory" else "run.json")
    if writer == "directory":
        target.mkdir()
        (target / "config.json").write_text("old")
    else:
        target.write_text("old")
    with pytest.raises(WriteError) as info:
        if writer == "directory":
            with atomic_directory(target, force=True) as tmp:
                (tmp / "config.json").write_text("new, half")
                raise exc
        else:
            real_fdopen = os.fdopen

            def failing_fdopen(fd, *args, **kwargs):  # what a full disk does to the temporary file
                fh = real_fdopen(fd, *args, **kwargs)
                fh.write = lambda text: (_ for _ in ()).throw(exc)
                return fh

            monkeypatch.setattr(os, "fdopen", failing_fdopen)
            write_text_atomic(target, "new")
    message = str(info.value)
    assert message.startswith(f"cannot write {target}: {cause}") and "\n" not in message
    assert info.value.exit_code == 2 and isinstance(info.value, OSError)
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]  # no partial left
    assert (target / "config.json" if writer == "directory" else target).read_text() == "old"


def test_a_failure_inside_a_nested_write_is_said_of_the_outer_target(tmp_path):
    """An export writes its reference checkpoint inside its own partial directory: a full disk
    there is reported against the export the user named, not the temporary name."""
    target = tmp_path / "export"
    with pytest.raises(WriteError) as info:
        with atomic_directory(target) as tmp:
            with atomic_directory(tmp / "reference"):
                raise OSError(errno.ENOSPC, "No space left on device")
    assert str(info.value).startswith(f"cannot write {target}: no space left on device")
    assert list(tmp_path.iterdir()) == []


def test_torchs_write_error_without_errno_is_explained(tmp_path, monkeypatch):
    """torch's zip writer loses the errno ("unexpected pos 576 vs 534"): the cause is found
    from the disk's free space."""
    import pit_deploy.errors as errors

    chained = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    chained.__context__ = RuntimeError("basic_ios::clear: iostream error")
    monkeypatch.setattr(errors.shutil, "disk_usage", lambda p: SimpleNamespace(free=4096))
    mapped = as_write_error(chained, tmp_path / "ck")
    assert str(mapped).startswith(f"cannot write {tmp_path / 'ck'}: no space left on device (ENOSPC)")
    assert as_write_error(RuntimeError("shapes do not match")) is None
    assert as_write_error(FileNotFoundError(errno.ENOENT, "No such file", "x")) is None


def test_a_stage_that_hits_a_full_disk_fails_with_exit_2_naming_where(fake, monkeypatch):
    out = fake.tmp / "run"

    def full(folder, *args, **kwargs):
        (folder / "pit").mkdir(parents=True, exist_ok=True)
        raise OSError(errno.ENOSPC, "No space left on device")  # an append (metrics.jsonl): no file name

    monkeypatch.setitem(pipeline.STAGE_FUNCTIONS, "train", full)
    code, err = fake.run(out)
    assert code == 2
    assert _error_lines(err) == [f"error: stage train failed: a write under {out / '2-train'} failed: no space left on "
                                 "device (ENOSPC); free some space or choose another --out"]
    assert _records(out)["train"].status == "failed"


def test_a_record_that_cannot_be_written_is_exit_2(fake, monkeypatch):
    out = fake.tmp / "run"
    real = StageRecord.write

    def write(self, folder, stamp=True):
        if self.stage == "export" and self.status == "done":
            raise OSError(errno.EROFS, "Read-only file system", str(folder / "stage.json"))
        real(self, folder, stamp)

    monkeypatch.setattr(StageRecord, "write", write)
    code, err = fake.run(out)
    assert code == 2
    assert _error_lines(err) == [f"error: {out / '3-export' / 'stage.json'}: read-only file system (EROFS); choose a "
                                 "writable location"]
    assert _records(out)["export"].status == "running"  # not done: the next run redoes it


WRITE_LIMITED = r"""
import contextlib, io, json, resource, signal, sys
from pit_deploy.cli import main

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
results = []
for limit, argv in json.loads(sys.argv[1]):
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit or resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    results.append({"argv": argv, "code": code, "err": err.getvalue()})
print(json.dumps(results))
"""


def test_commands_under_a_file_size_limit_exit_2_naming_the_path_and_leave_nothing_half_written(tmp_path):
    """The real convert, run, export and verify (recording) of a tiny model, with writes capped
    by RLIMIT_FSIZE (what a full disk does to the same writes: the model's safetensors, the
    export's reference, the manifest)."""
    pytest.importorskip("resource")  # POSIX
    from pit_deploy.io.checkpoint import save_model
    from pit_deploy.tiny import tiny_model, tiny_pit_model, tiny_tokenizer

    src, pit = tmp_path / "src", tmp_path / "pit"
    save_model(tiny_model("llama"), src, tiny_tokenizer())
    save_model(tiny_pit_model("llama"), pit, tiny_tokenizer())
    corpus = make_corpus(tmp_path)
    export = tmp_path / "export"
    small, tiny_cap = 64 * 1024, 1024  # the models are ~400 KB; run.json and the records a few KB
    tiny_onnx = ["--recipe", "tiny-ci", "--runtime", "onnx", "--mode", "materialized"]
    steps = [
        (small, ["convert", "--model", str(src), "--out", str(tmp_path / "converted"), "--t-init", "identity"]),
        (small, ["run", "smoke", "--model", str(src), "--data", str(corpus), "--out", str(tmp_path / "run"),
                 "--set", "convert.t_init='identity'", "--set", "train.eval_blocks=1", "--set", "train.seq_len=32"]),
        (small, ["export", str(pit), "--out", str(tmp_path / "capped-export"), *tiny_onnx]),
        (0, ["export", str(pit), "--out", str(export), *tiny_onnx]),
        (tiny_cap, ["verify", str(export)]),
    ]
    proc = subprocess.run([sys.executable, "-c", WRITE_LIMITED, json.dumps(steps)], capture_output=True, text=True,
                          env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    convert, run, capped, plain, verify = json.loads(proc.stdout.splitlines()[-1])
    cause = "file too large: the file size limit (ulimit -f) was reached (EFBIG); raise the limit or choose another --out"
    for result, path in [(convert, tmp_path / "converted"), (capped, tmp_path / "capped-export")]:
        assert result["code"] == 2, result
        assert _error_lines(result["err"]) == [f"error: cannot write {path}: {cause}"]
    # verify has no --out: its way out is the limit, or not recording
    assert verify["code"] == 2, verify
    assert _error_lines(verify["err"]) == [
        f"error: cannot write {export / 'manifest.json'}: file too large: the file size limit (ulimit -f) was "
        "reached (EFBIG); raise the limit, or pass --no-record to verify without recording"]
    assert run["code"] == 2, run
    model = tmp_path / "run" / "1-convert" / "model"
    assert _error_lines(run["err"]) == [f"error: stage convert failed: cannot write {model}: {cause}"]
    assert plain["code"] == 0, plain
    assert not (tmp_path / "converted").exists() and not (tmp_path / "capped-export").exists()
    assert not model.exists()
    assert _records(tmp_path / "run")["convert"].status == "failed"
    assert json.loads((export / "manifest.json").read_text())["verification"] is None  # intact, not half-recorded
    leftovers = [p for p in tmp_path.rglob("*") if ".partial-" in p.name]
    assert not leftovers, leftovers


# --------------------------------------------------------------------------------------
# 8. damaged records
# --------------------------------------------------------------------------------------

GARBAGE = {
    "binary": b"\x89PNG\r\n\x1a\n\x00\xff\xfe",
    "not-json": b"{status: done",
    "a-list": b"[1, 2, 3]",
    "no-settings": json.dumps({"stage": "train", "inputs": {}, "status": "done"}).encode(),
    "settings-a-string": json.dumps({"stage": "train", "settings": "fast", "inputs": {}, "status": "done"}).encode(),
    "outputs-a-list": json.dumps({"stage": "train", "settings": {}, "inputs": {}, "status": "done", "outputs": []}).encode(),
    "seconds-a-string": json.dumps({"stage": "train", "settings": {}, "inputs": {}, "status": "done",
                                    "seconds": "1"}).encode(),
    "unknown-status": json.dumps({"stage": "train", "settings": {}, "inputs": {}, "status": "finished"}).encode(),
    "another-stage": json.dumps({"stage": "export", "settings": {}, "inputs": {}, "status": "done"}).encode(),
    "bad-digest": json.dumps({"stage": "train", "settings": {}, "inputs": {}, "status": "done",
                              "files": {"2-train/pit/model/weights.bin": {"sha256": 5}}}).encode(),
}


@pytest.mark.parametrize("garbage", GARBAGE)
def test_a_damaged_stage_record_is_exit_2_before_any_work(fake, garbage):
    out = fake.tmp / "run"
    assert fake.run(out)[0] == 0
    record = stage_dir(out, "train") / "stage.json"
    record.write_bytes(GARBAGE[garbage])
    code, err = fake.run(out, "--from", "convert")
    assert code == 2 and fake.calls == []
    (line,) = _error_lines(err)
    assert line.startswith(f"error: {record} is not a stage record (")
    assert line.endswith("delete it to run the train stage again, or choose a new --out")


@pytest.mark.parametrize("garbage", ["binary", "not-json", "a-list"])
def test_a_damaged_run_record_is_exit_2(fake, garbage):
    out = fake.tmp / "run"
    out.mkdir()
    (out / "run.json").write_bytes(GARBAGE[garbage])
    code, err = fake.run(out)
    assert code == 2 and fake.calls == []
    assert _error_lines(err) == [f"error: {out / 'run.json'} is not a pit-deploy run record; choose another --out"]

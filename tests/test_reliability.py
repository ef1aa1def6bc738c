"""Commands that write one export directory at once never lose data or record into the wrong
export; paths a target's own config names stay inside the artifact; a model or input the
exporters cannot serve is one exit-2 line before any work (docs/conventions.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pit_deploy.cli import main
from pit_deploy.io.checkpoint import save_model
from pit_deploy.tiny import tiny_pit_model, tiny_tokenizer

PIT_DEPLOY = Path(sys.executable).with_name("pit-deploy")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("reliability") / "pit"
    save_model(tiny_pit_model("llama"), src, tiny_tokenizer())
    return src


@pytest.fixture(scope="module")
def onnx_export(source) -> Path:
    out = source.parent / "exp"
    assert main(["export", str(source), "--out", str(out), "--recipe", "tiny-ci", "--runtime", "onnx",
                 "--mode", "materialized"]) == 0
    return out


def _copy(export: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(export, target)
    return target


def _hold_lock(target: Path, what: str, then: str = "", keep: bool = True) -> subprocess.Popen:
    """A real process that holds ``target``'s lock (as a command writing it does), runs the
    Python statements ``then`` under it, and keeps it (``keep``) until :func:`_stop`; returns
    once it holds it."""
    code = textwrap.dedent(f"""
        import json, sys, time
        from pathlib import Path
        from pit_deploy.io.fs import lock_target
        with lock_target({str(target)!r}, {what!r}):
            print("locked", flush=True)
            {then or "pass"}
            if {keep}:
                sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=ENV)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


# ----------------------------------------------------------------------------------------
# Locks: export and verify take the export directory's lock; replacement is one step
# ----------------------------------------------------------------------------------------


def test_export_while_another_command_writes_the_directory_is_exit_2_naming_it(onnx_export, tmp_path):
    """A second export into a directory another process is writing (here: replacing it with
    --force) is refused, naming the first by its PID; the existing export is left as it was."""
    out = _copy(onnx_export, tmp_path)
    before = (out / "manifest.json").read_bytes()
    holder = _hold_lock(out, "export")
    try:
        run = subprocess.run([str(PIT_DEPLOY), "export", str(onnx_export / "reference"), "--out", str(out), "--force",
                              "--recipe", "tiny-ci", "--runtime", "onnx", "--mode", "materialized"],
                             capture_output=True, text=True, env=ENV, timeout=240)
    finally:
        _stop(holder)
    assert run.returncode == 2, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"pid {holder.pid}" in errors[0] and "Traceback" not in run.stderr
    assert (out / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]  # nothing hidden or left beside it


def test_force_replaces_a_directory_in_one_step_and_leaves_nothing_beside_it(tmp_path, monkeypatch):
    from pit_deploy.io import fs

    out = tmp_path / "exp"
    out.mkdir()
    (out / "old.txt").write_text("old")
    for exchange in (True, False):  # renameat2(RENAME_EXCHANGE), and the two renames elsewhere
        if not exchange:
            monkeypatch.setattr(fs, "exchange_paths", lambda a, b: False)
        seen = []
        with fs.atomic_directory(out, force=True, lock="export") as tmp:
            (tmp / "new.txt").write_text(str(exchange))
            seen.append(fs.target_lock_path(out).is_file())
        assert seen == [True]
        assert sorted(p.name for p in out.iterdir()) == ["new.txt"] and (out / "new.txt").read_text() == str(exchange)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]  # no .exp.old-PID, no lock file left


def test_exchange_keeps_the_path_present(tmp_path):
    from pit_deploy.io.fs import exchange_paths

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    (b / "x").write_text("b")
    if not exchange_paths(a, b):
        pytest.skip("this system cannot exchange two paths in one step")
    assert (a / "x").read_text() == "b" and (b / "x").read_text() == "a"


def test_a_replacement_a_killed_process_left_is_removed_by_the_next_write(tmp_path):
    from pit_deploy.io.fs import atomic_directory

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    for name in (f".exp.partial-{dead}-old", f".exp.old-{dead}"):  # this version's, and earlier versions'
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.onnx").write_text("a previous export")
    with atomic_directory(tmp_path / "exp", force=True, lock="export") as tmp:
        (tmp / "f").write_text("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]


def test_verify_records_only_into_the_export_it_measured(onnx_export, tmp_path, capsys, monkeypatch):
    """The export is replaced (its manifest changes) while verify measures the old files: the
    results are not written into the new export's manifest."""
    from pit_deploy.evaluate import verify

    out = _copy(onnx_export, tmp_path)
    load = verify.load_reference

    def replaced_meanwhile(directory):
        data = json.loads((out / "manifest.json").read_text())
        data["source"]["replaced"] = True  # what another export --force into it would do
        (out / "manifest.json").write_text(json.dumps(data, indent=2))
        return load(directory)

    monkeypatch.setattr(verify, "load_reference", replaced_meanwhile)
    capsys.readouterr()
    assert main(["verify", str(out)]) == 2
    err = capsys.readouterr().err
    assert "replaced" in err and "not recorded" in err
    assert json.loads((out / "manifest.json").read_text())["verification"] is None


def test_two_verifies_recording_at_once_both_keep_their_results(onnx_export, tmp_path, capsys, monkeypatch):
    """Another process records into the manifest (under the lock, read-modify-write taking a
    while) just as this verify records: neither result is lost."""
    from pit_deploy.evaluate import verify

    out = _copy(onnx_export, tmp_path)
    other = {"runtime": "onnx", "mode": "factorized", "dtype": "float32", "scheme": "float32", "passed": True}
    then = textwrap.dedent(f"""
        path = Path({str(out / "manifest.json")!r})
        data = json.loads(path.read_text())
        print("read", flush=True)
        time.sleep(4)
        data["verification"] = {{"passed": True, "artifacts": [{other!r}]}}
        path.write_text(json.dumps(data, indent=2))
    """).replace("\n", "\n            ")
    load, holders = verify.load_reference, []

    def another_verify_records(directory):
        holders.append(_hold_lock(out, "verify", then=then, keep=False))
        return load(directory)

    monkeypatch.setattr(verify, "load_reference", another_verify_records)
    try:
        assert main(["verify", str(out)]) == 0
    finally:
        for proc in holders:
            _stop(proc)
    recorded = json.loads((out / "manifest.json").read_text())["verification"]
    keys = sorted(f"{a['runtime']}-{a['mode']}" for a in recorded["artifacts"])
    assert keys == ["onnx-factorized", "onnx-materialized"], keys

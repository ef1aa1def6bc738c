"""The lock files and ``--force`` cannot be turned against their user: a lock path that is a
planted symbolic link, a hard link, a directory or someone else's file is refused (exit 2) with
its target untouched; ``--force`` replaces only pit-deploy's own outputs; ``verify`` tells an
export replaced under it from a damaged one; a full disk while recording names the way out
verify has (docs/conventions.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pit_deploy.cli import main
from pit_deploy.errors import PitError
from pit_deploy.io import fs
from pit_deploy.io.checkpoint import save_model
from pit_deploy.tiny import tiny_pit_model, tiny_tokenizer
from test_reliability import onnx_export, source  # noqa: F401 — the same tiny PIT model and ONNX export

PIT_DEPLOY = Path(sys.executable).with_name("pit-deploy")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
VICTIM_TEXT = "a file the user cares about\n"


def _export_args(source: Path, out: Path, *extra: str) -> list[str]:
    return ["export", str(source), "--out", str(out), "--recipe", "tiny-ci", "--runtime", "onnx",
            "--mode", "materialized", "--dtype", "float32", *extra]


def _one_error(capsys, code: int, *names: str) -> str:
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, err[-2000:]
    assert all(name in errors[0] for name in names), errors[0]
    return errors[0]


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    return victim


def _copy(export: Path, tmp_path: Path, name: str = "copy") -> Path:
    target = tmp_path / name
    shutil.copytree(export, target)
    return target


# --- the lock files -------------------------------------------------------------------------

def test_a_symlink_planted_as_an_exports_lock_leaves_its_target_untouched(source, tmp_path, capsys):
    victim = _victim(tmp_path)
    out = tmp_path / "exp"
    link = fs.target_lock_path(out)
    link.symlink_to(victim)
    code = main(_export_args(source, out))
    _one_error(capsys, code, str(link), "symbolic link")
    assert victim.read_text() == VICTIM_TEXT and link.is_symlink() and not out.exists()


def test_a_symlink_planted_as_the_lock_of_a_recording_verify_leaves_its_target_untouched(onnx_export, tmp_path,
                                                                                         capsys):
    victim = _victim(tmp_path)
    out = _copy(onnx_export, tmp_path)
    link = fs.target_lock_path(out)
    link.symlink_to(victim)
    manifest = (out / "manifest.json").read_bytes()
    code = main(["verify", str(out)])
    _one_error(capsys, code, str(link), "symbolic link")
    assert victim.read_text() == VICTIM_TEXT and link.is_symlink()
    assert (out / "manifest.json").read_bytes() == manifest  # nothing recorded


def test_a_symlink_planted_as_a_run_directorys_lock_leaves_its_target_untouched(tmp_path):
    """``run`` holds ``.pit-deploy.lock`` inside its directory; a dangling link is refused too
    (``O_CREAT`` through it would create the file it names)."""
    victim = _victim(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    for target in (victim, tmp_path / "created-by-the-link"):
        (run / fs.LOCK_NAME).unlink(missing_ok=True)
        (run / fs.LOCK_NAME).symlink_to(target)
        with pytest.raises(PitError, match="symbolic link"):
            with fs.lock_directory(run):
                pass
    assert victim.read_text() == VICTIM_TEXT and not (tmp_path / "created-by-the-link").exists()


def test_a_run_refuses_a_planted_lock_link_as_one_error_line(tmp_path):
    """The same through the command: a real process, exit 2, one line."""
    victim = _victim(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / fs.LOCK_NAME).symlink_to(victim)
    proc = subprocess.run([str(PIT_DEPLOY), "run", "smoke", "--out", str(run), "--set", "bench.enabled=false"],
                          capture_output=True, text=True, env=ENV, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "symbolic link" in errors[0], proc.stderr[-2000:]
    assert victim.read_text() == VICTIM_TEXT


@pytest.mark.parametrize("planted", ["hard link", "directory", "fifo"])
def test_a_lock_path_that_is_no_plain_file_of_ours_is_refused(tmp_path, planted):
    victim = _victim(tmp_path)
    out = tmp_path / "exp"
    lock = fs.target_lock_path(out)
    if planted == "hard link":
        os.link(victim, lock)
        match = "2 hard links"
    elif planted == "directory":
        lock.mkdir()
        match = "a directory"
    else:
        os.mkfifo(lock)
        match = "not a regular file"
    with pytest.raises(PitError, match=match):
        with fs.lock_target(out, "export"):
            pass
    assert victim.read_text() == VICTIM_TEXT and (lock.exists() or lock.is_symlink())


def test_a_lock_file_of_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    out = tmp_path / "exp"
    lock = fs.target_lock_path(out)
    lock.write_text("planted\n")
    os.chown(lock, 12345, 12345)
    with pytest.raises(PitError, match="owned by another user"):
        with fs.lock_target(out, "export"):
            pass
    assert lock.read_text() == "planted\n"


def test_an_honest_lock_file_left_by_a_killed_holder_is_taken_over(tmp_path):
    out = tmp_path / "exp"
    lock = fs.target_lock_path(out)
    lock.write_text("999999 export\n")
    with fs.lock_target(out, "export") as held:
        assert held == lock and lock.read_text().startswith(f"{os.getpid()} export")
    assert not lock.exists()


# --- --force ----------------------------------------------------------------------------------

def test_force_does_not_replace_a_folder_that_is_no_pit_deploy_output(source, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    code = main(_export_args(source, out, "--force"))
    _one_error(capsys, code, str(out), "not a pit-deploy output")
    assert (out / "thesis.tex").read_text() == "years of work"
    code = main(["convert", "--model", str(source), "--out", str(out), "--force"])
    _one_error(capsys, code, "not a pit-deploy output")
    assert sorted(p.name for p in out.iterdir()) == ["thesis.tex"]


def test_force_does_not_replace_an_artifact_folder_inside_an_export(source, onnx_export, tmp_path, capsys):
    export = _copy(onnx_export, tmp_path)
    artifact = export / "onnx-materialized"
    before = sorted(p.name for p in artifact.iterdir())
    code = main(_export_args(source, artifact, "--force"))
    _one_error(capsys, code, "lies inside the export", str(export))
    assert sorted(p.name for p in artifact.iterdir()) == before
    assert main(["verify", str(export), "--no-record"]) == 0


def test_force_replaces_pit_deploy_outputs(source, onnx_export, tmp_path, capsys):
    """What ``--force`` is for still works: an export over an export, a conversion over a
    conversion."""
    from pit_deploy.tiny import tiny_model

    export = _copy(onnx_export, tmp_path)
    assert main(_export_args(source, export, "--force")) == 0
    assert fs.pit_deploy_output(export) == "an export"
    plain = tmp_path / "plain"
    save_model(tiny_model("llama"), plain, tiny_tokenizer())
    converted = tmp_path / "converted"
    assert main(["convert", "--model", str(plain), "--out", str(converted)]) == 0
    assert fs.pit_deploy_output(converted) == "a PIT checkpoint"
    assert main(["convert", "--model", str(plain), "--out", str(converted), "--force"]) == 0
    capsys.readouterr()


def test_force_over_a_mount_point_is_one_error_line(source, tmp_path, capsys, monkeypatch):
    """A mount point cannot be renamed away (``EBUSY`` from the exchange). Which folder is a
    mount point is the kernel's to say; this machine's test stands one in for it."""
    out = tmp_path / "mounted"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    real = os.path.ismount
    monkeypatch.setattr(fs.os.path, "ismount", lambda p: Path(p) == out or real(p))
    code = main(_export_args(source, out, "--force"))
    _one_error(capsys, code, "mount point")
    assert (out / "manifest.json").read_text() == "{}"


def test_run_force_does_not_turn_a_foreign_folder_into_a_run(tmp_path, capsys):
    out = tmp_path / "foreign"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code = main(["run", "smoke", "--out", str(out), "--force", "--set", "bench.enabled=false"])
    _one_error(capsys, code, "not a pit-deploy run directory")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


# --- verify against a replacement, and a full disk while recording ---------------------------

def test_verify_of_an_export_replaced_under_it_says_so_not_damaged(onnx_export, tmp_path, capsys, monkeypatch):
    """Another export into the folder while verify reads its files: the replacement is a real
    directory exchange, made at the moment verify checks the digests."""
    from pit_deploy.evaluate import verify

    export = _copy(onnx_export, tmp_path)
    other = _copy(onnx_export, tmp_path, "other")
    data = json.loads((other / "manifest.json").read_text())
    data["created"] = "a later export"
    (other / "manifest.json").write_text(json.dumps(data))
    (other / "reference" / "config.json").write_text((other / "reference" / "config.json").read_text() + " ")
    real = verify.check_digests

    def replaced_midway(directory, manifest):
        fs.replace_directory(other, export)
        return real(directory, manifest)

    monkeypatch.setattr(verify, "check_digests", replaced_midway)
    code = main(["verify", str(export)])
    line = _one_error(capsys, code, "was replaced while it was being verified", "verify it again")
    assert "digest" not in line and "damaged" not in line


# --- a damaged artifact whose perplexity is beyond exp's range ---------------------------------

def test_a_perplexity_ratio_beyond_floats_is_unbounded_not_an_error():
    """A few exponent-flipped elements of a factorized ``T`` make the artifact's next-token
    loss millions of nats: the ratio is infinite (a failed bound, exit 1), not an overflow."""
    import torch

    from pit_deploy.data.heldout import kl_parity

    model = tiny_pit_model("llama").eval()

    class Damaged:
        def prefill(self, ids: torch.Tensor) -> torch.Tensor:
            logits = model(input_ids=ids[None]).logits[0].clone()
            logits[:-1].scatter_(1, ids[1:, None], -1e6)  # every next token is all but impossible
            return logits

    figures = kl_parity(Damaged(), model, [[1, 5, 9, 3, 7, 2]])
    assert figures.ppl_ratio == float("inf") and figures.kl_mean > 1e3

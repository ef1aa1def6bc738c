"""Training loop: PIT and TT learn, PIT keeps its identity, resume equals an uninterrupted
run, from scratch, distillation, precision, bad input."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from train_fixtures import config, crash_worker, make_corpus, make_model_dir, read_metrics

from pit_deploy.io.checkpoint import load_pit_model
from pit_deploy.cli import main
from pit_deploy.errors import PitError
from pit_deploy.io.sources import load_source
from pit_deploy.data.corpus import TextSource, validation_blocks
from pit_deploy.training.loop import TrainingRecipe, param_groups, train


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return make_model_dir(root), make_corpus(root)


def _losses(run):
    return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]


@pytest.mark.parametrize("tying", ["pit", "tt"])
def test_tiny_model_learns(tmp_path, assets, tying):
    model, corpus = assets
    out = tmp_path / tying
    result = train(config(out, model, corpus, tying=tying, steps=16, lr=1e-2))
    records = read_metrics(out)
    train_recs = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train_recs] == list(range(1, 17))
    losses = [r["loss"] for r in train_recs]
    # batches differ in content, so compare the held-out loss on fixed blocks, and the
    # mean of the second half of training against the first steps
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 16
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.3
    assert sum(losses[8:]) / 8 < sum(losses[:3]) / 3
    for r in train_recs:
        assert {"tokens", "ppl", "lr", "grad_norm", "tokens_per_s", "delta_ti"} <= r.keys()
        assert math.isclose(r["ppl"], math.exp(r["loss"]), rel_tol=1e-9)
        assert r["tokens"] == r["step"] * 4 * 32
    if tying == "pit":
        assert all(r["delta_ti"] <= 1e-5 for r in train_recs)
        reloaded = load_pit_model(out / "model")
        assert result.extra["delta_ti"] <= 1e-5 and hasattr(reloaded, "pit_interface")
    else:
        assert all(r["delta_ti"] > 1.0 for r in train_recs)  # TT is no pseudo-inverse
    # warmup then cosine: peak at the end of warmup, decreasing after
    lrs = [r["lr"] for r in train_recs]
    assert lrs[0] < lrs[1] == pytest.approx(1e-2) and all(a >= b - 1e-12 for a, b in zip(lrs[1:], lrs[2:]))
    assert lrs[-1] < 0.3 * lrs[1]
    # the reported validation loss is the saved model's: recompute it from the files
    summary = json.loads((out / "summary.json").read_text())
    saved = (load_pit_model(out / "model") if tying == "pit" else load_source(str(out / "model")).model).eval()
    cfg = config(out, model, corpus)
    dcfg = cfg.data_config_obj()
    val = validation_blocks(TextSource(dcfg), load_source(str(model)).tokenizer, dcfg, cfg.eval_blocks)
    with torch.no_grad():
        logits = saved(input_ids=val.ids[:, :-1]).logits
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), val.ids[:, 1:].flatten(), reduction="none")
    mask = val.mask[:, 1:].flatten()
    assert summary["final_val_loss"] == pytest.approx(float((ce * mask).sum() / mask.sum()), rel=1e-5)


def test_weight_decay_spares_interface(assets):
    from pit_deploy.converters.conversion import convert_model
    from pit_deploy.model.core import PITSpec
    from pit_deploy.tiny import tiny_model

    model = convert_model(tiny_model("llama"), spec=PITSpec(train_z=True))
    cfg = config("x", "m", "d", lr=1e-3, lr_t=1e-2)
    groups = {g["name"]: g for g in param_groups(model, cfg)}
    iface = model.pit_interface
    assert groups["interface_z"]["params"] == [iface.Z] and groups["interface_z"]["weight_decay"] == 0
    assert {id(p) for p in groups["interface_t"]["params"]} == {id(iface.L_offdiag), id(iface.L_diag)}
    assert groups["interface_t"]["weight_decay"] == 0 and groups["interface_t"]["lr_scale"] == pytest.approx(10)
    decayed = {id(p) for p in groups["decay"]["params"]}
    assert all(p.ndim == 2 for p in groups["decay"]["params"]) and id(iface.Z) not in decayed


def test_train_z_stays_on_stiefel(tmp_path, assets):
    model, corpus = assets
    out = tmp_path / "z"
    train(config(out, model, corpus, train_z=True, steps=6, eval_every=0, lr=1e-2))
    recs = [r for r in read_metrics(out) if r["kind"] == "train"]
    assert all(r["z_orthogonality_error"] <= 1e-5 and r["delta_ti"] <= 1e-5 for r in recs)
    before = load_pit_model  # Z moved away from its conversion value
    from pit_deploy.converters.conversion import convert_model
    from pit_deploy.io.sources import load_source

    z0 = convert_model(load_source(str(model)).model).pit_interface.Z
    z1 = before(out / "model").pit_interface.Z
    assert (z1 - z0).abs().max() > 1e-4


def _run_worker(script, expect_signal=None):
    # the child computes with as many threads as this process (a reduction's order depends on it),
    # so that its metrics can be compared bit for bit with an in-process run's
    import torch

    threads = str(torch.get_num_threads())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": threads,
           "MKL_NUM_THREADS": threads}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    if expect_signal is None:
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        assert proc.returncode == -expect_signal, proc.stderr[-3000:]  # killed by that signal
    return proc


def test_sigkilled_process_resumes_to_the_same_curve(tmp_path, assets):
    """A real training process killed with SIGKILL after step 6 (checkpoint at 4) resumes to
    bit-identical metrics and weights of an uninterrupted run."""
    model, corpus = assets
    common = dict(steps=10, save_every=4, eval_every=5, lr=3e-3)
    full, part = tmp_path / "full", tmp_path / "part"
    train(config(full, model, corpus, **common))
    _run_worker(crash_worker(tmp_path, part, model, corpus, crash_at=6, **common), expect_signal=signal.SIGKILL)
    assert (part / "checkpoints" / "LATEST").read_text() == "step-0000004"
    assert not (part / "model").exists()
    assert [r["step"] for r in read_metrics(part, "train")] == list(range(1, 7))  # logged past the checkpoint
    train(config(part, model, corpus, resume=True, **common))
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("step_time", "tokens_per_s", "mfu")} for r in rs]
    assert strip(read_metrics(full)) == strip(read_metrics(part))  # losses, lr, grad norms, delta_ti, evals
    sa = (full / "model" / "model.safetensors").read_bytes()
    assert sa == (part / "model" / "model.safetensors").read_bytes()


class _StopAfter(TrainingRecipe):
    """Ends the run with an exception after ``stop`` steps (their checkpoints are on disk)."""

    stop = 4

    def on_step_end(self, step):
        if step == self.stop:
            raise RuntimeError("stopped by the test")


@pytest.mark.parametrize("damage", ["truncate-weights", "truncate-optimizer", "bad-state", "no-rng"])
def test_resume_skips_a_damaged_checkpoint(tmp_path, assets, caplog, damage):
    """The newest checkpoint does not load: resume names it, takes the older one, and the run
    still ends on the uninterrupted curve."""
    model, corpus = assets
    common = dict(steps=6, save_every=2, keep_checkpoints=3, eval_every=0, lr=3e-3)
    full, part = tmp_path / "full", tmp_path / "part"
    train(config(full, model, corpus, **common))
    recipe = _StopAfter(config(part, model, corpus, **common)).setup()
    with pytest.raises(RuntimeError, match="stopped by the test"):
        recipe.train()
    recipe.cleanup()
    newest = part / "checkpoints" / "step-0000004"
    target = {"truncate-weights": "model.safetensors", "truncate-optimizer": "optimizer.pt",
              "bad-state": "state.json", "no-rng": "rng.pt"}[damage]
    if damage == "no-rng":
        (newest / target).unlink()
    else:
        data = (newest / target).read_bytes()
        (newest / target).write_bytes(data[: len(data) // 2])
    with caplog.at_level("WARNING"):
        train(config(part, model, corpus, resume=True, **common))
    assert "skipping checkpoint step-0000004" in caplog.text and "step-0000002" in caplog.text
    assert [r["loss"] for r in read_metrics(part, "train")] == [r["loss"] for r in read_metrics(full, "train")]


def test_resume_with_every_checkpoint_damaged_is_exit_2(tmp_path, assets, capsys):
    model, corpus = assets
    run = tmp_path / "r"
    train(config(run, model, corpus, steps=2, save_every=1, eval_every=0))
    for ck in (run / "checkpoints").glob("step-*"):
        (ck / "optimizer.pt").write_bytes(b"not a checkpoint")
    rc = main(["train", "--model", str(model), "--data", str(corpus), "--out", str(run), "--steps", "4",
               "--seq-len", "32", "--save-every", "1", "--resume", "--no-progress", "--no-plot"])
    err = capsys.readouterr().err
    assert rc == 2 and "no checkpoint" in err and "loads completely" in err and "step-0000001" in err


def test_latest_pointing_outside_the_run_is_refused(tmp_path, assets):
    model, corpus = assets
    run = tmp_path / "r"
    train(config(run, model, corpus, steps=2, save_every=2, eval_every=0))
    (run / "checkpoints" / "LATEST").write_text("../../elsewhere")
    with pytest.raises(PitError, match="points outside"):
        train(config(run, model, corpus, steps=4, save_every=2, eval_every=0, resume=True))


def test_sigterm_leaves_no_partial_directory(tmp_path, assets):
    """SIGTERM while ``pit-deploy train`` writes checkpoints every step: exit 130, no
    ``.step-*.partial-*`` left, and every checkpoint on disk loads. The process starts with
    SIGTERM blocked, as a launcher (or a parent thread) can leave it: the mask is inherited
    across exec, and the command must unblock what it handles (this case hung in the suite)."""
    model, corpus = assets
    run = tmp_path / "r"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "pit_deploy", "train", "--model", str(model), "--data",
                             str(corpus), "--out", str(run), "--steps", "100000", "--seq-len", "32",
                             "--save-every", "1", "--keep-checkpoints", "1000", "--no-progress", "--no-plot"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}))
    try:
        deadline = time.monotonic() + 240
        while len(list((run / "checkpoints").glob("step-*"))) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err
    leftovers = [p.name for p in run.rglob("*") if ".partial-" in p.name or ".old-" in p.name]
    assert leftovers == []
    assert not (run / "model").exists()
    from pit_deploy.training.checkpointer import load_latest

    assert load_latest(run).path.name == (run / "checkpoints" / "LATEST").read_text()


def test_from_scratch_tiny_trains(tmp_path, assets):
    model, corpus = assets
    out = tmp_path / "scratch"
    train(config(out, model, corpus, from_scratch=True, arch="tiny", tokenizer=str(model), steps=14,
                 lr=1e-2, eval_every=14))
    evals = [r["val_loss"] for r in read_metrics(out) if r["kind"] == "eval"]
    assert len(evals) == 2 and evals[-1] < evals[0] - 0.3
    m = load_pit_model(out / "model")
    assert m.config.model_type == "cohere"
    z = m.pit_interface.Z.double()
    assert torch.linalg.matrix_norm(z.T @ z - torch.eye(z.shape[1], dtype=z.dtype)) < 1e-5
    assert all(r["delta_ti"] <= 1e-5 for r in read_metrics(out) if r["kind"] == "train")


def test_distill_logs_kl_and_learns(tmp_path, assets):
    model, corpus = assets
    out = tmp_path / "distill"
    train(config(out, model, corpus, distill=True, distill_weight=1.0, steps=8, eval_every=0, t_init="output",
                 lr=1e-3, warmup_steps=0))
    recs = [r for r in read_metrics(out) if r["kind"] == "train"]
    assert all("kl" in r and r["kl"] >= 0 for r in recs)
    assert recs[0]["kl"] > 1e-3  # conversion disturbed the model
    assert recs[-1]["kl"] < recs[0]["kl"]
    # TT "distilled" to its own frozen copy starts at KL 0
    tt = tmp_path / "tt"
    train(config(tt, model, corpus, tying="tt", distill=True, steps=1, eval_every=0))
    assert read_metrics(tt)[0]["kl"] == pytest.approx(0.0, abs=1e-5)


def test_bf16_autocast_keeps_pit_identity(tmp_path, assets):
    model, corpus = assets
    out = tmp_path / "bf16"
    train(config(out, model, corpus, precision="bf16", steps=3, eval_every=0))
    recs = [r for r in read_metrics(out) if r["kind"] == "train"]
    assert all(math.isfinite(r["loss"]) and r["delta_ti"] <= 1e-5 for r in recs)


# ---- bad input ------------------------------------------------------------------------


def test_seq_len_beyond_positions(tmp_path, assets):
    model, corpus = assets
    with pytest.raises(PitError, match="exceeds the model's 128 positions"):
        train(config(tmp_path / "r", model, corpus, seq_len=129))


def test_resume_without_checkpoint(tmp_path, assets):
    model, corpus = assets
    (tmp_path / "r").mkdir()
    with pytest.raises(PitError, match="holds no checkpoint"):
        train(config(tmp_path / "r", model, corpus, resume=True))


def test_resume_with_other_options_is_refused(tmp_path, assets):
    model, corpus = assets
    run = tmp_path / "r"
    train(config(run, model, corpus, steps=2, save_every=2, eval_every=0))
    with pytest.raises(PitError, match="--seq-len 32 → 16"):
        train(config(run, model, corpus, steps=4, seq_len=16, resume=True, eval_every=0))


def test_non_finite_loss_stops_and_keeps_last_checkpoint(tmp_path, assets):
    model, corpus = assets
    run = tmp_path / "r"
    train(config(run, model, corpus, steps=2, save_every=2, eval_every=0))
    ck = run / "checkpoints" / "step-0000002" / "model.safetensors"
    before = ck.read_bytes()
    with pytest.raises(PitError, match=r"non-finite at step \d+.*step-0000002"):
        train(config(run, model, corpus, steps=8, save_every=2, eval_every=0, resume=True, lr=1e38,
                     grad_clip=0.0, warmup_steps=0))
    assert ck.read_bytes() == before
    assert (run / "checkpoints" / "LATEST").read_text() == "step-0000002"
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-0000002"]


def test_existing_output_needs_force(tmp_path, assets):
    model, corpus = assets
    run = tmp_path / "r"
    run.mkdir()
    (run / "keep.txt").write_text("precious")
    with pytest.raises(PitError, match="--force"):
        train(config(run, model, corpus))
    assert (run / "keep.txt").read_text() == "precious"


def test_cli_train_and_plot(tmp_path, assets, capsys):
    model, corpus = assets
    runs = []
    for tying in ("pit", "tt"):
        out = tmp_path / tying
        rc = main(["train", "--model", str(model), "--data", str(corpus), "--tying", tying, "--out", str(out),
                   "--tokens", "512", "--seq-len", "32", "--batch-size", "4", "--eval-every", "2",
                   "--val-fraction", "0.2", "--no-progress", "--lr", "3e-3"])
        assert rc == 0
        assert len([r for r in read_metrics(out) if r["kind"] == "train"]) == 4  # 512 / (4·32)
        assert (out / "loss.png").stat().st_size > 1000
        runs.append(str(out))
    png = tmp_path / "cmp.png"
    assert main(["plot", *runs, "--out", str(png)]) == 0 and png.stat().st_size > 1000
    rc = main(["train", "--model", str(model), "--data", str(tmp_path / "nothing-here"), "--out",
               str(tmp_path / "bad"), "--steps", "1", "--no-progress"])
    assert rc == 2
    assert "error:" in capsys.readouterr().err


def test_interface_only_keeps_the_converted_body(tmp_path, assets):
    """``--interface-only``: the body's linears and block norms leave training as converted (what
    keeps a source's 4-bit grid), while T and the final norm learn. Converting again differs by
    float noise (≈ 4e-7 here); four Adam steps at 1e-2 would move a trained weight by ≈ 1e-2."""
    from pit_deploy.converters.conversion import convert_model, default_conversion

    model, corpus = assets
    out = tmp_path / "iface"
    train(config(out, model, corpus, train_body=False, steps=4, eval_every=0, lr=1e-2))
    source = load_source(str(model)).model
    start = convert_model(source, default_conversion(source.config)).state_dict()
    end = load_pit_model(out / "model").state_dict()
    body = [k for k in start if ".layers." in k]
    assert body and max(float((start[k] - end[k]).abs().max()) for k in body) < 1e-5
    moved = [k for k in start if ".layers." not in k and float((start[k] - end[k]).abs().max()) > 1e-3]
    assert any("norm" in k for k in moved) and any("L_" in k for k in moved), moved


def test_interface_only_refuses_what_has_no_interface_or_trains_the_body():
    from pit_deploy.training.config import TrainConfig, validate, with_start_defaults

    for kw, needle in (({"tying": "tt"}, "--tying tt"), ({"lora": True}, "--lora"),
                       ({"from_scratch": True}, "--from-scratch")):
        with pytest.raises(PitError, match=needle):
            validate(with_start_defaults(TrainConfig(out="o", steps=1, train_body=False, **kw)))

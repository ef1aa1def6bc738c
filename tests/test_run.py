"""``pit-deploy run``: the one command on a tiny model and a small corpus — every stage, the
report checked against the stage outputs, reruns that do nothing, bad input, a failing stage,
and a run killed during training that continues from its checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pit_deploy.cli import main
from pit_deploy.errors import PitError
from pit_deploy.workflow import report as report_module
from pit_deploy.workflow.recipe import load_run_recipe

from train_fixtures import make_corpus, make_model_dir

ROOT = Path(__file__).resolve().parents[1]
NO_BENCH = ["--set", "bench.enabled=false"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("run-assets")
    return make_model_dir(root), make_corpus(root)


def _run(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(["run", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def finished_run(assets, tmp_path_factory):
    """One smoke run of every stage (bench included), shared by the checks below."""
    model, corpus = assets
    out = tmp_path_factory.mktemp("runs") / "smoke"
    code = main(["run", "smoke", "--model", str(model), "--data", str(corpus), "--out", str(out)])
    return code, out


def _record(out: Path, name: str) -> dict:
    folder = next(out.glob(f"*-{name}"))
    return json.loads((folder / "stage.json").read_text())


def test_every_stage_runs_and_the_report_shows_what_the_stages_measured(finished_run):
    code, out = finished_run
    assert code == 0
    for stage in ("convert", "train", "export", "verify", "bench", "report"):
        assert _record(out, stage)["status"] == "done", stage
    report = (out / "report.md").read_text()
    html = (out / "report.html").read_text()
    verify = _record(out, "verify")["outputs"]["reports"]
    artifacts = [a for r in verify for a in r["artifacts"]]
    assert {a["runtime"] for a in artifacts} == {"onnx", "executorch"}
    assert {a["dtype"] for a in artifacts} == {"float32", "int4"}
    for a in artifacts:  # every artifact verified, with the figures the verify stage measured
        assert a["passed"]
        assert f"{a['delta_ti']:.2e}" in report
        if a["dtype"] == "float32":
            assert f"{a['logits_rel_l2']:.2e}" in report
        else:  # quantized: KL figures against the fp32 reference
            assert f"{a['kl_mean']:.4f}" in report and f"{a['same_top1']:.1%}" in report
    rows = _record(out, "bench")["outputs"]["rows"]
    assert rows and {r["runtime"] for r in rows} >= {"onnx", "executorch"}
    for r in rows:  # and benchmarked: its table row shows the measured rate, or — when the runner's clock could not
        figure = "—" if r["decode_tok_s"] is None else format(r["decode_tok_s"], ".4g")
        assert any(line.startswith(f"| {report_module.bench_label(r)} |") and f"| {figure} |" in line for line in report.splitlines())
    if any(r["decode_tok_s"] is None for r in rows):
        assert "— in a rate column: not measured" in report
    summary = _record(out, "train")["outputs"]["runs"]["pit"]["summary"]
    assert format(summary["final_val_loss"], ".4g") in report
    conv = _record(out, "convert")["outputs"]
    assert format(conv["source_val_nll"], ".4g") in report
    assert "data:image/png;base64," in html  # single file: images embedded
    assert "Greedy answers" in report
    ran = [a["stock_runner"] for a in artifacts if (a.get("stock_runner") or {}).get("answers")]
    assert ran, "the stock runner ran on no .pte"
    for check in ran:  # the stock runner's counts and answers, as verify recorded them
        n = len(check["answers"])
        assert f"| {n - len(check['mismatches'])}/{n} |" in report
        assert " ".join(check["answers"][-1]["runner"].split())[:60] in report


def test_rerun_of_a_finished_run_does_no_work_and_says_why(finished_run, capsys):
    _, out = finished_run
    before = {p: p.stat().st_mtime_ns for p in out.rglob("stage.json")}
    code = main(["run", "smoke", "--out", str(out)] + _same_model_args(out))
    err = capsys.readouterr().err
    assert code == 0
    assert err.count("up to date") == 6, err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("stage.json")} == before


def _same_model_args(out: Path) -> list[str]:
    settings = json.loads((out / "run.json").read_text())["settings"]["run"]
    return ["--model", settings["model"], "--data", settings["data"]]


def test_from_stage_redoes_that_stage_and_later_ones(finished_run, capsys):
    _, out = finished_run
    convert_before = (next(out.glob("*-convert")) / "stage.json").stat().st_mtime_ns
    code = main(["run", "smoke", "--out", str(out), "--from", "report"] + _same_model_args(out))
    err = capsys.readouterr().err
    assert code == 0
    assert "report: running (--from report)" in err
    assert (next(out.glob("*-convert")) / "stage.json").stat().st_mtime_ns == convert_before


def test_verify_on_aarch64_kernels_is_a_run_setting(finished_run, arm_setup, tmp_path, capsys):
    """``verify.isa`` adds the emulated aarch64 rows to the run's verify stage and its report;
    the stages before it stay up to date (a copy of the finished run, so the shared one is kept)."""
    import shutil

    _, done = finished_run
    out = tmp_path / "smoke"
    shutil.copytree(done, out)
    code = main(["run", "smoke", "--out", str(out), *_same_model_args(out), *NO_BENCH,
                 "--set", 'verify.isa=["x86_64", "aarch64"]', "--set", 'verify.arm_cpu=["max", "cortex-a53"]'])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "export: up to date" in err and "verify: running (settings or inputs changed)" in err
    assert "report: running (settings or inputs changed)" in err  # the report shows the new rows
    rows = [a for r in json.loads((next(out.glob("*-verify")) / "verify.json").read_text())["reports"]
            for a in r["artifacts"]]
    arm = [a for a in rows if a["isa"] == "aarch64" and a["checked"]]
    assert {(a["runtime"], a["arm_cpu"]) for a in arm} == {("onnx", "max"), ("executorch", "max"), ("onnx", "cortex-a53")}
    assert all(a["passed"] for a in arm) and {a["dtype"] for a in arm} == {"float32", "int4"}
    # a .pte on the ARMv8.0 profile is listed as not checked, never as passed
    unchecked = [a for a in rows if a["isa"] == "aarch64" and not a["checked"]]
    assert {a["runtime"] for a in unchecked} == {"executorch"} and not any(a["passed"] for a in unchecked)
    report = (out / "report.md").read_text()
    assert "onnx [aarch64 max, KleidiAI on]" in report and "executorch [aarch64 max]" in report
    assert "not checked:" in report


def test_verify_on_aarch64_without_its_setup_is_refused_before_any_stage(assets, tmp_path, monkeypatch, capsys):
    model, corpus = assets
    monkeypatch.setenv("PIT_DEPLOY_AARCH64_ROOT", str(tmp_path / "none"))
    code, _, err = _run(["smoke", "--model", str(model), "--data", str(corpus), "--out", str(tmp_path / "r"),
                         "--set", 'verify.isa=["aarch64"]'], capsys)
    assert code == 2
    assert "verify.isa includes aarch64" in err and "bash scripts/setup_aarch64.sh" in err
    assert not (tmp_path / "r").exists() or not list((tmp_path / "r").glob("*-convert"))
    code, _, err = _run(["smoke", "--model", str(model), "--data", str(corpus), "--out", str(tmp_path / "r"),
                         "--set", 'verify.arm_cpu=["cortex-a99"]'], capsys)
    assert code == 2 and "[verify]: unknown aarch64 CPU profile 'cortex-a99'" in err


def test_changed_setting_reruns_downstream_only(assets, tmp_path, capsys):
    model, corpus = assets
    out = tmp_path / "r"
    base = ["smoke", "--model", str(model), "--data", str(corpus), "--out", str(out), "--set", "export.runtimes=['onnx']"] + NO_BENCH
    fp32 = ["--set", "export.dtype=['float32']"]  # until a quantized setting is what changes
    assert main(["run", *base, *fp32]) == 0
    capsys.readouterr()
    assert main(["run", *base, *fp32, "--set", "export.max_seq_len=48"]) == 0
    err = capsys.readouterr().err
    assert "convert: up to date" in err and "train: up to date" in err
    assert "export: running (settings or inputs changed)" in err
    manifest = json.loads((out / "3-export" / "export-float32" / "manifest.json").read_text())
    assert manifest["recipe"]["max_seq_len"] == 48
    # every export recipe field is a run key, and reaches the export (docs/run.md)
    assert main(["run", *base, "--set", "export.max_seq_len=48", "--set", "export.table_bits=4"]) == 0
    manifest = json.loads((out / "3-export" / "export-int4" / "manifest.json").read_text())
    assert {a["details"]["scheme"]["table_bits"] for a in manifest["artifacts"]} == {4}
    # a shipped export recipe drives the run's export: one export directory per scheme
    assert main(["run", *base, "--set", 'export.recipe="int4-compact"', "--set", "export.max_seq_len=64"]) == 0
    manifest = json.loads((out / "3-export" / "export-int4-compact" / "manifest.json").read_text())
    assert [a["path"] for a in manifest["artifacts"]] == ["onnx-factorized-int4-compact"]
    assert manifest["verification"]["passed"] is True


def test_unknown_recipe_key_names_the_closest_valid_key():
    with pytest.raises(PitError, match=r"train\.stepz.*did you mean 'steps'"):
        load_run_recipe("smoke", ["train.stepz=3"])
    with pytest.raises(PitError, match=r"\[exprt\].*did you mean 'export'"):
        load_run_recipe("smoke", ["exprt.runtimes=['onnx']"])
    with pytest.raises(PitError, match="unknown run recipe 'smok'.*did you mean 'smoke'"):
        load_run_recipe("smok")


def test_a_value_of_the_wrong_kind_is_named():
    with pytest.raises(PitError, match=r"train\.steps must be an integer"):
        load_run_recipe("smoke", ["train.steps='abc'"])
    with pytest.raises(PitError, match=r"bench\.threads must be a list"):
        load_run_recipe("smoke", ["bench.threads=2"])
    load_run_recipe("smoke", ["train.lr=1", "train.tokens=0"])  # an integer is a number; tokens has no default


def test_export_settings_are_checked_before_any_stage_runs():
    """A value the export stage would refuse is refused when the recipe is read, not after
    conversion and training."""
    with pytest.raises(PitError, match=r"\[export\]: pte_head_bits must be 0"):
        load_run_recipe("smoke", ["export.pte_head_bits=3"])
    with pytest.raises(PitError, match=r"\[export\]: unknown dtype 'int3'"):
        load_run_recipe("smoke", ["export.dtypes=['int3']"])
    assert load_run_recipe("smoke", ["export.pte_head_bits=8"])["export"]["pte_head_bits"] == 8


def test_unknown_key_from_the_command_line_is_exit_2(capsys):
    code, _, err = _run(["smoke", "--set", "bench.thread=2"], capsys)
    assert code == 2
    assert "did you mean 'threads'" in err


def test_run_directory_of_another_recipe_is_refused_unless_forced(assets, tmp_path, capsys):
    out = tmp_path / "r"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"format": "pit-deploy-run", "recipe": "default"}))
    code, _, err = _run(["smoke", "--out", str(out)] + NO_BENCH, capsys)
    assert code == 2 and "is a run of recipe 'default'" in err
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]  # nothing touched
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    code, _, err = _run(["smoke", "--out", str(foreign)] + NO_BENCH, capsys)
    assert code == 2 and "not a pit-deploy run directory" in err
    assert (foreign / "notes.txt").read_text() == "mine"


def test_a_failing_stage_stops_the_run_and_the_report_lists_it(assets, tmp_path, capsys, monkeypatch):
    """A static cache too long for the model: export fails (exit 2), verify never runs. The run's
    up-front check refuses this case before any stage (tested in tests/test_own_model.py); it is
    switched off here so that the case reaches the export stage, whose failure is under test."""
    from pit_deploy.workflow import validate

    monkeypatch.setattr(validate, "check_run_fits", lambda recipe: None)
    model, corpus = assets
    out = tmp_path / "r"
    code, out_text, err = _run(["smoke", "--model", str(model), "--data", str(corpus), "--out", str(out),
                                "--set", "export.max_seq_len=100000"] + NO_BENCH, capsys)
    assert code == 2
    assert "stage export failed" in err
    assert _record(out, "export")["status"] == "failed"
    assert not list(out.glob("*-verify"))
    report = (out / "report.md").read_text()
    assert "Stage **export** failed (exit 2)" in report
    assert "Stage **verify** has not run." in report


def test_run_killed_during_training_continues_from_its_checkpoint(assets, tmp_path):
    """A real process, killed with SIGKILL once training has saved a checkpoint; the rerun
    skips conversion and resumes training from that checkpoint instead of starting over."""
    model, corpus = assets
    out = tmp_path / "r"
    args = [sys.executable, "-m", "pit_deploy", "run", "smoke", "--model", str(model), "--data", str(corpus),
            "--out", str(out), "--set", "train.steps=60", "--set", "train.save_every=5", "--set", "train.eval_every=0",
            "--set", "export.runtimes=['onnx']", "--set", "export.dtype=['float32']",
            "--set", "verify.enabled=false"] + NO_BENCH  # what is asserted is training's resumption
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    checkpoints = out / "2-train" / "pit" / "checkpoints"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if checkpoints.is_dir() and any(checkpoints.glob("step-*")):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed: " + proc.stderr.read()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert _record(out, "train")["status"] == "running"  # the stage did not finish
    steps_before = sorted(p.name for p in checkpoints.glob("step-*"))
    assert steps_before
    again = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "convert: up to date" in again.stderr
    assert "resuming this run: convert finished before; train was interrupted and runs now" in again.stderr
    assert "train: running (interrupted before it finished; resuming it)" in again.stderr
    assert "resuming from its last checkpoint" in again.stderr
    summary = json.loads((out / "2-train" / "pit" / "summary.json").read_text())
    assert summary["steps"] == 60
    assert _record(out, "train")["status"] == "done"


def test_a_torchrun_child_reads_the_whole_config_from_a_file(tmp_path, monkeypatch):
    """``run`` hands a torchrun child its training config as a file (``train --config``): every
    field comes back as it was, so a renamed flag cannot silently drop an option."""
    import dataclasses

    import pit_deploy.training.loop as loop
    from pit_deploy.training.config import write_config
    from pit_deploy.training.loop import TrainConfig, TrainResult

    cfg = TrainConfig(out=str(tmp_path / "o"), model="m", tying="tt", steps=7, lr=2e-5, lr_t=0.0, streaming=False,
                      plot=False, lora=True, lora_targets=["q_proj", "v_proj"], grad_clip=0.5, resume=True, seed=3,
                      betas=(0.8, 0.99))
    seen = []
    done = TrainResult(out=cfg.out, steps=0, tokens=0, final_train_loss=None, final_val_loss=None,
                       initial_val_loss=None, median_step_time_s=None, tokens_per_s=None)
    monkeypatch.setattr(loop, "train", lambda c, say=None: seen.append(c) or done)  # train returns a result
    assert main(["train", "--config", str(write_config(cfg, tmp_path / "cfg.json"))]) == 0
    assert seen == [cfg]
    assert {f.name for f in dataclasses.fields(TrainConfig)} == set(dataclasses.asdict(seen[0]))


def test_gpu_cpt_recipe_code_path_on_cpu_with_two_processes(assets, tmp_path, capsys):
    """The gpu-cpt recipe (PIT and TT, torchrun across processes) with a tiny budget on CPU:
    gloo instead of NCCL, fp32 instead of bf16, local data instead of FineWeb-Edu."""
    model, corpus = assets
    out = tmp_path / "gpu"
    code = main(["run", "gpu-cpt", "--model", str(model), "--data", str(corpus), "--out", str(out),
                 "--set", "train.nproc=2", "--set", "train.precision='fp32'", "--set", "train.tokens=0",
                 "--set", "train.steps=2", "--set", "train.seq_len=32", "--set", "train.batch_size=1",
                 "--set", "train.grad_accum=1", "--set", "train.eval_every=1", "--set", "train.eval_blocks=2",
                 "--set", "train.save_every=0", "--set", "train.warmup_steps=0", "--set", "convert.calib_tokens=128",
                 "--set", "export.runtimes=['onnx']", "--set", "export.max_seq_len=64"] + NO_BENCH)
    assert code == 0, capsys.readouterr().err[-3000:]
    runs = _record(out, "train")["outputs"]["runs"]
    assert set(runs) == {"pit", "tt"}
    for info in runs.values():
        assert info["summary"]["steps"] == 2
        assert info["summary"]["extra"]["world_size"] == 2

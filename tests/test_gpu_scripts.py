"""The prepared GPU runs and the training options they use, on the CPU: ``--compile`` (and its
eager fallback), bf16 autocast with ``T`` and its solves in fp32, MFU and peak memory in the
metrics, ``--eval-prose``, ``--max-seconds``; the GPU recipes; and each prepared script end to end
on a tiny model for a few steps (``PIT_GPU_SMOKE=1``), so that none of it rots before a GPU runs it."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from train_fixtures import config, make_corpus, make_model_dir, read_metrics

from pit_deploy.errors import PitError
from pit_deploy.training.config import validate, with_start_defaults
from pit_deploy.training.loop import train

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "scripts" / "gpu"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-assets")
    return make_model_dir(root), make_corpus(root)


def _load_driver():
    spec = importlib.util.spec_from_file_location("gpu_run", GPU / "gpu_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- training options ---------------------------------------------------------------------


def test_bf16_autocast_keeps_t_and_its_solves_in_fp32():
    """Under bf16 autocast the Cholesky factor, T and the embedding solves stay fp32; the head's
    matmuls run in bf16 like any linear layer."""
    from pit_deploy.model.core import init_random

    interface = init_random(64, 8, torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert interface.cholesky_factor().dtype == torch.float32
        assert interface.transform().dtype == torch.float32
        assert interface.embed(torch.tensor([[1, 2, 3]])).dtype == torch.float32
        assert interface.logits(torch.randn(2, 8)).dtype == torch.bfloat16


def test_flops_per_token_and_mfu():
    from pit_deploy.tiny import tiny_model
    from pit_deploy.training.throughput import flops_per_token, mfu, parameter_count, peak_flops, peak_memory_mb

    model = tiny_model("llama")
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    expected = 6 * parameter_count(model) + 12 * c.num_hidden_layers * c.num_attention_heads * head_dim * 128
    assert flops_per_token(model, 128) == expected
    assert flops_per_token(model, 256) > flops_per_token(model, 128)  # the attention term grows with the context
    cpu = torch.device("cpu")
    assert peak_flops(cpu, "bf16") is None and peak_memory_mb(cpu) is None
    assert peak_flops(cpu, "bf16", 2.0) == 2e12
    # an fp32 CPU run: threads x fp32 FLOPs a cycle of the widest vector ISA x the clock
    from pit_deploy.training.throughput import cpu_peak_flops

    info = "flags\t\t: fpu sse2 avx2 fma avx512f\ncpu MHz\t\t: 2300.0\n"
    assert cpu_peak_flops(2, info) == pytest.approx(2 * 64 * 2.3e9)
    assert cpu_peak_flops(1, info.replace(" avx512f", "")) == pytest.approx(32 * 2.3e9)
    assert cpu_peak_flops(1, "flags\t: fp asimd\n") is None and cpu_peak_flops(1, "flags\t: avx2\n") is None
    assert mfu(1000.0, 1e9, 2e12) == pytest.approx(0.5) and mfu(1000.0, 1e9, None) is None


def test_new_options_are_validated():
    for bad in ({"peak_tflops": 0.0}, {"peak_tflops": float("nan")}, {"max_seconds": -1.0}):
        with pytest.raises(PitError):
            validate(with_start_defaults(config(Path("o"), Path("m"), Path("d"), **bad)))


def test_compile_falls_back_to_eager_and_throughput_is_logged(tmp_path, assets, monkeypatch, capsys):
    """A compiler that fails: one warning line, the run trains in eager mode; MFU from
    --peak-tflops, no peak memory on the CPU, held-out prose at every evaluation, and
    --max-seconds ends the run after its first step."""

    def broken_compile(model, *args, **kwargs):
        def fail(*a, **k):
            raise RuntimeError("no compiler here\nsecond line")
        return fail

    monkeypatch.setattr(torch, "compile", broken_compile)
    model, corpus = assets
    out = tmp_path / "run"
    result = train(config(out, model, corpus, compile=True, peak_tflops=1.0, eval_prose=True, max_seconds=1e-6,
                          steps=6, eval_every=3))
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning: --compile failed")]
    assert len(warnings) == 1 and "no compiler here" in warnings[0] and "eager" in warnings[0]
    assert result.extra["compiled"] is False
    assert result.steps == 1 and "max_seconds" in result.extra["stopped_early"]
    train_recs = read_metrics(out, "train")
    evals = read_metrics(out, "eval")
    assert [r["step"] for r in train_recs] == [1]
    rec = train_recs[0]
    assert rec["mfu"] == pytest.approx(rec["tokens_per_s"] * result.extra["flops_per_token"] / 1e12)
    assert rec["peak_memory_mb"] is None and rec["delta_ti"] <= 1e-5
    assert [e["step"] for e in evals] == [0, 1]  # the start, and the step the time ran out
    assert all(math.isfinite(e["val_prose_loss"]) for e in evals)
    assert (out / "model").is_dir()


def test_compile_uses_the_compiled_model(tmp_path, assets, monkeypatch):
    calls = []

    def counting_compile(model, *args, **kwargs):
        def run(*a, **k):
            calls.append(1)
            return model(*a, **k)
        return run

    monkeypatch.setattr(torch, "compile", counting_compile)
    model, corpus = assets
    result = train(config(tmp_path / "c", model, corpus, compile=True, steps=2, eval_every=0))
    assert result.extra["compiled"] is True
    assert len(calls) == 1 + 2  # the trial micro-batch, then one per step (batch 4, no accumulation)
    mfu = result.extra["mfu"]  # against the CPU's fp32 peak where it is known
    assert mfu is None or 0 < mfu < 1


# ---- recipes --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpu-cpt-offline", "gpu-scratch"])
def test_gpu_recipes_compare_pit_and_tt_offline(name):
    """Offline (the default corpus), both tyings, bf16 with compile, a token budget that the aimed-at
    throughput trains within the run's time limit, held-out prose evaluated."""
    from pit_deploy.workflow.recipe import load_run_recipe

    driver = _load_driver()
    recipe = load_run_recipe(name)
    train_table = recipe.effective("train")
    assert recipe["run"]["data"] == "default" and sorted(train_table["tying"]) == ["pit", "tt"]
    assert train_table["precision"] == "bf16" and train_table["compile"] and train_table["eval_prose"]
    seconds_at_target = train_table["tokens"] / driver.TARGETS["tokens_per_s"]
    assert 60 <= seconds_at_target <= train_table["max_seconds"]
    assert train_table["tokens"] // (train_table["seq_len"] * train_table["batch_size"]) > 4 * train_table["eval_every"]


def test_gpu_cpt_recipe_keeps_the_hub_recipe_beside_it():
    text = (ROOT / "pit_deploy" / "recipes" / "run" / "gpu-cpt.toml").read_text()
    assert "HuggingFaceFW/fineweb-edu" in text and "network" in text


# ---- the prepared scripts, end to end on a tiny model ---------------------------------------


def _smoke(script: str, out: Path, *args: str) -> dict:
    env = {**os.environ, "PIT_GPU_SMOKE": "1", "OUT": str(out), "PYTHON": sys.executable,
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(["bash", str(GPU / script), "--work", str(out / "work"), *args], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    name = script.replace("_run.sh", "")
    assert (out / f"gpu_{name}_smoke.log").is_file()
    return json.loads((out / f"gpu_{name}_smoke.json").read_text())


def _check_run(run: dict, steps: int, pit: bool) -> None:
    assert run["exit_code"] == 0
    curves = run["curves"]["train"]
    assert curves["step"] == list(range(1, steps + 1))
    assert len(curves["delta_ti"]) == steps  # every logged step; PIT's within the bound, TT's is E's own
    assert all(d <= 1e-5 for d in curves["delta_ti"]) if pit else all(d > 1e-3 for d in curves["delta_ti"])
    # MFU: against the CPU's fp32 peak where it is known (an fp32 CPU run), else None
    assert all(t > 0 for t in curves["tokens_per_s"]) and all(m is None or 0 < m < 1 for m in curves["mfu"])
    assert all(m is None for m in curves["peak_memory_mb"])
    assert "t_cond" in curves if pit else "t_cond" not in curves
    assert all(math.isfinite(v) for v in run["curves"]["eval"]["val_prose_loss"])
    assert run["summary"]["steps"] == steps and run["config"]["precision"] == "fp32"


@pytest.fixture(scope="module")
def cpt_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-cpt")
    return out, _smoke("cpt_run.sh", out, "--no-verify")


def test_cpt_script_smoke(cpt_result):
    _, result = cpt_result
    assert result["kind"] == "gpu-cpt" and result["smoke"] and result["status"] == "done"
    assert result["device"]["name"] and result["versions"]["torch"] == torch.__version__
    assert "gpu_run.py cpt" in result["command"] and result["recipe"] == "gpu-cpt-offline"
    assert result["budget"]["tokens_per_step"] == 32 * 2 and result["budget"]["steps"] == 3
    for tying in ("pit", "tt"):
        _check_run(result["runs"][tying], 3, tying == "pit")
        assert result["runs"][tying]["diagnose_end"]["exit_code"] == 0
    assert result["runs"]["pit"]["config"]["t_init"] == "preserve" and result["runs"]["tt"]["config"]["t_init"] is None
    assert result["runs"]["pit"]["interface"]["delta_ti_within_target"] is True
    assert result["comparison"]["pit_tt_step_time_ratio"] > 0


def test_scratch_script_smoke(tmp_path):
    result = _smoke("scratch_run.sh", tmp_path)
    assert result["kind"] == "gpu-scratch" and result["status"] == "done"
    for tying in ("pit", "tt"):
        run = result["runs"][tying]
        _check_run(run, 3, tying == "pit")
        assert run["config"]["from_scratch"] and run["config"]["arch"] == "tiny"
        assert run["diagnose_start"]["tying"] and run["diagnose_end"]["exit_code"] == 0
        assert run["probe"]["exit_code"] == 0 and run["probe"]["result"]
        lora = result["lora"][tying]
        assert lora["exit_code"] == 0 and lora["config"]["lora"] and lora["summary"]["steps"] == 2
    assert result["data"]["lora_files"] > 0 and result["data"]["pretrain_files"] > 0


def test_collect_files_a_result_and_refuses_a_smoke_run_in_benchmarks(cpt_result, tmp_path):
    out, _ = cpt_result
    collect = [sys.executable, str(GPU / "collect.py"), str(out / "gpu_cpt_smoke.json")]
    refused = subprocess.run(collect, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "smoke" in refused.stderr
    done = subprocess.run([*collect, "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    filed = json.loads((tmp_path / "gpu_cpt_pit_vs_tt_smoke.json").read_text())
    assert filed["provenance"] and filed["runs"]["pit"]["curves"]["train"]["delta_ti"]


def test_export_and_verify_is_skipped_with_the_reason_when_packages_are_missing(tmp_path, monkeypatch):
    driver = _load_driver()
    real = driver.importlib.import_module

    def no_optimum(name, *a, **k):
        if name.startswith("optimum"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(driver.importlib, "import_module", no_optimum)
    result = driver.export_and_verify(tmp_path / "model", tmp_path / "export")
    assert "optimum.exporters.onnx" in result["skipped"]

"""DDP on 2 CPU processes (gloo) gives the same losses as one process on the same global batch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from train_fixtures import config, make_corpus, make_model_dir, read_metrics

from pit_deploy.io.checkpoint import load_pit_model
from pit_deploy.model.inspect import find_interface
from pit_deploy.training.loop import train

WORKER = """
import os, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from train_fixtures import config
from pit_deploy.training.loop import TrainingRecipe
options = dict(batch_size=2, steps=3, eval_every=3, save_every=3, lr=3e-3)
options.update({options!r})
crash_at = options.pop("crash_at", None)

class Recipe(TrainingRecipe):
    def on_step_end(self, step):
        if step == crash_at:  # every process ends here, after the step's checkpoint, with no cleanup
            os._exit(0)

recipe = Recipe(config(Path({out!r}), Path({model!r}), Path({corpus!r}), **options)).setup()
result = recipe.train()
assert result.steps == options["steps"], result  # every rank returns the run's result
"""

def _torchrun_two(tmp_path: Path, out: Path, model: Path, corpus: Path, **options) -> None:
    """Run the worker above on 2 CPU processes (gloo) under torchrun."""
    script = tmp_path / f"worker-{out.name}.py"
    script.write_text(WORKER.format(tests=str(Path(__file__).parent), out=str(out), model=str(model),
                                    corpus=str(corpus), options=options))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        _, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        # torchrun forwards SIGTERM to its workers (which run in their own sessions); a plain
        # kill of torchrun would leave them running.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        finally:
            proc.kill()
        pytest.fail("torchrun with 2 processes did not finish within 240 s")
    assert proc.returncode == 0, stderr[-3000:]


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_processes_match_one(tmp_path, fsdp):
    model, corpus = make_model_dir(tmp_path), make_corpus(tmp_path)
    single = tmp_path / "single"
    train(config(single, model, corpus, batch_size=4, steps=3, eval_every=3, save_every=3, lr=3e-3))
    ddp = tmp_path / ("fsdp" if fsdp else "ddp")
    _torchrun_two(tmp_path, ddp, model, corpus, fsdp=fsdp)
    a = [r for r in read_metrics(single) if r["kind"] == "train"]
    b = [r for r in read_metrics(ddp) if r["kind"] == "train"]
    assert len(a) == len(b) == 3
    assert b[0]["tokens"] == a[0]["tokens"] == 4 * 32  # same global batch
    # first step: same model, same data; only the order of float sums differs
    assert b[0]["loss"] == pytest.approx(a[0]["loss"], rel=1e-6, abs=1e-6)
    # later steps check that gradients were averaged across processes like one big batch
    for x, y in zip(a[1:], b[1:]):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-3)
    ea = [r["val_loss"] for r in read_metrics(single) if r["kind"] == "eval"]
    eb = [r["val_loss"] for r in read_metrics(ddp) if r["kind"] == "eval"]
    assert eb == pytest.approx(ea, rel=1e-4)
    assert (ddp / "checkpoints" / "step-0000003" / "state.json").is_file()
    assert (ddp / "model" / "model.safetensors").is_file()
    # the interface stays exact, and the final (gathered) model reloads as a whole PIT model
    assert all(r["delta_ti"] <= 1e-5 for r in b)
    reloaded = load_pit_model(ddp / "model")
    assert find_interface(reloaded) is not None


def test_fsdp_transpose_tying_and_resume(tmp_path):
    """TT (tied table, sharded with the root) under FSDP; a resumed FSDP run continues the curve."""
    model, corpus = make_model_dir(tmp_path), make_corpus(tmp_path)
    whole = tmp_path / "whole"
    _torchrun_two(tmp_path, whole, model, corpus, fsdp=True, tying="tt")
    cut = tmp_path / "cut"
    _torchrun_two(tmp_path, cut, model, corpus, fsdp=True, tying="tt", save_every=1, crash_at=2)
    _torchrun_two(tmp_path, cut, model, corpus, fsdp=True, tying="tt", save_every=1, resume=True)
    a = [r["loss"] for r in read_metrics(whole) if r["kind"] == "train"]
    b = [r["loss"] for r in read_metrics(cut) if r["kind"] == "train"]
    assert len(a) == len(b) == 3
    assert b == pytest.approx(a, rel=1e-6)
    assert (whole / "model" / "model.safetensors").is_file()

"""Helpers shared by the training-area tests: a tiny model directory with a tiny tokenizer,
and a small text corpus, all built in code (no network)."""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from pit_deploy.io.checkpoint import save_model  # noqa: E402
from pit_deploy.tiny import tiny_model, tiny_tokenizer  # noqa: E402
from pit_deploy.training.loop import TrainConfig  # noqa: E402
from pit_deploy.io.metrics import read_metrics  # noqa: E402,F401  (re-exported for the tests)


def make_model_dir(root: Path, family: str = "llama", **kwargs) -> Path:
    """A saved tiny tied model of ``family`` with the tiny BPE tokenizer."""
    path = root / f"tiny-{family}"
    if not path.exists():
        save_model(tiny_model(family, **kwargs), path, tiny_tokenizer())
    return path


def make_corpus(root: Path, n_docs: int = 48, chars: int = 1500) -> Path:
    """``n_docs`` text files cut from the standard library's sources (real code)."""
    path = root / "corpus"
    if path.exists():
        return path
    path.mkdir(parents=True)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:n_docs]
    for i, f in enumerate(files):
        (path / f"doc{i:03d}.txt").write_text(f.read_text(errors="replace")[:chars])
    return path


def make_pairs(root: Path, n: int = 40) -> Path:
    """A prompt/completion JSONL file (instruction-style)."""
    path = root / "pairs.jsonl"
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"prompt": f"def add_{i}(a, b):\n", "completion": f"    return a + b + {i}\n"}) + "\n")
    return path


def config(out: Path, model: Path, data: Path, **overrides) -> TrainConfig:
    """A fast CPU training config for the tiny models."""
    base = dict(out=str(out), model=str(model), data=str(data), seq_len=32, batch_size=4, steps=12,
                lr=3e-3, warmup_steps=2, val_fraction=0.2, eval_every=6, eval_blocks=4,
                progress=False, plot=False, seed=0)
    base.update(overrides)
    return TrainConfig(**base)


# A training process that dies at the end of step ``crash_at`` (after that step's checkpoint),
# the way a killed job does: SIGKILL, no cleanup, no exception handler runs.
CRASH_WORKER = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from train_fixtures import config
from pit_deploy.training.loop import TrainingRecipe

class CrashAt(TrainingRecipe):
    def on_step_end(self, step):
        if step == {crash_at!r}:
            os.kill(os.getpid(), signal.SIGKILL)

options = {options!r}
recipe = CrashAt(config(Path({out!r}), Path({model!r}), Path({corpus!r}), **options))
recipe.setup()
recipe.train()
"""


def crash_worker(tmp_path: Path, out: Path, model: Path, corpus: Path, crash_at: int, **options) -> Path:
    """A script that trains ``config(out, model, corpus, **options)`` and kills itself with
    SIGKILL after step ``crash_at``."""
    script = tmp_path / f"worker-{out.name}-{crash_at}.py"
    script.write_text(CRASH_WORKER.format(tests=str(Path(__file__).parent), out=str(out), model=str(model),
                                          corpus=str(corpus), options=options, crash_at=crash_at))
    return script

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
from pit_deploy.train.loop import TrainConfig  # noqa: E402


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


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]

"""Loss curves of training runs: a small result object that loads, summarizes and plots.

``pit-deploy plot RUN...`` overlays runs the way the paper's figure compares PIT with TT:
training loss against tokens (solid) and, where the run evaluated, validation loss (markers,
dashed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PitError
from ..io.fs import check_output_file

#: the file types a chart may be written as (matplotlib picks the format by the suffix)
IMAGE_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def image_file(path: str | Path) -> Path:
    """The file a chart requested as ``path`` is written to: matplotlib adds ``.png`` to a name
    without a suffix, and so does this, so that the path a command prints is the file written."""
    path = Path(path)
    return path if path.suffix else path.with_name(path.name + ".png")


def check_image_path(path: str | Path, flag: str, inputs: tuple[str | Path, ...] = (),
                     make_parents: bool = False) -> Path:
    """:func:`image_file` of ``path``, refused (exit 2) before any work when it cannot be
    written: a directory, a suffix matplotlib does not write, or what
    :func:`~pit_deploy.io.fs.check_output_file` refuses."""
    if Path(path).is_dir():
        raise PitError(f"{flag} {path} is a directory; name the image file to write (e.g. {Path(path) / 'chart.png'})")
    target = image_file(path)
    if target.suffix.lower() not in IMAGE_SUFFIXES:
        raise PitError(f"{flag} {path}: cannot write a {target.suffix!r} image; use one of {', '.join(IMAGE_SUFFIXES)}")
    return check_output_file(target, flag, inputs=inputs, make_parents=make_parents)


@dataclass
class RunLog:
    """The logged metrics of one run directory (``metrics.jsonl`` + ``run.json``)."""

    path: Path
    label: str
    train: list[dict[str, Any]] = field(default_factory=list)
    eval: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def load(cls, path: str | Path, label: str | None = None) -> "RunLog":
        path = Path(path)
        from ..io.metrics import METRICS_NAME, read_metrics

        if not (path / METRICS_NAME).is_file():
            raise PitError(f"{path} has no {METRICS_NAME}; pass a directory written by `pit-deploy train`")
        records = read_metrics(path)
        if label is None:
            label = path.name
            run = path / "run.json"
            if run.is_file():
                cfg = json.loads(run.read_text())
                kind = "scratch" if cfg.get("from_scratch") else ("LoRA" if cfg.get("lora") else "")
                label = " ".join(x for x in (cfg.get("tying", "").upper(), kind, f"({path.name})") if x)
        return cls(
            path=path,
            label=label,
            train=[r for r in records if r.get("kind") == "train"],
            eval=[r for r in records if r.get("kind") == "eval"],
        )

    def summary(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "steps": self.train[-1]["step"] if self.train else 0,
            "final_train_loss": self.train[-1]["loss"] if self.train else None,
            "final_val_loss": self.eval[-1]["val_loss"] if self.eval else None,
        }

    def curves(self) -> dict[str, list]:
        """Columns for JSON: tokens/loss of training and evaluation records."""
        return {
            "train_tokens": [r["tokens"] for r in self.train],
            "train_loss": [r["loss"] for r in self.train],
            "eval_tokens": [r["tokens"] for r in self.eval],
            "val_loss": [r["val_loss"] for r in self.eval],
        }


def plot_runs(runs: list[RunLog], out: str | Path, title: str | None = None) -> Path:
    """Overlay the loss curves of ``runs`` in one PNG at ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for i, run in enumerate(runs):
        color = f"C{i}"
        c = run.curves()
        if c["train_tokens"]:
            ax.plot(c["train_tokens"], c["train_loss"], color=color, lw=1.5, label=f"{run.label} train")
        if c["eval_tokens"]:
            ax.plot(c["eval_tokens"], c["val_loss"], color=color, ls="--", marker="o", ms=3,
                    label=f"{run.label} validation")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or "training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = image_file(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out

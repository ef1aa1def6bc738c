#!/usr/bin/env python3
"""Files the JSON a prepared GPU run brought back into ``benchmarks/results/``, with a plot of
its curves.

    python scripts/gpu/collect.py RETURNED/gpu_cpt.json       # → benchmarks/results/gpu_cpt_pit_vs_tt.{json,png}
    python scripts/gpu/collect.py RETURNED/gpu_scratch.json   # → benchmarks/results/gpu_scratch_pit_vs_tt.{json,png}

The result keeps everything the run wrote (device, versions, command, token budget, curves,
``delta_ti`` per logged step, throughput, diagnostics) under ``provenance`` from
``pit_deploy.io.result_file.write_result``. A smoke result (``PIT_GPU_SMOKE=1``, a tiny model on
a CPU) is refused unless ``--out-dir`` names another folder than ``benchmarks/results``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NAMES = {"gpu-cpt": "gpu_cpt_pit_vs_tt", "gpu-scratch": "gpu_scratch_pit_vs_tt"}
RESULTS = ROOT / "benchmarks" / "results"


def plot(result: dict, path: Path) -> Path | None:
    """Validation curves (held-out code and prose) and the training loss of every run, against
    tokens; ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = {**result.get("runs", {}), **{f"LoRA {k}": v for k, v in (result.get("lora") or {}).items()}}
    panels = [("val_loss", "held-out code (validation split)"), ("val_prose_loss", "held-out prose"),
              ("loss", "training loss")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8))
    for ax, (key, title) in zip(axes, panels):
        for name, run in runs.items():
            table = run.get("curves", {}).get("train" if key == "loss" else "eval", {})
            xs, ys = table.get("tokens") or [], table.get(key) or []
            points = [(x, y) for x, y in zip(xs, ys) if isinstance(y, (int, float))]
            if points:
                ax.plot([p[0] / 1e6 for p in points], [p[1] for p in points], label=name.upper() if len(name) < 4 else name,
                        marker="o" if key != "loss" else None, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("tokens (millions)")
        ax.set_ylabel("nats/token")
        ax.grid(alpha=0.3)
        ax.legend()
    device = (result.get("device") or {}).get("name", "")
    fig.suptitle(f"{result.get('kind', '')}: PIT vs TT on {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    from pit_deploy.io.result_file import write_result

    p = argparse.ArgumentParser(description="file a prepared GPU run's JSON into benchmarks/results/")
    p.add_argument("result", help="the JSON the run wrote under $OUT (gpu_cpt.json or gpu_scratch.json)")
    p.add_argument("--out-dir", default=str(RESULTS), help="folder to write into (default: benchmarks/results)")
    args = p.parse_args(argv)
    source = Path(args.result)
    try:
        result = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"error: cannot read {source}: {exc}", file=sys.stderr)
        return 2
    kind = result.get("kind")
    if kind not in NAMES:
        print(f"error: {source} is not a prepared GPU run's result (kind {kind!r})", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir)
    if result.get("smoke") and out_dir.resolve() == RESULTS.resolve():
        print(f"error: {source} is a smoke run (a tiny model); it does not go into benchmarks/results", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    name = NAMES[kind] + ("_smoke" if result.get("smoke") else "")
    image = plot(result, out_dir / f"{name}.png")
    result["plot"] = image.name if image else None
    write_result(out_dir / f"{name}.json", result, __file__, argv if argv is not None else sys.argv[1:])
    if image:
        print(f"wrote {image}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What int4 costs the model, ours against the int4 builds a user would pick instead: one harness,
the same token ids, each artifact against its own unquantized model.

Quantization loss the way llama.cpp's ``perplexity --kl-divergence`` measures it: per position,
the KL divergence of the artifact's next-token distribution from the unquantized model's (mean
and 99th percentile), the same-top-1 rate and the perplexity ratio
(:func:`pit_deploy.data.heldout.kl_parity`), on three held-out kinds
(:func:`pit_deploy.data.calibration.heldout_sets`: code from the default corpus's validation
split, English prose and chat turns shipped with the package — none of it in the text GPTQ
calibrates on). Blocks of 255 tokens (a ``.pte``'s static cache holds 256).

Artifacts:

* ``ours:<name>`` — every quantized artifact of each ``--ours`` export directory, run by its
  target's driver (the ``.pte`` in ExecuTorch, ONNX in onnxruntime), against that export's fp32
  PIT reference in PyTorch;
* ``llama.cpp-Q8_0`` / ``-Q4_K_M`` / ``-Q4_0`` — the source GGUF requantized by llama.cpp's own
  quantizer (``llama_cpp.llama_model_quantize``, cached in ``--work``), run in llama.cpp
  (``logits_all``) — the default model ships as Q4_1, so these start from its grid;
* ``genai-builder-int4`` — onnxruntime-genai's model builder int4 of the source (built by
  ``genai_side_by_side.py``'s code, cached), its ``model.onnx`` in onnxruntime;

the peers against the source model in PyTorch (the GGUF dequantized to float32). Sizes: ours the
artifact's folder as its manifest records it (the tokenizer's files included, about 1.7 MB for
the default model), the peers' the files that hold the model. Speed is not measured here: ``pte_anchors.py`` times the same kinds
of artifact side by side, and GPTQ codes change no kernel or shape of a program.

    python benchmarks/int4_quality_peers.py --ours EXPORT_DIR [--ours EXPORT_DIR ...]
        [--model default] [--work bench_work/pte_anchors] [--no-peers]
        [--out benchmarks/results/int4_quality_peers.json]   (and a .png beside it: size vs mean KL)
    python benchmarks/int4_quality_peers.py --replot benchmarks/results/int4_quality_peers.json

llama-cpp-python (``bash scripts/setup_llama_cpp.sh``) and onnxruntime-genai are optional: a
peer whose package is missing is left out and the result says which and why.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from pte_anchors import size_mb  # noqa: E402
from pit_deploy.io.result_file import write_result  # noqa: E402

BLOCK = 255
LLAMA_TYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}


class _Prefill:
    """A decoder's ``prefill`` (numpy logits) as the driver protocol ``kl_parity`` reads."""

    def __init__(self, decoder):
        self.decoder = decoder

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.decoder.prefill(ids.numpy()))


def figures(driver, reference, sets: dict[str, list[list[int]]]) -> dict:
    from pit_deploy.data.heldout import kl_parity

    out = {}
    for kind, blocks in sets.items():
        f = kl_parity(driver, reference, blocks)
        out[kind] = {"kl_mean": f.kl_mean, "kl_p99": f.kl_p99, "same_top1": f.same_top1, "ppl_ratio": f.ppl_ratio,
                     "tokens": f.tokens}
    return out


def ours(directory: Path, sets: dict) -> list[dict]:
    from pit_deploy.io.checkpoint import load_pit_model
    from pit_deploy.io.manifest import Manifest
    from pit_deploy.runtime.drivers import driver_class

    manifest = Manifest.read(directory)
    reference = load_pit_model(directory / "reference").eval()
    rows = []
    for art in manifest.artifacts:
        if art.dtype == "float32":
            continue
        with driver_class(art.runtime)(directory / art.path) as driver:
            rows.append({"artifact": f"ours:{directory.name}/{art.path}", "size_mb": art.bytes / 1e6,
                         "rounding": (art.details.get("scheme") or {}).get("rounding", "rtn"),
                         **figures(driver, reference, sets)})
        print(rows[-1]["artifact"], {k: round(v["kl_mean"], 4) for k, v in rows[-1].items() if isinstance(v, dict)},
              flush=True)
    return rows


def llama_files(work: Path, source: str | None) -> tuple[dict[str, Path], str | None]:
    if source is None:
        return {}, "llama.cpp: no GGUF of the source"
    try:
        import llama_cpp
    except ImportError:
        return {}, "llama.cpp: llama-cpp-python is not installed (bash scripts/setup_llama_cpp.sh)"
    files = {}
    for name, ftype in LLAMA_TYPES.items():
        out = work / f"llama.cpp-{name}.gguf"
        if not out.is_file():
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, ftype)
            params.allow_requantize = True
            if llama_cpp.llama_model_quantize(source.encode(), str(out).encode(), params) != 0:
                return files, f"llama.cpp: quantizing to {name} failed"
        files[name] = out
    return files, None


def peers(model: str, work: Path, sets: dict, block: int) -> tuple[list[dict], list[str]]:
    from pit_deploy.io.sources import default_gguf_path, load_source

    loaded = load_source(model)
    source = loaded.model.float().eval()
    gguf = str(default_gguf_path()) if model == "default" else (model if model.endswith(".gguf") else None)
    rows, missing = [], []
    files, why = llama_files(work, gguf)
    if why:
        missing.append(why)
    for name, path in files.items():
        from pit_deploy.targets.gguf.decoder import LlamaCppDecoder  # only once llama_cpp imported

        decoder = LlamaCppDecoder(path, context=block + 1, kv_cache_type="f32")
        rows.append({"artifact": f"llama.cpp-{name}", "size_mb": path.stat().st_size / 1e6,
                     **figures(_Prefill(decoder), source, sets)})
        decoder.close()
        print(rows[-1]["artifact"], {k: round(v["kl_mean"], 4) for k, v in rows[-1].items() if isinstance(v, dict)},
              flush=True)
    try:
        from genai_side_by_side import builder_folders

        folders, _, _, _ = builder_folders(model, work, {})
        from pit_deploy.runtime.standalone import OrtDecoder

        folder = folders["builder-int4"]
        rows.append({"artifact": "genai-builder-int4", "size_mb": size_mb(folder),
                     **figures(_Prefill(OrtDecoder(folder / "model.onnx")), source, sets)})
        print(rows[-1]["artifact"], {k: round(v["kl_mean"], 4) for k, v in rows[-1].items() if isinstance(v, dict)},
              flush=True)
    except ImportError as exc:
        missing.append(f"genai-builder-int4: {exc}")
    return rows, missing


def plot(rows: list[dict], path: Path) -> None:
    """Size against mean KL, one marker a held-out kind, one label an artifact (log KL); an artifact
    measured twice with identical figures (the same file in two export directories) is drawn once."""
    import matplotlib

    seen: set[tuple] = set()
    unique = []
    for r in rows:
        key = (round(r["size_mb"], 3), *(r[k]["kl_mean"] for k in ("code", "prose", "chat")))
        if key not in seen:
            seen.add(key)
            unique.append(r)
    rows = unique

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for kind, marker in (("code", "o"), ("prose", "s"), ("chat", "^")):
        ax.scatter([r["size_mb"] for r in rows], [max(r[kind]["kl_mean"], 1e-4) for r in rows], marker=marker,
                   label=kind)
    span = max(r["size_mb"] for r in rows) - min(r["size_mb"] for r in rows)
    placed: list[tuple[float, float, float]] = []  # (x, KL, the label's width in MB) of each label drawn
    for r in rows:
        # ours by export directory and artifact (two directories may hold artifacts of one name)
        label = r["artifact"].removeprefix("ours:") + (f" ({r['rounding']})" if r.get("rounding") else "")
        x, y = r["size_mb"], max(r["code"]["kl_mean"], 1e-4)
        # a point under a label already drawn (within 15 % of its KL) has its own label a line lower
        near = sum(px - 0.02 * span <= x <= px + w and abs(y / py - 1) < 0.15 for px, py, w in placed)
        placed.append((x, y, 0.0065 * span * len(label)))
        ax.annotate(label, (x, y), fontsize=7, xytext=(4, 4 - 9 * near), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("size, MB (ours: the artifact folder, tokenizer included; peers: the model files)")
    ax.set_ylabel("mean KL from its own unquantized model (nats/token)")
    ax.legend(title="held-out")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ours", action="append", default=[], help="an export directory (repeatable)")
    ap.add_argument("--model", default="default", help="the source the peers are built from")
    ap.add_argument("--work", default="bench_work/pte_anchors", help="where the peers' files are built and cached")
    ap.add_argument("--no-peers", action="store_true", help="measure our artifacts only")
    ap.add_argument("--block", type=int, default=BLOCK, help="tokens a held-out block (default 255)")
    ap.add_argument("--out", default="benchmarks/results/int4_quality_peers.json")
    ap.add_argument("--replot", metavar="JSON", help="only draw the plot of an earlier result file again (beside it)")
    args = ap.parse_args(argv)
    if args.replot:
        import json

        plot(json.loads(Path(args.replot).read_text(encoding="utf-8"))["rows"], Path(args.replot).with_suffix(".png"))
        return 0
    from pit_deploy.io.sources import load_source

    start = time.perf_counter()
    if args.ours:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(Path(args.ours[0]) / "reference")
    else:
        tokenizer = load_source(args.model).tokenizer
    from pit_deploy.data.calibration import heldout_sets

    sets = heldout_sets(tokenizer, args.block)
    rows: list[dict] = []
    for directory in args.ours:
        rows += ours(Path(directory), sets)
    missing = ["peers: not asked for (--no-peers)"] if args.no_peers else []
    if not args.no_peers:
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
        found, missing = peers(args.model, work, sets, args.block)
        rows += found
    # the result (and its provenance: was the checkout clean?) before the plot changes a tracked file
    write_result(args.out, {"block": args.block, "tokens": {k: sum(map(len, v)) for k, v in sets.items()},
                            "rows": rows, "left_out": missing,
                            "seconds": round(time.perf_counter() - start, 1)}, __file__, argv)
    if rows:
        plot(rows, Path(args.out).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

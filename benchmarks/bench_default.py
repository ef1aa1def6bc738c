"""The fp32 artifacts of the default model, side by side: latency, memory, size — and the goals.

Why: this is the product's own benchmark — the figures and goals the README reports for
speed, memory and size come from one run of it, and re-running it after a change (or on another
machine) says whether they still hold.

Runs the project's own commands, in one go so every row is measured under the same conditions:

1. ``pit-deploy export MODEL --runtime onnx,executorch --mode materialized,factorized`` (PIT,
   the source-preserving conversion) — ``pit/``;
2. ``pit-deploy export MODEL --keep-tying --runtime onnx,executorch`` (the transpose-tied source
   through the same exporters) — ``tt/``;
3. ``pit-deploy verify`` of both;
4. ``pit-deploy bench pit tt --torch MODEL --threads 1,2`` — every artifact through its Python
   driver, every ``.pte`` also through ExecuTorch's stock LLM runner, plus PyTorch eager;

then writes ``benchmarks/results/bench_default.json`` (or ``--out``: the bench JSON plus export
times, verify results and the goals of the bench issue evaluated on these rows) and, beside it,
``bench_default.png`` and ``bench_default.md`` (the table and the goals).

Usage::

    python benchmarks/bench_default.py [--model default] [--work bench_work/default]
        [--runtime onnx,executorch] [--threads 1,2] [--prompt-len 64] [--gen-len 128] [--reps 3]
        [--reuse] [--out benchmarks/results/bench_default.json]

``--model`` takes anything ``pit-deploy export`` takes (a local checkpoint directory too);
``--runtime onnx`` skips the ExecuTorch programs, whose lowering takes minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from pit_deploy.io.result_file import write_result

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def pit_deploy(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``pit-deploy`` (this interpreter's); stop on failure unless ``check`` is false."""
    print("$ pit-deploy " + " ".join(args), flush=True)
    proc = subprocess.run([sys.executable, "-m", "pit_deploy.cli", *args], text=True, capture_output=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if check and proc.returncode != 0:
        sys.exit(f"pit-deploy {args[0]} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def _rows(rows: list[dict], **match) -> list[dict]:
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def _one(rows: list[dict], **match) -> dict | None:
    found = _rows(rows, **match)
    return found[0] if found else None


def goals(bench: dict, exports: dict, threads: list[int]) -> list[dict]:
    """The bench issue's goals, each with the measured figures and met / missed."""
    rows, out = bench["rows"], []

    def add(goal: str, measured: str, met: bool | None) -> None:
        out.append({"goal": goal, "measured": measured, "met": met})

    for t in threads:
        for runtime in ("onnx", "executorch", "executorch-llm-runner"):
            pit = _one(rows, runtime=runtime, mode="factorized", threads=t)
            tt = _one(rows, runtime=runtime, tying="tied", threads=t)
            if pit and tt:
                ratio = tt["decode_tok_s"] / pit["decode_tok_s"]
                add(f"PIT-factorized / TT decode time ≤ 1.01 ({runtime}, {t} thread(s))", f"{ratio:.3f}", ratio <= 1.01)
        pte = _one(rows, runtime="executorch", mode="factorized", threads=t)
        ort = _one(rows, runtime="onnx", mode="factorized", threads=t)
        if pte and ort:
            add(f".pte decode no slower than onnxruntime fp32 (factorized, {t} thread(s))",
                f"{pte['decode_ms_p50']:.1f} vs {ort['decode_ms_p50']:.1f} ms/token",
                pte["decode_ms_p50"] <= ort["decode_ms_p50"])
            ratio = ort["prefill_tok_s"] / pte["prefill_tok_s"]
            add(f".pte prefill of {pte['prompt_len']} tokens within 1.2× of onnxruntime's ({t} thread(s))",
                f"{ratio:.2f}×", ratio <= 1.2)
    for r in rows:
        if r["runtime"] in ("onnx", "executorch") and r["threads"] == threads[-1]:
            ratio = r["peak_rss_mb"] / r["size_mb"]
            add(f"peak RSS ≤ 1.3× file size ({r['artifact']})", f"{r['peak_rss_mb']:.0f} MB / {r['size_mb']:.0f} MB = {ratio:.2f}",
                ratio <= 1.3)
    pte_pit = _one(rows, runtime="executorch", mode="factorized")
    pte_tt = _one(rows, runtime="executorch", tying="tied")
    if pte_pit and pte_tt:
        ratio = pte_pit["size_mb"] / pte_tt["size_mb"]
        add("factorized .pte size ≤ 0.85× the stock TT .pte", f"{ratio:.3f}", ratio <= 0.85)
    for key, seconds in exports.items():
        if key.startswith("executorch"):
            add(f".pte export of the default model ≤ 90 s ({key})", f"{seconds:.0f} s", seconds <= 90)
    return out


def markdown(bench: dict, goal_rows: list[dict], exports: dict) -> str:
    lines = ["| artifact | runtime | threads | pp tok/s | tg tok/s | ms/token p50 | TTFT ms | load s | peak RSS MB | size MB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in bench["rows"]:
        lines.append(f"| {r['artifact']} | {r['runtime']} | {r['threads']} | {r['prefill_tok_s']:.1f} | "
                     f"{r['decode_tok_s']:.1f} | {r['decode_ms_p50']:.1f} | {r['ttft_ms']:.0f} | {r['load_s']:.2f} | "
                     f"{r['peak_rss_mb']:.0f} | {r['size_mb']:.1f} |")
    lines += ["", "| goal | measured | met |", "|---|---|---|"]
    for g in goal_rows:
        lines.append(f"| {g['goal']} | {g['measured']} | {'yes' if g['met'] else 'NO'} |")
    lines += ["", "Export time per artifact (s): " + ", ".join(f"{k} {v:.0f}" for k, v in exports.items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--work", default="bench_work/default", help="export directories go here")
    parser.add_argument("--runtime", default="onnx,executorch", help="comma list of runtimes to export")
    parser.add_argument("--max-seq-len", default="256")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--prompt-len", default="64")
    parser.add_argument("--gen-len", default="128")
    parser.add_argument("--reps", default="3")
    parser.add_argument("--reuse", action="store_true", help="keep export directories that already exist")
    parser.add_argument("--out", default=str(RESULTS / "bench_default.json"),
                        help="the result JSON; the .md table and the .png plot are written beside it")
    args = parser.parse_args(argv)

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    pit, tt = work / "pit", work / "tt"
    started = time.time()
    common = ["--runtime", args.runtime, "--max-seq-len", args.max_seq_len, "--force"]
    if not (args.reuse and (pit / "manifest.json").is_file()):
        pit_deploy("export", args.model, "--out", str(pit), "--mode", "materialized,factorized", *common)
    if not (args.reuse and (tt / "manifest.json").is_file()):
        pit_deploy("export", args.model, "--out", str(tt), "--keep-tying", *common)
    verify = {}
    for name, directory in (("pit", pit), ("tt", tt)):
        proc = pit_deploy("verify", str(directory), "--json", check=False)
        verify[name] = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {"error": proc.stderr[-2000:]}
    exports = {}
    for name, directory in (("pit", pit), ("tt", tt)):
        for art in json.loads((directory / "manifest.json").read_text())["artifacts"]:
            exports[f"{art['target']}-{art['mode']}" if name == "pit" else f"{art['target']}-tied"] = art["export_seconds"]
    out_json = Path(args.out)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    png = out_json.with_suffix(".png")
    proc = pit_deploy("bench", str(pit), str(tt), "--torch", args.model, "--threads", args.threads,
                      "--prompt-len", args.prompt_len, "--gen-len", args.gen_len, "--reps", args.reps,
                      "--json", "--plot", str(png))
    bench = json.loads(proc.stdout)
    threads = [int(t) for t in args.threads.split(",")]
    goal_rows = goals(bench, exports, threads)
    result = {**bench, "export_seconds": exports, "verify": verify, "goals": goal_rows,
              "settings": vars(args), "wall_s": round(time.time() - started, 1)}
    table = markdown(bench, goal_rows, exports)
    out_json.with_suffix(".md").write_text(table, encoding="utf-8")
    print(table)
    return write_result(out_json, result, __file__, argv)


if __name__ == "__main__":
    sys.exit(main())

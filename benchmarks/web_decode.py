"""Decode rates of the ``onnx`` target's folders where web developers run them — transformers.js in
Node (onnxruntime-node) and in headless Chromium (onnxruntime-web, WASM) — beside native
onnxruntime on the same folder, the same prompt ids and greedy length, in one run.

Why: ``verify --web`` proves a folder computes the right thing in the browser; this says how fast,
and how far the browser sits from native onnxruntime on the same machine.

Per folder and round (rounds interleaved): each client runs the folder in its own process
(:func:`pit_deploy.runtime.web_clients.run_web_client`, one prompt of ``--prompt-len`` ids,
``--gen-len`` greedy tokens through transformers.js's own ``generate``; prefill = the time to the
first new token, decode = the mean of the rest), and native onnxruntime runs the same ids through
the standalone decoder (``pit_deploy.runtime.standalone.OrtDecoder``: prefill call, then one
step per token). A client that cannot run a folder (an operator its build lacks) is recorded with
its error line. Threads: ``--threads`` for every engine (Chromium: WASM threads, the page is
cross-origin isolated).

Usage::

    python benchmarks/web_decode.py EXPORT/onnx-factorized [EXPORT/onnx-factorized-int4 ...]
        [--clients node,chromium] [--threads 1] [--rounds 2] [--prompt-len 64] [--gen-len 32]
        [--out benchmarks/results/web_decode.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from pit_deploy.io.result_file import write_result

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TEXT = ("The history of the printing press begins in the fifteenth century, when movable type changed "
               "how books were made, how ideas travelled between cities, and who could afford to read them. ")


def prompt_ids(folder: Path, length: int) -> list[int]:
    """``length`` ids of plain English prose from the folder's own tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids: list[int] = []
    while len(ids) < length:
        ids += tok(PROMPT_TEXT)["input_ids"]
    return ids[:length]


def native(folder: Path, ids: list[int], gen_len: int, threads: int) -> dict:
    """Native onnxruntime on the folder's decoder: prefill, then greedy steps."""
    import numpy as np

    from pit_deploy.runtime.standalone import OrtDecoder
    from pit_deploy.targets.onnx import decoder_file

    start = time.perf_counter()
    dec = OrtDecoder(decoder_file(folder), threads)
    load = time.perf_counter() - start
    t0 = time.perf_counter()
    logits = dec.prefill(np.asarray(ids, dtype=np.int64))
    prefill = time.perf_counter() - t0
    token, steps = int(logits[-1].argmax()), []
    for j in range(gen_len - 1):
        t0 = time.perf_counter()
        token = int(dec.step(token, len(ids) + j).argmax())
        steps.append(time.perf_counter() - t0)
    dec.close()
    return {"load_ms": load * 1e3, "prefill_ms": prefill * 1e3,
            "decode_ms_per_token": statistics.mean(steps) * 1e3 if steps else None}


def web(client: str, folder: Path, ids: list[int], gen_len: int, threads: int) -> dict:
    from pit_deploy.runtime.web_clients import WebClientFailed, run_web_client

    try:
        run = run_web_client(client, folder, [ids], gen_len, threads=threads)
    except WebClientFailed as exc:
        return {"error": str(exc)}
    return {"load_ms": run.load_ms, "prefill_ms": run.prefill_ms, "decode_ms_per_token": run.decode_ms_per_token,
            "dtype": run.dtype, "versions": run.versions, "wall_s": run.wall_s}


def folder_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name != "interface.onnx") / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="onnx target artifact folders")
    parser.add_argument("--clients", default="node,chromium")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "web_decode.json"))
    args = parser.parse_args(argv)
    clients = [c for c in args.clients.split(",") if c]
    engines = ["onnxruntime"] + clients
    ids = prompt_ids(args.folders[0], args.prompt_len)
    runs: dict[str, dict[str, list[dict]]] = {str(f): {e: [] for e in engines} for f in args.folders}
    for r in range(args.rounds):
        for folder in args.folders:
            for engine in engines:
                print(f"round {r + 1}: {folder.name} on {engine}", file=sys.stderr)
                row = (native(folder, ids, args.gen_len, args.threads) if engine == "onnxruntime"
                       else web(engine, folder, ids, args.gen_len, args.threads))
                runs[str(folder)][engine].append(row)
    table = []
    for folder in args.folders:
        for engine in engines:
            rows = runs[str(folder)][engine]
            ok = [x for x in rows if "error" not in x and x.get("decode_ms_per_token")]
            entry = {"folder": folder.name, "engine": engine, "size_mb": round(folder_mb(folder), 1)}
            if ok:
                entry["decode_ms_per_token"] = round(statistics.median(x["decode_ms_per_token"] for x in ok), 2)
                entry["prefill_ms"] = round(statistics.median(x["prefill_ms"] for x in ok), 1)
            else:
                entry["error"] = next((x["error"] for x in rows if "error" in x), "no decode measured")
            table.append(entry)
    for entry in table:
        native_ms = next((e.get("decode_ms_per_token") for e in table
                          if e["folder"] == entry["folder"] and e["engine"] == "onnxruntime"), None)
        if entry.get("decode_ms_per_token") and native_ms:
            entry["vs_native"] = round(entry["decode_ms_per_token"] / native_ms, 2)
    result = {"prompt_len": args.prompt_len, "gen_len": args.gen_len, "threads": args.threads,
              "rounds": args.rounds, "table": table, "runs": runs}
    for entry in table:
        print(entry)
    return write_result(args.out, result, __file__, argv)


if __name__ == "__main__":
    sys.exit(main())

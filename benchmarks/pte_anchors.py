"""Our int4 ``.pte`` in ExecuTorch's stock runner against the int4 builds a user would pick instead:
llama.cpp Q4_0 (through llama-cpp-python) and onnxruntime-genai's model builder int4, all made from
the same source model on this machine and timed side by side in one run.

Why: a phone or edge app that ships int4 chooses between these. This says where the ``.pte``
stands on decode and prefill speed, peak memory and size, at 1 and 2 threads, on the same prompt.

Artifacts (each timed in its own child process, so load and peak RSS are its own; rounds
interleaved; medians):

* ``llama.cpp-Q4_0`` — the source GGUF requantized to Q4_0 by llama.cpp's own quantizer
  (``llama_cpp.llama_model_quantize``; the default model ships as Q4_1, so the Q4_0 file is
  requantized from it, which changes its quality, not its size or speed); ``Llama(...)`` with
  ``n_threads = n_threads_batch = T``, ``n_ctx`` prompt + generated, ``Llama.generate`` greedy
  (``top_k=1``, ``temp=0``): prefill = the prompt's eval plus the first token, decode = the mean
  interval between the following tokens;
* ``genai-builder-int4`` — ``onnxruntime_genai.models.builder`` int4 of the source
  (``genai_side_by_side.py``'s build and timing);
* ``ours-pte-<scheme>`` — ``executorch-factorized-<scheme>`` of ``--ours`` in ExecuTorch's stock
  ``TextLLMRunner`` (its own tokenizer and decode loop, its ``Stats``), prompt = the same ids
  decoded to text;
* ``ours-genai-<label>`` — one of our onnx-genai folders (``--genai``), timed as the builder's is.

Memory: ``peak_rss_mb`` is the child's ``VmHWM`` (MiB); ``baseline_rss_mb`` its ``VmRSS`` once
the runtime is imported and before the model loads (for the stock runner that includes PyTorch,
which ExecuTorch's Python bindings import). ``above_baseline_over_file`` is what loading and
running add, over the model's files: the figure a memory budget on a phone is about.

Usage::

    python benchmarks/pte_anchors.py --ours EXPORT_DIR [--schemes int4-shared,int4] [--pte LABEL=FOLDER ...]
        [--genai LABEL=FOLDER ...]
        [--model default]
        [--work bench_work/pte_anchors] [--threads 1,2] [--rounds 3] [--prompt-len 64] [--gen-len 128]
        [--out benchmarks/results/pte_anchors.json]

llama-cpp-python must be installed (``bash scripts/setup_llama_cpp.sh`` builds it from its sdist);
without it the llama.cpp rows are left out and the result says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from genai_side_by_side import _peak_rss_mb, _rss_mb, builder_folders, prompt_ids  # noqa: E402
from genai_side_by_side import measure as measure_genai  # noqa: E402
from pit_deploy.io.result_file import write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _llama_child(path: str, threads: int, prompt: list[int], gen_len: int) -> dict:
    """Runs in the child process: load the GGUF with llama-cpp-python and time greedy generation."""
    import resource

    from llama_cpp import Llama

    baseline = _rss_mb()
    t0 = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=len(prompt) + gen_len + 8, n_threads=threads, n_threads_batch=threads,
                n_batch=max(len(prompt), 8), verbose=False)
    load_s = time.perf_counter() - t0
    stamps, tokens = [time.perf_counter()], []
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        stamps.append(time.perf_counter())
        tokens.append(int(token))
        if len(tokens) == gen_len:
            break
    steps = [b - a for a, b in zip(stamps[1:], stamps[2:])]
    return {"load_s": load_s, "prefill_ms": 1e3 * (stamps[1] - stamps[0]),
            "decode_ms_per_token": 1e3 * sum(steps) / max(len(steps), 1),
            "peak_rss_mb": _peak_rss_mb(resource), "baseline_rss_mb": baseline, "tokens": tokens}


def _runner_child(folder: str, threads: int, prompt_text: str, gen_len: int) -> dict:
    """Runs in the child process: the stock runner on ``folder``, one warm-up and one timed pass."""
    import resource

    from executorch.extension.llm.runner import TextLLMRunner  # noqa: F401  (the runtime, for the baseline)

    from pit_deploy.targets.executorch.llm_runner import generate_in_process, pass_figures
    from pit_deploy.runtime.standalone import load_llm_custom_ops, pte_data_file

    load_llm_custom_ops()
    baseline = _rss_mb()
    pte = str(Path(folder) / "model.pte")
    t0 = time.perf_counter()
    out = generate_in_process(pte, str(Path(folder) / "tokenizer.json"), [prompt_text], gen_len, threads=threads,
                              reps=2)[0]
    figures = pass_figures(out["runs"][-1])  # the warm-up pass is out["runs"][0]
    return {"load_and_run_s": time.perf_counter() - t0, "prompt_tokens": figures["prompt_tokens"],
            "prefill_ms": 1e3 * figures["prompt_tokens"] / figures["prefill_tok_s"],
            # from the rate: NaN, not 0, when the decode loop ran below the runner's clock resolution
            "decode_ms_per_token": 1e3 / figures["decode_tok_s"],
            "peak_rss_mb": _peak_rss_mb(resource), "baseline_rss_mb": baseline, "text": out["text"],
            "data_file": pte_data_file(pte) is not None}


def _in_child(kind: str, target: str, threads: int, prompt: object, gen_len: int) -> dict:
    args = [sys.executable, __file__, "--child", kind, "--child-target", target, "--child-threads", str(threads),
            "--child-prompt", json.dumps(prompt), "--gen-len", str(gen_len)]
    proc = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        sys.exit(f"timing {target} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def llama_q4_0(work: Path, source: str | None) -> tuple[Path | None, float | None, str | None]:
    """The source GGUF requantized to Q4_0 by llama.cpp (cached in ``work``); ``(None, None, why)``
    without llama-cpp-python or a GGUF of the source."""
    if source is None:
        return None, None, "llama.cpp Q4_0: no GGUF of the source (--gguf; the default model's is found by itself)"
    try:
        import llama_cpp
    except ImportError:
        return None, None, "llama.cpp Q4_0: llama-cpp-python is not installed (bash scripts/setup_llama_cpp.sh)"

    out = work / "llama.cpp-Q4_0.gguf"
    if out.is_file():
        return out, None, None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True
    t0 = time.perf_counter()
    status = llama_cpp.llama_model_quantize(source.encode(), str(out).encode(), params)
    if status != 0:
        sys.exit(f"llama_model_quantize failed with status {status}")
    return out, time.perf_counter() - t0, None


#: the files that hold a model (not its tokenizer or configuration)
MODEL_SUFFIXES = (".pte", ".ptd", ".onnx", ".data", ".gguf")


def size_mb(target: Path) -> float:
    files = [target] if target.is_file() else [p for p in target.iterdir() if p.is_file()]
    return sum(p.stat().st_size for p in files if p.suffix in MODEL_SUFFIXES) / 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ours", help="a pit-deploy export directory with executorch-factorized-<scheme> folders")
    parser.add_argument("--schemes", default="int4-shared,int4")
    parser.add_argument("--pte", action="append", default=[], metavar="LABEL=FOLDER",
                        help="one more .pte folder to time, under the row name ours-pte-LABEL (repeatable): e.g. an "
                             "export made with other settings")
    parser.add_argument("--genai", action="append", default=[], metavar="LABEL=FOLDER",
                        help="one of our onnx-genai folders to time too, under the row name ours-genai-LABEL "
                             "(repeatable): e.g. the default run's onnx-genai-factorized-int4")
    parser.add_argument("--model", default="default")
    parser.add_argument("--gguf", help="the source as a GGUF file for the llama.cpp anchor (default: the default "
                                       "model's own file when --model is default)")
    parser.add_argument("--work", default="bench_work/pte_anchors")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--out", default=str(RESULTS / "pte_anchors.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-target", help=argparse.SUPPRESS)
    parser.add_argument("--child-threads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-prompt", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        prompt = json.loads(args.child_prompt)
        child = {"llama": _llama_child, "runner": _runner_child}[args.child]
        print(json.dumps(child(args.child_target, args.child_threads, prompt, args.gen_len)))
        return 0
    if not args.ours:
        parser.error("--ours EXPORT_DIR is required (pit-deploy export MODEL --runtime executorch "
                     "--mode factorized --dtype int4-shared,int4)")

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ours = Path(args.ours)
    pte_folders = {f"ours-pte-{s}": ours / f"executorch-factorized-{s}" for s in args.schemes.split(",") if s}
    for item in args.pte:
        label, _, folder = item.partition("=")
        if not label or not folder:
            parser.error(f"--pte takes LABEL=FOLDER, got {item!r}")
        pte_folders[f"ours-pte-{label}"] = Path(folder)
    genai_folders = {}
    for item in args.genai:
        label, _, folder = item.partition("=")
        if not label or not folder:
            parser.error(f"--genai takes LABEL=FOLDER, got {item!r}")
        if not (Path(folder) / "genai_config.json").is_file():
            parser.error(f"--genai {item}: {folder} is no onnx-genai folder (no genai_config.json)")
        genai_folders[f"ours-genai-{label}"] = Path(folder)
    for name, folder in pte_folders.items():
        if not (folder / "model.pte").is_file():
            sys.exit(f"{name}: no {folder / 'model.pte'}; export it with `pit-deploy export MODEL --runtime executorch "
                     f"--mode factorized --dtype {args.schemes}`")
    builders, build_s, tokenizer, vocab = builder_folders(args.model, work, {"block_size": "32", "is_symmetric": "true",
                                                                           "accuracy_level": "4"})
    source_gguf = args.gguf
    if source_gguf is None and args.model == "default":
        from pit_deploy.io.sources import default_gguf_path

        source_gguf = str(default_gguf_path())
    gguf, quantize_s, missing = llama_q4_0(work, source_gguf)
    prompt = prompt_ids(tokenizer, vocab, args.prompt_len)
    prompt_text = tokenizer.decode(prompt)
    threads = [int(t) for t in args.threads.split(",")]
    artifacts: dict[str, tuple[str, Path]] = {name: ("runner", folder) for name, folder in pte_folders.items()}
    artifacts.update({name: ("genai", folder) for name, folder in genai_folders.items()})
    if gguf is not None:
        artifacts["llama.cpp-Q4_0"] = ("llama", gguf)
    artifacts["genai-builder-int4"] = ("genai", builders["builder-int4"])

    runs = []
    for r in range(args.rounds):
        for t in threads:
            for name, (kind, target) in artifacts.items():
                if kind == "genai":
                    got = measure_genai(target, t, prompt, args.gen_len)
                else:
                    got = _in_child(kind, str(target), t, prompt_text if kind == "runner" else prompt, args.gen_len)
                print(f"round {r + 1} threads {t} {name}: prefill {got['prefill_ms']:.1f} ms, decode "
                      f"{got['decode_ms_per_token']:.2f} ms/token, peak RSS {got['peak_rss_mb']:.0f} MB", flush=True)
                runs.append({"round": r + 1, "threads": t, "artifact": name,
                             **{k: v for k, v in got.items() if k not in ("tokens", "text")}})
    rows = []
    for t in threads:
        for name, (kind, target) in artifacts.items():
            mine = [x for x in runs if x["threads"] == t and x["artifact"] == name]
            row = {"artifact": name, "threads": t, "size_mb": size_mb(target), "rounds": len(mine)}
            for key in ("prefill_ms", "decode_ms_per_token", "peak_rss_mb"):
                row[key] = statistics.median(x[key] for x in mine)
            row["decode_tok_s"] = 1e3 / row["decode_ms_per_token"]
            baselines = [x["baseline_rss_mb"] for x in mine if x.get("baseline_rss_mb") is not None]
            if baselines:  # the memory figure: what loading and running adds, over the file
                row["baseline_rss_mb"] = statistics.median(baselines)
                row["above_baseline_mb"] = row["peak_rss_mb"] - row["baseline_rss_mb"]
                row["above_baseline_over_file"] = row["above_baseline_mb"] * 2 ** 20 / (row["size_mb"] * 1e6)
            rows.append(row)
    ratios = []
    peers = [n for n in artifacts if not n.startswith("ours-")]
    for t in threads:
        for name in (*pte_folders, *genai_folders):
            mine = next(r for r in rows if r["threads"] == t and r["artifact"] == name)
            for peer in peers:
                other = next(r for r in rows if r["threads"] == t and r["artifact"] == peer)
                ratios.append({"artifact": name, "peer": peer, "threads": t,
                               **{f"ours_over_peer_{k}": mine[k] / other[k]
                                  for k in ("decode_ms_per_token", "prefill_ms", "peak_rss_mb", "size_mb")}})
    result = {"model": args.model, "ours": str(ours), "prompt_len": args.prompt_len, "gen_len": args.gen_len,
              "rounds": args.rounds, "threads": threads, "peers_missing": [missing] if missing else [],
              "timing": "each artifact in its own child process per round, rounds interleaved; medians",
              "builder_s": build_s, "quantize_s": quantize_s, "rows": rows, "ratios": ratios, "runs": runs}
    for r in rows:
        over = f"  ({r['above_baseline_over_file']:.2f}× the file above the runtime)" if "above_baseline_over_file" in r else ""
        print(f"{r['artifact']:22s} t={r['threads']} prefill {r['prefill_ms']:7.1f} ms  decode "
              f"{r['decode_ms_per_token']:6.2f} ms/tok  RSS {r['peak_rss_mb']:6.0f} MB  size {r['size_mb']:6.1f} MB{over}")
    if missing:
        print(f"not measured: {missing}")
    return write_result(args.out, result, __file__, argv)


if __name__ == "__main__":
    sys.exit(main())

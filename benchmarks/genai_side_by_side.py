"""Our ``onnx-genai`` folders against onnxruntime-genai's own model builder run on the source
model, side by side, timed by ``onnxruntime_genai`` itself.

Why: a user who wants an onnxruntime-genai folder of the model would otherwise run
``python -m onnxruntime_genai.models.builder`` on the source checkpoint. This says what PIT's
factorized folder costs or saves against that, on the same runtime, in one run: prefill, decode,
peak memory and folder size, fp32 and int4.

Artifacts (each timed in its own child process, so load and peak RSS are its own):

* ``builder-int4`` / ``builder-fp32`` — the builder on the source model's plain Hugging Face
  checkpoint (``pit_deploy.targets.onnx_genai.export.builder_checkpoint``: the checkpoint our exporter gives the builder),
  with the block size, symmetry and accuracy level our int4 export passed (read from its
  manifest) and otherwise the builder's defaults (fused q/k/v, every body MatMul at 4 bits);
  cached in ``--work``;
* ``ours-factorized-int4`` / ``ours-factorized-int4-compact`` / ``ours-factorized-fp32`` —
  ``onnx-genai-factorized[-int4[-compact]]`` of a
  ``pit-deploy export --runtime onnx-genai --mode factorized --dtype float32,int4,int4-compact`` directory
  (``--ours``; exported into ``--work`` from ``--model`` when not given).

Each child: ``og.Config(folder)`` with the overlay
``{"model": {"decoder": {"session_options": {"intra_op_num_threads": T, "inter_op_num_threads": 1}}}}``,
``og.Model(config)``, a greedy generator (``min_length = max_length`` so an end-of-sequence
token does not stop it early) fed the same ``--prompt-len`` prompt ids for every artifact;
prefill = ``append_tokens(prompt)`` plus the first ``generate_next_token()`` (which only
selects the token: the logits came with ``append_tokens``), decode = the mean of the other
``--gen-len − 1`` calls (each one forward step); peak RSS from the child's ``VmHWM`` (``resource.getrusage`` where there is none; see
:func:`_peak_rss_mb`). Rounds are
interleaved (round r runs every artifact at every thread count before round r + 1) and the result
keeps every round plus the medians.

Usage::

    python benchmarks/genai_side_by_side.py [--model default] [--ours EXPORT_DIR]
        [--folder NAME=PATH ...] [--only-folders]
        [--work bench_work/genai] [--threads 1,2] [--rounds 3] [--prompt-len 64] [--gen-len 128]
        [--out benchmarks/results/genai_side_by_side.json]
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

from pit_deploy.io.result_file import write_result

ROOT = Path(__file__).resolve().parents[1]
#: our int4 schemes, each against the builder's int4: ``int4`` (8-bit table and v/down
#: projections) and ``int4-compact`` (4-bit table, v_proj at 8 bits; pit_deploy/schemes.py)
OUR_INT4 = ("int4", "int4-compact")
RESULTS = ROOT / "benchmarks" / "results"
PROMPT_TEXT = ("The history of the printing press begins in the fifteenth century, when movable type changed "
               "how books were made, how ideas travelled between cities, and who could afford to read them. ")


def _child(folder: str, threads: int, prompt: list[int], gen_len: int) -> dict:
    """Runs in the child process: load ``folder`` with ``onnxruntime_genai`` and time it."""
    import resource

    import numpy as np
    import onnxruntime_genai as og

    baseline = _rss_mb()  # the runtime imported, nothing loaded
    t0 = time.perf_counter()
    config = og.Config(folder)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)
    load_s = time.perf_counter() - t0
    total = len(prompt) + gen_len
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=total, min_length=total, do_sample=False)
    generator = og.Generator(model, params)
    t0 = time.perf_counter()
    generator.append_tokens(np.asarray([prompt], dtype=np.int32))
    generator.generate_next_token()
    prefill_s = time.perf_counter() - t0
    steps = []
    for _ in range(gen_len - 1):
        t = time.perf_counter()
        generator.generate_next_token()
        steps.append(time.perf_counter() - t)
    tokens = [int(x) for x in generator.get_sequence(0)[len(prompt):]]
    return {"load_s": load_s, "prefill_ms": 1e3 * prefill_s,
            "decode_ms_per_token": 1e3 * sum(steps) / max(len(steps), 1),
            "decode_ms_p50": 1e3 * statistics.median(steps) if steps else None,
            "peak_rss_mb": _peak_rss_mb(resource), "baseline_rss_mb": baseline, "tokens": tokens}


def _status_mib(key: str) -> float | None:
    """One of this process's ``/proc/self/status`` memory fields in MiB; ``None`` off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _rss_mb() -> float | None:
    """This process's resident memory now (``VmRSS``): taken once the runtime is imported and
    before the model loads, the runtime's own baseline."""
    return _status_mib("VmRSS")


def _peak_rss_mb(resource) -> float:
    """This process's peak RSS: ``VmHWM`` where Linux gives it, else ``getrusage``'s
    ``ru_maxrss``. Linux keeps ``ru_maxrss`` across ``fork`` + ``exec``, so a child started by
    a parent holding the source model reported the parent's peak (1007 MB for every folder of
    the default model); ``VmHWM`` belongs to the new address space."""
    peak = _status_mib("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(folder: Path, threads: int, prompt: list[int], gen_len: int) -> dict:
    """:func:`_child` in a fresh interpreter."""
    args = [sys.executable, __file__, "--child", str(folder), "--child-threads", str(threads),
            "--child-prompt", json.dumps(prompt), "--gen-len", str(gen_len)]
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"timing {folder} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def folder_size(folder: Path) -> dict:
    files = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
    model = sum(files.get(n, 0) for n in ("model.onnx", "model.onnx.data"))
    return {"folder_mb": sum(files.values()) / 1e6, "model_files_mb": model / 1e6}


def pit_deploy(*args: str) -> float:
    """Run ``pit-deploy`` (this interpreter's); stop on failure; return its wall time."""
    print("$ pit-deploy " + " ".join(args), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pit_deploy.cli", *args], text=True, capture_output=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        sys.exit(f"pit-deploy {args[0]} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def builder_folders(model: str, work: Path, extra: dict[str, str]) -> tuple[dict[str, Path], dict, object, int]:
    """The builder's int4 and fp32 folders of the source ``model`` (cached in ``work``), the
    seconds each build took (``None`` when cached), the source's tokenizer and vocabulary size."""
    from pit_deploy.targets.onnx_genai.export import builder_checkpoint, run_builder
    from pit_deploy.io.sources import load_source

    loaded = load_source(model)
    hf = work / "source-hf"
    if not (hf / "config.json").is_file():
        builder_checkpoint(loaded.model, loaded.tokenizer, hf)
    folders, seconds = {}, {}
    for precision in ("int4", "fp32"):
        out = work / f"builder-{precision}"
        seconds[precision] = None
        if not (out / "genai_config.json").is_file():
            t0 = time.perf_counter()
            run_builder(hf, out, precision, work / "builder-cache", extra if precision == "int4" else None)
            seconds[precision] = time.perf_counter() - t0
        folders[f"builder-{precision}"] = out
    return folders, seconds, loaded.tokenizer, int(loaded.model.config.vocab_size)


def _named_folder(spec: str) -> tuple[str, Path]:
    """``NAME=PATH`` of ``--folder``."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        sys.exit(f"error: --folder takes NAME=PATH, got {spec!r}")
    return name, Path(path)


def _is_quantized(folder: Path) -> bool:
    """Whether an onnx-genai folder's decoder holds ``MatMulNBits`` (the builder's int4/int8)."""
    import onnx

    decoder = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    return any(n.op_type == "MatMulNBits" for n in decoder.graph.node)


def prompt_ids(tokenizer, vocab: int, length: int) -> list[int]:
    if tokenizer is not None:
        text, ids = PROMPT_TEXT, []
        while len(ids) < length:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            text += PROMPT_TEXT
        return [int(i) for i in ids[:length]]
    import random

    rng = random.Random(0)
    return [rng.randrange(vocab) for _ in range(length)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="the source model (anything pit-deploy export takes)")
    parser.add_argument("--ours", help="a pit-deploy export directory with onnx-genai-factorized[-int4] "
                                       "(default: exported into --work from --model)")
    parser.add_argument("--work", default="bench_work/genai")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--folder", action="append", default=[], metavar="NAME=PATH",
                        help="time this onnx-genai folder of ours too, under NAME (repeatable; int4 folders are "
                             "compared with the builder's int4, the others with its fp32)")
    parser.add_argument("--only-folders", action="store_true",
                        help="time the --folder ones and the builder's, not the --ours directory's")
    parser.add_argument("--out", default=str(RESULTS / "genai_side_by_side.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-threads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-prompt", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.child_threads, json.loads(args.child_prompt), args.gen_len)))
        return 0

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    extra_folders = dict(_named_folder(spec) for spec in args.folder)
    if args.only_folders and not extra_folders:
        parser.error("--only-folders needs at least one --folder")
    ours = Path(args.ours) if args.ours else work / "ours"
    if args.only_folders:
        ours = next(iter(extra_folders.values())).parent
    export_s = None
    if not (ours / "manifest.json").is_file():
        export_s = pit_deploy("export", args.model, "--runtime", "onnx-genai", "--mode", "factorized",
                              "--dtype", ",".join(("float32", *OUR_INT4)), "--out", str(ours))
    manifest = json.loads((ours / "manifest.json").read_text())
    ours_int4 = ours / "onnx-genai-factorized-int4"
    ours_extra = next((a.get("details", {}).get("builder_extra_options") for a in manifest.get("artifacts", [])
                       if a.get("path") == ours_int4.name), None) or {}
    # the builder as a user runs it: our block size, symmetry and accuracy level, nothing more
    # (not our fuse_qkv=false and int8 overrides, which keep the scheme's 8-bit layers)
    extra = {k: v for k, v in ours_extra.items() if k in ("block_size", "accuracy_level", "is_symmetric")}
    builders, build_s, tokenizer, vocab = builder_folders(args.model, work, extra)
    if args.only_folders:  # the builder's fp32 only where one of the folders is fp32
        artifacts = {"builder-int4": builders["builder-int4"]}
        if not all(_is_quantized(folder) for folder in extra_folders.values()):
            artifacts["builder-fp32"] = builders["builder-fp32"]
    else:
        artifacts = {"builder-int4": builders["builder-int4"],
                     **{f"ours-factorized-{s}": ours / f"onnx-genai-factorized-{s}" for s in OUR_INT4},
                     "builder-fp32": builders["builder-fp32"], "ours-factorized-fp32": ours / "onnx-genai-factorized"}
    artifacts.update({f"ours-{name}": folder for name, folder in extra_folders.items()})
    # each of ours against the builder's build of the same precision
    peers = {name: "builder-int4" if _is_quantized(folder) else "builder-fp32" for name, folder in artifacts.items()}
    for name, folder in artifacts.items():
        if not (folder / "genai_config.json").is_file():
            sys.exit(f"{name}: {folder} is not an onnxruntime-genai folder; export --ours with `pit-deploy export "
                     f"MODEL --runtime onnx-genai --mode factorized --dtype {','.join(('float32', *OUR_INT4))}`")
    prompt = prompt_ids(tokenizer, vocab, args.prompt_len)
    threads = [int(t) for t in args.threads.split(",")]

    runs = []
    for r in range(args.rounds):
        for t in threads:
            for name, folder in artifacts.items():
                got = measure(folder, t, prompt, args.gen_len)
                print(f"round {r + 1} threads {t} {name}: prefill {got['prefill_ms']:.1f} ms, decode "
                      f"{got['decode_ms_per_token']:.2f} ms/token, peak RSS {got['peak_rss_mb']:.0f} MB", flush=True)
                runs.append({"round": r + 1, "threads": t, "artifact": name, **got})

    rows = []
    for t in threads:
        for name, folder in artifacts.items():
            mine = [x for x in runs if x["threads"] == t and x["artifact"] == name]
            row = {"artifact": name, "threads": t, "folder": folder.name, "rounds": len(mine), **folder_size(folder)}
            for key in ("prefill_ms", "decode_ms_per_token", "decode_ms_p50", "peak_rss_mb", "load_s"):
                row[key] = statistics.median(x[key] for x in mine)
            row["decode_tok_s"] = 1e3 / row["decode_ms_per_token"]
            peer = next(x for x in runs if x["threads"] == t and x["artifact"] == peers[name])
            same = [a == b for a, b in zip(mine[0]["tokens"], peer["tokens"])]
            row["greedy_tokens_equal_to_builder"] = (same.index(False) if False in same else len(same))
            rows.append(row)
    ratios = []
    for t in threads:
        for name in (n for n in artifacts if n.startswith("ours-")):
            ours_row = next(r for r in rows if r["threads"] == t and r["artifact"] == name)
            peer = next(r for r in rows if r["threads"] == t and r["artifact"] == peers[name])
            ratios.append({"artifact": name, "peer": peers[name], "threads": t, **{f"ours_over_builder_{k}": ours_row[k] / peer[k] for k in (
                "prefill_ms", "decode_ms_per_token", "peak_rss_mb", "folder_mb", "model_files_mb")}})
    result = {"model": args.model, "ours": str(ours), "prompt_len": args.prompt_len, "gen_len": args.gen_len,
              "rounds": args.rounds, "threads": threads, "builder_extra_options_int4": extra,
              "timing": "onnxruntime_genai Generator in a child process per artifact, rounds interleaved; medians",
              "export_s": export_s, "builder_s": build_s, "rows": rows, "ratios": ratios,
              "runs": [{k: v for k, v in x.items() if k != "tokens"} for x in runs]}
    for r in rows:
        print(f"{r['artifact']:22s} t={r['threads']} prefill {r['prefill_ms']:8.1f} ms  decode "
              f"{r['decode_ms_per_token']:6.2f} ms/tok  RSS {r['peak_rss_mb']:6.0f} MB  folder {r['folder_mb']:6.1f} MB")
    return write_result(args.out, result, __file__, argv)


if __name__ == "__main__":
    sys.exit(main())

"""What each ``pit-deploy`` command costs on one model: wall time, peak memory and output size of
``convert``, then ``export`` and ``verify`` per target, each run as a user runs it (a fresh
process), with the model's fp32 size beside them.

Why: a large vocabulary (Gemma 3's 262,144 tokens, Phi-4-mini's 200,064) makes the token table
most of a small model, and a command that holds a few extra copies of it (a float64 buffer, a
second table, a dense copy of a quantized one) needs many times the model's size in memory —
on a phone developer's laptop, a CI runner or a 2-core box, that is the difference between a
tool that runs and one that is killed. The figures here say how many times the model's fp32
size each command peaks at.

Peak memory is the largest resident set of the command's process tree (``wait4``'s
``ru_maxrss``: the command's process or any process it started and waited for), not a sum.
Each command runs with the GPTQ codes cache off (``PIT_DEPLOY_CACHE=off``): a second run of the
same model would otherwise read the body's codes instead of computing them.

Usage::

    python benchmarks/command_cost.py (--model DIR | --random-model gemma3-270m)
        [--runtime onnx,onnx-genai,executorch]
        [--dtype float32,int4] [--convert-arg=--accept-loss ...] [--export-arg ...]
        [--work DIR] [--out benchmarks/results/command_cost.json]

``--model`` is a plain Hugging Face directory (converted first, ``convert``'s defaults plus the
``--convert-arg`` flags) or a PIT checkpoint (used as it is). ``--random-model NAME`` instead
builds a model of a known architecture at its real size with random weights (and a tokenizer
whose text lands on ids across the whole vocabulary) in ``--work``: what a command costs
depends on the shapes, not on the weights, so the cost of a model you do not have on disk can
be measured (``gemma3-270m``: Gemma 3 270M's configuration, 262,144 tokens; ``gemma3-tiny``: the
same structure at a test size).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pit_deploy.io.result_file import write_result


def run_command(argv: list[str], log: Path) -> dict[str, Any]:
    """``pit-deploy ARGV`` in a fresh process: exit code, wall seconds, peak RSS (MiB) of its
    process tree, the last lines of its output (kept in ``log``)."""
    start = time.perf_counter()
    with log.open("w", encoding="utf-8") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "pit_deploy", *argv], stdout=sink, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "PIT_DEPLOY_CACHE": "off"})
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-3:]
    print(f"  pit-deploy {' '.join(argv[:1])}: exit {proc.returncode}, {seconds:.0f} s, "
          f"{usage.ru_maxrss / 1024:.0f} MiB peak", flush=True)
    return {"argv": argv, "exit_code": proc.returncode, "seconds": round(seconds, 1),
            "peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "output_tail": tail}


def folder_mib(path: Path) -> float | None:
    if not path.exists():
        return None
    return round(sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20, 1)


#: ``--random-model`` configurations: Gemma 3 270M as published (``gemma3_text``: 18 layers, five
#: sliding-window layers to one global, 262,144 tokens), and the same structure at a test size
_GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]
RANDOM_MODELS: dict[str, dict[str, Any]] = {
    "gemma3-270m": dict(vocab_size=262_144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                        layer_types=_GEMMA3_LAYERS * 3, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                        query_pre_attn_scalar=256, max_position_embeddings=32_768),
    "gemma3-tiny": dict(vocab_size=70_000, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=16,
                        layer_types=_GEMMA3_LAYERS, query_pre_attn_scalar=32, max_position_embeddings=512),
}


def random_model(name: str, out: Path) -> Path:
    """Write the ``--random-model`` ``name`` to ``out`` (seeded; norm gains drawn around 1 as a
    trained model's are, not left at the initial value); returns ``out``."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from pit_deploy.io.checkpoint import save_model
    from pit_deploy.tiny import tiny_tokenizer

    config = Gemma3TextConfig(**RANDOM_MODELS[name], tie_word_embeddings=True, architectures=["Gemma3ForCausalLM"])
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
    save_model(model, out, tiny_tokenizer(spread_to=config.vocab_size))
    return out


def model_facts(model: Path) -> dict[str, Any]:
    """Parameter count (from the safetensors headers, no load) and the model's fp32 size."""
    from safetensors import safe_open

    params = 0
    for file in sorted(model.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():
                shape = handle.get_slice(name).get_shape()
                count = 1
                for dim in shape:
                    count *= dim
                params += count
    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config", config)
    return {"model_type": text.get("model_type"), "vocab_size": text.get("vocab_size"),
            "hidden_size": text.get("hidden_size"), "parameters": params,
            "fp32_mib": round(params * 4 / 2**20, 1), "is_pit": "pit" in config}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="a plain HF directory or a PIT checkpoint")
    source.add_argument("--random-model", choices=sorted(RANDOM_MODELS),
                        help="a model of this architecture at its real size with random weights, built in --work")
    parser.add_argument("--runtime", default="onnx,onnx-genai,executorch", help="comma list of targets")
    parser.add_argument("--dtype", default="float32,int4", help="the export schemes, one export per target")
    parser.add_argument("--mode", default="factorized")
    parser.add_argument("--recipe", default=None, help="export recipe (default: export's own defaults)")
    parser.add_argument("--convert-arg", action="append", default=[], help="an extra flag for convert (repeat)")
    parser.add_argument("--export-arg", action="append", default=[], help="an extra flag for export (repeat)")
    parser.add_argument("--work", type=Path, default=None, help="where the outputs go (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/command_cost.json"))
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)

    work = args.work or Path(tempfile.mkdtemp(prefix="command-cost-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.random_model:
        shutil.rmtree(work / "source", ignore_errors=True)  # built by this script: made again
        args.model = random_model(args.random_model, work / "source")
    facts = model_facts(args.model)
    facts["weights"] = f"random ({args.random_model})" if args.random_model else "as given"
    rows: list[dict[str, Any]] = []

    def record(command: str, target: str | None, argv: list[str], out: Path | None) -> dict[str, Any]:
        row = {"command": command, "target": target,
               **run_command(argv, work / f"{command}-{target or 'model'}.log")}
        row["output_mib"] = folder_mib(out) if out is not None else None
        row["peak_over_fp32"] = round(row["peak_rss_mib"] / facts["fp32_mib"], 2) if facts["fp32_mib"] else None
        rows.append(row)
        return row

    model = args.model
    if not facts["is_pit"]:
        pit = work / "pit"
        shutil.rmtree(pit, ignore_errors=True)
        if record("convert", None, ["convert", "--model", str(args.model), "--out", str(pit), *args.convert_arg],
                  pit)["exit_code"] != 0:
            return _write(args, facts, rows, complete=False)
        model = pit
    recipe = ["--recipe", args.recipe] if args.recipe else []
    for target in [t.strip() for t in args.runtime.split(",") if t.strip()]:
        out = work / f"export-{target}"
        shutil.rmtree(out, ignore_errors=True)
        exported = record("export", target, ["export", str(model), "--out", str(out), "--runtime", target,
                                             "--mode", args.mode, "--dtype", args.dtype, *recipe, *args.export_arg],
                          out)
        if exported["exit_code"] == 0:
            record("verify", target, ["verify", str(out)], None)
    complete = all(r["exit_code"] == 0 for r in rows)
    return _write(args, facts, rows, complete)


def _write(args: argparse.Namespace, facts: dict[str, Any], rows: list[dict[str, Any]], complete: bool) -> int:
    worst = max((r["peak_rss_mib"] for r in rows), default=None)
    result = {"model": facts, "rows": rows, "complete": complete,
              "settings": {"runtime": args.runtime, "dtype": args.dtype, "mode": args.mode, "recipe": args.recipe,
                           "convert_args": args.convert_arg, "export_args": args.export_arg,
                           "gptq_codes_cache": "off"},
              "peak_rss_mib": worst,
              "peak_over_fp32": round(worst / facts["fp32_mib"], 2) if worst and facts["fp32_mib"] else None,
              "machine": {"cpu_count": os.cpu_count()}}
    write_result(args.out, result, __file__, argv=args.argv)
    return 0 if complete else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Where the time of ``pit-deploy run`` goes: each stage, and inside export each GPTQ grid and
each artifact; and how long the command line takes to answer ``--help`` and ``list``.

Why: the default run is a newcomer's first contact and the loop a developer waits on; a stage
that grows unnoticed makes both worse. This script runs the pipeline once as a user would, in a
child process, and reads the time of every part from what the run itself records and prints:

* ``stages``: each stage's seconds and status from its ``stage.json``;
* ``parts``: the progress lines that carry a time of their own (GPTQ rounding of a grid, each
  artifact's export, each training step line), with the run's wall clock when they were printed;
* ``gptq_cache``: ``cold`` (the default: the run computes its GPTQ codes, with a cache of its
  own that shares only the converted default model) or ``warm`` (``--warm-gptq``: the user's
  cache, as a second export of the same checkpoint sees it);
* ``cli``: the wall time of ``pit-deploy --help`` and ``pit-deploy list`` (median of five runs
  each), which read no model.

Several labelled runs (``--label before``, ``--label after``) go into one result file with
``--merge``, so that figures from two code versions measured on one machine sit side by side;
each run records its own code version.

Usage::

    python benchmarks/pipeline_time.py [--recipe default] [--label after] [--merge] [--warm-gptq]
        [--model DIR] [--set TABLE.KEY=VALUE ...] [--out benchmarks/results/pipeline_time.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pit_deploy.io.result_file import provenance, write_result

ROOT = Path(__file__).resolve().parents[1]
#: progress lines that carry a duration of their own: (kind, pattern with a ``seconds`` group)
TIMED_LINES: tuple[tuple[str, str], ...] = (
    ("gptq", r"GPTQ rounding of the body \((?P<what>[^)]*)\) in (?P<seconds>[0-9.]+) s"),
    ("gptq-cached", r"GPTQ codes of the body \((?P<what>[^)]*)\) read from the cache \(\w+\) in (?P<seconds>[0-9.]+) s"),
    ("artifact", r"^\s*(?P<what>[\w.-]+): [0-9.]+ MiB in (?P<seconds>[0-9.]+) s"),
    ("stage", r"^(?P<what>\w+): (?:done|skipped) in (?P<seconds>[0-9.]+) s"),
)


def cli_seconds(argv: list[str], reps: int = 5) -> float:
    """Median wall seconds of ``pit-deploy ARGV`` as a fresh process (interpreter start included)."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pit_deploy", *argv], capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return round(statistics.median(times), 3)


def timed_parts(lines: list[tuple[float, str]]) -> list[dict]:
    """The progress lines that name a duration, with the run's clock when each was printed."""
    parts = []
    for at, text in lines:
        message = re.sub(r"^\[pit-deploy [0-9:]+\] ", "", text)
        for kind, pattern in TIMED_LINES:
            found = re.search(pattern, message)
            if found:
                parts.append({"kind": kind, "what": found.group("what"), "seconds": float(found.group("seconds")),
                              "at_s": round(at, 1)})
                break
    return parts


def cold_gptq_cache(scratch: Path) -> dict[str, str]:
    """The environment of a run whose GPTQ codes are computed, not read from the cache: a cache
    root of its own under ``scratch``, sharing only the user's converted GGUF files (``gguf/``),
    so the default model loads as it always does after its first use."""
    from pit_deploy.io.cache_dir import CACHE_ENV, cache_root

    root = scratch / "cache"
    root.mkdir(parents=True)
    user = cache_root()
    if user is not None and (user / "gguf").is_dir():
        (root / "gguf").symlink_to((user / "gguf").resolve(), target_is_directory=True)
    return {**os.environ, CACHE_ENV: str(root)}


def run_pipeline(recipe: str, run_dir: Path, model: str | None, overrides: list[str],
                 env: dict[str, str] | None = None) -> dict:
    """``pit-deploy run`` in a child process; its progress lines with their times, its stages."""
    cmd = [sys.executable, "-m", "pit_deploy", "run", recipe, "--out", str(run_dir)]
    if model:
        cmd += ["--model", model]
    for item in overrides:
        cmd += ["--set", item]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[tuple[float, str]] = []
    for line in proc.stdout:
        lines.append((time.perf_counter() - start, line.rstrip("\n")))
        print(line, end="", flush=True)
    code = proc.wait()
    wall = time.perf_counter() - start
    stages = {}
    for record in sorted(run_dir.glob("*/stage.json")):
        data = json.loads(record.read_text(encoding="utf-8"))
        stages[data["stage"]] = {"status": data.get("status"), "seconds": data.get("seconds")}
    return {"command": cmd[2:], "exit_code": code, "wall_s": round(wall, 1), "stages": stages,
            "parts": timed_parts(lines), "lines": [[round(at, 1), text] for at, text in lines]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="default", help="run recipe (default: default)")
    parser.add_argument("--model", default=None, help="source model (default: the recipe's)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE")
    parser.add_argument("--label", default="current", help="name of this run in the result file")
    parser.add_argument("--merge", action="store_true", help="keep the other labels already in --out")
    parser.add_argument("--run-dir", default=None, help="run directory (default: a temporary one, removed)")
    parser.add_argument("--warm-gptq", action="store_true",
                        help="let the run read GPTQ codes from the user's cache (default: compute them, "
                             "as a first export of a checkpoint does)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pipeline_time.json"))
    args = parser.parse_args(argv)

    runs: dict = {}
    out = Path(args.out)
    if args.merge and out.is_file():
        runs = json.loads(out.read_text(encoding="utf-8")).get("runs", {})
    scratch = Path(tempfile.mkdtemp(prefix="pipeline-time-"))
    run_dir = Path(args.run_dir) if args.run_dir else scratch / "run"
    try:
        result = {"cli": {"help_s": cli_seconds(["--help"]), "list_s": cli_seconds(["list"])}}
        env = None if args.warm_gptq else cold_gptq_cache(scratch)
        result.update(run_pipeline(args.recipe, run_dir, args.model, args.overrides, env))
        result["gptq_cache"] = "warm" if args.warm_gptq else "cold"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result["provenance"] = provenance(__file__, argv)
    runs[args.label] = result
    write_result(out, {"benchmark": "pipeline_time", "runs": runs}, __file__, argv)
    return 0 if result["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

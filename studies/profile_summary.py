"""Summarise a sampling profile of a ``pit-deploy`` command: inclusive seconds per function.

Reads the raw (collapsed-stack) output of ``py-spy record -f raw`` — one line per distinct stack,
``frame;frame;… count`` — and writes, for the functions whose frame matches one of the
``--match`` substrings, the seconds of samples that have the function anywhere on their stack
(each counted once per sample). Used for the `.pte` int4 export's profile in
``studies/pte-lowering.md``.

Usage::

    py-spy record -r 20 -f raw -o profile.txt -- pit-deploy export PIT_DIR --out OUT \\
        --runtime executorch --mode factorized --dtype int4
    python studies/profile_summary.py profile.txt --rate 20 --command "pit-deploy export …" \\
        --out studies/results/pte_int4_export_profile.json
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

from pit_deploy.io.result_file import write_result

ROOT = Path(__file__).resolve().parents[1]
FRAME = re.compile(r"(?P<name>.*) \((?P<file>.*?):\d+\)$")

#: frames worth naming: our own code, ExecuTorch's lowering phases, torchao's quantization operators
MATCH = ("pit_deploy/", "to_edge_transform_and_lower", "run_decompositions", "XnnpackBackend.preprocess",
         "XNNPACKPassManager.transform", "_generate_edge_program", "to_executorch", "_strict_export",
         "_choose_qparams_affine", "_quantize_affine", "_dequantize_affine", "FakeTensorMode.dispatch")


def inclusive(lines, rate: float) -> tuple[float, collections.Counter]:
    """Total seconds sampled, and seconds per ``name (file)`` with the frame anywhere on the stack."""
    seconds: collections.Counter = collections.Counter()
    total = 0.0
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        spent = int(count) / rate
        total += spent
        seen = set()
        for frame in stack.split(";"):
            m = FRAME.match(frame)
            key = f"{m['name']} ({m['file'].split('site-packages/')[-1]})" if m else frame
            if key not in seen:
                seen.add(key)
                seconds[key] += spent
    return total, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="py-spy's raw output (-f raw)")
    parser.add_argument("--rate", type=float, default=100.0, help="samples per second it was recorded at (-r)")
    parser.add_argument("--command", default="", help="the command that was profiled, for the record")
    parser.add_argument("--match", action="append", help="frame substrings to keep (default: a built-in list)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    total, seconds = inclusive(Path(args.profile).read_text().splitlines(), args.rate)
    keep = tuple(args.match or MATCH)
    frames = {k: round(v, 1) for k, v in seconds.most_common() if any(m in k for m in keep)}
    return write_result(args.out, {"profiled_command": args.command, "sampled_seconds": round(total, 1),
                                   "rate_hz": args.rate, "inclusive_seconds": frames}, __file__, argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a `.pte` program's memory goes when ExecuTorch's runtime loads and runs it.

The int4 `.pte` of the default model peaks at about 4× its file size in `pit-deploy bench`
(960 MB for a 223 MB program, 234 MB of which is the interpreter and its libraries). This study
loads one program step by step in a fresh process and reads the kernel's own accounting after
each step (``/proc/self/status``: ``VmRSS``, its split into ``RssAnon`` — memory the process
allocated — and ``RssFile`` — pages of mapped files, here the program itself when it is
memory-mapped —, and the peak ``VmHWM``):

1. the runtime imported (the baseline every bench cell also has);
2. ``Runtime.load_program(path)`` (the file opened, the flatbuffer verified; with its
   ``model.ptd`` as the data path where the folder has one, and the file size is the pair's);
3. ``load_method("forward")`` (the XNNPACK delegate initialised: weights unpacked and repacked
   into its own layout, memory planned);
4. a prefill of ``--prompt-len`` tokens;
5. ``--gen-len`` decode steps.

Each program runs in its own child process, so the figures do not mix.

``--xnnpack-weight-cache`` measures each program a second time with the XNNPACK backend's
weight cache switched on before the program loads. The 1.5.1 wheel's backend has one (packed
weights kept in one cache and looked up by the constants' names, the unpacked constants released
once packed), off by default; an application turns it on through ExecuTorch's runtime API,
``executorch::runtime::set_option("XnnpackBackend", …)`` with the bool option
``weight_cache_enabled``. The Python bindings and ``TextLLMRunner`` expose no backend options, so
the child calls that exported C++ function of ``libexecutorch.so`` through ctypes, building the
``BackendOption`` (a 64-byte key, then a ``std::variant<bool, int, std::array<char, 256>>``) as
the wheel's ``runtime/backend/options.h`` lays it out, and reads the option back to check.

Usage::

    python studies/pte_memory.py EXPORT/executorch-factorized-int4 [EXPORT/executorch-factorized ...]
        [--prompt-len 64] [--gen-len 32] [--threads 2] [--xnnpack-weight-cache]
        [--out studies/results/pte_memory.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from pit_deploy.io.result_file import write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

#: what the child runs: one program, the kernel's memory figures after each step, as JSON lines
CHILD = r"""
import json, sys, time

def status():
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = round(int(value.split()[0]) / 1024, 1)  # kB -> MB (MiB)
    return out

def mark(step, **extra):
    print(json.dumps({"step": step, **status(), **extra}), flush=True)

path, prompt_len, gen_len, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
weight_cache = sys.argv[5] == "1"
import torch
torch.set_num_threads(threads)
from executorch.runtime import Runtime
from pit_deploy.runtime.standalone import load_llm_custom_ops, pte_data_file
load_llm_custom_ops()
runtime = Runtime.get()
if weight_cache:
    import ctypes, os, executorch
    lib = ctypes.CDLL(os.path.join(list(executorch.__path__)[0], "lib", "libexecutorch.so"))

    class Option(ctypes.Structure):  # runtime/backend/options.h: key[64], variant<bool, int, array<char, 256>>
        _fields_ = [("key", ctypes.c_char * 64), ("value", ctypes.c_char * 256), ("index", ctypes.c_ubyte),
                    ("pad", ctypes.c_ubyte * 3)]

    class Span(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("length", ctypes.c_size_t)]

    def call(symbol, value):
        fn = getattr(lib, symbol)
        fn.restype, fn.argtypes = ctypes.c_uint32, [ctypes.c_char_p, Span]
        option = (Option * 1)()
        option[0].key, option[0].index, option[0].value = b"weight_cache_enabled", 0, bytes([value])
        error = fn(b"XnnpackBackend", Span(ctypes.cast(option, ctypes.c_void_p), 1))
        return error, option[0].value[0]

    set_error, _ = call("_ZN10executorch7runtime10set_optionEPKcNS0_4SpanINS0_13BackendOptionEEE", 1)
    get_error, enabled = call("_ZN10executorch7runtime10get_optionEPKcNS0_4SpanINS0_13BackendOptionEEE", 0)
    if set_error or get_error or enabled != 1:
        sys.exit(f"could not switch on the XNNPACK weight cache (errors {set_error}, {get_error}; read {enabled})")
mark("runtime imported")
start = time.perf_counter()
data = pte_data_file(path)  # model.ptd: the constants of a program that keeps them outside the .pte
program = runtime.load_program(path, data_path=None if data is None else str(data))
mark("load_program", seconds=round(time.perf_counter() - start, 2))
start = time.perf_counter()
forward = program.load_method("forward")
mark("load_method forward", seconds=round(time.perf_counter() - start, 2))
ids = torch.randint(1, 1000, (1, prompt_len), generator=torch.Generator().manual_seed(0))
logits = forward.execute([ids, torch.tensor([0], dtype=torch.long)])[0]
mark("prefill", tokens=prompt_len)
token = int(logits[0, -1].argmax())
for pos in range(prompt_len, prompt_len + gen_len):
    logits = forward.execute([torch.tensor([[token]]), torch.tensor([pos], dtype=torch.long)])[0]
    token = int(logits[0, -1].argmax())
mark("decode", tokens=gen_len)
"""


def measure(folder: Path, prompt_len: int, gen_len: int, threads: int, weight_cache: bool = False) -> dict:
    from pit_deploy.targets.executorch import PTE_NAME

    pte = folder / PTE_NAME
    proc = subprocess.run([sys.executable, "-c", CHILD, str(pte), str(prompt_len), str(gen_len), str(threads),
                           "1" if weight_cache else "0"], capture_output=True, text=True, check=False)
    steps = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not steps:
        return {"folder": folder.name, "error": proc.stderr[-2000:]}
    base = steps[0]["VmRSS"]
    for step in steps:
        step["above_baseline_mb"] = round(step["VmRSS"] - base, 1)
    data = pte.with_suffix(".ptd")  # a program's named data file counts as the program
    size_mb = round((pte.stat().st_size + (data.stat().st_size if data.is_file() else 0)) / 2**20, 1)
    return {"folder": folder.name, "xnnpack_weight_cache": weight_cache, "file_mib": size_mb, "steps": steps,
            "peak_above_baseline_over_file": round((steps[-1]["VmHWM"] - base) / size_mb, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="executorch artifact folders")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "studies" / "results" / "pte_memory.json"))
    parser.add_argument("--xnnpack-weight-cache", action="store_true",
                        help="measure each program twice, with the XNNPACK weight cache off and on")
    args = parser.parse_args(argv)
    caches = (False, True) if args.xnnpack_weight_cache else (False,)
    rows = [measure(f, args.prompt_len, args.gen_len, args.threads, cache) for f in args.folders for cache in caches]
    for row in rows:
        print(json.dumps(row, indent=1))
    return write_result(args.out, {
        "question": "where a .pte program's resident memory goes when ExecuTorch loads and runs it",
        "units": "MiB from /proc/self/status (VmRSS, RssAnon, RssFile; VmHWM the peak)",
        "prompt_len": args.prompt_len, "gen_len": args.gen_len, "threads": args.threads, "programs": rows,
    }, __file__, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    raise SystemExit(main())

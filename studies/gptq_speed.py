"""GPTQ of the default model's body: this checkout's code against an earlier revision's, side by
side in one process, on an idle machine and beside a competing load.

Why: calibrated rounding was reported taking 288–652 s per grid inside ``pit-deploy run default``
where the arithmetic is a few GFLOP. The question is where the time goes and whether a faster
implementation keeps the codes: both implementations round the same converted model on the same
calibration blocks, and the digests of their codes, scales and zero points are compared.

The earlier implementation is read from git (``git show REV:pit_deploy/exporters/calibrated_rounding.py``)
and loaded as a module beside the current one. ``--load`` runs the measurement a second time with
a child process keeping the machine's cores busy with float32 matrix products (torch, as many
threads as cores), as a test suite, a second export or a browser would.

Usage::

    python studies/gptq_speed.py --against REV [--target onnx-genai,executorch] [--load]
        [--out studies/results/gptq_speed.json]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import multiprocessing
import os
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE = "pit_deploy/exporters/calibrated_rounding.py"


def load_revision(rev: str) -> types.ModuleType:
    """``MODULE`` as it was at ``rev``, its relative imports made absolute."""
    text = subprocess.run(["git", "show", f"{rev}:{MODULE}"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout
    module = types.ModuleType(f"calibrated_rounding_{rev}")
    sys.modules[module.__name__] = module  # dataclasses look their module up by name
    exec(compile(text.replace("from ..", "from pit_deploy."), f"{rev}:{MODULE}", "exec"), module.__dict__)
    return module


def busy(stop) -> None:
    """Keep every core busy with float32 products until ``stop`` is set."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    a = torch.randn(1024, 1024)
    while not stop.is_set():
        a = torch.tanh(a @ a)


def digest(codes: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(codes):
        for tensor in (codes[name].codes, codes[name].scales, codes[name].zeros):
            h.update(tensor.numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, help="git revision of the implementation to compare with")
    parser.add_argument("--model", default="default")
    parser.add_argument("--target", default="onnx-genai,executorch", help="comma list: whose weight grid")
    parser.add_argument("--layers", type=int, default=None, help="round only the first N decoder layers")
    parser.add_argument("--load", action="store_true", help="also measure beside a competing load")
    parser.add_argument("--out", default=str(ROOT / "studies" / "results" / "gptq_speed.json"))
    args = parser.parse_args(argv)

    import torch

    import pit_deploy.exporters.calibrated_rounding as current
    from pit_deploy.data.calibration import calibration_blocks
    from pit_deploy.exporters.pipeline import load_pit_source
    from pit_deploy.exporters.recipes import load_recipe
    from pit_deploy.io.result_file import write_result
    from pit_deploy.model.families import adapter_for
    from pit_deploy.schemes import get_scheme
    from pit_deploy.targets import get_target

    earlier = load_revision(args.against)
    loaded = load_pit_source(args.model, "identity")  # the body is what GPTQ rounds; T does not matter here
    model = loaded.model.eval()
    if args.layers:
        layers = adapter_for(model.config).layers(model)
        del layers[args.layers:]
    # the int4 the default run ships on the default model (its own recipe), else the int4 scheme
    schemes = load_recipe("smollm2-135m").schemes(model.config) if args.model == "default" else []
    scheme = next((s for s in schemes if s.dtype == "int4"), None) or get_scheme("int4")
    blocks, source = calibration_blocks(loaded.tokenizer, model.config, 256)
    rows = []
    settings = [("idle", False)] + ([("beside load", True)] if args.load else [])
    for target in args.target.split(","):
        grid = get_target(target).weight_grid(scheme, "factorized")
        for setting, loaded_machine in settings:
            stop = worker = None
            if loaded_machine:
                spawn = multiprocessing.get_context("spawn")  # a forked child of torch can hang in its thread pool
                stop = spawn.Event()
                worker = spawn.Process(target=busy, args=(stop,), daemon=True)
                worker.start()
            try:
                for name, module in (("current", current), (args.against, earlier)):
                    work = copy.deepcopy(model)
                    start = time.perf_counter()
                    codes = module.calibrate(work, blocks, module.scheme_grids(work, scheme, grid), "gptq")
                    seconds = time.perf_counter() - start
                    rows.append({"target": target, "machine": setting, "code": name, "seconds": round(seconds, 1),
                                 "linears": len(codes), "digest": digest(codes)})
                    print(rows[-1], flush=True)
            finally:
                if worker is not None:
                    stop.set()
                    worker.join(timeout=30)
                    if worker.is_alive():
                        worker.kill()
    same = {}
    for row in rows:
        same.setdefault((row["target"], row["machine"]), set()).add(row["digest"])
    result = {
        "study": "gptq_speed", "model": args.model, "scheme": scheme.name, "against": args.against,
        "layers": args.layers, "calibration": source, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
        "rows": rows, "same_codes": all(len(d) == 1 for d in same.values()),
    }
    return write_result(args.out, result, __file__, argv)


if __name__ == "__main__":
    sys.exit(main())

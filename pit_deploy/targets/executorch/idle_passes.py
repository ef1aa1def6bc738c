"""Skip the XNNPACK delegate passes that have nothing to rewrite in a partition.

ExecuTorch's XNNPACK backend runs a fixed list of graph passes on every partition it lowers
(``executorch.backends.xnnpack._passes.XNNPACKPassManager``, called by
``XnnpackBackend.preprocess``). Each pass ends by re-tracing the whole partition on fake tensors
(``ExportPass``), whether it changed anything or not, and a decoder's partitions are all its
layers: on the default model that is about 9 s per pass for an int4 program. Several passes
rewrite operators that a language model's partitions never hold (batch norm, convolutions,
PReLU, padding, bilinear upsampling, long concatenations, a decomposed SDPA): for those the pass
finds nothing, and its re-trace is all it costs.

:func:`skip_idle_passes` leaves a pass out of a partition's list only when none of the operators
it rewrites occurs in that partition, so what is lowered stays the same program: the ``.pte``
bytes are identical with and without it (``studies/pte_lowering_time.py`` compares them, and
``tests/test_pte_lowering.py`` checks it on a tiny model). Passes not named here always run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

#: pass class name → substrings of the operator names it rewrites (``exir_ops.edge`` targets as
#: ``str(node.target)``, e.g. ``aten.convolution.default``); a pass is skipped in a partition
#: with no such operator. The pattern-matching passes list an operator every pattern holds
#: (``_softmax`` for the decomposed SDPA, ``index`` for the decomposed bilinear upsampling).
TRIGGERS: dict[str, tuple[str, ...]] = {
    "ConvertToUpsampleBilinear2d": ("upsample", "index"),
    "ConvertToSDPAPass": ("softmax", "scaled_dot_product"),
    "FuseBatchNormPass": ("batch_norm",),
    "DecomposeBatchNorm": ("batch_norm",),
    "DecomposeConcatenate": ("aten.cat",),
    "InsertPadQDQPass": ("constant_pad_nd",),
    "Conv1dUnsqueezePass": ("convolution",),
    "PReLUReshapePass": ("prelu",),
}


def operator_names(graph_module) -> set[str]:
    """The names of the operators ``graph_module`` (and any graph module it holds) calls."""
    names = set()
    for module in graph_module.modules():
        graph = getattr(module, "graph", None)
        if graph is None:
            continue
        names.update(str(node.target) for node in graph.nodes if node.op == "call_function")
    return names


def needed(pass_name: str, operators: set[str]) -> bool:
    """Whether the pass ``pass_name`` may rewrite something among ``operators``."""
    triggers = TRIGGERS.get(pass_name)
    return triggers is None or any(t in op for op in operators for t in triggers)


@contextlib.contextmanager
def skip_idle_passes() -> Iterator[list[str]]:
    """While active, each partition the XNNPACK backend lowers runs only the passes of its
    default list that :func:`needed` keeps. Yields a list that collects the names skipped (one
    entry per partition and pass), for measuring."""
    from executorch.backends.xnnpack import xnnpack_preprocess

    stock = getattr(xnnpack_preprocess, "XNNPACKPassManager", None)
    skipped: list[str] = []
    if stock is None:  # an ExecuTorch that builds its pass list elsewhere: every pass runs
        yield skipped
        return

    class _Trimmed(stock):
        def __init__(self, exported_program, passes=None):
            super().__init__(exported_program, passes)
            if passes:  # an explicit list (the dynamically quantized linear partitioner's) stays as asked
                return
            operators = operator_names(exported_program.graph_module)
            kept = [p for p in self.passes if needed(p.__name__, operators)]
            skipped.extend(p.__name__ for p in self.passes if p not in kept)
            self.passes = kept

    xnnpack_preprocess.XNNPACKPassManager = _Trimmed
    try:
        yield skipped
    finally:
        xnnpack_preprocess.XNNPACKPassManager = stock

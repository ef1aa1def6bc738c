"""One registered exporter per runtime: what it writes, which dtypes it supports, which
driver runs its artifacts and how its artifact's shapes are described in the manifest.

Listing exporters imports no heavy library: each :class:`ExporterSpec` names its export
function as ``"module:function"`` and imports it on first use. A new runtime is one
:func:`register_exporter` call (plus its driver in :mod:`pit_deploy.runtime.base`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import PitError


@dataclass(frozen=True)
class ExporterSpec:
    """How one runtime's artifacts are made.

    Attributes:
        runtime: the runtime name (also the driver's name and the artifact folder's prefix).
        target: ``"module:function"`` with signature ``(model, out_dir, *, tokenizer, recipe,
            opset, dtype) -> dict`` (details recorded in the manifest); ``model`` is the fp32
            prepared model, quantization to ``dtype`` is the exporter's.
        dtypes: export dtypes this runtime supports.
        static_cache: whether the artifact has a static KV cache of ``recipe.max_seq_len``.
        check: optional ``"module:function"`` ``(config, recipe) -> None`` run before any slow work.
    """

    runtime: str
    target: str
    dtypes: tuple[str, ...] = ("float32",)
    static_cache: bool = False
    check: str | None = None

    def export(self, model: Any, out_dir: Path, **kwargs: Any) -> dict:
        return _resolve(self.target)(model, out_dir, **kwargs)

    def precheck(self, config: Any, recipe: Any) -> None:
        if self.check:
            _resolve(self.check)(config, recipe)

    def shapes(self, config: Any, mode: str, recipe: Any) -> dict[str, Any]:
        """The manifest's ``shapes`` entry of an artifact of this runtime."""
        v, d = config.vocab_size, config.hidden_size
        shapes: dict[str, Any] = {"vocab_size": v, "hidden_size": d, "num_layers": config.num_hidden_layers}
        if mode == "factorized":
            shapes["interface"] = {"Zt": [d, v], "T": [d, d], "T_inv": [d, d]}
        elif mode == "tied":
            shapes["interface"] = {"E": [v, d], "W_out": "Eᵀ (transpose tying)"}
        else:
            shapes["interface"] = {"E": [v, d], "W_out": [d, v]}
        if self.static_cache:
            shapes["max_seq_len"] = recipe.max_seq_len
            shapes["forward"] = {"tokens": [1, "S"], "input_pos": [1], "logits": [1, "S", v]}
        else:
            shapes["decoder"] = "optimum text-generation-with-past (dynamic batch/sequence/past)"
        return shapes


def _resolve(target: str) -> Callable[..., Any]:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


EXPORTERS: dict[str, ExporterSpec] = {}


def register_exporter(spec: ExporterSpec) -> ExporterSpec:
    EXPORTERS[spec.runtime] = spec
    return spec


def exporter_for(runtime: str) -> ExporterSpec:
    try:
        return EXPORTERS[runtime]
    except KeyError:
        raise PitError(f"unknown runtime {runtime!r}; choose from {', '.join(EXPORTERS)}") from None


register_exporter(ExporterSpec("onnx", "pit_deploy.export.to_onnx:export_artifact",
                               dtypes=("float32", "int8", "int4")))
register_exporter(ExporterSpec(
    "executorch", "pit_deploy.export.to_executorch:export_artifact", static_cache=True,
    dtypes=("float32", "int8", "int4"), check="pit_deploy.export.to_executorch:precheck",
))

"""The ``onnx`` target: optimum's ``text-generation-with-past`` decoder run by onnxruntime.

Artifact layout (``docs/export.md``): :data:`DECODER_NAME` + :data:`DECODER_DATA` (the decoder
and its external weights, stored once), :data:`INTERFACE_NAME` (``(input_ids, hidden) ->
(embeddings, logits)``, reading the decoder's very weight bytes, so verification measures the
runtime's own ``W_out E``). Exporter: :mod:`pit_deploy.export.to_onnx`; quantized graphs:
:mod:`pit_deploy.export.quantize_onnx`; driver: :mod:`pit_deploy.runtime.ort_driver`; on a
device: ``OrtDecoder`` of :mod:`pit_deploy.runtime.standalone` (numpy + onnxruntime only).

Standard library only at import; the hooks import what they call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import register_target
from .base import Target, WeightGrid, resolve

DECODER_NAME = "model.onnx"
DECODER_DATA = "model.onnx_data"
INTERFACE_NAME = "interface.onnx"


class OnnxOptimumTarget(Target):
    name = "onnx"
    title = "ONNX (optimum decoder with KV cache) on onnxruntime"
    module = "onnxruntime"
    package = "onnxruntime"
    dtypes = ("float32", "int8", "int4")
    exporter = "pit_deploy.export.to_onnx:export_artifact"
    driver = "pit_deploy.runtime.ort_driver:OnnxDriver"
    standalone = ("pit_deploy.runtime.standalone", "OrtDecoder")
    bundle_install = "onnxruntime numpy"
    primary_file = DECODER_NAME
    ship_priority = 20

    def shapes(self, config: Any, mode: str, recipe: Any) -> dict[str, Any]:
        return {**super().shapes(config, mode, recipe),
                "decoder": "optimum text-generation-with-past (dynamic batch/sequence/past)"}

    def weight_grid(self, scheme: Any, mode: str) -> WeightGrid:
        """``MatMulNBits`` everywhere: asymmetric blocks of ``group_size`` (8-bit ones too), the
        head and the embedding on the ``table_bits`` table (:mod:`pit_deploy.export.quantize_onnx`)."""
        return WeightGrid(symmetric=False, per_channel_8bit=False, head_bits=scheme.table_bits,
                          embed_bits=scheme.table_bits)

    def interface_checks(self, folder: Path, dim: int) -> tuple[bool | None, list[str]]:
        """The interface graph must read the decoder's weight bytes (else ``delta_ti`` would be
        measured on a copy that the decoder does not run)."""
        shared, message = resolve("pit_deploy.runtime.onnx_weights:shared_weights")(folder, min_elements=dim * dim)
        return shared, [message]


TARGET = register_target(OnnxOptimumTarget())

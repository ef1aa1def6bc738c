"""The ``onnx-genai`` target: a folder that ``onnxruntime_genai.Model(folder)`` loads and
generates with, its fused decoder written by the onnxruntime-genai model builder.

Artifact layout: :data:`DECODER_NAME` + :data:`BUILDER_DATA` (the builder's fused decoder and
its external weights), :data:`CONFIG_NAME` (the genai runtime's config), the tokenizer files the
builder copies, and :data:`INTERFACE_NAME` (the decoder's own embedding and head nodes, reading
the decoder's weight bytes, so verification measures the runtime's own ``W_out E``).
Exporter: :mod:`pit_deploy.export.to_genai`; driver: :mod:`pit_deploy.runtime.genai_driver`; on a
device: ``OrtDecoder`` of :mod:`pit_deploy.runtime.standalone` (numpy + onnxruntime only), which
reads both ONNX layouts.

Standard library only at import; the hooks import what they call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import PitError
from . import register_target
from .base import Target, VerifyContext, WeightGrid, resolve

DECODER_NAME = "model.onnx"
#: the builder's name for the decoder's external data (not optimum's ``model.onnx_data``)
BUILDER_DATA = "model.onnx.data"
CONFIG_NAME = "genai_config.json"
INTERFACE_NAME = "interface.onnx"

#: ``config.model_type`` → the HF architecture the builder (0.18.0) dispatches on, for the
#: families whose builder graphs were checked against PyTorch here. GPT-2 has no builder.
BUILDER_FAMILIES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "gemma": "GemmaForCausalLM",
}
BUILDER_ARCHITECTURES: tuple[str, ...] = tuple(BUILDER_FAMILIES.values())


class OnnxGenaiTarget(Target):
    name = "onnx-genai"
    title = "onnxruntime-genai folder (model builder's fused decoder, genai_config.json)"
    module = "onnxruntime_genai"
    package = "onnxruntime-genai"
    dtypes = ("float32", "int8", "int4")
    model_types = tuple(BUILDER_FAMILIES)
    exporter = "pit_deploy.export.to_genai:export_artifact"
    driver = "pit_deploy.runtime.genai_driver:GenaiDriver"
    primary_file = DECODER_NAME
    standalone = ("pit_deploy.runtime.standalone", "OrtDecoder")
    bundle_install = "onnxruntime numpy"
    ship_priority = 15
    #: opt-in (``--runtime onnx-genai``): it needs onnxruntime-genai and builds fewer families
    #: (no GPT-2) than the default targets
    default_export = False
    #: the builder quantizes the body with the scheme's block size and keeps the scheme's 8-bit
    #: layers through its int8 overrides; the token table of a factorized artifact is quantized
    #: like the ``onnx`` target's (table bits, PIT correction)
    scheme_settings = Target.scheme_settings + ("rounding",)
    families = tuple(BUILDER_FAMILIES)

    def weight_grid(self, scheme: Any, mode: str) -> WeightGrid:
        """The builder's body: onnxruntime's symmetric ``MatMulNBits`` blocks of ``group_size``
        (8-bit overrides too; with ``rounding = "gptq"`` the codes are the calibrated model's,
        :func:`pit_deploy.export.to_genai.write_calibrated_body`). Factorized: our token table,
        asymmetric at ``table_bits`` as on the ``onnx`` target. Materialized: the builder rounds
        the head like the body and keeps the embedding float32."""
        if mode == "factorized":
            return WeightGrid(symmetric=True, per_channel_8bit=False, head_bits=scheme.table_bits,
                              embed_bits=scheme.table_bits, full_range=True, table_symmetric=False)
        return WeightGrid(symmetric=True, per_channel_8bit=False, head_bits=8 if scheme.dtype == "int8" else 4,
                          embed_bits=0, full_range=True)

    def precheck(self, config: Any, recipe: Any) -> None:
        """Refuse a family the builder cannot build, or a missing builder, before any slow work."""
        if not self.installed():
            raise PitError(f"the {self.name} runtime needs the onnxruntime-genai model builder; "
                           f"install it with `pip install {self.package}==0.18.0`")
        model_type = getattr(config, "model_type", None)
        if model_type not in BUILDER_FAMILIES:
            raise PitError(f"the {self.name} runtime builds {', '.join(BUILDER_FAMILIES)} models with the "
                           f"onnxruntime-genai builder; {model_type!r} is not one of them")

    def shapes(self, config: Any, mode: str, recipe: Any) -> dict[str, Any]:
        return {**super().shapes(config, mode, recipe),
                "decoder": "onnxruntime-genai builder (GroupQueryAttention, dynamic batch/sequence/past)"}

    def interface_checks(self, folder: Path, dim: int) -> tuple[bool | None, list[str]]:
        """The interface graph must read the decoder's weight bytes."""
        shared, message = resolve("pit_deploy.runtime.genai_driver:shared_interface_weights")(folder, dim * dim)
        return shared, [message]

    def verify_extras(self, ctx: VerifyContext, art: Any, result: Any, quantized: bool) -> None:
        """Load the folder with ``onnxruntime_genai.Model`` and compare its generator's logits
        with the decoder session's (the same graph through the genai runtime's own KV cache)."""
        resolve("pit_deploy.runtime.genai_driver:check_generator")(ctx, art, result, quantized)


TARGET = register_target(OnnxGenaiTarget())

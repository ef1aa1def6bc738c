"""The ``gguf`` target: one GGUF file that llama.cpp, and the apps built on it, load and run;
verified and benchmarked in llama.cpp itself through llama-cpp-python.

A materialized PIT model is an ordinary Llama-family model whose output head is untied from its
input embedding, which llama.cpp's ``llama`` and ``qwen3`` architectures support as they are
(``output.weight`` beside ``token_embd.weight``). A factorized model (``Zᵀ`` read by both ends
through ``T`` and ``T⁻¹``) has no llama.cpp architecture, so it is refused; the transpose-tied
baseline (``--keep-tying``) is written without ``output.weight``, which is how llama.cpp ties.

Artifact layout: one ``model-<type>.gguf`` (:data:`FILE_NAMES`) and :data:`SPEC_NAME`, a small
JSON that says which file to open and with which KV-cache type (the type that made the fp32
bounds hold: ``docs/llama_cpp.md``). Exporter: :mod:`pit_deploy.export.to_gguf`; driver:
:mod:`pit_deploy.runtime.llama_cpp_driver`; on a device: ``LlamaCppDecoder`` of
:mod:`pit_deploy.runtime.llama_cpp_decoder` (numpy + llama-cpp-python only).

Schemes: ``float32`` (F32), ``f16`` and ``q8_0`` (written here with gguf-py), ``q4_0`` and
``q4_k_m`` (llama.cpp's own quantizer, ``llama_model_quantize``). The generic ``int8``/``int4``
schemes describe other runtimes' grids, so they are refused here rather than silently mapped.

Standard library only at import; the hooks import what they call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import PitError
from . import register_target
from .base import Target

#: the JSON beside the GGUF file: which file, which KV-cache type, which llama.cpp version
SPEC_NAME = "llama_cpp.json"

#: ``config.model_type`` → the llama.cpp architecture written in ``general.architecture``
ARCHITECTURES: dict[str, str] = {"llama": "llama", "qwen3": "qwen3"}

#: scheme name → llama.cpp's name of the file type (``general.file_type``'s meaning)
FILE_TYPES: dict[str, str] = {"float32": "F32", "f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k_m": "Q4_K_M"}

#: scheme name → the GGUF file of its artifact folder
FILE_NAMES: dict[str, str] = {name: f"model-{kind.lower()}.gguf" for name, kind in FILE_TYPES.items()}

#: the pinned llama-cpp-python (built from its sdist by ``scripts/setup_llama_cpp.sh``)
PACKAGE_VERSION = "0.3.36"


class LlamaCppTarget(Target):
    name = "gguf"
    title = "GGUF file for llama.cpp (llama-cpp-python; materialized only)"
    module = "llama_cpp"
    package = "llama-cpp-python"
    dtypes = ("float32", "float16", "int8", "int4")
    model_types = tuple(ARCHITECTURES)
    modes = ("materialized",)
    schemes = tuple(FILE_TYPES)
    #: the corrected token table is float32, the pseudo-inverse of the dequantized head
    exact_interface_modes = ("materialized",)
    exporter = "pit_deploy.export.to_gguf:export_artifact"
    driver = "pit_deploy.runtime.llama_cpp_driver:LlamaCppDriver"
    standalone = ("pit_deploy.runtime.llama_cpp_decoder", "LlamaCppDecoder")
    bundle_install = f"llama-cpp-python=={PACKAGE_VERSION} numpy"
    ship_priority = 20
    #: opt-in (``--runtime gguf``): it needs llama-cpp-python and writes materialized Llama/Qwen3 only
    default_export = False
    #: the quantized schemes read only the PIT correction of the head/table pair
    scheme_settings = ("pit_correction",)
    families = tuple(ARCHITECTURES)
    modes = ("materialized",)
    schemes = tuple(FILE_TYPES)

    def precheck(self, config: Any, recipe: Any) -> None:
        """Refuse, before any slow work: a family llama.cpp has no architecture for here, a
        factorized export, or a scheme that is not one of llama.cpp's file types."""
        model_type = getattr(config, "model_type", None)
        if model_type not in ARCHITECTURES:
            raise PitError(f"the {self.name} runtime writes {', '.join(ARCHITECTURES)} models (llama.cpp "
                           f"architectures checked here); {model_type!r} is not one of them")
        if getattr(config, "pit", None) and "factorized" in recipe.modes:
            raise PitError(f"the {self.name} runtime cannot hold a factorized PIT model: llama.cpp has no "
                           "architecture whose embedding and head read one Zᵀ through T⁻¹ and T; "
                           "export it with --mode materialized")
        other = [name for name in recipe.dtype if name not in FILE_TYPES]
        if other:
            raise PitError(f"the {self.name} runtime writes llama.cpp's own types ({', '.join(FILE_TYPES)}), "
                           f"not {', '.join(other)}")
        if any(name not in ("float32", "f16", "q8_0") for name in recipe.dtype) and not self.installed():
            raise PitError(f"q4_0/q4_k_m GGUF files are made by llama.cpp's quantizer; install llama-cpp-python "
                           f"with `bash scripts/setup_llama_cpp.sh` (pins {PACKAGE_VERSION})")

    def shapes(self, config: Any, mode: str, recipe: Any) -> dict[str, Any]:
        return {**super().shapes(config, mode, recipe), "architecture": ARCHITECTURES.get(config.model_type)}

    def primary_path(self, folder: Path) -> str:
        """The GGUF file :data:`SPEC_NAME` names."""
        try:
            return str(json.loads((folder / SPEC_NAME).read_text())["file"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PitError(f"{folder / SPEC_NAME} cannot be read ({exc}); re-export") from None

    def verify_extras(self, ctx: Any, art: Any, result: Any, quantized: bool) -> None:
        """Record the KV-cache type the figures were measured with and, for quantized files,
        ``delta_ti`` of the head/table pair as exported with and without the PIT correction."""
        details = art.details if isinstance(art.details, dict) else {}
        result.notes.append(f"llama.cpp KV cache: {details.get('kv_cache_type', '?')}")
        quant = details.get("quantization") or {}
        if "delta_ti_uncorrected" in quant:
            result.notes.append(f"delta_ti of the quantized head with the table it was exported with: "
                                f"{quant.get('delta_ti_corrected', float('nan')):.3e} (corrected), "
                                f"{quant['delta_ti_uncorrected']:.3e} (table quantized as the source, "
                                "measured at export)")


TARGET = register_target(LlamaCppTarget())

"""The ``gguf`` target: one GGUF file that llama.cpp, and the apps built on it, load and run;
verified and benchmarked in llama.cpp itself through llama-cpp-python.

A materialized PIT model is an ordinary Llama-family model whose output head is untied from its
input embedding, which llama.cpp's ``llama``, ``qwen3``, ``smollm3``, ``phi3`` and ``gemma3``
architectures support as they are (``output.weight`` beside ``token_embd.weight``). llama.cpp's
``gemma`` and ``gemma2`` always read the head from the token table, so the first Gemma and Gemma 2
are refused. A factorized model (``Zᵀ`` read by both ends
through ``T`` and ``T⁻¹``) has no llama.cpp architecture, so it is refused; the transpose-tied
baseline (``--keep-tying``) is written without ``output.weight``, which is how llama.cpp ties.

Artifact layout: one ``model-<type>.gguf`` (:data:`FILE_NAMES`) and :data:`SPEC_NAME`, a small
JSON that says which file to open and with which KV-cache type (the type that made the fp32
bounds hold: ``docs/llama_cpp.md``). Exporter: :mod:`pit_deploy.targets.gguf.export`; driver:
:mod:`pit_deploy.targets.gguf.driver`; on a device: ``LlamaCppDecoder`` of
:mod:`pit_deploy.targets.gguf.decoder` (numpy + llama-cpp-python only).

Schemes: ``float32`` (F32), ``f16`` and ``q8_0`` (written here with gguf-py), ``q4_0`` and
``q4_k_m`` (llama.cpp's own quantizer, ``llama_model_quantize``). The generic ``int8``/``int4``
schemes describe other runtimes' grids, so they are refused here rather than silently mapped.

Standard library only at import; the hooks import what they call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...errors import PitError
from .. import register_target
from ..base import Target, plain_relative, resolve

#: the JSON beside the GGUF file: which file, which KV-cache type, which llama.cpp version
SPEC_NAME = "llama_cpp.json"

#: ``config.model_type`` → the llama.cpp architecture written in ``general.architecture``
ARCHITECTURES: dict[str, str] = {"llama": "llama", "qwen3": "qwen3", "smollm3": "smollm3", "phi3": "phi3",
                                 "gemma3_text": "gemma3"}

#: scheme name → llama.cpp's name of the file type (``general.file_type``'s meaning)
FILE_TYPES: dict[str, str] = {"float32": "F32", "f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k_m": "Q4_K_M"}

#: scheme name → the GGUF file of its artifact folder
FILE_NAMES: dict[str, str] = {name: f"model-{kind.lower()}.gguf" for name, kind in FILE_TYPES.items()}

#: architectures whose MLP applies GELU, which llama.cpp's CPU backend computes from a float16 lookup
#: table (ggml's ``GGML_GELU_FP16``, on by default): the activation is rounded to float16 on the way
#: in and out, which alone moves a float32 file's logits past the float32 bound (measured: rel L2
#: 2.5e-4 on the tiny Gemma 3, 2.8e-4 from PyTorch with the same rounding; docs/llama_cpp.md)
TABLE_GELU_ARCHITECTURES = ("gemma3",)

#: the KV-cache types an export may record (``targets/gguf/decoder.py``'s ``KV_TYPES``)
KV_CACHE_TYPES = ("f32", "f16")
#: positions a llama.cpp context holds unless ``llama_cpp.json`` says otherwise (the decoder's default)
DEFAULT_CONTEXT = 2048

#: Q8_0's block: a row of a quantized weight holds a multiple of this many values
Q8_0_BLOCK = 32

#: the pinned llama-cpp-python (built from its sdist by ``scripts/setup_llama_cpp.sh``)
PACKAGE_VERSION = "0.3.36"

#: llama.cpp's own file types as schemes of this target: the codes are llama.cpp's, not the shared
#: int8/int4 grids, and the head is BF16 in all four (HEAD_TYPE of the exporter). Bounds set from the
#: default model's measurements in llama.cpp (docs/llama_cpp.md, "Bounds") with a margin of about 1.5x
#: on the KL means. Measured (corrected table; uncorrected within 4 %): q8_0 0.0033 / 0.021 / 96.8 % /
#: 1.0003, q4_0 0.47 / 2.62 / 68 % / 1.55, q4_k_m 0.080 / 0.46 / 85.5 % / 1.05 (kl_mean / kl_p99 / same
#: top-1 / ppl ratio); f16 8.4e-5 / 4.9e-4 / 99.5 % / 1.0000 (the transpose-tied f16 file: 6.0e-6, its
#: head F16 too).
LLAMA_CPP_SCHEMES = (
    {"name": "f16", "dtype": "float16",
     "bounds": {"kl_mean": 1.5e-4, "kl_p99": 1e-3, "same_top1": 0.98, "ppl_ratio": 1.002},
     "description": "llama.cpp F16: every body linear in float16, the head BF16"},
    {"name": "q8_0", "dtype": "int8",
     "bounds": {"kl_mean": 0.005, "kl_p99": 0.035, "same_top1": 0.93, "ppl_ratio": 1.01},
     "description": "llama.cpp Q8_0: 8-bit blocks of 32 with one f16 scale for every body linear, the head BF16"},
    {"name": "q4_0", "dtype": "int4",
     "bounds": {"kl_mean": 0.7, "kl_p99": 4.0, "same_top1": 0.6, "ppl_ratio": 1.8},
     "description": "llama.cpp Q4_0 by its own quantizer: 4-bit blocks of 32 with one f16 scale, the head BF16"},
    {"name": "q4_k_m", "dtype": "int4",
     "bounds": {"kl_mean": 0.12, "kl_p99": 0.7, "same_top1": 0.8, "ppl_ratio": 1.1},
     "description": "llama.cpp Q4_K_M by its own quantizer: 4-bit k-quant super-blocks of 256, some layers at "
                    "Q6_K (Q5_0/Q8_0 where rows are not a multiple of 256), the head BF16"},
)


class LlamaCppTarget(Target):
    name = "gguf"
    title = "GGUF file for llama.cpp (llama-cpp-python; materialized only)"
    module = "llama_cpp"
    package = "llama-cpp-python"
    dtypes = ("float32", "float16", "int8", "int4")
    model_types = tuple(ARCHITECTURES)
    modes = ("materialized",)
    schemes = tuple(FILE_TYPES)
    own_schemes = LLAMA_CPP_SCHEMES
    #: the corrected token table is float32, the pseudo-inverse of the dequantized head
    exact_interface_modes = ("materialized",)
    exporter = "pit_deploy.targets.gguf.export:export_artifact"
    driver = "pit_deploy.targets.gguf.driver:LlamaCppDriver"
    standalone = ("pit_deploy.targets.gguf.decoder", "LlamaCppDecoder")
    bundle_install = f"llama-cpp-python=={PACKAGE_VERSION} numpy"
    ship_priority = 20
    weight_check = "pit_deploy.targets.gguf.stored_weights:check_gguf_weights"
    aarch64_blocker = "llama-cpp-python is built from source for the host's CPU; no aarch64 build of it is set up"
    #: opt-in (``--runtime gguf``): it needs llama-cpp-python and writes materialized Llama/Qwen3 only
    default_export = False
    #: the quantized schemes read only the PIT correction of the head/table pair
    scheme_settings = ("pit_correction",)

    def streams_tables(self, schemes: Any) -> bool:
        """Every scheme: the tables are computed, rounded and written 8192 rows at a time
        (``TensorByRows``), and no scheme calibrates on the model."""
        return True

    def precheck(self, config: Any, recipe: Any) -> None:
        """Refuse, before any slow work: a family llama.cpp has no architecture for here, a
        factorized export, or a scheme that is not one of llama.cpp's file types."""
        model_type = getattr(config, "model_type", None)
        if model_type not in ARCHITECTURES:
            raise PitError(f"the {self.name} runtime writes {', '.join(ARCHITECTURES)} models (llama.cpp "
                           f"architectures checked here); {model_type!r} is not one of them")
        if model_type == "gemma3_text":
            resolve("pit_deploy.targets.gguf.export:check_gemma3")(config)
        if getattr(config, "pit", None) and "factorized" in recipe.modes:
            raise PitError(f"the {self.name} runtime cannot hold a factorized PIT model: llama.cpp has no "
                           "architecture whose embedding and head read one Zᵀ through T⁻¹ and T; "
                           "export it with --mode materialized")
        if ARCHITECTURES[model_type] in TABLE_GELU_ARCHITECTURES and "float32" in recipe.dtype:
            raise PitError(f"a float32 {ARCHITECTURES[model_type]} GGUF cannot meet the float32 bounds: llama.cpp's CPU "
                           "backend computes GELU from a float16 table (logits off by ~2.5e-4 relative, the bound is "
                           "1e-4); export it with --dtype f16, q8_0, q4_0 or q4_k_m, checked against their own bounds")
        other = [name for name in recipe.dtype if name not in FILE_TYPES]
        if other:
            raise PitError(f"the {self.name} runtime writes llama.cpp's own types ({', '.join(FILE_TYPES)}), "
                           f"not {', '.join(other)}")
        if "q8_0" in recipe.dtype:
            head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            widths = {"hidden_size": config.hidden_size, "intermediate_size": getattr(config, "intermediate_size", 0),
                      "attention width (heads × head size)": config.num_attention_heads * head}
            odd = [f"{name} {width}" for name, width in widths.items() if width % Q8_0_BLOCK]
            if odd:
                raise PitError(f"q8_0 rounds each weight row in blocks of {Q8_0_BLOCK}, and this model's "
                               f"{', '.join(odd)} {'is' if len(odd) == 1 else 'are'} not a multiple of {Q8_0_BLOCK}; "
                               "export it with --dtype f16 or float32")
        if any(name not in ("float32", "f16", "q8_0") for name in recipe.dtype) and not self.installed():
            raise PitError(f"q4_0/q4_k_m GGUF files are made by llama.cpp's quantizer; install llama-cpp-python "
                           f"with `bash scripts/setup_llama_cpp.sh` (pins {PACKAGE_VERSION})")

    def precheck_tokenizer(self, tokenizer: Any) -> None:
        """Refuse, before the GGUF conversion, a tokenizer the file cannot hold: none, not byte-level
        BPE, or a pre-tokenizer whose llama.cpp counterpart was not checked here."""
        resolve("pit_deploy.targets.gguf.vocab:check_tokenizer")(tokenizer)

    def shapes(self, config: Any, mode: str, recipe: Any) -> dict[str, Any]:
        return {**super().shapes(config, mode, recipe), "architecture": ARCHITECTURES.get(config.model_type)}

    required_files = ((SPEC_NAME,),)

    def primary_path(self, folder: Path) -> str:
        """The GGUF file :data:`SPEC_NAME` names (a plain relative path: :meth:`check_files`
        checks that it is a file of the artifact)."""
        ((_, key, name),) = self.config_references(folder)
        if not plain_relative(name):
            raise PitError(f"{folder / SPEC_NAME}: {key} is {name!r}, not a plain relative path inside the artifact "
                           "(no absolute path, no '..'); the file was edited or tampered — re-export")
        return name

    def config_references(self, folder: Path) -> list[tuple[str, str, Any]]:
        """The GGUF file :data:`SPEC_NAME` names (its ``"file"``)."""
        try:
            spec = json.loads((folder / SPEC_NAME).read_text(encoding="utf-8"))
            return [(SPEC_NAME, '"file"', spec["file"])]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PitError(f"{folder / SPEC_NAME} cannot be read ({type(exc).__name__}: {exc}); re-export") from None

    def check_files(self, directory: Path, art: Any) -> None:
        """The generic checks, then :data:`SPEC_NAME`'s settings: a KV-cache type llama.cpp
        takes here, and a context that holds the model's positions (what verification and bench
        prompts need; the export writes ``min(max positions, 2048)``)."""
        super().check_files(directory, art)
        folder = Path(directory) / art.path
        spec = json.loads((folder / SPEC_NAME).read_text(encoding="utf-8"))
        kv = spec.get("kv_cache_type", "f16")
        if kv not in KV_CACHE_TYPES:
            raise PitError(f"{folder / SPEC_NAME}: \"kv_cache_type\" is {kv!r}, not one of {', '.join(KV_CACHE_TYPES)}; "
                           "the file was edited — re-export")
        context = spec.get("context_length", DEFAULT_CONTEXT)
        try:
            config = json.loads((Path(directory) / "reference" / "config.json").read_text(encoding="utf-8"))
            needed = min(int(config.get("max_position_embeddings") or DEFAULT_CONTEXT), DEFAULT_CONTEXT)
        except (OSError, ValueError, TypeError):
            needed = 1  # the reference is checked (and refused) where it is loaded
        if not isinstance(context, int) or isinstance(context, bool) or context < needed:
            raise PitError(f"{folder / SPEC_NAME}: \"context_length\" is {context!r}, fewer positions than the model's "
                           f"{needed} that verification and bench prompts may use; the file was edited — re-export")

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

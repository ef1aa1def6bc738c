"""The ``onnx`` target: optimum's ``text-generation-with-past`` decoder run by onnxruntime.

Artifact layout (``docs/export.md``): the one transformers.js loads unchanged (the Hugging Face
hub's ONNX layout): ``config.json`` (with a ``transformers.js_config`` naming the graph's dtype and
its external data), the tokenizer files (the chat template also inside
``tokenizer_config.json``, the only place transformers.js reads it), and under ``onnx/`` the
decoder ``model{suffix}.onnx`` + ``model{suffix}.onnx_data`` (its external weights, stored once;
the suffix is transformers.js's for the dtype: :func:`decoder_name`) and :data:`INTERFACE_NAME`
(``(input_ids, hidden) -> (embeddings, logits)``, reading the decoder's very weight bytes, so
verification measures the runtime's own ``W_out E``). Folders exported before this layout (the
decoder at the top) still load: :func:`decoder_file`. Exporter: :mod:`pit_deploy.targets.onnx.export`; quantized graphs:
:mod:`pit_deploy.exporters.quantize_onnx`; driver: :mod:`pit_deploy.targets.onnx.driver`; on a
device: ``OrtDecoder`` of :mod:`pit_deploy.runtime.standalone` (numpy + onnxruntime only).

Standard library only at import; the hooks import what they call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import PitError
from .. import register_target
from ..base import ONNXRUNTIME_AARCH64, Target, WeightGrid, resolve

#: the subfolder transformers.js reads graphs from
GRAPH_DIR = "onnx"
#: the fp32 decoder (quantized ones carry transformers.js's suffix: :func:`decoder_name`)
DECODER_NAME = f"{GRAPH_DIR}/model.onnx"
INTERFACE_NAME = f"{GRAPH_DIR}/interface.onnx"
#: transformers.js's dtype name for each of our dtypes: it picks ``onnx/model{suffix}.onnx`` by it
#: (``DEFAULT_DTYPE_SUFFIX_MAPPING`` of transformers.js 4.x)
WEB_DTYPES = {"float32": ("fp32", ""), "int8": ("int8", "_int8"), "int4": ("q4", "_q4")}
#: the layout of folders exported before the web layout
LEGACY_DECODER, LEGACY_INTERFACE = "model.onnx", "interface.onnx"


def decoder_name(dtype: str) -> str:
    """The decoder's path in the folder for one of our dtypes (``onnx/model_q4.onnx`` for int4)."""
    return f"{GRAPH_DIR}/model{WEB_DTYPES[dtype][1]}.onnx"


def data_name(decoder: str) -> str:
    """The external-data file name of a decoder: transformers.js fetches ``<graph file>_data`` and
    hands it to onnxruntime-web under that name, so the graph must point at exactly it."""
    return Path(decoder).name + "_data"


def decoder_file(folder: Path) -> Path:
    """The decoder graph of an artifact folder, this layout's or the pre-web one's.

    Raises:
        PitError: no decoder, or more than one, under ``onnx/``.
    """
    folder = Path(folder)
    if (folder / LEGACY_DECODER).is_file():
        return folder / LEGACY_DECODER
    found = sorted(p for p in (folder / GRAPH_DIR).glob("model*.onnx") if p.is_file())
    if len(found) != 1:
        raise PitError(f"{folder}: expected one decoder graph onnx/model*.onnx, found "
                       f"{[p.name for p in found] or 'none'}; re-export")
    return found[0]


def interface_file(folder: Path) -> Path:
    """The interface graph beside :func:`decoder_file`'s decoder."""
    folder = Path(folder)
    return folder / (LEGACY_INTERFACE if (folder / LEGACY_DECODER).is_file() else INTERFACE_NAME)

#: The web schemes: the same codes as int8/int4, dequantized by standard operators that onnxruntime
#: folds at load, because onnxruntime-web's default WASM build lacks GatherBlockQuantized and runs
#: MatMulNBits far slower than fp32 (docs/web.md). No activation is rounded at run time, so the int8
#: scheme's factor of 10 (for XNNPACK's int8 activations) does not apply: the default factor of 4.
WEB_SCHEMES = (
    {"name": "int8-web", "dtype": "int8",
     "bounds": {"kl_mean": 0.05, "kl_p99": 0.5, "same_top1": 0.85, "ppl_ratio": 1.1},
     "description": "8-bit codes folded to float32 when the session loads: runs in onnxruntime-web's default "
                    "WASM build at fp32 speed; a smaller download, not less memory",
     "fold_at_load": True},
    {"name": "int4-web", "dtype": "int4", "bounds": "int4",
     "description": "the int4 scheme's codes (v_proj/down_proj and the token table at 8 bits) folded to "
                    "float32 when the session loads: runs in onnxruntime-web's default WASM build at fp32 "
                    "speed; a smaller download, not less memory",
     "int4_8bit_layers": ("v_proj", "down_proj"), "fold_at_load": True},
)


class OnnxOptimumTarget(Target):
    name = "onnx"
    title = "ONNX (optimum decoder with KV cache) on onnxruntime"
    module = "onnxruntime"
    package = "onnxruntime"
    dtypes = ("float32", "int8", "int4")
    exporter = "pit_deploy.targets.onnx.export:export_artifact"
    driver = "pit_deploy.targets.onnx.driver:OnnxDriver"
    standalone = ("pit_deploy.runtime.standalone", "OrtDecoder")
    bundle_install = "onnxruntime numpy"
    primary_file = DECODER_NAME
    ship_priority = 20
    web_ready = True
    #: the decoder runs prompt by prompt, the interface graph one call for all ids
    own_schemes = WEB_SCHEMES
    aarch64_engine = ONNXRUNTIME_AARCH64
    aarch64_layout = "plain"
    weight_check = "pit_deploy.evaluate.onnx_weights:check_onnx_weights"

    def streams_tables(self, schemes: Any) -> bool:
        """Float32 exports: the graphs are traced with a few rows of each table and the tables
        written from their rows (:mod:`pit_deploy.exporters.vocab_standin`). A quantized scheme
        calibrates on the model and rounds whole tables, so it needs them."""
        return not any(scheme.quantized for scheme in schemes)

    def aarch64_graphs(self, folder: Path) -> tuple[Path, Path]:
        return decoder_file(folder), interface_file(folder)
    scheme_settings = Target.scheme_settings + ("rounding", "head_activations")

    def primary_path(self, folder: Path) -> str:
        return decoder_file(folder).relative_to(folder).as_posix()

    def shapes(self, config: Any, mode: str, recipe: Any) -> dict[str, Any]:
        return {**super().shapes(config, mode, recipe),
                "decoder": "optimum text-generation-with-past (dynamic batch/sequence/past)"}

    def weight_grid(self, scheme: Any, mode: str) -> WeightGrid:
        """``MatMulNBits`` everywhere: asymmetric blocks of ``group_size`` (8-bit ones too), the
        head and the embedding on the ``table_bits`` table (:mod:`pit_deploy.exporters.quantize_onnx`)."""
        return WeightGrid(symmetric=False, per_channel_8bit=False, head_bits=scheme.table_bits,
                          embed_bits=scheme.table_bits)

    def verify_extras(self, ctx: Any, art: Any, result: Any, quantized: bool) -> None:
        """``verify --web``: the folder as transformers.js runs it (:mod:`pit_deploy.targets.onnx.web_check`)."""
        if ctx.web_clients:
            resolve("pit_deploy.targets.onnx.web_check:verify_web")(ctx, art, result)

    def interface_checks(self, folder: Path, dim: int) -> tuple[bool | None, list[str]]:
        """The interface graph must read the decoder's weight bytes (else ``delta_ti`` would be
        measured on a copy that the decoder does not run)."""
        shared, message = resolve("pit_deploy.targets.onnx.interface_weights:shared_weights")(folder, min_elements=dim * dim)
        return shared, [message]


TARGET = register_target(OnnxOptimumTarget())

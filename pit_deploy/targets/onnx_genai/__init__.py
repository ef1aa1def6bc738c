"""The ``onnx-genai`` target: a folder that ``onnxruntime_genai.Model(folder)`` loads and
generates with, its fused decoder written by the onnxruntime-genai model builder.

Artifact layout: :data:`DECODER_NAME` + :data:`BUILDER_DATA` (the builder's fused decoder and
its external weights), :data:`CONFIG_NAME` (the genai runtime's config), the tokenizer files the
builder copies, and :data:`INTERFACE_NAME` (the decoder's own embedding and head nodes, reading
the decoder's weight bytes, so verification measures the runtime's own ``W_out E``).
Exporter: :mod:`pit_deploy.targets.onnx_genai.export`; driver: :mod:`pit_deploy.targets.onnx_genai.driver`; on a
device: ``OrtDecoder`` of :mod:`pit_deploy.runtime.standalone` (numpy + onnxruntime only), which
reads both ONNX layouts.

Standard library only at import; the hooks import what they call.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ...errors import PitError
from .. import register_target
from ..base import ONNXRUNTIME_AARCH64, Target, VerifyContext, WeightGrid, resolve

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
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
BUILDER_ARCHITECTURES: tuple[str, ...] = tuple(BUILDER_FAMILIES.values())
#: the model types whose embedding the builder multiplies by √d rounded to two decimals
#: (``builders/gemma.py``: ``np.round(np.sqrt(hidden_size), decimals=2)``), not by √d itself
ROUNDED_EMBEDDING_SCALE: tuple[str, ...] = ("gemma", "gemma2", "gemma3_text")


def builder_embedding_multiplier(config: Any, multiplier: float) -> float:
    """The multiplier the builder's graph applies to the gathered embedding rows, where the model
    applies ``multiplier``: a table exported for the builder is divided by this one, so that the
    rows the decoder reads are the model's exactly (dividing by √d where the graph multiplies by
    √d rounded, 25.3 for 25.2982 at d = 640, would leave ``W_out E`` off the identity by 1.7e-3)."""
    if getattr(config, "model_type", None) in ROUNDED_EMBEDDING_SCALE:
        return round(math.sqrt(config.hidden_size), 2)  # np.round's rint(x·100)/100, the same double
    return float(multiplier)
#: onnxruntime's GroupQueryAttention (the builder's attention) takes head sizes in multiples of this
HEAD_SIZE_MULTIPLE = 16
#: the body linears the builder writes a node for, by their Hugging Face name, and the builder
#: node path(s) computing each (``/model/layers.{i}/<path>/MatMul``): the linears
#: ``int4_8bit_layers`` can keep at 8 bits through its int8 overrides. Phi-3 fuses its query, key
#: and value into ``qkv_proj`` (the builder keeps that node) and its gate and up projections into
#: ``gate_up_proj`` (the builder splits it into ``gate_proj`` and ``up_proj``)
BUILDER_PROJECTIONS: dict[str, tuple[str, ...]] = {
    **{p: (f"attn/{p}",) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")},
    **{p: (f"mlp/{p}",) for p in ("gate_proj", "up_proj", "down_proj")},
    "gate_up_proj": ("mlp/gate_proj", "mlp/up_proj"),
}


def unknown_projections(names: tuple[str, ...] | list[str]) -> list[str]:
    """The names of ``int4_8bit_layers`` whose last component is no projection the builder writes
    a node for (:data:`BUILDER_PROJECTIONS`)."""
    return [name for name in names if name.rsplit(".", 1)[-1] not in BUILDER_PROJECTIONS]


def head_size(config: dict[str, Any]) -> int:
    """The attention head size of a model config (``head_dim``, else hidden size / heads)."""
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def check_interface_graph(path: Path) -> None:
    """Refuse (exit 2) an :data:`INTERFACE_NAME` that is not an interface graph: ``input_ids``
    and ``hidden`` in, ``embeddings`` and ``head_logits`` out (read without its weights)."""
    import onnx

    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception as exc:  # noqa: BLE001 — onnx raises several types for a damaged file
        raise PitError(f"{path} cannot be read as ONNX ({type(exc).__name__}); re-export") from None
    inits = {i.name for i in graph.initializer}
    inputs = sorted(i.name for i in graph.input if i.name not in inits)
    outputs = sorted(o.name for o in graph.output)
    if inputs != ["hidden", "input_ids"] or not {"embeddings", "head_logits"} <= set(outputs):
        raise PitError(f"{path} is not an interface graph (inputs {inputs}, outputs {outputs}; expected input_ids and "
                       "hidden in, embeddings and head_logits out); re-export")


def read_genai_config(folder: Path) -> Any:
    """The parsed :data:`CONFIG_NAME` of ``folder``.

    Raises:
        PitError: it cannot be read or is not JSON (named, not the decoder).
    """
    import json

    path = folder / CONFIG_NAME
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PitError(f"{path} cannot be read ({type(exc).__name__}: {exc}); re-export") from None


class OnnxGenaiTarget(Target):
    name = "onnx-genai"
    title = "onnxruntime-genai folder (model builder's fused decoder, genai_config.json)"
    module = "onnxruntime_genai"
    package = "onnxruntime-genai"
    dtypes = ("float32", "int8", "int4")
    model_types = tuple(BUILDER_FAMILIES)
    splits_fused = True
    exporter = "pit_deploy.targets.onnx_genai.export:export_artifact"
    driver = "pit_deploy.targets.onnx_genai.driver:GenaiDriver"
    primary_file = DECODER_NAME
    standalone = ("pit_deploy.runtime.standalone", "OrtDecoder")
    bundle_install = "onnxruntime numpy"
    ship_priority = 15
    #: the builder's decoder takes batched inputs; the interface graph is the onnx target's
    aarch64_engine = ONNXRUNTIME_AARCH64
    aarch64_layout = "batched"
    weight_check = "pit_deploy.evaluate.onnx_weights:check_onnx_weights"

    def aarch64_graphs(self, folder: Path) -> tuple[Path, Path]:
        return folder / DECODER_NAME, folder / INTERFACE_NAME
    #: opt-in (``--runtime onnx-genai``): it needs onnxruntime-genai and builds fewer families
    #: (no GPT-2) than the default targets
    default_export = False
    #: the builder quantizes the body with the scheme's block size and keeps the scheme's 8-bit
    #: layers through its int8 overrides; the token table of a factorized artifact is quantized
    #: like the ``onnx`` target's (table bits, PIT correction)
    scheme_settings = Target.scheme_settings + ("rounding", "head_activations", "genai_group_size")

    def scheme_for(self, scheme: Any) -> Any:
        """``genai_group_size``, where set, is this target's ``group_size``."""
        if scheme.quantized and scheme.genai_group_size:
            return scheme.with_settings(group_size=scheme.genai_group_size)
        return scheme

    def weight_grid(self, scheme: Any, mode: str) -> WeightGrid:
        """The body's ``MatMulNBits`` in blocks of ``group_size`` (8-bit overrides too): with
        ``rounding = "rtn"`` the builder's own, symmetric; with ``gptq`` the calibrated model's
        codes, asymmetric with integer zero points
        (:func:`pit_deploy.targets.onnx_genai.export.write_calibrated_body`), which onnxruntime's
        int8-activation kernel reads at the symmetric blocks' speed and which round 19 % closer
        (``studies/onnx-genai-int4.md``). Factorized: our token table, asymmetric at
        ``table_bits`` as on the ``onnx`` target. Materialized: the builder rounds the head
        symmetrically and keeps the embedding float32."""
        body_symmetric = scheme.rounding != "gptq"
        if mode == "factorized":
            return WeightGrid(symmetric=body_symmetric, per_channel_8bit=False, head_bits=scheme.table_bits,
                              embed_bits=scheme.table_bits, full_range=True, table_symmetric=False)
        return WeightGrid(symmetric=body_symmetric, per_channel_8bit=False, head_bits=8 if scheme.dtype == "int8" else 4,
                          embed_bits=0, full_range=True, table_symmetric=True)

    def precheck(self, config: Any, recipe: Any) -> None:
        """Refuse, before any slow work (calibration, GPTQ): a missing builder, a family it cannot
        build, a head size its attention cannot run, an int4 linear kept at 8 bits that the builder
        writes no node of its own for."""
        if not self.installed():
            raise PitError(f"the {self.name} runtime needs the onnxruntime-genai model builder; "
                           f"install it with `pip install {self.package}==0.18.0`")
        model_type = getattr(config, "model_type", None)
        if model_type not in BUILDER_FAMILIES:
            raise PitError(f"the {self.name} runtime builds {', '.join(BUILDER_FAMILIES)} models with the "
                           f"onnxruntime-genai builder; {model_type!r} is not one of them")
        head = head_size(config.to_dict() if hasattr(config, "to_dict") else vars(config))
        if head % HEAD_SIZE_MULTIPLE:
            raise PitError(f"the {self.name} runtime runs attention in onnxruntime's GroupQueryAttention, whose head "
                           f"size must be a multiple of {HEAD_SIZE_MULTIPLE}; this model's is {head} (hidden size "
                           f"{config.hidden_size} / {config.num_attention_heads} heads) — export it with --runtime onnx")
        for scheme in recipe.schemes(config):
            unknown = unknown_projections(scheme.int4_8bit_layers) if scheme.dtype == "int4" else []
            if unknown:
                raise PitError(f"int4_8bit_layers {', '.join(repr(n) for n in unknown)} ({scheme.name}): the "
                               f"onnxruntime-genai builder writes no node of its own for it, so the {self.name} runtime "
                               f"cannot keep it at 8 bits (it can: {', '.join(BUILDER_PROJECTIONS)}); drop it from "
                               "--int4-8bit-layers or export it with --runtime onnx")

    def precheck_tokenizer(self, tokenizer: Any) -> None:
        """The folder needs the tokenizer (onnxruntime-genai loads it from there)."""
        if tokenizer is None:
            raise PitError("an onnxruntime-genai folder needs the tokenizer; the source has none (add its tokenizer "
                           "files to the model directory)")

    #: the tokenizer files onnxruntime-genai loads, and the folder's own files
    required_files = (("tokenizer.json", "tokenizer.model"), ("tokenizer_config.json",), (CONFIG_NAME,),
                      (DECODER_NAME,), (INTERFACE_NAME,))

    def config_references(self, folder: Path) -> list[tuple[str, str, Any]]:
        """Every ``filename`` in :data:`CONFIG_NAME` (the decoder's, and any other session's)."""
        found: list[tuple[str, str, Any]] = []

        def walk(node: Any, key: str) -> None:
            if isinstance(node, dict):
                for name, value in node.items():
                    where = f"{key}.{name}" if key else str(name)
                    if name == "filename" or str(name).endswith("_filename"):
                        found.append((CONFIG_NAME, where, value))
                    else:
                        walk(value, where)
            elif isinstance(node, list):
                for i, value in enumerate(node):
                    walk(value, f"{key}[{i}]")

        walk(read_genai_config(folder), "")
        return found

    def check_files(self, directory: Path, art: Any) -> None:
        """The generic checks, then: the decoder the config names is :data:`DECODER_NAME` (the
        file ``verify`` measures), and the config's shapes are the reference model's (a wrong
        ``head_size`` would make the genai runtime read the cache wrong)."""
        super().check_files(directory, art)
        folder = Path(directory) / art.path
        config = read_genai_config(folder)
        model = config.get("model") if isinstance(config, dict) else None
        decoder = model.get("decoder") if isinstance(model, dict) else None
        if not isinstance(decoder, dict):
            raise PitError(f"{folder / CONFIG_NAME} has no model.decoder section; the file was edited — re-export")
        if decoder.get("filename") != DECODER_NAME:
            raise PitError(f"{folder / CONFIG_NAME}: model.decoder.filename is {decoder.get('filename')!r}, not "
                           f"{DECODER_NAME!r}, the decoder verify measures; the file was edited — re-export")
        check_interface_graph(folder / INTERFACE_NAME)
        try:
            import json

            ref = json.loads((Path(directory) / "reference" / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return  # the reference is checked (and refused) where it is loaded
        expected = {"head_size": head_size(ref), "hidden_size": ref.get("hidden_size"),
                    "num_attention_heads": ref.get("num_attention_heads"),
                    "num_key_value_heads": ref.get("num_key_value_heads") or ref.get("num_attention_heads"),
                    "num_hidden_layers": ref.get("num_hidden_layers")}
        for key, want in expected.items():
            if want is not None and key in decoder and decoder[key] != want:
                raise PitError(f"{folder / CONFIG_NAME}: model.decoder.{key} is {decoder[key]!r}, the model's is "
                               f"{want!r}; the file was edited or does not belong to this export — re-export")
        # the builder writes the model's own context; a shorter one makes the runtime refuse every
        # generation past it (and a longer one lets it write past the position table)
        context, want = model.get("context_length"), ref.get("max_position_embeddings")
        if isinstance(want, int) and context != want:
            raise PitError(f"{folder / CONFIG_NAME}: model.context_length is {context!r}, the model's is {want!r} "
                           "(max_position_embeddings); the file was edited or does not belong to this export — "
                           "re-export")

    def shapes(self, config: Any, mode: str, recipe: Any) -> dict[str, Any]:
        return {**super().shapes(config, mode, recipe),
                "decoder": "onnxruntime-genai builder (GroupQueryAttention, dynamic batch/sequence/past)"}

    def interface_checks(self, folder: Path, dim: int) -> tuple[bool | None, list[str]]:
        """The interface graph must read the decoder's weight bytes."""
        shared, message = resolve("pit_deploy.targets.onnx_genai.driver:shared_interface_weights")(folder, dim * dim)
        return shared, [message]

    def verify_extras(self, ctx: VerifyContext, art: Any, result: Any, quantized: bool) -> None:
        """Load the folder with ``onnxruntime_genai.Model`` and compare its generator's logits
        with the decoder session's (the same graph through the genai runtime's own KV cache)."""
        resolve("pit_deploy.targets.onnx_genai.driver:check_generator")(ctx, art, result, quantized)


TARGET = register_target(OnnxGenaiTarget())

"""Export a prepared model to a folder that ``onnxruntime_genai.Model(folder)`` loads.

The decoder graph is not ours: the onnxruntime-genai model builder
(``python -m onnxruntime_genai.models.builder``, PyPI ``onnxruntime-genai``) writes the fused
graph (``GroupQueryAttention``, ``SkipSimplifiedLayerNormalization``, ``MatMulNBits`` when
quantized) together with ``genai_config.json`` and the tokenizer files that the genai runtime
reads. We give it a plain Hugging Face checkpoint in a temporary directory and keep its folder.

* **materialized** — the builder reads ``E = Z T⁻¹`` and ``W_out = T Zᵀ`` as ordinary weights.
* **quantized** — the builder writes the body's ``MatMulNBits`` (symmetric blocks); for a scheme
  that rounds by GPTQ the pipeline hands over a calibrated model, whose codes (asymmetric, with
  integer zero points) replace the builder's own rounding node by node
  (:func:`write_calibrated_body`).
* **factorized** — the builder reads the same materialized checkpoint, then the token interface
  of its graph is rewritten (:func:`factorize_graph`): the embedding ``Gather`` becomes
  ``Gather(Zᵀ, ids, axis=1) → Transpose → MatMul(M)`` with ``M = T⁻¹`` and the head ``MatMul``
  becomes ``MatMul(h, T) → MatMul(·, Zᵀ)``, both reading the one ``Zᵀ`` initializer.

Beside ``model.onnx`` we write ``interface.onnx`` (``(input_ids[1, N], hidden[1, M, d]) ->
(embeddings, logits)``): the nodes of the decoder between ``input_ids`` and the first layer's
norm, and between the final norm and ``logits``, copied with their initializers still pointing
into the decoder's external data file — the runtime's own ``W_out E`` by construction.

The builder is run in a child process: importing it appends its own directory to ``sys.path``
(top-level modules named ``builders`` and ``quantization``), and builder 0.18.0 needs four
corrections under transformers 4.57, which the child makes before running it
(:mod:`pit_deploy.targets.onnx_genai.builder_child`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from transformers import PreTrainedModel

from ...errors import PitError
from ...exporters.vocab_standin import VocabStandin, standin_size
from ...io.checkpoint import compact_tokenizer_json, save_model
from ...model.core import row_chunks
from ...model.families import FUSED_PROJECTIONS
from ...schemes import Scheme, names_linear
from . import (BUILDER_ARCHITECTURES, BUILDER_DATA, BUILDER_PROJECTIONS, CONFIG_NAME, DECODER_NAME, INTERFACE_NAME,
               builder_embedding_multiplier, unknown_projections)

#: builder ``-p`` value of each dtype the target exports
PRECISIONS = {"float32": "fp32", "int8": "int8", "int4": "int4"}

#: the child's script: the builder's ``__main__`` after four corrections (read its docstring)
_CHILD = Path(__file__).with_name("builder_child.py")


def builder_checkpoint(model: PreTrainedModel, tokenizer: Any, out: Path) -> Path:
    """Save ``model`` (a plain HF model) as the checkpoint the builder reads.

    ``architectures`` is set (the builder dispatches on its first entry; transformers'
    ``save_pretrained`` of a model built from a config leaves it out).
    """
    arch = type(model).__name__
    if arch not in BUILDER_ARCHITECTURES:
        raise PitError(f"the onnxruntime-genai builder has no {arch}; supported: {', '.join(BUILDER_ARCHITECTURES)}")
    save_model(model, out, tokenizer, force=True)
    path = out / "config.json"
    config = json.loads(path.read_text())
    config["architectures"] = [arch]
    path.write_text(json.dumps(config, indent=2))
    return out


def _die_with_parent() -> Any:
    """A ``preexec_fn`` that makes the child get SIGKILL when this process dies, however it
    dies (Linux ``prctl(PR_SET_PDEATHSIG)``): a killed export leaves no builder running.
    ``None`` elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import signal

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm


def run_builder(hf_dir: Path, out_dir: Path, precision: str, cache_dir: Path,
                extra_options: dict[str, str] | None = None, target_options: dict[str, Any] | None = None) -> None:
    """``python -m onnxruntime_genai.models.builder -i hf_dir -o out_dir -p precision -e cpu``.

    Raises:
        PitError: the builder failed (its last lines of output are in the message).
    """
    cmd = [sys.executable, "-c", _CHILD.read_text(), "-i", str(hf_dir), "-o", str(out_dir), "-p", precision,
           "-e", "cpu", "-c", str(cache_dir)]
    if extra_options:
        cmd += ["--extra_options", *(f"{k}={v}" for k, v in extra_options.items())]
    if target_options:  # the builder's structured config (version 2): per-node quantization overrides
        cmd += ["--builder_config_version", "2", "--target_options", json.dumps(target_options)]
    # offline: everything the builder reads is in hf_dir; a hub lookup would only stall
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, preexec_fn=_die_with_parent())
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise PitError(f"the onnxruntime-genai builder failed (exit {proc.returncode}):\n{tail}")



def int8_overrides(layers: tuple[str, ...] | list[str], num_layers: int) -> tuple[dict[str, str], dict[str, Any]]:
    """The builder options that keep the linears named in ``layers`` (the int4 scheme's
    ``int4_8bit_layers``: ``v_proj`` in every layer, ``layers.3.mlp.down_proj`` in one,
    :func:`~pit_deploy.schemes.names_linear`) at 8 bits: exact-name ``int8`` overrides of the
    builder's structured quantization config, and ``fuse_qkv=false`` when a query/key/value
    projection is among them (fused, it has no node of its own).

    Raises:
        PitError: a name the builder has no projection node for (the target's precheck refuses it
            before any work; this guards direct callers).
    """
    unknown = unknown_projections(layers)
    if unknown:
        raise PitError(f"int4_8bit_layers {unknown}: the onnxruntime-genai builder has no such projection "
                       f"(known: {', '.join(BUILDER_PROJECTIONS)})")
    names, hf_parent = tuple(layers), {"attn": "self_attn", "mlp": "mlp"}
    overrides, projections = [], set()
    for i in range(num_layers):
        for proj, nodes in BUILDER_PROJECTIONS.items():
            if names_linear(f"model.layers.{i}.{hf_parent[nodes[0].split('/')[0]]}.{proj}", names):
                overrides += [{"match": {"name": f"/model/layers.{i}/{node}/MatMul"}, "type": "int8"} for node in nodes]
                projections.add(proj)
    extra = {"fuse_qkv": "false"} if projections & {"q_proj", "k_proj", "v_proj"} else {}
    return extra, ({"quant_config": {"weights": {"overrides": overrides}}} if overrides else {})


def _plain_twin(model: PreTrainedModel) -> PreTrainedModel:
    """The plain HF model the builder reads: ``model`` itself when materialized; for a
    factorized model, a materialized copy built from its ``pit_factors`` (the builder must see
    an ordinary embedding and head; :func:`factorize_graph` replaces them afterwards)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import no_init_weights

    from ...model.families import adapter_for
    from ...exporters.passes import FACTORS_ATTR

    factors = getattr(model, FACTORS_ATTR, None)
    if factors is None:
        return model
    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = False  # E and W_out are two different matrices (as materialize says)
    adapter = adapter_for(config)
    with no_init_weights():
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # drop the factors and whatever the PIT embedding/head modules hold (they read the factors)
    modules = {id(mod): name for name, mod in model.named_modules()}
    prefixes = (FACTORS_ATTR + ".", modules[id(model.get_input_embeddings())] + ".",
                modules[id(model.get_output_embeddings())] + ".")
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(prefixes)}
    zt = factors.Zt.detach()
    t, t_inv = (getattr(factors, n).detach().to(torch.float64) for n in ("T", "T_inv"))
    emb_name = next(n for n, p in plain.named_parameters() if p is plain.get_input_embeddings().weight)
    head_name = next(n for n, p in plain.named_parameters() if p is plain.get_output_embeddings().weight)
    # written into the twin's own (uninitialized) tables, which load_state_dict then keeps
    embedding, head = plain.get_input_embeddings().weight.data, plain.get_output_embeddings().weight.data
    emb_scale, head_scale = adapter.embedding_multiplier(config), adapter.logits_multiplier(config)
    # E = Z T⁻¹ and W_out = T Zᵀ in float64, a chunk of tokens at a time (the same products,
    # token for token): no float64 copy of a 262k-token table
    for part, rows in row_chunks(zt.T):
        embedding[part] = ((rows @ t_inv) / emb_scale).float()
        head[part] = ((t @ rows.T).T / head_scale).float()
    state[emb_name], state[head_name] = embedding, head
    bias = getattr(model.get_output_embeddings(), "bias", None)
    if bias is not None:
        state[head_name.rsplit(".", 1)[0] + ".bias"] = bias.detach().float()
    # assign: the twin reads the body's tensors and its own two tables, no copy into them
    missing, unexpected = plain.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise PitError(f"cannot rebuild a plain twin for the builder: missing {missing}, unexpected {unexpected}")
    return plain.eval()


@contextlib.contextmanager
def _table_for_builder(model: PreTrainedModel) -> Iterator[None]:
    """While the builder's checkpoint is written: ``model``'s embedding table rescaled from the
    model's multiplier to the one the builder's graph applies
    (:func:`~pit_deploy.targets.onnx_genai.builder_embedding_multiplier`), so the decoder reads
    the model's rows exactly; the model's own tensor is put back afterwards, untouched."""
    from ...model.families import adapter_for

    config = model.config
    ours = float(adapter_for(config).embedding_multiplier(config))
    theirs = builder_embedding_multiplier(config, ours)
    weight = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if theirs == ours or (head is not None and head.weight is weight):
        # a tied table (the transpose-tied baseline) is the head too: it is left as the builder
        # builds any tied Gemma, with the builder's rounded scale
        yield
        return
    original = weight.data
    scaled = torch.empty_like(original)
    for part, rows in row_chunks(original, ours / theirs):  # float64 a chunk at a time: 2.6 GB at 262k tokens whole
        scaled[part] = rows.to(original.dtype)
    weight.data = scaled
    try:
        yield
    finally:
        weight.data = original


# --------------------------------------------------------------------------------------
# graph surgery on the builder's decoder
# --------------------------------------------------------------------------------------


def _producers(graph) -> dict[str, Any]:
    return {out: node for node in graph.node for out in node.output}


def _interface_tensors(graph) -> tuple[str, str]:
    """``(embedding_output, head_input)``: the tensor the first layer's input norm reads (the
    effective embedding, multipliers applied) and the final norm's output that the head reads.

    The builder names its nodes after the HF modules (``/model/layers.0/input_layernorm/…``,
    ``/model/layers.{L}/final_norm_layernorm/…``); we rely on those names and fail loudly when
    a builder version changes them.
    """
    first_norm = next((n for n in graph.node if n.name.startswith("/model/layers.0/input_layernorm/")), None)
    final_norm = next((n for n in graph.node if "/final_norm_layernorm/" in n.name), None)
    if first_norm is None or final_norm is None:
        raise PitError("the builder's graph has no /model/layers.0/input_layernorm or final_norm_layernorm node; "
                       "this onnxruntime-genai version names its nodes differently")
    return first_norm.input[0], final_norm.output[0]


def _subgraph(graph, start: str, end: str) -> list[Any]:
    """The nodes that compute ``end`` from ``start`` and constants, in graph order.

    Raises:
        PitError: ``end`` depends on another graph input (the cut is not clean).
    """
    producers = _producers(graph)
    initializers = {i.name for i in graph.initializer}
    inputs = {i.name for i in graph.input}
    wanted: set[str] = set()
    stack = [end]
    while stack:
        name = stack.pop()
        if name == start or name in initializers or not name:
            continue
        node = producers.get(name)
        if node is None:
            if name in inputs:
                raise PitError(f"{end} depends on the graph input {name}, not only on {start}")
            continue
        key = node.output[0]
        if key in wanted:
            continue
        wanted.add(key)
        stack.extend(node.input)
    return [n for n in graph.node if n.output[0] in wanted]


def write_interface_graph(folder: Path) -> dict[str, Any]:
    """Write ``interface.onnx``: the decoder's own embedding and head nodes, reading the
    decoder's external data (initializers are copied as references, not bytes)."""
    import onnx
    from onnx import TensorProto, helper

    decoder = onnx.load(str(folder / DECODER_NAME), load_external_data=False)
    graph = decoder.graph
    emb_out, head_in = _interface_tensors(graph)
    emb_nodes = _subgraph(graph, "input_ids", emb_out)
    head_nodes = _subgraph(graph, head_in, "logits")
    used = {name for node in emb_nodes + head_nodes for name in node.input}
    inits = [i for i in graph.initializer if i.name in used]
    nodes = list(emb_nodes) + list(head_nodes)
    # rename the head's input to "hidden" and expose the two outputs under fixed names
    for node in head_nodes:
        for i, name in enumerate(node.input):
            if name == head_in:
                node.input[i] = "hidden"
    nodes += [helper.make_node("Identity", [emb_out], ["embeddings"], name="/interface/embeddings"),
              helper.make_node("Identity", ["logits"], ["head_logits"], name="/interface/logits")]
    io_type = next(i for i in graph.input if i.name.startswith("past_key_values")).type.tensor_type.elem_type
    new_graph = helper.make_graph(
        nodes, "pit_interface",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "n"]),
         helper.make_tensor_value_info("hidden", io_type, [1, "m", None])],
        [helper.make_tensor_value_info("embeddings", io_type, [1, "n", None]),
         helper.make_tensor_value_info("head_logits", io_type, [1, "m", None])],
        initializer=inits,
    )
    model = helper.make_model(new_graph, opset_imports=list(decoder.opset_import), ir_version=decoder.ir_version)
    onnx.save_model(model, str(folder / INTERFACE_NAME))
    return {"interface": INTERFACE_NAME, "embedding_nodes": [n.op_type for n in emb_nodes],
            "head_nodes": [n.op_type for n in head_nodes],
            "interface_tensors_shared": [i.name for i in inits if i.data_location == onnx.TensorProto.EXTERNAL]}


# --------------------------------------------------------------------------------------
# calibrated codes in the builder's body
# --------------------------------------------------------------------------------------

#: a body ``MatMulNBits`` of the builder: ``/model/layers.{i}/{attn|mlp}/{projection}/MatMul_Q{bits}``
_BODY_NODE = re.compile(r"/model/layers\.(\d+)/(?:attn|mlp)/(\w+)/MatMul_Q\d+")
#: the module path of a body linear of a Hugging Face decoder (``…layers.{i}.self_attn.q_proj``)
_BODY_LINEAR = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")


def _builder_blocks(rounded: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int, int]:
    """``(packed codes, scales, packed zero points or None, bits, block)`` of a ``MatMulNBits``
    that stacks ``rounded`` (the calibrated linears it computes, output rows in order), in
    onnxruntime's layout. Asymmetric codes are laid out with their zero points as the ``onnx``
    target lays out its own (:func:`~pit_deploy.exporters.onnx_tables.block_table_from_codes`).
    A symmetric grid has none, as the builder writes it: onnxruntime subtracts its default
    ``2^(b−1)``, so a code ``q`` is stored as ``q + 2^(b−1)`` (4-bit ones two a byte, low nibble
    first).

    Raises:
        RuntimeError: parts on different grids, or codes outside the grid (internal errors: the
            pipeline calibrates every linear of a node on the target's one grid).
    """
    from ...exporters.calibrated_rounding import RoundedWeight
    from ...exporters.onnx_tables import block_table_from_codes

    grids = {(r.grid, r.codes.shape[1] // r.scales.shape[1]) for r in rounded}
    if len(grids) != 1:
        raise RuntimeError(f"one MatMulNBits stacks linears on different grids: {sorted(map(str, grids))}")
    (grid, block), = grids
    bits = grid.bits
    stacked = RoundedWeight(*(torch.cat([getattr(r, f) for r in rounded]) for f in ("codes", "scales", "zeros")), grid)
    codes = stacked.codes.numpy().astype(np.int32) + (2 ** (bits - 1) if grid.symmetric else 0)
    if codes.min() < 0 or codes.max() >= 2 ** bits:
        raise RuntimeError(f"calibrated codes outside the {bits}-bit range")
    if not grid.symmetric:
        table = block_table_from_codes(stacked)
        return table.packed, table.scales, table.zero_points, bits, block
    n, k = codes.shape
    packed = codes.astype(np.uint8).reshape(n, k // block, block)
    if bits == 4:
        packed = packed[..., 0::2] | (packed[..., 1::2] << 4)
    scales = stacked.scales.numpy().astype(np.float32)
    return np.ascontiguousarray(packed), np.ascontiguousarray(scales), None, bits, block


def write_calibrated_body(model: Any, codes: dict[str, Any]) -> int:
    """Put a calibrated model's GPTQ codes (:func:`~pit_deploy.exporters.calibrated_rounding.
    rounded_weights`, by module name) into the body ``MatMulNBits`` of the builder's decoder
    ``model`` (loaded with its external data), in place of the builder's own rounding; returns
    how many nodes were rewritten.

    Why after the builder rather than through it: the builder rounds whatever weights it reads
    to nearest on its own grid (the scale from each block's largest weight), which moves the
    codes of any block whose largest weight GPTQ left off the grid's end; writing the codes
    into its nodes keeps its graph (fusions, ``GroupQueryAttention``, ``accuracy_level``) and
    makes the folder the exact twin of the calibrated model's weights. Asymmetric codes bring
    their zero points, which become the node's optional fourth input; their bits and block size
    must be the node's.

    Raises:
        RuntimeError: a body node without codes, codes without a node, or codes whose shape is
            not the node's (internal errors: each would leave a linear rounded twice, not as
            calibrated, or wrong).
    """
    from onnx import numpy_helper

    by_linear: dict[tuple[int, str], Any] = {}
    for name, rounded in codes.items():
        match = _BODY_LINEAR.search(name)
        if match is None:
            raise RuntimeError(f"calibrated linear {name} is no decoder-layer projection the builder writes")
        by_linear[(int(match.group(1)), match.group(2))] = rounded
    inits = {i.name: i for i in model.graph.initializer}
    used: set[tuple[int, str]] = set()
    for node in model.graph.node:
        match = _BODY_NODE.fullmatch(node.name)
        if node.op_type != "MatMulNBits" or match is None:
            continue
        layer, projection = int(match.group(1)), match.group(2)
        packed_parts = () if (layer, projection) in by_linear else FUSED_PROJECTIONS.get(projection, ())
        parts = [(layer, p) for p in packed_parts or (projection,)]
        missing = [p for p in parts if p not in by_linear]
        if missing:
            raise RuntimeError(f"{node.name}: no calibrated codes for {missing}")
        if len(node.input) > 3 and node.input[3]:
            raise RuntimeError(f"{node.name} has zero points; the builder was asked for symmetric blocks")
        attrs = {a.name: a.i for a in node.attribute}
        packed, scales, zeros, bits, block = _builder_blocks([by_linear[p] for p in parts])
        if (bits, block) != (attrs["bits"], attrs["block_size"]):
            raise RuntimeError(f"{node.name} is {attrs['bits']}-bit in blocks of {attrs['block_size']}, its "
                               f"calibrated codes {bits}-bit in blocks of {block}")
        for name, array in ((node.input[1], packed), (node.input[2], scales)):
            old = inits[name]
            if array.size != int(np.prod(old.dims)):
                raise RuntimeError(f"{node.name}: {name} holds {tuple(old.dims)}, the codes give {array.shape}")
            old.CopyFrom(numpy_helper.from_array(array.reshape(tuple(old.dims)), name))
        if zeros is not None:
            # one flat vector, as the scales the builder writes: N rows of ⌈blocks·bits/8⌉ bytes
            name = f"{node.input[1]}.zero_points"
            model.graph.initializer.append(numpy_helper.from_array(zeros.reshape(-1), name))
            if len(node.input) > 3:
                node.input[3] = name
            else:
                node.input.append(name)
        used.update(parts)
    if used != set(by_linear):
        raise RuntimeError(f"{len(set(by_linear) - used)} calibrated linears have no MatMulNBits in the builder's graph")
    return len(used)


def save_decoder(model: Any, folder: Path) -> None:
    """Write the decoder ``model`` (its external data loaded) back over the folder's, every
    initializer in :data:`BUILDER_DATA`."""
    import onnx

    (folder / BUILDER_DATA).unlink()  # the external data is in memory; saving appends to an existing file
    onnx.save_model(model, str(folder / DECODER_NAME), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=BUILDER_DATA, size_threshold=0)


# --------------------------------------------------------------------------------------
# the target's exporter
# --------------------------------------------------------------------------------------


@torch.no_grad()
def export_genai(model: PreTrainedModel, out_dir: Path, tokenizer: Any = None, dtype: str = "float32",
                 group_size: int = 32, table_bits: int | None = None, pit_correction: bool = True,
                 int8_layers: tuple[str, ...] = (), head_moments: Any = None,
                 head_int8: bool = False) -> dict[str, Any]:
    """Build the genai folder of ``model`` (materialized, or factorized: see the module
    docstring) into ``out_dir``; returns the manifest details. ``int8_layers``: at int4, the
    linears kept at 8 bits (:func:`int8_overrides`); ``head_int8``: a factorized quantized head
    with int8 activations (:func:`factorize_graph`)."""
    import onnx

    from ...exporters.calibrated_rounding import rounded_weights, split_fused
    from ...exporters.passes import FACTORS_ATTR

    if dtype not in PRECISIONS:
        raise PitError(f"the onnx-genai target exports {', '.join(PRECISIONS)}, not {dtype}")
    if tokenizer is None:
        raise PitError("an onnxruntime-genai folder needs the tokenizer; the source has none")
    factorized = getattr(model, FACTORS_ATTR, None) is not None
    out_dir.mkdir(parents=True, exist_ok=True)
    extra: dict[str, str] = {}
    if dtype != "float32":
        # the builder's defaults, spelled out so the manifest says what was asked
        extra = {"block_size": str(group_size), "accuracy_level": "4", "is_symmetric": "true"}
    target: dict[str, Any] = {}
    if dtype == "int4" and int8_layers:
        more, target = int8_overrides(tuple(int8_layers), int(model.config.num_hidden_layers))
        extra.update(more)
    if "sliding_attention" in (getattr(model.config, "layer_types", None) or ()):
        # full-length caches in the local layers too: the builder's default ring of window slots
        # (GroupQueryAttention's sliding_window_cache) is read by onnxruntime-genai's own cache
        # manager only, while verify runs the graph in plain onnxruntime with a cache that grows
        # by each step; the attention itself keeps the window (its local_window_size)
        extra["windowed_kv_cache"] = "false"
    # beside the artifact: inside an export's partial directory, which the next export removes if
    # this process is killed (a copy in the system temp folder would stay there for good)
    # the builder's token tables are replaced when the graph is factorized: it builds the body
    # of a few-row stand-in (pit_deploy.exporters.vocab_standin), never the V×d tables
    v, d = int(model.config.vocab_size), int(model.config.hidden_size)
    size = standin_size(model, v, d) if factorized else None
    # the builder splits Phi-3's gate_up_proj into gate_proj and up_proj nodes
    calibrated = split_fused(rounded_weights(model)) if dtype != "float32" else {}
    for standin in ([VocabStandin(model, v, d, size)] if size is not None else []) + [None]:
        with tempfile.TemporaryDirectory(prefix=".pit-genai-", dir=out_dir.parent) as tmp:
            with standin.applied() if standin is not None else contextlib.nullcontext():
                twin = _plain_twin(model)
                with _table_for_builder(twin):
                    hf_dir = builder_checkpoint(twin, tokenizer, Path(tmp) / "hf")
                del twin  # the builder reads the checkpoint; a factorized model's twin holds two V×d tables
            run_builder(hf_dir, out_dir, PRECISIONS[dtype], Path(tmp) / "cache", extra, target)
        if not factorized:
            break
        try:  # the codes go in while the interface is rewritten: the decoder is read and written once
            rewrite = factorize_graph(out_dir, getattr(model, FACTORS_ATTR), model.config, dtype, group_size,
                                      table_bits, pit_correction, head_moments, calibrated, head_int8,
                                      standin_rows=None if standin is None else standin.size)
        except StandinShows:
            for built in (out_dir / DECODER_NAME, out_dir / BUILDER_DATA):
                built.unlink()
            continue
        if standin is not None:
            _genai_config_vocab(out_dir, standin.size, v)
        break
    compacted = compact_tokenizer_json(out_dir)  # the builder saves it indented
    if not factorized:
        rewrite = {}
        if calibrated:
            decoder = onnx.load(str(out_dir / DECODER_NAME), load_external_data=True)
            write_calibrated_body(decoder, calibrated)
            save_decoder(decoder, out_dir)
    details: dict[str, Any] = {**rewrite, "builder": "onnxruntime_genai.models.builder", "precision": PRECISIONS[dtype],
                               "decoder": DECODER_NAME, "decoder_data": BUILDER_DATA, "genai_config": CONFIG_NAME}
    if compacted:
        details["tokenizer_json"] = f"written without indentation ({compacted} bytes smaller, the same JSON)"
    if calibrated:
        details["body_rounding"] = (f"GPTQ codes of {len(calibrated)} linears written into the builder's "
                                    "MatMulNBits (asymmetric, integer zero points)")
    if extra:
        details["builder_extra_options"] = extra
    if target:
        details["builder_int8_layers"] = list(int8_layers)
        if "quantization" in details:
            details["quantization"]["body"] += f"; {', '.join(int8_layers)} at 8 bits (the builder's int8 overrides)"
    details.update(write_interface_graph(out_dir))
    decoder = onnx.load(str(out_dir / DECODER_NAME), load_external_data=False)
    details["decoder_nodes"] = len(decoder.graph.node)
    ops: dict[str, int] = {}
    for node in decoder.graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    details["decoder_ops"] = dict(sorted(ops.items()))
    return details


def factorize_graph(folder: Path, factors: Any, config: Any, dtype: str, group_size: int = 32,
                    table_bits: int | None = None, pit_correction: bool = True,
                    head_moments: Any = None, codes: dict[str, Any] | None = None,
                    head_int8: bool = False, standin_rows: int | None = None) -> dict[str, Any]:
    """Replace the builder's embedding and head weights by one ``Zᵀ`` and two ``d×d`` factors
    (and, with ``codes``, its body's rounding by a calibrated model's: :func:`write_calibrated_body`).

    The builder's graph (read from the materialized twin) computes ``Gather(E_s, ids)`` and
    ``MatMul(h, W_s)`` (``MatMulNBits`` when quantized) with the *stored* weights
    ``E_s = Z T⁻¹ / a`` and ``W_s = T Zᵀ / b`` (``a``, ``b`` the family's embedding and logits
    multipliers, which the builder applies in nodes of their own). They become

    * ``Gather(Zᵀ, ids, axis=1) → Transpose(1, 2, 0) → MatMul(M)`` with ``M = T⁻¹ / a``;
    * ``MatMul(h, T / b) → MatMul(·, Zᵀ)``;

    so the one ``V×d`` tensor of the graph is ``Zᵀ`` and the gather and the head read it. The
    constants are computed in float64 from the factors and cast once.

    For ``int8``/``int4`` (the builder has quantized the body) the table is then quantized the
    way the ``onnx`` target quantizes its factorized graphs (:func:`pit_deploy.exporters.quantize_onnx.quantize_graph`
    with ``body=False``): one block-quantized ``Ẑ`` read by ``GatherBlockQuantized`` and by the
    head's ``MatMulNBits`` (fp32 activations), stored once, and with ``pit_correction``
    ``M = (ẐᵀẐ)⁻¹ T⁻¹ / a`` so that ``W_out E = I`` holds on the runtime. With ``head_moments``
    (``Σ hᵀh`` of the head's input on calibration text) ``Ẑ`` is rounded by GPTQ
    (:func:`pit_deploy.exporters.onnx_tables.calibrated_table`), not to nearest.

    A quantized table holds the rows of ``Z R``, with ``T R`` and ``Rᵀ T⁻¹`` beside it: the
    rotation both ONNX targets give their factorized tables (:func:`pit_deploy.exporters.onnx_tables.rotate_table`).

    ``standin_rows``: the builder read a twin whose tables were cut to that many rows
    (:mod:`pit_deploy.exporters.vocab_standin`); the shapes are given the real vocabulary and
    ``Zᵀ`` is written from the model a part at a time.

    Raises:
        PitError: a graph whose embedding/head is not the plain ``Gather``/``MatMul`` expected.
        StandinShows: ``standin_rows`` appears in the graph other than in the tables replaced.
    """
    import onnx
    from onnx import helper, numpy_helper

    from ...model.families import adapter_for
    from ...exporters.onnx_graph import StoredTable, delete_initializers, mark_pending, save_deduplicated
    from ...exporters.quantize_onnx import quantize_graph
    from ...exporters.vocab_standin import give_vocab

    path = folder / DECODER_NAME
    model = onnx.load(str(path), load_external_data=True)
    if codes:
        write_calibrated_body(model, codes)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    _, head_in = _interface_tensors(graph)
    gather = next((n for n in graph.node if n.op_type == "Gather" and list(n.input)[1:] == ["input_ids"]
                   and n.input[0] in inits), None)
    head = next((n for n in graph.node if n.op_type in ("MatMul", "MatMulNBits") and n.input[0] == head_in
                 and n.input[1] in inits), None)
    if gather is None or head is None:
        raise PitError("the builder's graph has no Gather(table, input_ids) / MatMul(final norm, head) to factorize")
    adapter = adapter_for(config)
    a = builder_embedding_multiplier(config, adapter.embedding_multiplier(config))
    b = float(adapter.logits_multiplier(config))
    zt = factors.Zt.detach().to(torch.float32)  # as it is: a float64 detour rounds back to the same values
    m = factors.T_inv.detach().to(torch.float64) / a
    th = factors.T.detach().to(torch.float64) / b
    names = {"Zt": "pit.Zt", "M": "pit.M", "T": "pit.T"}
    pending = {names["Zt"]: StoredTable(zt)}  # written a part at a time, never copied into the graph
    zt_init = graph.initializer.add()
    zt_init.name = names["Zt"]
    mark_pending(zt_init, pending[names["Zt"]])
    for key, value in (("M", m), ("T", th)):
        graph.initializer.append(numpy_helper.from_array(value.to(torch.float32).numpy(), names[key]))
    del zt
    emb_out, logits = gather.output[0], head.output[0]
    emb_nodes = [
        helper.make_node("Gather", [names["Zt"], "input_ids"], ["/pit/embed/Gather/output_0"], axis=1,
                         name="/pit/embed/Gather"),
        helper.make_node("Transpose", ["/pit/embed/Gather/output_0"], ["/pit/embed/Transpose/output_0"],
                         perm=[1, 2, 0], name="/pit/embed/Transpose"),
        helper.make_node("MatMul", ["/pit/embed/Transpose/output_0", names["M"]], [emb_out], name="/pit/embed/MatMul"),
    ]
    head_nodes = [
        helper.make_node("MatMul", [head_in, names["T"]], ["/pit/head/MatMulT/output_0"], name="/pit/head/MatMulT"),
        helper.make_node("MatMul", ["/pit/head/MatMulT/output_0", names["Zt"]], [logits], name="/pit/head/MatMulZt"),
    ]
    nodes = []
    for node in graph.node:
        if node is gather:
            nodes += emb_nodes
        elif node is head:
            nodes += head_nodes
        else:
            nodes.append(node)
    dropped = {gather.input[0], *(name for name in head.input[1:] if name)}
    still_read = {name for node in nodes for name in node.input}
    del graph.node[:]
    graph.node.extend(nodes)
    delete_initializers(graph, dropped - still_read)
    v, d = factors.vocab_size, factors.hidden_size
    if standin_rows is not None:
        if not give_vocab(graph, standin_rows, v):
            raise StandinShows(f"{standin_rows} appears in the builder's graph beside its token tables")
    details: dict[str, Any] = {"replaced": sorted(dropped),
                               "embedding": "Gather(Zt, axis=1) -> Transpose -> MatMul(M = T^-1 / emb_mult)",
                               "head": "MatMul(T / logits_mult) -> MatMul(Zt)"}
    quant_details: dict[str, Any] | None = None
    if dtype != "float32":
        model, quant = quantize_graph(model, dtype, group_size, v, d, pit_correction, body=False,
                                      table_bits=table_bits, head_moments=head_moments, head_int8=head_int8,
                                      tables=pending)
        if quant.get("pit_correction") and a * b != 1.0:
            # quantize_graph's M = (ẐᵀẐ)⁻¹ (T/b)⁻¹ = b (ẐᵀẐ)⁻¹ T⁻¹; the graph needs (ẐᵀẐ)⁻¹ T⁻¹ / a
            init = next(i for i in model.graph.initializer if i.name == names["M"])
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) / (a * b), names["M"]))
        # the body is the builder's graph (its block size and accuracy level): its own symmetric
        # rounding, or the calibrated codes with their zero points
        quant.pop("body_8bit", None)
        quant["body"] = (f"{'GPTQ codes (asymmetric) in ' if codes else ''}the builder's MatMulNBits ({dtype}, "
                         f"{'' if codes else 'symmetric, '}block {group_size}, accuracy_level 4)")
        quant_details = quant
    (folder / BUILDER_DATA).unlink()
    save_deduplicated(model, path, BUILDER_DATA, pending)  # the gather's and the head's table: one byte range
    saved = onnx.load(str(path), load_external_data=False)
    # the tensors the embedding's gathers (input 0) and the head's matmuls (input 1) read as the
    # token table, and the byte ranges of the data file they occupy: one per table plane
    readers = [(n, 0) for n in saved.graph.node if n.name.startswith("/pit/embed/Gather")
               and n.op_type in ("Gather", "GatherBlockQuantized")] + \
              [(n, 1) for n in saved.graph.node if n.name.startswith("/pit/head/MatMulZt")
               and n.op_type in ("MatMul", "MatMulNBits")]
    tables = {n.input[k] for n, k in readers}
    ranges = {tuple(sorted((e.key, e.value) for e in i.external_data)) for i in saved.graph.initializer
              if i.name in tables}
    details["tables"] = sorted(tables)
    details["table_byte_ranges"] = len(ranges)
    out: dict[str, Any] = {"factorized": details}
    if quant_details is not None:
        out["quantization"] = quant_details  # where verify reads pit_correction / interface_exact
    return out


class StandinShows(Exception):
    """The builder's graph of a stand-in twin cannot be given the real vocabulary back."""


def _genai_config_vocab(folder: Path, size: int, vocab: int) -> None:
    """The builder wrote the stand-in twin's vocabulary size into ``genai_config.json``."""
    path = folder / CONFIG_NAME
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("model", {}).get("vocab_size") == size:
        config["model"]["vocab_size"] = vocab
        path.write_text(json.dumps(config, indent=4), encoding="utf-8")  # as the builder writes it


def export_artifact(model: PreTrainedModel, out_dir: Path, *, tokenizer: Any = None, recipe: Any = None,
                    scheme: Scheme, opset: int | None = None) -> dict[str, Any]:
    """The ``onnx-genai`` target's exporter (:mod:`pit_deploy.targets.onnx_genai`)."""
    from ...exporters.calibrated_rounding import head_moments_array
    from ...exporters.passes import FACTORS_ATTR

    factorized = getattr(model, FACTORS_ATTR, None) is not None
    # the builder writes the body's graph; a calibrated model's GPTQ codes replace its rounding,
    # and the token table is ours, rounded by GPTQ on the same calibration text
    return export_genai(model, out_dir, tokenizer, dtype=scheme.dtype, group_size=scheme.group_size,
                        table_bits=scheme.table_bits, pit_correction=scheme.pit_correction,
                        int8_layers=scheme.int4_8bit_layers if scheme.dtype == "int4" else (),
                        head_moments=head_moments_array(model) if scheme.quantized and factorized else None,
                        head_int8=scheme.head_activations == "int8")

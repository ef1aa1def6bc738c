"""Export a prepared (materialized or factorized) model to ONNX with ``optimum``.

The decoder goes through ``optimum.exporters.onnx.onnx_export_from_model`` with the task
``text-generation-with-past``: inputs ``input_ids``, ``attention_mask``, ``position_ids`` and
``past_key_values.{i}.key/value``, outputs ``logits`` and ``present.{i}.key/value`` — the
layout ``optimum.onnxruntime.ORTModelForCausalLM`` loads and generates with (optimum-onnx
docs, "Export a model to ONNX with optimum.exporters.onnx") and transformers.js runs. The folder
is laid out as transformers.js loads it with no edit (:mod:`pit_deploy.targets.onnx`):
the graphs under ``onnx/``, every large weight in one external-data file named after the graph,
``config.json`` saying which graph and that it has external data, the chat template also in
``tokenizer_config.json``.

Beside the decoder we write ``interface.onnx``: a two-output graph
``(input_ids[N], hidden[N, d]) -> (embeddings[N, d], logits[N, V])`` built from the same
modules, giving the *effective* interface as the runtime computes it. :func:`shared_weights`
checks that its large initializers are byte-identical to initializers of the decoder.

Factorized mode keeps ``Z`` once: the factorized modules (see
:mod:`pit_deploy.exporters.passes`) hold ``Zᵀ`` and use it only through ``Gather(axis=1)`` and
``MatMul``, which constant folding leaves alone.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from ...exporters.passes import InterfaceProbe, write_computed_tables
from ...io.checkpoint import compact_tokenizer_json, save_tokenizer
from ...model.inspect import tying_of
from ...schemes import Scheme
from . import INTERFACE_NAME, WEB_DTYPES, data_name, decoder_name
from ...exporters.vocab_standin import VocabStandin, standin_size

log = logging.getLogger(__name__)
ONNX_TASK = "text-generation-with-past"
#: the interface graph as traced, before its tables and quantization
TMP_INTERFACE = ".interface.onnx.tmp"


@torch.no_grad()
def export_onnx(model: PreTrainedModel, out_dir: Path, tokenizer=None, opset: int | None = None,
                dtype: str = "float32", group_size: int = 32, pit_correction: bool = True,
                table_bits: int | None = None, keep_8bit: tuple[str, ...] = (),
                fold_at_load: bool = False, head_int8: bool = False) -> dict:
    """Write the decoder (+ config, generation config, tokenizer) and the interface graph;
    for ``int8``/``int4`` quantize both graphs (:mod:`pit_deploy.exporters.quantize_onnx`; with ``fold_at_load``,
    codes that onnxruntime folds to float32 at load, :mod:`.web_fold`; ``head_int8``: a factorized
    head with int8 activations).

    Returns:
        a dict with the task, the opset, the ONNX file names (and the quantization details).
    """
    from functools import partial

    from ...exporters.calibrated_rounding import head_moments_array
    from .web_fold import fold_graph
    from ...exporters.onnx_graph import save_deduplicated
    from ...exporters.quantize_onnx import quantize_graph

    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    v, d = model.config.vocab_size, model.config.hidden_size
    decoder, interface, pending = _traced_graphs(model, out_dir, opset)
    (out_dir / "model.onnx").unlink()  # optimum's name, at the top
    (out_dir / TMP_INTERFACE).unlink()
    for old in out_dir.glob("*.onnx_data"):
        old.unlink()
    if tokenizer is not None:
        save_tokenizer(tokenizer, out_dir)
        compact_tokenizer_json(out_dir)  # the web and onnxruntime clients download it with the model
    name = decoder_name(dtype)
    details: dict = {"task": ONNX_TASK, "decoder": name, "decoder_data": data_name(name),
                     "interface": INTERFACE_NAME, "transformers_js_dtype": WEB_DTYPES[dtype][0]}
    # a calibrated model's codes go in as they are (fold_at_load schemes take no calibration)
    # and a calibrated model's token table is rounded by GPTQ too, once for both graphs (the
    # second finds the first's codes in table_cache)
    quantize = None if dtype == "float32" else fold_graph if fold_at_load else \
        partial(quantize_graph, codes=calibrated_codes(model), head_moments=head_moments_array(model),
                table_cache={}, head_int8=head_int8)
    if quantize is not None:  # the quantizers read the tables from the model (one copy of their rows)
        decoder, details["quantization"] = quantize(decoder, dtype, group_size, v, d, pit_correction,
                                                    body=True, table_bits=table_bits, keep_8bit=keep_8bit,
                                                    tables=pending[0])
    (out_dir / name).parent.mkdir(exist_ok=True)
    save_deduplicated(decoder, out_dir / name, data_name(name), pending[0])
    del decoder
    if quantize is not None:
        interface, _ = quantize(interface, dtype, group_size, v, d, pit_correction, body=False,
                                table_bits=table_bits, tables=pending[1])
    details["interface_tensors_shared"] = share_interface_weights(out_dir / name, interface, min_elements=d * d,
                                                                  pending=pending)
    write_web_config(out_dir, WEB_DTYPES[dtype][0])
    return details


def _traced_graphs(model: PreTrainedModel, out_dir: Path, opset: int | None) -> tuple[Any, Any, tuple[dict, dict]]:
    """The decoder and the interface graph, loaded, and each one's tables to write from the model:
    traced with a few-row stand-in of the tables (:mod:`pit_deploy.exporters.vocab_standin`), or
    with the whole tables where the vocabulary is small or a stand-in's graph cannot take its
    tables back."""
    import onnx

    def load() -> tuple[Any, Any]:
        return (onnx.load(str(out_dir / "model.onnx"), load_external_data=True),
                onnx.load(str(out_dir / TMP_INTERFACE), load_external_data=True))

    v, d = model.config.vocab_size, model.config.hidden_size
    size = standin_size(model, v, d)
    if size is not None:
        standin = VocabStandin(model, v, d, size)
        _trace_graphs(model, out_dir, opset, standin)
        decoder, interface = load()
        tables, interface_tables = standin.restore(decoder.graph), standin.restore(interface.graph)
        if tables is not None and interface_tables is not None:
            standin.fix_config(out_dir)
            return decoder, interface, (tables, interface_tables)
        log.info("the ONNX graphs could not take their tables back from a %d-row stand-in; "
                 "exporting them at the full vocabulary", size)
        del decoder, interface
        for traced in (out_dir / "model.onnx", out_dir / TMP_INTERFACE, *out_dir.glob("*.onnx_data")):
            traced.unlink()  # onnx appends to an existing data file
    write_computed_tables(model)  # a model materialized by rows, traced whole
    _trace_graphs(model, out_dir, opset, None)
    return (*load(), ({}, {}))


def _trace_graphs(model: PreTrainedModel, out_dir: Path, opset: int | None, standin: VocabStandin | None) -> None:
    """optimum's decoder (``model.onnx`` and its data) and the interface graph
    (:data:`TMP_INTERFACE`) traced into ``out_dir``; with a ``standin``, of the model's tables cut
    to its rows (:mod:`.vocab_standin`)."""
    from contextlib import nullcontext

    from optimum.exporters.onnx import onnx_export_from_model

    d = model.config.hidden_size
    with standin.applied() if standin is not None else nullcontext():
        # do_validation=False: optimum's check only warns above atol; `pit-deploy verify` fails instead.
        had_forward = "forward" in vars(model)
        try:
            onnx_export_from_model(
                model, out_dir, task=ONNX_TASK, opset=opset, do_validation=False, preprocessors=None
            )
        finally:
            # optimum's model patcher restores `forward` by assigning it on the instance; left there,
            # a later torch.export of the same model (the .pte exporter) traces that bound method and
            # fails on Gemma (its √d constant is built inside the class's forward)
            if not had_forward:
                vars(model).pop("forward", None)
        torch.onnx.export(
            InterfaceProbe(model).eval(),
            (torch.arange(4, dtype=torch.long), torch.zeros(4, d)),
            str(out_dir / TMP_INTERFACE),
            input_names=["input_ids", "hidden"],
            output_names=["embeddings", "logits"],
            dynamic_axes={"input_ids": {0: "n"}, "hidden": {0: "m"}, "embeddings": {0: "n"}, "logits": {0: "m"}},
            opset_version=opset or 17,
            # A tied model reads one table for both sides: folding the head's transpose would make
            # a second, transposed copy that the decoder does not hold. Keep the Transpose node.
            do_constant_folding=tying_of(model) != "tied",
            dynamo=False,
        )


def calibrated_codes(model: PreTrainedModel) -> dict:
    """A calibrated model's codes (:mod:`pit_deploy.exporters.calibrated_rounding`) by the digest of each linear's
    weight as the graph stores it (transposed, :func:`pit_deploy.exporters.onnx_graph.weight_digest`)."""
    from ...exporters.calibrated_rounding import rounded_weights
    from ...exporters.onnx_graph import weight_digest

    return {weight_digest(model.get_submodule(name).weight.detach().T.numpy()): rounded
            for name, rounded in rounded_weights(model).items()}


def write_web_config(out_dir: Path, web_dtype: str) -> None:
    """Make the folder load in transformers.js as it is: ``config.json`` names the graph's dtype
    (so the graph under ``onnx/`` is found with no option) and says its weights are external data
    (else the browser never fetches them); the chat template goes into ``tokenizer_config.json``,
    the only place transformers.js reads it (transformers also writes it to
    ``chat_template.jinja``, which stays)."""
    import json

    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["transformers.js_config"] = {"dtype": web_dtype, "use_external_data_format": True}
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    template, tok_config_path = out_dir / "chat_template.jinja", out_dir / "tokenizer_config.json"
    if template.is_file() and tok_config_path.is_file():
        tok_config = json.loads(tok_config_path.read_text(encoding="utf-8"))
        tok_config.setdefault("chat_template", template.read_text(encoding="utf-8"))
        tok_config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def share_interface_weights(decoder_path: Path, interface, min_elements: int,
                            pending: tuple[dict, dict] = ({}, {})) -> list[str]:
    """Write the interface graph beside ``decoder_path`` reading its large weights from the
    decoder's external data file.

    The decoder is already saved with its tensors in one external-data file (ONNX external data:
    each initializer records ``location``/``offset``/``length``; see onnx's "External Data"
    docs). Each large initializer of the ``interface`` graph whose bytes equal a decoder
    initializer is pointed at that same byte range, so the interface graph adds no weight bytes
    on disk and reads exactly the decoder's weights.

    Returns:
        names of the interface initializers now shared with the decoder.
    """
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import ExternalDataInfo

    from ...exporters.onnx_graph import fill_pending
    from ...runtime.onnx_shared_weights import range_digest

    decoder = onnx.load(str(decoder_path), load_external_data=False)
    folder = decoder_path.parent
    ranges: dict[str, dict[str, str]] = {}
    for init in decoder.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            info = ExternalDataInfo(init)
            ranges[init.name] = {"location": info.location, "offset": str(info.offset), "length": str(info.length)}
    by_digest: dict[tuple, dict[str, str]] = {}
    for init in decoder.graph.initializer:  # each range hashed from the file: never the whole file in memory
        if init.name in ranges:
            r = ranges[init.name]
            digest = range_digest(folder / r["location"], int(r["offset"]), int(r["length"]))
            by_digest[(digest, init.data_type, tuple(init.dims))] = r
    # the tables both graphs take from the model (.vocab_standin): the decoder's range of each
    by_table = {table.key: ranges[name] for name, table in pending[0].items() if name in ranges}
    shared = []
    for init in interface.graph.initializer:
        table = pending[1].get(init.name)
        if table is not None:
            target = by_table.get(table.key)
            if target is None:
                fill_pending(interface.graph, {init.name: table})
                continue
        else:
            arr = numpy_helper.to_array(init)
            if arr.size < min_elements:
                continue
            key = (hashlib.sha256(arr.tobytes()).hexdigest(), init.data_type, tuple(init.dims))
            target = by_digest.get(key)
            if target is None:
                continue
        init.ClearField("raw_data")
        del init.external_data[:]
        init.data_location = onnx.TensorProto.EXTERNAL
        for k, v in target.items():
            entry = init.external_data.add()
            entry.key, entry.value = k, v
        shared.append(init.name)
    onnx.save_model(interface, str(folder / Path(INTERFACE_NAME).name))
    return shared


def export_artifact(model: PreTrainedModel, out_dir: Path, *, tokenizer=None, recipe=None,
                    scheme: Scheme, opset: int | None = None) -> dict:
    """The ``onnx`` target's exporter (:mod:`pit_deploy.targets.onnx`)."""
    return export_onnx(model, out_dir, tokenizer, opset, dtype=scheme.dtype, group_size=scheme.group_size,
                       pit_correction=scheme.pit_correction, table_bits=scheme.table_bits,
                       keep_8bit=scheme.int4_8bit_layers, fold_at_load=scheme.fold_at_load,
                       head_int8=scheme.head_activations == "int8")

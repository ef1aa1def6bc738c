"""Export a prepared (materialized or factorized) model to ONNX with ``optimum``.

The decoder goes through ``optimum.exporters.onnx.onnx_export_from_model`` with the task
``text-generation-with-past``: inputs ``input_ids``, ``attention_mask``, ``position_ids`` and
``past_key_values.{i}.key/value``, outputs ``logits`` and ``present.{i}.key/value`` — the
layout ``optimum.onnxruntime.ORTModelForCausalLM`` loads and generates with (optimum-onnx
docs, "Export a model to ONNX with optimum.exporters.onnx"). torch's ONNX exporter writes
weights as external data once a model passes the 2 GB protobuf limit, and optimum gathers
them into one ``model.onnx_data`` file.

Beside the decoder we write ``interface.onnx``: a two-output graph
``(input_ids[N], hidden[N, d]) -> (embeddings[N, d], logits[N, V])`` built from the same
modules, giving the *effective* interface as the runtime computes it. :func:`shared_weights`
checks that its large initializers are byte-identical to initializers of the decoder.

Factorized mode keeps ``Z`` once: the factorized modules (see
:mod:`pit_deploy.export_passes`) hold ``Zᵀ`` and use it only through ``Gather(axis=1)`` and
``MatMul``, which constant folding leaves alone.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from .export_passes import InterfaceProbe

DECODER_NAME = "model.onnx"
INTERFACE_NAME = "interface.onnx"
ONNX_TASK = "text-generation-with-past"


class _InterfaceGraph(nn.Module):
    def __init__(self, probe: InterfaceProbe):
        super().__init__()
        self.probe = probe

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor):
        return self.probe.embed(input_ids), self.probe.head_logits(hidden)


@torch.no_grad()
def export_onnx(model: PreTrainedModel, out_dir: Path, tokenizer=None, opset: int | None = None) -> dict:
    """Write ``model.onnx`` (+ config, generation config, tokenizer) and ``interface.onnx``.

    Returns:
        a dict with the task, the opset and the ONNX file names.
    """
    from optimum.exporters.onnx import onnx_export_from_model

    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    # do_validation=False: optimum's check only warns above atol; `pit-deploy verify` fails instead.
    onnx_export_from_model(
        model, out_dir, task=ONNX_TASK, opset=opset, do_validation=False, preprocessors=None
    )
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    probe = _InterfaceGraph(InterfaceProbe(model)).eval()
    d = model.config.hidden_size
    torch.onnx.export(
        probe,
        (torch.arange(4, dtype=torch.long), torch.zeros(4, d)),
        str(out_dir / INTERFACE_NAME),
        input_names=["input_ids", "hidden"],
        output_names=["embeddings", "logits"],
        dynamic_axes={"input_ids": {0: "n"}, "hidden": {0: "m"}, "embeddings": {0: "n"}, "logits": {0: "m"}},
        opset_version=opset or 17,
        do_constant_folding=True,
        dynamo=False,
    )
    return {"task": ONNX_TASK, "decoder": DECODER_NAME, "interface": INTERFACE_NAME}


def _initializer_digests(path: Path, min_elements: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path), load_external_data=True)
    out = {}
    for init in model.graph.initializer:
        n = 1
        for dim in init.dims:
            n *= dim
        if n < min_elements:
            continue
        arr = numpy_helper.to_array(init)
        out[init.name] = (hashlib.sha256(arr.tobytes()).hexdigest(), tuple(arr.shape))
    return out


def shared_weights(artifact_dir: Path, min_elements: int) -> tuple[bool, str]:
    """Are the interface graph's large weights byte-identical to some of the decoder's?

    Args:
        artifact_dir: directory with ``model.onnx`` and ``interface.onnx``.
        min_elements: only initializers with at least this many elements are compared (the
            ``V×d`` / ``d×d`` interface constants, not small scalars).

    Returns:
        ``(ok, message)``.
    """
    probe = _initializer_digests(artifact_dir / INTERFACE_NAME, min_elements)
    decoder = _initializer_digests(artifact_dir / DECODER_NAME, min_elements)
    have = {digest for digest, _ in decoder.values()}
    missing = [f"{name}{shape}" for name, (digest, shape) in probe.items() if digest not in have]
    if not probe:
        return False, "interface.onnx holds no interface weights to compare"
    if missing:
        return False, f"interface.onnx weights not found byte-identical in model.onnx: {missing}"
    return True, f"{len(probe)} interface weight(s) byte-identical to the decoder's"


def large_initializers(path: Path, min_elements: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of initializers with at least ``min_elements`` elements."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    rows = []
    for init in model.graph.initializer:
        n = 1
        for dim in init.dims:
            n *= dim
        if n >= min_elements:
            rows.append((init.name, tuple(init.dims)))
    return rows

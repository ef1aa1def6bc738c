"""Properties of the artifacts themselves: storage, runner conventions, optimum generation."""

from __future__ import annotations

import json

import pytest
import torch

from pit_deploy.io.checkpoint import load_pit_model
from pit_deploy.io.manifest import MANIFEST_NAME, Manifest


def _count_vd(path, v, d):
    from pit_deploy.runtime.onnx_weights import large_initializers

    return [s for _, s in large_initializers(path, v * d) if sorted(s) == sorted((v, d))]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_onnx_factorized_keeps_z_once(exports, family):
    out, _ = exports.tiny(family)
    v, d = 512, 64
    assert len(_count_vd(out / "onnx-factorized" / "model.onnx", v, d)) == 1
    assert len(_count_vd(out / "onnx-materialized" / "model.onnx", v, d)) == 2


def test_manifest_records_everything(exports):
    out, _ = exports.tiny("llama")
    data = json.loads((out / MANIFEST_NAME).read_text())
    manifest = Manifest.read(out)
    assert {a.key for a in manifest.artifacts} == {
        "onnx-materialized", "onnx-factorized", "executorch-materialized", "executorch-factorized"}
    for art in manifest.artifacts:
        assert art.dtype == "float32" and art.files and art.export_seconds > 0
        assert all(len(f["sha256"]) == 64 for f in art.files.values())
    assert data["versions"]["torch"] and data["versions"]["executorch"] and data["versions"]["onnxruntime"]
    assert data["reference"]["files"]["reference/model.safetensors"]["sha256"]
    assert data["verification"]["passed"] is True
    assert len(data["verification"]["artifacts"]) == 4


@pytest.mark.parametrize("mode", ["materialized", "factorized"])
def test_pte_follows_llm_runner_conventions(exports, mode):
    from executorch.runtime import Runtime

    out, _ = exports.tiny("qwen3")
    program = Runtime.get().load_program(str(out / f"executorch-{mode}" / "model.pte"))
    names = set(program.method_names)
    assert {"forward", "embed", "head", "get_max_seq_len", "get_max_context_len", "use_kv_cache",
            "enable_dynamic_shape", "get_eos_ids"} <= names
    assert program.load_method("get_max_seq_len").execute([])[0] == 64
    assert bool(program.load_method("use_kv_cache").execute([])[0]) is True
    assert bool(program.load_method("enable_dynamic_shape").execute([])[0]) is True
    assert list(program.load_method("get_eos_ids").execute([])) == [2]
    fwd = program.load_method("forward")
    # one-call prefill of different lengths (dynamic sequence dimension), logits only
    for n in (1, 7, 40):
        logits = fwd.execute([torch.arange(3, 3 + n)[None], torch.tensor([0])])
        assert len(logits) == 1 and tuple(logits[0].shape) == (1, n, 512)


@pytest.mark.parametrize("mode", ["materialized", "factorized"])
def test_ort_model_generates_like_pytorch(exports, mode):
    from optimum.onnxruntime import ORTModelForCausalLM

    out, _ = exports.tiny("granite")
    ort = ORTModelForCausalLM.from_pretrained(out / f"onnx-{mode}")
    ref = load_pit_model(out / "reference")
    ids = torch.tensor([[5, 17, 99, 250, 3, 42]])
    kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False)
    with torch.no_grad():
        expected = ref.generate(ids, **kw)
    got = ort.generate(ids, **kw)
    assert torch.equal(got, expected)

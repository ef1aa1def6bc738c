"""The families of the compact models people put on phones — SmolLM3, Phi-3/Phi-4-mini and
Llama 3.2's rotary scaling — through convert (``preserve``) → export → verify on every target
that builds them, with the structure that sets each apart in its tiny model
(:data:`pit_deploy.tiny.DEPLOYED_FAMILIES`): layers without rotary embeddings, fused
``qkv_proj``/``gate_up_proj``, partial rotary, ``longrope`` and ``llama3`` frequency scaling.

Each check exports and verifies for real (onnxruntime, the onnxruntime-genai builder and
runtime, ExecuTorch, llama.cpp); verify compares with PyTorch, so a runtime that rotates a layer
the model does not rotate, or holds the wrong frequencies, fails it. The default tier runs one
cheap path per family's distinctive part; the full tier runs every target at fp32 and int4.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pit_deploy.api import Conversion
from pit_deploy.cli import main
from pit_deploy.io.checkpoint import save_model
from pit_deploy.tiny import DEPLOYED_FAMILIES, tiny_model, tiny_tokenizer

from pit_models import converted_families, export_verify


@pytest.fixture(scope="module")
def conversions(tmp_path_factory) -> dict[str, Conversion]:
    """Each family's tiny source converted as ``convert`` does by default."""
    return converted_families(tmp_path_factory.mktemp("deployed"), DEPLOYED_FAMILIES)


@pytest.fixture(scope="module")
def converted(conversions) -> dict[str, Path]:
    return {family: c.out for family, c in conversions.items()}


def test_preserve_keeps_what_each_family_computes(conversions):
    """``preserve`` (the default) folds and rotates Phi-3's fused linears and SmolLM3's layers as
    Llama's: the converted model's held-out loss is the source's."""
    for family, done in conversions.items():
        assert done.t_init == "preserve", family
        assert abs(done.converted_nll - done.source_nll) < 1e-3, (family, done.source_nll, done.converted_nll)


def test_phi3_int4_on_the_builder_and_llama_cpp(converted, tmp_path):
    """Phi-3 on onnxruntime-genai at int4 (its builder keeps ``qkv_proj`` packed and splits
    ``gate_up_proj`` into two nodes, which take the calibrated codes' row halves, and reads
    ``longrope``), and on llama.cpp at Q4_0 (``attn_qkv``, a double-height ``ffn_up``, partial
    rotary, the short and long factor tensors)."""
    manifest = export_verify(converted["phi3"], tmp_path / "genai", "onnx-genai", "--dtype", "int4",
                              "--mode", "factorized")
    codes = manifest["artifacts"][0]["details"]["weight_codes"]["tensors"]
    assert "model.layers.0.mlp.gate_proj" in codes and "model.layers.0.mlp.gate_up_proj" not in codes
    export_verify(converted["phi3"], tmp_path / "gguf", "gguf", "--dtype", "q4_0", "--mode", "materialized")
    from gguf import GGUFReader

    reader = GGUFReader(str(next((tmp_path / "gguf").rglob("*.gguf"))))
    names = {t.name for t in reader.tensors}
    assert {"blk.0.attn_qkv.weight", "rope_factors_long.weight", "rope_factors_short.weight"} <= names
    assert int(reader.fields["phi3.rope.dimension_count"].parts[-1][0]) == 48  # 3/4 of a 64-wide head


def test_smollm3_layers_without_rotary(converted, tmp_path):
    """SmolLM3 on onnxruntime-genai (the builder's layers without rotary embeddings are built
    without any) and on llama.cpp (which leaves out every fourth layer's)."""
    export_verify(converted["smollm3"], tmp_path / "genai", "onnx-genai", "--mode", "factorized")
    export_verify(converted["smollm3"], tmp_path / "gguf", "gguf", "--mode", "materialized")


def test_llama3_rotary_scaling_in_gguf(converted, tmp_path):
    """Llama 3.2's ``rope_type: llama3`` on llama.cpp: the frequency factors travel as
    ``rope_freqs.weight`` (the low frequencies divided by the scaling factor, the high ones kept)."""
    export_verify(converted["llama3"], tmp_path / "gguf", "gguf", "--mode", "materialized")
    from gguf import GGUFReader

    reader = GGUFReader(str(next((tmp_path / "gguf").rglob("*.gguf"))))
    factors = np.asarray(next(t for t in reader.tensors if t.name == "rope_freqs.weight").data)
    assert factors[0] == pytest.approx(1.0) and factors[-1] == pytest.approx(32.0)


def test_smollm3_with_another_no_rope_pattern_is_refused_for_gguf(tmp_path):
    """llama.cpp's smollm3 fixes the step of its layers without rotary embeddings at four; a model
    with another pattern is refused (exit 2, one line), not written to compute something else."""
    model = tiny_model("smollm3")
    model.config.no_rope_layers = [1, 0, 1, 0]
    save_model(model, tmp_path / "src", tiny_tokenizer())
    assert main(["export", str(tmp_path / "src"), "--out", str(tmp_path / "x"), "--runtime", "gguf",
                 "--keep-tying", "--recipe", "tiny-ci"]) == 2


@pytest.mark.full
@pytest.mark.parametrize("family", DEPLOYED_FAMILIES)
@pytest.mark.parametrize("runtime", ["onnx", "onnx-genai", "executorch", "gguf"])
def test_every_target_fp32_and_int4(converted, tmp_path, family, runtime):
    """Every target at fp32 and at its 4-bit scheme, both modes where the target has them."""
    dtypes = "float32,q4_0" if runtime == "gguf" else "float32,int4"
    modes = ["--mode", "materialized"] if runtime == "gguf" else []
    export_verify(converted[family], tmp_path / "x", runtime, "--dtype", dtypes, *modes)


def test_pte_of_a_longrope_model_is_bounded_by_its_original_context(converted, tmp_path):
    """A ``.pte`` holds ``longrope``'s short factors (its static cache bounds the positions), so a
    cache longer than the original context is refused before any work (exit 2)."""
    assert main(["export", str(converted["phi3"]), "--out", str(tmp_path / "x"), "--runtime", "executorch",
                 "--max-seq-len", "4096"]) == 2

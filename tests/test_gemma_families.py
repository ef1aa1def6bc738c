"""Gemma 2 and Gemma 3 (``gemma2``, ``gemma3_text``) through convert → export → verify on every
target that builds them, on tiny models with their structure (:data:`pit_deploy.tiny.GEMMA_FAMILIES`):
local sliding-window layers with a window shorter than the verify prompts, a norm on each
block's outputs, Gemma 2's attention and final soft-capping, Gemma 3's query/key norms, two
rotary bases and the √d scale inside its embedding module, tanh-approximated GELU.

Verify compares each runtime with PyTorch, so a runtime whose local layers see past their
window, a ``.pte`` that computes GELU's erf form where the model has the tanh one, or an exported
table scaled twice fails it. The default tier runs one cheap path per family's distinctive
part; the full tier runs every target at fp32 and int4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pit_deploy.api import Conversion
from pit_deploy.cli import main
from pit_deploy.tiny import GEMMA_FAMILIES, tiny_model, tiny_tokenizer

from pit_models import converted_families, export_verify


@pytest.fixture(scope="module")
def conversions(tmp_path_factory) -> dict[str, Conversion]:
    """Each family's tiny source converted as ``convert`` does by default."""
    return converted_families(tmp_path_factory.mktemp("gemma"), GEMMA_FAMILIES)


@pytest.fixture(scope="module")
def converted(conversions) -> dict[str, Path]:
    return {family: c.out for family, c in conversions.items()}


def test_the_conversion_keeps_the_body(conversions):
    """``preserve`` for post-normalized blocks keeps every body weight and fits the final gain;
    the loss moves (no rotation symmetry), and the figure is reported."""
    for family, done in conversions.items():
        assert done.t_init == "preserve", family
        assert done.delta_ti < 1e-5
        assert done.source_nll is not None and done.converted_nll is not None


def test_gemma3_pte_holds_local_layers_and_tanh_gelu(converted, tmp_path):
    """Gemma 3 as a ``.pte``: a prompt longer than the window prefills in one call (every layer's
    static cache holds the whole context, the model's mask keeps local layers to their window)
    and the MLP's tanh GELU lowers as that function (XNNPACK's own GELU is the erf form)."""
    manifest = export_verify(converted["gemma3"], tmp_path / "pte", "executorch", "--mode", "materialized")
    assert manifest["artifacts"][0]["target"] == "executorch"


def test_gemma2_on_the_builder(converted, tmp_path):
    """Gemma 2 on onnxruntime-genai: the builder's soft-capping and sliding-window attention, with
    full-length caches in the local layers (what verify's plain onnxruntime session feeds)."""
    manifest = export_verify(converted["gemma2"], tmp_path / "genai", "onnx-genai", "--mode", "factorized")
    assert manifest["artifacts"][0]["details"]["builder_extra_options"]["windowed_kv_cache"] == "false"


def test_gemma_builder_embedding_scale_is_matched(tmp_path):
    """The builder multiplies Gemma's embedding rows by √d rounded to two decimals (11.31 for
    √128); the exported table is divided by that number, so the runtime's ``W_out E`` is the
    identity (divided by √d itself, ``delta_ti`` was 3.7e-3 and the logits off by 2.9e-4; with the tiny configs' d = 64 both
    are 8 and nothing shows)."""
    from pit_deploy.api import convert
    from pit_deploy.io.checkpoint import save_model

    save_model(tiny_model("gemma3", hidden_size=128), tmp_path / "src", tiny_tokenizer())
    pit = convert(tmp_path / "src", tmp_path / "pit", calib_tokens=256, say=None).out
    export_verify(pit, tmp_path / "genai", "onnx-genai", "--mode", "factorized,materialized")


def test_gemma3_on_llama_cpp_with_its_tokenizer(tmp_path):
    """Gemma 3 as GGUF files: llama.cpp's ``gemma3`` graph (norm gains ``1 + w``, local layers
    from the config's layer flags, two rotary bases, the √d scale on the table) verifies against
    PyTorch with ``W_out E = I`` on the runtime; the SentencePiece-form tokenizer, written as
    llama.cpp's ``llama`` tokenizer with merge-rank scores, splits text into the ids Hugging Face
    gives, byte fallback and special tokens included."""
    import llama_cpp

    from pit_deploy.api import convert
    from pit_deploy.io.checkpoint import save_model
    from pit_deploy.tiny import tiny_sentencepiece_tokenizer

    tok = tiny_sentencepiece_tokenizer()
    model = tiny_model("gemma3", vocab_size=len(tok))
    model.config.bos_token_id, model.config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    save_model(model, tmp_path / "src", tok)
    pit = convert(tmp_path / "src", tmp_path / "pit", calib_tokens=256, say=None, accept_loss=True).out
    manifest = export_verify(pit, tmp_path / "gguf", "gguf", "--mode", "materialized", "--dtype", "q8_0,q4_0")
    for art in manifest["artifacts"]:
        assert art["details"]["architecture"] == "gemma3"
        assert art["details"]["quantization"]["delta_ti_corrected"] < 1e-5
    gguf_file = next((tmp_path / "gguf").rglob("model-q8_0.gguf"))
    vocab = llama_cpp.Llama(str(gguf_file), vocab_only=True, verbose=False)
    for text in ["def  class return\nvalue  name", "bob's café 東京 🚀", "<eos> model<bos>token", "  lead and trail  "]:
        assert vocab.tokenize(text.encode(), add_bos=True, special=True) == tok(text)["input_ids"], text


def test_gguf_refuses_float32_gemma3_and_gemma2(converted, tmp_path):
    """Refused before any work (exit 2): a float32 Gemma 3 file (llama.cpp's CPU GELU is a
    float16 table, past the float32 bound) and Gemma 2 (llama.cpp's gemma2 reads its head from
    the token table, so no untied PIT head has a place)."""
    for family, dtype in (("gemma3", "float32"), ("gemma2", "q8_0")):
        assert main(["export", str(converted[family]), "--out", str(tmp_path / family), "--runtime", "gguf",
                     "--mode", "materialized", "--recipe", "tiny-ci", "--dtype", dtype]) == 2
        assert not (tmp_path / family / "manifest.json").exists()


def test_tanh_gelu_is_spelled_out_for_the_lowering():
    """Inside the rewrite no ``aten.gelu`` reaches the exported graph, the values are the same, and
    the modules are restored on exit."""
    from transformers.activations import GELUTanh

    from pit_deploy.targets.executorch.xnnpack_rewrites import tanh_gelu_spelled_out

    module = torch.nn.Sequential(torch.nn.Linear(8, 8), GELUTanh()).eval()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    want = module(x)
    with tanh_gelu_spelled_out(module):
        got = module(x)
        graph = torch.export.export(module, (x,)).graph
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    assert not any("gelu" in str(node.target) for node in graph.nodes)
    assert "gelu" in str(torch.export.export(module, (x,)).graph)


def test_special_tokens_past_the_vocabulary_are_allowed(caplog):
    """Gemma 3's tokenizer keeps its multimodal ``<image_soft_token>`` one id past the text
    model's table: a special token there is allowed with a warning; a plain token is refused."""
    from pit_deploy.converters.conversion import check_tokenizer_fits
    from pit_deploy.errors import PitError

    tok = tiny_tokenizer()
    config = tiny_model("gemma3").config
    tok.add_special_tokens({"additional_special_tokens": ["<image_soft_token>"]})
    config.vocab_size = len(tok) - 1
    check_tokenizer_fits(tok, config)
    assert "<image_soft_token>" in caplog.text
    tok.add_tokens(["plainword"])
    config.vocab_size = len(tok) - 2
    with pytest.raises(PitError, match="no embedding row"):
        check_tokenizer_fits(tok, config)


@pytest.mark.full
@pytest.mark.parametrize("family", GEMMA_FAMILIES)
@pytest.mark.parametrize("runtime", ["onnx", "onnx-genai", "executorch"])
def test_every_target_fp32_and_int4(converted, tmp_path, family, runtime):
    """Every target that builds Gemma 2/3 at fp32 and int4, both modes."""
    export_verify(converted[family], tmp_path / "x", runtime, "--dtype", "float32,int4")


@pytest.mark.full
def test_gemma3_every_gguf_type(converted, tmp_path):
    """Gemma 3 in every GGUF type llama.cpp runs it at here (float32 is refused)."""
    export_verify(converted["gemma3"], tmp_path / "x", "gguf", "--mode", "materialized", "--dtype", "f16,q8_0,q4_0,q4_k_m")

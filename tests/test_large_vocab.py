"""A vocabulary past 65,536 ids (Gemma 3's 262,144, Phi-4-mini's 200,064, Llama 3's 128,256) on
every target: a tiny Llama of 70,000 tokens whose tokenizer encodes text to the top ids
(:func:`pit_deploy.tiny.tiny_tokenizer` with ``spread_to``), converted, exported and verified.

Verify feeds the runtimes the held-out text's ids, so a runtime, a writer or a table codec that
keeps token ids (or a row count) in 16 bits reads the wrong rows, and the logits fail the
bound. The default tier runs the plain ONNX fp32 path; the full tier every target at fp32 and
its 4-bit scheme.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pit_deploy.io.checkpoint import save_model
from pit_deploy.tiny import tiny_model, tiny_tokenizer

from pit_models import export_verify

VOCAB = 70_000


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    from pit_deploy.api import convert

    root = tmp_path_factory.mktemp("large-vocab")
    save_model(tiny_model("llama", vocab_size=VOCAB), root / "src", tiny_tokenizer(spread_to=VOCAB))
    return convert(root / "src", root / "pit", calib_tokens=512, say=None).out


def test_text_encodes_past_16_bits(converted):
    """The premise: the held-out text verify feeds is made of ids past 65,535."""
    from transformers import AutoTokenizer

    from pit_deploy.data.calibration import heldout_sets

    sets = heldout_sets(AutoTokenizer.from_pretrained(converted), 64)
    ids = [i for blocks in sets.values() for block in blocks for i in block]
    assert ids and min(i for i in ids if i > 2) > 65_535 and max(ids) < VOCAB


def test_onnx_fp32(converted, tmp_path):
    manifest = export_verify(converted, tmp_path / "x", "onnx", "--dtype", "float32")
    assert manifest["artifacts"][0]["target"] == "onnx"


@pytest.mark.full
@pytest.mark.parametrize("runtime, dtypes, mode", [
    ("onnx", "int4", "factorized"),
    ("onnx-genai", "float32,int4", "factorized"),
    ("executorch", "float32,int4", "factorized"),
    ("gguf", "float32,q4_k_m", "materialized"),
])
def test_every_target(converted, tmp_path, runtime, dtypes, mode):
    export_verify(converted, tmp_path / "x", runtime, "--dtype", dtypes, "--mode", mode)

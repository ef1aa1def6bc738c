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


def test_onnx_fp32(converted, tmp_path, monkeypatch):
    manifest = export_verify(converted, tmp_path / "x", "onnx", "--dtype", "float32")
    assert manifest["artifacts"][0]["target"] == "onnx"
    _same_logits_without_the_arena(tmp_path / "x", manifest["artifacts"][0]["path"])
    _runtime_runs_without_the_reference(tmp_path / "x", monkeypatch)


def _runtime_runs_without_the_reference(directory: Path, monkeypatch) -> None:
    """verify computes the reference's runs first and lets the model go before the runtime
    runs (at a 262k-token vocabulary, a second 1 GB model beside the runtime's); the runs are
    kept for the next fp32 artifact, so the model is loaded once for all of them."""
    import gc
    import weakref

    from pit_deploy.cli import main
    from pit_deploy.evaluate import verify

    loaded, measured = [], []
    load, measure = verify.load_reference_model, verify.runtime_logits

    def counted_load(path):
        model = load(path)
        loaded.append(weakref.ref(model))
        return model

    def measure_alone(*args):
        gc.collect()
        measured.append([ref() is not None for ref in loaded])
        return measure(*args)

    monkeypatch.setattr(verify, "load_reference_model", counted_load)
    monkeypatch.setattr(verify, "runtime_logits", measure_alone)
    monkeypatch.setattr(verify, "RELEASE_MIN_BYTES", 0)  # the tiny model's 18 MB table stands in for 1 GB
    assert main(["verify", str(directory), "--no-record"]) == 0
    assert measured and not any(any(alive) for alive in measured), measured
    assert len(loaded) == 1


def _same_logits_without_the_arena(directory: Path, path: str) -> None:
    """A session without onnxruntime's CPU memory arena (what verify opens) changes memory, not
    outputs: the logits of a prefill and of decode steps are bit-identical to a plain session's."""
    import torch

    from pit_deploy.evaluate.verify import runtime_logits
    from pit_deploy.runtime.drivers import driver_class

    prompt, fed = torch.tensor([5, 69_990, 123, 66_000]), torch.tensor([7, 69_999, 42])
    runs = []
    for lean in (False, True):
        driver = driver_class("onnx")(directory / path)
        if lean:
            driver.free_buffers_between_runs()
        runs.append(runtime_logits(driver, prompt, fed))
        driver.close()
        assert driver.arena is not lean
    assert runs[0].shape == (7, VOCAB) and torch.isfinite(runs[0]).all()
    assert torch.equal(runs[0], runs[1])


def test_logit_checks_taken_by_rows_are_the_whole_block_figures():
    """verify's logit figures are computed a few rows at a time (a 262k-token row is 1 MiB, 2 in
    float64); they are the figures of the whole block, NaN and infinities included."""
    import torch

    from pit_deploy.evaluate.bound_checks import finite_by_rows, max_abs_diff, rel_l2

    gen = torch.Generator().manual_seed(0)
    b = torch.randn(37, 1000, generator=gen)
    a = b + 1e-3 * torch.randn(37, 1000, generator=gen)
    whole = float(torch.linalg.vector_norm((a - b).double()) / torch.linalg.vector_norm(b.double()))
    assert rel_l2(a, b) == pytest.approx(whole, rel=1e-12)
    assert rel_l2(a[0], b[0]) == pytest.approx(float(torch.linalg.vector_norm((a[0] - b[0]).double())
                                                      / torch.linalg.vector_norm(b[0].double())), rel=1e-12)
    assert max_abs_diff(a, b) == float((a.double() - b.double()).abs().max())
    rows, count = finite_by_rows(a)
    assert rows.shape == (37,) and bool(rows.all()) and count == 0
    a[5, 3], a[30, 999], a[30, 0] = float("nan"), float("inf"), float("-inf")
    rows, count = finite_by_rows(a)
    assert count == 3 and rows.tolist() == [i not in (5, 30) for i in range(37)]
    assert rel_l2(a, b) != rel_l2(a, b)  # NaN
    assert max_abs_diff(a, b) != max_abs_diff(a, b)


def test_the_reference_greedy_steps_compute_only_the_last_logits():
    """The reference's greedy steps ask a model that takes ``logits_to_keep`` for the last
    position only (its full pass over the sequence, which verify compares, stays whole), and
    choose the same tokens as from every position's logits; a model without the argument still runs."""
    import torch

    from pit_deploy.evaluate.verify import reference_run

    model = tiny_model("llama", vocab_size=VOCAB).eval()
    rows = []
    forward = model.forward

    def spy(input_ids=None, logits_to_keep=0, **kwargs):
        out = forward(input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs)
        rows.append(out.logits.shape[1])
        return out

    model.forward = spy
    prompt = torch.tensor([3, 66_001, 69_000, 12])
    greedy, logits = reference_run(model, prompt, 6)
    assert rows == [1] * 6 + [9]
    seq = prompt.clone()
    for token in greedy.tolist():
        with torch.no_grad():
            assert int(forward(input_ids=seq[None]).logits[0, -1].argmax()) == token
        seq = torch.cat([seq, torch.tensor([token])])
    assert logits.shape == (9, VOCAB)

    class Plain(torch.nn.Module):  # a forward without logits_to_keep
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, input_ids):
            return forward(input_ids=input_ids)

    assert torch.equal(reference_run(Plain(), prompt, 6)[0], greedy)


@pytest.mark.full
@pytest.mark.parametrize("runtime, dtypes, mode", [
    ("onnx", "int4", "factorized"),
    ("onnx-genai", "float32,int4", "factorized"),
    ("executorch", "float32,int4", "factorized"),
    ("gguf", "float32,q4_k_m", "materialized"),
])
def test_every_target(converted, tmp_path, runtime, dtypes, mode):
    export_verify(converted, tmp_path / "x", runtime, "--dtype", dtypes, "--mode", mode)


def test_quantized_verify_compares_with_the_reference_logits_on_disk(converted, tmp_path, monkeypatch):
    """A quantized artifact's held-out KL compares the runtime with the reference's logits written
    once to a temporary file, the model let go while the runtime runs (at a 262k-token vocabulary,
    1 GB beside the sessions): the figures equal those against the model in memory, the file
    serves every quantized artifact of the export, and it is closed when verify ends."""
    import gc
    import weakref

    from pit_deploy.data import heldout
    from pit_deploy.evaluate import verify

    directory = tmp_path / "x"
    export_verify(converted, directory, "onnx", "--dtype", "int8,int4", "--mode", "factorized")
    monkeypatch.setattr(verify, "RELEASE_MIN_BYTES", 2**62)  # the model in memory, as for a small one
    in_memory = verify.verify_export(directory, record=False)

    loaded, alive_at_kl, spilled = [], [], []
    load, figures = verify.load_reference_model, heldout.kl_figures

    def counted_load(path):
        model = load(path)
        loaded.append(weakref.ref(model))
        return model

    def figures_alone(rows):
        gc.collect()
        alive_at_kl.append(any(ref() is not None for ref in loaded))
        return figures(rows)

    class Recorded(heldout.ReferenceLogits):
        def __init__(self, model, blocks):
            super().__init__(model, blocks)
            spilled.append(self)

    monkeypatch.setattr(verify, "load_reference_model", counted_load)
    monkeypatch.setattr(heldout, "kl_figures", figures_alone)
    monkeypatch.setattr(heldout, "ReferenceLogits", Recorded)
    monkeypatch.setattr(verify, "RELEASE_MIN_BYTES", 0)  # the tiny model's table stands in for 1 GB
    on_disk = verify.verify_export(directory, record=False)

    assert len(in_memory.artifacts) == len(on_disk.artifacts) == 2
    for a, b in zip(in_memory.artifacts, on_disk.artifacts):
        assert (a.kl_mean, a.kl_p99, a.same_top1, a.ppl_ratio) == (b.kl_mean, b.kl_p99, b.same_top1, b.ppl_ratio)
        assert a.passed and b.passed and a.heldout_tokens == b.heldout_tokens > 0
    assert alive_at_kl == [False, False]
    assert len(spilled) == 1 and spilled[0]._file.closed


@pytest.mark.parametrize("dtype", ["float32", "q8_0", "q4_0"])
def test_a_gguf_file_written_a_part_of_rows_at_a_time_is_the_file_of_the_whole_tables(converted, tmp_path, dtype):
    """A GGUF export alone computes, rounds and writes the token table and the head 8192 rows at a
    time from Z and T (never either table whole: 1.3 GB at a 262k-token vocabulary): the file and
    the recorded delta_ti figures are byte for byte those written from the whole materialized tables."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (bash scripts/setup_llama_cpp.sh)")
    from transformers import AutoTokenizer

    from pit_deploy.converters.materialize import TableRows
    from pit_deploy.exporters.passes import materialize, materialize_by_rows
    from pit_deploy.io.gguf_files import GGML_ROWS
    from pit_deploy.io.checkpoint import load_pit_model
    from pit_deploy.schemes import get_scheme
    from pit_deploy.targets import get_target
    from pit_deploy.targets.gguf.export import export_gguf

    model, tokenizer = load_pit_model(converted), AutoTokenizer.from_pretrained(converted)
    get_target("gguf")  # registers llama.cpp's own schemes
    scheme = get_scheme(dtype)
    asked: list[int] = []
    rows_of = TableRows.__getitem__

    def counted(self, rows):
        asked.append(len(range(*rows.indices(self.shape[0]))))
        return rows_of(self, rows)

    whole = export_gguf(materialize(model), tmp_path / "whole", tokenizer, scheme)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TableRows, "__getitem__", counted)
        by_rows = export_gguf(materialize_by_rows(model), tmp_path / "rows", tokenizer, scheme)
    name = whole["file"]
    assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "rows" / name).read_bytes()
    assert whole == by_rows
    assert asked and max(asked) <= GGML_ROWS and sum(asked) % VOCAB == 0 and sum(asked) >= 2 * VOCAB

"""The ``gguf`` target: tiny Llama/Qwen3 PIT models written as GGUF files, run in llama.cpp through
llama-cpp-python and verified there through the generic commands (``pit-deploy export``/``verify``/
``bench``); factorized exports refused; a corrupted tensor caught by the numbers alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (bash scripts/setup_llama_cpp.sh)")

from bundle_device import assert_self_contained, run_bundle  # noqa: E402
from pit_deploy.cli import main  # noqa: E402
from pit_deploy.io.checkpoint import save_model  # noqa: E402
from pit_deploy.io.manifest import Manifest  # noqa: E402
from pit_deploy.tiny import tiny_model, tiny_pit_model, tiny_tokenizer  # noqa: E402

CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


def _source(tmp_path: Path, family: str, pit: bool = True) -> Path:
    src = tmp_path / f"{family}-src"
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE  # the GGUF must carry it to llama.cpp's chat formatting
    save_model(tiny_pit_model(family) if pit else tiny_model(family), src, tokenizer)
    return src


def _export(tmp_path: Path, family: str, dtypes: str, *extra: str, pit: bool = True) -> Path:
    out = tmp_path / f"{family}-exp"
    assert main(["export", str(_source(tmp_path, family, pit)), "--out", str(out), "--runtime", "gguf",
                 "--mode", "materialized", "--dtype", dtypes, *extra]) == 0
    return out


def _verify(out: Path, capsys, code: int = 0) -> list[dict]:
    capsys.readouterr()
    assert main(["verify", str(out), "--no-record", "--json"]) == code
    return json.loads(capsys.readouterr().out)["artifacts"]


def _tensors(path: Path) -> dict[str, object]:
    from gguf import GGUFReader

    return {t.name: t for t in GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fp32_gguf_loads_in_llama_cpp_and_matches_pytorch(family, tmp_path, capsys):
    out = _export(tmp_path, family, "float32")
    (art,) = Manifest.read(out).artifacts
    folder = out / art.path
    path = folder / art.details["file"]
    assert art.details["kv_cache_type"] == "f32" and art.details["architecture"] == family
    tensors = _tensors(path)
    assert "output.weight" in tensors and "token_embd.weight" in tensors  # the head is untied
    (result,) = _verify(out, capsys)
    assert result["passed"], result["failures"]
    assert result["logits_rel_l2"] <= 1e-4 and result["top1_agreement"] == 1.0 and result["greedy_match"]
    assert result["delta_ti"] <= 1e-5
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    template = bytes(fields["tokenizer.chat_template"].parts[-1]).decode()
    assert template == CHAT_TEMPLATE


def test_llama_rotary_rows_are_reordered_per_head():
    """HF's half-split rotary pairs (i, i + D/2) become llama.cpp's adjacent pairs (2i, 2i + 1)."""
    from pit_deploy.targets.gguf.export import rotary_pairs

    heads, dim = 2, 4
    w = np.arange(heads * dim, dtype=np.float32)[:, None].repeat(3, 1)
    got = rotary_pairs(w, heads)[:, 0].tolist()
    assert got == [0, 2, 1, 3, 4, 6, 5, 7]


def test_factorized_is_refused_with_exit_2_before_export(tmp_path, capsys):
    out = tmp_path / "exp"
    src = _source(tmp_path, "llama")
    for mode in ("factorized", "materialized,factorized"):
        capsys.readouterr()
        assert main(["export", str(src), "--out", str(out), "--runtime", "gguf", "--mode", mode]) == 2
        err = capsys.readouterr().err
        assert [line for line in err.splitlines() if line.startswith("error:")] == [line for line in err.splitlines()
                                                                                     if "error" in line]
        assert err.count("error:") == 1 and "no architecture" in err and "--mode materialized" in err
        assert not out.exists()


@pytest.mark.parametrize("dtype, message", [("int4", "llama.cpp's own types"), ("int8", "llama.cpp's own types")])
def test_other_runtimes_schemes_are_refused(dtype, message, tmp_path, capsys):
    out = tmp_path / "exp"
    assert main(["export", str(_source(tmp_path, "llama")), "--out", str(out), "--runtime", "gguf",
                 "--mode", "materialized", "--dtype", dtype]) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_a_corrupted_tensor_fails_verify(tmp_path, capsys):
    """One body weight of the F32 file overwritten with noise (digests re-recorded, so only the
    numbers can give it away): llama.cpp's logits leave the reference, verify exits 1."""
    from scramble import rehash

    out = _export(tmp_path, "llama", "float32")
    art = Manifest.read(out).artifacts[0]
    path = out / art.path / art.details["file"]
    tensor = _tensors(path)["blk.0.ffn_down.weight"]
    raw = bytearray(path.read_bytes())
    start, length = int(tensor.data_offset), int(tensor.n_bytes)
    raw[start:start + length] = np.random.default_rng(0).standard_normal(length // 4).astype(np.float32).tobytes()
    path.write_bytes(bytes(raw))
    rehash(out)
    (result,) = _verify(out, capsys, code=1)
    assert not result["passed"] and any("rel_l2" in f for f in result["failures"]), result["failures"]


def test_quantized_files_pass_kl_and_the_correction_restores_the_identity(tmp_path, capsys):
    """F16, Q8_0 (gguf-py) and Q4_0 (llama.cpp's quantizer) pass their KL bounds in llama.cpp; with the
    correction the table is the float32 pseudo-inverse of the dequantized head (W_out E = I on
    what llama.cpp reads), without it the table is rounded like the rest and delta_ti is large."""
    out = _export(tmp_path, "llama", "f16,q8_0,q4_0")
    results = {r["scheme"]: r for r in _verify(out, capsys)}
    assert set(results) == {"f16", "q8_0", "q4_0"}
    for art in Manifest.read(out).artifacts:
        quant = art.details["quantization"]
        result = results[art.scheme_name]
        assert result["passed"], result["failures"]
        assert quant["pit_correction"] and quant["table_type"] == "F32" and quant["head_type"] == "BF16"
        tensors = _tensors(out / art.path / art.details["file"])
        assert tensors["output.weight"].tensor_type.name == "BF16" and tensors["token_embd.weight"].tensor_type.name == "F32"
        assert tensors["blk.0.ffn_up.weight"].tensor_type.name == art.details["file_type"]  # the body is the scheme's
        assert result["delta_ti"] <= 1e-5 < quant["delta_ti_uncorrected"]
        assert abs(result["delta_ti"] - quant["delta_ti_corrected"]) <= 1e-6
        assert result["kl_mean"] <= 0.05
    plain = _export(tmp_path / "plain", "llama", "q4_0", "--no-pit-correction")
    (art,) = Manifest.read(plain).artifacts
    assert art.details["quantization"]["table_type"] == "Q4_0"
    (result,) = _verify(plain, capsys)
    assert result["passed"] and result["delta_ti"] > 1e-3


def test_the_interface_is_what_llama_cpp_gathers_and_its_head_computes(tmp_path, capsys, monkeypatch):
    """``delta_ti`` comes from llama.cpp's graph (its gather's rows, its head on injected basis
    vectors), which equal the file's tables as gguf-py dequantizes them; one token row moved in the
    file (digests re-recorded) leaves the greedy text alone but fails verify on delta_ti."""
    from scramble import rehash

    import torch

    from pit_deploy.io.gguf_files import read_gguf_tensors
    from pit_deploy.model import quantized_interface
    from pit_deploy.model.quantized_interface import identity_defect
    from pit_deploy.targets.gguf.driver import LlamaCppDriver
    from pit_deploy.targets.gguf.interface import runtime_interface

    out = _export(tmp_path, "llama", "float32,q4_0")
    for art in Manifest.read(out).artifacts:
        path = out / art.path / art.details["file"]
        table, head = runtime_interface(path, threads=1)
        stored = read_gguf_tensors(path, ("token_embd.weight", "output.weight"))
        np.testing.assert_array_equal(table, stored["token_embd.weight"])
        np.testing.assert_array_equal(head, stored["output.weight"].T)  # not the model's logits
        # verify's figure sums W_out E over parts of both tables, never whole: the same defect
        with LlamaCppDriver(out / art.path) as driver, monkeypatch.context() as patch:
            patch.setattr(quantized_interface, "DEFECT_HEAD_ROWS", 5)  # several groups of basis rows
            by_parts = driver.interface_defect(*table.shape)
        whole = identity_defect(torch.from_numpy(table), torch.from_numpy(head))
        assert by_parts == pytest.approx(whole, rel=1e-9, abs=1e-12)
    art = next(a for a in Manifest.read(out).artifacts if a.scheme_name == "float32")
    path = out / art.path / art.details["file"]
    tensor = _tensors(path)["token_embd.weight"]
    raw = bytearray(path.read_bytes())
    row = int(tensor.data_offset) + 7 * 4 * int(tensor.shape[0])  # row of id 7 (ggml: ne0 = d)
    values = np.frombuffer(bytes(raw[row:row + 4 * int(tensor.shape[0])]), dtype=np.float32)
    raw[row:row + values.nbytes] = (values * 1.01).astype(np.float32).tobytes()
    path.write_bytes(bytes(raw))
    rehash(out)
    capsys.readouterr()
    assert main(["verify", str(out), "--no-record", "--json", "--dtype", "float32"]) == 1
    (result,) = json.loads(capsys.readouterr().out)["artifacts"]
    assert any("delta_ti" in f for f in result["failures"]), result["failures"]


def test_tied_baseline_has_no_output_tensor_and_matches_its_reference(tmp_path, capsys):
    out = tmp_path / "tt"
    assert main(["export", str(_source(tmp_path, "llama", pit=False)), "--out", str(out), "--runtime", "gguf",
                 "--keep-tying", "--dtype", "float32"]) == 0
    (art,) = Manifest.read(out).artifacts
    assert art.mode == "tied" and art.details["tied"]
    assert "output.weight" not in _tensors(out / art.path / art.details["file"])
    (result,) = _verify(out, capsys)
    assert result["passed"], result["failures"]


def test_chat_completion_runs_on_the_file(tmp_path):
    """llama-cpp-python's chat completion formats with the file's own template and generates."""
    from llama_cpp import Llama

    out = _export(tmp_path, "qwen3", "float32")
    art = Manifest.read(out).artifacts[0]
    llm = Llama(model_path=str(out / art.path / art.details["file"]), n_ctx=128, verbose=False)
    reply = llm.create_chat_completion([{"role": "user", "content": "def"}], max_tokens=4, temperature=0.0)
    llm.close()
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert reply["usage"]["prompt_tokens"] > 2




def test_bench_bundle_runs_the_gguf_with_llama_cpp_only(tmp_path, capsys):
    """``bench --bundle`` packs the gguf decoder beside the standalone runtime; on a "device"
    where importing pit_deploy or transformers fails it reproduces the reference's greedy tokens."""
    out = _export(tmp_path, "llama", "float32")
    bundle = tmp_path / "edge.tar.gz"
    assert main(["bench", str(out), "--bundle", str(bundle), "--prompt-len", "8", "--gen-len", "6", "--reps", "1"]) == 0
    (row,) = run_bundle(bundle, tmp_path)
    assert row["runtime"] == "gguf" and row["first_divergence"] is None and row["decode_tok_s"] > 0
    assert not {"pit_deploy", "transformers"} & set(row["imported"])


def test_standalone_decoder_imports_nothing_of_the_package():
    from pit_deploy.targets.gguf import decoder as llama_cpp_decoder
    from pit_deploy.targets.gguf import SPEC_NAME

    assert llama_cpp_decoder.SPEC_NAME == SPEC_NAME  # the decoder cannot import the target's constant
    assert_self_contained(Path(llama_cpp_decoder.__file__), ("transformers", "torch"))


def test_the_decoder_writes_each_positions_logits_once_into_an_array_of_the_callers(tmp_path):
    """The decoder evaluates through llama.cpp's context and batch, not ``Llama.eval``: a prefill's
    logits are the caller's own array (a later call leaves it as it was; llama-cpp-python's logits
    array is not written), ``prefill_last`` is the last row of ``prefill``, and steps continue
    the cache the way a longer prefill computes the same positions (to rounding: llama.cpp's kernels
    differ with the number of rows)."""
    from pit_deploy.targets.gguf.decoder import PREFILL_BATCH, LlamaCppDecoder

    out = _export(tmp_path, "llama", "float32")
    (art,) = Manifest.read(out).artifacts
    decoder = LlamaCppDecoder(out / art.path / art.details["file"], threads=1)
    ids = np.random.default_rng(0).integers(3, decoder.vocab, PREFILL_BATCH + 9)  # two batches
    whole = decoder.prefill(ids)
    kept = whole.copy()
    assert whole.shape == (len(ids), decoder.vocab) and whole.flags.owndata and np.isfinite(whole).all()
    assert not np.shares_memory(whole, decoder.llm.scores) and decoder.llm.scores.shape[0] == PREFILL_BATCH
    last = decoder.prefill_last(ids)  # the head on one row: another kernel, the same values to rounding
    assert np.allclose(last, whole[-1], rtol=1e-5, atol=1e-6) and last.argmax() == whole[-1].argmax()
    first = decoder.prefill(ids[:5])
    assert np.array_equal(first, whole[:5]) and np.array_equal(whole, kept)
    steps = np.stack([decoder.step(int(t), 5 + k) for k, t in enumerate(ids[5:9])])
    assert np.allclose(steps, whole[5:9], rtol=1e-4, atol=1e-4)
    assert [int(row.argmax()) for row in steps] == [int(row.argmax()) for row in whole[5:9]]
    with pytest.raises(ValueError, match="9 tokens are cached"):
        decoder.step(1, 11)
    decoder.close()


def test_an_export_to_gguf_alone_never_materializes_the_tables(tmp_path, monkeypatch):
    """The pipeline hands the gguf target a model without its two tables (their rows computed as
    the file is written) when every target of the mode writes them so (the float32 ``onnx``
    target does too), and materializes them once where another target of the same mode needs
    them whole (``onnx-genai``'s builder reads a checkpoint)."""
    from pit_deploy.exporters import pipeline
    from pit_deploy.exporters.passes import TABLE_ROWS_ATTR

    asked, prepare = [], pipeline.prepare

    def recorded(model, mode, dtype, tables_by_rows=False):
        prepared = prepare(model, mode, dtype, tables_by_rows)
        asked.append((mode, tables_by_rows, hasattr(prepared, TABLE_ROWS_ATTR)))
        return prepared

    monkeypatch.setattr(pipeline, "prepare", recorded)
    _export(tmp_path, "llama", "float32")
    assert asked == [("materialized", True, True)]
    asked.clear()
    for other, by_rows in (("onnx", True), ("onnx-genai", False)):
        out = tmp_path / f"gguf-{other}"
        assert main(["export", str(tmp_path / "llama-src"), "--out", str(out), "--runtime", f"gguf,{other}",
                     "--mode", "materialized", "--dtype", "float32"]) == 0
        assert asked == [("materialized", by_rows, by_rows)], other
        assert {a.target for a in Manifest.read(out).artifacts} == {"gguf", other}
        asked.clear()

"""Properties of the artifacts themselves: storage, runner conventions, optimum generation."""

from __future__ import annotations

import json

import pytest
import torch

from pit_deploy.io.checkpoint import load_pit_model
from pit_deploy.io.manifest import MANIFEST_NAME, Manifest


def _count_vd(path, v, d):
    from pit_deploy.targets.onnx.interface_weights import large_initializers

    return [s for _, s in large_initializers(path, v * d) if sorted(s) == sorted((v, d))]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_onnx_factorized_keeps_z_once(exports, family):
    out, _ = exports.tiny(family)
    v, d = 512, 64
    assert len(_count_vd(out / "onnx-factorized" / "onnx" / "model.onnx", v, d)) == 1
    assert len(_count_vd(out / "onnx-materialized" / "onnx" / "model.onnx", v, d)) == 2


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
    from pit_deploy.runtime.standalone import pte_data_file

    pte = out / f"executorch-{mode}" / "model.pte"
    data = pte_data_file(pte)  # a factorized program keeps its constants in model.ptd
    assert (data is not None) == (mode == "factorized")
    program = Runtime.get().load_program(str(pte), data_path=None if data is None else str(data))
    names = set(program.method_names)
    assert {"forward", "embed", "head", "get_max_seq_len", "get_max_context_len", "use_kv_cache",
            "enable_dynamic_shape", "get_eos_ids"} <= names
    assert program.load_method("get_max_seq_len").execute([])[0] == 64
    assert bool(program.load_method("use_kv_cache").execute([])[0]) is True
    assert bool(program.load_method("enable_dynamic_shape").execute([])[0]) is True
    assert list(program.load_method("get_eos_ids").execute([])) == [2]
    fwd = program.load_method("forward")
    # one-call prefill of different lengths (dynamic sequence dimension), the last position's
    # logits only (what the runner samples from; a full [1, n, V] would size the planned pool)
    for n in (1, 7, 40):
        logits = fwd.execute([torch.arange(3, 3 + n)[None], torch.tensor([0])])
        assert len(logits) == 1 and tuple(logits[0].shape) == (1, 1, 512)


@pytest.mark.parametrize("mode", ["materialized", "factorized"])
def test_ort_model_generates_like_pytorch(exports, mode):
    from optimum.onnxruntime import ORTModelForCausalLM

    out, _ = exports.tiny("granite")
    ort = ORTModelForCausalLM.from_pretrained(out / f"onnx-{mode}", subfolder="onnx")
    ref = load_pit_model(out / "reference")
    ids = torch.tensor([[5, 17, 99, 250, 3, 42]])
    kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False)
    with torch.no_grad():
        expected = ref.generate(ids, **kw)
    got = ort.generate(ids, **kw)
    assert torch.equal(got, expected)


def test_pte_folder_carries_a_tokenizer_the_stock_runner_loads(exports):
    out, report = exports.tiny("llama")
    manifest = Manifest.read(out)
    for art in manifest.artifacts:
        if art.runtime != "executorch":
            continue
        assert f"{art.path}/tokenizer.json" in art.files, "the tokenizer file must be digest-covered"
        assert art.details["runner_tokenizer"] == "tokenizer.json"
        runner = report.result("executorch", art.mode).stock_runner
        assert runner["identical"] is True and runner["prompts"] == 3, runner
        assert all(a["runner"] == a["reference"] and a["runner"] for a in runner["answers"])


def test_tampered_runner_tokenizer_fails_verify(exports, tmp_path):
    """A runner tokenizer that decodes differently (its byte-level decoder removed), digests
    re-recorded so only the stock runner can notice: verify fails and says so."""
    import shutil

    from pit_deploy.evaluate.verify import verify_directory
    from pit_deploy.io.fs import sha256_file

    src, _ = exports.tiny("llama")
    out = tmp_path / "tampered"
    shutil.copytree(src, out)
    tok_path = out / "executorch-factorized" / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    assert tok["decoder"] is not None
    tok["decoder"] = None
    tok_path.write_text(json.dumps(tok))
    data = json.loads((out / MANIFEST_NAME).read_text())
    for art in data["artifacts"]:
        key = "executorch-factorized/tokenizer.json"
        if key in art["files"]:
            art["files"][key] = {"sha256": sha256_file(tok_path), "bytes": tok_path.stat().st_size}
    (out / MANIFEST_NAME).write_text(json.dumps(data))
    report = verify_directory(out, runtimes="executorch", modes="factorized", record=False)
    r = report.result("executorch", "factorized")
    assert r.greedy_match is True, "the program itself is untouched"
    assert not r.passed and any("stock ExecuTorch LLM runner" in f for f in r.failures), r.failures


def test_bench_has_a_stock_runner_row_per_pte(exports, tmp_path, capsys):
    """`bench` times each .pte twice: through the Python driver and through ExecuTorch's stock
    LLM runner, whose row carries the runner's own Stats figures. The runner's clock counts whole
    milliseconds: 12 tokens of the tiny model decoded within one tick (a NaN rate, as documented
    in ``pass_figures``) once its layers ran in one XNNPACK partition, so it generates 48."""
    import math

    from pit_deploy.cli import main
    from pit_deploy.evaluate.bench import ROW_FIELDS

    out, _ = exports.tiny("llama")
    assert main(["bench", str(out), "--threads", "1", "--prompt-len", "8", "--gen-len", "48", "--reps", "2",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    runner_rows = [r for r in rows if r["runtime"] == "executorch-llm-runner"]
    assert {r["mode"] for r in runner_rows} == {"materialized", "factorized"} and len(rows) == 6
    for r in runner_rows:
        assert set(ROW_FIELDS) <= set(r) and "first_divergence" not in r
        assert r["prompt_tokens"] >= 1 and r["generated_tokens"] >= 1 and r["runner_text"]
        assert math.isfinite(r["decode_tok_s"]) and r["decode_tok_s"] > 0 and r["peak_rss_mb"] > 0

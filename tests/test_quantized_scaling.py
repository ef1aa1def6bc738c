"""Quantized parity scaled to the model: every quantized artifact's manifest entry records the
error its weight rounding alone is expected to cost (measured at export in PyTorch, without the
artifact), and ``verify`` fails an artifact whose KL is further from fp32 than that explains —
which the absolute bounds, set on the default model, cannot do on a tiny one.

Cost: ONNX on every family of ``FAMILIES`` (factorized int8 and int4: one export per family,
verified honest, then with random bytes in every body weight); the ``.pte`` scrambled case
(factorized int4, a quantized lowering of about a minute) on Llama only: the scrambling and the
``.pte`` weight grid act on torchao's ``nn.Linear`` quantization, the same code for every family
whose ``.pte`` body is quantized (Llama, Qwen3, Granite; GPT-2's ``Conv1D`` linears are not), and
``studies/quantized_scaling.py`` runs the case on all of them (its results file records each).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pit_deploy.cli import main
from pit_deploy.evaluate.verify import verify_directory
from pit_deploy.exporters.expected_error import fake_quantize
from pit_deploy.io.checkpoint import save_model
from pit_deploy.io.manifest import MANIFEST_NAME
from pit_deploy.schemes import QuantizedBounds, bounds_for
from pit_deploy.tiny import FAMILIES, tiny_pit_model

from scramble import rehash, scramble_onnx_body, scrambled_pte_linears

QUANTIZED = ("int8", "int4")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qscale-src")
    out = {}
    for family in FAMILIES:
        out[family] = root / family
        save_model(tiny_pit_model(family), out[family])
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def onnx_export(request, sources, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(f"qscale-{request.param}") / "exp"
    assert main(["export", str(sources[request.param]), "--out", str(out), "--runtime", "onnx",
                 "--mode", "factorized", "--dtype", ",".join(QUANTIZED), "--max-seq-len", "64"]) == 0
    return out


@pytest.fixture(scope="module")
def llama_export(sources, tmp_path_factory) -> Path:
    """Checks of the manifest's reading need one family's export, not four."""
    out = tmp_path_factory.mktemp("qscale-one") / "exp"
    assert main(["export", str(sources["llama"]), "--out", str(out), "--runtime", "onnx",
                 "--mode", "factorized", "--dtype", ",".join(QUANTIZED), "--max-seq-len", "64"]) == 0
    return out


def _copy(export: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(export, target)
    return target


def test_honest_onnx_artifacts_pass_the_scaled_check(onnx_export):
    """The expected error is recorded per artifact, and the honest artifact is within the bound
    it scales (the runtime also rounds activations, so its KL is at least about as large)."""
    manifest = json.loads((onnx_export / MANIFEST_NAME).read_text())
    for art in manifest["artifacts"]:
        expected = art["details"]["expected"]
        assert 0 < expected["kl_mean"] < expected["kl_p99"] and "PyTorch" in expected["method"]
    report = verify_directory(onnx_export, record=False)
    assert report.passed, str(report)
    for dtype in QUANTIZED:
        r = report.result("onnx", "factorized", dtype)
        assert r.expected_kl_mean > 0 and r.scaled_bounds["kl_mean"] >= r.kl_mean
        assert 0.5 * r.expected_kl_mean <= r.kl_mean, (r.kl_mean, r.expected_kl_mean)
        assert not any("scaled KL check was not available" in n for n in r.notes)


def test_random_body_weights_fail_verification_on_onnx(onnx_export, tmp_path, capsys):
    """Random bytes in every body ``MatMulNBits`` weight, digests re-recorded (a broken exporter,
    not a tampered file): within the absolute bounds on a tiny model, but far beyond the error
    its quantization explains — exit 1, naming the scaled bound."""
    d = _copy(onnx_export, tmp_path)
    for dtype in QUANTIZED:
        assert scramble_onnx_body(d / f"onnx-factorized-{dtype}") > 0
    rehash(d)
    assert main(["verify", str(d), "--no-record", "--json"]) == 1
    for art in json.loads(capsys.readouterr().out)["artifacts"]:
        assert not art["passed"]
        assert any("expected at export" in f for f in art["failures"]), art["failures"]
        absolute = bounds_for(art["scheme"])
        assert art["kl_mean"] <= absolute.kl_mean  # what the absolute bound alone let through


def test_random_body_weights_fail_verification_on_pte(sources, tmp_path, capsys):
    """The ``.pte`` case: the quantized linears' codes are replaced by random ones before
    lowering (``tests/scramble.py``: editing XNNPACK's packed weights in the flatbuffer is not
    faithful); the expected error is measured on the unquantized model and stays honest."""
    out = tmp_path / "exp"
    with scrambled_pte_linears() as counts:
        assert main(["export", str(sources["llama"]), "--out", str(out), "--runtime", "executorch",
                     "--mode", "factorized", "--dtype", "int4", "--max-seq-len", "64"]) == 0
    assert counts and all(counts)
    assert main(["verify", str(out), "--no-record", "--json"]) == 1
    (art,) = json.loads(capsys.readouterr().out)["artifacts"]
    assert not art["passed"] and any("expected at export" in f for f in art["failures"]), art["failures"]


def test_a_manifest_without_the_expectation_is_refused(llama_export, tmp_path, capsys):
    """Deleting the expected error would drop the scaled check: the target records it for every
    quantized artifact, so a manifest without it is unusable input (exit 2, re-export)."""
    d = _copy(llama_export, tmp_path)
    data = json.loads((d / MANIFEST_NAME).read_text())
    for art in data["artifacts"]:
        del art["details"]["expected"]
    (d / MANIFEST_NAME).write_text(json.dumps(data))
    assert main(["verify", str(d), "--no-record"]) == 2
    err = capsys.readouterr().err
    assert "details.expected" in err and "re-export" in err, err


@pytest.mark.parametrize("bad", [{"kl_mean": "x", "kl_p99": 0.1}, {"kl_mean": -1.0, "kl_p99": 0.1}, [1, 2]])
def test_a_garbled_expectation_is_exit_2(llama_export, tmp_path, capsys, bad):
    d = _copy(llama_export, tmp_path)
    data = json.loads((d / MANIFEST_NAME).read_text())
    data["artifacts"][0]["details"]["expected"] = bad
    (d / MANIFEST_NAME).write_text(json.dumps(data))
    assert main(["verify", str(d), "--no-record"]) == 2
    assert "details.expected" in capsys.readouterr().err


def test_recipe_bounds_override_the_scaled_check(llama_export, tmp_path, capsys):
    """``[bounds.<scheme>]`` reaches the factor and the floor like every other bound."""
    d = _copy(llama_export, tmp_path)
    data = json.loads((d / MANIFEST_NAME).read_text())
    data["recipe"]["bounds"] = {"int4": {"expected_factor": 0.5, "expected_floor": 0.0}}
    (d / MANIFEST_NAME).write_text(json.dumps(data))
    assert main(["verify", str(d), "--dtype", "int4", "--no-record", "--json"]) == 1
    (art,) = json.loads(capsys.readouterr().out)["artifacts"]
    assert art["bounds"]["expected_factor"] == 0.5 and not art["passed"]


def test_scaled_bound_is_the_larger_of_factor_and_floor():
    b = QuantizedBounds(expected_factor=3.0, expected_floor=1e-3, expected_factor_p99=2.0, expected_floor_p99=1e-2)
    assert b.scaled_kl_bound(0.1, 1.0) == pytest.approx((0.3, 2.0))
    assert b.scaled_kl_bound(1e-6, 1e-6) == (1e-3, 1e-2)


def test_the_rounding_reproduces_both_runtimes_grids():
    """The expected error's own rounding (written without the exporters' quantizers) lands on
    onnxruntime's asymmetric blocks and on the symmetric grid of the ``.pte`` token table, up to
    float32 rounding of the scales (a rare tie may round one code the other way)."""
    from pit_deploy.targets.executorch.token_table import dequantize_rows, quantize_rows
    from pit_deploy.exporters.onnx_tables import block_quantize

    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 64)).astype(np.float32)
    w[:, 3] *= 10.0  # an outlier column
    for bits in (4, 8):
        ort = block_quantize(w, bits, 32).dequantize()
        mine = fake_quantize(torch.from_numpy(w), bits, 32, symmetric=False).numpy()
        assert (np.abs(ort - mine) > 1e-5).mean() < 1e-2
        q, scales = quantize_rows(torch.from_numpy(w), 32, bits)
        mine = fake_quantize(torch.from_numpy(w), bits, 32, symmetric=True).numpy()
        np.testing.assert_allclose(mine, dequantize_rows(q, scales), atol=1e-5)
    per_row = fake_quantize(torch.from_numpy(w), 8, None, symmetric=True)
    steps = torch.from_numpy(np.abs(w).max(1, keepdims=True) / 127)
    assert float(((per_row - torch.from_numpy(w)).abs() / steps).max()) <= 0.5 + 1e-4


def test_fake_quantize_by_row_chunks_is_one_pass(monkeypatch):
    """The expected-error rounding works on a few rows at a time (a 262k-token table is 1.3 GB
    a float64 copy): the values are those of one pass, in the dtype asked for."""
    from pit_deploy.model import core

    w = torch.randn(45, 64, generator=torch.Generator().manual_seed(2))
    whole = fake_quantize(w, 4, 32, symmetric=False, dtype=torch.float64)
    monkeypatch.setattr(core, "POLAR_CHUNK_ROWS", 8)
    assert torch.equal(fake_quantize(w, 4, 32, symmetric=False, dtype=torch.float64), whole)
    assert torch.equal(fake_quantize(w, 4, 32, symmetric=False), whole.to(torch.float32))

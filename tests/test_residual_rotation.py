"""The residual rotation a quantized ``.pte``'s body is rounded in (``rotate_residual``): an
orthogonal Hadamard-based ``Q``, a symmetry of the float32 model (same logits, same interface),
and a ``.pte`` that carries it keeps ``W_out E = I`` on the runtime."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pit_deploy.cli import main
from pit_deploy.errors import PitError
from pit_deploy.evaluate.verify import verify_directory
from pit_deploy.exporters.passes import InterfaceProbe, prepare
from pit_deploy.exporters.residual_rotation import (Unrotate, hadamard, rotate_residual, rotation_matrix,
                                                 rotation_of)
from pit_deploy.io.manifest import MANIFEST_NAME
from pit_deploy.schemes import get_scheme
from pit_deploy.tiny import tiny_model, tiny_pit_model
from pit_models import dense_t_pit_dir


@pytest.mark.parametrize("n", [1, 2, 12, 24, 48, 64, 144, 576])
def test_hadamard_orders(n):
    h = hadamard(n)
    assert h.shape == (n, n) and set(np.unique(h)) <= {-1, 1}
    assert np.array_equal(h @ h.T, n * np.eye(n, dtype=np.int64))


def test_other_orders_get_a_random_orthogonal_matrix():
    assert hadamard(40) is None and hadamard(36) is None
    for d in (40, 576):
        q = rotation_matrix(d)
        assert torch.allclose(q @ q.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
    hq = rotation_matrix(576)
    assert torch.allclose(hq.abs(), torch.full_like(hq, 576 ** -0.5))  # a Hadamard's entries: all ±1/√d
    assert torch.equal(hq, rotation_matrix(576))  # a fixed seed: the export is reproducible


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
@pytest.mark.parametrize("mode", ["factorized", "materialized"])
def test_rotation_leaves_the_logits_and_the_interface_unchanged(family, mode):
    """The fp32 logits change by at most 1e-5 (relative), the probe's ``E`` rows and head rows
    (what ``delta_ti`` is measured on) are the unrotated ones, and the body did change."""
    prepared = prepare(tiny_pit_model(family), mode)
    rotated = rotate_residual(prepared)
    assert rotation_of(prepared) is None and rotation_of(rotated) is not None
    assert isinstance(rotated.model.norm, Unrotate)
    ids = torch.randint(0, prepared.config.vocab_size, (1, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = prepared(input_ids=ids).logits, rotated(input_ids=ids).logits
        assert float((got - ref).norm() / ref.norm()) < 1e-5
        d, v = prepared.config.hidden_size, prepared.config.vocab_size
        all_ids, basis = torch.arange(v), torch.eye(d)
        before, after = InterfaceProbe(prepared), InterfaceProbe(rotated)
        e0, e1 = before.embed(all_ids), after.embed(all_ids)
        assert float((e1 - e0).norm() / e0.norm()) < 1e-5
        w0, w1 = before.head_logits(basis), after.head_logits(basis)
        assert float((w1 - w0).norm() / w0.norm()) < 1e-6
        if mode == "factorized":  # W_out E = I for the probe's rows, as for the unrotated model's
            identity = w1.double() @ e1.double()  # head rows (d, V) times table rows (V, d)
            assert float((identity - torch.eye(d, dtype=torch.float64)).abs().max()) < 1e-4
    q_before = prepared.model.layers[0].self_attn.q_proj.weight
    q_after = rotated.model.layers[0].self_attn.q_proj.weight
    assert float((q_after - q_before).abs().max()) > 1e-3


def test_rotation_refuses_families_without_the_symmetry():
    from pit_deploy.converters.conversion import convert_model

    gpt2 = prepare(convert_model(tiny_model("gpt2")), "factorized")
    with pytest.raises(PitError, match="rotate_residual"):
        rotate_residual(gpt2)


def test_rotation_is_a_quantized_executorch_setting():
    assert get_scheme("int4").rotate_residual is True
    with pytest.raises(PitError, match="rotate_residual applies to quantized"):
        get_scheme("float32").with_settings(rotate_residual=True)
    assert get_scheme("int4").with_settings(rotate_residual=False).settings().get("rotate_residual") is None


# Full tier: two int4 lowerings and two verifications (about two minutes). In the default tier the
# rotated int4 .pte verifies with delta_ti <= 1e-4 on the runtime in
# tests/test_quantize.py::test_executorch_4bit_token_table_keeps_the_interface_exact and in the
# README block (tests/test_own_model.py); what only this test adds is the unrotated export beside it.
@pytest.mark.full
def test_a_rotated_int4_pte_keeps_the_interface_exact_on_the_runtime(tmp_path):
    """The ``int4`` ``.pte`` (rotated by default) and the same export with ``--no-rotate-residual``:
    both verify, with ``delta_ti ≤ 1e-4`` measured on the runtime, and the manifest says which."""
    source = dense_t_pit_dir("llama", tmp_path)
    expected = {}
    for flag, rotated in (([], True), (["--no-rotate-residual"], False)):
        out = tmp_path / f"exp-{rotated}"
        assert main(["export", str(source), "--out", str(out), "--runtime", "executorch", "--mode", "factorized",
                     "--dtype", "int4", "--max-seq-len", "64", *flag]) == 0
        (art,) = json.loads((out / MANIFEST_NAME).read_text())["artifacts"]
        assert art["details"]["scheme"].get("rotate_residual", False) is rotated
        report = verify_directory(out, record=False)
        assert report.passed, str(report)
        result = report.result("executorch", "factorized", "int4")
        assert result.interface_exact is True and result.delta_ti <= 1e-4, (rotated, result.delta_ti)
        expected[rotated] = art["details"]["expected"]["kl_mean"]
    # the expected error (which scales verify's bound) is measured on the rotated model too: of the
    # same order as the unrotated one's, not the KL of a table read in the wrong basis
    assert expected[True] < 3 * expected[False] + 1e-3, expected


def test_models_without_the_symmetry_are_named_and_exported_unrotated(tmp_path):
    """A family outside the pre-norm RMSNorm ones, or a tied embedding and head (which would turn
    with the table), is not rotated: :func:`rotation_blocker` says why, and ``int4``'s default
    rotation gives way in the export instead of failing it."""
    from pit_deploy.exporters.residual_rotation import rotation_blocker

    assert rotation_blocker(prepare(tiny_pit_model("llama"), "factorized")) is None
    assert "tied" in rotation_blocker(prepare(tiny_model("llama", tie_word_embeddings=True), "tied"))
    assert "gpt2" in rotation_blocker(prepare(tiny_pit_model("gpt2"), "factorized"))
    out = tmp_path / "exp"
    assert main(["export", str(dense_t_pit_dir("gpt2", tmp_path)), "--out", str(out), "--runtime", "executorch",
                 "--mode", "factorized", "--dtype", "int4", "--max-seq-len", "64"]) == 0
    (art,) = json.loads((out / MANIFEST_NAME).read_text())["artifacts"]
    assert "rotate_residual" not in art["details"]["scheme"]

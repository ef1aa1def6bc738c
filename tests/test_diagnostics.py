"""Token-interface metrics against definitions computed the slow, obvious way."""

from __future__ import annotations

import math

import pytest
import torch

from pit_deploy.converters.conversion import convert_model
from pit_deploy.analysis.diagnostics import METRIC_KEYS, diagnose_model, interface_metrics, pseudo_inverse_rows
from pit_deploy.tiny import tiny_model


def _random(v: int = 300, d: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randn(v, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_pseudo_inverse_matches_pinv() -> None:
    w = _random().T
    assert torch.allclose(pseudo_inverse_rows(w), torch.linalg.pinv(w), atol=1e-10)


def test_pseudo_inverse_of_rank_deficient_head_falls_back_to_svd() -> None:
    w = _random().T.clone()
    w[3] = w[2]
    assert torch.allclose(pseudo_inverse_rows(w), torch.linalg.pinv(w), atol=1e-8)


def test_exact_pseudo_inverse_pair_scores_zero() -> None:
    e = _random()
    w = torch.linalg.pinv(e)  # W_out = E⁺ so W_out E = I and W_out⁺ = E
    r = interface_metrics(e, w)
    assert r.delta_ti < 1e-10 and r.cosine_distance < 1e-12
    assert r.procrustes_error < 1e-7 and r.principal_angle < 1e-7


def test_transpose_tying_of_a_non_orthogonal_table_drifts() -> None:
    e = _random() * torch.linspace(0.1, 3.0, 16, dtype=torch.float64)
    r = interface_metrics(e, e.T, "tied", extended=True)
    assert r.delta_ti > 1.0 and r.cosine_distance > 1e-3 and r.principal_angle > 1e-2
    assert r.polar_distance < 1e-10, "polar factors coincide under exact transpose tying"


def test_metrics_match_their_definitions() -> None:
    e, w = _random(200, 8, 1), _random(200, 8, 2).T
    r = interface_metrics(e, w)
    b_out = torch.linalg.pinv(w)
    cos = torch.nn.functional.cosine_similarity(e, b_out, dim=1)
    assert math.isclose(r.cosine_distance, float((1 - cos).mean()), rel_tol=1e-9)
    angle = torch.arccos(cos.clamp(-1, 1)).mean()
    assert math.isclose(r.principal_angle, float(angle), rel_tol=1e-6)
    assert math.isclose(r.delta_ti, float(torch.linalg.matrix_norm(w @ e - torch.eye(8, dtype=torch.float64))), rel_tol=1e-12)
    # Procrustes: the minimum over orthogonal R has the closed form
    # ‖A‖² + ‖B‖² − 2‖AᵀB‖_* (nuclear norm; Schönemann 1966), and no random R beats it.
    a, b = e / e.norm(), b_out / b_out.norm()
    optimum = torch.sqrt(a.square().sum() + b.square().sum() - 2 * torch.linalg.matrix_norm(a.T @ b, ord="nuc"))
    assert math.isclose(r.procrustes_error, float(optimum), rel_tol=1e-9)
    for seed in range(20):
        q, _ = torch.linalg.qr(_random(8, 8, 100 + seed))
        assert torch.linalg.matrix_norm(a @ q - b) >= r.procrustes_error - 1e-12


def test_zero_rows_are_counted_not_averaged() -> None:
    e = _random()
    e[:5] = 0
    r = interface_metrics(e, torch.linalg.pinv(e))
    assert r.degenerate_rows == 5 and math.isfinite(r.cosine_distance)


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="W_out must be"):
        interface_metrics(_random(), _random())


def test_model_reports(family: str) -> None:
    tied = diagnose_model(tiny_model(family))
    assert tied.tying == "tied" and tied.delta_ti > 1e-2
    pit_model = convert_model(tiny_model(family), "output")
    pit = diagnose_model(pit_model)
    assert pit.tying == "pit"
    assert pit.delta_ti <= 1e-5 and pit.cosine_distance <= 1e-6 and pit.principal_angle <= 1e-5
    assert pit.extra["z_orthogonality_error"] < 1e-5
    untied = diagnose_model(tiny_model(family, tie_word_embeddings=False))
    assert untied.tying == "untied"
    data = pit.to_dict()
    assert all(k in data for k in (*METRIC_KEYS, "vocab_size", "hidden_size", "tying"))
    assert "delta_ti" in str(pit)

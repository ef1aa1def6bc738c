"""The source-preserving conversion on tiny models of every family it covers: the body is
exact after folding and rotation, W_out E = I, the fitted head is closer to the source than
every paper init, the checkpoint round-trips, and LayerNorm families are refused clearly."""

from __future__ import annotations

import torch
import pytest

from pit_deploy.convert import convert_model
from pit_deploy.convert.preserve import fit_symmetric, weighted_misfit
from pit_deploy.errors import PitError
from pit_deploy.io.checkpoint import load_pit_model, save_model
from pit_deploy.model.families import adapter_for
from pit_deploy.model.inspect import interface_delta_ti
from pit_deploy.tiny import tiny_model

FAMILIES = ["llama", "qwen3", "granite"]


def _source(family: str) -> torch.nn.Module:
    """A tiny model whose norm gains are not all one (block norms and the final norm, one
    negative): with unit gains ``A = H²`` is symmetric and any method would look exact."""
    model = tiny_model(family).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.5 * torch.randn(param.shape, generator=gen))
        final = adapter_for(model.config).final_norm(model).weight
        final[0] = -abs(float(final[0])) - 0.5
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(3))


def _kl(ref: torch.Tensor, logits: torch.Tensor) -> float:
    lp_ref, lp = torch.log_softmax(ref.double(), -1), torch.log_softmax(logits.double(), -1)
    return float((lp_ref.exp() * (lp_ref - lp)).sum(-1).mean())


@pytest.mark.parametrize("family", FAMILIES)
def test_body_is_exact_after_folding_and_rotation(family):
    src = _source(family)
    ids = _ids()
    captured = {}

    def hook(name):
        return lambda _m, args: captured.__setitem__(name, args[0].detach().double())

    h = adapter_for(src.config).final_norm(src).register_forward_pre_hook(hook("src"))
    with torch.no_grad():
        src(ids)
    h.remove()
    pit = convert_model(_source(family), "preserve")
    rot = pit.pit_interface.Z.detach().double()  # Z = U R
    h = adapter_for(pit.config).final_norm(pit).register_forward_pre_hook(hook("pit"))
    with torch.no_grad():
        pit(ids)
    h.remove()
    # R from Z = U R (U: polar factor of the source embedding): R = Uᵀ Z
    from pit_deploy.model.core import polar_factor
    from pit_deploy.model.inspect import effective_interface

    e_eff, _, _ = effective_interface(_source(family))
    u, _ = polar_factor(e_eff)
    r = u.double().T @ rot
    assert torch.allclose(r.T @ r, torch.eye(r.shape[0], dtype=torch.float64), atol=1e-5)
    expected = captured["src"] @ r
    scale = expected.abs().max()
    assert float((captured["pit"] - expected).abs().max() / scale) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_interface_is_exact_and_closer_than_every_paper_init(family):
    ids = _ids()
    src = _source(family)
    with torch.no_grad():
        ref = src(ids).logits
    kls = {}
    for t_init in ("identity", "input", "output", "preserve"):
        model = convert_model(_source(family), t_init)
        assert interface_delta_ti(model) < 1e-5
        with torch.no_grad():
            kls[t_init] = _kl(ref, model(ids).logits)
    assert kls["preserve"] < min(kls[t] for t in ("identity", "input", "output")), kls


def test_checkpoint_round_trip_keeps_the_logits(tmp_path):
    model = convert_model(_source("llama"), "preserve")
    assert model.config.pit["t_init"] == "preserve"
    assert model.config.pit["preserve"]["misfit_fitted"] <= model.config.pit["preserve"]["misfit_identity_rotation"]
    save_model(model, tmp_path / "pit")
    again = load_pit_model(tmp_path / "pit")
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)


def test_layernorm_family_is_refused_with_a_paper_init_named():
    with pytest.raises(PitError, match="--t-init identity, input or output"):
        convert_model(tiny_model("gpt2"), "preserve")


def test_fit_solves_the_weighted_problem():
    """The closed form beats random symmetric perturbations of itself (it is the minimizer)."""
    gen = torch.Generator().manual_seed(0)
    d = 6
    a = torch.randn(d, d, generator=gen, dtype=torch.float64)
    m1, m2 = torch.randn(d, d, generator=gen, dtype=torch.float64), torch.randn(d, d, generator=gen, dtype=torch.float64)
    c, p = m1 @ m1.T + 0.1 * torch.eye(d, dtype=torch.float64), m2 @ m2.T + 0.1 * torch.eye(d, dtype=torch.float64)
    g = fit_symmetric(a, c, p)
    assert torch.allclose(g, g.T)
    best = weighted_misfit(g, a, c, p)
    for _ in range(20):
        e = torch.randn(d, d, generator=gen, dtype=torch.float64) * 1e-3
        assert weighted_misfit(g + e + e.T, a, c, p) >= best
    # a symmetric A is recovered exactly
    s = a + a.T
    assert torch.allclose(fit_symmetric(s, c, p), s, atol=1e-8)

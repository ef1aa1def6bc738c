"""The PIT math of the paper's Approach section and Algorithm 1."""

from __future__ import annotations

import pytest
import torch

from pit_deploy.model.core import PITInterface, PITSpec, init_from_embedding, init_random, orthonormalize, polar_factor


def _random_interface(v: int, d: int, seed: int = 0, spec: PITSpec = PITSpec()) -> PITInterface:
    """Random Stiefel Z and a random, well-conditioned, non-diagonal L."""
    gen = torch.Generator().manual_seed(seed)
    iface = init_random(v, d, gen, spec=spec)
    with torch.no_grad():
        iface.L_offdiag.copy_(0.3 / d**0.5 * torch.randn(d, d, generator=gen))
        iface.L_diag.add_(0.2 * torch.randn(d, generator=gen))
    return iface


def _runtime_interface_fp32(iface: PITInterface) -> tuple[torch.Tensor, torch.Tensor]:
    """E and W_out as the FP32 forward computes them: embed every id, head on the basis."""
    with torch.no_grad():
        e = iface.embed(torch.arange(iface.vocab_size))
        w = iface.logits(torch.eye(iface.hidden_size))
    assert e.dtype == torch.float32 and w.dtype == torch.float32
    return e, w


@pytest.mark.parametrize("v,d", [(1000, 64), (50_000, 1024)])
def test_interface_identity_fp32(v: int, d: int) -> None:
    iface = _random_interface(v, d)
    e, w = _runtime_interface_fp32(iface)
    delta = torch.linalg.matrix_norm(w.double() @ e.double() - torch.eye(d, dtype=torch.float64))
    assert delta <= 1e-5, f"‖W_out E − I‖_F = {delta:.3e} in FP32 for V={v}, d={d}"


def test_float64_materialization_is_exact() -> None:
    iface = _random_interface(2000, 128)
    e, w = iface.materialize()
    assert e.dtype == torch.float64
    delta = torch.linalg.matrix_norm(w @ e - torch.eye(128, dtype=torch.float64))
    assert delta <= 1e-5


@pytest.mark.parametrize("diagonal", ["softplus", "exp"])
def test_gradients_match_finite_differences(diagonal: str) -> None:
    iface = _random_interface(40, 6, spec=PITSpec(diagonal=diagonal, train_z=True)).double()
    ids = torch.tensor([[0, 3, 7], [39, 3, 1]])
    hidden = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=False)
    params = (iface.Z, iface.L_offdiag, iface.L_diag)

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.iface = iface

        def forward(self) -> torch.Tensor:
            return (self.iface.embed(ids) * hidden).sum() + self.iface.logits(hidden).pow(2).sum()

    probe = Probe()

    def forward(z, off, diag):
        names = {"iface.Z": z, "iface.L_offdiag": off, "iface.L_diag": diag}
        return torch.func.functional_call(probe, names, ())

    inputs = tuple(p.detach().clone().requires_grad_(True) for p in params)
    assert torch.autograd.gradcheck(forward, inputs, eps=1e-6, atol=1e-6)
    loss = forward(*inputs)
    grads = torch.autograd.grad(loss, inputs)
    assert all(g.abs().sum() > 0 for g in grads), "gradient did not reach Z, L_offdiag or L_diag"


def test_frozen_z_gets_no_gradient_but_l_does() -> None:
    iface = _random_interface(100, 8)
    assert not iface.Z.requires_grad
    loss = iface.embed(torch.tensor([1, 2, 3])).sum() + iface.logits(torch.randn(4, 8)).sum()
    loss.backward()
    assert iface.Z.grad is None
    assert iface.L_diag.grad is not None and iface.L_diag.grad.abs().sum() > 0
    assert iface.L_offdiag.grad is not None and iface.L_offdiag.grad.tril(-1).abs().sum() > 0


def test_retraction_keeps_stiefel_after_100_steps() -> None:
    torch.manual_seed(0)
    iface = _random_interface(3000, 64, spec=PITSpec(train_z=True))
    opt = torch.optim.AdamW(iface.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(100):
        ids = torch.randint(0, 3000, (32,))
        loss = (iface.embed(ids) - 1).pow(2).mean() + iface.logits(torch.randn(16, 64)).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        iface.retract_()
    err = iface.orthogonality_error()
    assert err <= 1e-6, f"‖ZᵀZ − I‖_F = {err:.3e} after 100 steps"


def test_steps_without_retraction_leave_the_manifold() -> None:
    """Control for the test above: the retraction is what keeps Z orthonormal."""
    torch.manual_seed(0)
    iface = _random_interface(3000, 64, spec=PITSpec(train_z=True))
    opt = torch.optim.SGD([iface.Z], lr=1.0)
    loss = (iface.embed(torch.arange(100)) - 1).pow(2).sum()
    loss.backward()
    opt.step()
    assert iface.orthogonality_error() > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_keeps_solves_fp32(dtype: torch.dtype) -> None:
    iface = _random_interface(500, 32)
    ids = torch.arange(500)
    reference = iface.embed(ids)
    with torch.autocast("cpu", dtype=dtype):
        lf = iface.cholesky_factor()
        t = iface.transform()
        emb = iface.embed(ids)
        logits = iface.logits(torch.randn(3, 32))
    assert lf.dtype == torch.float32 and t.dtype == torch.float32
    assert emb.dtype == torch.float32
    assert torch.equal(emb, reference), "the embedding solve must not run in reduced precision"
    assert logits.dtype == dtype, "the head matmuls follow autocast like a plain lm_head"


@pytest.mark.parametrize("method", ["polar", "qr"])
def test_random_init_is_orthonormal(method: str) -> None:
    z = orthonormalize(torch.randn(5000, 96, dtype=torch.float64), method)  # type: ignore[arg-type]
    assert torch.linalg.matrix_norm(z.T @ z - torch.eye(96, dtype=torch.float64)) < 1e-12


def test_polar_factor_reconstructs() -> None:
    a = torch.randn(800, 32, dtype=torch.float64) * torch.logspace(0, 3, 32, dtype=torch.float64)
    u, h = polar_factor(a)
    assert torch.allclose(u @ h, a, atol=1e-9 * a.abs().max())
    assert torch.linalg.matrix_norm(u.T @ u - torch.eye(32, dtype=torch.float64)) < 1e-12
    assert torch.allclose(h, h.T) and torch.linalg.eigvalsh(h).min() > 0


@pytest.mark.parametrize("seed", range(20))
def test_polar_factor_rejects_rank_deficient(seed: int) -> None:
    """A repeated column leaves a Gram eigenvalue of rounding size and random sign: refused
    for every draw (the old test passed only when the eigenvalue came out non-positive)."""
    a = torch.randn(100, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    a[:, 3] = a[:, 2]
    with pytest.raises(ValueError, match="rank deficient"):
        polar_factor(a)


@pytest.fixture
def source_embedding() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    scales = torch.logspace(-1, 1, 48, dtype=torch.float64)
    return torch.randn(700, 48, generator=gen, dtype=torch.float64) * scales


def test_t_init_identity(source_embedding: torch.Tensor) -> None:
    iface = init_from_embedding(source_embedding, "identity")
    t = iface.transform().double()
    assert torch.allclose(t, torch.eye(48, dtype=torch.float64), atol=1e-6)
    u, _ = polar_factor(source_embedding)
    assert torch.allclose(iface.Z.double(), u, atol=1e-6)


def test_t_init_input_reproduces_source_embedding(source_embedding: torch.Tensor) -> None:
    e, _ = init_from_embedding(source_embedding, "input").materialize()
    rel = (e - source_embedding).norm() / source_embedding.norm()
    assert rel < 1e-6, f"E = Z T⁻¹ should equal E0 for T = H⁻¹, relative error {rel:.2e}"


def test_t_init_output_reproduces_tied_head(source_embedding: torch.Tensor) -> None:
    _, w = init_from_embedding(source_embedding, "output").materialize()
    rel = (w - source_embedding.T).norm() / source_embedding.norm()
    assert rel < 1e-6, f"W_out = T Zᵀ should equal E0ᵀ for T = H, relative error {rel:.2e}"


def test_unknown_t_init_is_rejected(source_embedding: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="unknown T init"):
        init_from_embedding(source_embedding, "cholesky")


def test_diagonal_clamp_bounds_l() -> None:
    iface = _random_interface(100, 16, spec=PITSpec(clamp_min=0.9, clamp_max=1.1))
    with torch.no_grad():
        iface.L_diag.fill_(10.0)
    diag = torch.diagonal(iface.cholesky_factor())
    assert torch.all(diag <= 1.1 + 1e-7)
    e, w = iface.materialize()
    assert torch.linalg.matrix_norm(w @ e - torch.eye(16, dtype=torch.float64)) < 1e-5


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="diagonal map"):
        PITSpec(diagonal="relu")
    with pytest.raises(ValueError, match="positive"):
        PITSpec(clamp_min=0.0)


def test_an_interface_takes_a_fresh_table_without_a_second_copy_and_rows_rotate_in_place(monkeypatch):
    """A conversion hands PITInterface the Z it just computed (640 MiB at a 262k vocabulary):
    ``copy=False`` keeps that very tensor, the default still copies a caller's; rotating U's rows
    into U itself gives what rotating into a new table gives."""
    import pit_deploy.model.core as core
    from pit_deploy.model.core import rotate_rows

    monkeypatch.setattr(core, "POLAR_CHUNK_ROWS", 64)  # several chunks, each read before it is written
    g = torch.Generator().manual_seed(0)
    z, _ = polar_factor(torch.randn(300, 8, generator=g, dtype=torch.float64), dtype=torch.float32)
    lf = torch.eye(8, dtype=torch.float64)
    assert PITInterface(z, lf, copy=False).Z.data_ptr() == z.data_ptr()
    assert PITInterface(z, lf).Z.data_ptr() != z.data_ptr()
    r, _ = torch.linalg.qr(torch.randn(8, 8, generator=g, dtype=torch.float64))
    rotated = rotate_rows(z, r)
    assert rotate_rows(z, r, out=z) is z and torch.equal(z, rotated)

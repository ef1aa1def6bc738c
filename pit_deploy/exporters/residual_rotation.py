"""A randomized Hadamard rotation of the residual stream before a quantized body is rounded.

Why: XNNPACK's ``8da4w``/``8da8w`` linears quantize their input to int8 per token, and the
default model's residual stream has a few channels far larger than the rest; a rotation spreads
them over every channel (QuaRot, Ashkboos et al., arXiv:2404.00456; SpinQuant, Liu et al.,
arXiv:2405.16406), and together with calibrated rounding it lowers the KL of the int4 program
(``studies/rotation.md`` for the measurements).

What it does to a prepared (factorized or materialized) model, in float32, with no change to what
the model computes:

* every block norm's gain is folded into the linears that read it and the stream is rotated by an
  orthogonal ``Q`` (readers ``W → W Q``, writers ``W → Qᵀ W``): the conversion's own step
  (:func:`pit_deploy.converters.preserve.fold_and_rotate`), exact for pre-norm RMSNorm blocks;
* the embedding's output enters rotated: its ``d×d`` matrix takes ``Q`` (``T⁻¹ → T⁻¹ Q``; a
  quantized gather's correction ``M → M Q``, :func:`pit_deploy.targets.executorch.token_table.quantize_token_table`), a
  plain table its rows (``E → E Q``): no extra work at run time;
* one ``d×d`` matmul ``Qᵀ`` before the final norm (:class:`Unrotate`) returns to the interface's
  basis, because the final norm's diagonal gain is not a symmetry of ``Q``.

The PIT interface itself (``Z``, ``T``, the head) is untouched, so ``W_out E = I`` is the
unrotated program's: the ``embed`` method the program exposes for ``verify`` multiplies the rows
by ``Qᵀ`` again (:class:`.passes.InterfaceProbe`), and the model carries ``Q`` as
:data:`ROTATION_ATTR`.

``Q = H D / √d`` with ``H`` a Hadamard matrix (Kronecker products of Sylvester's ``H₂`` and
Paley's ``H₁₂``: every ``d = 2^a 12^b``, 576 among them) and ``D`` random signs from a fixed seed;
other sizes get a random orthogonal matrix (QR of a Gaussian), which QuaRot found slightly worse.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

from ..errors import PitError
from ..model.families import adapter_for
from ..model.modules import PITEmbedding

#: the model attribute (a plain ``d×d`` tensor, not a buffer: no constant of the exported program)
#: that holds the rotation of a rotated model
ROTATION_ATTR = "pit_residual_rotation"
#: the seed of the random signs: fixed, so an export is reproducible
ROTATION_SEED = 0


def paley_hadamard(q: int) -> np.ndarray:
    """Paley's construction I: a Hadamard matrix of order ``q + 1`` for a prime ``q ≡ 3 (mod 4)``."""
    squares = {(i * i) % q for i in range(1, q)}
    chi = np.array([0] + [1 if i in squares else -1 for i in range(1, q)])
    s = np.zeros((q + 1, q + 1), dtype=np.int64)
    s[0, 1:], s[1:, 0] = 1, -1
    s[1:, 1:] = chi[(np.arange(q)[None, :] - np.arange(q)[:, None]) % q]
    return s + np.eye(q + 1, dtype=np.int64)


def hadamard(n: int) -> np.ndarray | None:
    """A Hadamard matrix of order ``n = 2^a · 12^b``; ``None`` for other orders."""
    h = np.ones((1, 1), dtype=np.int64)
    h2, h12 = np.array([[1, 1], [1, -1]]), paley_hadamard(11)
    while n > 1:
        if n % 12 == 0:
            h, n = np.kron(h, h12), n // 12
        elif n % 2 == 0:
            h, n = np.kron(h, h2), n // 2
        else:
            return None
    return h


def rotation_matrix(d: int, seed: int = ROTATION_SEED) -> torch.Tensor:
    """An orthogonal ``d×d`` float64 matrix: a Hadamard matrix with random column signs where
    one of order ``d`` is built here, else a random orthogonal one."""
    gen = torch.Generator().manual_seed(seed)
    h = hadamard(d)
    if h is not None:
        signs = torch.randint(0, 2, (d,), generator=gen).to(torch.float64) * 2 - 1
        return torch.from_numpy(h).to(torch.float64) / d ** 0.5 * signs[None, :]
    q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))[None, :]


class Unrotate(nn.Module):
    """``x ↦ norm(x Qᵀ)``: the rotated stream back in the interface's basis, then the final norm."""

    def __init__(self, q: torch.Tensor, norm: nn.Module):
        super().__init__()
        self.register_buffer("Qt", q.T.contiguous())
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x @ self.Qt)


def rotation_of(model: nn.Module) -> torch.Tensor | None:
    """The rotation of a model made by :func:`rotate_residual` (``None``: not rotated)."""
    return getattr(model, ROTATION_ATTR, None)


def _replace(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for name, module in model.named_modules():
        if module is old:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, new)
            return
    raise PitError("the final norm is not a submodule of the model")


def _factorized(embedding: nn.Module) -> bool:
    return isinstance(embedding, PITEmbedding) and hasattr(embedding.interface, "T_inv")


def rotation_blocker(model: PreTrainedModel) -> str | None:
    """Why the residual stream of ``model`` cannot be rotated exactly (``None``: it can)."""
    from ..converters.preserve import PRESERVE_FAMILIES

    model_type = getattr(model.config, "model_type", None)
    if model_type not in PRESERVE_FAMILIES:
        return (f"the rotation is a symmetry of pre-norm RMSNorm families ({', '.join(sorted(PRESERVE_FAMILIES))}), "
                f"not of {model_type!r}")
    if adapter_for(model.config).post_norms:
        return (f"{model_type} normalizes each block's outputs with a gain of its own before they join the residual "
                "stream, so no rotation of the stream is a symmetry of it")
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if _factorized(embedding):
        return None
    if type(embedding) is not nn.Embedding:
        return f"a {type(embedding).__name__} embedding cannot take the rotation"
    if getattr(head, "weight", None) is embedding.weight:
        return "the head shares the embedding's weight (a tied model), which would turn with it"
    return None


@torch.no_grad()
def rotate_residual(prepared: PreTrainedModel, seed: int = ROTATION_SEED) -> PreTrainedModel:
    """A copy of a prepared float32 model whose residual stream is rotated (see the module
    docstring); ``prepared`` is not changed.

    Raises:
        PitError: :func:`rotation_blocker` names a reason.
    """
    from ..converters.preserve import PRESERVE_FAMILIES, fold_and_rotate

    why = rotation_blocker(prepared)
    if why is not None:
        raise PitError(f"rotate_residual: {why}; set rotate_residual = false for this model")
    source = prepared.get_input_embeddings()
    # a factorized table is read, never written, by the rotation (it moves into T⁻¹): shared
    table = {id(source.interface.Zt): source.interface.Zt} if _factorized(source) else {}
    model = copy.deepcopy(prepared, table)
    dtype = next(model.parameters()).dtype
    q = rotation_matrix(model.config.hidden_size, seed)
    fold_and_rotate(model, q, PRESERVE_FAMILIES[model.config.model_type])
    embedding = model.get_input_embeddings()
    if _factorized(embedding):
        t_inv = embedding.interface.T_inv
        t_inv.copy_((t_inv.to(torch.float64) @ q).to(t_inv.dtype))
    else:
        embedding.weight.copy_((embedding.weight.to(torch.float64) @ q).to(embedding.weight.dtype))
    norm = adapter_for(model.config).final_norm(model)
    _replace(model, norm, Unrotate(q.to(dtype), norm))
    object.__setattr__(model, ROTATION_ATTR, q.to(dtype))  # a plain attribute: no constant of the program
    return model

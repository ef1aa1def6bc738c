"""Rewrites that keep a decoder layer inside one XNNPACK partition per side of the attention.

Why: lowered as Hugging Face writes them, each layer of the default model broke into several
XNNPACK partitions with portable operators between them, and the lowering copies the graph for
every partition: side by side, the rewrites cut both (``studies/pte-lowering.md``). The breaks
came from operators the XNNPACK partitioner refuses (its
operator configs in ``executorch/backends/xnnpack/partition/config``):

* **RMSNorm's** ``mean(x², dim=-1, keepdim=True)``: XNNPACK's mean only covers 4-D inputs
  averaged over dims ``[2, 3]``. Written here as ``linear(x², 1/d · 1ᵀ)`` — the same sum of
  squares divided by ``d``, as a fully-connected layer with one output — which XNNPACK runs.
* **RoPE's** ``rotate_half`` (``cat(−x[..., D/2:], x[..., :D/2])``): the slices of an input with
  a dynamic dimension are refused. Written as ``linear(x, P)`` with the signed permutation
  matrix ``P`` (exact in floating point: each output is one input times ±1, the rest zeros).
* **views whose size names the dynamic sequence length** (``view(1, s, 9, 64)``): refused as
  symbolic; the same view with ``-1`` in place of the one symbolic entry is accepted and means
  the same thing (:func:`inferred_view_sizes`, an edge transform pass).

What remains outside the delegates per layer is what has to: the cache update and attention
custom ops (:mod:`.llm_ops`). Measured on the default model: ``studies/pte-lowering.md``.

The module and function swaps are undone when the context manager exits, so the caller's model
is unchanged after export.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

#: family → (modeling module, RMSNorm class) of the families exported with the LLM custom ops
_FAMILY_MODULES = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaRMSNorm"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "MistralRMSNorm"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm"),
    "granite": ("transformers.models.granite.modeling_granite", "GraniteRMSNorm"),
}
ROTATION_BUFFER = "pit_rope_rotation"


class LinearRMSNorm(nn.Module):
    """``weight · x / sqrt(mean(x²) + eps)`` with the mean as a one-output linear layer.

    Shares ``weight`` with the module it replaces (no copy).
    """

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.eps = float(norm.variance_epsilon)
        d = norm.weight.shape[-1]
        self.register_buffer("mean_weight", torch.full((1, d), 1.0 / d, dtype=norm.weight.dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = F.linear(x * x, self.mean_weight)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def rotate_half_matrix(head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``(D, D)`` weight ``W`` with ``linear(x, W) == cat(−x[..., D/2:], x[..., :D/2])``."""
    if head_dim % 2:
        raise ValueError(f"rotate_half needs an even head dimension, got {head_dim}")
    half = head_dim // 2
    idx = torch.arange(half)
    weight = torch.zeros(head_dim, head_dim, dtype=dtype)
    weight[idx, idx + half] = -1.0  # output i < D/2 reads −x[i + D/2]
    weight[idx + half, idx] = 1.0  # output i ≥ D/2 reads x[i − D/2]
    return weight


@contextlib.contextmanager
def xnnpack_friendly(root: nn.Module, model: nn.Module, head_dim: int) -> Iterator[None]:
    """Within the block, ``model``'s RMSNorms are :class:`LinearRMSNorm` and its family's
    ``rotate_half`` is a matmul with a buffer registered on ``root`` (the module being
    exported, so ``torch.export`` lifts it as a constant of the program). Restores both on exit.
    Models of other families pass through unchanged.
    """
    family = getattr(model.config, "model_type", None)
    if family not in _FAMILY_MODULES:
        yield
        return
    module_name, norm_name = _FAMILY_MODULES[family]
    modeling = importlib.import_module(module_name)
    norm_cls = getattr(modeling, norm_name)
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is norm_cls:
                swapped.append((parent, name, child))
                setattr(parent, name, LinearRMSNorm(child))
    dtype = next(model.parameters()).dtype
    root.register_buffer(ROTATION_BUFFER, rotate_half_matrix(head_dim, dtype), persistent=False)
    original = modeling.rotate_half

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != head_dim:
            return original(x)
        return F.linear(x, getattr(root, ROTATION_BUFFER))

    modeling.rotate_half = rotate_half
    try:
        yield
    finally:
        modeling.rotate_half = original
        delattr(root, ROTATION_BUFFER)
        for parent, name, child in swapped:
            setattr(parent, name, child)


@contextlib.contextmanager
def tanh_gelu_spelled_out(model: nn.Module) -> Iterator[None]:
    """Within the block, every tanh-approximated GELU of ``model`` (transformers' ``GELUTanh``:
    Gemma's ``gelu_pytorch_tanh``) computes its formula with elementary operations,
    ``x/2 · (1 + tanh(√(2/π) (x + 0.044715 x³)))``, instead of calling
    ``gelu(x, approximate="tanh")``.

    Why: XNNPACK's partitioner (ExecuTorch 1.5.1) takes every ``aten.gelu`` node without reading
    its ``approximate`` argument and runs XNNPACK's GELU, the exact erf form, so a tanh GELU would
    compute another function on the device (on a tiny Gemma 3, logits rel L2 1.6e-4 against
    PyTorch, past the fp32 bound). Spelled out, the same function lowers to XNNPACK's tanh,
    multiplications and additions. Restores the modules on exit."""
    from transformers.activations import GELUTanh

    swapped = [module for module in model.modules() if isinstance(module, GELUTanh)]
    saved = [module.act for module in swapped]
    for module in swapped:
        module.act = module._gelu_tanh_python
    try:
        yield
    finally:
        for module, act in zip(swapped, saved):
            module.act = act


def inferred_view_sizes(graph_module: torch.fx.GraphModule):
    """Edge transform pass: a ``view_copy`` whose output size has exactly one symbolic entry
    gets ``-1`` there and concrete integers elsewhere (the same view, which XNNPACK accepts)."""
    from torch.fx.passes.infra.pass_base import PassResult

    changed = False
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or "view_copy" not in str(node.target):
            continue
        value = node.meta.get("val")
        if value is None:
            continue
        sizes = list(value.shape)
        symbolic = [i for i, s in enumerate(sizes) if not isinstance(s, int)]
        if len(symbolic) != 1:
            continue
        new = [-1 if i == symbolic[0] else int(s) for i, s in enumerate(sizes)]
        if list(node.args[1]) != new:
            node.args = (node.args[0], new, *node.args[2:])
            changed = True
    if changed:
        graph_module.recompile()
    return PassResult(graph_module, changed)

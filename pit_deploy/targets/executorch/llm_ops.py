"""The KV cache update and attention of an exported decoder as ExecuTorch's LLM custom ops.

Why: lowered with the Hugging Face ``StaticCache`` and SDPA, every layer of a ``.pte`` breaks
into many pieces — the cache write (``index_put``), the causal mask (``where``,
``any``, ``logical_not``), the grouped-query ``expand`` and ``view`` copies run on portable
kernels between XNNPACK partitions (measured on a 2-layer Llama: ``studies/pte-lowering.md``,
"Custom ops and rewrites"). Lowering time grows with the number of partitions (``to_backend`` copies the
graph once per partition), and the attention spans every cache slot whatever the position.
ExecuTorch's own Llama export uses two custom ops instead (``extension/llm/custom_ops``,
registered by the ``executorch`` runtime as ``llama::update_cache`` and ``llama::custom_sdpa``):

* ``update_cache(value [B, S, H_kv, D], cache [B, S_max, H_kv, D], start_pos)`` writes the new
  keys/values in place;
* ``custom_sdpa(q [B, S, H, D], k_cache, v_cache, start_pos, None, 0, is_causal=True, scale)``
  attends causally over positions ``0 … start_pos + S − 1`` only, with grouped-query heads
  handled inside the kernel (no ``expand``).

Here they are plugged into the Hugging Face model through its public extension points: a
``StaticCache`` subclass whose ``update`` writes with ``update_cache`` into caches laid out
``[B, S_max, H_kv, D]``, and an attention function registered with
``transformers.AttentionInterface`` (see the transformers docs, "Attention interface"). A
registered name that has no mask function makes ``create_causal_mask`` return ``None``, so no
mask is built at all. The start position travels as a keyword argument of the model call,
which the supported families forward to the attention function.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, StaticCache

ATTN_NAME = "pit_executorch_sdpa"
START_KWARG = "pit_start_pos"
#: families whose attention modules forward extra keyword arguments to the attention function
#: and call it with queries ``[B, H, S, D]`` and the cache's keys/values (checked by the tests)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "granite")


def available() -> bool:
    """Whether the custom ops (and their export-time definitions) can be loaded."""
    try:
        from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  (registers the ops)
    except Exception:  # noqa: BLE001 — any failure to load means: not available
        return False
    return hasattr(torch.ops.llama, "custom_sdpa") and hasattr(torch.ops.llama, "update_cache")


def supports(config: Any) -> bool:
    return getattr(config, "model_type", None) in FAMILIES and available()


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``custom_sdpa`` over the whole cache from ``kwargs[START_KWARG]``; returns ``[B, S, H, D]``
    as Hugging Face's own attention functions do."""
    start = kwargs.get(START_KWARG)
    if start is None:
        raise RuntimeError(f"the {ATTN_NAME} attention needs the start position ({START_KWARG}) in the model call")
    q = query.transpose(1, 2)  # [B, S, H, D]
    out = torch.ops.llama.custom_sdpa(q, key, value, start, None, 0.0, True, scaling)
    return out, None


AttentionInterface.register(ATTN_NAME, _attention)


class CustomOpsCache(StaticCache):
    """A static cache whose per-layer key/value tensors are laid out ``[1, S_max, H_kv, D]`` and
    written by ``llama::update_cache`` at the start position of the current call."""

    def __init__(self, config: Any, max_cache_len: int, heads: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__(config=config, max_cache_len=max_cache_len)
        layers = int(config.num_hidden_layers)
        self.keys = [torch.zeros(1, max_cache_len, heads, head_dim, dtype=dtype) for _ in range(layers)]
        self.values = [torch.zeros(1, max_cache_len, heads, head_dim, dtype=dtype) for _ in range(layers)]
        self.start_pos: Any = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache, v_cache = self.keys[layer_idx], self.values[layer_idx]
        torch.ops.llama.update_cache(key_states.transpose(1, 2), k_cache, self.start_pos)
        torch.ops.llama.update_cache(value_states.transpose(1, 2), v_cache, self.start_pos)
        return k_cache, v_cache


"""PyTorch eager driver: a model directory (PIT checkpoint or plain Hugging Face model) run by
``transformers`` with its dynamic KV cache — the reference side of verify and the eager row of
a benchmark, behind the same interface as the device runtimes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .base import Driver


class TorchDriver(Driver):
    """``model(input_ids, past_key_values=...)`` in float32 on the CPU."""

    runtime = "torch"

    def __init__(self, folder: str | Path | None = None, threads: int | None = None, model=None) -> None:
        super().__init__(folder or ".", threads)
        # torch's pool is the process's: the caller's size comes back on close
        self._caller_threads = torch.get_num_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        if model is None:
            from ..io.sources import load_source

            model = load_source(str(folder), with_tokenizer=False).model
        self.model = model.eval()
        self.past = None
        self.length = 0

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids[None], use_cache=True)
        self.past, self.length = out.past_key_values, len(ids)
        return out.logits[0]

    @torch.no_grad()
    def step(self, token: int, pos: int) -> torch.Tensor:
        if pos != self.length:
            raise ValueError(f"step at position {pos}, but {self.length} tokens are cached")
        out = self.model(input_ids=torch.tensor([[token]]), past_key_values=self.past, use_cache=True)
        self.past, self.length = out.past_key_values, pos + 1
        return out.logits[0, -1]

    @torch.no_grad()
    def interface(self, vocab: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        from ..model.inspect import effective_interface

        e, w, _ = effective_interface(self.model)
        return e, w

    def close(self) -> None:
        self.model = None
        self.past = None
        torch.set_num_threads(self._caller_threads)

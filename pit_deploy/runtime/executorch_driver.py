"""ExecuTorch driver: ``executorch.runtime`` loads ``model.pte`` and runs its ``forward``,
``embed`` and ``head`` methods (XNNPACK delegate and portable kernels).

The program follows the ExecuTorch LLM runner's conventions (``docs/export.md``):
``forward(tokens [1, S], input_pos [1]) -> logits [1, S, V]`` over a static KV cache kept in
the program's mutable buffers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .base import Driver

PTE_NAME = "model.pte"


def set_threads(threads: int | None) -> None:
    """Resize ExecuTorch's shared CPU threadpool (used by XNNPACK) to ``threads``."""
    if threads is None:
        return
    from executorch.extension.pybindings import portable_lib

    portable_lib._unsafe_reset_threadpool(int(threads))


class ExecuTorchDriver(Driver):
    """``forward`` for prefill/decode, ``embed``/``head`` for the effective interface."""

    runtime = "executorch"

    def __init__(self, folder: str | Path, threads: int | None = None) -> None:
        super().__init__(folder, threads)
        from executorch.runtime import Runtime

        set_threads(threads)
        self.program = Runtime.get().load_program(str(self.folder / PTE_NAME))
        self.forward = self.program.load_method("forward")

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        # clone: outputs may live in the method's planned memory, reused by the next call
        return self.forward.execute([ids[None].contiguous(), torch.tensor([0], dtype=torch.long)])[0][0].clone()

    def step(self, token: int, pos: int) -> torch.Tensor:
        out = self.forward.execute([torch.tensor([[token]], dtype=torch.long), torch.tensor([pos], dtype=torch.long)])
        return out[0][0, -1].clone()

    def interface(self, vocab: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        emb = self.program.load_method("embed").execute([torch.arange(vocab, dtype=torch.long)])[0]
        head = self.program.load_method("head").execute([torch.eye(dim, dtype=torch.float32)])[0]
        return emb.clone(), head.clone()

    def close(self) -> None:
        self.forward = None
        self.program = None

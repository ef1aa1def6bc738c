"""onnxruntime driver: ``ORTModelForCausalLM`` (optimum) for the decoder with its KV cache, a
plain ``onnxruntime.InferenceSession`` for ``interface.onnx``.

Artifact layout (written by the ONNX exporter, ``docs/export.md``): ``model.onnx`` +
``model.onnx_data`` (optimum's text-generation-with-past decoder), ``interface.onnx``
(``(input_ids, hidden) -> (embeddings, logits)``, reading the decoder's weight bytes).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .base import Driver

DECODER_NAME = "model.onnx"
DECODER_DATA = "model.onnx_data"
INTERFACE_NAME = "interface.onnx"


def session_options(threads: int | None):
    """``SessionOptions`` with ``threads`` intra-op threads (``None``: onnxruntime's default)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads is not None:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    return opts


class OnnxDriver(Driver):
    """The decoder through ``ORTModelForCausalLM``; the interface graph through a session."""

    runtime = "onnx"

    def __init__(self, folder: str | Path, threads: int | None = None) -> None:
        super().__init__(folder, threads)
        from optimum.onnxruntime import ORTModelForCausalLM

        self.model = ORTModelForCausalLM.from_pretrained(
            self.folder, use_cache=True, use_io_binding=False, session_options=session_options(threads)
        )
        self.past = None
        self.length = 0

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long), use_cache=True)
        self.past, self.length = out.past_key_values, len(ids)
        return out.logits[0]

    def step(self, token: int, pos: int) -> torch.Tensor:
        if pos != self.length:
            raise ValueError(f"step at position {pos}, but {self.length} tokens are cached")
        out = self.model(
            input_ids=torch.tensor([[token]]), attention_mask=torch.ones(1, pos + 1, dtype=torch.long),
            past_key_values=self.past, use_cache=True,
        )
        self.past, self.length = out.past_key_values, pos + 1
        return out.logits[0, -1]

    def interface(self, vocab: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        import onnxruntime as ort

        sess = ort.InferenceSession(
            str(self.folder / INTERFACE_NAME), sess_options=session_options(self.threads),
            providers=["CPUExecutionProvider"],
        )
        emb, logits = sess.run(
            None, {"input_ids": np.arange(vocab, dtype=np.int64), "hidden": np.eye(dim, dtype=np.float32)}
        )
        return torch.from_numpy(emb), torch.from_numpy(logits)

    def close(self) -> None:
        self.model = None
        self.past = None

"""onnxruntime driver: :class:`~pit_deploy.runtime.standalone.OrtDecoder` (a plain
``InferenceSession`` over optimum's decoder with its KV cache) and a session for
``interface.onnx``.

The artifact's layout is the ``onnx`` target's (:mod:`pit_deploy.targets.onnx_optimum`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..targets.onnx_optimum import decoder_file, interface_file
from .base import Driver, loading, numpy_step
from .standalone import OrtDecoder, ort_session_options

__all__ = ["OnnxDriver"]


class OnnxDriver(Driver):
    """The decoder through :class:`OrtDecoder`; the interface graph through its own session."""

    runtime = "onnx"

    def __init__(self, folder: str | Path, threads: int | None = None) -> None:
        super().__init__(folder, threads)
        path = self.decoder_path()
        with loading(path, "onnxruntime"):
            self.decoder = OrtDecoder(path, threads)

    def decoder_path(self) -> Path:
        """The folder's decoder graph (a subclass for another ONNX target names its own)."""
        return decoder_file(self.folder)

    def interface_path(self) -> Path:
        """The folder's interface graph."""
        return interface_file(self.folder)

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.decoder.prefill(ids.numpy()))

    def step(self, token: int, pos: int) -> torch.Tensor:
        return numpy_step(self.decoder, token, pos)

    def interface(self, vocab: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        import onnxruntime as ort

        path = self.interface_path()
        with loading(path, "onnxruntime"):
            sess = ort.InferenceSession(
                str(path), sess_options=ort_session_options(self.threads),
                providers=["CPUExecutionProvider"],
            )
        emb, logits = sess.run(
            None, {"input_ids": np.arange(vocab, dtype=np.int64), "hidden": np.eye(dim, dtype=np.float32)}
        )
        return torch.from_numpy(emb), torch.from_numpy(logits)

    def close(self) -> None:
        self.decoder.close()

"""onnxruntime driver shared by the ONNX targets: :class:`~pit_deploy.runtime.standalone.OrtDecoder`
(a plain ``InferenceSession`` over a decoder with its KV cache) and a session for the interface
graph. Each target names its own files (``onnx``: :mod:`pit_deploy.targets.onnx.driver`;
``onnx-genai``: :mod:`pit_deploy.targets.onnx_genai.driver`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .base import Driver, loading, numpy_step
from .standalone import OrtDecoder, ort_session_options

__all__ = ["OrtDriver"]


class OrtDriver(Driver):
    """The decoder through :class:`OrtDecoder`; the interface graph through its own session. A
    subclass names the folder's graphs (:meth:`decoder_path`, :meth:`interface_path`)."""

    def __init__(self, folder: str | Path, threads: int | None = None) -> None:
        super().__init__(folder, threads)
        path = self.decoder_path()
        with loading(path, "onnxruntime"):
            self.decoder = OrtDecoder(path, threads)

    def decoder_path(self) -> Path:
        """The folder's decoder graph."""
        raise NotImplementedError

    def interface_path(self) -> Path:
        """The folder's interface graph."""
        raise NotImplementedError

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

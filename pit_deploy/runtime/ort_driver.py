"""onnxruntime driver shared by the ONNX targets: :class:`~pit_deploy.runtime.standalone.OrtDecoder`
(a plain ``InferenceSession`` over a decoder with its KV cache) and a session for the interface
graph. Each target names its own files (``onnx``: :mod:`pit_deploy.targets.onnx.driver`;
``onnx-genai``: :mod:`pit_deploy.targets.onnx_genai.driver`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..model.quantized_interface import identity_defect_in_groups
from .base import Driver, loading, numpy_step
from .standalone import OrtDecoder, ort_session_options

__all__ = ["OrtDriver", "defect_in_parts", "interface_in_parts"]

#: ids an interface graph embeds per run, and basis rows its head multiplies per run: onnxruntime
#: keeps the memory its largest run needed, which for all 262,144 ids at once was 3 GB
INTERFACE_IDS = 16384
INTERFACE_ROWS = 64


def interface_in_parts(run: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]], vocab: int,
                       dim: int, hidden_dtype: type = np.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``E`` ``(vocab, dim)`` and the head's logits of the ``dim`` basis vectors ``(dim, vocab)``,
    float32, from ``run(ids, hidden) -> (embeddings (n, dim), logits (m, vocab))`` (an interface
    graph's session): :data:`INTERFACE_IDS` ids a run (beside one basis row), then
    :data:`INTERFACE_ROWS` basis rows a run (beside one id), into arrays allocated once."""
    emb = np.empty((vocab, dim), np.float32)
    for start, rows in _embedding_parts(run, vocab, dim, hidden_dtype):
        emb[start:start + len(rows)] = rows
    return torch.from_numpy(emb), torch.from_numpy(_head_logits(run, vocab, dim, hidden_dtype))


def defect_in_parts(run: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]], vocab: int,
                    dim: int, hidden_dtype: type = np.float32) -> float:
    """``delta_ti`` from the same runs as :func:`interface_in_parts` (so the same figure): the head's
    logits a group of basis rows at a time, each group's ``W_out E`` summed over the runs'
    embeddings (:func:`~pit_deploy.model.quantized_interface.identity_defect_in_groups`), so that
    neither ``E`` nor ``W_out`` is ever whole (640 MiB each at 262,144 tokens and d = 640)."""
    return identity_defect_in_groups(
        lambda rows: torch.from_numpy(_head_logits(run, vocab, dim, hidden_dtype, rows)),
        lambda: ((start, torch.from_numpy(e)) for start, e in _embedding_parts(run, vocab, dim, hidden_dtype)),
        dim)


def _embedding_parts(run: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]], vocab: int, dim: int,
                     hidden_dtype: type) -> Iterator[tuple[int, np.ndarray]]:
    """``(first id, embeddings)`` of :data:`INTERFACE_IDS` ids a run (beside one basis row)."""
    basis = np.eye(1, dim, dtype=hidden_dtype)
    for start in range(0, vocab, INTERFACE_IDS):
        yield start, run(np.arange(start, min(vocab, start + INTERFACE_IDS), dtype=np.int64), basis)[0]


def _head_logits(run: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]], vocab: int, dim: int,
                 hidden_dtype: type, rows: slice | None = None) -> np.ndarray:
    """The head's logits of the basis vectors ``rows`` (default all ``dim``) ``(rows, vocab)``,
    float32: :data:`INTERFACE_ROWS` basis rows a run (beside one id)."""
    rows = rows or slice(0, dim)
    logits = np.empty((rows.stop - rows.start, vocab), np.float32)
    basis = np.eye(dim, dtype=hidden_dtype)[rows]
    for start in range(0, len(basis), INTERFACE_ROWS):
        stop = min(len(basis), start + INTERFACE_ROWS)
        logits[start:stop] = run(np.zeros(1, np.int64), basis[start:stop])[1]
    return logits


class OrtDriver(Driver):
    """The decoder through :class:`OrtDecoder`; the interface graph through its own session. A
    subclass names the folder's graphs (:meth:`decoder_path`, :meth:`interface_path`).

    The decoder's session is opened on first use (:attr:`Driver.decoder`)."""

    #: session config entries of every session this driver opens (:meth:`hold_weights_once`)
    session_config: dict[str, str] = {}
    #: whether its sessions keep onnxruntime's CPU memory arena (:meth:`free_buffers_between_runs`)
    arena: bool = True

    def hold_weights_once(self) -> None:
        """No pre-packing: onnxruntime otherwise keeps each float32 ``MatMul`` weight a second
        time in its kernel's layout (measured on a 262k-token model: a session of 1.7 GB instead
        of the external data file's pages). Float32 only: a ``MatMulNBits`` without its packed
        weights would take another kernel than the one deployed."""
        self.session_config = {**self.session_config, "session.disable_prepacking": "1"}

    def free_buffers_between_runs(self) -> None:
        """No CPU memory arena: the outputs are the same, and a run's buffers are freed when it ends."""
        self.arena = False

    def session_options(self) -> Any:
        """The ``SessionOptions`` of every session this driver opens."""
        return ort_session_options(self.threads, self.session_config, self.arena)

    def open_decoder(self) -> OrtDecoder:
        path = self.decoder_path()
        with loading(path, "onnxruntime"):
            return OrtDecoder(path, self.threads, self.session_config, self.arena)

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
        run, hidden_dtype = self.interface_runner(vocab, dim)
        return interface_in_parts(run, vocab, dim, hidden_dtype)

    def interface_defect(self, vocab: int, dim: int) -> float:
        run, hidden_dtype = self.interface_runner(vocab, dim)
        return defect_in_parts(run, vocab, dim, hidden_dtype)

    def interface_runner(self, vocab: int, dim: int) -> tuple[Callable[[np.ndarray, np.ndarray],
                                                                       tuple[np.ndarray, np.ndarray]], type]:
        """``(run(ids, hidden) -> (embeddings, logits), the hidden input's dtype)`` over a session
        of the folder's interface graph (a target whose graph takes other shapes overrides this)."""
        import onnxruntime as ort

        path = self.interface_path()
        with loading(path, "onnxruntime"):
            sess = ort.InferenceSession(
                str(path), sess_options=self.session_options(),
                providers=["CPUExecutionProvider"],
            )

        def run(ids: np.ndarray, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            emb, logits = sess.run(None, {"input_ids": ids, "hidden": hidden})
            return emb, logits

        return run, np.float32

    def close(self) -> None:
        self.close_decoder()

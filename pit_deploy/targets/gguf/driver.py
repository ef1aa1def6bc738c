"""Driver of the ``gguf`` target (:mod:`pit_deploy.targets.gguf`).

Prefill and step run the folder's GGUF file in llama.cpp through
:class:`~pit_deploy.targets.gguf.decoder.LlamaCppDecoder` (the code bench bundles carry), with
the KV-cache type the export recorded.

``interface()`` returns the rows llama.cpp's embedding gathers and its head applied to the basis
vectors, read and fed through its graph's evaluation callback
(:mod:`pit_deploy.targets.gguf.interface`), so ``delta_ti`` is llama.cpp's own, as for the
other runtimes. A tied file has no ``output.weight``; llama.cpp's head is then its table.
``interface_defect()`` sums ``W_out E`` over parts of both, so neither table is held whole.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import PitError
from ...runtime.base import Driver, loading, numpy_step
from . import SPEC_NAME
from .decoder import LlamaCppDecoder, decoder_threads
from .interface import LlamaInterface, runtime_interface

__all__ = ["LlamaCppDriver"]


class LlamaCppDriver(Driver):
    """The GGUF file in llama.cpp for prefill, decode and the interface."""

    runtime = "gguf"

    def __init__(self, folder: str | Path, threads: int | None = None) -> None:
        super().__init__(folder, threads)
        from .. import get_target

        self.path = self.folder / get_target(self.runtime).primary_path(self.folder)
        if not self.path.is_file():
            raise PitError(f"{self.path} is missing (named by {self.folder / SPEC_NAME}); re-export")

    def open_decoder(self) -> LlamaCppDecoder:
        with loading(self.path, "llama.cpp"):
            return LlamaCppDecoder(self.path, self.threads)

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.decoder.prefill(ids.tolist()))

    def prefill_last(self, ids: torch.Tensor) -> torch.Tensor:
        """llama.cpp computes the head for the last position only, as in its own generation."""
        return torch.from_numpy(self.decoder.prefill_last(ids.tolist()))

    def step(self, token: int, pos: int) -> torch.Tensor:
        return numpy_step(self.decoder, token, pos)

    def interface(self, vocab: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        with loading(self.path, "llama.cpp"):
            table, head = runtime_interface(self.path, decoder_threads(self.threads))
        if table.shape != (vocab, dim) or head.shape != (dim, vocab):
            raise PitError(f"{self.path}: token table {table.shape} / head {head.T.shape}, expected {(vocab, dim)}; "
                           "the file does not match its manifest — re-export")
        return torch.from_numpy(table), torch.from_numpy(head)

    def interface_defect(self, vocab: int, dim: int) -> float:
        """``delta_ti`` a group of basis rows at a time against a new pass over the ids
        (:func:`~pit_deploy.model.quantized_interface.identity_defect_in_groups`): at a 262,144-token
        vocabulary the two whole tables were 1.3 GB beside the file llama.cpp maps."""
        from ...model.quantized_interface import identity_defect_in_groups, table_parts

        with loading(self.path, "llama.cpp"), LlamaInterface(self.path, decoder_threads(self.threads)) as interface:
            if (interface.vocab, interface.dim) != (vocab, dim):
                raise PitError(f"{self.path}: token table {(interface.vocab, interface.dim)}, expected {(vocab, dim)}; "
                               "the file does not match its manifest — re-export")
            return identity_defect_in_groups(
                lambda rows: torch.from_numpy(interface.head_rows(rows)),
                lambda: table_parts(lambda part: torch.from_numpy(interface.table_rows(part)), vocab), dim)

    def close(self) -> None:
        self.close_decoder()

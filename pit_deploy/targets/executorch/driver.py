"""ExecuTorch driver: ``executorch.runtime`` loads ``model.pte``; decoding goes through
:class:`~pit_deploy.runtime.standalone.PteDecoder` (``forward``), the effective interface
through the program's ``embed`` and ``head`` methods (XNNPACK delegate and portable kernels).

The program follows the ExecuTorch LLM runner's conventions (``docs/export.md``):
``forward(tokens [1, S], input_pos [1]) -> logits [1, 1, V]`` (the last position's) over a
static KV cache kept in the program's mutable buffers.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from ...model.quantized_interface import identity_defect_in_groups, table_parts
from ...runtime.base import Driver, loading
from ...runtime.standalone import PteDecoder, load_pte_program
from . import INTERFACE_HIDDEN_ROWS, INTERFACE_IDS, PTE_NAME

__all__ = ["ExecuTorchDriver"]


class ExecuTorchDriver(Driver):
    """``forward`` for prefill/decode, ``embed``/``head`` for the effective interface."""

    runtime = "executorch"

    def open_decoder(self) -> PteDecoder:
        with loading(self.folder / PTE_NAME, "the ExecuTorch runtime"):
            return PteDecoder(self.folder / PTE_NAME, self.threads)

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.prefill(ids.tolist())

    def prefill_last(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.prefill_last(ids.tolist())

    def step(self, token: int, pos: int) -> torch.Tensor:
        return self.decoder.step(token, pos)

    def interface(self, vocab: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``E`` (all ``vocab`` ids) and ``W_out``ᵀ (the head on the ``dim`` basis vectors) from
        the program's ``embed`` and ``head`` methods, fed in chunks no larger than the methods
        were exported for (``INTERFACE_IDS``, ``INTERFACE_HIDDEN_ROWS``; programs exported before
        the limit take any)."""
        embed, head = self._interface_methods()
        # each chunk's output goes straight into tables allocated once: a list of chunks joined by
        # torch.cat held every V×d table twice (1.3 GB more at a 262,144-token vocabulary)
        emb = torch.empty(vocab, dim)
        for start, rows in _embedding_parts(embed, vocab, dim):
            emb[start:start + len(rows)] = rows
        return emb, _head_logits(head, vocab, dim)

    def interface_defect(self, vocab: int, dim: int) -> float:
        """``delta_ti`` a group of basis rows at a time against a new pass over the ids
        (:func:`~pit_deploy.model.quantized_interface.identity_defect_in_groups`): neither table whole."""
        embed, head = self._interface_methods()
        return identity_defect_in_groups(lambda rows: _head_logits(head, vocab, dim, rows),
                                         lambda: _embedding_parts(embed, vocab, dim), dim)

    def _interface_methods(self) -> tuple[Any, Any]:
        """The program's ``embed`` and ``head`` methods."""
        if self._decoder is not None:
            program = self._decoder.program
        else:  # the program alone: loading `forward` packs the delegate's weights, which embed/head need not wait for
            with loading(self.folder / PTE_NAME, "the ExecuTorch runtime"):
                program, _ = load_pte_program(self.folder / PTE_NAME, self.threads)
        return program.load_method("embed"), program.load_method("head")

    def close(self) -> None:
        self.close_decoder()


def _embedding_parts(embed: Any, vocab: int, dim: int) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first id, rows)`` of ``embed`` over all ids in the parts of
    :func:`~pit_deploy.model.quantized_interface.table_parts` (so the summed figure is the whole
    table's), each part filled by calls of ``INTERFACE_IDS`` ids."""
    def rows(part: slice) -> torch.Tensor:
        ids = torch.arange(part.start, part.stop, dtype=torch.long)
        out = torch.empty(len(ids), dim)
        for start, chunk in zip(range(0, len(ids), INTERFACE_IDS), ids.split(INTERFACE_IDS)):
            out[start:start + len(chunk)] = embed.execute([chunk])[0]
        return out

    return table_parts(rows, vocab)


def _head_logits(head: Any, vocab: int, dim: int, rows: slice | None = None) -> torch.Tensor:
    """``head`` on the basis vectors ``rows`` (default all ``dim``) ``(rows, vocab)``,
    ``INTERFACE_HIDDEN_ROWS`` rows a call."""
    basis = torch.eye(dim, dtype=torch.float32)[rows or slice(0, dim)]
    out = torch.empty(len(basis), vocab)
    for start, chunk in zip(range(0, len(basis), INTERFACE_HIDDEN_ROWS), basis.split(INTERFACE_HIDDEN_ROWS)):
        out[start:start + len(chunk)] = head.execute([chunk])[0]
    return out

"""The driver interface every runtime implements, and the registry that finds one by name.

A driver loads one artifact folder and exposes what verification and benchmarking need:

* ``prefill(ids)`` — logits ``(S, V)`` of a whole prompt in one call (the KV cache restarts);
* ``step(token, pos)`` — logits ``(V,)`` of one more token at position ``pos``, through the cache;
* ``interface(vocab, dim)`` — the artifact's *own* effective embedding of all ``V`` ids
  ``(V, d)`` and its head applied to the ``d`` basis vectors ``(d, V)``, from which
  ``delta_ti = ‖W_out E − I‖_F`` is computed (``docs/definitions.md``);
* ``threads`` — the intra-op thread count the runtime uses; ``close()`` releases it.

Which driver runs a runtime's artifacts is the target's to say (:mod:`pit_deploy.targets`,
looked up by :func:`pit_deploy.runtime.drivers.driver_class`).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Iterator

from ..errors import PitError


@contextlib.contextmanager
def loading(path: str | Path, runtime: str) -> Iterator[None]:
    """Turn the failure of ``runtime`` to load the file ``path`` (truncated, corrupted, or not
    what the manifest says: its digests can be rewritten to match) into unusable input, exit 2:
    one line naming the file, the runtime's own first line of complaint, and what to do."""
    try:
        yield
    except PitError:
        raise
    except Exception as exc:  # noqa: BLE001 — every runtime has its own exception types
        said = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise PitError(f"{path} cannot be loaded by {runtime}: {said}; the file is damaged or was not written by "
                       "this export — re-export") from None


def numpy_step(decoder: Any, token: int, pos: int) -> Any:
    """``decoder.step(token, pos)`` of a numpy-based standalone decoder as a tensor. A step at a
    position the decoder's cache does not hold (its ``ValueError``) is the caller's mistake: a
    :class:`PitError` with the decoder's message."""
    import torch

    try:
        return torch.from_numpy(decoder.step(token, pos))
    except ValueError as exc:
        raise PitError(str(exc)) from None


class Driver(ABC):
    """One loaded artifact on one runtime (see the module docstring for the contract)."""

    runtime: str = ""

    def __init__(self, folder: str | Path, threads: int | None = None) -> None:
        self.folder = Path(folder)
        if threads is not None and threads < 1:
            raise PitError(f"threads must be at least 1, got {threads}")
        self.threads = threads
        self._decoder: Any = None

    def hold_weights_once(self) -> None:
        """Ask the runtime to keep one copy of the weights, at some cost in speed: what ``verify``
        wants of a float32 artifact, whose weights are most of its memory (1 GB at a 262k-token
        vocabulary) and whose figures do not depend on how a kernel lays its weights out. Called
        before the first use; default: nothing to change."""

    def free_buffers_between_runs(self) -> None:
        """Ask the runtime to give each run's working memory back when the run ends, instead of
        keeping the largest it has needed: what ``verify`` wants, whose prompts and held-out blocks
        vary in length (an arena that grew by 150 MiB over four prompts at a 262k-token
        vocabulary). Called before the first use; default: nothing to change."""

    def open_decoder(self) -> Any:
        """The runtime's decoder of the folder (a driver that runs one overrides this)."""
        raise NotImplementedError(f"{type(self).__name__} opens no decoder")

    @property
    def decoder(self) -> Any:
        """:meth:`open_decoder`'s decoder, opened on first use. Verification measures the
        interface first; a runtime that loads the interface's graph or methods on their own
        (an ONNX interface graph, a ``.pte``'s ``embed``/``head``, llama.cpp's second context)
        then never holds them beside the decoder's weights — at a 262,144-token vocabulary the
        two together were 1.3–1.7 GB of the peak."""
        if self._decoder is None:
            self._decoder = self.open_decoder()
        return self._decoder

    def close_decoder(self) -> None:
        """Release the decoder, if it was opened."""
        if self._decoder is not None:
            self._decoder.close()
            self._decoder = None

    @abstractmethod
    def prefill(self, ids: Any) -> Any:
        """Logits ``(S, V)`` of ``ids`` (a 1-D LongTensor) from an empty cache."""

    def prefill_last(self, ids: Any) -> Any:
        """Logits ``(V,)`` of the last position of ``ids`` from an empty cache: what generation
        needs (a runtime whose program returns only that row overrides this to skip the rest)."""
        return self.prefill(ids)[-1]

    @abstractmethod
    def step(self, token: int, pos: int) -> Any:
        """Logits ``(V,)`` of ``token`` at position ``pos`` (``pos`` = tokens already cached)."""

    @abstractmethod
    def interface(self, vocab: int, dim: int) -> tuple[Any, Any]:
        """``(E (V, d), head logits of I_d (d, V))`` computed by the runtime itself."""

    def interface_defect(self, vocab: int, dim: int) -> float:
        """``delta_ti = ‖W_out E − I‖_F`` of :meth:`interface`'s tables. A runtime that computes
        the embedding a part at a time overrides this to sum ``W_out E`` over the parts
        (:func:`~pit_deploy.model.quantized_interface.identity_defect_by_parts`, the same
        figure) and never hold ``E`` whole: 640 MiB at 262,144 tokens and d = 640."""
        from ..model.quantized_interface import identity_defect

        emb, head = self.interface(vocab, dim)
        return identity_defect(emb, head)

    def close(self) -> None:
        """Release the runtime's resources (default: nothing to do)."""

    def __enter__(self) -> "Driver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def greedy(driver: Driver, prompt: Any, max_new: int, eos: frozenset[int] = frozenset(),
           context: int | None = None) -> list[int]:
    """Greedy continuation of ``prompt`` through ``driver``: one prefill, then one step per
    token, stopping after ``max_new`` tokens, at an id in ``eos``, or at the ``context`` limit.

    Raises:
        PitError: the runtime produced non-finite logits (an argmax of NaN means nothing).
    """
    import torch

    if context is not None:
        max_new = min(max_new, context - len(prompt))
    out: list[int] = []
    if max_new < 1:
        return out
    logits, pos = driver.prefill_last(prompt), len(prompt)
    while True:
        if not torch.isfinite(logits).all():
            raise PitError(f"the {driver.runtime or 'model'} runtime produced non-finite logits while generating")
        out.append(int(logits.argmax()))
        if out[-1] in eos or len(out) == max_new:
            return out
        logits, pos = driver.step(out[-1], pos), pos + 1

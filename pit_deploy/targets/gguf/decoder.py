"""A GGUF file run by llama.cpp through llama-cpp-python: prefill and one-token steps with the
full logits of every position, for verification, benchmarks and bench bundles.

This module imports nothing of ``pit_deploy`` (numpy and ``llama_cpp`` only): ``pit-deploy bench
--bundle`` packs it beside ``pit_bench_runtime.py`` for devices without this package, and the
``gguf`` target's driver (:mod:`pit_deploy.targets.gguf.driver`) decodes through it, so
verification and devices run the same code.

The KV-cache type comes from ``llama_cpp.json`` beside the file (written at export): ``f32`` for
float32 files, whose fp32 parity llama.cpp's default f16 cache does not reach, ``f16`` (llama.cpp's
default) for quantized ones.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

#: the JSON beside the GGUF file (the ``gguf`` target's ``SPEC_NAME``)
SPEC_NAME = "llama_cpp.json"
#: ggml type ids of the KV-cache types an export may record (ggml.h)
KV_TYPES = {"f32": 0, "f16": 1}
#: positions a context holds unless told otherwise: verification prompts, held-out blocks and bench
#: prompts plus their continuations fit
DEFAULT_CONTEXT = 2048
#: tokens llama.cpp evaluates at a time in a prefill. With every position's logits kept, its output
#: and compute buffers hold this many rows of the vocabulary each: at 262,144 ids, 64 rows are
#: 67 MB where llama-cpp-python's 512 were 537 MB, and the logits are bit for bit the same
PREFILL_BATCH = 64


#: llama.cpp's log levels (ggml.h): debug 1, info 2, warning 3, error 4, continuation 5
_WARN, _ERROR, _CONT = 3, 4, 5
_LOG: dict[str, Any] = {"callback": None, "seen": set(), "last": False}


def quiet_llama_log() -> None:
    """Route llama.cpp's log through a filter, once per process: errors as they come, each
    distinct warning once, nothing below. llama-cpp-python's own filter reads the levels of an
    older llama.cpp and lets every warning through, so a context longer than the model's positions
    (llama.cpp rounds a context up to 256) was warned about at every context made."""
    import ctypes
    import sys

    import llama_cpp
    from llama_cpp import Llama  # noqa: F401 — installs llama-cpp-python's logger, which this replaces

    if _LOG["callback"] is not None:
        return

    @llama_cpp.llama_log_callback
    def callback(level: int, text: bytes, _user: Any) -> None:
        message = text.decode("utf-8", errors="replace")
        if level == _CONT:
            show = _LOG["last"]
        elif level == _WARN:
            show = message not in _LOG["seen"]
            _LOG["seen"].add(message)
        else:
            show = level >= _ERROR
        _LOG["last"] = show
        if show:
            print(message, end="", file=sys.stderr, flush=True)

    _LOG["callback"] = callback  # kept alive: llama.cpp holds a pointer to it
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))


def read_spec(path: Path) -> dict[str, Any]:
    """The export's ``llama_cpp.json`` beside ``path`` (``{}`` when there is none: llama.cpp's defaults)."""
    spec = path.parent / SPEC_NAME
    return json.loads(spec.read_text(encoding="utf-8")) if spec.is_file() else {}


def decoder_threads(threads: int | None) -> int:
    """The threads llama.cpp runs on: ``threads``, or half the CPUs (llama.cpp's own default)."""
    return threads or max(1, (os.cpu_count() or 2) // 2)


class LlamaCppDecoder:
    """``llama_cpp.Llama`` with the recorded KV-cache type, evaluated through its context and batch
    (every position's logits of a prefill read once into the caller's array); ``prefill`` and
    ``prefill_last`` restart the cache, ``step`` appends one token."""

    def __init__(self, path: str | Path, threads: int | None = None, context: int | None = None,
                 kv_cache_type: str | None = None) -> None:
        """``kv_cache_type`` overrides the recorded one (``f32``/``f16``; a study compares them)."""
        from llama_cpp import Llama

        quiet_llama_log()
        path = Path(path)
        spec = read_spec(path)
        self.kv_cache_type = kv_cache_type or spec.get("kv_cache_type", "f16")
        kv = KV_TYPES[self.kv_cache_type]
        threads = decoder_threads(threads)
        self.threads = threads
        # logits_all=False: llama-cpp-python's context-long logits array is never used (see
        # _evaluate), so it is made n_batch rows long
        self.llm = Llama(model_path=str(path), n_ctx=context or int(spec.get("context_length", DEFAULT_CONTEXT)),
                         n_batch=PREFILL_BATCH, n_threads=threads, n_threads_batch=threads, logits_all=False,
                         type_k=kv, type_v=kv, flash_attn=False, verbose=False)
        self.vocab = self.llm.n_vocab()

    def prefill(self, ids: Any) -> np.ndarray:
        """Logits ``(S, V)`` of ``ids`` from an empty cache (an array of the caller's own)."""
        tokens = [int(i) for i in ids]
        self.llm.reset()
        out = np.empty((len(tokens), self.vocab), dtype=np.float32)
        self._evaluate(tokens, out)
        return out

    def prefill_last(self, ids: Any) -> np.ndarray:
        """Logits ``(V,)`` of the last of ``ids`` from an empty cache: llama.cpp computes the head
        for that position only, as its own generation does."""
        tokens = [int(i) for i in ids]
        self.llm.reset()
        out = np.empty((1, self.vocab), dtype=np.float32)
        self._evaluate(tokens, out, every_position=False)
        return out[0]

    def step(self, token: int, pos: int) -> np.ndarray:
        """Logits ``(V,)`` of ``token`` at ``pos`` (the tokens already cached)."""
        if pos != self.llm.n_tokens:
            raise ValueError(f"step at position {pos}, but {self.llm.n_tokens} tokens are cached")
        out = np.empty((1, self.vocab), dtype=np.float32)
        self._evaluate([int(token)], out)
        return out[0]

    def _evaluate(self, tokens: list[int], out: np.ndarray, every_position: bool = True) -> None:
        """Evaluate ``tokens`` after the cached ones, ``PREFILL_BATCH`` at a time, and copy each
        position's logits (or the last one's) from llama.cpp's output buffer into ``out``.

        Why not ``Llama.eval``: it copies every position's logits into llama-cpp-python's own
        context-long ``scores`` array, which stays resident, and a caller's array was a second
        copy (268 MB each for 256 positions at 262,144 ids). This is ``eval``'s loop (the same
        batches, positions and cache bookkeeping, so the logits are the same) writing once into
        ``out``."""
        llm = self.llm
        llm._ctx.kv_cache_seq_rm(-1, llm.n_tokens, -1)
        for first in range(0, len(tokens), llm.n_batch):
            batch = tokens[first:first + llm.n_batch]
            n_past, n = llm.n_tokens, len(batch)
            llm._batch.set_batch(batch=batch, n_past=n_past, logits_all=every_position)
            llm._ctx.decode(llm._batch)
            llm.input_ids[n_past:n_past + n] = batch
            llm.n_tokens += n
            if every_position:
                out[first:first + n] = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n, self.vocab))
        if not every_position:
            out[0] = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(self.vocab,))

    def close(self) -> None:
        if getattr(self, "llm", None) is not None:
            self.llm.close()
            self.llm = None

"""The token interface of a GGUF file as llama.cpp itself computes it: the rows its embedding
gathers and its head applied to the basis vectors, for ``delta_ti`` on the runtime.

llama.cpp's API returns logits and final hidden states only. Its graph scheduler, though, takes an
evaluation callback (``cb_eval`` of the context parameters, the hook of llama.cpp's own
``eval-callback`` tool): asked for a node by name, it computes the graph up to that node, hands the
tensor to the callback, and carries on if the callback returns true. Here that reads

* the table: the output of the embedding gather (``embd``; ``inp_embd`` in other llama.cpp
  versions), or of the scaling after it where the architecture scales the rows (Gemma 3's
  ``inp_scaled``), for every id, after which the callback stops the graph (nothing later is needed);
* the head: the final norm's output (``result_norm``), which the callback *overwrites* with rows of
  the identity before the head's matmul reads it; the logits are then the head's rows as
  llama.cpp's kernel computes them (its dequantization, its activation rounding: a basis vector is
  exact on every grid it uses).

Measured on the default model's files (``pit-deploy verify``), both equal the tables gguf-py
dequantizes from the file for the F32 table and the F32/BF16 heads; a tied Q4_0 file's Q8_0 head
differs by llama.cpp's own arithmetic (1.2e-4 at most).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import PitError
from .decoder import quiet_llama_log

#: names the embedding gather's output has had in llama.cpp's graph
GATHER_NAMES = ("embd", "inp_embd")
#: the node after the gather where an architecture's graph scales the rows (Gemma 3: ``× √d``): the
#: effective table, the one ``W_out E = I`` is about, is read there
SCALED_GATHER_NAMES = {"gemma3": ("inp_scaled",)}
#: the final norm's output, the head's input
HEAD_INPUT_NAME = "result_norm"
#: ids (or basis vectors) per decode call. The context's buffers hold this many rows of logits
#: twice (its output and its compute buffer): at 262,144 ids, 64 rows are 134 MB where 256 were
#: 537 MB, in the same time and with the same tables
CHUNK = 64


def _ggml(llama_cpp: Any) -> ctypes.CDLL:
    """ggml's tensor accessors from the library llama-cpp-python ships beside ``libllama``."""
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    candidates = sorted(lib_dir.glob("libggml-base.*")) + sorted(lib_dir.glob("ggml-base.*"))
    if not candidates:
        raise PitError(f"llama-cpp-python ships no ggml-base library in {lib_dir}; reinstall it "
                       "(`bash scripts/setup_llama_cpp.sh`)")
    lib = ctypes.CDLL(str(candidates[0]))
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_nelements.restype = ctypes.c_int64
    lib.ggml_nelements.argtypes = [ctypes.c_void_p]
    for name in ("ggml_backend_tensor_get", "ggml_backend_tensor_set"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    return lib


def _architecture(lc: Any, model: Any) -> str:
    """``general.architecture`` of a loaded model."""
    buf = ctypes.create_string_buffer(64)
    size = lc.llama_model_meta_val_str(model, b"general.architecture", buf, len(buf))
    return buf.value.decode(errors="replace") if size > 0 else ""


class LlamaInterface:
    """One llama.cpp context over the GGUF file ``path`` that reads its interface (module
    docstring) a part at a time: :meth:`table_rows` for the embedding's rows of some ids,
    :meth:`head_rows` for the head's logits of some basis vectors. Use it as a context manager.

    Raises:
        PitError: llama.cpp cannot load the file or make a context, or its graph has no node of
            the names above (a llama.cpp whose graph names changed).
    """

    def __init__(self, path: str | Path, threads: int) -> None:
        import llama_cpp as lc

        quiet_llama_log()
        self.path, self._lc = Path(path), lc
        self._ggml = _ggml(lc)
        lc.llama_backend_init()
        self._model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
        if not self._model:
            raise PitError(f"llama.cpp cannot load {path}; re-export it")
        self._ctx = self._batch = None
        try:
            self.dim = int(lc.llama_model_n_embd(self._model))
            self.vocab = int(lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self._model)))
            self._gather = SCALED_GATHER_NAMES.get(_architecture(lc, self._model), GATHER_NAMES)
            self._state: dict[str, Any] = {"want": self._gather, "rows": None, "inject": None}
            self._callback = lc.ggml_backend_sched_eval_callback(self._observe)  # kept alive with self
            params = lc.llama_context_default_params()
            params.n_ctx = params.n_batch = params.n_ubatch = CHUNK
            params.n_threads = params.n_threads_batch = threads
            params.cb_eval = self._callback
            self._ctx = lc.llama_init_from_model(self._model, params)
            self._batch = lc.llama_batch_init(CHUNK, 0, 1)
            if not self._ctx:
                raise PitError(f"llama.cpp cannot make a context for {path}")
            self._memory = lc.llama_get_memory(self._ctx)
        except BaseException:
            self.close()
            raise

    def _observe(self, tensor: int, ask: bool, _user: Any) -> bool:
        state, ggml = self._state, self._ggml
        name = ggml.ggml_get_name(tensor).decode(errors="replace")
        if ask:
            return name in state["want"]
        if name not in state["want"]:
            return True
        count = int(ggml.ggml_nelements(tensor))
        if state["inject"] is None:  # the gather: read it, and stop the graph there
            rows = np.empty(count, dtype=np.float32)
            ggml.ggml_backend_tensor_get(tensor, rows.ctypes.data, 0, rows.nbytes)
            state["rows"] = rows.reshape(-1, self.dim)
            return False
        vectors = np.ascontiguousarray(state["inject"], dtype=np.float32)
        if vectors.size != count:
            raise RuntimeError(f"{name} holds {count} values, {vectors.size} were to be written")
        ggml.ggml_backend_tensor_set(tensor, vectors.ctypes.data, 0, vectors.nbytes)
        state["rows"] = vectors
        return True

    def _decode(self, ids: list[int], all_logits: bool) -> None:
        lc, state, batch = self._lc, self._state, self._batch
        lc.llama_memory_clear(self._memory, True)
        state["rows"] = None
        batch.n_tokens = len(ids)
        for i, token in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1 if all_logits or i == len(ids) - 1 else 0
        status = lc.llama_decode(self._ctx, batch)
        if state["rows"] is None:
            raise PitError(f"llama.cpp's graph for {self.path} has no node named {' or '.join(state['want'])} "
                           f"(decode status {status}); this llama.cpp is not the one checked here")

    def table_rows(self, ids: slice) -> np.ndarray:
        """The embedding's rows ``(n, d)`` of the ids ``ids`` (a slice of ``0 … V``)."""
        self._state["want"], self._state["inject"] = self._gather, None
        out = np.empty((len(range(self.vocab)[ids]), self.dim), dtype=np.float32)
        first = ids.start or 0
        for start in range(0, len(out), CHUNK):
            count = min(len(out), start + CHUNK) - start
            self._decode(list(range(first + start, first + start + count)), all_logits=False)
            out[start:start + count] = self._state["rows"][:count]
        return out

    def head_rows(self, rows: slice) -> np.ndarray:
        """The head's logits ``(n, V)`` of the basis vectors ``rows`` (a slice of ``0 … d``)."""
        lc = self._lc
        basis = np.eye(self.dim, dtype=np.float32)[rows]
        out = np.empty((len(basis), self.vocab), dtype=np.float32)
        self._state["want"] = (HEAD_INPUT_NAME,)
        for start in range(0, len(basis), CHUNK):
            self._state["inject"] = basis[start:start + CHUNK]
            count = len(self._state["inject"])
            self._decode([0] * count, all_logits=True)
            out[start:start + count] = np.ctypeslib.as_array(lc.llama_get_logits(self._ctx),
                                                            shape=(count * self.vocab,)).reshape(count, self.vocab)
        return out

    def close(self) -> None:
        lc = self._lc
        if self._batch is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            lc.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            lc.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> "LlamaInterface":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def runtime_interface(path: str | Path, threads: int) -> tuple[np.ndarray, np.ndarray]:
    """``(table (V, d), head (d, V))`` of the GGUF file ``path`` as llama.cpp computes them
    (module docstring); ``logits = h @ head``.

    Raises:
        PitError: as :class:`LlamaInterface`.
    """
    with LlamaInterface(path, threads) as interface:
        table = interface.table_rows(slice(0, interface.vocab))
        return table, interface.head_rows(slice(0, interface.dim))

"""The onnxruntime-genai builder's decoder run with nothing but ``numpy`` and ``onnxruntime``.

Imports nothing of ``pit_deploy``: ``pit-deploy bench --bundle`` packs this file, unchanged,
beside the bundle's ``pit_bench_runtime.py`` (the ``onnx-genai`` target names it as its
standalone decoder), and the package's own driver
(:class:`pit_deploy.runtime.genai_driver.GenaiDriver`) decodes through it too — one
implementation for verification, benchmarks and devices.

Why not ``OrtDecoder`` (optimum's layout): the builder's graph declares the last cache
dimension symbolically (``kv_cache_dim``) and has no ``position_ids`` (its
``GroupQueryAttention`` derives positions from ``attention_mask``), so the cache shape comes from
the folder's ``genai_config.json`` (``num_key_value_heads``, ``head_size``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

#: the genai runtime's config, beside the decoder in the folder
CONFIG_NAME = "genai_config.json"
_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


class GenaiDecoder:
    """``model.onnx`` of an onnxruntime-genai folder in a plain ``InferenceSession``: the inputs
    genai feeds (``input_ids``, ``attention_mask`` of the total length,
    ``past_key_values.N.key/value``), the cache kept as numpy arrays between calls from each
    run's ``present.N.key/value``."""

    def __init__(self, path: str | Path, threads: int | None = None) -> None:
        import onnxruntime as ort

        path = Path(path)
        decoder = json.loads((path.parent / CONFIG_NAME).read_text())["model"]["decoder"]
        opts = ort.SessionOptions()
        if threads is not None:
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.past_names = [n for n in inputs if n.startswith("past_key_values.")]
        shape = (1, int(decoder["num_key_value_heads"]), 0, int(decoder["head_size"]))
        self.empty_past = {n: np.zeros(shape, _NP.get(inputs[n].type, np.float32)) for n in self.past_names}
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.past: dict[str, np.ndarray] = dict(self.empty_past)
        self.length = 0

    def _run(self, ids: np.ndarray, start: int) -> np.ndarray:
        feed = {"input_ids": ids[None].astype(np.int64),
                "attention_mask": np.ones((1, start + len(ids)), dtype=np.int64), **self.past}
        outputs = dict(zip(self.output_names, self.session.run(self.output_names, feed)))
        self.past = {n: outputs[n.replace("past_key_values.", "present.", 1)] for n in self.past_names}
        self.length = start + len(ids)
        return outputs["logits"][0].astype(np.float32)

    def prefill(self, ids: Any) -> np.ndarray:
        """Logits ``(S, V)`` of ``ids`` from an empty cache."""
        self.past = dict(self.empty_past)
        return self._run(np.asarray(ids, dtype=np.int64).reshape(-1), 0)

    def step(self, token: int, pos: int) -> np.ndarray:
        """Logits ``(V,)`` of ``token`` at position ``pos`` (= tokens already cached)."""
        if pos != self.length:
            raise ValueError(f"step at position {pos}, but {self.length} tokens are cached")
        return self._run(np.array([token], dtype=np.int64), pos)[-1]

    def close(self) -> None:
        self.session = None
        self.past = {}

"""The weight-level check of a GGUF artifact: every tensor of the file that is not float32,
dequantized by gguf-py (``gguf.quants.dequantize``), against the tensor the exporter writes from
the reference under the same llama.cpp name (``blk.N.attn_q.weight``, with llama.cpp's row order
of ``q``/``k``: :func:`pit_deploy.targets.gguf.export.gguf_tensors`); the PIT-corrected table is
float32 and is not a quantized tensor. :mod:`pit_deploy.evaluate.weight_check` compares them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...evaluate.weight_check import Pairing, Stored, WeightCheck, artifact_mode, compare

#: bits of the GGUF types, by type name (the others are float or unknown)
GGUF_BITS = {"Q2_K": 2, "Q3_K": 3, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5,
             "Q6_K": 6, "Q8_0": 8, "Q8_1": 8, "Q8_K": 8}
#: relative unit in the last place of the float types a GGUF file may hold
GGUF_FLOAT_ULP = {"F16": 2.0 ** -10, "BF16": 2.0 ** -7}


def gguf_stored(path: Path) -> list[Stored]:
    """Every tensor of the GGUF file at ``path`` that is not float32, dequantized by gguf-py when
    it is compared, a slice of rows at a time (:func:`pit_deploy.io.gguf_files.gguf_tensor_rows`):
    the whole file in float32 is the model's fp32 size, and gguf-py's temporaries for one
    262k-token table were several times the table's. The tensors are found by a scan of the
    file's header (gguf-py's ``GGUFReader`` builds every metadata array, 0.5 GB for a 262k-token
    vocabulary, and maps the whole file).

    Raises:
        GGUFFormatError: a header that cannot be parsed or a type gguf-py does not know (a
            ``ValueError``: the weight check reports the file as not checked, never as a pass).
    """
    from ...io.gguf_files import ggml_type, gguf_tensor_infos, gguf_tensor_rows

    out = []
    for info in gguf_tensor_infos(path):
        kind = ggml_type(path, info).name
        if kind == "F32":
            continue
        cols = int(info.shape[0])  # ggml's ne[0] is the row length
        rows = int(np.prod(info.shape)) // cols

        def load(which: slice | np.ndarray | None = None, info: Any = info) -> np.ndarray:
            return gguf_tensor_rows(path, info, which)

        # a k-quant's sub-block scales are themselves rounded against the 256-value super-block's
        block = 256 if kind.endswith("_K") else 32
        out.append(Stored(info.name, None, GGUF_BITS.get(kind), block, ulp=GGUF_FLOAT_ULP.get(kind, 0.0)
                          if kind not in GGUF_BITS else None, f16_scales=kind in GGUF_BITS,
                          load=load, rows_cols=(rows, cols)))
    return out


def check_gguf_weights(directory: Path, art: Any, reference: Any) -> WeightCheck:
    """A GGUF artifact: every quantized tensor against the tensor the exporter writes from the
    prepared reference under the same name (llama.cpp's, ``blk.N.attn_q.weight``, with its rows
    in llama.cpp's order: :func:`pit_deploy.targets.gguf.export.gguf_tensors`)."""
    from ...converters.materialize import TableRows, materialize_model
    from ...exporters.passes import prepare
    from ...model.inspect import find_interface, unwrap_model
    from .export import EMBED, HEAD, gguf_tensors

    name = (art.details or {}).get("file") if isinstance(art.details, dict) else None
    files = [rel for rel in art.files if rel.endswith(".gguf")]
    rel = next((f for f in files if Path(f).name == name), files[0] if files else None)
    if rel is None:
        return WeightCheck(checked=False, note="the artifact lists no .gguf file")
    mode = artifact_mode(art)
    if mode == "materialized" and find_interface(unwrap_model(reference)) is not None:
        # the body as the exporter writes it; the two tables a slice at a time when compared
        written = gguf_tensors(materialize_model(reference, torch.float32, share_body=True, tables=False))
        written[EMBED], written[HEAD] = TableRows(reference, "table"), TableRows(reference, "head")
    else:
        written = gguf_tensors(prepare(reference, mode))

    def pair(stored: Stored) -> Pairing | str:
        if stored.name not in written:
            return "the exporter writes no tensor of that name from the reference model"
        return Pairing(stored.name, [(stored.name, written[stored.name])], (stored.name,))

    return compare(gguf_stored(directory / rel), pair, art.details)

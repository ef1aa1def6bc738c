"""Export a prepared (materialized or tied) Llama/Qwen3 model as one GGUF file for llama.cpp.

The file is written here with gguf-py's ``GGUFWriter``:

* tensors under llama.cpp's names (``token_embd``, ``blk.N.attn_q`` …, ``output_norm``,
  ``output``), in PyTorch's ``(out, in)`` layout, which the writer stores as ggml's ``(in, out)``;
* for the ``llama`` architecture the rows of ``q_proj``/``k_proj`` are reordered per head: Hugging
  Face rotates the two halves of a head (``rotate_half``), llama.cpp's ``llama`` rotary rotates
  adjacent pairs, so row ``h·D + s·D/2 + j`` moves to ``h·D + 2j + s``. ``qwen3`` is a NeoX-rotary
  architecture in llama.cpp (halves, as Hugging Face), so its rows stay;
* ``output.weight`` untied (a materialized PIT head); a tied baseline omits it, which is how
  llama.cpp ties;
* the tokenizer (:mod:`pit_deploy.targets.gguf.vocab`: byte-level or SentencePiece BPE) and the
  hyper-parameters llama.cpp reads;
* a model materialized without its tables (the pipeline's ``materialize_by_rows``, when ``gguf``
  is the mode's only target): the token table and the head are computed from ``Z`` and ``T``,
  rounded and written 8192 rows at a time (:class:`~pit_deploy.io.gguf_files.TensorByRows`), the
  same bytes as from the whole tables, which a 262k-token model's export then never holds;
* for ``gemma3``: every RMS-norm gain as ``1 + w`` (Hugging Face's Gemma norms multiply by
  ``1 + w``, llama.cpp's by the stored gain), the local layers' window, flags and rotary base.
  The table stays the model's stored one; llama.cpp multiplies its rows by ``√d`` as Gemma does.

Quantized schemes and the token interface (``docs/llama_cpp.md``):

* ``f16``/``q8_0``: every body weight rounded by gguf-py to F16 / its Q8_0 quantizer (the same
  rounding as ggml's reference ``quantize_row_q8_0``).
* ``q4_0``/``q4_k_m``: llama.cpp's own quantizer (``llama_model_quantize`` of llama-cpp-python),
  run on the F32 file; it picks its own types per body tensor.
* an untied head at :data:`HEAD_TYPE` in every quantized file, not llama.cpp's Q6_K/Q8_0 (why: at
  the constant). A tied baseline keeps llama.cpp's own types: its table is its head, and llama.cpp
  0.3.36 decodes a tied BF16 table about 20× slower than an untied BF16 head (2.3 s against 0.11 s
  a token on the default model, measured on a loaded machine), and the source model has no gains
  that would make its Q8_0 head costly (Q8_0 file: mean KL 0.0041).
* the PIT correction: the head is quantized first; the stored token table is then the
  pseudo-inverse of the *dequantized* head, ``E = Ŵ (ŴᵀŴ)⁻¹`` in float64, stored in float32, so
  ``W_out E = I`` holds for what llama.cpp computes up to float32 rounding. Rounding that table
  to the file's type would undo most of it (``delta_ti_corrected_table_rounded``, recorded where
  gguf-py can round the type), which is why it costs ``V·d`` float32s of file. For llama.cpp's
  quantizer this takes two runs: the first gives the head's codes; the second quantizes the file
  whose table is the corrected one (kept F32 by ``token_embedding_type``), and its head's codes
  must be byte-identical to the first run's (checked). ``delta_ti`` of the exported pair is
  recorded with and without the correction; ``--no-pit-correction`` keeps the quantized table.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable, Union

import numpy as np
import torch
from transformers import PreTrainedModel

from ...errors import PitError
from ...io.heap import give_back_freed_memory
from ...io.gguf_files import (TensorByRows, dequantize_by_rows, ggml_type, gguf_tensor_infos, gguf_tensor_rows,
                               quantize_by_rows, same_stored_bytes)
from ...model.quantized_interface import corrected_rows, identity_defect_of_rows, pseudo_inverse_map
from ...schemes import Scheme
from . import ARCHITECTURES, FILE_NAMES, FILE_TYPES, PACKAGE_VERSION, SPEC_NAME
from .decoder import DEFAULT_CONTEXT
from .vocab import general_name, write_tokenizer

#: a weight as the writer takes it: a float32 array, or a table computed a part of rows at a time
Tensor = Union[np.ndarray, TensorByRows]

#: the KV-cache type recorded per file type: float32 files are verified against the fp32 bounds,
#: which llama.cpp's default f16 cache misses on the default model (docs/llama_cpp.md);
#: quantized files use llama.cpp's default, as the apps that run them do
KV_CACHE_TYPES = {"F32": "f32", "F16": "f16", "Q8_0": "f16", "Q4_0": "f16", "Q4_K_M": "f16"}

#: the head's type in every quantized file. llama.cpp's own choice (Q6_K, or Q8_0 where a row is not a
#: multiple of 256) makes its matmul round the head's *input* to 8 bits per block of 32, and the final
#: norm's gains of a ``preserve`` conversion (up to 1.2e5 on the default model) put a few channels far
#: above the rest of their block: Q8_0 head 0.065 mean KL, BF16 head 0.0033 (body Q8_0 both; F32 head
#: 0.0033 at twice BF16's bytes; F16 overflows). docs/llama_cpp.md, "The head in BF16".
HEAD_TYPE = "BF16"

#: llama.cpp's ``llama_ftype`` of the types its quantizer makes here (llama.h)
_LLAMA_FTYPES = {"Q4_0": 2, "Q4_K_M": 15}

#: Hugging Face module path inside a decoder layer → llama.cpp tensor name inside ``blk.N``
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    # Phi-3's fused linears: llama.cpp's phi3 reads q, k, v from one tensor and gate, up from one
    # tensor of twice the feed-forward rows (gate first, as Phi3MLP splits it)
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
}
EMBED, HEAD = "token_embd.weight", "output.weight"
#: Gemma 3's block names its norms differently: ``post_attention_layernorm`` is the norm on the
#: attention's *output* (Llama's is the MLP's input norm), and the MLP has a pre- and a post-norm
_GEMMA3_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                       "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
#: the layer names per architecture where they are not :data:`_LAYER_NAMES`
LAYER_NAMES = {"gemma3": _GEMMA3_LAYER_NAMES}
#: the architectures whose llama.cpp graph multiplies the gathered rows by ``√d`` (Gemma's scale)
SCALED_TABLES = ("gemma3",)
#: the architectures whose Hugging Face RMS norms multiply by ``1 + w`` (``Gemma3RMSNorm``) where
#: llama.cpp multiplies by the stored gain: their norm weights are written as ``1 + w`` (float32,
#: the sum Hugging Face computes too)
UNIT_OFFSET_NORMS = ("gemma3",)
#: the architectures whose llama.cpp rotary rotates adjacent pairs (``LLAMA_ROPE_TYPE_NORM``), so
#: the Hugging Face q/k rows are reordered (:func:`rotary_pairs`); the others rotate halves as HF does
ADJACENT_PAIR_ROTARY = ("llama", "smollm3")
#: llama.cpp's smollm3 leaves the rotary embedding out of every fourth layer, a step it does not
#: read from the file (``n_no_rope_layer_step = 4``)
SMOLLM3_NO_ROPE_STEP = 4


# --------------------------------------------------------------------------------------
# tensors
# --------------------------------------------------------------------------------------


def rotary_pairs(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a q/k projection from Hugging Face's half-split rotary order to llama.cpp's
    adjacent-pair order, per head (module docstring)."""
    rows, cols = weight.shape
    half = rows // heads // 2
    return weight.reshape(heads, 2, half, cols).swapaxes(1, 2).reshape(rows, cols)


def is_tied(model: PreTrainedModel) -> bool:
    """Whether the head reads the embedding's very tensor (the transpose-tied baseline)."""
    head = model.get_output_embeddings()
    return head is not None and head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


@torch.no_grad()
def gguf_tensors(model: PreTrainedModel) -> dict[str, Tensor]:
    """Every weight of ``model`` as float32 under its llama.cpp name; the token table and the head
    of a model materialized without them (:data:`TABLE_ROWS_ATTR`) as :class:`TensorByRows`.

    Raises:
        PitError: a factorized model, a weight llama.cpp's architecture has no place for (a bias,
            a rotary-scaling table), or a family without an architecture here.
    """
    from ...exporters.passes import FACTORS_ATTR, TABLE_ROWS_ATTR

    config = model.config
    if getattr(model, FACTORS_ATTR, None) is not None:
        raise PitError("the gguf runtime cannot hold a factorized PIT model (llama.cpp has no architecture for "
                       "it); export it with --mode materialized")
    arch = ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise PitError(f"the gguf runtime writes {', '.join(ARCHITECTURES)} models, not {config.model_type!r}")
    if arch == "smollm3":
        expected = [int((i + 1) % SMOLLM3_NO_ROPE_STEP != 0) for i in range(config.num_hidden_layers)]
        if list(getattr(config, "no_rope_layers", expected)) != expected:
            raise PitError(f"no_rope_layers {config.no_rope_layers}: llama.cpp's smollm3 leaves the rotary embedding "
                           f"out of every {SMOLLM3_NO_ROPE_STEP}th layer only ({expected}); export it with "
                           "--runtime onnx or onnx-genai")
    if arch == "gemma3":
        check_gemma3(config)
    names = LAYER_NAMES.get(arch, _LAYER_NAMES)
    streamed = getattr(model, TABLE_ROWS_ATTR, None)  # a materialized model without its two tables
    tied = streamed is None and is_tied(model)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    out: dict[str, Tensor] = {}
    unplaced = []
    tables = {} if streamed is None else dict(zip(("model.embed_tokens.weight", "lm_head.weight"), streamed))
    for name, value in model.state_dict().items():
        if name in tables:  # the weight is never written (never resident): its rows are computed as written
            array = TensorByRows(tables[name].__getitem__, *tables[name].shape)
        else:
            array = value.detach().to(torch.float32).cpu().numpy()
        if name == "model.embed_tokens.weight":
            out[EMBED] = array
        elif name == "model.norm.weight":
            out["output_norm.weight"] = array
        elif name == "lm_head.weight":
            if not tied:
                out[HEAD] = array
        elif name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            module, kind = rest.rsplit(".", 1)
            if module not in names or kind != "weight":
                unplaced.append(name)
                continue
            if arch in ADJACENT_PAIR_ROTARY and module == "self_attn.q_proj":
                array = rotary_pairs(array, heads)
            elif arch in ADJACENT_PAIR_ROTARY and module == "self_attn.k_proj":
                array = rotary_pairs(array, kv_heads)
            out[f"blk.{index}.{names[module]}.weight"] = array
        else:
            unplaced.append(name)
    if unplaced:
        raise PitError(f"the {arch} GGUF architecture has no place for {', '.join(unplaced[:4])}"
                       f"{' …' if len(unplaced) > 4 else ''}")
    if arch in UNIT_OFFSET_NORMS:
        out = {name: array + np.float32(1.0) if name.endswith("norm.weight") else array for name, array in out.items()}
    out.update(rotary_tensors(model, arch))
    return out


def check_gemma3(config: Any) -> None:
    """Refuse a ``gemma3_text`` model that llama.cpp's ``gemma3`` graph would compute otherwise.

    llama.cpp scales queries by ``1/√head_dim`` (``1/√(d/heads)`` at 62 layers, the 27B), has no
    attention soft-capping, applies the tanh GELU, and reads one rotary base for the global layers
    and one for the local ones (no rotary scaling written here).

    Raises:
        PitError: a setting of ``config`` outside that.
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    scalar = config.hidden_size // config.num_attention_heads if config.num_hidden_layers == 62 else head_dim
    problems = []
    kinds = list(getattr(config, "layer_types", None) or [])
    if len(kinds) != config.num_hidden_layers or set(kinds) - {"sliding_attention", "full_attention"}:
        problems.append(f"layer_types {kinds} (one 'sliding_attention' or 'full_attention' per layer)")
    if int(getattr(config, "query_pre_attn_scalar", scalar) or scalar) != scalar:
        problems.append(f"query_pre_attn_scalar {config.query_pre_attn_scalar} (llama.cpp scales queries by "
                        f"1/√{scalar} at {config.num_hidden_layers} layers)")
    if getattr(config, "attn_logit_softcapping", None):
        problems.append("attention soft-capping (llama.cpp's gemma3 has none)")
    if getattr(config, "rope_scaling", None):
        problems.append(f"rope_scaling {config.rope_scaling}")
    if getattr(config, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        problems.append(f"hidden_activation {config.hidden_activation!r} (llama.cpp applies the tanh GELU)")
    if problems:
        raise PitError(f"llama.cpp's gemma3 architecture would not compute this model: {'; '.join(problems)}; "
                       "export it with --runtime onnx, onnx-genai or executorch")


def rotary_dims(config: Any) -> int:
    """The dimensions of a head the rotary embedding turns (``partial_rotary_factor`` of it)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(head_dim * float(getattr(config, "partial_rotary_factor", 1.0) or 1.0))


def rotary_tensors(model: PreTrainedModel, arch: str) -> dict[str, np.ndarray]:
    """The frequency-factor tensors llama.cpp reads for a rotary scaling (none for the default).

    * ``llama3`` (Llama 3.1/3.2) on the ``llama`` architecture: ``rope_freqs.weight``, one factor
      per frequency by which llama.cpp divides it (``ggml_rope_ext``'s ``freq_factors``): the
      default frequencies over those of the model's own rotary module.
    * ``longrope`` (Phi-3 long context, Phi-4-mini) on ``phi3``: ``rope_factors_short`` and
      ``rope_factors_long`` from the config; llama.cpp takes the long ones when the context is
      longer than the original one (:func:`write_gguf` writes that length and the attention
      factor).

    Raises:
        PitError: any other rotary scaling, or one on an architecture that does not read it.
    """
    from ...model.rotary import rope_type

    config = model.config
    kind = rope_type(config)
    if kind == "default":
        return {}
    if kind == "llama3" and arch == "llama":
        dims = rotary_dims(config)
        base = float(getattr(config, "rope_theta", 10000.0))
        default = 1.0 / base ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims)
        actual = next(m.inv_freq for m in model.modules() if hasattr(m, "inv_freq")).to(torch.float64)
        return {"rope_freqs.weight": (default / actual).to(torch.float32).numpy()}
    if kind == "longrope" and arch == "phi3":
        scaling = config.rope_scaling
        return {f"rope_factors_{which}.weight": np.asarray(scaling[f"{which}_factor"], dtype=np.float32)
                for which in ("short", "long")}
    raise PitError(f"rope_scaling {config.rope_scaling} is not written to GGUF here (the {arch} architecture takes "
                   "the default rotary" + (", llama3 scaling" if arch == "llama" else "")
                   + (", longrope" if arch == "phi3" else "") + "); export it with --runtime onnx")


# --------------------------------------------------------------------------------------
# the file
# --------------------------------------------------------------------------------------


def longrope_attention_factor(config: Any) -> float:
    """The factor ``longrope`` scales the rotary cos/sin by (transformers'
    ``_compute_longrope_parameters``): the config's ``attention_factor``, else
    ``sqrt(1 + ln(s) / ln(original))`` for ``s = max_position_embeddings / original`` > 1."""
    import math

    given = (config.rope_scaling or {}).get("attention_factor")
    if given is not None:
        return float(given)
    original = float(config.original_max_position_embeddings)
    scale = float(config.max_position_embeddings) / original
    return 1.0 if scale <= 1.0 else math.sqrt(1.0 + math.log(scale) / math.log(original))


def write_gguf(path: Path, model: PreTrainedModel, tokenizer: Any, tensors: dict[str, Tensor],
               quantized: dict[str, tuple[np.ndarray, Any]] | None = None, file_type: int = 0) -> None:
    """Write ``tensors`` (float32 arrays or :class:`TensorByRows`, llama.cpp names) and the
    model's metadata to ``path``; ``quantized`` holds ``name → (codes, ggml type)`` written
    instead of their float32 twin."""
    import gguf

    config = model.config
    arch = ARCHITECTURES[config.model_type]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(general_name(str(getattr(config, "_name_or_path", "") or "pit-model"), tokenizer))
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(config.num_attention_heads))
    writer.add_head_count_kv(int(config.num_key_value_heads))
    writer.add_key_length(int(head_dim))
    writer.add_value_length(int(head_dim))
    writer.add_rope_dimension_count(rotary_dims(config))
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", 10000.0)))
    if "rope_factors_long.weight" in tensors:  # longrope: where llama.cpp switches, and the cos/sin scale
        original = int(config.original_max_position_embeddings)
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(longrope_attention_factor(config))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    if arch == "gemma3":
        _gemma3_metadata(writer, config)
    writer.add_vocab_size(int(config.vocab_size))
    writer.add_file_type(file_type)
    if tokenizer is None:
        raise PitError("a GGUF file needs the tokenizer (llama.cpp reads it from the file); the source has none")
    write_tokenizer(writer, tokenizer, int(config.vocab_size))
    quantized = quantized or {}
    for name, array in tensors.items():
        if name in quantized:
            codes, qtype = quantized[name]
            writer.add_tensor(name, codes, raw_shape=codes.shape, raw_dtype=qtype)
        elif isinstance(array, TensorByRows):  # computed (and rounded) a part at a time as it is written
            writer.add_tensor(name, array, raw_shape=array.shape, raw_dtype=array.kind)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gemma3_metadata(writer: Any, config: Any) -> None:
    """Gemma 3's local layers: the window, which layers are local (one flag per layer, from the
    config's ``layer_types``, so no period is assumed), their rotary base, and the final
    soft-capping where the config sets one."""
    writer.add_sliding_window(int(config.sliding_window))
    kinds = list(getattr(config, "layer_types", None) or [])
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in kinds])
    writer.add_rope_freq_base_swa(float(getattr(config, "rope_local_base_freq", 10000.0)))
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))


def llama_quantize(src: Path, dst: Path, kind: str, table_type: int | None = None,
                   head_type: int | None = None) -> None:
    """Quantize the GGUF file ``src`` to ``kind`` (``Q4_0``/``Q4_K_M``) with llama.cpp's own
    quantizer into ``dst``; ``table_type`` and ``head_type`` (ggml type ids) override the types it
    gives the token table and the head (``output.weight``, or a tied model's table).

    Raises:
        PitError: llama-cpp-python is missing, or the quantizer failed.
    """
    try:
        import llama_cpp
    except ImportError:
        raise PitError(f"{kind} GGUF files are made by llama.cpp's quantizer; install llama-cpp-python with "
                       f"`bash scripts/setup_llama_cpp.sh` (pins {PACKAGE_VERSION})") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = _LLAMA_FTYPES[kind]
    params.nthread = os.cpu_count() or 1
    if table_type is not None:
        params.token_embedding_type = table_type
    if head_type is not None:
        params.output_tensor_type = head_type
    # llama.cpp logs every tensor it quantizes (and its fallbacks for short rows) through
    # llama-cpp-python's logger; the manifest records the types it chose
    chatter = logging.getLogger("llama-cpp-python")
    level = chatter.level
    # its buffers for the largest tensor (the float32 table read, and its output) are ~1 GB at a
    # 262k-token vocabulary: they start from the pages the row-by-row work before it freed
    give_back_freed_memory()
    chatter.setLevel(logging.CRITICAL)  # (its level table is off by one: warnings arrive as errors)
    try:
        status = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    finally:
        chatter.setLevel(level)
    if status != 0 or not dst.is_file():
        raise PitError(f"llama.cpp's quantizer failed on {src.name} ({kind}, status {status})")


# --------------------------------------------------------------------------------------
# the target's exporter
# --------------------------------------------------------------------------------------


def table_scale(config: Any) -> np.float32:
    """What llama.cpp's graph multiplies the gathered rows by: ``√d`` in float32 for the
    architectures in :data:`SCALED_TABLES` (``sqrtf(n_embd)``), else 1."""
    if ARCHITECTURES.get(config.model_type) in SCALED_TABLES:
        return np.sqrt(np.float32(config.hidden_size))
    return np.float32(1.0)


def _rows_of(tensor: Tensor) -> Callable[[slice], np.ndarray]:
    """``rows -> those rows`` of a float32 array or a :class:`TensorByRows`."""
    return tensor.rows_of if isinstance(tensor, TensorByRows) else tensor.__getitem__


def _file_rows(path: Path, name: str) -> Callable[[slice], np.ndarray]:
    """``rows -> those rows of tensor name``, dequantized from the file ``path``."""
    (info,) = [i for i in gguf_tensor_infos(path) if i.name == name]
    return lambda rows: gguf_tensor_rows(path, info, rows)


def _table_figures(head: Callable[[slice], np.ndarray], vocab: int, plain_rows: Callable[[slice], np.ndarray],
                   table_type: str | None, scale: np.float32,
                   corrected: Callable[[slice], np.ndarray] | None = None) -> dict[str, Any]:
    """``delta_ti`` of the dequantized head (``head(rows)``, ``vocab`` rows) with the table
    quantized as the source (``plain_rows(rows)``: a slice of its rows dequantized, times the
    graph's ``scale``), and — where gguf-py can round the table's type — with the corrected table
    (``corrected(rows)``, or computed here) rounded to that type: what storing the correction at
    the file's precision would leave (the reason it is stored in float32). Every table a part of
    rows at a time (every type here rounds each row on its own): neither table nor head is held
    whole."""
    import gguf
    from gguf.quants import dequantize, quantize

    out = {"delta_ti_uncorrected": identity_defect_of_rows(head, plain_rows, vocab, scale)}
    qtype = getattr(gguf.GGMLQuantizationType, table_type or "", None)
    if qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.F16):
        table = corrected or corrected_rows(head, pseudo_inverse_map(head, vocab, scale))

        def rounded(rows: slice) -> np.ndarray:
            return dequantize(quantize(table(rows), qtype), qtype)

        out["delta_ti_corrected_table_rounded"] = identity_defect_of_rows(head, rounded, vocab, scale)
    return out


#: the file types gguf-py writes itself: the body's ggml type and llama.cpp's ``general.file_type``
_GGUF_PY_TYPES = {"Q8_0": "MOSTLY_Q8_0", "F16": "MOSTLY_F16"}


def _gguf_py_file(model: PreTrainedModel, tokenizer: Any, tensors: dict[str, Tensor], path: Path,
                  kind: str, correction: bool, scale: np.float32) -> dict[str, Any]:
    """Q8_0 or F16 by gguf-py: every body weight rounded to ``kind`` (Q8_0: the same rounding as
    ggml's reference ``quantize_row_q8_0``), the head to :data:`HEAD_TYPE`; the table ``kind``,
    or with ``correction`` the float32 pseudo-inverse of the rounded head. A tied model (the
    baseline) is all ``kind``, as llama.cpp makes it. Only the head's codes are held whole: the
    table is rounded or corrected a part of rows at a time as it is written."""
    import gguf

    body_t, head_t = gguf.GGMLQuantizationType[kind], gguf.GGMLQuantizationType[HEAD_TYPE]
    codes = {name: (quantize_by_rows(a, body_t), body_t) for name, a in tensors.items()
             if getattr(a, "ndim", 0) == 2 and name not in (EMBED, HEAD)}
    info: dict[str, Any] = {"head_type": kind, "table_type": kind}
    plain = TensorByRows(_rows_of(tensors[EMBED]), *_shape(tensors[EMBED]), kind=body_t)
    if HEAD not in tensors:  # tied: llama.cpp's own choice (module docstring)
        tensors = {**tensors, EMBED: plain}
    else:
        info["head_type"] = HEAD_TYPE
        vocab, dim = _shape(tensors[HEAD])
        rounded_head = TensorByRows(_rows_of(tensors[HEAD]), vocab, dim, head_t)
        head_codes = np.empty(rounded_head.shape, dtype=np.uint8)
        for rows, part in rounded_head.parts():
            head_codes[rows] = part
        codes[HEAD] = (head_codes, head_t)

        def head(rows: slice) -> np.ndarray:
            return dequantize_by_rows(head_codes[rows], head_t, dim)

        def plain_rows(rows: slice) -> np.ndarray:
            return dequantize_by_rows(quantize_by_rows(plain.rows_of(rows), body_t), body_t, dim)

        table = corrected_rows(head, pseudo_inverse_map(head, vocab, scale)) if correction else None
        info.update(_table_figures(head, vocab, plain_rows, kind, scale, table))
        if table is not None:
            tensors = {**tensors, EMBED: TensorByRows(table, vocab, dim)}
            info["table_type"] = "F32"
            info["delta_ti_corrected"] = identity_defect_of_rows(head, table, vocab, scale)
        else:
            tensors = {**tensors, EMBED: plain}
    write_gguf(path, model, tokenizer, tensors, codes, file_type=gguf.LlamaFileType[_GGUF_PY_TYPES[kind]])
    return info


def _shape(tensor: Tensor) -> tuple[int, int]:
    """``(rows, values a row)`` of a float32 array or a float32 :class:`TensorByRows`."""
    return (tensor.count, tensor.cols) if isinstance(tensor, TensorByRows) else tuple(tensor.shape)


def _llama_quantized(model: PreTrainedModel, tokenizer: Any, tensors: dict[str, Tensor], path: Path,
                     kind: str, correction: bool, scale: np.float32) -> dict[str, Any]:
    """Q4_0/Q4_K_M by llama.cpp's quantizer, an untied head at :data:`HEAD_TYPE`, with the
    two-run correction (module docstring); a tied model (the baseline) as llama.cpp makes it.
    The head and the tables are read from the files a part of rows at a time."""
    import gguf

    head_t = int(gguf.GGMLQuantizationType[HEAD_TYPE]) if HEAD in tensors else None

    def types(file: Path) -> dict[str, str]:
        return {info.name: ggml_type(file, info).name for info in gguf_tensor_infos(file) if info.name in (EMBED, HEAD)}

    with tempfile.TemporaryDirectory(prefix=".pit-gguf-", dir=path.parent) as tmp:
        f32, first = Path(tmp) / "f32.gguf", Path(tmp) / "first.gguf"
        write_gguf(f32, model, tokenizer, tensors)
        llama_quantize(f32, first, kind, head_type=head_t)
        chosen = types(first)
        info: dict[str, Any] = {"head_type": chosen.get(HEAD, chosen.get(EMBED)), "table_type": chosen.get(EMBED)}
        if HEAD not in chosen:  # (tied: llama.cpp's head is its table; nothing to correct)
            first.replace(path)
            return info
        vocab, dim = _shape(tensors[HEAD])
        head = _file_rows(first, HEAD)
        table = corrected_rows(head, pseudo_inverse_map(head, vocab, scale)) if correction else None
        info.update(_table_figures(head, vocab, _file_rows(first, EMBED), chosen.get(EMBED), scale, table))
        if table is None:
            first.replace(path)
            return info
        write_gguf(f32, model, tokenizer, {**tensors, EMBED: TensorByRows(table, vocab, dim)})
        llama_quantize(f32, path, kind, head_type=head_t, table_type=0)  # GGML_TYPE_F32: the table as computed
        if not same_stored_bytes(path, first, HEAD):
            raise PitError(f"llama.cpp's quantizer rounded the head differently in its second {kind} run; the "
                           "corrected table would not match it")
        info["table_type"] = types(path).get(EMBED)
        info["delta_ti_corrected"] = identity_defect_of_rows(_file_rows(path, HEAD), _file_rows(path, EMBED), vocab,
                                                             scale)
    return info


@torch.no_grad()
def export_gguf(model: PreTrainedModel, out_dir: Path, tokenizer: Any, scheme: Scheme) -> dict[str, Any]:
    """Write ``model`` as the GGUF file of ``scheme`` and its :data:`SPEC_NAME` into ``out_dir``;
    returns the manifest details."""
    import gguf

    if scheme.name not in FILE_TYPES:
        raise PitError(f"the gguf runtime writes {', '.join(FILE_TYPES)}, not {scheme.name}")
    kind = FILE_TYPES[scheme.name]
    tensors = gguf_tensors(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / FILE_NAMES[scheme.name]
    details: dict[str, Any] = {"file": path.name, "file_type": kind, "architecture": ARCHITECTURES[model.config.model_type],
                               "kv_cache_type": KV_CACHE_TYPES[kind], "tied": HEAD not in tensors,
                               "context_length": min(int(model.config.max_position_embeddings), DEFAULT_CONTEXT),
                               "gguf_writer": f"gguf {version('gguf')}"}
    if kind == "F32":
        write_gguf(path, model, tokenizer, tensors, file_type=gguf.LlamaFileType.ALL_F32)
    else:
        correction = bool(scheme.pit_correction) and HEAD in tensors
        scale = table_scale(model.config)
        if kind in _GGUF_PY_TYPES:
            quant = _gguf_py_file(model, tokenizer, tensors, path, kind, correction, scale)
            quant["quantizer"] = f"gguf-py {kind}"
        else:
            quant = _llama_quantized(model, tokenizer, tensors, path, kind, correction, scale)
            quant["quantizer"] = f"llama.cpp llama_model_quantize (llama-cpp-python {PACKAGE_VERSION})"
        # corrected: the table is float32, so W_out E = I up to float32 rounding (verify bounds delta_ti)
        quant.update(pit_correction=correction, interface_exact=correction)
        details["quantization"] = quant
    spec = {"file": path.name, "kv_cache_type": details["kv_cache_type"], "context_length": details["context_length"],
            "llama_cpp_python": PACKAGE_VERSION}
    (out_dir / SPEC_NAME).write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")
    return details


def export_artifact(model: PreTrainedModel, out_dir: Path, *, tokenizer: Any = None, recipe: Any = None,
                    scheme: Scheme, opset: int | None = None) -> dict[str, Any]:
    """The ``gguf`` target's exporter (:mod:`pit_deploy.targets.gguf`)."""
    return export_gguf(model, out_dir, tokenizer, scheme)

"""Export a prepared (materialized or factorized) model to an ExecuTorch ``.pte`` for XNNPACK.

The program follows the conventions of ExecuTorch's stock LLM runner
(``extension/llm/runner``: ``TextDecoderRunner`` / ``TextLLMRunner``):

* ``forward(tokens: int64[1, S], input_pos: int64[1]) -> logits: float[1, 1, V]``, the logits
  of the last position (the runner samples from the last row; ExecuTorch's own LLM export does
  the same unless asked for full logits). ``S`` is a dynamic dimension (``1 ≤ S < max_seq_len``)
  so a whole prompt prefills in one call; ``input_pos`` holds the position of ``tokens[0, 0]``
  (the runner passes a one-element ``start_pos`` tensor when ``enable_dynamic_shape`` is true).
  Returning every position's logits would make memory planning size ``forward``'s pool for a
  full prefill's ``[1, S_max, V]`` floats (48 MiB of the default model's 60); the drivers read
  the other positions by stepping through the prompt (:class:`~pit_deploy.runtime.standalone.PteDecoder`).
* The KV cache is static: one ``[1, kv_heads, max_seq_len, head_dim]`` key and value buffer
  per layer, registered as module buffers and mutated in place, so ``torch.export`` records
  them as mutable buffers that live in the program's planned memory.
* Constant methods read by the runner's metadata loader: ``get_max_seq_len`` (required),
  ``get_max_context_len``, ``use_kv_cache``, ``enable_dynamic_shape``, ``get_eos_ids``,
  ``get_bos_id``, ``get_vocab_size``.
* Extra methods ``embed(ids: int64[N ≤ V]) -> float[N, d]`` and ``head(h: float[N ≤ d, d])
  -> float[N, V]`` expose the *effective* token interface, computed by the very same modules
  as ``forward``, so ``verify`` can measure ``delta_ti`` on the runtime itself. The runner
  only calls ``forward`` and the metadata methods.

Lowering: ``torch.export.export(..., strict=True)`` then
``executorch.exir.to_edge_transform_and_lower(..., partitioner=[XnnpackPartitioner()])``
(ExecuTorch docs, "Exporting to ExecuTorch" / "Building and Running ExecuTorch with XNNPACK
Backend"). Before tracing, RMSNorm and RoPE are rewritten so that each layer lowers to one
XNNPACK partition per side of the attention (:mod:`.xnnpack_rewrites`). The cache wrapper is
written here on top of ``transformers.StaticCache`` (its
``early_initialization`` allocates the tensors up front; see ``transformers.cache_utils``).
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Iterator

import torch
from torch import nn
from transformers import PreTrainedModel, StaticCache

from ...errors import PitError
from ...exporters.passes import FACTORS_ATTR, InterfaceProbe
from ...model.families import max_positions
from ...schemes import Scheme, names_linear
from . import DATA_TAG, INTERFACE_HIDDEN_ROWS, INTERFACE_IDS, PTE_NAME
from .head import xnnpack_linear_config
from .idle_passes import skip_idle_passes
from .runner_tokenizer import write_runner_tokenizer
from .token_table import quantize_token_table
from .xnnpack_rewrites import inferred_view_sizes, tanh_gelu_spelled_out, xnnpack_friendly


def _kv_geometry(config) -> tuple[int, int]:
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    if heads is None:
        heads = config.n_head  # GPT-2 naming
    n_attn = getattr(config, "num_attention_heads", None) or config.n_head
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_attn
    return int(heads), int(head_dim)


def check_max_seq_len(config, max_seq_len: int) -> None:
    """Raise :class:`PitError` if a static cache of ``max_seq_len`` cannot fit the model, or
    passes the length where its rotary frequencies change (:mod:`pit_deploy.model.rotary`)."""
    from ...model.rotary import fixed_length, rope_type

    if max_seq_len < 2:
        raise PitError(f"max_seq_len {max_seq_len} is too small; use at least 2 (prompt + 1 token)")
    limit = max_positions(config)
    if limit is not None and max_seq_len > limit:
        raise PitError(
            f"a static KV cache of {max_seq_len} positions exceeds what this model supports "
            f"({limit} positions, config max_position_embeddings/n_positions); pass "
            f"--max-seq-len {limit} or less"
        )
    fixed = fixed_length(config)
    if fixed is not None and max_seq_len > fixed:
        raise PitError(f"a static KV cache of {max_seq_len} positions passes the {fixed} positions up to which this "
                       f"model's {rope_type(config)!r} rotary embedding keeps its frequencies (past them it changes "
                       f"them, which a .pte cannot follow); pass --max-seq-len {fixed} or less")


def full_length_layers(config):
    """``config``, or for a model with sliding-window layers (Gemma 2 and 3) a copy whose layers
    all say full attention, to lay out the static cache with: transformers' sliding-window cache
    layer is a ring of ``window`` slots, which cannot take a prompt longer than the window in one
    call (and the program prefills a whole prompt at once). Every layer then keeps the whole
    context, and the model's own sliding-window mask (built from its unchanged config, with the
    cache's positions) still keeps each local layer to its window: the same attention, exactly,
    for the memory of a full-length cache in those layers."""
    kinds = getattr(config, "layer_types", None) or ()
    if "sliding_attention" not in kinds:
        return config
    twin = copy.deepcopy(config)
    twin.layer_types = ["full_attention"] * len(kinds)
    twin.sliding_window = None
    return twin


class StaticKVDecoder(nn.Module):
    """``forward(tokens [1, S], input_pos [1]) -> logits [1, S, V]`` over a static KV cache
    (``[1, 1, V]``, the last position's, with ``last_logits``).

    With ``llm_ops`` (the default where the family allows it, :mod:`.llm_ops`) the cache update
    and the attention are ExecuTorch's ``llama::update_cache`` / ``llama::custom_sdpa`` over
    caches laid out ``[1, S_max, H_kv, D]``; otherwise Hugging Face's ``StaticCache`` and SDPA.
    """

    def __init__(self, model: PreTrainedModel, max_seq_len: int, llm_ops: bool = False,
                 last_logits: bool = False):
        super().__init__()
        check_max_seq_len(model.config, max_seq_len)
        self.model = model
        self.max_seq_len = int(max_seq_len)
        self.llm_ops = bool(llm_ops)
        self.last_logits = bool(last_logits)
        dtype = next(model.parameters()).dtype
        heads, head_dim = _kv_geometry(model.config)
        if self.llm_ops:
            from .llm_ops import CustomOpsCache

            self.cache = CustomOpsCache(model.config, self.max_seq_len, heads, head_dim, dtype)
            keys, values = self.cache.keys, self.cache.values
        else:
            self.cache = StaticCache(config=full_length_layers(model.config), max_cache_len=self.max_seq_len)
            self.cache.early_initialization(1, heads, head_dim, dtype, torch.device("cpu"))
            keys = [layer.keys for layer in self.cache.layers]
            values = [layer.values for layer in self.cache.layers]
        for i, (k, v) in enumerate(zip(keys, values)):
            # Registered so that torch.export sees them as (mutable) buffers of the program.
            self.register_buffer(f"key_cache_{i}", k, persistent=False)
            self.register_buffer(f"value_cache_{i}", v, persistent=False)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        cache_position = torch.arange(seq, dtype=torch.long) + input_pos
        extra = {}
        if self.llm_ops:
            from .llm_ops import START_KWARG

            start = input_pos[0].item()
            torch._check_is_size(start)
            torch._check(start + seq <= self.max_seq_len)
            self.cache.start_pos = start
            extra[START_KWARG] = start
        out = self.model(
            input_ids=tokens,
            position_ids=cache_position.unsqueeze(0),
            cache_position=cache_position,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1 if self.last_logits else 0,  # 0: every position (transformers' convention)
            **extra,
        )
        return out.logits


class _EmbedMethod(nn.Module):
    def __init__(self, probe: InterfaceProbe):
        super().__init__()
        self.probe = probe

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.probe.embed(input_ids)


class _HeadMethod(nn.Module):
    def __init__(self, probe: InterfaceProbe):
        super().__init__()
        self.probe = probe

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.probe.head_logits(hidden)


def metadata_methods(config, max_seq_len: int) -> dict[str, object]:
    """Constant methods of the stock ExecuTorch LLM runner."""
    eos = getattr(config, "eos_token_id", None)
    eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    meta: dict[str, object] = {
        "get_max_seq_len": int(max_seq_len),
        "get_max_context_len": int(max_seq_len),
        "use_kv_cache": True,
        "enable_dynamic_shape": True,
        "get_vocab_size": int(config.vocab_size),
    }
    if eos_ids:
        meta["get_eos_ids"] = eos_ids
    bos = getattr(config, "bos_token_id", None)
    if isinstance(bos, int):
        meta["get_bos_id"] = bos
    return meta


@torch.no_grad()
def export_pte(model: PreTrainedModel, out_dir: Path, max_seq_len: int, interface_methods: bool = True,
               external_data: bool = False, trim_passes: bool = True) -> dict:
    """Lower ``model`` (already materialized or factorized) to ``out_dir/model.pte``.

    With ``interface_methods=False`` only ``forward`` and the metadata methods are written
    (what a stock export holds; used for the size baseline of a plain tied model).

    ``external_data``: every constant — the XNNPACK delegate's weights and the program's own
    (the gather's table) — goes to ``out_dir/model.ptd`` (ExecuTorch's program-data separation;
    the runtime and the stock runner take it as their data path). One named data file is what
    lets a gather and a linear share a table: ExecuTorch's named data store keeps byte-identical
    blobs once, but only within one file, and a program's own constants reach that store only
    as external data (:func:`pit_deploy.targets.executorch.token_table.shared_rows`).

    Returns:
        a dict with the method names, the metadata values, ``max_seq_len``, the attention used
        and, with ``external_data``, the data file's name.
    """
    from executorch.exir import ExecutorchBackendConfig

    edge, use_llm_ops = lower_to_edge(model, max_seq_len, interface_methods, external_data=external_data,
                                      trim_passes=trim_passes)
    config = ExecutorchBackendConfig(external_constants=(lambda _node: DATA_TAG) if external_data else False)
    lowered = edge.to_executorch(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / PTE_NAME
    with open(path, "wb") as fh:
        lowered.write_to_file(fh)
    data = {}
    if external_data:
        lowered.write_tensor_data_to_file(str(out_dir))
        data = {"data_file": f"{DATA_TAG}.ptd"}
    meta = metadata_methods(model.config, max_seq_len)
    return {"methods": sorted(edge.methods) + sorted(meta), "metadata": meta, "max_seq_len": int(max_seq_len),
            "attention": "llama::custom_sdpa + llama::update_cache" if use_llm_ops else "transformers StaticCache + SDPA",
            **data}


def tag_external_data(graph_module: torch.fx.GraphModule):
    """Edge transform pass: tag every node for the named data file (``DATA_TAG``), so that the
    XNNPACK delegate writes the weights it serializes (quantized weights are serialized from the
    node that dequantizes them, not from the placeholder) there instead of into the ``.pte``."""
    from torch.fx.passes.infra.pass_base import PassResult

    for node in graph_module.graph.nodes:
        if node.op in ("placeholder", "call_function", "get_attr"):
            node.meta.setdefault("custom", {})["delegate_constant_tag"] = DATA_TAG
    return PassResult(graph_module, True)


@torch.no_grad()
def lower_to_edge(model: PreTrainedModel, max_seq_len: int, interface_methods: bool = True,
                  rewrites: bool = True, external_data: bool = False, trim_passes: bool = True):
    """``torch.export`` the methods of ``model`` and lower them for XNNPACK; ``rewrites=False``
    skips :mod:`.xnnpack_rewrites` (for measuring what they change); ``external_data`` tags the
    delegate's weights for the named data file (:func:`export_pte`); ``trim_passes=False`` runs
    every XNNPACK pass on every partition (:mod:`.idle_passes`; the program is the same).

    Returns:
        ``(EdgeProgramManager, whether the LLM custom ops were used)``; the model is unchanged.
    """
    from ...model.rotary import fixed_frequencies
    from . import llm_ops

    model.eval()
    use_llm_ops = llm_ops.supports(model.config)
    saved_attn = model.config._attn_implementation
    if use_llm_ops:
        model.config._attn_implementation = llm_ops.ATTN_NAME
    try:
        with skip_idle_passes() if trim_passes else contextlib.nullcontext(), fixed_frequencies(model, max_seq_len), \
                tanh_gelu_spelled_out(model), contiguous_table(model):
            return _lower(model, max_seq_len, interface_methods, use_llm_ops, rewrites, external_data), use_llm_ops
    finally:
        model.config._attn_implementation = saved_attn


@contextlib.contextmanager
def contiguous_table(model: PreTrainedModel) -> Iterator[None]:
    """While ``model`` is lowered: its factorized ``Zᵀ`` as one contiguous tensor. A factorized
    model reads ``Zᵀ`` as a view of the PIT model's ``Z`` (:func:`pit_deploy.exporters.passes.factorize`),
    and the lowering makes a non-contiguous constant contiguous once per method that reads it:
    ``forward``, ``embed`` and ``head`` each held a ``V×d`` copy (1.3 GB more at a 262,144-token
    vocabulary). The view is put back afterwards."""
    factors = getattr(model, FACTORS_ATTR, None)
    if factors is None or factors.Zt.is_contiguous():
        yield
        return
    view = factors.Zt
    factors.Zt = view.contiguous()
    try:
        yield
    finally:
        factors.Zt = view


def _lower(model: PreTrainedModel, max_seq_len: int, interface_methods: bool, use_llm_ops: bool,
           rewrites: bool, external_data: bool = False):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    decoder = StaticKVDecoder(model, max_seq_len, llm_ops=use_llm_ops, last_logits=True).eval()
    probe = InterfaceProbe(model).eval()
    d = model.config.hidden_size
    prompt_len = min(8, max_seq_len - 1)
    seq = torch.export.Dim("seq", min=1, max=max_seq_len - 1)
    # Upper bounds matter: memory planning sizes the buffers for them and the runtime allocates
    # them at load (an unbounded head of N×V floats would not even load); verify feeds V ids and
    # d basis vectors in chunks of at most INTERFACE_IDS / INTERFACE_HIDDEN_ROWS.
    v = model.config.vocab_size
    ids_dim = torch.export.Dim("ids", min=1, max=max(2, min(v, INTERFACE_IDS)))
    rows = torch.export.Dim("rows", min=1, max=max(2, min(d, INTERFACE_HIDDEN_ROWS)))
    _, head_dim = _kv_geometry(model.config)
    with xnnpack_friendly(decoder, model, head_dim) if rewrites else contextlib.nullcontext():
        forward = torch.export.export(
            decoder,
            (torch.zeros(1, prompt_len, dtype=torch.long), torch.tensor([0], dtype=torch.long)),
            dynamic_shapes=({1: seq}, None),
            strict=True,
        )
    programs = {
        "forward": forward,
        "embed": torch.export.export(
            _EmbedMethod(probe), (torch.arange(4, dtype=torch.long),),
            dynamic_shapes=({0: ids_dim},), strict=True,
        ),
        "head": torch.export.export(
            _HeadMethod(probe), (torch.zeros(4, d),), dynamic_shapes=({0: rows},), strict=True,
        ),
    }
    if not interface_methods:
        programs = {"forward": programs["forward"]}
    meta = metadata_methods(model.config, max_seq_len)
    # _check_ir_validity=False skips the edge-dialect verifier, which re-runs every graph on fake
    # tensors after each pass (most of the samples of a profile window of the default model's
    # lowering); ExecuTorch's own LLM export builder turns it off too. `verify` checks the numbers.
    return to_edge_transform_and_lower(
        programs, partitioner=[XnnpackPartitioner()], constant_methods=meta,
        transform_passes=[*([inferred_view_sizes] if rewrites else []),
                          *([tag_external_data] if external_data else [])] or None,
        compile_config=EdgeCompileConfig(_check_ir_validity=False),
    )


def precheck(config, recipe) -> None:
    """Before any slow work: the static cache must fit the model (the target's precheck)."""
    check_max_seq_len(config, recipe.max_seq_len)


def quantize_linears(model: PreTrainedModel, dtype: str, group_size: int,
                     keep_8bit: tuple[str, ...] = ()) -> tuple[PreTrainedModel, dict]:
    """A copy of ``model`` whose ``nn.Linear`` layers are quantized with torchao's
    ``Int8DynamicActivationIntxWeightConfig`` — int8 dynamic activations with int4 weights in
    groups of ``group_size`` (``8da4w``) or per-channel int8 weights (``8da8w``) — which the
    XNNPACK partitioner lowers to its dynamically quantized fully-connected kernels.

    int4 weights are symmetric (XNNPACK's 4-bit kernels have no zero point: torchao's asymmetric
    int4 lowers without error but computes wrong numbers) with scales from torchao's HQQ
    scale-only search, and the linears named in ``keep_8bit`` (:func:`~pit_deploy.schemes.names_linear`; by default
    ``v_proj`` and ``down_proj``, the tensors llama.cpp's Q4_K_M also keeps at higher precision)
    get 8-bit weights: measured on the default model, each lowers the mean KL, the 8-bit layers
    most (``studies/pte-head-and-table.md``, "What is quantized, and how").

    The head stays fp32: a factorized head reads ``Zᵀ`` through a plain matmul, and a
    materialized or tied ``lm_head`` is left out of the quantization — XNNPACK's quantized
    linears quantize their input to int8 per token, and on the default model's materialized
    head that measured a mean KL far over the bounds at 8 and 4 bits, failing verification
    (``studies/pte-head-and-table.md``). The input embedding is quantized separately
    (:func:`.token_table.quantize_token_table`).
    """
    from torchao.quantization import quantize_

    from ...exporters.calibrated_rounding import copy_for_rounding

    twin = copy_for_rounding(model)  # its linears are replaced and rewritten; the token table is read
    head = twin.get_output_embeddings()

    def linear(module: nn.Module) -> bool:  # a quantized linear: every nn.Linear but the head
        return isinstance(module, nn.Linear) and module is not head

    common = {"library": "torchao Int8DynamicActivationIntxWeightConfig"}
    int8 = xnnpack_linear_config(8, group_size)
    if dtype == "int8":
        quantize_(twin, int8, filter_fn=lambda module, _fqn: linear(module))
        return twin, {"linear": "8da8w (int8 dynamic activations, per-channel int8 weights)", **common}

    def kept(module: nn.Module, fqn: str) -> bool:
        return linear(module) and names_linear(fqn, keep_8bit)

    n_kept = sum(kept(module, fqn) for fqn, module in twin.named_modules())
    quantize_(twin, int8, filter_fn=kept)
    quantize_(twin, xnnpack_linear_config(4, group_size), filter_fn=lambda module, fqn: linear(module) and not kept(module, fqn))
    scales = "HQQ scale-only scales"
    if write_rounded_codes(twin):
        scales = "GPTQ codes and scales written as calibrated"
    return twin, {"linear": f"8da4w (int8 dynamic activations, symmetric int4 weights, group {group_size}, "
                            f"{scales})",
                  "linear_8bit": f"8da8w for {', '.join(keep_8bit) or 'none'} ({n_kept} layers)", **common}


def write_rounded_codes(model: nn.Module) -> int:
    """Put a calibrated model's GPTQ codes and scales (:mod:`pit_deploy.exporters.calibrated_rounding`) into its
    torchao-quantized linears in place of torchao's own rounding; returns how many.

    Raises:
        RuntimeError: a code's grid does not match the linear's torchao layout (an internal
            error: the calibration and the quantization disagree on a layer's bits or group).
    """
    from ...exporters.calibrated_rounding import rounded_weights

    codes = rounded_weights(model)
    for name, rounded in codes.items():
        weight = model.get_submodule(name).weight
        ok = all(hasattr(weight, a) for a in ("qdata", "scale", "zero_point")) and \
            weight.qdata.shape == rounded.codes.shape and weight.scale.shape == rounded.scales.shape
        if not ok:
            raise RuntimeError(f"{name}: the calibrated codes {tuple(rounded.codes.shape)} / scales "
                           f"{tuple(rounded.scales.shape)} do not fit the quantized linear")
        with torch.no_grad():
            weight.qdata.copy_(rounded.codes.to(torch.int8))
            weight.scale.copy_(rounded.scales.to(weight.scale.dtype))
            weight.zero_point.zero_()
    return len(codes)


def export_artifact(model: PreTrainedModel, out_dir: Path, *, tokenizer=None, recipe=None,
                    scheme: Scheme, opset: int | None = None) -> dict:
    """The ``executorch`` target's exporter (:mod:`pit_deploy.targets.executorch`). The
    folder also gets the tokenizer file ExecuTorch's stock LLM runner loads (:mod:`.runner_tokenizer`)."""
    if not scheme.quantized:
        # a factorized program's gather and head read one Zᵀ, which XNNPACK serializes as the very
        # bytes of the program's constant: with every constant in model.ptd the named data store
        # keeps them once, where a lone .pte holds them twice (its constants and the delegate's)
        factorized = getattr(model, FACTORS_ATTR, None) is not None
        written = export_pte(model, out_dir, recipe.max_seq_len, external_data=factorized)
    else:
        from ...exporters.calibrated_rounding import head_moments

        # a GPTQ-calibrated body: a quantized head's table is calibrated on the same text
        moments = head_moments(model) if scheme.pte_quantized_head_bits else None
        quantized, details = quantize_linears(model, scheme.dtype, scheme.group_size, scheme.int4_8bit_layers)
        # the embedding reads an 8-bit table; a factorized head stays a matmul with the fp32 Zᵀ
        # (not an nn.Linear) and the correction keeps W_out E = I exact, unless pte_head_bits
        # asks for a rotated quantized head (:mod:`.token_table`, :mod:`.head`)
        details.update(quantize_token_table(quantized, scheme.group_size, scheme.pit_correction,
                                            table_bits=scheme.table_bits, head_bits=scheme.pte_quantized_head_bits,
                                            shared=scheme.pte_shared_table, head_moments=moments))
        written = {**export_pte(quantized, out_dir, recipe.max_seq_len, external_data=details["shared_table"]),
                   "quantization": details}
    return {**written, **write_runner_tokenizer(tokenizer, out_dir, int(getattr(model.config, "vocab_size", 0) or 0))}

"""Module rewrites that prepare a PIT model for export: *materialize* and *factorize*.

Both passes take a PIT model (see :mod:`pit_deploy.converters`) and return a new model whose
effective token interface is PIT's, written with operators every export runtime has:

* :func:`materialize` — a vanilla untied Hugging Face model with ``E = Z T⁻¹`` and
  ``W_out = T Zᵀ`` computed in float64 and stored as plain weights
  (:func:`pit_deploy.converters.materialize.materialize_model`).
* :func:`factorize` — the same architecture and the same ``PITEmbedding`` / ``PITHead``
  modules, reading a :class:`PITFactors` instead of the trainable interface: ``Z`` **once**
  (stored transposed, ``Zᵀ`` of shape ``d×V``), ``T`` and ``T⁻¹`` as constants computed in
  float64 and cast once. There is no triangular solve in the graph: neither ONNX nor the
  ExecuTorch portable/XNNPACK kernels have one (``docs/export.md``).

Why ``Zᵀ`` and not ``Z``: the head is then a plain ``MatMul(h T, Zᵀ)`` and the embedding a
gather along axis 1 of the same tensor followed by a transpose of the (dynamic) result, so an
exporter's constant folding never has a reason to create a second ``V×d`` constant (a
``Transpose`` of a constant weight is exactly what the ONNX exporter folds).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PreTrainedModel

from ..converters.materialize import materialize_model
from ..errors import PitError
from ..model.families import adapter_for
from ..model.inspect import find_interface, unwrap_model
from ..model.modules import INTERFACE_ATTR, PIT_CONFIG_KEY, PITEmbedding, PITHead
from .recipes import MODES
from .residual_rotation import rotation_of

FACTORS_ATTR = "pit_factors"
#: the attribute of a model materialized without its two tables (:func:`materialize_by_rows`): the
#: ``(table, head)`` :class:`~pit_deploy.converters.materialize.TableRows` that compute their rows
TABLE_ROWS_ATTR = "pit_table_rows"


def _tracing() -> bool:
    """Whether an exporter is tracing this forward (TorchScript, ``torch.export`` or dynamo)."""
    return torch.jit.is_tracing() or torch.compiler.is_exporting() or torch.compiler.is_compiling()


class PITFactors(nn.Module):
    """The constants of a factorized interface, registered once on the model.

    Buffers (all in the export dtype, computed in float64 from ``(Z, L)``):
        ``Zt``: ``(d, V)`` — ``Zᵀ``, the one copy of the token memory.
        ``T``: ``(d, d)`` — ``L Lᵀ``.
        ``T_inv``: ``(d, d)`` — ``T⁻¹`` by a float64 Cholesky solve.
    """

    def __init__(self, zt: torch.Tensor, t: torch.Tensor, t_inv: torch.Tensor):
        super().__init__()
        # Zt as given, a transposed view of Z where the dtype is Z's: the factorized twin then reads
        # the PIT model's table instead of holding a second V×d copy (an exporter writes it out
        # in its own layout; nothing writes into it in place)
        self.register_buffer("Zt", zt)
        self.register_buffer("T", t.contiguous())
        self.register_buffer("T_inv", t_inv.contiguous())

    @classmethod
    @torch.no_grad()
    def from_interface(cls, interface, dtype: torch.dtype = torch.float32) -> "PITFactors":
        _, t = interface.transform_float64()
        t_inv = interface.inverse_transform()
        # Z straight to dtype: the one rounding a float64 detour would make (float64 holds every
        # float32/16 value exactly), without a float64 copy of a V×d table; in Z's own dtype, Z
        # itself (a view)
        return cls(interface.Z.detach().T.to(dtype), t.to(dtype), t_inv.to(dtype))

    @property
    def vocab_size(self) -> int:
        return self.Zt.shape[1]

    @property
    def hidden_size(self) -> int:
        return self.Zt.shape[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``(Zᵀ[:, ids])ᵀ T⁻¹``: a gather of ``Zᵀ`` columns, then one ``d×d`` matmul.

        Traced (ONNX, ``torch.export``), the gather is the column gather of ``Zᵀ`` the exported
        graphs carry. Run eagerly (verify's references), the same columns are read as rows of
        ``(Zᵀ)ᵀ``: where ``Zᵀ`` is a view of ``Z``, a column gather copies the whole table first
        (hundreds of MiB at a 262k vocabulary, every call), a row gather reads N rows.
        """
        ids = input_ids.reshape(-1)
        if _tracing():
            cols = torch.index_select(self.Zt, 1, ids)  # (d, N)
        else:
            cols = torch.index_select(self.Zt.transpose(0, 1), 0, ids).transpose(0, 1)
        rows = cols.transpose(0, 1) @ self.T_inv  # (N, d)
        return rows.reshape(*input_ids.shape, self.hidden_size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(h T) Zᵀ``, reading the same ``Zᵀ`` constant as the embedding."""
        return (hidden @ self.T) @ self.Zt


def _require_pit(model: nn.Module):
    interface = find_interface(model)
    if interface is None:
        raise PitError(
            "export needs a PIT model; this one has plain embeddings — run `pit-deploy convert` "
            "first or pass the source model to `pit-deploy export`, which converts it"
        )
    return interface


def materialize(model: PreTrainedModel, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A vanilla untied copy of a PIT ``model`` (E, W_out from float64), in ``dtype``."""
    _require_pit(model)
    return materialize_model(model, dtype, share_body=True)  # the exporters copy what they write


@torch.no_grad()
def factorize(model: PreTrainedModel, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A copy of PIT ``model`` whose embedding/head are the factorized twins.

    The copy's state dict holds ``pit_factors.Zt`` / ``.T`` / ``.T_inv`` (and the head bias, if
    any) instead of ``Z`` and ``L``. The original model is not modified.

    Where a tensor of the model is already in ``dtype``, the copy reads it rather than holding its
    own (:func:`shared_memo`): ``Zt`` is a view of ``Z``, and the body's weights are the model's
    tensors under the copy's own ``Parameter`` objects. A 270M model at a 262,144-token vocabulary
    is 1 GB of float32; the copy adds the ``d×d`` factors. Nothing writes into a prepared model's
    weights in place: whatever rounds or rotates them works on a copy of its own
    (:func:`pit_deploy.exporters.calibrated_rounding.copy_for_rounding`,
    :func:`pit_deploy.exporters.residual_rotation.rotate_residual`).
    """
    base = unwrap_model(model)
    interface = _require_pit(base)
    factors = PITFactors.from_interface(interface, dtype)
    # the copy shares the interface (it is taken off the copy below) rather than copying its V×d Z
    twin = copy.deepcopy(base, memo={id(interface): interface, **shared_memo(base, dtype)})
    adapter = adapter_for(twin.config)
    old_head = twin.get_output_embeddings()
    bias = getattr(old_head, "bias", None)
    delattr(twin, INTERFACE_ATTR)
    setattr(twin, FACTORS_ATTR, factors)
    twin.set_input_embeddings(PITEmbedding(factors, adapter.module_embedding_multiplier(twin.config)))
    twin.set_output_embeddings(
        PITHead(factors, adapter.logits_multiplier(twin.config), None if bias is None else bias.to(dtype))
    )
    strip_pit_config(twin)
    twin.to(dtype)
    twin.eval()
    return twin


def shared_memo(model: nn.Module, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """A :func:`copy.deepcopy` memo under which a copy of ``model`` reads each of its tensors
    already in ``dtype`` instead of copying it: parameters as new ``nn.Parameter`` objects over
    the same data (a ``.data`` swap or a cast on the copy's parameter leaves the model's alone),
    buffers as they are (a module replaces a buffer, it does not write into it)."""
    memo: dict[int, torch.Tensor] = {}
    for param in model.parameters():
        if param.dtype == dtype:
            memo[id(param)] = nn.Parameter(param.detach(), requires_grad=param.requires_grad)
    for buffer in model.buffers():
        if buffer.dtype == dtype:
            memo[id(buffer)] = buffer
    return memo


class InterfaceProbe(nn.Module):
    """What an exported model's own weights say the *effective* interface is.

    ``embed(ids)`` returns effective rows ``E_eff[ids]`` (the embedding module's output times
    the multiplier the family's forward applies to it); ``head(h)`` returns effective logits ``h W_out_eff``
    (head output times the logits multiplier, head bias excluded, since ``delta_ti`` is about
    the linear map). Both reuse the model's own embedding/head modules, so an exporter sees
    the very same weight tensors as in the decoder.
    """

    def __init__(self, model: PreTrainedModel):
        super().__init__()
        adapter = adapter_for(model.config)
        self.embedding = model.get_input_embeddings()
        self.head = model.get_output_embeddings()
        for module in (self.embedding, self.head):
            if isinstance(module, (PITEmbedding, PITHead)) and isinstance(module.interface, PITFactors):
                self.factors = module.interface  # register for export (shared object)
            elif isinstance(module, PITHead) and isinstance(module.interface, nn.Module):
                self.head_interface = module.interface  # a quantized program's own head constants
        self.emb_mult = float(adapter.module_embedding_multiplier(model.config))
        self.logit_mult = float(adapter.logits_multiplier(model.config))
        # a residual rotation Q (:mod:`.residual_rotation`) is folded into the embedding's output;
        # the interface is the unrotated rows, so the probe turns them back with Qᵀ
        rotation = rotation_of(model)
        self.register_buffer("Qt", None if rotation is None else rotation.T.contiguous())

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.embedding(input_ids)
        if self.Qt is not None:
            out = out @ self.Qt
        return out if self.emb_mult == 1.0 else out * self.emb_mult

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.head, PITHead):
            return self.head.interface.logits(hidden)  # multipliers cancel: the effective head is T Zᵀ
        out = self.head(hidden)  # the module itself: its weight may be a quantized tensor
        if getattr(self.head, "bias", None) is not None:
            out = out - self.head.bias
        return out if self.logit_mult == 1.0 else out * self.logit_mult

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor):
        return self.embed(input_ids), self.head_logits(hidden)


def strip_pit_config(model: PreTrainedModel) -> None:
    """Drop the ``pit`` block from an exported model's config (it describes ``(Z, L)``)."""
    if hasattr(model.config, PIT_CONFIG_KEY):
        delattr(model.config, PIT_CONFIG_KEY)


def keep_tied(model: PreTrainedModel, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A copy of a plain (tied or untied) ``model`` in ``dtype``, unchanged otherwise: the
    transpose-tied baseline that goes through the same exporters as PIT."""
    base = unwrap_model(model)
    if find_interface(base) is not None:
        raise PitError("--keep-tying exports the source model as it is; this one is already a PIT model")
    twin = copy.deepcopy(base).to(dtype)
    twin.eval()
    return twin


def materialize_by_rows(model: PreTrainedModel, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """:func:`materialize` without the two tables: the body as there, the embedding and head
    weights never written (never resident), and :data:`TABLE_ROWS_ATTR` holding the ``(table,
    head)`` :class:`~pit_deploy.converters.materialize.TableRows` whose rows are computed as
    :func:`materialize` computes them. For an exporter that writes the tables a part of rows at a
    time (a target's ``streams_tables``): at a 262,144-token vocabulary and d = 640 the two tables
    are 1.3 GB of float32 that the export then never holds. Nothing may run this model's forward."""
    from ..converters.materialize import TableRows

    _require_pit(model)
    plain = materialize_model(model, dtype, share_body=True, tables=False)
    setattr(plain, TABLE_ROWS_ATTR, (TableRows(model, "table", dtype), TableRows(model, "head", dtype)))
    return plain


@torch.no_grad()
def write_computed_tables(model: PreTrainedModel) -> None:
    """Give a model of :func:`materialize_by_rows` its two tables whole, computed a part of rows
    at a time, for an exporter that finds it cannot take them by rows after all; any other model
    is left as it is."""
    rows = getattr(model, TABLE_ROWS_ATTR, None)
    if rows is None:
        return
    for module, source in ((model.get_input_embeddings(), rows[0]), (model.get_output_embeddings(), rows[1])):
        table = torch.empty(source.shape, dtype=module.weight.dtype)
        for start in range(0, source.shape[0], 8192):
            table[start:start + 8192] = torch.from_numpy(source[start:start + 8192])
        module.weight.data = table
    delattr(model, TABLE_ROWS_ATTR)


def prepare(model: PreTrainedModel, mode: str, dtype: torch.dtype = torch.float32,
            tables_by_rows: bool = False) -> PreTrainedModel:
    """Apply the pass named ``mode`` (one of :data:`MODES`, or ``tied`` for the baseline);
    ``tables_by_rows``: a materialized model's tables as :func:`materialize_by_rows` leaves them."""
    if mode == "tied":
        return keep_tied(model, dtype)
    if mode == "materialized":
        return materialize_by_rows(model, dtype) if tables_by_rows else materialize(model, dtype)
    if mode == "factorized":
        return factorize(model, dtype)
    raise PitError(f"unknown export mode {mode!r}; choose from {', '.join(MODES)}")

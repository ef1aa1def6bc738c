"""Materialization: a PIT model back to a vanilla, untied Hugging Face model.

``E = Z T⁻¹`` and ``W_out = T Zᵀ`` are computed in float64 and stored as plain weights
(``docs/export.md``, "materialized" mode): any standard tool loads the result.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.modeling_utils import no_init_weights

from ..errors import PitError
from ..model.core import head_rows, table_rows
from ..model.families import adapter_for
from ..model.inspect import find_interface, unwrap_model
from ..model.modules import INTERFACE_ATTR, PIT_CONFIG_KEY


@torch.no_grad()
def materialize_model(model: PreTrainedModel, dtype: torch.dtype | None = None,
                      share_body: bool = False, tables: bool = True) -> PreTrainedModel:
    """A new, vanilla untied model with ``E = Z T⁻¹`` and ``W_out = T Zᵀ`` as plain weights.

    Computed in float64 from ``(Z, T)`` by row chunks and cast once to ``dtype`` (default: the model's), with
    the family multipliers undone so that the *effective* interface is exactly PIT's. The
    result has no project modules: plain ``transformers`` saves and loads it.

    The new model takes the two tables as they are computed (no second copy of either) and
    copies the body, unless ``share_body``: then each body tensor already in ``dtype`` is the
    model's own data under the new model's ``Parameter`` — for an exporter, which never writes
    into its input's weights, not for a model that is trained or edited afterwards.

    ``tables=False`` leaves the embedding and head weights unwritten (never resident, their
    values undefined): for a reader of the body that takes the tables from :class:`TableRows`
    a slice at a time (a 262k-token model's two tables are 1.3 GB in float32).
    """
    base = unwrap_model(model)
    interface = find_interface(base)
    if interface is None:
        raise PitError("materialize needs a PIT model; this one has plain embeddings")
    dtype = dtype or interface.Z.dtype
    config = copy.deepcopy(base.config)
    if hasattr(config, PIT_CONFIG_KEY):
        delattr(config, PIT_CONFIG_KEY)
    config.tie_word_embeddings = False
    adapter = adapter_for(config)
    with no_init_weights():
        plain = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    def body(v: torch.Tensor) -> torch.Tensor:  # the model's tensor where shared and already right, else a copy
        if not v.is_floating_point():
            return v if share_body else v.clone()
        return v.to(dtype, copy=not share_body)

    state = {k: body(v) for k, v in base.state_dict().items() if not k.startswith(INTERFACE_ATTR + ".")}
    emb_name = _param_name(plain, plain.get_input_embeddings().weight)
    head_name = _param_name(plain, plain.get_output_embeddings().weight)
    if tables:
        state[emb_name], state[head_name] = interface.materialized_rows(
            dtype, adapter.embedding_multiplier(config), adapter.logits_multiplier(config))
    else:
        state[emb_name] = plain.get_input_embeddings().weight
        state[head_name] = plain.get_output_embeddings().weight
    head_bias = getattr(base.get_output_embeddings(), "bias", None)
    if head_bias is not None:
        state[head_name.rsplit(".", 1)[0] + ".bias"] = head_bias.detach().to(dtype, copy=not share_body)
    # assign: the new model's (never written, so never resident) tensors are replaced, not copied into
    plain.load_state_dict(state, strict=True, assign=True)
    plain.eval()
    return plain


def _param_name(model: nn.Module, param: torch.Tensor) -> str:
    for name, p in model.named_parameters(remove_duplicate=False):
        if p is param:
            return name
    raise LookupError("parameter not found in model")


class TableRows:
    """The materialized embedding (``which="table"``) or head (``"head"``, as ``W_outᵀ``) of a PIT
    ``model`` in ``dtype``, ``(V, d)``, whose rows are computed when indexed, as
    :func:`materialize_model` computes them (float64, the family's multiplier undone, cast once):
    a check that reads a table a slice at a time never holds the whole of it."""

    def __init__(self, model: PreTrainedModel, which: str, dtype: torch.dtype = torch.float32) -> None:
        if which not in ("table", "head"):
            raise ValueError(f"which must be 'table' or 'head', not {which!r}")
        base = unwrap_model(model)
        interface = find_interface(base)
        if interface is None:
            raise PitError("materialized rows need a PIT model; this one has plain embeddings")
        adapter = adapter_for(base.config)
        self._z = interface.Z.detach()
        self._which, self._dtype = which, dtype
        lf, t = interface.transform_float64()
        self._factor = lf if which == "table" else t
        self._divisor = (adapter.embedding_multiplier(base.config) if which == "table"
                         else adapter.logits_multiplier(base.config))
        self.shape = tuple(self._z.shape)

    def __getitem__(self, rows: slice | np.ndarray) -> np.ndarray:
        """Rows ``rows`` (a slice or an index array) as a NumPy array."""
        index = torch.as_tensor(rows) if isinstance(rows, np.ndarray) else rows
        z = self._z[index].to(torch.float64)
        make = table_rows if self._which == "table" else head_rows
        return make(z, self._factor, self._dtype, self._divisor).numpy()

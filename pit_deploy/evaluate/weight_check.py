"""Verification at the weight level: each quantized weight read back from the artifact, in the
runtime's own codes and scales, compared with the reference model's weight on the target's grid.

The KL bounds judge an artifact through its output, and a model whose logits depend little on
its body can hide random codes there (a tiny model's KL stays within a multiple of its expected
error). This check does not depend on the model's sensitivity. This module is what every target
shares: the tensor record (:class:`Stored`), the grid, the reference weights by module path, and
the comparison (:func:`compare`). Reading an artifact's tensors and pairing them with the
reference is each format's own, named by its target's
:attr:`~pit_deploy.targets.base.Target.weight_check` hook:

* ONNX, both ONNX targets (:mod:`pit_deploy.evaluate.onnx_weights`): every ``MatMulNBits``,
  ``GatherBlockQuantized`` and folded web weight, paired by the module path its nodes are named for.
* GGUF (:mod:`pit_deploy.targets.gguf.stored_weights`): every tensor that is not float32, paired
  by its llama.cpp name with what the exporter writes from the reference.
* ``.pte`` (:mod:`pit_deploy.targets.executorch.stored_weights`): every quantized constant of
  every XNNPACK delegate and every quantized gather table, paired by program order and role.

**What it is compared with.** The export directory's ``reference/`` checkpoint, prepared as the
exporter prepared it (:func:`pit_deploy.exporters.passes.prepare`), each stored tensor with the
weight of **its own name**, once. A token table no module holds (a factorized ``Z``) by its
role: the embedding's (read by a gather) or the head's, among the few forms the exporter may
store it in (:func:`table_candidates`). A weight paired with two stored tensors fails the check,
and so does a recorded digest that no tensor paired with its weight holds.

**The grid.** Plain rounding (``rtn``): every dequantized element within one grid step of the
reference weight, the step of a ``b``-bit block being ``2·max|w| / (2^b − 1)`` over the block
of the reference (the widest step any of the runtimes' quantizers uses for that block; llama.cpp's
k-quants: over the 256-value super-block, against which their sub-block scales are rounded; a
float16/bfloat16 tensor: one unit in the last place). A target may accept a tensor off that grid
that is its exporter's own rounding of the reference (``compare``'s ``own_rounding``: a
``.pte``'s torchao HQQ codes). Calibrated rounding (``gptq``) moves codes further on purpose: the
export records a digest of each calibrated tensor's codes and scales under the tensor's name
(``details.weight_codes``: the body's linears by module path; ``details.quantization.weight_codes``:
``token_table``, ``head``), and the artifact's tensor must hold exactly the digest of its own
name (a fused projection: its parts', row range by row range); a tensor holding another weight's
codes is compared on its own weight's grid, and fails.

The first tensor that fails is named, with the reference weight it was paired with; nothing is
sampled but the choice among a token table's forms (a few rows pick it, then every element is
compared).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..io.weight_codes import CODES_FIELD, code_digest
from ..model.families import FUSED_PROJECTIONS, split_part

#: what a dequantized element may exceed one grid step by (float32 rounding of scale × code)
STEP_SLACK = 1e-3
#: rows of an artifact tensor that pick the form of the token table it holds
PROBE_ROWS = 8
#: rows compared on the grid at a time (:func:`off_grid`)
GRID_ROWS = 8192


@dataclass
class Stored:
    """One quantized tensor as the artifact stores it, ``(rows, K)``.

    ``values``: the dequantized tensor, or ``None`` where it is kept as ``qz``/``scales`` and
    dequantized only when compared by value (:meth:`dense`): a tensor that holds its recorded
    calibrated codes is never dequantized, which spares a float32 copy of a 262k-token table.
    ``qz``/``scales``: the integer codes minus their zero points ``(rows, K)`` and the block
    scales ``(rows, K / block)`` where the format has them (for the calibrated-codes digest);
    ``bits``: the grid's bits (``None``: a float type with relative step ``ulp``)."""

    name: str
    values: np.ndarray | None
    bits: int | None
    block: int
    qz: np.ndarray | None = None
    scales: np.ndarray | None = None
    ulp: float | None = None
    #: the block scales are float16 (GGUF): a tiny block's scale is itself rounded, up to half a
    #: float16 unit, which ``2^(b−1)`` codes multiply
    f16_scales: bool = False
    #: where the artifact puts the tensor: the names of the ONNX nodes that read it, a ``.pte``'s
    #: method and delegate (what :func:`compare`'s pairing finds its reference weight by)
    places: tuple[str, ...] = ()
    #: read by a gather (the embedding side of a token table), not by a matmul
    gather: bool = False
    #: a ``.pte`` linear's role in its program
    #: (:func:`pit_deploy.targets.executorch.stored_weights._plan_roles`), ``None`` where none is known
    role: str | None = None
    #: makes the dequantized values of some rows (all where given ``None``) where neither they nor
    #: codes are kept (a GGUF tensor): called when the tensor is compared by value, a slice of
    #: rows at a time, so no whole table in float32 is made at once
    load: Callable[[slice | np.ndarray | None], np.ndarray] | None = None
    #: the tensor's shape where ``values`` and ``qz`` are both ``None``
    rows_cols: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.values is None and (self.qz is None or self.scales is None) and \
                (self.load is None or self.rows_cols is None):
            raise ValueError(f"{self.name}: neither values, nor codes and scales, nor a loader and a shape")

    @property
    def shape(self) -> tuple[int, ...]:
        if self.values is not None:
            return tuple(self.values.shape)
        return tuple(self.qz.shape) if self.qz is not None else tuple(self.rows_cols)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def dense(self, rows: np.ndarray | None = None) -> np.ndarray:
        """The dequantized values (float32), of ``rows`` only where given; computed from the codes
        on each call where the tensor keeps none (so a whole table is not kept beside its codes)."""
        if self.values is not None:
            return self.values if rows is None else self.values[rows]
        if self.qz is None:
            return self.load(rows)
        qz, scales = (self.qz, self.scales) if rows is None else (self.qz[rows], self.scales[rows])
        blocks = scales.shape[1]
        values = qz.reshape(qz.shape[0], blocks, -1).astype(np.float32)
        values *= scales[..., None]  # in place: one float32 array, not two
        return values.reshape(qz.shape[0], -1)


@dataclass
class WeightCheck:
    """The outcome: ``checked`` false with ``note`` saying why (never a pass); else the
    number of tensors compared and the first ``failure`` (``None``: every one on its grid)."""

    checked: bool
    tensors: int = 0
    calibrated: int = 0
    failure: str | None = None
    note: str = ""
    names: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"checked": self.checked, "tensors": self.tensors, "calibrated": self.calibrated,
                "failure": self.failure, "note": self.note}


def from_codes(name: str, qz: np.ndarray, scales: np.ndarray, bits: int, block: int, cols: int) -> Stored:
    """A tensor of ``cols`` columns from its codes minus zero points ``(rows, K)`` and block
    scales: kept as codes (dequantized when compared by value) where ``K`` is ``cols``;
    dequantized and cut to ``cols`` where the format pads its rows to whole blocks."""
    if cols == qz.shape[1]:
        return Stored(name, None, bits, block, qz, scales)
    rows, blocks = scales.shape
    values = qz.reshape(rows, blocks, block).astype(np.float32)
    values *= scales[..., None]  # in place: one float32 table, not two
    return Stored(name, values.reshape(rows, -1)[:, :cols], bits, block)


# --------------------------------------------------------------------------------------
# the grid
# --------------------------------------------------------------------------------------


def grid_step(reference: np.ndarray, stored: Stored) -> np.ndarray:
    """One grid step per element of ``reference`` ``(rows, K)`` (see the module docstring)."""
    ref = np.asarray(reference, dtype=np.float32)
    if stored.bits is None:
        return np.abs(ref) * (stored.ulp or 0.0) + 2.0 ** -24
    rows, cols = ref.shape
    block = stored.block
    pad = (-cols) % block
    padded = np.pad(np.abs(ref), ((0, 0), (0, pad))) if pad else np.abs(ref)
    top = padded.reshape(rows, -1, block).max(axis=2)
    step = 2.0 * top / (2 ** stored.bits - 1)
    if stored.f16_scales:
        ulp16 = np.maximum(2.0 ** -24, 2.0 ** (np.floor(np.log2(np.maximum(2 * step, 1e-30))) - 10))
        step = step + 2 ** (stored.bits - 1) * ulp16 / 2
    return np.repeat(step, block, axis=1)[:, :cols]


def off_grid(stored: Stored, reference: np.ndarray) -> tuple[int, float]:
    """``(elements of ``stored`` beyond one grid step of ``reference``, the worst distance in
    steps)``, :data:`GRID_ROWS` rows at a time (each row's grid is its own; a 262k-token table
    compared whole would take float64 copies of several times its size)."""
    bad, worst = 0, 0.0
    for start in range(0, max(stored.shape[0], 1), GRID_ROWS):
        rows = slice(start, start + GRID_ROWS)
        values, ref = stored.dense(rows), reference[rows]
        step = grid_step(ref, stored)
        diff = np.abs(values.astype(np.float64) - ref.astype(np.float64))
        allowed = step * (1 + STEP_SLACK) + 1e-12
        bad += int((~(diff <= allowed)).sum())  # NaN counts as beyond
        if diff.size:
            worst = max(worst, float(np.nanmax(diff / np.maximum(step, 1e-30))))
        if not np.isfinite(values).all():
            worst = float("inf")
    return bad, worst


# --------------------------------------------------------------------------------------
# the reference, and which of its weights each stored tensor is paired with
# --------------------------------------------------------------------------------------


@dataclass
class Pairing:
    """What one stored tensor is compared with.

    ``label``: the reference weight, for messages; ``candidates``: its array ``(rows, K)`` (one for
    a weight found by name; a token table's few forms where the artifact gives it a role rather
    than a name, :meth:`ReferenceWeights.table`); ``names``: the module paths the tensor stands
    for, in row order (a fused projection stacks several); ``once``: each of ``names`` may be
    paired with one stored tensor only; ``codes``: the recorded calibrated codes it may hold
    (``details.weight_codes``), each a tuple of names whose tensors it stacks row range by row
    range (default: ``names``; a token table also its own ``token_table``)."""

    label: str
    candidates: list[tuple[str, np.ndarray]]
    names: tuple[str, ...] = ()
    once: bool = True
    codes: tuple[tuple[str, ...], ...] = ()
    #: makes ``candidates`` on first use (:meth:`forms`): a token table's forms are full ``V×d``
    #: arrays, not needed when the stored table holds its recorded calibrated codes
    lazy: Callable[[], list[tuple[str, np.ndarray]]] | None = None

    def __post_init__(self) -> None:
        self.codes = self.codes or ((self.names,) if self.names else ())

    def forms(self) -> list[tuple[str, np.ndarray]]:
        """:attr:`candidates`, made by :attr:`lazy` the first time they are asked for."""
        if self.lazy is not None:
            self.candidates, self.lazy = self.lazy(), None
        return self.candidates


def _float_weights(model: Any) -> dict[str, np.ndarray]:
    """Every 2-D floating-point tensor of ``model``'s state, as float32 numpy arrays."""
    import torch

    return {name: value.detach().to(torch.float32).cpu().numpy() for name, value in model.state_dict().items()
            if value.ndim == 2 and value.is_floating_point()}


def table_candidates(prepared: Any, vocab: int, rotated_table: bool) -> list[tuple[str, np.ndarray]]:
    """The forms ``(V, d)`` a token table of the prepared reference may be stored in: every 2-D
    weight with ``vocab`` rows or columns, as rows (``Zᵀ`` of a factorized model gives ``Z``),
    and with ``rotated_table`` (a factorized ONNX graph's table, which the exporter turns by
    ``R``) the same times ``R``."""
    import torch

    from ..exporters.residual_rotation import rotation_matrix
    from ..model.core import rotate_rows

    found = []
    for name, array in _float_weights(prepared).items():
        if vocab not in array.shape:
            continue
        rows = np.ascontiguousarray(array if array.shape[0] == vocab else array.T, dtype=np.float32)
        found.append((name if array.shape[0] == vocab else name + ".T", rows))
        if rotated_table:  # as the exporter turns it: float64 by row chunks (no float64 copy of a 262k table)
            r = rotation_matrix(rows.shape[1]).to(torch.float64)
            found.append((name + " R", rotate_rows(torch.from_numpy(rows), r).numpy()))
    return found


def _aliases(path: str) -> list[str]:
    """``path`` and the module path the onnxruntime-genai builder's ``attn`` stands for (``self_attn``)."""
    parts = path.split(".")
    other = ".".join("self_attn" if p == "attn" else p for p in parts)
    return [path] if other == path else [path, other]


class ReferenceWeights:
    """The weights of a prepared reference model by module path, oriented as the artifacts store
    them (``(out, in)``: a ``Conv1D``'s ``(in, out)`` weight transposed), and its token table's
    forms (``tables``, from :func:`table_candidates` or a target's own, such as
    :func:`pit_deploy.targets.executorch.stored_weights.pte_table_candidates`)."""

    def __init__(self, prepared: Any, vocab: int,
                 tables: list[tuple[str, np.ndarray]] | Callable[[], list[tuple[str, np.ndarray]]]):
        self.state = _float_weights(prepared)
        self.modules = dict(prepared.named_modules())
        self.vocab = vocab
        self._tables = tables
        self.embed_key = self._key_of(prepared.get_input_embeddings())
        self.head_key = self._key_of(prepared.get_output_embeddings())

    def _key_of(self, module: Any) -> str | None:
        for path, candidate in self.modules.items():
            if candidate is module and module is not None and f"{path}.weight" in self.state:
                return f"{path}.weight"
        return None

    def weight(self, path: str) -> np.ndarray | None:
        """The weight of the module at ``path`` as ``(out, in)``, or ``None``."""
        array = self.state.get(f"{path}.weight")
        if array is None:
            return None
        return array.T if type(self.modules.get(path)).__name__ == "Conv1D" else array

    def linear(self, path: str) -> Pairing | None:
        """The weight a node named for ``path`` holds: the module's own; a builder's fused
        projection (``qkv_proj``, ``gate_up_proj``): its parts' weights stacked in order; one part
        of a fused linear the builder splits (Phi-3's ``gate_up_proj`` into ``gate_proj`` and
        ``up_proj``): its share of the fused weight's rows (recorded codes under the part's name,
        :func:`~pit_deploy.model.families.split_part`)."""
        for name in _aliases(path):
            array = self.weight(name)
            if array is not None:  # a materialized token table also holds the table's calibrated codes
                table = f"{name}.weight" in (self.embed_key, self.head_key)
                return Pairing(f"{name}.weight", [(f"{name}.weight", array)], (name,),
                               codes=((name,), ("token_table",)) if table else ())
            parent, _, leaf = name.rpartition(".")
            if leaf in FUSED_PROJECTIONS:
                paths = tuple(f"{parent}.{part}" for part in FUSED_PROJECTIONS[leaf])
                arrays = [self.weight(q) for q in paths]
                if all(a is not None for a in arrays) and len({a.shape[1] for a in arrays}) == 1:
                    label = f"{parent}.{{{','.join(FUSED_PROJECTIONS[leaf])}}}.weight stacked"
                    return Pairing(label, [(label, np.concatenate(arrays))], paths)
            part = split_part(name)
            fused = self.weight(part[0]) if part else None
            if fused is not None:
                rows = fused.shape[0] // part[2]
                label = f"{part[0]}.weight rows {part[1] * rows}:{(part[1] + 1) * rows}"
                return Pairing(label, [(label, fused[part[1] * rows:(part[1] + 1) * rows])], (name,))
        return None

    def table(self, gather: bool, names: tuple[str, ...] = ("token_table",), once: bool = False) -> Pairing:
        """The token table as the embedding (``gather``) or the head reads it: the forms of
        :attr:`tables`, less the other side's weight where the model has two (a materialized
        ``E`` and ``W_out``)."""
        other = self.head_key if gather else self.embed_key
        own = self.embed_key if gather else self.head_key

        def forms() -> list[tuple[str, np.ndarray]]:
            return [(n, a) for n, a in self.tables if other is None or other == own or other not in n]

        return Pairing("the token table's " + ("embedding" if gather else "head"), [], names, once, lazy=forms)

    @property
    def tables(self) -> list[tuple[str, np.ndarray]]:
        """The token table's forms, made on first use where they were given as a function (and
        kept: both sides of a table read them)."""
        if callable(self._tables):
            self._tables = self._tables()
        return self._tables


def _probe_rows(rows: int) -> np.ndarray:
    return np.unique(np.linspace(0, rows - 1, min(rows, PROBE_ROWS)).round().astype(int))


def best_candidate(stored: Stored, candidates: list[tuple[str, np.ndarray]]) -> tuple[str, np.ndarray] | None:
    """The candidate closest to ``stored`` on a few rows, measured in grid steps (the forms of one
    token table: :meth:`ReferenceWeights.table`)."""
    candidates = [(n, a) for n, a in candidates if a.shape == stored.shape]
    if not candidates:
        return None
    rows = _probe_rows(stored.shape[0])
    probe = Stored(stored.name, stored.dense(rows), stored.bits, stored.block, ulp=stored.ulp,
                   f16_scales=stored.f16_scales)
    scores = []
    for name, array in candidates:
        step = grid_step(array[rows], probe)
        diff = np.abs(probe.values.astype(np.float64) - array[rows])
        scores.append(float(np.nanmean(diff / np.maximum(step, 1e-30))))
    return candidates[int(np.nanargmin(scores))] if not all(np.isnan(scores)) else candidates[0]


# --------------------------------------------------------------------------------------
# the check
# --------------------------------------------------------------------------------------


def section(details: Any, key: str) -> dict[str, Any]:
    """``details[key]`` when it is a mapping, else empty (a manifest field a user may have edited)."""
    value = details.get(key) if isinstance(details, dict) else None
    return value if isinstance(value, dict) else {}


def recorded_codes(details: Any) -> dict[str, dict[str, Any]]:
    """The calibrated codes' digests the export recorded, by name: the body's linears by module
    path (``details.weight_codes``), a token table and a ``.pte``'s head by role
    (``details.quantization.weight_codes``: ``token_table``, ``head``)."""
    out: dict[str, dict[str, Any]] = {}
    for entry in (section(details, CODES_FIELD), section(section(details, "quantization"), CODES_FIELD)):
        for name, item in section(entry, "tensors").items():
            if isinstance(item, dict) and isinstance(item.get("sha256"), str):
                out[str(name)] = item
    return out


def holds_codes(stored: Stored, recorded: dict[str, dict[str, Any]], names: tuple[str, ...]) -> bool:
    """Whether ``stored`` holds the calibrated codes recorded under ``names``: the whole tensor,
    or (a fused projection) its consecutive row ranges, one recorded tensor each, in order."""
    if stored.qz is None or stored.scales is None or not names or any(n not in recorded for n in names):
        return False
    rows, cols = stored.qz.shape
    at = 0
    for name in names:
        item = recorded[name]
        try:
            height, width = int(item.get("rows", 0)), int(item.get("cols", 0))
        except (TypeError, ValueError):
            return False
        if width != cols or height <= 0 or at + height > rows:
            return False
        if code_digest(stored.qz[at:at + height], stored.scales[at:at + height]) != item["sha256"]:
            return False
        at += height
    return at == rows


def compare(stored_tensors: list[Stored], pair: Callable[[Stored], Pairing | str], details: Any,
            own_rounding: Callable[[Stored, np.ndarray], bool] | None = None,
            complete: bool = True) -> WeightCheck:
    """Check every stored tensor against the reference weight ``pair`` gives it (a string: why it
    has none, a failure): its calibrated codes against the digests recorded under that weight's
    own name, else every element on the grid of that weight. A weight paired with two tensors
    fails (each is stored once), and so (``complete``: every quantized tensor was read) does a
    recorded digest that no tensor holds. ``own_rounding(stored, reference)``: whether a tensor
    off the grid is what the exporter's own quantizer makes of the reference weight
    (:func:`pit_deploy.targets.executorch.stored_weights.torchao_hqq_rounding`)."""
    recorded = recorded_codes(details)
    result = WeightCheck(checked=True)
    owner: dict[str, str] = {}
    held: set[str] = set()
    for stored in stored_tensors:
        result.tensors += 1
        result.names.append(stored.name)
        pairing = pair(stored)
        if isinstance(pairing, str):
            result.failure = f"quantized tensor {stored.name}: {pairing}"
            return result
        for name in pairing.names if pairing.once else ():
            if name in owner:
                result.failure = (f"quantized tensor {stored.name}: paired with {name}, as {owner[name]} is; "
                                  "each weight of the model is stored once")
                return result
            owner[name] = stored.name
        holds = next((names for names in pairing.codes if holds_codes(stored, recorded, names)), None)
        if holds is not None:
            result.calibrated += 1
            held.update(holds)
            continue
        forms = pairing.forms()
        pick = forms[0] if len(forms) == 1 else best_candidate(stored, forms)
        ref_name, ref = pick if pick is not None else (pairing.label, None)
        if ref is None or ref.shape != stored.shape:
            shape = "" if ref is None else f" of shape {tuple(ref.shape)}"
            result.failure = (f"quantized tensor {stored.name} {stored.shape}: its reference weight "
                              f"{pairing.label}{shape} does not have its shape")
            return result
        bad, worst = off_grid(stored, ref)
        if bad and own_rounding is not None and own_rounding(stored, ref):
            continue
        if bad:
            grid = f"{stored.bits}-bit blocks of {stored.block}" if stored.bits else "float16/bfloat16"
            calibrated = [n for names in pairing.codes for n in names if n in recorded]
            how = (f"neither within one grid step of its reference weight {ref_name} nor the calibrated codes "
                   f"recorded for {', '.join(calibrated)}" if calibrated
                   else f"not within one grid step of its reference weight {ref_name}")
            result.failure = (f"quantized tensor {stored.name}: {bad} of {stored.size} values {how} "
                              f"({grid}, worst {worst:.3g} steps)")
            return result
    if not result.tensors:
        result.failure = "the artifact holds no quantized tensor to check"
    elif complete and (missing := [n for n in recorded if n not in held]):
        result.failure = (f"the calibrated codes recorded for {missing[0]}"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                          + " are held by no quantized tensor of the artifact paired with that weight")
    return result


def check_artifact_weights(directory: Path, art: Any, reference: Any) -> WeightCheck:
    """The weight-level check of one quantized artifact (see the module docstring): the check its
    target names (:attr:`~pit_deploy.targets.base.Target.weight_check`), or "not checked"."""
    from ..targets import get_target, resolve

    target = get_target(art.target)
    if target.weight_check is None:
        return WeightCheck(checked=False, note=f"not checked at the weight level: {target.weight_check_blocker} "
                                               "(KL bounds only)")
    return resolve(target.weight_check)(Path(directory), art, reference)


def artifact_mode(art: Any) -> str:
    return art.mode if art.mode in ("materialized", "factorized", "tied") else "materialized"

"""Verification at the weight level: each quantized weight read back from the artifact, in the
runtime's own codes and scales, compared with the reference model's weight on the target's grid.

The KL bounds judge an artifact through its output, and a model whose logits depend little on
its body can hide random codes there (a tiny model's KL stays within a multiple of its expected
error). This check does not depend on the model's sensitivity:

* **What is read.** ONNX (``onnx``, ``onnx-genai``): every ``MatMulNBits`` (body linears, the
  head, an 8-bit table's two nibble planes summed back), every ``GatherBlockQuantized`` (the
  token table the embedding reads) and every folded weight of the web schemes (codes, block
  scales and zero points that the graph dequantizes at load). GGUF: every tensor that is not
  float32, dequantized by gguf-py (``gguf.quants.dequantize``). A ``.pte`` keeps its linears
  inside XNNPACK's packed delegate data, which no public reader of ExecuTorch opens: its
  artifacts are reported "not checked at the weight level", never as passed by this check.
* **What it is compared with.** The export directory's ``reference/`` checkpoint, prepared as
  the exporter prepared it (:func:`pit_deploy.export.passes.prepare`): every 2-D weight, its
  transpose, the builder's fused projections (``qkv_proj``, ``gate_up_proj``), and a
  factorized token table turned by the exporter's rotation (``Z R``); the gguf target's
  tensors under llama.cpp's names with its row order (:func:`pit_deploy.export.to_gguf.gguf_tensors`).
  The PIT-corrected GGUF table is float32 and is not a quantized tensor.
* **The grid.** Plain rounding (``rtn``): every dequantized element within one grid step of the
  reference weight, the step of a ``b``-bit block being ``2·max|w| / (2^b − 1)`` over the block
  of the reference (the widest step any of the runtimes' quantizers uses for that block; llama.cpp's
  k-quants: over the 256-value super-block, against which their sub-block scales are rounded; a
  float16/bfloat16 tensor: one unit in the last place). Calibrated rounding (``gptq``) moves
  codes further on purpose: the export records a digest of each calibrated tensor's codes and
  scales (``details.weight_codes``), and the artifact's tensor must hold exactly those.

The first tensor that fails is named; nothing is sampled but the pairing of an artifact tensor
with its reference weight (a few rows pick the candidate, then every element is compared).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..io.weight_codes import CODES_FIELD, code_digest, table_codes

#: what a dequantized element may exceed one grid step by (float32 rounding of scale × code)
STEP_SLACK = 1e-3
#: rows of an artifact tensor that pick its reference weight among those of its shape
PROBE_ROWS = 8
#: bits of the GGUF types, by type name (the others are float or unknown)
GGUF_BITS = {"Q2_K": 2, "Q3_K": 3, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5,
             "Q6_K": 6, "Q8_0": 8, "Q8_1": 8, "Q8_K": 8}
#: relative unit in the last place of the float types a GGUF file may hold
GGUF_FLOAT_ULP = {"F16": 2.0 ** -10, "BF16": 2.0 ** -7}
#: the builder's fused projections and the linears whose output rows each stacks, in order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass
class Stored:
    """One quantized tensor as the artifact stores it, dequantized to ``(rows, K)``.

    ``qz``/``scales``: the integer codes minus their zero points ``(rows, K)`` and the block
    scales ``(rows, K / block)`` where the format has them (for the calibrated-codes digest);
    ``bits``: the grid's bits (``None``: a float type with relative step ``ulp``)."""

    name: str
    values: np.ndarray
    bits: int | None
    block: int
    qz: np.ndarray | None = None
    scales: np.ndarray | None = None
    ulp: float | None = None
    #: the block scales are float16 (GGUF): a tiny block's scale is itself rounded, up to half a
    #: float16 unit, which ``2^(b−1)`` codes multiply
    f16_scales: bool = False


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


# --------------------------------------------------------------------------------------
# reading the artifact
# --------------------------------------------------------------------------------------


def _from_codes(name: str, qz: np.ndarray, scales: np.ndarray, bits: int, block: int, cols: int) -> Stored:
    rows, blocks = scales.shape
    values = (qz.reshape(rows, blocks, block).astype(np.float32) * scales[..., None]).reshape(rows, -1)
    return Stored(name, values[:, :cols], bits, block, qz[:, :cols] if cols == qz.shape[1] else None,
                  scales if cols == qz.shape[1] else None)


_PLANE = re.compile(r"^(.*)\.p(\d+)\.data$")
_FOLDED = re.compile(r"^(.*)\.q(4|8)$")


def onnx_stored(path: Path) -> list[Stored]:
    """Every quantized tensor of the ONNX graph at ``path`` (see the module docstring), in graph
    order; an 8-bit table stored as two nibble planes is one tensor."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path), load_external_data=True)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    arrays: dict[str, np.ndarray] = {}

    def arr(name: str) -> np.ndarray | None:
        if not name or name not in inits:
            return None
        if name not in arrays:
            arrays[name] = numpy_helper.to_array(inits[name])
        return arrays[name]

    out: list[Stored] = []
    planes: dict[str, dict[int, tuple[np.ndarray, np.ndarray, int, int]]] = {}
    seen: set[str] = set()
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "MatMulNBits" and arr(node.input[1]) is not None and arr(node.input[2]) is not None:
            data_name, bits, block, cols = node.input[1], int(attrs.get("bits", 4)), int(attrs["block_size"]), int(attrs["K"])
            zp = arr(node.input[3]) if len(node.input) > 3 else None
            scales = arr(node.input[2]).reshape(int(attrs["N"]), -1)
        elif node.op_type == "GatherBlockQuantized" and arr(node.input[0]) is not None and arr(node.input[2]) is not None:
            data_name, bits, block = node.input[0], int(attrs.get("bits", 4)), int(attrs.get("block_size", 128))
            zp = arr(node.input[3]) if len(node.input) > 3 else None
            scales = arr(node.input[2])
            cols = scales.shape[-1] * block
        else:
            continue
        if data_name in seen:
            continue
        seen.add(data_name)
        qz, scales = table_codes(arr(data_name), scales, zp, bits, block)
        plane = _PLANE.match(data_name)
        if plane:
            planes.setdefault(plane.group(1), {})[int(plane.group(2))] = (qz, scales, bits, block)
            continue
        out.append(_from_codes(node.name or data_name, qz, scales, bits, block, cols))
    for prefix, parts in planes.items():
        n = len(parts)
        qz = sum(parts[k][0] * 16 ** (n - 1 - k) for k in sorted(parts))
        scales, _, block = parts[0][1], parts[0][2], parts[0][3]
        out.append(_from_codes(prefix, qz, scales, 4 * n, block, qz.shape[1]))
    for name in inits:
        folded = _FOLDED.match(name)
        if not folded or f"{folded.group(1)}.scales" not in inits:
            continue
        base, bits = folded.group(1), int(folded.group(2))
        scales = arr(f"{base}.scales")
        rows, blocks = scales.shape[0], scales.shape[1]
        block = arr(name).reshape(-1).size * 8 // bits // (rows * blocks)
        qz, scales = table_codes(arr(name), scales.reshape(rows, blocks), arr(f"{base}.zero_points"), bits, block)
        out.append(_from_codes(base, qz, scales, bits, block, qz.shape[1]))
    return out


def gguf_stored(path: Path) -> list[Stored]:
    """Every tensor of the GGUF file at ``path`` that is not float32, dequantized by gguf-py."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    out = []
    for t in GGUFReader(str(path)).tensors:
        kind = t.tensor_type.name
        if kind == "F32":
            continue
        values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        values = values.reshape(-1, int(t.shape[0]))  # ggml's ne[0] is the row length
        # a k-quant's sub-block scales are themselves rounded against the 256-value super-block's
        block = 256 if kind.endswith("_K") else 32
        out.append(Stored(t.name, values, GGUF_BITS.get(kind), block, ulp=GGUF_FLOAT_ULP.get(kind, 0.0)
                          if kind not in GGUF_BITS else None, f16_scales=kind in GGUF_BITS))
    return out


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


def off_grid(stored_values: np.ndarray, reference: np.ndarray, stored: Stored) -> tuple[int, float]:
    """``(elements beyond one grid step, the worst distance in steps)``."""
    step = grid_step(reference, stored)
    diff = np.abs(stored_values.astype(np.float64) - reference.astype(np.float64))
    allowed = step * (1 + STEP_SLACK) + 1e-12
    bad = ~(diff <= allowed)  # NaN counts as beyond
    worst = float(np.nanmax(diff / np.maximum(step, 1e-30))) if diff.size else 0.0
    if not np.isfinite(stored_values).all():
        worst = float("inf")
    return int(bad.sum()), worst


# --------------------------------------------------------------------------------------
# the reference
# --------------------------------------------------------------------------------------


def onnx_candidates(prepared: Any, vocab: int, rotated_table: bool) -> dict[tuple[int, int], list[tuple[str, np.ndarray]]]:
    """The reference weights an ONNX artifact's tensors may hold, by shape ``(rows, K)``
    (``rotated_table``: a factorized graph's table, which the exporter turns by ``R``)."""
    import torch

    from ..export.residual_rotation import rotation_matrix

    state = {name: value.detach().to(torch.float32).cpu().numpy() for name, value in prepared.state_dict().items()
             if value.ndim == 2 and value.is_floating_point()}
    found: dict[tuple[int, int], list[tuple[str, np.ndarray]]] = {}

    def add(name: str, array: np.ndarray) -> None:
        found.setdefault(tuple(array.shape), []).append((name, np.ascontiguousarray(array, dtype=np.float32)))

    for name, array in state.items():
        add(name, array)
        add(name + ".T", array.T)
        if rotated_table and vocab in array.shape:
            rows = array if array.shape[0] == vocab else array.T
            r = rotation_matrix(rows.shape[1]).numpy()
            add(name + " R", (rows.astype(np.float64) @ r).astype(np.float32))
    for name in state:
        module, _, leaf = name.rpartition(".")
        prefix, _, proj = module.rpartition(".")
        for fused, parts in FUSED.items():
            if proj == parts[0] and leaf == "weight":
                names = [f"{prefix}.{p}.weight" for p in parts]
                if all(n in state for n in names) and len({state[n].shape[1] for n in names}) == 1:
                    add(f"{prefix}.{fused}.weight", np.concatenate([state[n] for n in names]))
    return found


def _probe_rows(rows: int) -> np.ndarray:
    return np.unique(np.linspace(0, rows - 1, min(rows, PROBE_ROWS)).round().astype(int))


def best_candidate(stored: Stored, candidates: list[tuple[str, np.ndarray]]) -> tuple[str, np.ndarray] | None:
    """The candidate closest to ``stored`` on a few rows, measured in grid steps."""
    if not candidates:
        return None
    rows = _probe_rows(stored.values.shape[0])
    probe = Stored(stored.name, stored.values[rows], stored.bits, stored.block, ulp=stored.ulp,
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


def _recorded(details: Any) -> dict[tuple[int, int], dict[str, int]]:
    """The calibrated codes' digests the export recorded, by ``(rows, cols)``: digest → count."""
    if not isinstance(details, dict):
        return {}
    quant = details.get("quantization") if isinstance(details.get("quantization"), dict) else {}
    items = []
    for entry in (details.get(CODES_FIELD), quant.get(CODES_FIELD)):
        tensors = entry.get("tensors") if isinstance(entry, dict) else None
        items += list(tensors.values()) if isinstance(tensors, dict) else []
    out: dict[tuple[int, int], dict[str, int]] = {}
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("sha256"), str):
            key = (int(item.get("rows", 0)), int(item.get("cols", 0)))
            out.setdefault(key, {}).setdefault(item["sha256"], 0)
            out[key][item["sha256"]] += 1
    return out


def _calibrated(stored: Stored, recorded: dict[tuple[int, int], dict[str, int]]) -> bool:
    """Whether ``stored`` holds recorded calibrated codes: the whole tensor, or (a fused
    projection) consecutive row ranges each of which is one recorded tensor."""
    if stored.qz is None or stored.scales is None or not recorded:
        return False
    rows, cols = stored.qz.shape
    heights = sorted({r for r, c in recorded if c == cols}, reverse=True)
    at = 0
    while at < rows:
        for h in heights:
            if at + h <= rows and code_digest(stored.qz[at:at + h], stored.scales[at:at + h]) in recorded[(h, cols)]:
                at += h
                break
        else:
            return False
    return True


def compare(stored_tensors: list[Stored], reference: dict[str, np.ndarray] | None,
            candidates: dict[tuple[int, int], list[tuple[str, np.ndarray]]] | None,
            details: Any) -> WeightCheck:
    """Check every stored tensor: by name against ``reference`` (GGUF) or against the best of
    ``candidates`` of its shape (ONNX); calibrated codes against the recorded digests."""
    recorded = _recorded(details)
    result = WeightCheck(checked=True)
    for stored in stored_tensors:
        result.tensors += 1
        result.names.append(stored.name)
        if _calibrated(stored, recorded):
            result.calibrated += 1
            continue
        if reference is not None:
            ref = reference.get(stored.name)
            ref_name = stored.name
        else:
            pick = best_candidate(stored, (candidates or {}).get(tuple(stored.values.shape), []))
            ref_name, ref = pick if pick is not None else (None, None)
        if ref is None or ref.shape != stored.values.shape:
            result.failure = (f"quantized tensor {stored.name} {tuple(stored.values.shape)} matches no weight of the "
                              "reference model")
            return result
        bad, worst = off_grid(stored.values, ref, stored)
        if bad:
            grid = f"{stored.bits}-bit blocks of {stored.block}" if stored.bits else "float16/bfloat16"
            how = ("neither within one grid step of the reference weight nor the calibrated codes recorded at export"
                   if recorded else "not within one grid step of the reference weight")
            result.failure = (f"quantized tensor {stored.name}: {bad} of {stored.values.size} values {how} "
                              f"(closest reference weight {ref_name}, {grid}, worst {worst:.3g} steps)")
            return result
    if not result.tensors:
        result.failure = "the artifact holds no quantized tensor to check"
    return result


def check_artifact_weights(directory: Path, art: Any, reference: Any) -> WeightCheck:
    """The weight-level check of one quantized artifact (see the module docstring): the check its
    target names (:attr:`~pit_deploy.targets.base.Target.weight_check`), or "not checked"."""
    from ..targets import get_target, resolve

    target = get_target(art.runtime)
    if target.weight_check is None:
        return WeightCheck(checked=False, note=f"not checked at the weight level: {target.weight_check_blocker} "
                                               "(KL bounds only)")
    return resolve(target.weight_check)(Path(directory), art, reference)


def _mode(art: Any) -> str:
    return art.mode if art.mode in ("materialized", "factorized", "tied") else "materialized"


def check_onnx_weights(directory: Path, art: Any, reference: Any) -> WeightCheck:
    """An ONNX artifact (either ONNX target): its decoder's quantized tensors against every
    weight of the prepared reference that has their shape."""
    from ..export.passes import prepare
    from ..targets import get_target

    folder = directory / art.path
    stored = onnx_stored(folder / get_target(art.runtime).primary_path(folder))
    candidates = onnx_candidates(prepare(reference, _mode(art)), int(art.shapes["vocab_size"]),
                                 _mode(art) == "factorized")
    return compare(stored, None, candidates, art.details)


def check_gguf_weights(directory: Path, art: Any, reference: Any) -> WeightCheck:
    """A GGUF artifact: every quantized tensor against the tensor the exporter wrote from the
    prepared reference under the same name."""
    from ..export.passes import prepare
    from ..export.to_gguf import gguf_tensors

    name = (art.details or {}).get("file") if isinstance(art.details, dict) else None
    files = [rel for rel in art.files if rel.endswith(".gguf")]
    rel = next((f for f in files if Path(f).name == name), files[0] if files else None)
    if rel is None:
        return WeightCheck(checked=False, note="the artifact lists no .gguf file")
    return compare(gguf_stored(directory / rel), gguf_tensors(prepare(reference, _mode(art))), None, art.details)

"""A body left on the source's 4-bit grid: how much of the int4 `.pte`'s KL does it remove, and
what does it cost the trained model?

The default model's GGUF stores all 210 body linears as Q4_1: in blocks of 32 input columns,
``w = d·q + m`` with ``q ∈ 0..15`` and a half-precision ``d``, ``m`` a block. The ``preserve``
conversion folds the block norms' gains into the linears and turns the residual stream by an
orthogonal ``R`` (an exact symmetry); both leave the body computing what the source computed but
move every weight off that grid, so the exporter's GPTQ pays a full 4-bit rounding
(``studies/gptq_variants.py``: the body's weights alone cost 0.043 / 0.097 / 0.102 on held-out
code / prose / chat). Mapped back (``R`` recovered from the writers by orthogonal Procrustes,
the source gains unfolded), a converted body lands on the grid again up to float32 noise, and a
program that computes in the source's basis could hold it exactly: XNNPACK's 4-bit linears are
symmetric, so ``w = d·(q − 8) + c`` with ``c = m + 8d``: the symmetric codes with scale ``d`` in
one ``8da4w`` linear, and a second, small linear from the 32-column block sums of the input to
the output, weights ``c``.

Every row is eager PyTorch with that program's numerics against the fp32 PIT model it came from,
on the held-out kinds of :func:`pit_deploy.data.calibration.heldout_sets`:

- ``body on the grid``: each body weight, in the source's basis, rounded on its source block's
  grid (``d`` in bfloat16, as XNNPACK stores a 4-bit scale; ``c`` makes up the difference);
  float activations, float token table;
- ``+ int8 activations``: each linear's input (in the source's basis, where the stream's outlier
  channels are not spread by any rotation) through XNNPACK's per-token asymmetric int8;
- ``+ int8 offsets``: the block-sum linear at 8 bits (per-row int8 weights, its int8 input);
- ``+ 4-bit table by GPTQ``: the shipped token table (:func:`pit_deploy.targets.executorch.token_table.quantize_token_table`,
  one 4-bit table for the gather and the head, rounded against the head input's moments).

Two checkpoints: the default run's (20 steps of continued pretraining that train every weight) and one
trained the same way with ``--interface-only`` (the body and block norms frozen: only ``T`` and
the final norm learn), whose body is still exactly on the grid. Each checkpoint's rows also give the
absolute mean NLL per held-out kind, because a frozen body also gives up what training taught it.

    pit-deploy train --model runs/default/1-convert/model --data default --steps 20 --seq-len 256 \\
        --batch-size 4 --lr 1e-5 --warmup-steps 4 --weight-decay 0 --eval-every 10 --interface-only \\
        --out runs/iface
    python studies/source_grid.py --pit runs/default/2-train/pit/model \\
        --pit-interface-only runs/iface/model [--out studies/results/source_grid.json]
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pit_deploy.converters.preserve as preserve  # noqa: E402
from pit_deploy.data.calibration import calibration_blocks, heldout_sets  # noqa: E402
from pit_deploy.exporters.calibrated_rounding import BLOCKS_ATTR, head_moments  # noqa: E402
from pit_deploy.exporters.passes import prepare  # noqa: E402
from pit_deploy.targets.executorch.token_table import quantize_token_table  # noqa: E402
from pit_deploy.io.checkpoint import load_pit_model  # noqa: E402
from pit_deploy.io.sources import load_source  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gptq_frontier import measure  # noqa: E402
from pit_deploy.io.result_file import write_result  # noqa: E402

BLOCK = 32
#: the linears that read each block norm, and those that write into the stream (the conversion's)
READERS, WRITERS = preserve._READERS, preserve._WRITERS
LINEARS = tuple(lin for names in READERS.values() for lin in names) + WRITERS
TABLE_GROUP = 32


def norm_of(linear: str) -> str | None:
    return next((norm for norm, names in READERS.items() if linear in names), None)


def source_rotation(pit: nn.Module, source: nn.Module) -> torch.Tensor:
    """``R`` (float64) with ``R W_pit ≈ W_source`` for every writer: orthogonal Procrustes."""
    m = sum(source.get_submodule(f"model.layers.{i}.{w}").weight.double()
            @ pit.get_submodule(f"model.layers.{i}.{w}").weight.double().T
            for i in range(len(source.model.layers)) for w in WRITERS)
    u, _, vh = torch.linalg.svd(m)
    return u @ vh


class SourceBasis:
    """One linear's maps between the PIT model's basis and the source's: a reader's input
    ``x_src = x_pit a_in`` (the rotation back and the gains unfolded), a writer's output
    ``y_pit = y_src a_out``; the other side is the same in both."""

    def __init__(self, pit: nn.Module, source: nn.Module, r: torch.Tensor, layer: int, linear: str):
        norm = norm_of(linear)
        if norm is None:  # a writer: its input is no residual stream, its output is
            self.a_in, self.a_out = None, r
        else:  # a reader: y = norm(x_src)·g_src·W_srcᵀ = norm(x_pit)·g_pit·W_pitᵀ
            g_pit = pit.get_submodule(f"model.layers.{layer}.{norm}").weight.double()
            g_src = source.get_submodule(f"model.layers.{layer}.{norm}").weight.double()
            self.a_in, self.a_out = torch.diag(1 / g_pit) @ r.T @ torch.diag(g_src), None
        # float32 copies for the forward (:meth:`around`), made once
        self.in32 = None if self.a_in is None else self.a_in.float()
        self.out32 = None if self.a_out is None else self.a_out.float()

    def weight_to_source(self, w: torch.Tensor) -> torch.Tensor:
        w = w.double()
        if self.a_out is not None:  # y_pit = y_src R → W_pit = Rᵀ W_src
            return self.a_out @ w
        return w @ torch.linalg.inv(self.a_in).T

    def weight_from_source(self, w: torch.Tensor) -> torch.Tensor:
        if self.a_out is not None:
            return self.a_out.T @ w
        return w @ self.a_in.T

    def around(self, x: torch.Tensor, inner) -> torch.Tensor:
        """``inner`` (a source-basis linear) applied to a PIT-basis input (float32), its output
        back in the PIT basis."""
        y = inner(x if self.in32 is None else x @ self.in32)
        return y if self.out32 is None else y @ self.out32


def grid_of(w_source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d, m)`` ``(rows·blocks, 1)`` of a weight stored as Q4_1: a block's smallest value is
    ``m`` (code 0) and its largest ``m + 15d`` (code 15)."""
    blocks = w_source.reshape(-1, BLOCK)
    lo = blocks.min(1, keepdim=True).values
    return (blocks.max(1, keepdim=True).values - lo) / 15, lo


def codes_on(w_source: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``w_source``'s nearest codes ``0..15`` on the grid ``(d, m)`` of :func:`grid_of`, its shape."""
    codes = torch.round((w_source.reshape(-1, BLOCK) - m) / torch.where(d > 0, d, 1)).clamp(0, 15)
    return codes.reshape(w_source.shape)


class GridLinear(nn.Module):
    """One body linear as the source-grid program computes it, in the PIT model's basis:
    ``y = (x̂ W_symᵀ + Ŝ Cᵀ)`` in the source's basis, with ``W_sym = d·(q − 8)`` (``d`` bfloat16),
    ``C`` the blocks' offsets ``c = m + 8d``, ``S`` the input's block sums."""

    def __init__(self, basis: SourceBasis, codes: torch.Tensor, d: torch.Tensor, c: torch.Tensor):
        super().__init__()
        rows, cols = codes.shape
        self.basis = basis
        self.w_sym = ((codes - 8) * d.reshape(rows, -1, 1).repeat_interleave(BLOCK, 2).reshape(rows, cols)).float()
        self.c = c.reshape(rows, cols // BLOCK).float()
        self.act8 = self.offset8 = False
        self.smooth: torch.Tensor | None = None  # per input channel, see block_smoothing

    def dense(self) -> torch.Tensor:
        """The float weight in the source's basis."""
        return self.w_sym + self.c.repeat_interleave(BLOCK, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.basis.around(x, self._in_source)

    def _in_source(self, u: torch.Tensor) -> torch.Tensor:
        s = u.unflatten(-1, (-1, BLOCK)).sum(-1)
        c = self.c
        if self.offset8:  # 8da8w: per-row symmetric int8 weights, its input per token
            c = per_row_int8(c)
            s = per_token_int8(s)
        if self.act8:
            u = per_token_int8(u) if self.smooth is None else per_token_int8(u / self.smooth) * self.smooth
        return u @ self.w_sym.T + s @ c.T


def per_token_int8(x: torch.Tensor) -> torch.Tensor:
    """XNNPACK's dynamic activation quantization: asymmetric int8 over ``[min(x, 0), max(x, 0)]``,
    one scale a token, in float32 as the runtime computes it. (The project's
    :func:`~pit_deploy.exporters.expected_error.fake_quantize` rounds the same grid in float64, which
    moves a few codes at half steps: on the ``--interface-only`` model's int8-activation row, chat's
    KL 0.0252 becomes 0.0232.)"""
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True).clamp(min=0)
    scale = (hi - lo).clamp(min=1e-12) / 255
    zero = torch.round(-lo / scale) - 128
    return (torch.clamp(torch.round(x / scale) + zero, -128, 127) - zero) * scale


def per_row_int8(w: torch.Tensor) -> torch.Tensor:
    """``8da8w``'s weights: symmetric int8, one scale a row, in float32 (as :func:`per_token_int8`)."""
    scale = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(w / scale).clamp(-127, 127) * scale


@torch.no_grad()
def grid_model(pit: nn.Module, source: nn.Module) -> tuple[nn.Module, dict]:
    """A copy of ``pit`` whose body linears are :class:`GridLinear` on the source's grid; the
    figures of how far the body was from it."""
    model = copy.deepcopy(pit)
    r = source_rotation(pit, source)
    moved = total = 0.0
    worst = 0.0
    for i in range(len(source.model.layers)):
        for lin in LINEARS:
            name = f"model.layers.{i}.{lin}"
            basis = SourceBasis(pit, source, r, i, lin)
            w_src = source.get_submodule(name).weight.double()
            d, m = grid_of(w_src)
            d16 = d.to(torch.bfloat16).double()  # XNNPACK's 4-bit scale
            w_pit = basis.weight_to_source(pit.get_submodule(name).weight)
            # how the PIT weight's change weighs in the output: the source gain of its column
            g = torch.ones(w_src.shape[1], dtype=torch.float64) if norm_of(lin) is None else \
                source.get_submodule(f"model.layers.{i}.{norm_of(lin)}").weight.double().abs()
            change, size = float(((w_pit - w_src) * g).norm()), float((w_src * g).norm())
            moved, total, worst = moved + change ** 2, total + size ** 2, max(worst, change / size)
            c = m + 8 * d16  # w = d16·(q − 8) + c = d16·q + m: the scale's bfloat16 rounding is the only error
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, GridLinear(basis, codes_on(w_pit, d, m), d16, c))
    return model, {"body_moved_rel": math.sqrt(moved / total), "body_moved_worst_linear": worst}


def mean_nll(model: nn.Module, sets: dict[str, list[list[int]]]) -> dict[str, float]:
    out = {}
    with torch.no_grad():
        for kind, blocks in sets.items():
            total = count = 0.0
            for row in blocks:
                ids = torch.tensor(row)[None]
                logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
                total -= float(logp.gather(1, ids[0, 1:, None]).sum())
                count += ids.shape[1] - 1
            out[kind] = total / count
    return out


def activation_absmax(model: nn.Module, blocks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per input channel (source basis), the largest ``|u|`` each :class:`GridLinear` reads on ``blocks``."""
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, GridLinear):
            def hook(mod, args, name=name):
                u = args[0] if mod.basis.in32 is None else args[0] @ mod.basis.in32
                m = u.detach().abs().reshape(-1, u.shape[-1]).amax(0)
                seen[name] = torch.maximum(seen[name], m) if name in seen else m
            hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        for block in blocks:
            model(input_ids=block[None])
    for h in hooks:
        h.remove()
    return seen


def block_smoothing(model: nn.Module, absmax: dict[str, torch.Tensor], alpha: float = 0.5) -> None:
    """SmoothQuant's factors (Xiao et al., 2023, arXiv:2211.10438) ``s = a^α / w^(1−α)``, one per
    block of 32 input channels, on the block norms' readers (a shared ``s`` for the linears of one
    norm: it divides the norm's gain) and on ``down_proj`` (it divides ``up_proj``'s rows). A
    factor constant over a block scales that block's ``d`` and ``m`` alike, so the weights stay on a
    4-bit grid; the emulation divides the quantized input by ``s`` and multiplies it back."""
    layers = len(model.model.layers)
    for i in range(layers):
        groups = [[f"model.layers.{i}.{lin}" for lin in names] for names in READERS.values()]
        groups.append([f"model.layers.{i}.mlp.down_proj"])
        for group in groups:
            mods = [model.get_submodule(n) for n in group]
            a = absmax[group[0]].reshape(-1, BLOCK).amax(1)
            w = torch.stack([m.dense().abs().amax(0) for m in mods]).amax(0).reshape(-1, BLOCK).amax(1)
            factor = (a.clamp(min=1e-5) ** alpha / w.clamp(min=1e-5) ** (1 - alpha)).repeat_interleave(BLOCK)
            for m in mods:
                m.smooth = factor


def rows_of(label: str, path: str, source: nn.Module, tokenizer, sets, variants: bool) -> list[dict]:
    """:func:`measure_rows` of the checkpoint at ``path``."""
    torch.manual_seed(0)
    return measure_rows(label, load_pit_model(path).eval(), source, tokenizer, sets, variants)


def measure_rows(label: str, reference: nn.Module, source: nn.Module, tokenizer, sets, variants: bool) -> list[dict]:
    """The four stages (module docstring) of one fp32 PIT model, its body rounded on ``source``'s
    grid; with ``variants`` two more rows, each the full program changed in one more way: block
    smoothing; then also a table in groups of 16."""
    base = {"checkpoint": label, "reference_nll": mean_nll(reference, sets)}
    start = time.perf_counter()
    model, moved = grid_model(reference, source)
    model.eval()
    blocks, _ = calibration_blocks(tokenizer, reference.config, 256)
    rows = []

    def row(stage: str, m: nn.Module, mb: float) -> None:
        figures = measure(m, reference, sets)
        rows.append({**base, **moved, "stage": stage, "weight_mb": round(mb, 2), **figures,
                     "nll": {k: base["reference_nll"][k] + math.log(v["ppl_ratio"]) for k, v in figures.items()}})
        print(label, stage, {k: round(v["kl_mean"], 4) for k, v in figures.items()}, flush=True)

    def program(m: nn.Module, group: int, smooth: dict | None) -> nn.Module:
        """``m`` (int8 activations and offsets on) with the token table the exporter builds,
        GPTQ-rounded against the head input's moments, in groups of ``group``."""
        prepared = prepare(m, "factorized")
        for name, mod in prepared.named_modules():
            if isinstance(mod, GridLinear):
                mod.act8 = mod.offset8 = True
        if smooth is not None:
            block_smoothing(prepared, smooth)
        object.__setattr__(prepared, BLOCKS_ATTR, blocks)
        moments = head_moments(prepared)
        quantize_token_table(prepared, group, True, table_bits=4, head_bits=4, shared=True, head_moments=moments)
        return prepared.eval()

    row("body on the grid", model, weight_mb(source, 32, table_bits=32))
    grids = [m for m in model.modules() if isinstance(m, GridLinear)]
    absmax = activation_absmax(model, blocks[:16]) if variants else None
    for g in grids:
        g.act8 = True
    row("+ int8 activations", model, weight_mb(source, 32, table_bits=32))
    for g in grids:
        g.offset8 = True
    row("+ int8 offsets", model, weight_mb(source, 8, table_bits=32))
    row("+ 4-bit table by GPTQ", program(model, TABLE_GROUP, None), weight_mb(source, 8))
    if variants:
        row("+ block smoothing of the activations", program(model, TABLE_GROUP, absmax), weight_mb(source, 8))
        row("+ table in groups of 16", program(model, 16, absmax), weight_mb(source, 8, table_group=16))
    rows[-1]["seconds"] = round(time.perf_counter() - start, 1)
    return rows


def weight_mb(source: nn.Module, offsets_bits: int, table_bits: int = 4, table_group: int = TABLE_GROUP) -> float:
    """The program's weights: 4-bit codes + a bfloat16 scale a block, the offsets (a byte or a
    float a block, + a float32 scale a row at 8 bits), the shared token table as the shipped
    program holds it (4-bit codes, a bfloat16 head scale and a float32 gather scale a group)."""
    total = 0.0
    for name, p in source.named_parameters():
        if p.ndim == 2 and ".layers." in name:
            rows, cols = p.shape
            total += rows * cols / 2 + rows * cols / BLOCK * 2
            total += rows * cols / BLOCK * (1 if offsets_bits == 8 else 4) + (rows * 4 if offsets_bits == 8 else 0)
    vocab, dim = source.config.vocab_size, source.config.hidden_size
    total += vocab * dim * table_bits / 8 + (vocab * dim / table_group * (2 + 4) if table_bits == 4 else 0)
    return total / 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pit", required=True, help="the default run's PIT checkpoint of the default model")
    ap.add_argument("--pit-interface-only", required=True, help="the same training with --interface-only")
    ap.add_argument("--out", default="studies/results/source_grid.json")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    source = load_source("default", with_tokenizer=False).model.eval()
    tokenizer = AutoTokenizer.from_pretrained(args.pit)
    sets = heldout_sets(tokenizer)
    rows = rows_of("main job (every weight trained)", args.pit, source, tokenizer, sets, variants=False)
    rows += rows_of("--interface-only", args.pit_interface_only, source, tokenizer, sets, variants=True)
    return write_result(args.out, {"heldout_tokens": {k: sum(map(len, v)) for k, v in sets.items()},
                            "rows": rows}, script=__file__, argv=argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

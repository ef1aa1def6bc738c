"""Three known refinements of GPTQ on the int4 `.pte` the default run ships: do any of them bring the
held-out prose and chat, the kinds the calibration text does not hold, nearer ``0.05``?

Every row is the shipped configuration (residual rotation, GPTQ body, the 56 linears
``studies/int4_sensitivity.py`` ranks most sensitive within 85 MB at 8 bits, the one 4-bit token
table by GPTQ), run with the program's own numerics in eager mode as ``studies/gptq_frontier.py``
runs its configurations, changed in one way:

- ``act-order``: columns visited by decreasing input energy, group scales chosen up front
  (:func:`pit_deploy.exporters.calibrated_rounding.gptq`'s ``act_order``; GPTQ's "act-order" with
  "static groups", the form that keeps the runtimes' adjacent-column groups);
- ``calibration ×4``: four times the calibration text (32 768 tokens of the training split, the
  same chat prompts);
- ``scale tuning N@LR``: after GPTQ, the group scales learned for N steps at learning rate LR
  against the float model's logits on the calibration blocks, the codes unchanged
  (:func:`tune_scales`: the end-to-end step of EfficientQAT, Chen et al., 2024,
  arXiv:2407.11062, "E2E-QP"; PEQA, Kim et al., 2023, arXiv:2305.14152). GPTQ makes each
  linear's outputs right on its own; the errors of 210 linears still add up along the network,
  and with the codes fixed each group's scale is still free. It lives here, not in the exporter,
  because it did not pay (``studies/results/gptq_variants.json``).

The ``breakdown`` row of the shipped configuration splits its KL into the body's weights alone
(float activations, float table), then XNNPACK's int8 dynamic activations, then the 4-bit table.

    python studies/gptq_variants.py --pit runs/default/2-train/pit/model \\
        [--configs NAME,...] [--sensitivity studies/results/int4_sensitivity.json] \\
        [--out studies/results/gptq_variants.json]
"""

from __future__ import annotations

import dataclasses
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pit_deploy.data.calibration as calibration  # noqa: E402
import pit_deploy.exporters.calibrated_rounding as calibrated_rounding  # noqa: E402
from pit_deploy.exporters.calibrated_rounding import RoundedWeight  # noqa: E402
from pit_deploy.exporters.residual_rotation import rotate_residual  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gptq_frontier  # noqa: E402
from gptq_frontier import load_setup, measure_config, report_row, study_args, study_result  # noqa: E402
from pit_deploy.io.result_file import write_result  # noqa: E402
from table_gptq import sensitive_linears  # noqa: E402

#: the shipped configuration's weight budget (MB) and token table bits
BUDGET_MB, TABLE_BITS = 85.0, 4

#: name -> what changes (see the module docstring)
CONFIGS = {
    "breakdown": {"breakdown": True},
    "act-order": {"act_order": True},
    "calibration x4": {"calibration": 4},
    "scale tuning 80@1e-4": {"tune": (80, 1e-4)},
    "scale tuning 80@1e-3": {"tune": (80, 1e-3)},
    "calibration x4 + scale tuning 160@1e-4": {"calibration": 4, "tune": (160, 1e-4)},
}


def _bf16_ste(x: torch.Tensor) -> torch.Tensor:
    return x + (x.to(torch.bfloat16).to(x.dtype) - x).detach()


class _TunedWeight:
    """One linear's weight as a function of its learned log-scale factors."""

    def __init__(self, rounded: RoundedWeight):
        self.rounded = rounded
        out, cols = rounded.codes.shape
        groups = rounded.scales.shape[1]
        self.q = (rounded.codes.to(torch.float32) - rounded.zeros.to(torch.float32).repeat_interleave(
            cols // groups, dim=1)).reshape(out, groups, cols // groups)
        self.log_factor = nn.Parameter(torch.zeros_like(rounded.scales))

    def scales(self) -> torch.Tensor:
        s = self.rounded.scales * torch.exp(self.log_factor)
        return _bf16_ste(s) if self.rounded.grid.symmetric else s

    def weight(self) -> torch.Tensor:
        return (self.q * self.scales()[..., None]).reshape(self.q.shape[0], -1)


def _kl(teacher_logp: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(student_logits.float(), -1)
    return (teacher_logp.exp() * (teacher_logp - logp)).sum(-1).mean()


def tune_scales(model: nn.Module, teacher: nn.Module, codes: dict[str, RoundedWeight], blocks: list[torch.Tensor],
                steps: int, lr: float) -> dict[str, RoundedWeight]:
    """Learn the scales of ``codes`` (``model``'s rounded linears) for ``steps`` steps, one
    calibration block a step, each pass over the blocks in a seeded order; write the tuned
    weights into ``model`` and return the codes with their new scales (the codes unchanged).
    Each scale is learned as ``s₀ · exp(a)``, ``a`` from 0 (a relative step, alike for large
    and small groups); on a symmetric grid it is rounded to bfloat16 in the forward, as XNNPACK
    stores it, with a straight-through gradient, so what is learned survives the export."""
    from torch.func import functional_call

    tuned = {name: _TunedWeight(r) for name, r in codes.items()}
    optimizer = torch.optim.Adam([t.log_factor for t in tuned.values()], lr=lr)
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    teacher_logp: dict[int, torch.Tensor] = {}
    was_training = model.training
    model.eval()
    try:
        generator = torch.Generator().manual_seed(0)
        order: list[int] = []
        for _ in range(steps):
            if not order:  # each pass over the blocks in a new seeded order
                order = torch.randperm(len(blocks), generator=generator).tolist()
            index = order.pop()
            ids = blocks[index]
            if index not in teacher_logp:
                with torch.no_grad():
                    teacher_logp[index] = torch.log_softmax(teacher(input_ids=ids, use_cache=False).logits.float(), -1)
            weights = {f"{name}.weight": t.weight() for name, t in tuned.items()}
            logits = functional_call(model, weights, args=(), kwargs={"input_ids": ids, "use_cache": False}).logits
            loss = _kl(teacher_logp[index], logits)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        for p in frozen:
            p.requires_grad_(True)
        model.train(was_training)
    out: dict[str, RoundedWeight] = {}
    with torch.no_grad():
        for name, t in tuned.items():
            scales = t.scales().detach().to(torch.float32)
            out[name] = RoundedWeight(t.rounded.codes, scales, t.rounded.zeros, t.rounded.grid)
            module = model.get_submodule(name)
            module.weight.copy_(out[name].dequantize().to(module.weight.dtype))
    return out


@contextmanager
def _patched(module, name: str, value):
    """``module.name`` set to ``value`` for the block (how a row changes one part of the pipeline)."""
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _calibrated(act_order: bool, tune: tuple[int, float] | None):
    """:func:`~pit_deploy.exporters.calibrated_rounding.calibrated_model` with ``act_order``,
    followed by :func:`tune_scales` for ``tune`` ``(steps, lr)`` if given."""

    def calibrated_model(body, scheme, grid, blocks):
        model = calibrated_rounding.calibrated_model(body, scheme, grid, blocks, act_order=act_order)
        if tune:
            codes = tune_scales(model, body, calibrated_rounding.rounded_weights(model), blocks, *tune)
            setattr(model, calibrated_rounding.ROUNDED_ATTR, codes)
        return model

    return calibrated_model


def main(argv: list[str] | None = None) -> int:
    args = study_args(__doc__, CONFIGS, "studies/results/gptq_variants.json", argv,
                      sensitivity="studies/results/int4_sensitivity.json")
    base = load_setup(args.pit)
    rotated = rotate_residual(base.prepared)
    eight = sensitive_linears(base, args.sensitivity, BUDGET_MB, TABLE_BITS)
    rows = []
    for name in args.configs.split(","):
        change = CONFIGS[name]
        setup = base
        if change.get("calibration"):
            from transformers import AutoTokenizer

            with _patched(calibration, "CALIBRATION_TOKENS", calibration.CALIBRATION_TOKENS * change["calibration"]):
                blocks, _ = calibration.calibration_blocks(AutoTokenizer.from_pretrained(args.pit),
                                                           base.reference.config, 256)
            setup = dataclasses.replace(base, blocks=blocks)
        row = {"config": name, "rotation": "hadamard", "budget_mb": BUDGET_MB, "calibration_blocks": len(setup.blocks)}
        if change.get("breakdown"):
            stages: dict = {}
            last = measure_config(setup, rotated, "gptq", eight, TABLE_BITS, True, stages)
            row["breakdown"] = {**stages, "+ 4-bit table": {k: last[k] for k in setup.sets}}
            print(name, {k: {s: round(v["kl_mean"], 4) for s, v in r.items()} for k, r in row["breakdown"].items()})
            rows.append(row)
            continue
        calibrated = _calibrated(bool(change.get("act_order")), change.get("tune"))
        with _patched(gptq_frontier, "calibrated_model", calibrated):
            row.update(measure_config(setup, rotated, "gptq", eight, TABLE_BITS, True))
        report_row({k: v for k, v in row.items() if k != "int4_8bit_layers"})
        rows.append(row)
    write_result(args.out, study_result(base, rows, sensitivity=args.sensitivity), script=__file__, argv=argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Bits where they matter: each body linear's sensitivity to 4-bit rounding on the default model,
and the ``.pte``'s int4 configurations that spend a size budget on the most sensitive linears.

1. **Sensitivity.** For every body linear in turn, the fp32 PIT model (factorized, as the ``.pte``
   is exported) with that linear alone rounded to the ``.pte``'s 4-bit grid (symmetric, groups
   of 32, weights only: :func:`pit_deploy.exporters.expected_error.fake_quantize`), run in eager
   mode on held-out blocks of the three kinds (:func:`pit_deploy.data.calibration.heldout_sets`:
   code, prose, chat); its sensitivity is the mean KL from the fp32 model, averaged over the
   kinds. What keeping it at 8 bits costs is its weights' bytes at 8 bits (one byte a weight and a
   float32 scale a row, ``8da8w``) less at 4 (half a byte and a bfloat16 scale a group, ``8da4w``).
2. **Allocation.** Starting from every body linear at 4 bits, linears move to 8 bits in order
   of sensitivity per byte until the budget of weight bytes is spent
   (``int4_8bit_layers`` naming each one, ``layers.N.mlp.down_proj``).
3. **Measured.** Each configuration is then calibrated (GPTQ,
   :mod:`pit_deploy.exporters.calibrated_rounding`) and run with the program's own numerics in
   eager mode, as ``studies/gptq_frontier.py`` runs its configurations (torchao ``8da4w``/``8da8w``
   linears, the exporter's shared token table), on all the held-out blocks.

    python studies/int4_sensitivity.py --pit runs/default/2-train/pit/model \\
        [--budgets 87.0:4:32,101.58:8:32] [--out studies/results/int4_sensitivity.json]

A budget ``MB:TABLE_BITS:GROUP`` is megabytes of weights (the program's files add about 3 MB of
other constants: the int4 ``.pte`` of 101.58 MB of weights is 104.6 MB), the token table's bits
and the 4-bit group size.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pit_deploy.data.calibration import calibration_blocks, heldout_sets  # noqa: E402
from pit_deploy.exporters.calibrated_rounding import calibrated_model  # noqa: E402
from pit_deploy.exporters.expected_error import fake_quantize  # noqa: E402
from pit_deploy.exporters.passes import prepare  # noqa: E402
from pit_deploy.targets.executorch.token_table import quantize_token_table  # noqa: E402
from pit_deploy.targets.executorch.export import quantize_linears  # noqa: E402
from pit_deploy.io.checkpoint import load_pit_model  # noqa: E402
from pit_deploy.schemes import get_scheme  # noqa: E402
from pit_deploy.targets import get_target  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gptq_frontier import gather_scale_bytes, linear_bytes, measure, weight_bytes  # noqa: E402
from pit_deploy.io.result_file import write_result  # noqa: E402

#: held-out blocks per kind that the sensitivity pass reads (the measured configurations read all)
SENSITIVITY_BLOCKS = 3


def body_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The body's ``nn.Linear`` layers by module path (the head is not one in a factorized model)."""
    head = model.get_output_embeddings()
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}


def promotion_bytes(linear: nn.Linear, group: int) -> int:
    """Bytes that keeping ``linear`` at 8 bits adds over 4 bits (module docstring)."""
    rows, cols = linear.weight.shape
    return linear_bytes(rows, cols, 8, group) - linear_bytes(rows, cols, 4, group)


@torch.no_grad()
def sensitivities(model: nn.Module, sets: dict[str, list[list[int]]], group: int) -> dict[str, dict[str, float]]:
    """Mean KL per kind of ``model`` with each body linear alone rounded to 4 bits."""
    blocks = {kind: [torch.tensor(b)[None] for b in rows[:SENSITIVITY_BLOCKS]] for kind, rows in sets.items()}
    reference = {kind: [torch.log_softmax(model(input_ids=b).logits[0].double(), -1) for b in bs]
                 for kind, bs in blocks.items()}
    out = {}
    linears = body_linears(model)
    for i, (name, linear) in enumerate(linears.items()):
        saved = linear.weight.detach().clone()
        linear.weight.copy_(fake_quantize(saved, 4, group, symmetric=True))
        figures = {}
        for kind, bs in blocks.items():
            kls = [(ref.exp() * (ref - torch.log_softmax(model(input_ids=b).logits[0].double(), -1))).sum(-1)
                   for b, ref in zip(bs, reference[kind])]
            figures[kind] = float(torch.cat(kls).mean())
        linear.weight.copy_(saved)
        figures["mean"] = sum(figures.values()) / len(blocks)
        out[name] = figures
        if i % 30 == 0:
            print(f"sensitivity {i + 1}/{len(linears)} {name}: {figures['mean']:.4g}", flush=True)
    return out


def allocate(model: nn.Module, sens: dict[str, dict[str, float]], budget_bytes: int, table_bits: int,
             group: int) -> tuple[list[str], int]:
    """The linears kept at 8 bits within ``budget_bytes`` of weights, most sensitive per byte
    first, and the weight bytes of the result (counted as :func:`weight_bytes` counts them)."""
    linears = body_linears(model)
    v, d = model.config.vocab_size, model.config.hidden_size
    used = linear_bytes(v, d, table_bits, group) + gather_scale_bytes(v, d, table_bits, group)  # the shared table
    used += sum(linear_bytes(*m.weight.shape, 4, group) for m in linears.values())
    order = sorted(linears, key=lambda n: sens[n]["mean"] / promotion_bytes(linears[n], group), reverse=True)
    chosen = []
    for name in order:
        cost = promotion_bytes(linears[name], group)
        if used + cost <= budget_bytes:
            chosen.append(name)
            used += cost
    return chosen, used


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pit", required=True, help="a PIT checkpoint of the default model")
    ap.add_argument("--budgets", default="87.0:4:32,87.0:8:64,101.58:8:32",
                    help="comma list of MB:TABLE_BITS:GROUP (module docstring)")
    ap.add_argument("--out", default="studies/results/int4_sensitivity.json")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.pit)
    reference = load_pit_model(args.pit).eval()
    prepared = prepare(reference, "factorized").eval()
    sets = heldout_sets(tokenizer)
    start = time.perf_counter()
    sens = sensitivities(prepared, sets, 32)
    sens_seconds = time.perf_counter() - start
    blocks, source = calibration_blocks(tokenizer, reference.config, 256)
    grid = get_target("executorch").weight_grid(get_scheme("int4"), "factorized")
    rows = []
    for budget in args.budgets.split(","):
        mb, table_bits, group = float(budget.split(":")[0]), *map(int, budget.split(":")[1:])
        chosen, counted = allocate(prepared, sens, int(mb * 1e6), table_bits, group)
        names = tuple(n.removeprefix("model.") for n in chosen)
        scheme = get_scheme("int4").with_settings(int4_8bit_layers=names, table_bits=table_bits, group_size=group,
                                                  rounding="gptq")
        start = time.perf_counter()
        body = calibrated_model(prepared, scheme, grid, blocks)
        seconds = time.perf_counter() - start
        twin, _ = quantize_linears(body, "int4", group, names)
        quantize_token_table(twin, group, True, table_bits=table_bits, head_bits=table_bits, shared=True)
        row = {"budget_mb": mb, "table_bits": table_bits, "group_size": group, "int4_8bit_layers": list(names),
               "allocated_mb": counted / 1e6, "weight_mb": weight_bytes(twin, table_bits, group) / 1e6,
               "rounding_seconds": round(seconds, 1), **measure(twin.eval(), reference, sets)}
        print({k: (v if not isinstance(v, (dict, list)) else (round(v["kl_mean"], 4) if isinstance(v, dict) else len(v)))
               for k, v in row.items()}, flush=True)
        rows.append(row)
    ranked = sorted(sens, key=lambda n: sens[n]["mean"], reverse=True)
    write_result(args.out, {"calibration": source, "heldout_tokens": {k: sum(map(len, v)) for k, v in sets.items()},
                            "sensitivity_blocks_per_kind": SENSITIVITY_BLOCKS,
                            "sensitivity_seconds": round(sens_seconds, 1),
                            "sensitivity": {n: sens[n] for n in ranked}, "rows": rows}, script=__file__, argv=argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Calibrated rounding of the ``.pte``'s token table: does GPTQ of the one table that the quantized
head and the gather share close the gap a 4-bit table leaves, and where does the size/quality
frontier of the default model's int4 program sit once it does?

The shared table is the head's weight ``Y ≈ Z R`` (``V×d``), which the head multiplies by
``u = h S`` (:mod:`pit_deploy.targets.executorch.head`). Rounding it to nearest treats every direction of
``d`` alike; GPTQ (:mod:`pit_deploy.exporters.calibrated_rounding`) moves each row's rounding error
along the directions ``u`` rarely takes on real text, from ``Σ uᵀu = Sᵀ (Σ hᵀh) S`` with ``h`` the
hidden states the head reads on the calibration blocks, the body already rounded
(:func:`~pit_deploy.exporters.calibrated_rounding.head_moments`). The gather reads the same codes and
its correction matrix is computed from them, so ``W_out E = I`` still holds.

Every configuration rotates the residual stream (``rotate_residual``, ``studies/rotation_gptq.py``)
and rounds the body by GPTQ; each is run with the program's own numerics in eager mode as
``studies/gptq_frontier.py`` runs its configurations, on the three held-out kinds. ``sens:MB``
keeps at 8 bits the linears ``studies/int4_sensitivity.py`` ranks most sensitive per byte within
MB megabytes of weights (its ``sensitivity`` figures, read from ``--sensitivity``).

    python studies/table_gptq.py --pit runs/default/2-train/pit/model \\
        [--configs NAME,...] [--sensitivity studies/results/int4_sensitivity.json] \\
        [--out studies/results/table_gptq.json]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pit_deploy.exporters.residual_rotation import rotate_residual  # noqa: E402
from pit_deploy.schemes import get_scheme  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gptq_frontier import load_setup, measure_config, report_row, study_args, study_result  # noqa: E402
from int4_sensitivity import allocate  # noqa: E402
from pit_deploy.io.result_file import write_result  # noqa: E402

#: name -> (linears at 8 bits, or "sens:MB"; token table bits; the table rounded by GPTQ)
CONFIGS = {
    "all@4 t4": ((), 4, False),
    "all@4 t4 table-gptq": ((), 4, True),
    "all@4 t8 table-gptq": ((), 8, True),
    "v+down@8 t8 table-gptq": (("v_proj", "down_proj"), 8, True),
    "v+down@8 t4 table-gptq": (("v_proj", "down_proj"), 4, True),
    "sens:85.0 t4 table-gptq": ("sens:85.0", 4, True),
    "sens:101.58 t4 table-gptq": ("sens:101.58", 4, True),
}


def sensitive_linears(setup, sensitivity: str, budget_mb: float, table_bits: int) -> tuple[str, ...]:
    """The linears kept at 8 bits within ``budget_mb`` of weights, most sensitive per byte first
    (:func:`int4_sensitivity.allocate` on the ``sensitivity`` file's figures), named as
    ``int4_8bit_layers`` names them."""
    sens = json.loads(Path(sensitivity).read_text())["sensitivity"]
    chosen, _ = allocate(setup.prepared, sens, int(budget_mb * 1e6), table_bits, get_scheme("int4").group_size)
    return tuple(n.removeprefix("model.") for n in chosen)


def main(argv: list[str] | None = None) -> int:
    args = study_args(__doc__, CONFIGS, "studies/results/table_gptq.json", argv,
                      sensitivity="studies/results/int4_sensitivity.json")
    setup = load_setup(args.pit)
    rotated = rotate_residual(setup.prepared)
    rows = []
    for name in args.configs.split(","):
        eight, table_bits, table_gptq = CONFIGS[name]
        budget = None
        if isinstance(eight, str):
            budget = float(eight.split(":")[1])
            eight = sensitive_linears(setup, args.sensitivity, budget, table_bits)
        row = {"config": name, "rotation": "hadamard", "budget_mb": budget,
               **measure_config(setup, rotated, "gptq", eight, table_bits, table_gptq)}
        report_row({k: v for k, v in row.items() if k != "int4_8bit_layers"})
        rows.append(row)
    write_result(args.out, study_result(setup, rows, sensitivity=args.sensitivity), script=__file__, argv=argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

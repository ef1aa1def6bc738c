"""What the rotation of a quantized ``.pte`` head buys, measured in PyTorch eager: the KL figures of
the default model's factorized int4 program (torchao-quantized body, 8-bit token table — what
``pit-deploy export --dtype int4 --runtime executorch`` builds) with the fp32 head, and with an
8- or 4-bit head over ``Z`` (no rotation) or ``Z R`` (``--pte-head-bits``), against the fp32
model on the held-out blocks an export recorded; plus how spread the head's input is (max/rms
of ``h T R`` per token, median: a per-token int8 scale loses the more, the larger it is).

    python studies/pte_head_rotation.py --export DIR \\
        [--out studies/results/pte_head_rotation.json]

``DIR`` is an export directory of the model (its ``reference/`` and manifest's held-out blocks).
"""

from __future__ import annotations

import copy
import json
import os
import platform
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pit_deploy.exporters.passes import factorize  # noqa: E402
from pit_deploy.targets.executorch.head import RotatedQuantizedHead  # noqa: E402
from pit_deploy.targets.executorch.token_table import quantize_token_table  # noqa: E402
from pit_deploy.exporters.recipes import Recipe  # noqa: E402
from pit_deploy.targets.executorch.export import quantize_linears  # noqa: E402

from executorch_int4_schemes import export_run, kl_figures  # noqa: E402
from pit_deploy.io.result_file import write_result  # noqa: E402

VARIANTS = {"fp32 head": (0, True), "8-bit head, R = I": (8, False), "8-bit head, rotated": (8, True),
            "4-bit head, R = I": (4, False), "4-bit head, rotated": (4, True)}


@torch.no_grad()
def spread(model, ids: torch.Tensor, head: RotatedQuantizedHead) -> float:
    """Median over tokens of max|u| / rms(u) for the head's input ``u = h T R``."""
    hidden = model.model(input_ids=ids).last_hidden_state.reshape(-1, head.hidden_size)
    u = hidden @ head.TR
    return float((u.abs().amax(-1) / u.pow(2).mean(-1).sqrt()).median())


def main(argv=None) -> int:
    args, model, ids, ref = export_run(argv, __doc__, "studies/results/pte_head_rotation.json")
    export = Path(args.export)
    fp32 = factorize(model)
    recipe = Recipe()
    body, _ = quantize_linears(fp32, "int4", recipe.group_size, recipe.int4_8bit_layers)
    rows = {}
    for name, (bits, rotate) in VARIANTS.items():
        start = time.perf_counter()
        twin = copy.deepcopy(body)
        quantize_token_table(twin, recipe.group_size, True, head_bits=bits, rotate=rotate)
        row = kl_figures(twin, ids, ref)
        if bits:
            row["head_input_max_over_rms"] = spread(twin, ids[:2], twin.pit_quantized_head)
        rows[name] = {**row, "seconds": round(time.perf_counter() - start, 1)}
        print(name, json.dumps(rows[name]), flush=True)
    return write_result(args.out, {"variants": rows, "heldout_tokens": int(ids.numel()), "export": str(export),
                                   "body": "int4 (8da4w, v_proj/down_proj 8da8w), 8-bit token table",
                                   "machine": platform.platform(), "torch": torch.__version__}, __file__, argv)


if __name__ == "__main__":
    raise SystemExit(main())

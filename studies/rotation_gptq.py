"""Does a rotation of the residual stream make calibrated (GPTQ) 4-bit rounding of the ``.pte``'s
body better on the default model? Measured side by side with and without it, on three held-out
kinds.

A pre-norm RMSNorm block reads the residual stream only through its norms; once their gains are
folded into the linears that read them, an orthogonal ``Q`` is an exact symmetry of the body
(readers ``W → W Q``, writers ``W → Qᵀ W``; :func:`pit_deploy.converters.preserve.fold_and_rotate`,
the conversion's own step). The PIT interface is left alone: the embedding's ``d×d`` matrix takes
``Q`` (``T⁻¹ → T⁻¹ Q``, and the quantized gather's correction ``M → M Q``, both free at run
time), and one ``d×d`` matmul ``Qᵀ`` before the final norm returns to the interface's basis (the
final norm's gain ``D`` is not a symmetry of ``Q``). The interface identity is therefore the
unrotated program's. QuaRot (Ashkboos et al., arXiv:2404.00456) and SpinQuant (Liu et al.,
arXiv:2405.16406) report that such a rotation spreads activation outliers across channels, which
matters here because XNNPACK's ``8da4w`` quantizes each linear's input to int8 per token, and
that it pays off together with GPTQ.

``Q`` is the exporter's randomized Hadamard matrix (``H₁₂ ⊗ H₁₂ ⊗ H₄`` for d = 576, fixed random
signs; :func:`pit_deploy.exporters.residual_rotation.rotate_residual` makes the rotated model and
:func:`~pit_deploy.targets.executorch.token_table.quantize_token_table` folds ``Q`` into the gather's
correction). Each configuration runs torchao's ``8da4w``/``8da8w`` emulation in eager as
:mod:`studies.gptq_frontier` does (same calibration, held-out sets, byte counts; the ``d×d``
float32 matrix before the final norm, 1.3 MB, is not in the byte counts).

    python studies/rotation_gptq.py --pit runs/default/2-train/pit/model \\
        [--configs NAME,...] [--out studies/results/rotation_gptq.json]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pit_deploy.exporters.residual_rotation import rotate_residual  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gptq_frontier import load_setup, measure_config, report_row, study_args, study_result  # noqa: E402
from pit_deploy.io.result_file import write_result  # noqa: E402

#: name -> (linears at 8 bits, token table bits, rotated)
CONFIGS = {
    "gptq v+down@8 t8": (("v_proj", "down_proj"), 8, False),
    "rot gptq v+down@8 t8": (("v_proj", "down_proj"), 8, True),
    "gptq all@4 t8": ((), 8, False),
    "rot gptq all@4 t8": ((), 8, True),
    "rot gptq all@4 t4": ((), 4, True),
}


def main(argv: list[str] | None = None) -> int:
    args = study_args(__doc__, CONFIGS, "studies/results/rotation_gptq.json", argv)
    setup = load_setup(args.pit)
    rotated = rotate_residual(setup.prepared)
    probe = torch.tensor([setup.sets["prose"][0][:64]])
    with torch.no_grad():
        a, b = setup.prepared(input_ids=probe).logits, rotated(input_ids=probe).logits
    fp32_check = {"max_rel_logit_change": float((a - b).abs().max() / a.abs().max())}
    print("fp32 rotated vs not:", fp32_check, flush=True)
    rows = []
    for name in args.configs.split(","):
        eight, table_bits, rotate = CONFIGS[name]
        row = {"config": name, "rotation": "hadamard" if rotate else None,
               **measure_config(setup, rotated if rotate else setup.prepared, "gptq", eight, table_bits)}
        report_row(row)
        rows.append(row)
    write_result(args.out, study_result(setup, rows, fp32_rotated=fp32_check), script=__file__, argv=argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

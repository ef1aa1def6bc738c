"""Does a rotation of the residual stream make calibrated (GPTQ) 4-bit rounding of the ``.pte``'s
body better on the default model? Measured side by side with and without it, on three held-out
kinds.

A pre-norm RMSNorm block reads the residual stream only through its norms; once their gains are
folded into the linears that read them, an orthogonal ``Q`` is an exact symmetry of the body
(readers ``W → W Q``, writers ``W → Qᵀ W``; :func:`pit_deploy.convert.preserve.fold_and_rotate`,
the conversion's own step). The PIT interface is left alone: the embedding's ``d×d`` matrix takes
``Q`` (``T⁻¹ → T⁻¹ Q``, and the quantized gather's correction ``M → M Q``, both free at run
time), and one ``d×d`` matmul ``Qᵀ`` before the final norm returns to the interface's basis (the
final norm's gain ``D`` is not a symmetry of ``Q``). The interface identity is therefore the
unrotated program's. QuaRot (Ashkboos et al., arXiv:2404.00456) and SpinQuant (Liu et al.,
arXiv:2405.16406) report that such a rotation spreads activation outliers across channels, which
matters here because XNNPACK's ``8da4w`` quantizes each linear's input to int8 per token, and
that it pays off together with GPTQ.

``Q`` is the exporter's randomized Hadamard matrix (``H₁₂ ⊗ H₁₂ ⊗ H₄`` for d = 576, fixed random
signs; :func:`pit_deploy.export.residual_rotation.rotate_residual` makes the rotated model and
:func:`~pit_deploy.export.pte_token_table.quantize_token_table` folds ``Q`` into the gather's
correction). Each configuration runs torchao's ``8da4w``/``8da8w`` emulation in eager as
:mod:`studies.gptq_frontier` does (same calibration, held-out sets, byte counts; the ``d×d``
float32 matrix before the final norm, 1.3 MB, is not in the byte counts).

    python studies/rotation_gptq.py --pit runs/default/2-train/pit/model \\
        [--configs NAME,...] [--out studies/results/rotation_gptq.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pit_deploy.data.calibration import calibration_blocks, heldout_sets  # noqa: E402
from pit_deploy.export.calibrated_rounding import calibrated_model  # noqa: E402
from pit_deploy.export.passes import prepare  # noqa: E402
from pit_deploy.export.pte_token_table import quantize_token_table  # noqa: E402
from pit_deploy.export.residual_rotation import rotate_residual  # noqa: E402
from pit_deploy.export.to_executorch import quantize_linears  # noqa: E402
from pit_deploy.io.checkpoint import load_pit_model  # noqa: E402
from pit_deploy.schemes import get_scheme  # noqa: E402
from pit_deploy.targets import get_target  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the shared result writer
from gptq_frontier import measure, weight_bytes  # noqa: E402
from result_file import write_result  # noqa: E402

#: name -> (linears at 8 bits, token table bits, rotated)
CONFIGS = {
    "gptq v+down@8 t8": (("v_proj", "down_proj"), 8, False),
    "rot gptq v+down@8 t8": (("v_proj", "down_proj"), 8, True),
    "gptq all@4 t8": ((), 8, False),
    "rot gptq all@4 t8": ((), 8, True),
    "rot gptq all@4 t4": ((), 4, True),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pit", required=True, help="a PIT checkpoint of the default model")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list of configurations (default: all)")
    ap.add_argument("--out", default="studies/results/rotation_gptq.json")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.pit)
    reference = load_pit_model(args.pit).eval()
    prepared = prepare(reference, "factorized")
    rotated = rotate_residual(prepared)
    sets = heldout_sets(tokenizer)
    probe = torch.tensor([sets["prose"][0][:64]])
    with torch.no_grad():
        a, b = prepared(input_ids=probe).logits, rotated(input_ids=probe).logits
    fp32_check = {"max_rel_logit_change": float((a - b).abs().max() / a.abs().max())}
    print("fp32 rotated vs not:", fp32_check, flush=True)
    blocks, source = calibration_blocks(tokenizer, reference.config, 256)
    grid = get_target("executorch").weight_grid(get_scheme("int4"), "factorized")
    rows = []
    for name in args.configs.split(","):
        eight, table_bits, rotate = CONFIGS[name]
        scheme = get_scheme("int4").with_settings(int4_8bit_layers=eight, table_bits=table_bits, rounding="gptq")
        start = time.perf_counter()
        body = calibrated_model(rotated if rotate else prepared, scheme, grid, blocks)
        seconds = time.perf_counter() - start
        twin, _ = quantize_linears(body, "int4", scheme.group_size, eight)
        quantize_token_table(twin, scheme.group_size, True, table_bits=table_bits, head_bits=table_bits, shared=True)
        row = {"config": name, "rotation": "hadamard" if rotate else None, "int4_8bit_layers": list(eight),
               "table_bits": table_bits, "weight_mb": weight_bytes(twin, table_bits, scheme.group_size) / 1e6,
               "rounding_seconds": round(seconds, 1), **measure(twin.eval(), reference, sets)}
        print({k: (v if not isinstance(v, dict) else round(v["kl_mean"], 4)) for k, v in row.items()}, flush=True)
        rows.append(row)
    write_result(args.out, {"calibration": source, "heldout_tokens": {k: sum(map(len, v)) for k, v in sets.items()},
                            "fp32_rotated": fp32_check, "rows": rows}, script=__file__, argv=argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

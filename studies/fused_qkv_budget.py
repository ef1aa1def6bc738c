"""What the onnx-genai int4 folder would give up to run the builder's fused query/key/value node.

onnxruntime-genai's builder writes one ``MatMulNBits`` for a layer's query, key and value
projections (``fuse_qkv``) and one ``bits`` value holds for a whole node. The SmolLM2-135M
recipe keeps 56 linears at 8 bits, most of them ``v_proj`` and ``k_proj``, so its folder is
built with ``fuse_qkv=false``: three nodes a layer where the builder has one (211
``MatMulNBits`` a decode step against the builder's 151, ``benchmarks/results/genai_decode_profile.json``).

This reads the per-linear sensitivities of ``studies/int4_sensitivity.py`` (each body linear
alone at 4 bits, the mean held-out KL it adds; measured on the ``.pte``'s grid, so a ranking, not
the onnx-genai folder's KL) and compares, at the same bytes:

* the recipe's choice (``pit_deploy/recipes/smollm2-135m.toml``);
* the best choice that keeps query, key and value at 4 bits in every layer (so the builder can
  fuse them): the output, gate, up and down projections by sensitivity per byte;
* how many layers have none of their query, key and value at 8 bits (the layers a per-layer
  fusion could merge).

    python studies/fused_qkv_budget.py [--recipe smollm2-135m] [--out studies/results/fused_qkv_budget.json]

The byte costs are onnx-genai's blocks of 64 with a float32 scale and a zero point a block.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pit_deploy.exporters.recipes import find_recipe, load_recipe
from pit_deploy.io.result_file import write_result

ROOT = Path(__file__).resolve().parents[1]
#: the default model's shapes (SmolLM2-135M: hidden 576, 3 key/value heads of 64, MLP 1536)
SHAPES = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
          "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}
QKV = ("q_proj", "k_proj", "v_proj")
BLOCK = 64


def node_bytes(kind: str, bits: int) -> float:
    """A ``MatMulNBits`` node's bytes: the codes, a float32 scale and a zero point a block."""
    k, n = SHAPES[kind]
    blocks = n * (k // BLOCK)
    return n * k * bits / 8 + blocks * (4 + (1 if bits == 8 else 0.5))


def extra_bytes(name: str) -> float:
    """What keeping the linear ``name`` at 8 bits costs over 4."""
    kind = name.rsplit(".", 1)[-1]
    return node_bytes(kind, 8) - node_bytes(kind, 4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sensitivity", default=str(ROOT / "studies/results/int4_sensitivity.json"))
    parser.add_argument("--recipe", default="smollm2-135m", help="an export recipe's name")
    parser.add_argument("--out", default=str(ROOT / "studies/results/fused_qkv_budget.json"))
    args = parser.parse_args(argv)

    sens = {name.removeprefix("model."): v["mean"]
            for name, v in json.loads(Path(args.sensitivity).read_text())["sensitivity"].items()}
    chosen = list(load_recipe(args.recipe).int4_8bit_layers)
    budget = sum(extra_bytes(n) for n in chosen)

    fusable = sorted((n for n in sens if n.rsplit(".", 1)[-1] not in QKV), key=lambda n: -sens[n] / extra_bytes(n))
    fused, spent = [], 0.0
    for name in fusable:
        if spent + extra_bytes(name) <= budget:
            fused.append(name)
            spent += extra_bytes(name)

    layers = sorted({int(n.split(".")[1]) for n in sens})
    qkv_8bit = {int(n.split(".")[1]) for n in chosen if n.rsplit(".", 1)[-1] in QKV}

    def summary(names: list[str]) -> dict:
        return {"linears_at_8_bits": len(names), "extra_mb": round(sum(extra_bytes(n) for n in names) / 1e6, 3),
                "summed_sensitivity": round(sum(sens[n] for n in names), 4),
                "qkv_linears_at_8_bits": sum(n.rsplit(".", 1)[-1] in QKV for n in names)}

    result = {
        "what": "the recipe's 8-bit linears against the best choice that keeps q/k/v at 4 bits (fusable), "
                "at the same bytes; summed sensitivity = the held-out KL the 8-bit linears take away, summed",
        "sensitivity_source": str(Path(args.sensitivity).relative_to(ROOT)),
        "recipe": str(find_recipe(args.recipe).resolve().relative_to(ROOT)),
        "all_linears_summed_sensitivity": round(sum(sens.values()), 4),
        "recipe_choice": summary(chosen),
        "fused_qkv_choice": {**summary(fused), "names": fused},
        "layers": len(layers),
        "layers_with_a_qkv_linear_at_8_bits": len(qkv_8bit),
        "layers_a_per_layer_fusion_could_merge": len(layers) - len(qkv_8bit),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "fused_qkv_choice"}, indent=1))
    print("fused-qkv choice:", summary(fused))
    return write_result(args.out, result, __file__, argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())

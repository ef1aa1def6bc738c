"""Which int4 scheme the ExecuTorch exporter uses, measured: the KL figures of torchao-quantized
twins of a PIT model against the fp32 model (PyTorch eager, the held-out blocks an export
recorded), and whether XNNPACK computes symmetric and asymmetric int4 weights correctly.

    python studies/executorch_int4_schemes.py --export DIR \\
        [--out studies/results/executorch_int4_schemes.json]

``DIR`` is an export directory of the model (``pit-deploy export default --out DIR ...``): its
``reference/`` checkpoint and its manifest's held-out blocks are used. Variants: symmetric
min/max scales (``sym``), HQQ scale-only scales (``hqq``), asymmetric (``asym``, which XNNPACK
cannot run), and HQQ with ``down_proj`` / ``v_proj`` + ``down_proj`` kept at 8 bits (what
``int4_8bit_layers`` selects; the exporter's default is the last).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn as nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_  # noqa: E402
from torchao.quantization.granularity import PerAxis, PerGroup  # noqa: E402
from torchao.quantization.quant_primitives import MappingType  # noqa: E402
from torchao.quantization.quantize_.workflows import IntxChooseQParamsAlgorithm  # noqa: E402

from pit_deploy.io.checkpoint import load_pit_model  # noqa: E402

from pit_deploy.io.result_file import write_result  # noqa: E402

HQQ = IntxChooseQParamsAlgorithm.HQQ_SCALE_ONLY
VARIANTS = {
    "sym": ({"weight_mapping_type": MappingType.SYMMETRIC}, ()),
    "asym": ({"weight_mapping_type": MappingType.ASYMMETRIC}, ()),
    "hqq": ({"intx_choose_qparams_algorithm": HQQ}, ()),
    "hqq+down_proj@8": ({"intx_choose_qparams_algorithm": HQQ}, ("down_proj",)),
    "hqq+v_proj,down_proj@8": ({"intx_choose_qparams_algorithm": HQQ}, ("v_proj", "down_proj")),
}


def quantized_twin(model: nn.Module, int4_kwargs: dict, keep_8bit: tuple[str, ...], group: int = 32) -> nn.Module:
    twin = copy.deepcopy(model)
    is_kept = lambda m, fqn: isinstance(m, nn.Linear) and fqn.rsplit(".", 1)[-1] in keep_8bit  # noqa: E731
    quantize_(twin, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)),
              filter_fn=is_kept)
    quantize_(twin, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group),
                                                          **int4_kwargs),
              filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and not is_kept(m, fqn))
    return twin


@torch.no_grad()
def reference_and_heldout(export: Path) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """An export directory's fp32 reference model, its held-out blocks ``(B, L)`` and the
    reference's log-probabilities on them (float64)."""
    model = load_pit_model(export / "reference").eval()
    ids = torch.tensor(json.loads((export / "manifest.json").read_text())["heldout"]["blocks"])
    return model, ids, torch.log_softmax(model(input_ids=ids).logits.double(), -1)


@torch.no_grad()
def kl_figures(model: nn.Module, ids: torch.Tensor, ref: torch.Tensor) -> dict:
    q = torch.log_softmax(model(input_ids=ids).logits.double(), -1)
    kl = (ref.exp() * (ref - q)).sum(-1).flatten()
    targets = ids[:, 1:, None]
    nll_ref, nll_q = -ref[:, :-1].gather(-1, targets).mean(), -q[:, :-1].gather(-1, targets).mean()
    return {"kl_mean": float(kl.mean()), "kl_p99": float(kl.quantile(0.99)),
            "same_top1": float((q.argmax(-1) == ref.argmax(-1)).double().mean()),
            "ppl_ratio": float((nll_q - nll_ref).exp())}


def xnnpack_error(int4_kwargs: dict) -> float:
    """Relative L2 distance between the lowered `.pte` and the eager torchao model on a
    two-layer MLP: what XNNPACK makes of the scheme."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64)).eval()
    x = torch.randn(2, 64)
    quantize_(mlp, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32),
                                                         **int4_kwargs))
    eager = mlp(x)
    program = to_edge_transform_and_lower(torch.export.export(mlp, (x,)), partitioner=[XnnpackPartitioner()],
                                          compile_config=EdgeCompileConfig(_check_ir_validity=False)).to_executorch()
    got = _load_for_executorch_from_buffer(program.buffer).forward((x,))[0]
    return float((got - eager).norm() / eager.norm())


def export_run(argv, doc: str, default_out: str):
    """The command line of an eager benchmark over an export directory: ``--export DIR --out
    JSON``. Returns ``(args, reference model, held-out ids, reference log-probabilities)``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--export", required=True, help="an export directory (reference/ + manifest.json)")
    parser.add_argument("--out", default=default_out)
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    return (args, *reference_and_heldout(Path(args.export)))


def main(argv=None) -> int:
    args, model, ids, ref = export_run(argv, __doc__, "studies/results/executorch_int4_schemes.json")
    export = Path(args.export)
    rows = {}
    for name, (int4_kwargs, keep) in VARIANTS.items():
        start = time.perf_counter()
        rows[name] = {**kl_figures(quantized_twin(model, int4_kwargs, keep), ids, ref),
                      "int8_layers": list(keep), "seconds": round(time.perf_counter() - start, 1)}
        print(name, json.dumps(rows[name]), flush=True)
    lowering = {name: xnnpack_error(VARIANTS[name][0]) for name in ("sym", "hqq", "asym")}
    print("pte vs eager (relative L2):", json.dumps(lowering), flush=True)
    result = {"variants": rows, "pte_vs_eager_rel_l2": lowering, "heldout_tokens": int(ids.numel()),
              "export": str(export), "machine": platform.platform(), "torch": torch.__version__}
    return write_result(args.out, result, __file__, argv)


if __name__ == "__main__":
    raise SystemExit(main())

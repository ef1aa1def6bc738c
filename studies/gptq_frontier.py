"""Calibrated (GPTQ) against plain rounding on the default model: the size/quality frontier of the
``.pte``'s int4 configurations, measured on three held-out kinds.

Each configuration is the ExecuTorch program's own numerics run in PyTorch eager: the body
linears through torchao's ``8da4w``/``8da8w`` tensors (int8 dynamic activations, as XNNPACK
computes them) holding either torchao's own HQQ rounding (``rtn``, what ``--rounding rtn``
exports) or the GPTQ codes (``gptq``, :mod:`pit_deploy.exporters.calibrated_rounding`), and the
token table the exporter builds (:func:`pit_deploy.targets.executorch.token_table.quantize_token_table`:
one shared 8- or 4-bit table for the gather and the head). Figures against the fp32 PIT model,
per held-out kind (:func:`pit_deploy.data.calibration.heldout_sets`: code from the corpus's
validation split, prose and chat shipped with the package; the calibration reads the training
split and chat prompts only). Sizes are the ``.pte`` + ``.ptd`` bytes the configuration's
weights take, counted from the tensors (codes, scales as XNNPACK and the gather store them).

    python studies/gptq_frontier.py --pit runs/default/2-train/pit/model \\
        [--configs NAME,...] [--out studies/results/gptq_frontier.json]
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pit_deploy.data.calibration import calibration_blocks, heldout_sets  # noqa: E402
from pit_deploy.data.heldout import kl_parity  # noqa: E402
from pit_deploy.exporters.calibrated_rounding import calibrated_model, head_moments  # noqa: E402
from pit_deploy.exporters.passes import prepare  # noqa: E402
from pit_deploy.targets.executorch.token_table import quantize_token_table  # noqa: E402
from pit_deploy.targets.executorch.export import quantize_linears  # noqa: E402
from pit_deploy.io.checkpoint import load_pit_model  # noqa: E402
from pit_deploy.runtime.torch_driver import TorchDriver  # noqa: E402
from pit_deploy.schemes import get_scheme  # noqa: E402
from pit_deploy.targets import get_target  # noqa: E402

from pit_deploy.io.result_file import write_result  # noqa: E402

#: name -> (rounding, linears at 8 bits, token table bits)
CONFIGS = {
    "rtn v+down@8 t8": ("rtn", ("v_proj", "down_proj"), 8),
    "gptq v+down@8 t8": ("gptq", ("v_proj", "down_proj"), 8),
    "gptq down@8 t8": ("gptq", ("down_proj",), 8),
    "gptq all@4 t8": ("gptq", (), 8),
    "rtn v+down@8 t4": ("rtn", ("v_proj", "down_proj"), 4),
    "gptq v+down@8 t4": ("gptq", ("v_proj", "down_proj"), 4),
    "gptq down@8 t4": ("gptq", ("down_proj",), 4),
    "gptq all@4 t4": ("gptq", (), 4),
}


def linear_bytes(rows: int, cols: int, bits: int, group: int) -> int:
    """Bytes of one quantized linear in the program: at 4 bits ``½`` byte a weight + a bfloat16
    scale a group (``8da4w``), at 8 bits a byte + a float32 scale a row (``8da8w``)."""
    return rows * cols // 2 + rows * (cols // group) * 2 if bits == 4 else rows * cols + rows * 4


def gather_scale_bytes(vocab: int, dim: int, table_bits: int, group: int) -> int:
    """The gather's own float32 scales of the shared table: a row's at 8 bits, a group's at 4."""
    return vocab * (dim // group) * 4 if table_bits == 4 else vocab * 4


def weight_bytes(model: nn.Module, table_bits: int, group: int) -> int:
    """Bytes of the program's weights: every quantized linear (the head, over the shared table,
    among them) and the gather's scales of that table."""
    total = 0
    for _name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or not hasattr(weight, "qdata"):
            continue
        rows, cols = weight.qdata.shape
        total += linear_bytes(rows, cols, 4 if weight.scale.shape[1] > 1 else 8, group)
    return total + gather_scale_bytes(model.config.vocab_size, model.config.hidden_size, table_bits, group)


def measure(model: nn.Module, reference: nn.Module, sets: dict[str, list[list[int]]]) -> dict:
    out = {}
    for kind, blocks in sets.items():
        f = kl_parity(TorchDriver(model=model), reference, blocks)
        out[kind] = {"kl_mean": f.kl_mean, "kl_p99": f.kl_p99, "same_top1": f.same_top1, "ppl_ratio": f.ppl_ratio,
                     "tokens": f.tokens}
    return out


@dataclass
class Setup:
    """What every configuration of these studies is measured with."""

    reference: nn.Module  # the fp32 PIT model the KL is taken against
    prepared: nn.Module  # its factorized export form, which configurations round
    sets: dict[str, list[list[int]]]  # held-out blocks by kind
    blocks: list[torch.Tensor]  # calibration blocks
    source: str  # what the calibration text is
    grid: object  # the .pte target's weight grid


def load_setup(pit: str) -> Setup:
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(pit)
    reference = load_pit_model(pit).eval()
    blocks, source = calibration_blocks(tokenizer, reference.config, 256)
    return Setup(reference, prepare(reference, "factorized"), heldout_sets(tokenizer), blocks, source,
                 get_target("executorch").weight_grid(get_scheme("int4"), "factorized"))


def measure_config(setup: Setup, body: nn.Module, rounding: str, eight: tuple[str, ...], table_bits: int,
                   table_gptq: bool = False, stages: dict | None = None) -> dict:
    """Round ``body`` (the prepared model, or one derived from it) as the ``.pte`` does and
    measure it: the figures of one row. ``table_gptq``: the shared token table rounded by GPTQ
    against the head input's moments on the calibration text, as the exporter now does for a
    GPTQ body (:func:`pit_deploy.exporters.calibrated_rounding.head_moments`); else to nearest.
    ``stages``: also measured, by held-out kind, into it on the way: the rounded body alone
    (float activations, float table) and with the int8 dynamic activations."""
    scheme = get_scheme("int4").with_settings(int4_8bit_layers=eight, table_bits=table_bits, rounding=rounding)
    start = time.perf_counter()
    rounded = calibrated_model(body, scheme, setup.grid, setup.blocks) if rounding == "gptq" else body
    moments = head_moments(rounded) if table_gptq else None
    seconds = time.perf_counter() - start
    if stages is not None:
        stages["body weights"] = measure(rounded.eval(), setup.reference, setup.sets)
    twin, _ = quantize_linears(rounded, "int4", scheme.group_size, eight)
    if stages is not None:
        stages["+ int8 activations"] = measure(twin.eval(), setup.reference, setup.sets)
    quantize_token_table(twin, scheme.group_size, True, table_bits=table_bits, head_bits=table_bits, shared=True,
                         head_moments=moments)
    return {"int4_8bit_layers": list(eight), "table_bits": table_bits, "table_rounding": "gptq" if table_gptq else "rtn",
            "weight_mb": weight_bytes(twin, table_bits, scheme.group_size) / 1e6,
            "rounding_seconds": round(seconds, 1), **measure(twin.eval(), setup.reference, setup.sets)}


def report_row(row: dict) -> None:
    print({k: (v if not isinstance(v, dict) else round(v["kl_mean"], 4)) for k, v in row.items()}, flush=True)


def study_result(setup: Setup, rows: list[dict], **extra) -> dict:
    """What these studies write: the calibration text, the held-out token counts, ``extra``, the rows."""
    return {"calibration": setup.source, "heldout_tokens": {k: sum(map(len, v)) for k, v in setup.sets.items()},
            **extra, "rows": rows}


def study_args(doc: str, configs: dict, out: str, argv: list[str] | None, **paths: str) -> argparse.Namespace:
    """``--pit``, ``--configs`` (of ``configs``), ``--out`` (default ``out``), and a ``--NAME``
    option for each of ``paths`` (an input file, its default the value)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--pit", required=True, help="a PIT checkpoint of the default model")
    ap.add_argument("--configs", default=",".join(configs), help="comma list of configurations (default: all)")
    ap.add_argument("--out", default=out)
    for name, default in paths.items():
        ap.add_argument(f"--{name}", default=default)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = study_args(__doc__, CONFIGS, "studies/results/gptq_frontier.json", argv)
    setup = load_setup(args.pit)
    rows = []
    for name in args.configs.split(","):
        rounding, eight, table_bits = CONFIGS[name]
        row = {"config": name, "rounding": rounding, **measure_config(setup, setup.prepared, rounding, eight, table_bits)}
        report_row(row)
        rows.append(row)
    write_result(args.out, study_result(setup, rows), script=__file__, argv=argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

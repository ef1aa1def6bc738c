"""Can training keep the body on the source's 4-bit grid and still learn? Scales and minima of the
Q4_1 blocks trained, the codes fixed.

``studies/source_grid.py`` found that a body frozen by ``--interface-only`` rounds without loss
but gives up what training teaches (validation 2.3935 against 2.3382 after the default run's 20
steps), and a body trained in full is off the grid for good. In between: the body's codes stay,
each block's ``d`` and ``m`` learn (PEQA, Kim et al., 2023, arXiv:2305.14152, trains only the
scales of a quantized model), with the interface and the final norm, the block norms frozen. The
body is then on a grid by construction, its own.

The run repeats the default run's training (its 20 steps, 4 × 256 tokens a step, AdamW at 1e-5 with
4 warm-up steps and cosine decay, clipping at 1, no weight decay) from the default run's converted
checkpoint, each body linear computed in the source's basis (:class:`GridTrained`: ``W = d·q +
m`` from the codes, the maps of :class:`source_grid.SourceBasis` on either side). It reports the
validation loss before and after, and then measures the trained model as
``studies/source_grid.py`` measures a program: the body on its grid, int8 activations, 8-bit
offsets, block smoothing and the 4-bit token table by GPTQ, mean KL against the trained fp32
model and absolute NLL on the held-out kinds.

    python studies/grid_scale_training.py --convert runs/default/1-convert/model \\
        [--steps 20] [--out studies/results/grid_scale_training.json]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pit_deploy.data.calibration import calibration_blocks, heldout_sets  # noqa: E402
from pit_deploy.data.corpus import TextSource, TrainStream, validation_blocks  # noqa: E402
from pit_deploy.io.checkpoint import load_pit_model  # noqa: E402
from pit_deploy.io.sources import load_source  # noqa: E402
from pit_deploy.model.families import adapter_for  # noqa: E402
from pit_deploy.model.inspect import find_interface  # noqa: E402
from pit_deploy.training.config import TrainConfig, with_start_defaults  # noqa: E402
from pit_deploy.training.evaluation import block_nll  # noqa: E402
from pit_deploy.training.loop import cosine_lr  # noqa: E402
from pit_deploy.training.loss import token_loss  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import source_grid  # noqa: E402
from source_grid import BLOCK, LINEARS, SourceBasis, codes_on, grid_of, source_rotation  # noqa: E402
from pit_deploy.io.result_file import write_result  # noqa: E402


class GridTrained(nn.Module):
    """A body linear as ``d·q + m`` in the source's basis: codes fixed, ``d`` and ``m`` learned."""

    def __init__(self, basis: SourceBasis, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
        super().__init__()
        self.basis = basis
        self.register_buffer("codes", codes.float(), persistent=False)
        self.d = nn.Parameter(d.float().reshape(codes.shape[0], -1))
        self.m = nn.Parameter(m.float().reshape(codes.shape[0], -1))

    def weight_source(self) -> torch.Tensor:
        rows, cols = self.codes.shape
        q = self.codes.reshape(rows, -1, BLOCK)
        return (q * self.d[..., None] + self.m[..., None]).reshape(rows, cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.basis.around(x, lambda u: u @ self.weight_source().T)


@torch.no_grad()
def on_grid(model: nn.Module, source: nn.Module) -> nn.Module:
    """``model`` with each body linear a :class:`GridTrained` from the source's codes and grid."""
    r = source_rotation(model, source)
    for i in range(len(source.model.layers)):
        for lin in LINEARS:
            name = f"model.layers.{i}.{lin}"
            w_src = source.get_submodule(name).weight.double()
            d, m = grid_of(w_src)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr,
                    GridTrained(SourceBasis(model, source, r, i, lin), codes_on(w_src, d, m), d, m))
    return model


def train(model: nn.Module, tokenizer, steps: int) -> dict:
    """The default run's training (module docstring) of the grid scales, interface and final norm."""
    cfg = with_start_defaults(TrainConfig(out="unused", model="unused", data="default", steps=steps, seq_len=256,
                                          batch_size=4, lr=1e-5, warmup_steps=4, weight_decay=0.0, eval_blocks=8))
    data = cfg.data_config_obj()
    corpus = TextSource(data)
    stream = TrainStream(corpus, tokenizer, data)
    val = validation_blocks(corpus, tokenizer, data, cfg.eval_blocks)
    for p in model.parameters():
        p.requires_grad_(False)
    trained = [p for m in model.modules() if isinstance(m, GridTrained) for p in (m.d, m.m)]
    trained += [p for p in find_interface(model).parameters() if p is not find_interface(model).Z]
    trained += list(adapter_for(model.config).final_norm(model).parameters())
    for p in trained:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(trained, lr=cfg.lr, betas=cfg.betas, weight_decay=0.0)
    model.eval()  # no dropout in this family; eval keeps the forward as the exporter's
    start_val = block_nll(model, val, cfg.batch_size)
    start = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, cfg, steps)
        batch = stream.next_batch(cfg.batch_size)
        loss = token_loss(model(input_ids=batch.inputs, use_cache=False).logits, batch.ids[:, 1:], batch.mask[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, cfg.grad_clip)
        opt.step()
        print(f"step {step + 1} loss {float(loss.detach()):.4f}", flush=True)
    with torch.no_grad():
        end_val = block_nll(model, val, cfg.batch_size)
    return {"steps": steps, "validation_loss_start": start_val, "validation_loss_end": end_val,
            "train_seconds": round(time.perf_counter() - start, 1)}


@torch.no_grad()
def as_plain(model: nn.Module) -> nn.Module:
    """The trained model with plain ``nn.Linear`` body weights (in its own basis), what
    :func:`source_grid.grid_model` takes as the checkpoint and ``source`` (in the source's basis,
    with the trained ``d``, ``m``) as the grid it rounds to."""
    plain = copy.deepcopy(model)
    for name, mod in list(plain.named_modules()):
        if isinstance(mod, GridTrained):
            w = mod.basis.weight_from_source(mod.weight_source().double())
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight.copy_(w.float())
            parent, _, attr = name.rpartition(".")
            setattr(plain.get_submodule(parent), attr, lin)
    return plain


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--convert", required=True, help="the default run's converted checkpoint (1-convert/model)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="studies/results/grid_scale_training.json")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.convert)
    source = load_source("default", with_tokenizer=False).model.eval()
    model = on_grid(load_pit_model(args.convert), source)
    training = train(model, tokenizer, args.steps)
    print(training, flush=True)
    trained = as_plain(model).eval()
    # the trained grid as a "source" whose weights are exactly on it, so grid_model keeps its codes
    grid_source = _grid_source(model, source)
    sets = heldout_sets(tokenizer)
    rows = source_grid.measure_rows("grid scales trained", trained, grid_source, tokenizer, sets, variants=True)
    return write_result(args.out, {"training": training, "heldout_tokens": {k: sum(map(len, v)) for k, v in sets.items()},
                                   "rows": rows}, script=__file__, argv=argv)


@torch.no_grad()
def _grid_source(model: nn.Module, source: nn.Module) -> nn.Module:
    """A copy of ``source`` whose body weights are the trained ``d·q + m`` (its source-basis weights)."""
    twin = copy.deepcopy(source)
    for name, mod in model.named_modules():
        if isinstance(mod, GridTrained):
            twin.get_submodule(name).weight.copy_(mod.weight_source())
    return twin


if __name__ == "__main__":
    raise SystemExit(main())

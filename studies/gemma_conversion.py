"""What converting a real Gemma 3 (or Gemma 2) to PIT keeps, measured: held-out KL from the
source and the change of held-out NLL on code, prose and chat text, for

* ``preserve`` as ``pit-deploy convert`` runs it for these families: the body and the embedding
  kept as they are (``Z = U``, ``T = H⁻¹``), the final gain fitted as a diagonal;
* ``rotated``: the pre-norm families' conversion forced onto the post-normalized blocks —
  fold the pre-norm gains, rotate the residual stream by the fitted ``R``, give each post-norm
  the diagonal of ``Rᵀ diag(g) R`` (the best a diagonal gain can do after the rotation without
  knowing its inputs) — to show what the missing symmetry costs;
* ``output``: the paper's output-side init, for reference;

with each conversion's wall time and the process's peak memory.

    python studies/gemma_conversion.py --model DIR [--calib-tokens 4096]
        [--out studies/results/gemma_conversion.json]

``DIR`` is a Hugging Face folder of a Gemma 2/3 text model with its tokenizer (for example
``google/gemma-3-270m``). The held-out blocks are :func:`pit_deploy.data.calibration.heldout_sets`'
first four of each kind, each led by the tokenizer's BOS token as Gemma expects (without it a
Gemma model's loss is far higher at every position). The chat blocks go through the tokenizer's
chat template.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pit_deploy.converters import convert_model  # noqa: E402
from pit_deploy.converters.preserve import PRESERVE_FAMILIES, calibration_set, calibration_stats, fit_symmetric_grouped  # noqa: E402
from pit_deploy.data.calibration import heldout_sets  # noqa: E402
from pit_deploy.io.result_file import write_result  # noqa: E402
from pit_deploy.io.sources import load_source  # noqa: E402
from pit_deploy.model.core import polar_factor, spd_and_inverse  # noqa: E402
from pit_deploy.model.inspect import effective_interface, interface_delta_ti  # noqa: E402

#: the norm before each block half and the linears reading it; the norm after it and its writer
PRE_NORMS = {"input_layernorm": ("self_attn", ("q_proj", "k_proj", "v_proj")),
             "pre_feedforward_layernorm": ("mlp", ("gate_proj", "up_proj"))}
POST_NORMS = {"post_attention_layernorm": ("self_attn", "o_proj"), "post_feedforward_layernorm": ("mlp", "down_proj")}


def blocks(tokenizer, per_kind: int = 4, length: int = 256) -> dict[str, list[list[int]]]:
    bos = tokenizer.bos_token_id
    sets = heldout_sets(tokenizer, length - 1)
    return {kind: [[bos] + (b[1:] if b and b[0] == bos else b) for b in rows[:per_kind]] for kind, rows in sets.items()}


@torch.no_grad()
def logprobs(model, sets) -> dict[str, list[torch.Tensor]]:
    return {kind: [torch.log_softmax(model(input_ids=torch.tensor([b])).logits[0, :-1].double(), -1) for b in rows]
            for kind, rows in sets.items()}


def scores(ref: dict, got: dict, sets: dict) -> dict[str, dict[str, float]]:
    out = {}
    for kind, rows in sets.items():
        kl = nll = nll_ref = n = 0.0
        for b, lp_ref, lp in zip(rows, ref[kind], got[kind]):
            y = torch.tensor(b[1:])[:, None]
            kl += float((lp_ref.exp() * (lp_ref - lp)).sum())
            nll += float(-lp.gather(1, y).sum())
            nll_ref += float(-lp_ref.gather(1, y).sum())
            n += len(b) - 1
        out[kind] = {"kl": kl / n, "source_nll": nll_ref / n, "nll_change": (nll - nll_ref) / n, "tokens": int(n)}
    return out


@torch.no_grad()
def rotated(model, tokenizer, calib_tokens: int):
    """The pre-norm conversion forced onto post-normalized blocks (see the module docstring)."""
    from pit_deploy.model.pit_model import install_interface, pit_config_block
    from pit_deploy.model.core import PITInterface, PITSpec
    from pit_deploy.model.families import adapter_for

    offset = PRESERVE_FAMILIES[model.config.model_type]
    e_eff, w_eff, _ = effective_interface(model)
    u, h = (t.to(torch.float64) for t in polar_factor(e_eff))
    h_sym, h_inv = spd_and_inverse(h)
    norm = model.model.norm
    a = (norm.weight.double() + offset)[:, None] * (w_eff @ u @ h_sym)
    rows = calibration_set(model, tokenizer, "default", calib_tokens, 256, chat=False)
    stats = calibration_stats(model, rows, u)
    g = fit_symmetric_grouped(a, [(s.weight, s.second_moment, h_inv @ s.fisher @ h_inv) for s in stats.groups])
    d_vals, r = torch.linalg.eigh(g)
    for layer in model.model.layers:
        for norm_name, (parent, names) in PRE_NORMS.items():
            pre = getattr(layer, norm_name)
            gain = pre.weight.double() + offset
            for name in names:
                lin = getattr(getattr(layer, parent), name)
                lin.weight.copy_((lin.weight.double() * gain[None, :] @ r).float())
            pre.weight.fill_(1.0 - offset)
        for norm_name, (parent, name) in POST_NORMS.items():
            lin = getattr(getattr(layer, parent), name)
            lin.weight.copy_((r.T @ lin.weight.double()).float())
            post = getattr(layer, norm_name)
            gain = post.weight.double() + offset
            post.weight.copy_((torch.diagonal(r.T @ torch.diag(gain) @ r) - offset).float())
    norm.weight.copy_((d_vals - offset).float())
    t = r.T @ h_inv @ r
    interface = PITInterface((u @ r).float(), torch.linalg.cholesky(0.5 * (t + t.T)), PITSpec())
    adapter = adapter_for(model.config)
    install_interface(model, interface, adapter, pit_config_block(PITSpec(), t_init="preserve", init="polar-rotated",
                                                                  source_tying="tied", source=None, adapter=adapter))
    return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a Hugging Face folder of a Gemma 2/3 text model")
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--out", default="studies/results/gemma_conversion.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    src = load_source(args.model)
    tok = src.tokenizer
    sets = blocks(tok)
    ref = logprobs(src.model, sets)
    config = src.model.config
    results: dict = {"model": {"model_type": config.model_type, "vocab_size": config.vocab_size,
                               "hidden_size": config.hidden_size, "layers": config.num_hidden_layers,
                               "parameters": sum(p.numel() for p in src.model.parameters())},
                     "conversions": {}}
    del src
    for name in ("preserve", "rotated", "output"):
        loaded = load_source(args.model)
        start = time.perf_counter()
        if name == "rotated":
            model = rotated(loaded.model, tok, args.calib_tokens)
        else:
            model = convert_model(loaded.model, name, source=loaded.source, tokenizer=tok, calib_tokens=args.calib_tokens)
        row = {"wall_s": time.perf_counter() - start, "delta_ti": interface_delta_ti(model),
               "scores": scores(ref, logprobs(model, sets), sets)}
        if name == "preserve":
            row["fit"] = model.config.pit["preserve"]
        results["conversions"][name] = row
        print(name, json.dumps(row["scores"]), flush=True)
        del model, loaded
    results["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    results["setup"] = {"calib_tokens": args.calib_tokens, "machine": platform.platform(), "cpu_count": os.cpu_count(),
                        "torch": torch.__version__}
    return write_result(args.out, results, __file__, argv)


if __name__ == "__main__":
    raise SystemExit(main())

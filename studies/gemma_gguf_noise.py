"""How much a GGUF file's rounding moves a Gemma 3 model's predictions, for the source model and
for its ``preserve`` PIT conversion: held-out KL from PyTorch of

* the ``q8_0`` (and any other ``--dtype``) GGUF file as ``pit-deploy export --runtime gguf``
  writes it, run in llama.cpp (llama-cpp-python);
* PyTorch with every body linear's weight rounded as Q8_0 rounds it (blocks of 32, a float16
  scale, round to nearest) — the weights alone;
* the same plus each body linear's *input* rounded to Q8_0 blocks, as llama.cpp's Q8_0 matmul
  does to its activations.

The body and the embedding of the ``preserve`` conversion are the source's own, so the same
rounding reaches the same final hidden states; what differs is the head that reads them.

    python studies/gemma_gguf_noise.py --model DIR [--dtype q8_0,q4_k_m]
        [--out studies/results/gemma_gguf_noise.json]

``DIR``: a Hugging Face folder of a Gemma 3 text model with its tokenizer. The held-out blocks are
those of ``studies/gemma_conversion.py`` (code, prose, chat; ``--blocks`` blocks of 256 tokens each).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemma_conversion import blocks, logprobs, scores  # noqa: E402

from pit_deploy.converters import convert_model  # noqa: E402
from pit_deploy.exporters.passes import materialize  # noqa: E402
from pit_deploy.io.result_file import write_result  # noqa: E402
from pit_deploy.io.sources import load_source  # noqa: E402
from pit_deploy.schemes import get_scheme  # noqa: E402
from pit_deploy.targets.gguf.decoder import LlamaCppDecoder  # noqa: E402
from pit_deploy.targets.gguf.export import FILE_NAMES, export_gguf  # noqa: E402

#: Q8_0's block of values sharing one scale
BLOCK = 32


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded as Q8_0 rounds a row: per block of 32, scale ``max|x| / 127`` stored in
    float16, values rounded to the nearest multiple."""
    rows = x.reshape(-1, BLOCK)
    scale = (rows.abs().amax(-1, keepdim=True) / 127).half().float()
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (torch.round(rows / safe) * scale).reshape(x.shape)


def body_linears(model) -> list[torch.nn.Linear]:
    return [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]


@torch.no_grad()
def emulated(model, sets, activations: bool) -> dict:
    """Held-out log-probabilities with the body's weights (and, with ``activations``, the
    linears' inputs) rounded to Q8_0; the model is restored afterwards."""
    linears = body_linears(model)
    kept = [m.weight.data for m in linears]
    hooks = []
    try:
        for m in linears:
            m.weight.data = q8_0(m.weight.data)
            if activations:
                hooks.append(m.register_forward_pre_hook(lambda _m, inputs: (q8_0(inputs[0]),)))
        return logprobs(model, sets)
    finally:
        for m, w in zip(linears, kept):
            m.weight.data = w
        for h in hooks:
            h.remove()


def on_llama_cpp(model, tokenizer, sets, dtype: str, work: Path) -> dict:
    """Held-out log-probabilities of ``model``'s GGUF file of ``dtype`` in llama.cpp."""
    folder = work / dtype
    export_gguf(model, folder, tokenizer, get_scheme(dtype))
    decoder = LlamaCppDecoder(folder / FILE_NAMES[dtype], threads=os.cpu_count() or 1)
    try:
        return {kind: [torch.log_softmax(torch.from_numpy(decoder.prefill(b))[:-1].double(), -1) for b in rows]
                for kind, rows in sets.items()}
    finally:
        decoder.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a Hugging Face folder of a Gemma 3 text model")
    ap.add_argument("--dtype", default="q8_0", help="comma list of GGUF schemes (f16, q8_0, q4_0, q4_k_m)")
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--blocks", type=int, default=2, help="held-out blocks per kind (each set of log-probabilities "
                    "holds blocks × 255 × V float64s: 3.2 GB at 2 per kind and Gemma 3's vocabulary)")
    ap.add_argument("--out", default="studies/results/gemma_gguf_noise.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    source = load_source(args.model)
    tok = source.tokenizer
    sets = blocks(tok, per_kind=args.blocks)
    pit = materialize(convert_model(load_source(args.model).model, "preserve", source=source.source, tokenizer=tok,
                                    calib_tokens=args.calib_tokens))
    results: dict = {"model": {"model_type": source.model.config.model_type, "vocab_size": source.model.config.vocab_size},
                     "rows": {}}
    with tempfile.TemporaryDirectory(prefix="gemma-gguf-") as tmp:
        for name, model in (("source", source.model.eval()), ("pit_preserve", pit.eval())):
            ref = logprobs(model, sets)
            row = {"pytorch_q8_0_weights": scores(ref, emulated(model, sets, False), sets),
                   "pytorch_q8_0_weights_and_inputs": scores(ref, emulated(model, sets, True), sets)}
            for dtype in [d.strip() for d in args.dtype.split(",") if d.strip()]:
                row[f"llama_cpp_{dtype}"] = scores(ref, on_llama_cpp(model, tok, sets, dtype, Path(tmp) / name), sets)
            results["rows"][name] = row
            print(name, {k: {kind: round(v["kl"], 4) for kind, v in s.items()} for k, s in row.items()}, flush=True)
    return write_result(args.out, results, __file__, argv)


if __name__ == "__main__":
    raise SystemExit(main())

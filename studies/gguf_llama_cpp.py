"""The gguf target's choices, measured in llama.cpp (llama-cpp-python) on an export directory.

1. **KV-cache type of float32 files**: the float32 artifact's logits against the PyTorch reference
   on ``verify``'s prompts (prefill, then the reference's greedy tokens one step at a time) with
   llama.cpp's default f16 cache and with an f32 cache: worst relative L2 of prefill and steps, mean
   KL, top-1 agreement. The export records the type that meets the fp32 bounds.
2. **The France question** through ``Llama.create_chat_completion`` (the file's own chat template,
   greedy) for every GGUF artifact, beside the PyTorch reference's greedy answer to the same chat.
3. **The token interface** of each quantized artifact: ``delta_ti`` of its head with the table
   llama.cpp's quantizer would store, with the corrected table rounded to that type (where gguf-py
   can round it), in float16, and as exported (float32); and of the transpose-tied baseline's file
   (``--tt``). Read from the files (gguf-py's dequantization: ``docs/llama_cpp.md``).

Usage::

    pit-deploy export PIT_MODEL --out EXPORT --runtime gguf --mode materialized --dtype float32,q8_0,q4_0,q4_k_m
    pit-deploy export SOURCE --keep-tying --out TT_EXPORT --runtime gguf --dtype float32
    python studies/gguf_llama_cpp.py --export EXPORT [--tt TT_EXPORT] [--threads 2] \
        [--no-kv-cache] [--out studies/results/gguf_llama_cpp.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch


from pit_deploy.io.result_file import write_result  # noqa: E402

from pit_deploy.evaluate.verify import GREEDY_TOKENS, load_reference, make_prompts, reference_run
from pit_deploy.targets.gguf.export import EMBED, HEAD
from pit_deploy.model.quantized_interface import corrected_table, identity_defect
from pit_deploy.io.gguf_files import read_gguf_tensors
from pit_deploy.io.manifest import Manifest
from pit_deploy.targets.gguf.decoder import LlamaCppDecoder

QUESTION = "What is the capital of France?"
ANSWER_TOKENS = 24


def kv_cache_figures(path: Path, reference: Any, tokenizer: Any, vocab: int, threads: int) -> dict[str, Any]:
    """Parity of the float32 file with each KV-cache type (point 1 of the module docstring)."""
    prompts = make_prompts(tokenizer, vocab, 10**9)
    runs = [reference_run(reference, p, GREEDY_TOKENS) for p in prompts]
    out = {}
    for kv in ("f16", "f32"):
        decoder = LlamaCppDecoder(path, threads, kv_cache_type=kv)
        pre_rel, dec_rel, kls, agree, total = [], [], [], 0, 0
        for prompt, (greedy, ref) in zip(prompts, runs):
            n = len(prompt)
            pre = torch.from_numpy(decoder.prefill(prompt.tolist())).double()
            steps = torch.stack([torch.from_numpy(decoder.step(int(greedy[j]), n + j)).double()
                                 for j in range(GREEDY_TOKENS - 1)])
            ref = ref.double()
            pre_rel.append(float((pre - ref[:n]).norm() / ref[:n].norm()))
            dec_rel.append(float((steps - ref[n:]).norm() / ref[n:].norm()))
            got = torch.cat([pre, steps])
            logp, logq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
            kls.append((logp.exp() * (logp - logq)).sum(-1))
            agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
            total += got.shape[0]
        decoder.close()
        out[kv] = {"prefill_rel_l2": max(pre_rel), "decode_rel_l2": max(dec_rel),
                   "kl_mean": float(torch.cat(kls).mean()), "top1_agreement": agree / total}
    return out


def reference_answer(reference: Any, tokenizer: Any) -> str:
    """The PyTorch reference's greedy answer to :data:`QUESTION` through its chat template."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                        return_tensors="pt")
    if not isinstance(ids, torch.Tensor):
        ids = ids["input_ids"]
    with torch.no_grad():
        out = reference.generate(ids, max_new_tokens=ANSWER_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def chat_answer(path: Path, threads: int) -> str:
    """llama-cpp-python's ``create_chat_completion`` of :data:`QUESTION`, greedy."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=512, n_threads=threads, verbose=False)
    reply = llm.create_chat_completion([{"role": "user", "content": QUESTION}], max_tokens=ANSWER_TOKENS,
                                       temperature=0.0, top_k=1)
    llm.close()
    return reply["choices"][0]["message"]["content"]


def interface_figures(path: Path, details: dict[str, Any]) -> dict[str, Any]:
    """Point 3 of the module docstring for one quantized file."""
    tables = read_gguf_tensors(path, (EMBED, HEAD))
    head = tables[HEAD]
    corrected = corrected_table(head)
    quant = details.get("quantization", {})
    return {
        "head_type": quant.get("head_type"), "table_type": quant.get("table_type"),
        "delta_ti_uncorrected": quant.get("delta_ti_uncorrected"),
        "delta_ti_corrected_table_rounded": quant.get("delta_ti_corrected_table_rounded"),
        "delta_ti_corrected_table_f16": identity_defect(corrected.astype(np.float16).astype(np.float32), head.T),
        "delta_ti_exported": identity_defect(tables[EMBED], head.T),
        "table_mib_f32": corrected.size * 4 / 2**20, "table_mib_f16": corrected.size * 2 / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", required=True, help="a gguf export directory (float32 and quantized)")
    parser.add_argument("--tt", default=None, help="a --keep-tying gguf export of the source (baseline)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="studies/results/gguf_llama_cpp.json")
    parser.add_argument("--no-kv-cache", action="store_true", help="skip point 1 (the slowest)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    directory = Path(args.export)
    manifest = Manifest.read(directory)
    reference, tokenizer = load_reference(directory)
    result: dict[str, Any] = {"export": directory.name, "question": QUESTION, "answers": {}, "interface": {}}
    result["answers"]["pytorch reference"] = reference_answer(reference, tokenizer)
    for art in manifest.artifacts:
        path = directory / art.path / art.details["file"]
        if art.runtime != "gguf":
            continue
        if art.dtype == "float32" and not args.no_kv_cache:
            result["kv_cache"] = kv_cache_figures(path, reference, tokenizer, art.shapes["vocab_size"], args.threads)
        elif art.dtype != "float32":
            result["interface"][art.key] = interface_figures(path, art.details)
        result["answers"][art.key] = chat_answer(path, args.threads)
    if args.tt:
        tt = Manifest.read(args.tt)
        (art,) = [a for a in tt.artifacts if a.runtime == "gguf" and a.dtype == "float32"]
        path = Path(args.tt) / art.path / art.details["file"]
        table = read_gguf_tensors(path, (EMBED,))[EMBED]
        result["interface"]["tt-baseline (f32, tied)"] = {"delta_ti_exported": identity_defect(table, table.T)}
        result["answers"]["tt-baseline gguf"] = chat_answer(path, args.threads)
    print(json.dumps(result, indent=1, default=str))
    return write_result(args.out, result, __file__, argv)


if __name__ == "__main__":
    raise SystemExit(main())

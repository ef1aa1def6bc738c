"""The tokenizer of a GGUF file: what llama.cpp reads to turn text into the model's ids.

Two forms of a Hugging Face ``tokenizer.json`` are written, each as the llama.cpp tokenizer whose
rules are the same:

* **byte-level BPE** (GPT-2, SmolLM, Llama 3, Qwen): ``tokenizer.ggml.model = "gpt2"``, the
  tokens, their types and the merges, with the pre-tokenizer named by :func:`pre_tokenizer_name`;
* **SentencePiece BPE** (Gemma, Llama 2): a BPE model with byte fallback over text whose spaces
  are replaced by ``▁``. llama.cpp's ``"llama"`` tokenizer (``llm_tokenizer_spm``) starts from the
  characters and repeatedly joins the adjacent pair whose join is a token of the highest *score*;
  a token's score here is minus the rank of the first merge that makes it (:func:`merge_scores`),
  so the pair joined first is the one Hugging Face's BPE merges first. Hugging Face's conversion of
  a SentencePiece model lists a merge for every split of every piece in the piece's score order,
  which is what makes the two procedures agree. Characters outside the vocabulary fall back to
  ``<0xNN>`` byte tokens in both.

Special and added tokens are typed ``CONTROL`` / ``USER_DEFINED`` (llama.cpp matches them whole
before the model splits the rest, as Hugging Face does); rows of the embedding past the
tokenizer's ids are ``UNUSED`` placeholders.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

from ...errors import PitError

#: SentencePiece's stand-in for a space
SPACE = "▁"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def pre_tokenizer_name(tokenizer_json: dict[str, Any]) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for the pre-tokenizer of a byte-level BPE
    ``tokenizer.json``: the name whose split rules are the same as the Hugging Face tokenizer's.

    Raises:
        PitError: a pre-tokenizer whose llama.cpp counterpart was not checked here.
    """
    pre = tokenizer_json.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"  # byte-level with the GPT-2 split regex
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex", True):
        return "smollm"  # digits one by one, then the GPT-2 regex
    raise PitError(f"the tokenizer's pre-tokenizer {kinds or pre.get('type')} has no llama.cpp counterpart checked "
                   "here (byte-level BPE with the GPT-2 split, optionally single digits first; or SentencePiece "
                   "BPE); export this model with another --runtime (onnx, executorch)")


def _is_space_replace(step: dict[str, Any]) -> bool:
    return step.get("type") == "Replace" and (step.get("pattern") or {}).get("String") == " " \
        and step.get("content") == SPACE


def sentencepiece_prefix(tokenizer_json: dict[str, Any]) -> bool | None:
    """For a SentencePiece-form BPE ``tokenizer.json`` (module docstring), whether a ``▁`` is put
    in front of the text (llama.cpp's ``add_space_prefix``); ``None`` for any other form.

    The forms taken: a normalizer that replaces spaces by ``▁`` (optionally prefixing one) with no
    pre-tokenizer or Gemma's split on spaces (which finds none after that normalizer); or no
    normalizer and a ``Metaspace`` pre-tokenizer that does not split.
    """
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        return None
    norm = tokenizer_json.get("normalizer") or {}
    steps = norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm] if norm else []
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if steps and _is_space_replace(steps[-1]):
        prefix = steps[:-1]
        if prefix and not (len(prefix) == 1 and prefix[0].get("type") == "Prepend" and prefix[0].get("prepend") == SPACE):
            return None
        inert_split = pre.get("type") == "Split" and (pre.get("pattern") or {}).get("String") == " "
        return bool(prefix) if not pre or inert_split else None
    if not steps and pre.get("type") == "Metaspace" and pre.get("replacement", SPACE) == SPACE \
            and not pre.get("split", True):
        return pre.get("prepend_scheme", "always") != "never"
    return None


def merge_scores(tokenizer_json: dict[str, Any]) -> dict[str, float]:
    """Each token a merge makes → minus the rank of the first merge that makes it (the
    SentencePiece score llama.cpp joins pairs by: module docstring)."""
    scores: dict[str, float] = {}
    for rank, merge in enumerate(tokenizer_json["model"].get("merges", [])):
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        scores.setdefault(left + right, -float(rank))
    return scores


def _saved(tokenizer: Any, tmp: Path) -> dict[str, Any]:
    """``tokenizer.json`` of ``tokenizer`` saved into ``tmp``.

    Raises:
        PitError: no tokenizer, or no ``tokenizer.json`` (a slow tokenizer).
    """
    if tokenizer is None:
        raise PitError("a GGUF file needs the tokenizer (llama.cpp reads it from the file); the source has none")
    tokenizer.save_pretrained(tmp)
    try:
        return json.loads((Path(tmp) / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise PitError("the gguf runtime writes BPE tokenizers from their tokenizer.json, and this tokenizer has "
                       "none (not a fast tokenizer); export this model with another --runtime") from None


def tokenizer_form(tokenizer_json: dict[str, Any]) -> tuple[str, str, bool]:
    """``(llama.cpp tokenizer model, pre-tokenizer name, add_space_prefix)`` of a
    ``tokenizer.json``: ``("llama", "default", …)`` for the SentencePiece form, ``("gpt2", name,
    False)`` for byte-level BPE.

    Raises:
        PitError: not BPE, or a form llama.cpp's tokenizers were not checked against here.
    """
    if (tokenizer_json.get("model") or {}).get("type") != "BPE":
        raise PitError("the gguf runtime writes BPE tokenizers only (byte-level or SentencePiece); export this "
                       "model with another --runtime (onnx, executorch)")
    prefix = sentencepiece_prefix(tokenizer_json)
    if prefix is not None:
        return "llama", "default", prefix
    return "gpt2", pre_tokenizer_name(tokenizer_json), False


def check_tokenizer(tokenizer: Any) -> None:
    """Refuse, before any conversion work, a tokenizer a GGUF file cannot hold (the ``gguf``
    target's :meth:`~pit_deploy.targets.base.Target.precheck_tokenizer`)."""
    with tempfile.TemporaryDirectory(prefix="pit-gguf-tok-") as tmp:
        tokenizer_form(_saved(tokenizer, Path(tmp)))


def write_tokenizer(writer: Any, tokenizer: Any, vocab_size: int) -> None:
    """Tokens, token types (and scores, or merges), special ids and the chat template of
    ``tokenizer`` into the GGUF ``writer``, one entry per embedding row."""
    import gguf

    with tempfile.TemporaryDirectory(prefix="pit-gguf-tok-") as tmp:
        data = _saved(tokenizer, Path(tmp))
        model, pre, space_prefix = tokenizer_form(data)
        by_id = {i: t for t, i in tokenizer.get_vocab().items()}
        specials = {int(a["id"]) for a in data.get("added_tokens", []) if a.get("special")}
        added = {int(a["id"]) for a in data.get("added_tokens", [])}
        unk = (data.get("model") or {}).get("unk_token")
        scores = merge_scores(data) if model == "llama" else {}
        unreached = -float(len(scores) + 1)  # a longer token no merge makes: joined last, if ever
        tokens, types, values = [], [], []
        for i in range(vocab_size):
            token = by_id.get(i)
            if token is None:  # a padded row of the embedding: no token of the tokenizer
                tokens.append(f"[PAD{i}]")
                types.append(gguf.TokenType.UNUSED)
                values.append(unreached)
                continue
            tokens.append(token)
            if i in specials:
                types.append(gguf.TokenType.CONTROL)
            elif i in added:
                types.append(gguf.TokenType.USER_DEFINED)
            elif model == "llama" and token == unk:
                types.append(gguf.TokenType.UNKNOWN)
            elif model == "llama" and _BYTE_TOKEN.fullmatch(token):
                types.append(gguf.TokenType.BYTE)
            else:
                types.append(gguf.TokenType.NORMAL)
            values.append(scores.get(token, 0.0 if len(token) == 1 else unreached))
        writer.add_tokenizer_model(model)
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        if model == "llama":
            writer.add_token_scores(values)
            writer.add_add_space_prefix(space_prefix)
        gguf.SpecialVocab(tmp, load_merges=model == "gpt2", n_vocab=vocab_size).add_to_gguf(writer, quiet=True)


#: llama.cpp (``llama-vocab.cpp``) sets strip attributes on these tokens of any file whose
#: ``general.name`` contains ``phi3`` or ``phi-3``, and fails to load it when one is missing
_PHI3_NAME_TOKENS = ("</s>", "<unk>", "<s>", "<|endoftext|>")


def general_name(name: str, tokenizer: Any) -> str:
    """``general.name``: the model's name, with ``phi3``/``phi-3`` spelled ``phi_3`` when the
    tokenizer lacks a token llama.cpp looks up for names that contain them (a model saved under
    a folder called ``phi3-…`` would otherwise not load)."""
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    if all(token in vocab for token in _PHI3_NAME_TOKENS):
        return name
    return re.sub(r"(?i)phi(-?)3", lambda m: m.group(0)[:3] + "_3", name)

"""The tokenizer file every ``.pte`` artifact folder carries for ExecuTorch's stock LLM runner.

``llama_main`` and its Python bindings (``TextLLMRunner``) take a ``.pte`` and a tokenizer file.
The runner's C++ Hugging Face tokenizer (the ``pytorch/tokenizers`` library ExecuTorch builds
with) reads ``tokenizer.json`` but rejects some components that the Python ``tokenizers``
library accepts. Measured with the default model: a tokenizer converted from GGUF by
``transformers`` carries an *empty* ``Sequence`` normalizer, and the runner refuses it with
"Missing normalizers for Normalizer of type Sequence". An empty sequence is the identity, so
removing it changes no encoding; that is the only kind of repair made here, and each one is
recorded in the manifest (``docs/export.md``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...io.fs import json_text
from .llm_runner import RUNNER_TOKENIZER

# component key in tokenizer.json -> the list key of its ``Sequence`` form
_SEQUENCE_KEYS = {"normalizer": "normalizers", "pre_tokenizer": "pretokenizers",
                  "post_processor": "processors", "decoder": "decoders"}


def runner_tokenizer(tokenizer: Any, vocab_size: int | None = None) -> tuple[dict[str, Any], list[str]] | None:
    """The fast tokenizer's JSON, with empty ``Sequence`` components replaced by ``null`` and
    added tokens at ids past the model's ``vocab_size`` removed; ``None`` for a tokenizer
    without a fast (``tokenizer.json``) form.

    Why the second repair: the stock runner samples over as many ids as its tokenizer has, so
    with Gemma 3's ``<image_soft_token>`` (one id past the text model's 262,144 logits) it read
    one float past the logits, picked that id, and failed to embed it ("index 262144 is out of
    range"). Such tokens have no embedding row: no prompt can use them anyway.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    data = json.loads(backend.to_str())
    repairs = []
    if vocab_size:
        past = [t for t in data.get("added_tokens") or [] if int(t.get("id", -1)) >= vocab_size]
        if past:
            data["added_tokens"] = [t for t in data["added_tokens"] if int(t.get("id", -1)) < vocab_size]
            repairs.append(f"removed the added token{'s' if len(past) > 1 else ''} "
                           f"{', '.join(str(t.get('content')) for t in past)} past the model's {vocab_size} ids "
                           "(the stock runner samples over every tokenizer id and would read past the logits)")
    for key, inner in _SEQUENCE_KEYS.items():
        part = data.get(key)
        if isinstance(part, dict) and part.get("type") == "Sequence" and not part.get(inner):
            data[key] = None
            repairs.append(f"removed an empty Sequence {key} (the identity; the stock runner rejects it)")
    return data, repairs


def write_runner_tokenizer(tokenizer: Any, folder: Path, vocab_size: int | None = None) -> dict[str, Any]:
    """Write ``folder/tokenizer.json`` for the stock runner (a model of ``vocab_size`` ids);
    returns what the manifest records."""
    made = runner_tokenizer(tokenizer, vocab_size) if tokenizer is not None else None
    if made is None:
        why = "no tokenizer" if tokenizer is None else "the tokenizer has no tokenizer.json form"
        return {"runner_tokenizer": None, "runner_tokenizer_note": f"{why}: the stock LLM runner cannot run this artifact"}
    data, repairs = made
    (folder / RUNNER_TOKENIZER).write_text(json_text(data, ensure_ascii=False), encoding="utf-8")
    return {"runner_tokenizer": RUNNER_TOKENIZER, "runner_tokenizer_repairs": repairs}

"""The stock-runner check compares only what ExecuTorch's runner can hand over as text: the
reference's greedy tokens before the first one whose piece is not whole UTF-8 or that lies past
the tokenizer's vocabulary (a tiny model's embedding can have more rows than its tokenizer has
tokens). The end-to-end run of the check is in the README test of ``tests/test_own_model.py``."""

from __future__ import annotations

from pit_deploy.targets.executorch.stock_runner import whole_utf8_prefix
from pit_deploy.tiny import tiny_tokenizer


def test_the_compared_prefix_ends_at_a_partial_piece_or_an_id_without_a_piece():
    tok = tiny_tokenizer(512)
    whole = tok("the model", add_special_tokens=False)["input_ids"]
    euro = tok("€", add_special_tokens=False)["input_ids"]  # three bytes, one byte-level token each
    assert len(euro) == 3 and all("\ufffd" in tok.decode([i]) for i in euro)
    assert whole_utf8_prefix(tok, whole) == len(whole)
    assert whole_utf8_prefix(tok, whole + euro + whole) == len(whole)
    assert len(tok) < 512  # the trained vocabulary is smaller than the model's 512 rows
    assert whole_utf8_prefix(tok, whole + [len(tok)] + whole) == len(whole)
    assert whole_utf8_prefix(tok, euro[:1] + whole) == 0


def test_the_runner_tokenizer_drops_added_tokens_past_the_vocabulary():
    """A special token one id past the model's table (Gemma 3's ``<image_soft_token>``) is left
    out of the runner's tokenizer, which the runner sizes its sampling by; tokens inside stay."""
    from pit_deploy.targets.executorch.runner_tokenizer import runner_tokenizer

    tok = tiny_tokenizer()
    vocab = len(tok)
    tok.add_special_tokens({"additional_special_tokens": ["<image_soft_token>"]})
    data, repairs = runner_tokenizer(tok, vocab)
    ids = [t["id"] for t in data["added_tokens"]]
    assert max(ids) < vocab and {0, 1, 2} <= set(ids)
    assert len(repairs) == 1 and "<image_soft_token>" in repairs[0]
    assert runner_tokenizer(tok, vocab + 1)[1] == [] and runner_tokenizer(tok)[1] == []

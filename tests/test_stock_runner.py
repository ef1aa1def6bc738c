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

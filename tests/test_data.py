"""Data: sources, deterministic split, packing, masks, resumable position, bad input."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from train_fixtures import make_corpus, make_pairs

from pit_deploy.data.corpus import DataConfig, TextSource, TrainStream, local_refs, validation_blocks
from pit_deploy.errors import PitError
from pit_deploy.tiny import tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_default_corpus_split_is_deterministic_and_disjoint():
    cfg = DataConfig("default", val_fraction=0.05)
    train, val = local_refs("default", cfg)
    train2, val2 = local_refs("default", cfg)
    assert [r.key for r in train] == [r.key for r in train2] and [r.key for r in val] == [r.key for r in val2]
    assert len(train) > 100 and len(val) > 5
    assert not {r.key for r in train} & {r.key for r in val}
    # the documented rule (docs/training.md), computed here, not with the implementation's predicate
    held_out = lambda key: int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0**64 < 0.05
    assert all(held_out(r.key) for r in val) and not any(held_out(r.key) for r in train)
    assert all(r.key.endswith(".py") for r in train[:20])
    # about 5 % held out
    assert 0.02 < len(val) / (len(train) + len(val)) < 0.09


def test_packing_overlaps_by_one_and_covers_every_token(tmp_path, tok):
    corpus = make_corpus(tmp_path, n_docs=6)
    cfg = DataConfig(str(corpus), seq_len=16, val_fraction=0.0)
    stream = TrainStream(TextSource(cfg), tok, cfg)
    b = stream.next_batch(5)
    assert b.ids.dtype == torch.int64 and b.ids.shape == (5, 17)
    for i in range(4):
        assert b.ids[i, -1] == b.ids[i + 1, 0]  # next block starts where this one ends
    assert torch.equal(b.inputs, b.ids[:, :-1]) and torch.equal(b.targets, b.ids[:, 1:])
    # the concatenated targets are the token stream itself
    order = TextSource(cfg)._order(0)
    first_doc = TextSource(cfg).train_refs[order[0]].load().text
    ids = tok(first_doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    flat = [b.ids[0, 0].item()] + b.targets.flatten().tolist()
    n = min(len(ids), len(flat))
    assert flat[:n] == ids[:n]


def test_stream_is_seeded_and_resumes_exactly(tmp_path, tok):
    corpus = make_corpus(tmp_path, n_docs=10, chars=300)
    cfg = DataConfig(str(corpus), seq_len=24, seed=3, val_fraction=0.0)
    a = TrainStream(TextSource(cfg), tok, cfg)
    for _ in range(7):
        a.next_batch(3)
    state = json.loads(json.dumps(a.state_dict()))  # survives JSON
    rest = [a.next_batch(3).ids for _ in range(40)]  # crosses into the next epoch
    assert a.epoch >= 1
    b = TrainStream(TextSource(cfg), tok, cfg)
    b.load_state_dict(state)
    for expected in rest:
        assert torch.equal(b.next_batch(3).ids, expected)
    other = TrainStream(TextSource(DataConfig(str(corpus), seq_len=24, seed=4, val_fraction=0.0)), tok, cfg)
    fresh = TrainStream(TextSource(cfg), tok, cfg)
    assert not torch.equal(other.next_batch(3).ids, fresh.next_batch(3).ids)


def test_prompt_completion_masks_only_the_completion(tmp_path, tok):
    pairs = make_pairs(tmp_path, n=3)
    cfg = DataConfig(str(pairs), seq_len=200, val_fraction=0.0)
    src = TextSource(cfg)
    doc = src.train_refs[0].load()
    assert doc.prompt.startswith("def add_") and doc.completion.startswith("    return")
    stream = TrainStream(src, tok, cfg)
    block = stream.next_batch(1)
    n_prompt = len(tok(doc.prompt, add_special_tokens=False)["input_ids"])
    first = src._order(0)[0]
    d0 = src.train_refs[first].load()
    n_prompt = len(tok(d0.prompt, add_special_tokens=False)["input_ids"])
    assert block.mask[0, :n_prompt].sum() == 0 and block.mask[0, n_prompt] == 1


def test_validation_blocks_are_fixed(tmp_path, tok):
    corpus = make_corpus(tmp_path, n_docs=20)
    cfg = DataConfig(str(corpus), seq_len=16, val_fraction=0.3)
    a = validation_blocks(TextSource(cfg), tok, cfg, 4)
    b = validation_blocks(TextSource(cfg), tok, cfg, 4)
    assert a is not None and a.ids.shape == (4, 17) and torch.equal(a.ids, b.ids)


def test_no_text_is_a_clear_error(tmp_path, tok):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("   \n")
    (empty / "b.jsonl").write_text(json.dumps({"other": "field"}) + "\n")
    with pytest.raises(PitError, match="found no text"):
        TextSource(DataConfig(str(empty)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(PitError, match="bad.jsonl:1"):
        TextSource(DataConfig(str(bad)))


def test_training_split_without_text_is_an_error(tmp_path, tok):
    corpus = make_corpus(tmp_path, n_docs=3)
    cfg = DataConfig(str(corpus), seq_len=16, val_fraction=0.999999)  # everything held out
    stream = TrainStream(TextSource(cfg), tok, cfg)
    with pytest.raises(PitError, match="training split yields no text"):
        stream.next_batch(1)


class _FakeIterable:
    """Stands in for ``datasets.IterableDataset`` (no network in tests)."""

    def __init__(self, rows, start=0, epoch=0, pred=None):
        self.rows, self.start, self.epoch, self.pred, self.pos = rows, start, epoch, pred, start

    def filter(self, fn):
        return _FakeIterable(self.rows, self.start, self.epoch, fn)

    def shuffle(self, seed, buffer_size=None):
        return self

    def set_epoch(self, epoch):
        self.epoch = epoch

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.start = self.pos = state["pos"]

    def __iter__(self):
        order = self.rows if self.epoch % 2 == 0 else self.rows[::-1]
        for i in range(self.start, len(order)):
            self.pos = i + 1
            if self.pred is None or self.pred(order[i]):
                yield order[i]


def test_hub_dataset_path_streams_splits_and_resumes(monkeypatch, tok):
    import sys
    import types

    rows = [{"text": f"document number {i} " * (3 + i % 5)} for i in range(200)]
    calls = []

    def load_dataset(name, config=None, split=None, streaming=None):
        calls.append((name, config, split, streaming))
        return _FakeIterable(rows)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    cfg = DataConfig("HuggingFaceFW/fineweb-edu", seq_len=16, hub_config="sample-10BT", val_fraction=0.1)
    src = TextSource(cfg)
    assert src.is_hub
    val = validation_blocks(src, tok, cfg, 2)
    assert val is not None and calls[0] == ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True)
    a = TrainStream(src, tok, cfg)
    for _ in range(5):
        a.next_batch(2)
    state = json.loads(json.dumps(a.state_dict()))
    assert state["hub_state"]["pos"] > 0
    rest = [a.next_batch(2).ids for _ in range(5)]
    b = TrainStream(TextSource(cfg), tok, cfg)
    b.load_state_dict(state)
    for expected in rest:
        assert torch.equal(b.next_batch(2).ids, expected)
    # held-out documents never reach training
    held_out = lambda text: int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2.0**64 < 0.1
    val_texts = {r["text"] for r in rows if held_out(r["text"])}
    assert val_texts and all(not held_out(d.text) for d, _ in zip(src.train_documents(0, 0, None), range(50)))


def test_missing_local_path_is_not_taken_for_a_hub_id(tmp_path):
    with pytest.raises(PitError, match="no such file or directory"):
        TextSource(DataConfig(str(tmp_path / "missing" / "dir")))


def test_kl_figures_by_parts_of_a_sequence_are_the_whole_sequence_figures(monkeypatch):
    """The held-out KL works on a few positions of a sequence at a time (a 256-token block of a
    262k-token vocabulary is 537 MB a float64 copy): every figure equals the one of the whole
    sequence at once, a non-finite output still counts, and odd lengths lose no position."""
    import math

    from pit_deploy.data import heldout

    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in (37, 1, 8):
        ids = torch.randint(0, 300, (n,), generator=gen)
        ref = 3 * torch.randn(n, 300, generator=gen)
        rows.append((ids, ref, ref + 0.2 * torch.randn(n, 300, generator=gen)))
    monkeypatch.setattr(heldout, "KL_ELEMENTS", 1000 * 300)
    whole = heldout.kl_figures(rows)
    monkeypatch.setattr(heldout, "KL_ELEMENTS", 3 * 300 + 299)  # 3 positions of 300 ids
    assert heldout.kl_figures(rows) == whole and whole.tokens == 46 and whole.kl_mean > 0
    rows[0][2][20, 7] = float("nan")
    damaged = heldout.kl_figures(rows)
    assert damaged.nonfinite_outputs == 1 and math.isinf(damaged.kl_mean)


def test_kl_figures_are_the_written_out_definition():
    """The fused KL and the float32 argmax and finiteness test give the figures of the definition
    written out in float64: a chunk of finite values whose float32 sum overflows counts no
    non-finite output, and an infinite row is unbounded and never agrees."""
    import math

    from pit_deploy.data import heldout

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (9,), generator=gen)
    ref = 3 * torch.randn(9, 50, generator=gen)
    got = ref + 0.3 * torch.randn(9, 50, generator=gen)
    got[4] = torch.full((50,), 3e38)  # finite, a float32 sum overflows

    def written_out(ref, got):
        logp, logq = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
        kl = (logp.exp() * (logp - logq)).sum(-1)
        nxt = ids[1:]
        gap = (-logq[:-1].gather(1, nxt[:, None]).sum() + logp[:-1].gather(1, nxt[:, None]).sum()) / 8
        return kl, int((got.double().argmax(-1) == ref.double().argmax(-1)).sum()), math.exp(gap)

    figures = heldout.kl_figures([(ids, ref, got)])
    kl, agree, ratio = written_out(ref, got)
    assert figures.nonfinite_outputs == 0 and figures.same_top1 == agree / 9
    assert figures.kl_mean == pytest.approx(float(kl.mean()), rel=1e-12)
    assert figures.ppl_ratio == pytest.approx(ratio, rel=1e-12)
    row_2_agreed = int(got[2].argmax() == ref[2].argmax())
    got[2, 0] = float("inf")
    figures = heldout.kl_figures([(ids, ref, got)])
    assert figures.nonfinite_outputs == 1 and math.isinf(figures.kl_mean)
    assert figures.same_top1 == (agree - row_2_agreed) / 9


def test_kl_figures_let_a_blocks_logits_go_before_the_next_block_is_made():
    """Only one block's logits are alive at a time (at a 262k-token vocabulary a block's pair is
    0.5 GB): when the next block is asked for, the last one's tensors are gone."""
    import gc
    import weakref

    from pit_deploy.data import heldout

    gen = torch.Generator().manual_seed(0)
    alive: list[list[weakref.ref]] = []
    seen_alive = []

    def block():
        ids = torch.randint(0, 50, (6,), generator=gen)
        ref, got = torch.randn(6, 50, generator=gen), torch.randn(6, 50, generator=gen)
        alive.append([weakref.ref(ref), weakref.ref(got)])
        return ids, ref, got

    def rows():  # as kl_parity's: the generator itself keeps no block
        for _ in range(3):
            gc.collect()
            seen_alive.append(sum(r() is not None for refs in alive for r in refs))
            yield block()

    figures = heldout.kl_figures(rows())
    assert seen_alive == [0, 0, 0] and figures.tokens == 18


def _bos_adding(tok):
    """``tok`` with a post-processor that puts ``<s>`` before every text, as Gemma's and Llama 3's do."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = tok.backend_tokenizer
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def test_a_tokenizer_that_adds_bos_gets_blocks_led_by_it_that_cover_every_token_once(tmp_path, tok):
    from pit_deploy.data.corpus import block_lead

    assert block_lead(tok) is None  # adds no BOS: blocks as cut from the packed stream
    bos_tok = _bos_adding(tiny_tokenizer())
    assert block_lead(bos_tok) == bos_tok.bos_token_id == 1
    corpus = make_corpus(tmp_path, n_docs=6)
    cfg = DataConfig(str(corpus), seq_len=16, val_fraction=0.0)
    plain = TrainStream(TextSource(cfg), tok, cfg).next_batch(6)
    led = TrainStream(TextSource(cfg), bos_tok, cfg).next_batch(6)
    assert led.ids.shape == (6, 17) and bool((led.ids[:, 0] == 1).all())
    # the same token stream: each id of the packed documents is a target exactly once
    stream = [plain.ids[0, 0].item()] + plain.targets.flatten().tolist()
    assert led.targets.flatten().tolist() == stream[: 6 * 16]
    assert bool((led.target_mask == 1).all())
    # resumed from its saved position, a led stream goes on with the same blocks
    a = TrainStream(TextSource(cfg), bos_tok, cfg)
    a.next_batch(2)
    b = TrainStream(TextSource(cfg), bos_tok, cfg)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert torch.equal(a.next_batch(3).ids, b.next_batch(3).ids)
    val_cfg = DataConfig(str(corpus), seq_len=16, val_fraction=0.5)
    val = validation_blocks(TextSource(val_cfg), bos_tok, val_cfg, 3)
    assert val is not None and bool((val.ids[:, 0] == 1).all())

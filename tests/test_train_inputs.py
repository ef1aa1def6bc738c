"""Training inputs: token-normalized gradient accumulation, every flag's range checked up
front (exit 2 before any model is loaded), UTF-8 data, and flags generated from the config."""

from __future__ import annotations

import dataclasses
import json

import pytest
from train_fixtures import config, make_corpus, make_model_dir, read_metrics

from pit_deploy.cli import build_parser, main
from pit_deploy.training.config import TrainConfig, default_of
from pit_deploy.data.corpus import DataConfig, TextSource, TrainStream
from pit_deploy.training.loop import param_groups, train


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return make_model_dir(root), make_corpus(root)


def _unequal_pairs(root):
    """Prompt/completion records whose trained (completion) share varies a lot between blocks."""
    path = root / "unequal.jsonl"
    with open(path, "w") as fh:
        for i in range(60):
            prompt = ("# " + "context words " * (12 if i % 3 else 1)) + f"\ndef f_{i}(x):\n"
            completion = "    return x\n" if i % 3 else "    " + " + ".join(f"x * {k}" for k in range(8)) + "\n"
            fh.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    return path


def test_gradient_accumulation_is_normalized_by_trained_tokens(tmp_path, assets):
    """4 blocks in one micro-batch or in 4 micro-batches of 1: the same global batch must give
    the same loss and the same update, although the blocks hold very different numbers of
    trained tokens (a per-micro-batch mean would weigh them alike)."""
    model, _ = assets
    data = _unequal_pairs(tmp_path)
    common = dict(steps=4, eval_every=0, lr=3e-3, warmup_steps=0, seq_len=32)
    cfg = config(tmp_path / "probe", model, data, batch_size=4, **common)
    from pit_deploy.io.sources import load_source

    tokenizer = load_source(str(model)).tokenizer
    dcfg = cfg.data_config_obj()
    per_block = TrainStream(TextSource(dcfg), tokenizer, dcfg).next_batch(4).mask[:, 1:].sum(1)
    assert per_block.max() >= 2 * per_block.min() > 0  # the case that separates the two normalizations
    one = tmp_path / "one"
    four = tmp_path / "four"
    train(config(one, model, data, batch_size=4, grad_accum=1, **common))
    train(config(four, model, data, batch_size=1, grad_accum=4, **common))
    a, b = read_metrics(one, "train"), read_metrics(four, "train")
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)


BAD_FLAGS = [
    (["--lr=-1e-2"], "--lr must be positive"),
    (["--lr", "0"], "--lr must be positive"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--lr-t=-1"], "--lr-t must be 0 or more"),
    (["--weight-decay=-0.1"], "--weight-decay must be 0 or more"),
    (["--grad-clip=-1"], "--grad-clip must be 0 or more"),
    (["--warmup-steps=-3"], "--warmup-steps must be 0 or more"),
    (["--save-every=-1"], "--save-every must be 0 or more"),
    (["--eval-every=-1"], "--eval-every must be 0 or more"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be at least 1"),
    (["--grad-accum", "0"], "--grad-accum must be at least 1"),
    (["--min-lr-ratio", "1.5"], "--min-lr-ratio must be in [0, 1]"),
    (["--betas", "0.9,1.0"], "--betas must be two numbers in [0, 1)"),
    (["--distill", "--distill-temperature", "0"], "--distill-temperature must be positive"),
    (["--lora", "--lora-rank", "0"], "--lora-rank must be at least 1"),
    (["--device", "tpu"], "unknown --device 'tpu'"),
    (["--val-fraction", "1"], "--val-fraction must be in [0, 1)"),
    (["--t-max-cond", "0.5"], "--t-max-cond must exceed 1"),
    (["--max-delta-ti=-1e-4"], "--max-delta-ti must be 0 (no check) or positive"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_training_flags_are_exit_2_before_loading(tmp_path, capsys, flags, message):
    """The model named does not exist: the flag check must come first to give this message."""
    out = tmp_path / "run"
    rc = main(["train", "--model", str(tmp_path / "no-such-model"), "--out", str(out), "--steps", "2", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert not out.exists()


def test_lr_t_zero_freezes_the_rate_of_t(assets):
    """``--lr-t 0`` means a rate of 0 for T's factors, not "unset" (which means ``--lr``)."""
    model, corpus = assets
    from pit_deploy.converters.conversion import convert_model
    from pit_deploy.io.sources import load_source

    pit = convert_model(load_source(str(model)).model)
    scales = lambda cfg: {g["name"]: g["lr_scale"] for g in param_groups(pit, cfg)}
    assert scales(config("x", model, corpus, lr_t=0.0))["interface_t"] == 0.0
    assert scales(config("x", model, corpus, lr_t=None))["interface_t"] == 1.0
    assert scales(config("x", model, corpus, lr=1e-3, lr_t=2e-3))["interface_t"] == pytest.approx(2.0)


@pytest.mark.parametrize("name,payload,message", [
    ("latin1.txt", "caf\xe9 cr\xe8me ".encode("latin-1") * 40, "is not UTF-8 text"),
    ("binary.txt", b"\x00\x01\x02 text" * 40, "looks binary"),
    ("latin1.jsonl", json.dumps({"text": "x"}).encode() + b"\n" + '{"text": "caf\xe9"}'.encode("latin-1"),
     "is not UTF-8 text"),
])
def test_data_that_is_not_utf8_text_is_named(tmp_path, assets, capsys, name, payload, message):
    model, corpus = assets
    data = tmp_path / "data"
    data.mkdir()
    (data / "good.txt").write_text("def f():\n    return 1\n" * 30)
    (data / name).write_bytes(payload)
    rc = main(["train", "--model", str(model), "--data", str(data), "--out", str(tmp_path / "run"),
               "--steps", "1", "--seq-len", "32", "--no-progress", "--no-plot"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and name in err, err
    assert not (tmp_path / "run").exists()


def test_default_corpus_reads_leniently():
    """The bundled corpus (the interpreter's standard library) is read as it is."""
    source = TextSource(DataConfig("default"))
    assert len(source.train_refs) > 100


def test_every_config_field_is_a_flag_with_the_config_default():
    """Flags come from the dataclass: a renamed or new field gets its flag and default."""
    parser = build_parser()
    args = parser.parse_args(["train", "--out", "x"])
    for f in dataclasses.fields(TrainConfig):
        assert hasattr(args, f.name), f"no flag for {f.name}"
        if f.name != "out":
            assert getattr(args, f.name) == default_of(f.name), f.name
    parsed = parser.parse_args(["train", "--out", "x", "--betas", "0.8,0.99", "--lora-targets", "q_proj, v_proj",
                                "--no-progress", "--lr-t", "0"])
    assert parsed.betas == (0.8, 0.99) and parsed.lora_targets == ["q_proj", "v_proj"]
    assert parsed.progress is False and parsed.lr_t == 0.0


def test_learning_rate_and_warmup_follow_the_start():
    """Left out, --lr and --warmup-steps follow where training starts: the measured continued-
    pretraining rate from a pretrained model (PIT from preserve, or TT), the from-scratch rate
    from scratch, for LoRA and from a paper init; given, they are kept as given."""
    from pit_deploy.training.config import CPT_LR, CPT_WARMUP, SCRATCH_LR, TrainConfig, with_start_defaults

    def resolved(**kw):
        cfg = with_start_defaults(TrainConfig(out="o", steps=1, **kw))
        return cfg.lr, cfg.warmup_steps

    assert resolved() == resolved(tying="tt") == resolved(t_init="preserve") == (CPT_LR, CPT_WARMUP)
    assert CPT_LR < SCRATCH_LR
    for start in ({"from_scratch": True}, {"lora": True}, {"t_init": "identity"}, {"t_init": "output"}):
        assert resolved(**start) == (SCRATCH_LR, 0), start
    assert resolved(tying="tt", t_init="identity") == (CPT_LR, CPT_WARMUP)  # TT converts nothing
    assert resolved(lr=2e-5, warmup_steps=0) == (2e-5, 0)

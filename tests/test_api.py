"""The Python API (``pit_deploy.convert``, ``train``, ``export``, ``verify``, ``bench``, ``run``) on
a tiny model: each call returns what a program reads, and a user's mistake is a ``PitError``."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pit_deploy
from pit_deploy import PitError

from scramble import rehash
from train_fixtures import make_corpus, make_model_dir

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("api-assets")
    return make_model_dir(root), make_corpus(root)


@pytest.fixture(scope="module")
def converted(assets, tmp_path_factory):
    model, _ = assets
    out = tmp_path_factory.mktemp("api-convert") / "pit"
    lines: list[str] = []
    return pit_deploy.convert(model, out, calib_tokens=256, say=lines.append), lines


@pytest.fixture(scope="module")
def exported(converted, tmp_path_factory):
    conversion, _ = converted
    out = tmp_path_factory.mktemp("api-export") / "exp"
    manifest = pit_deploy.export(conversion.out, out, runtime="onnx", mode="factorized", dtype="float32",
                                 max_seq_len=32, say=None)
    return manifest, out


def test_import_loads_no_heavy_library_and_the_calls_stay_callable():
    code = (
        "import sys, pit_deploy as p\n"
        "heavy = [m for m in ('torch', 'onnx', 'onnxruntime', 'transformers', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert {'convert', 'train', 'export', 'verify', 'bench', 'run', 'PitError', '__version__'} <= set(dir(p))\n"
        # the sub-packages are named apart from the calls: importing one leaves the call a function
        "import inspect, pydoc, pit_deploy.workflow.recipe, pit_deploy.training.config, pit_deploy.exporters.recipes\n"
        "assert pit_deploy.exporters.recipes.Recipe and pit_deploy.training.config.TrainConfig\n"
        "calls = [p.convert, p.train, p.export, p.verify, p.bench, p.run]\n"
        "assert all(inspect.isfunction(f) for f in calls), calls\n"
        # help() shows the call and its parameters
        "assert 'function export' in pydoc.render_doc(p.export) and 'runtime' in str(inspect.signature(p.export))\n"
        "heavy = [m for m in ('torch', 'onnx', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_convert_returns_the_checkpoint_and_its_figures(converted, assets, tmp_path):
    conversion, lines = converted
    assert callable(pit_deploy.convert)
    assert conversion.t_init == "preserve"
    assert (conversion.out / "config.json").is_file()
    assert conversion.delta_ti < 1e-5
    assert conversion.source_nll is not None and conversion.converted_nll is not None
    assert any(line.startswith("held-out NLL") for line in lines) and lines[-1] == "done"
    # messages raised to Python name the keyword arguments, not the command's flags
    with pytest.raises(PitError, match="^calib_tokens must be at least 1") as caught:
        pit_deploy.convert(assets[0], tmp_path / "x", calib_tokens=0, say=None)
    assert "--" not in str(caught.value)
    with pytest.raises(PitError, match="force=True") as caught:  # an existing non-empty out, before any load
        pit_deploy.convert(assets[0], conversion.out, say=None)
    assert "--force" not in str(caught.value)
    assert not (tmp_path / "x").exists()


def test_convert_past_the_loss_bound_raises_the_figures(assets, tmp_path):
    from pit_deploy.errors import BoundError
    from pit_deploy.io.checkpoint import save_model
    from pit_deploy.tiny import tiny_model, tiny_tokenizer

    granite = save_model(tiny_model("granite"), tmp_path / "granite", tiny_tokenizer())
    with pytest.raises(BoundError) as caught:  # the paper init loses several nats on this source
        pit_deploy.convert(granite, tmp_path / "x", t_init="output", say=None)
    figures = caught.value.figures
    assert caught.value.exit_code == 1 and figures["bound"] == pit_deploy.api.MAX_LOSS_RISE
    assert figures["converted_nll"] > figures["source_nll"]
    assert not (tmp_path / "x").exists()
    with pytest.raises(PitError, match="max_loss_rise must be a number"):
        pit_deploy.convert(assets[0], tmp_path / "x", max_loss_rise="0.5", say=None)


def test_train_takes_the_flags_as_keywords(converted, assets, tmp_path):
    conversion, _ = converted
    _, corpus = assets
    lines: list[str] = []
    result = pit_deploy.train(conversion.out, tmp_path / "run", data=corpus, steps=2, seq_len=32, batch_size=2,
                              betas="0.9,0.95", val_fraction=0.2, progress=False, plot=False, say=lines.append)
    assert result.steps == 2 and result.final_train_loss > 0
    # without the progress bar, a line after the first step and the last (step, loss, tokens/s,
    # MFU where the CPU's peak is known, ETA or the time in all), then the summary
    assert len(lines) == 3 and lines[-1] == f"done: 2 steps, final train loss {result.final_train_loss:.4f}"
    assert re.fullmatch(r"step 1/2: loss \d+\.\d{4}, [\d,]+ tokens/s(, MFU \d+\.\d%)?, ETA \d+s", lines[0]), lines
    assert re.fullmatch(r"step 2/2: loss \d+\.\d{4}, [\d,]+ tokens/s(, MFU \d+\.\d%)?, \d+s in all", lines[1]), lines
    with pytest.raises(PitError, match="did you mean 'steps'"):
        pit_deploy.train(conversion.out, tmp_path / "run2", stepz=2, say=None)
    with pytest.raises(PitError, match="out is required"):
        pit_deploy.train(conversion.out, steps=2, say=None)


def test_export_returns_the_manifest(exported, converted, tmp_path):
    manifest, out = exported
    assert [(a.runtime, a.mode, a.dtype) for a in manifest.artifacts] == [("onnx", "factorized", "float32")]
    assert (out / "manifest.json").is_file() and manifest.artifacts[0].bytes > 0
    with pytest.raises(PitError, match="unknown runtime 'nope'"):
        pit_deploy.export(converted[0].out, tmp_path / "e", runtime="onnx,nope", say=None)
    with pytest.raises(PitError, match="runtime="):
        pit_deploy.export(converted[0].out, tmp_path / "e", runtimes=["onnx"], say=None)
    assert not (tmp_path / "e").exists()


def test_verify_passes_an_honest_export_and_fails_a_corrupted_one(exported, tmp_path):
    _, out = exported
    report = pit_deploy.verify(out, record=False, say=None)
    assert report.passed is True
    assert report.result("onnx", "factorized").logits_rel_l2 < 1e-4
    with pytest.raises(PitError, match="unknown runtime"):
        pit_deploy.verify(out, runtime="nope", say=None)
    selected = pit_deploy.verify(out, record=False, target="onnx", scheme="float32", say=None)  # the aliases
    assert [(a.runtime, a.mode) for a in selected.artifacts] == [("onnx", "factorized")] and selected.passed
    # the reference's weights changed and the digests re-recorded: only the numbers can tell
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "corrupted"
    shutil.copytree(out, bad)
    weights = bad / "reference" / "model.safetensors"
    tensors = load_file(weights)
    name = next(k for k, v in tensors.items() if "layers.0" in k and v.ndim == 2)
    tensors[name] = tensors[name] * 3.0
    save_file(tensors, weights, metadata={"format": "pt"})
    rehash(bad)
    report = pit_deploy.verify(bad, say=None)
    assert report.passed is False and report.artifacts[0].failures


def test_progress_goes_to_the_logger_by_default(exported, caplog, capsys):
    """A library call prints nothing by default: its progress lines go to the ``pit_deploy``
    logger at INFO, where a program that configures logging sees them."""
    _, out = exported
    with caplog.at_level(logging.INFO, logger="pit_deploy"):
        assert pit_deploy.verify(out, record=False).passed
    assert any(r.name == "pit_deploy" and "verifying" in r.getMessage() for r in caplog.records)
    assert "[pit-deploy" not in capsys.readouterr().err


def test_bench_returns_the_rows(exported, tmp_path):
    _, out = exported
    rows_file = tmp_path / "rows.json"
    result = pit_deploy.bench(out, threads="1", prompt_len=8, gen_len=4, reps=1, out=rows_file, say=None)
    assert [(r["runtime"], r["threads"], r["prompt_len"], r["gen_len"]) for r in result.rows] == [("onnx", 1, 8, 4)]
    assert result.rows[0]["decode_tok_s"] > 0
    assert json.loads(rows_file.read_text())["rows"][0]["artifact"] == result.rows[0]["artifact"]
    with pytest.raises(PitError, match="^threads takes comma-separated integers"):
        pit_deploy.bench(out, threads="one", say=None)
    with pytest.raises(PitError, match="gen_len"):
        pit_deploy.bench(out, gen_len=1, say=None)
    # the command's other modes are calls of their own, each with one return type
    archive = pit_deploy.bench_bundle(out, out=tmp_path / "b.tar.gz", prompt_len=8, gen_len=4, reps=1, say=None)
    assert isinstance(archive, Path) and archive.is_file()
    again = pit_deploy.bench_ingest(rows_file, say=None)
    assert [r["artifact"] for r in again.rows] == [r["artifact"] for r in result.rows]
    with pytest.raises(PitError, match="at least one rows file"):
        pit_deploy.bench_ingest(say=None)
    with pytest.raises(TypeError):
        pit_deploy.bench(out, bundle=tmp_path / "x.tar.gz", say=None)  # no second return type on bench


def test_run_returns_the_exit_code_and_the_report(assets, tmp_path):
    model, corpus = assets
    overrides = {"export.runtimes": ["onnx"], "export.dtype": ["float32"], "export.max_seq_len": 32,
                 "train.steps": 2, "train.save_every": 0, "verify.enabled": False, "bench.enabled": False}
    result = pit_deploy.run("smoke", model=model, data=corpus, out=tmp_path / "r", overrides=overrides, say=None)
    assert result.exit_code == 0 and result.failed_stage is None
    assert Path(result.report).is_file()
    assert "onnx-factorized" in Path(result.report).read_text()
    with pytest.raises(PitError, match="did you mean 'steps'"):
        pit_deploy.run("smoke", model=model, data=corpus, out=tmp_path / "r2", overrides=["train.stepz=2"], say=None)


def _bool_options() -> list[tuple[str, str]]:
    """Every switch of the API: the calls' bool parameters, the training options' and the export
    recipe's (``pit_correction=``, …) bool fields."""
    import inspect
    from dataclasses import fields

    from pit_deploy.exporters.recipes import Recipe
    from pit_deploy.training.config import TrainConfig

    out = [(call, name) for call in ("convert", "train", "export", "verify", "bench", "run")
           for name, p in inspect.signature(getattr(pit_deploy, call)).parameters.items()
           if isinstance(p.default, bool)]
    out += [("train", f.name) for f in fields(TrainConfig) if str(f.type) == "bool"]
    out += [("export", f.name) for f in fields(Recipe) if str(f.type) in ("bool", "bool | None")]
    return out


def _call(call: str, tmp_path: Path, **kwargs):
    """``pit_deploy.<call>`` with its required arguments (paths that do not exist: the types are
    checked before anything is read)."""
    positional = {"convert": (tmp_path / "m", tmp_path / "o"), "train": (tmp_path / "m", tmp_path / "o"),
                  "export": (tmp_path / "m", tmp_path / "o"), "verify": (tmp_path / "d",), "bench": (),
                  "run": ("default",)}[call]
    if call == "run":
        kwargs = {"model": tmp_path / "m", "out": tmp_path / "o", **kwargs}
    return getattr(pit_deploy, call)(*positional, **{"say": None, **kwargs})


@pytest.mark.parametrize("call, name", _bool_options())
def test_every_switch_of_the_api_must_be_a_real_bool(call, name, tmp_path):
    """``record="no"`` is truthy: taken as given it would switch the option on. Every switch
    refuses anything but True or False, naming the argument, before any work."""
    with pytest.raises(PitError, match=rf"^{call}\(\): {name} must be True(,| or) False.*got 'no' \(str\)"):
        _call(call, tmp_path, **{name: "no"})
    assert list(tmp_path.iterdir()) == []


def test_verify_record_no_does_not_record(exported, tmp_path):
    _, out = exported
    copy = tmp_path / "exp"
    shutil.copytree(out, copy)
    before = (copy / "manifest.json").read_bytes()
    with pytest.raises(PitError, match="record must be True or False"):
        pit_deploy.verify(copy, record="no", say=None)
    assert (copy / "manifest.json").read_bytes() == before


@pytest.mark.parametrize("call, kwargs, said", [
    ("export", {"dtype": 4}, "export(): dtype must be a name, a comma list or a list of names, got 4 (int)"),
    ("export", {"runtime": ["onnx", 3]}, "export(): runtime must be a name, a comma list or a list of names"),
    ("export", {"recipe": 7}, "export(): recipe must be a recipe name, a path or a Recipe, got 7 (int)"),
    ("export", {"max_seq_len": "64"}, "export(): max_seq_len must be an integer, got '64' (str)"),
    ("export", {"group_size": 3.5}, "export(): group_size must be an integer or None, got 3.5 (float)"),
    ("train", {"lr": "fast"}, "train(): lr must be a number or None, got 'fast' (str)"),
    ("train", {"steps": "3"}, "train(): steps must be an integer or None, got '3' (str)"),
    ("train", {"betas": 0.9}, "train(): betas must be two numbers"),
    ("train", {"data": 5}, "train(): data must be text (a str), got 5 (int)"),
    ("convert", {"calib_tokens": 1.5}, "convert(): calib_tokens must be an integer, got 1.5 (float)"),
    ("convert", {"t_init": 1}, "convert(): t_init must be text (a str) or None, got 1 (int)"),
    ("verify", {"expect_sha256": 0}, "verify(): expect_sha256 must be text (a str) or None"),
    ("verify", {"isa": 64}, "verify(): isa must be a name, a comma list or a list of names"),
    ("export", {"runtime": "onnx", "target": "gguf"}, "export(): pass runtime or target, not both"),
    ("verify", {"dtype": "int4", "scheme": "int8"}, "verify(): pass dtype or scheme, not both"),
    ("export", {"target": 5}, "export(): runtime must be a name, a comma list or a list of names, got 5"),
    ("bench", {"threads": 1.5}, "bench(): threads must be an integer, a list of integers or a comma list"),
    ("bench", {"reps": "3"}, "bench(): reps must be an integer, got '3' (str)"),
    ("run", {"from_stage": 2}, "run(): from_stage must be text (a str) or None, got 2 (int)"),
    ("run", {"overrides": [("train.steps", 2)]}, "run(): overrides must be 'TABLE.KEY=VALUE' texts"),
    ("run", {"say": "loud"}, "run(): say must be None or a callable taking one string, got 'loud' (str)"),
])
def test_arguments_of_the_wrong_type_are_a_pit_error_naming_them(call, kwargs, said, tmp_path):
    with pytest.raises(PitError) as caught:
        _call(call, tmp_path, **kwargs)
    assert said in str(caught.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("call, position", [("convert", 0), ("convert", 1), ("export", 1), ("verify", 0),
                                            ("run", 0), ("train", 1)])
def test_a_path_that_is_not_a_path_is_a_pit_error_naming_it(call, position, tmp_path):
    args = [tmp_path / "m", tmp_path / "o"][: 1 if call in ("verify", "run") else 2]
    args[position] = None if call != "train" else 3
    name = {"convert": ["model", "out"], "export": ["model", "out"], "verify": ["directory"], "run": ["recipe"],
            "train": ["model", "out"]}[call][position]
    with pytest.raises(PitError, match=rf"^{call}\(\): {name} must be a path \(str or os.PathLike\), got"):
        getattr(pit_deploy, call)(*args, say=None)


def test_the_command_line_keeps_the_flags(assets, tmp_path, capsys):
    """The same mistake through the command line names the flag (the API's keyword terms are for
    Python callers only)."""
    from pit_deploy.cli import main

    assert main(["convert", "--model", str(assets[0]), "--out", str(tmp_path / "x"), "--calib-tokens", "0"]) == 2
    assert "error: --calib-tokens must be at least 1" in capsys.readouterr().err


def test_keyword_terms_of_a_message():
    from pit_deploy.errors import in_keyword_terms

    assert in_keyword_terms("pass --force, or --no-pit-correction with --dtype int4; --calib-tokens ≥ 1",
                            frozenset({"force"})) == \
        "pass force=True, or pit_correction=False with dtype int4; calib_tokens ≥ 1"

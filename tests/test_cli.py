"""`pit-deploy convert` and `pit-deploy diagnose`, including every bad input a user can give them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from transformers import BertConfig, BertModel

from pit_deploy.io.checkpoint import save_model
from pit_deploy.cli import main
from pit_deploy.tiny import tiny_model


@pytest.fixture
def plain_dir(tmp_path: Path, family: str) -> Path:
    out = tmp_path / f"{family}-plain"
    save_model(tiny_model(family), out)
    return out


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_diagnose_convert_diagnose(plain_dir: Path, tmp_path: Path, capsys) -> None:
    code, out, _ = _run(capsys, "diagnose", str(plain_dir), "--json")
    assert code == 0
    tied = json.loads(out)
    assert tied["tying"] == "tied" and tied["delta_ti"] > 1e-2
    assert {"delta_ti", "cosine_distance", "procrustes_error", "principal_angle",
            "vocab_size", "hidden_size", "tying"} <= set(tied)

    pit_dir = tmp_path / "pit"
    code, _, err = _run(capsys, "convert", "--model", str(plain_dir), "--out", str(pit_dir), "--t-init", "output")
    assert code == 0, err
    assert "[pit-deploy" in err  # stage lines go to stderr
    code, out, _ = _run(capsys, "diagnose", str(pit_dir), "--json")
    pit = json.loads(out)
    assert pit["tying"] == "pit" and pit["vocab_size"] == 512 and pit["hidden_size"] == 64
    assert pit["delta_ti"] <= 1e-5 and pit["cosine_distance"] <= 1e-6 and pit["principal_angle"] <= 1e-5

    code, out, _ = _run(capsys, "diagnose", str(pit_dir))
    assert code == 0 and "delta_ti" in out and not out.lstrip().startswith("{")


def test_existing_out_needs_force(tmp_path: Path, capsys) -> None:
    src = tmp_path / "src"
    save_model(tiny_model("gpt2"), src)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    code, _, err = _run(capsys, "convert", "--model", str(src), "--out", str(out))
    assert code == 2 and "--force" in err
    assert (out / "keep.txt").read_text() == "user data"
    code, _, err = _run(capsys, "convert", "--model", str(src), "--out", str(out), "--force")
    assert code == 2 and "not a pit-deploy output" in err  # --force replaces pit-deploy's outputs only
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    converted = tmp_path / "converted"
    assert _run(capsys, "convert", "--model", str(src), "--out", str(converted))[0] == 0
    (converted / "stale.txt").write_text("from the earlier conversion")
    code, _, err = _run(capsys, "convert", "--model", str(src), "--out", str(converted), "--force")
    assert code == 0, err
    assert not (converted / "stale.txt").exists() and (converted / "model.safetensors").is_file()


def _bert_dir(tmp_path: Path) -> Path:
    path = tmp_path / "bert"
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64)
    BertModel(config).save_pretrained(path)
    return path


def _nonfinite_dir(tmp_path: Path) -> Path:
    model = tiny_model("llama")
    with torch.no_grad():
        model.get_input_embeddings().weight[7, 3] = float("nan")
    return save_model(model, tmp_path / "nan")


def _vocab_only_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_string("general.name", "not a model")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _garbage_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"this is not a gguf file at all")
    return path


def _pickle_only_dir(tmp_path: Path) -> Path:
    path = tmp_path / "pickled"
    tiny_model("llama").save_pretrained(path, safe_serialization=False)
    return path


@pytest.mark.parametrize(
    "make_source,message",
    [
        (lambda p: p / "does-not-exist", "no such file or directory"),
        (_bert_dir, "not a causal language model"),
        (_nonfinite_dir, "non-finite"),
        (_vocab_only_gguf, "not a language model"),
        (_garbage_gguf, "not a GGUF file"),
        (_pickle_only_dir, "pickle"),
    ],
    ids=["missing", "bert", "nonfinite", "vocab-only-gguf", "garbage-gguf", "pickle-only"],
)
def test_bad_sources_exit_2_and_write_nothing(tmp_path: Path, capsys, make_source, message: str) -> None:
    source = make_source(tmp_path)
    out = tmp_path / "out"
    code, stdout, err = _run(capsys, "convert", "--model", str(source), "--out", str(out))
    assert code == 2
    error_lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and message in error_lines[0], err
    assert "Traceback" not in err
    assert not out.exists(), "a failed convert must not create --out"
    assert not any(p.name.startswith(".out") for p in tmp_path.iterdir()), "temporary dir left behind"


def test_unknown_t_init(tmp_path: Path, capsys) -> None:
    src = save_model(tiny_model("llama"), tmp_path / "src")
    code, _, err = _run(capsys, "convert", "--model", str(src), "--out", str(tmp_path / "o"), "--t-init", "spd")
    assert code == 2 and "unknown --t-init 'spd'" in err
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def lossy_source(tmp_path_factory) -> Path:
    """A tiny Granite whose ``output`` conversion raises the held-out NLL by about 5.5 nats/token
    (its logit and residual multipliers make the paper init far from the source)."""
    from pit_deploy.tiny import tiny_tokenizer

    return save_model(tiny_model("granite"), tmp_path_factory.mktemp("lossy") / "granite", tiny_tokenizer())


def test_a_conversion_past_the_loss_bound_is_exit_1_with_its_figures_and_writes_nothing(lossy_source, tmp_path,
                                                                                      capsys) -> None:
    out = tmp_path / "o"
    code, _, err = _run(capsys, "convert", "--model", str(lossy_source), "--out", str(out), "--t-init", "output")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1, err
    assert "held-out NLL from" in errors[0] and "past the bound of 0.25" in errors[0], errors[0]
    assert "--accept-loss" in errors[0] and "Traceback" not in err
    assert not out.exists() and not any(p.name.startswith(".o") for p in tmp_path.iterdir())


@pytest.mark.parametrize("t_init", ["preserve", "output"])
def test_the_loss_bound_error_names_the_way_back_for_the_conversion_that_failed(t_init) -> None:
    from pit_deploy.api import check_loss_rise
    from pit_deploy.errors import BoundError

    with pytest.raises(BoundError) as caught:
        check_loss_rise(2.1, 5.0, 0.25, False, t_init, source="models/gemma-3")
    text = str(caught.value)
    assert "nothing was written" in text and "--accept-loss" in text, text
    distill = "pit-deploy train --model models/gemma-3 --distill --distill-weight 1" in text
    assert distill == (t_init == "preserve"), text  # a PIT checkpoint cannot be distilled: the source is named
    check_loss_rise(2.1, 2.2, 0.25, False, t_init)  # within the bound: nothing to say


@pytest.mark.parametrize("flags", [["--accept-loss"], ["--max-loss-rise", "50"]], ids=["accept", "wider-bound"])
def test_a_lossy_conversion_is_kept_when_asked(lossy_source, tmp_path, capsys, caplog, flags) -> None:
    out = tmp_path / "o"
    code, _, err = _run(capsys, "convert", "--model", str(lossy_source), "--out", str(out), "--t-init", "output",
                        *flags)
    assert code == 0, err
    assert (out / "config.json").exists()
    assert ("kept as asked" in caplog.text) == (flags == ["--accept-loss"]), caplog.text


@pytest.mark.parametrize("bound", ["-1", "nan"])
def test_a_loss_bound_that_is_not_a_non_negative_number_is_exit_2(lossy_source, tmp_path, capsys, bound) -> None:
    code, _, err = _run(capsys, "convert", "--model", str(lossy_source), "--out", str(tmp_path / "o"),
                        "--max-loss-rise", bound)
    assert code == 2 and "--max-loss-rise must be a number of nats/token ≥ 0" in err, err
    assert not (tmp_path / "o").exists()


def test_console_script_runs_as_a_process(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pit_deploy", "diagnose", str(tmp_path / "nope"), "--json"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")


@pytest.mark.parametrize("argv", [["--help"], ["list"], ["export", "--help"], ["export", "m", "--out", "o", "--dtype", "bogus"],
                                  ["verify"], ["list", "bogus"], ["train", "--help"], ["run", "--help"]])
def test_help_list_and_argument_errors_load_no_heavy_library(argv):
    """The parser's choices come from tables that import no torch: ``--help``, ``list`` and an
    argument error answer at once, and print no library warning before the answer."""
    code = (
        "import sys\n"
        "from pit_deploy.cli import main\n"
        "try:\n"
        f"    rc = main({argv!r})\n"
        "except SystemExit as exc:\n"
        "    rc = exc.code\n"
        "heavy = [m for m in ('torch', 'transformers', 'torchao', 'onnx', 'onnxruntime', 'executorch') if m in sys.modules]\n"
        "print('HEAVY', heavy, 'RC', rc, file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("HEAVY [] RC"), proc.stderr[-2000:]
    others = [line for line in proc.stderr.splitlines()[:-1] if line.strip()]
    assert all(line.startswith(("usage:", "error:", "pit-deploy", "  ")) for line in others), others
    rc = last.rsplit("RC", 1)[1].strip()
    assert rc in ("0", "None") if argv[-1] in ("--help", "list") else rc == "2"


@pytest.mark.parametrize("command", ["export", "verify"])
def test_scheme_is_the_same_option_as_dtype(command):
    """``--scheme`` (what the value names) and ``--dtype`` (its older name) set the same option."""
    from pit_deploy.cli import build_parser

    head = ["export", "DIR", "--out", "OUT"] if command == "export" else ["verify", "DIR"]
    parser = build_parser()
    assert parser.parse_args([*head, "--scheme", "int4,q4_k_m"]).dtype == parser.parse_args(
        [*head, "--dtype", "int4,q4_k_m"]).dtype


@pytest.mark.parametrize("command", ["export", "verify"])
def test_target_is_the_same_option_as_runtime(command):
    """``--target`` (the name the docs use) and ``--runtime`` set the same option."""
    from pit_deploy.cli import build_parser

    head = ["export", "DIR", "--out", "OUT"] if command == "export" else ["verify", "DIR"]
    parser = build_parser()
    want = parser.parse_args([*head, "--runtime", "onnx,gguf"])
    got = parser.parse_args([*head, "--target", "onnx,gguf"])
    assert vars(got) == vars(want)

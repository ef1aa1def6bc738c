"""Verify never passes what it cannot measure; no command destroys data; every user mistake is
a clear exit 2 and an internal error a one-line exit 3 (docs/conventions.md)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pit_deploy.cli import main
from pit_deploy.io.checkpoint import save_model
from pit_deploy.io.fs import sha256_file
from pit_deploy.tiny import tiny_model, tiny_pit_model, tiny_tokenizer


def _poisoned(tmp_path: Path, name: str, value: float, pit: bool = True) -> Path:
    model = tiny_pit_model("llama") if pit else tiny_model("llama")
    with torch.no_grad():
        dict(model.named_parameters())[name].view(-1)[3] = value
    out = tmp_path / f"poisoned-{name.replace('.', '-')}-{value}"
    save_model(model, out, tiny_tokenizer())
    return out


@pytest.mark.parametrize("name", ["model.layers.0.mlp.down_proj.weight", "pit_interface.Z", "pit_interface.L_offdiag"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("command", ["export", "diagnose", "probe"])
def test_non_finite_weight_anywhere_is_refused_naming_the_tensor(tmp_path, capsys, name, value, command):
    src = _poisoned(tmp_path, name, value)
    args = {"export": ["export", str(src), "--out", str(tmp_path / "exp"), "--recipe", "tiny-ci", "--runtime", "onnx"],
            "diagnose": ["diagnose", str(src)], "probe": ["probe", str(src), "--ids", "1,2,3"]}[command]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert name in err and "non-finite" in err
    assert not (tmp_path / "exp").exists()


def test_convert_refuses_a_non_finite_body_weight(tmp_path, capsys):
    src = _poisoned(tmp_path, "model.layers.0.self_attn.q_proj.weight", float("nan"), pit=False)
    assert main(["convert", "--model", str(src), "--out", str(tmp_path / "out"), "--t-init", "identity"]) == 2
    assert "model.layers.0.self_attn.q_proj.weight" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def onnx_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("robust")
    src = root / "pit"
    save_model(tiny_pit_model("llama"), src, tiny_tokenizer())
    out = root / "exp"
    assert main(["export", str(src), "--out", str(out), "--recipe", "tiny-ci", "--runtime", "onnx", "--mode", "materialized"]) == 0
    return out


def _copy(export: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(export, target)
    return target


def _rehash(directory: Path) -> None:
    """Re-record every digest, as a broken exporter (not a tamperer) would have written them."""
    data = json.loads((directory / "manifest.json").read_text())
    tables = [data["reference"]["files"]] + [a["files"] for a in data["artifacts"]]
    for table in tables:
        for rel, info in table.items():
            info["sha256"] = sha256_file(directory / rel)
            info["bytes"] = (directory / rel).stat().st_size
    data["verification"] = None
    (directory / "manifest.json").write_text(json.dumps(data))


def test_nan_on_the_runtime_side_fails_verification(onnx_export, tmp_path, capsys):
    """One NaN in a decoder weight of the ONNX artifact: verify must exit 1 and say why —
    never report rel_l2 0.0 or 100 % top-1 because max(0.0, nan) is 0.0."""
    import onnx
    from onnx import numpy_helper

    d = _copy(onnx_export, tmp_path)
    path = d / "onnx-materialized" / "onnx" / "model.onnx"
    model = onnx.load(str(path), load_external_data=True)
    # the first MLP down-projection (128 × 64 in the tiny Llama): a body weight, not the table
    target = next(i for i in model.graph.initializer if list(i.dims) == [128, 64])
    arr = numpy_helper.to_array(target).copy()
    arr.flat[0] = np.nan
    target.CopyFrom(numpy_helper.from_array(arr, target.name))
    (d / "onnx-materialized" / "onnx" / "model.onnx_data").unlink()
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx_data", size_threshold=1024)
    _rehash(d)
    code = main(["verify", str(d), "--json", "--no-record"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    art = report["artifacts"][0]
    assert not art["passed"]
    assert art["nonfinite_outputs"] > 0
    assert any("non-finite" in f for f in art["failures"])
    assert art["top1_agreement"] < 1.0
    assert not art["greedy_match"]


def test_non_finite_reference_is_unusable_input(onnx_export, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    d = _copy(onnx_export, tmp_path)
    weights = d / "reference" / "model.safetensors"
    state = load_file(str(weights))
    key = next(k for k in state if "down_proj" in k)
    state[key].view(-1)[0] = float("nan")
    save_file(state, str(weights), metadata={"format": "pt"})
    _rehash(d)
    assert main(["verify", str(d), "--no-record"]) == 2
    assert key in capsys.readouterr().err


@pytest.mark.parametrize("where", ["cwd", "source", "inside-source", "contains-source", "home", "root"])
def test_force_never_deletes_what_the_user_did_not_name(tmp_path, capsys, monkeypatch, where):
    src = tmp_path / "work" / "src"
    save_model(tiny_model("llama"), src, tiny_tokenizer())
    monkeypatch.chdir(tmp_path / "work")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    out = {"cwd": ".", "source": str(src), "inside-source": str(src / "sub"), "contains-source": str(tmp_path / "work"),
           "home": str(Path.home()), "root": "/"}[where]
    code = main(["convert", "--model", str(src), "--out", out, "--force", "--t-init", "identity"])
    err = capsys.readouterr().err
    assert code == 2 and "refusing" in err or "lies inside" in err or "filesystem root" in err, err
    assert code == 2
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_force_refuses_a_symlinked_out(tmp_path, capsys):
    src = tmp_path / "src"
    save_model(tiny_model("llama"), src, tiny_tokenizer())
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("keep")
    (tmp_path / "link").symlink_to(precious)
    assert main(["convert", "--model", str(src), "--out", str(tmp_path / "link"), "--force", "--t-init", "identity"]) == 2
    assert "symbolic link" in capsys.readouterr().err
    assert (precious / "keep.txt").read_text() == "keep"


def test_out_under_a_file_fails_before_loading(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(["convert", "--model", "default", "--out", str(tmp_path / "afile" / "out")]) == 2
    assert "is a file" in capsys.readouterr().err


@pytest.mark.parametrize("tamper, message", [
    (lambda m: m["artifacts"][0].__setitem__("path", "../elsewhere"), "not a plain relative path"),
    (lambda m: m["artifacts"][0]["files"].__setitem__("../../etc/passwd", {"sha256": "0" * 64, "bytes": 1}),
     "not a plain relative path"),
    (lambda m: m["artifacts"][0].__setitem__("runtime", "tflite"), "not a runtime this pit-deploy knows"),
    (lambda m: m["artifacts"][0].pop("shapes"), "has no 'shapes'"),
    (lambda m: m["artifacts"][0].__setitem__("files", ["model.onnx"]), "artifacts[0].files must be a dict"),
    (lambda m: m.pop("reference"), "missing key 'reference'"),
])
def test_tampered_manifests_are_exit_2(onnx_export, tmp_path, capsys, tamper, message):
    d = _copy(onnx_export, tmp_path)
    data = json.loads((d / "manifest.json").read_text())
    tamper(data)
    (d / "manifest.json").write_text(json.dumps(data))
    assert main(["verify", str(d), "--no-record"]) == 2
    assert message in capsys.readouterr().err


def test_artifact_folder_replaced_by_a_symlink_outside_is_refused(onnx_export, tmp_path, capsys):
    d = _copy(onnx_export, tmp_path)
    outside = tmp_path / "outside"
    shutil.move(str(d / "onnx-materialized"), outside)
    (d / "onnx-materialized").symlink_to(outside)
    assert main(["verify", str(d), "--no-record"]) == 2
    assert "points outside" in capsys.readouterr().err


def test_expect_sha256_pins_an_export(onnx_export, tmp_path, capsys):
    d = _copy(onnx_export, tmp_path)
    good = sha256_file(d / "manifest.json")
    assert main(["verify", str(d), "--no-record", "--expect-sha256", "0" * 64]) == 2
    assert "not the pinned" in capsys.readouterr().err
    assert main(["verify", str(d), "--no-record", "--expect-sha256", good]) == 0


def test_read_only_export_is_refused_before_the_check(onnx_export, tmp_path, capsys, monkeypatch):
    """(Simulated through os.access: the tests may run as root, which writes anywhere.)"""
    d = _copy(onnx_export, tmp_path)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == d and mode & os.W_OK else real_access(p, mode, **kw))
    assert main(["verify", str(d)]) == 2
    assert "--no-record" in capsys.readouterr().err


def test_config_that_disagrees_with_tensor_shapes_is_exit_2(tmp_path, capsys):
    src = tmp_path / "pit"
    save_model(tiny_pit_model("llama"), src, tiny_tokenizer())
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = cfg["intermediate_size"] * 2
    (src / "config.json").write_text(json.dumps(cfg))
    assert main(["diagnose", str(src)]) == 2
    assert "does not match" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [(["--top-k", "-3"], "--top-k must be at least 1"),
                                           (["--top-k", "100000"], "exceeds the vocabulary"),
                                           (["--plot", "/nonexistent-dir/x.png"], "does not exist")])
def test_probe_ranges_are_exit_2(tmp_path, capsys, args, message):
    src = tmp_path / "pit"
    save_model(tiny_pit_model("llama"), src, tiny_tokenizer())
    assert main(["probe", str(src), "--ids", "1,2,3", *args]) == 2
    assert message in capsys.readouterr().err


def test_internal_error_is_exit_3_with_one_line(monkeypatch, capsys):
    import pit_deploy.cli as cli

    def boom(_args):
        raise RuntimeError("something broke inside")

    monkeypatch.setattr(cli, "run_diagnose", boom)
    assert cli.main(["diagnose", "x"]) == 3
    err = capsys.readouterr().err
    assert "internal error" in err and "--debug" in err and "Traceback" not in err
    assert cli.main(["--debug", "diagnose", "x"]) == 3
    assert "Traceback" in capsys.readouterr().err

"""``pit-deploy export`` / ``verify`` from the command line: bad input, tampering, interrupts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pit_deploy.io.checkpoint import save_model
from pit_deploy.io.fs import sha256_file
from pit_deploy.cli import main
from pit_deploy.converters.conversion import convert_model
from pit_deploy.model.inspect import find_interface
from pit_deploy.tiny import tiny_model


@pytest.fixture(scope="module")
def pit_dir(tmp_path_factory) -> Path:
    model = convert_model(tiny_model("llama"))
    it = find_interface(model)
    with torch.no_grad():
        it.L_diag.add_(0.3 * torch.randn(it.L_diag.shape, generator=torch.Generator().manual_seed(0)))
    out = tmp_path_factory.mktemp("src") / "pit"
    save_model(model, out)
    return out


@pytest.fixture(scope="module")
def onnx_export(pit_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("exp") / "onnx"
    assert main(["export", str(pit_dir), "--out", str(out), "--runtime", "onnx", "--mode", "factorized"]) == 0
    return out


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def test_verify_json_passes(onnx_export, capsys):
    assert main(["verify", str(onnx_export), "--json", "--no-record"]) == 0
    data = json.loads(capsys.readouterr().out)
    (art,) = data["artifacts"]
    assert {"runtime", "mode", "logits_rel_l2", "logits_max_abs", "top1_agreement", "greedy_match",
            "delta_ti", "passed"} <= set(art)
    assert art["runtime"] == "onnx" and art["mode"] == "factorized" and art["passed"] is True
    assert data["passed"] is True


def test_flipped_byte_fails_digest(onnx_export, tmp_path, capsys):
    d = _copy(onnx_export, tmp_path)
    target = d / "onnx-factorized" / "onnx" / "model.onnx"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    assert main(["verify", str(d)]) == 2
    err = capsys.readouterr().err
    assert "digest" in err and "onnx-factorized/onnx/model.onnx" in err and "modified or corrupted" in err


def test_deleted_file_fails_digest(onnx_export, tmp_path, capsys):
    d = _copy(onnx_export, tmp_path)
    (d / "onnx-factorized" / "onnx" / "interface.onnx").unlink()
    assert main(["verify", str(d)]) == 2
    err = capsys.readouterr().err
    assert "onnx-factorized/onnx/interface.onnx" in err and "missing" in err


def test_failed_bound_exits_1_and_names_it(onnx_export, tmp_path, capsys):
    """A reference that no longer matches the artifact (digest updated) must fail parity."""
    d = _copy(onnx_export, tmp_path)
    weights = d / "reference" / "model.safetensors"
    state = load_file(str(weights))
    key = next(k for k in state if k.endswith("mlp.down_proj.weight"))
    state[key] = state[key] * 1.5
    save_file(state, str(weights), metadata={"format": "pt"})
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["reference"]["files"]["reference/model.safetensors"]["sha256"] = sha256_file(weights)
    (d / "manifest.json").write_text(json.dumps(manifest))
    assert main(["verify", str(d), "--json"]) == 1
    art = json.loads(capsys.readouterr().out)["artifacts"][0]
    assert art["passed"] is False and any("logits_rel_l2" in f for f in art["failures"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--runtime", "onnx,tflite"], "unknown runtime 'tflite'"),
        (["--mode", "quantized"], "unknown mode 'quantized'"),
        (["--recipe", "nope"], "unknown recipe 'nope'"),
        (["--dtype", "float16"], "unknown dtype"),
        (["--runtime", "executorch", "--max-seq-len", "4096"], "exceeds what this model supports"),
    ],
)
def test_export_bad_input_exit_2(pit_dir, tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    assert main(["export", str(pit_dir), "--out", str(out), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_verify_bad_input_exit_2(onnx_export, pit_dir, tmp_path, capsys):
    assert main(["verify", str(pit_dir)]) == 2
    assert "not an export directory" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "nowhere")]) == 2
    assert main(["verify", str(onnx_export), "--runtime", "tflite"]) == 2
    assert "unknown runtime" in capsys.readouterr().err
    assert main(["verify", str(onnx_export), "--runtime", "executorch"]) == 2
    assert "no artifact" in capsys.readouterr().err


def test_export_refuses_non_empty_out(pit_dir, onnx_export, capsys):
    assert main(["export", str(pit_dir), "--out", str(onnx_export), "--runtime", "onnx"]) == 2
    assert "--force" in capsys.readouterr().err


def _start_export(pit_dir: Path, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pit_deploy", "export", str(pit_dir), "--out", str(out),
           "--runtime", "executorch", "--mode", "factorized", "--max-seq-len", "33"]
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=os.environ.copy())


def _wait_for(proc: subprocess.Popen, marker: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    for line in proc.stderr:  # progress lines
        if marker in line:
            return
        if time.time() > deadline:
            break
    proc.kill()
    pytest.fail(f"export never reached {marker!r}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_interrupted_export_leaves_nothing_complete(pit_dir, tmp_path, sig, capsys):
    out = tmp_path / "export"
    proc = _start_export(pit_dir, out)
    _wait_for(proc, "exporting executorch-factorized")  # reference written, lowering under way
    partials = list(tmp_path.glob(".export.partial-*"))
    assert partials and (partials[0] / "reference" / "model.safetensors").is_file()
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert not out.exists()
    leftovers = list(tmp_path.glob(".export.partial-*"))
    if sig == signal.SIGTERM:
        assert leftovers == []  # cleaned up like Ctrl-C
    assert not any((p / "manifest.json").exists() for p in leftovers)
    for p in leftovers:  # a SIGKILL leaves a hidden temp dir that verify refuses
        assert main(["verify", str(p)]) == 2
        assert "no manifest.json" in capsys.readouterr().err

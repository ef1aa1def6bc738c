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
    (lambda m: m["artifacts"][0].__setitem__("target", "tflite"), "not a target this pit-deploy knows"),
    (lambda m: m["artifacts"][0].__setitem__("runtime", "executorch"), "names two targets"),
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


def test_a_manifest_that_names_the_target_runtime_is_read(onnx_export, tmp_path):
    """Manifests written before the field was called ``target`` name it ``runtime``: read as such."""
    from pit_deploy.io.manifest import Manifest

    d = _copy(onnx_export, tmp_path)
    data = json.loads((d / "manifest.json").read_text())
    for art in data["artifacts"]:
        art["runtime"] = art.pop("target")
    (d / "manifest.json").write_text(json.dumps(data))
    manifest = Manifest.read(d)
    assert {a.target for a in manifest.artifacts} == {"onnx"} and all(a.runtime == "onnx" for a in manifest.artifacts)
    assert main(["verify", str(d), "--no-record"]) == 0


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
    assert "intermediate_size is 256, but model.safetensors holds 128" in capsys.readouterr().err


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


# ----------------------------------------------------------------------------------------
# A source's config.json: sizes checked against the checkpoint before anything is built
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_sources(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama, GPT-2 and PIT Llama, saved once (each test copies the one it edits)."""
    root = tmp_path_factory.mktemp("config-sizes")
    out = {"llama": root / "llama", "gpt2": root / "gpt2", "pit": root / "pit"}
    save_model(tiny_model("llama"), out["llama"], tiny_tokenizer())
    save_model(tiny_model("gpt2"), out["gpt2"], tiny_tokenizer())
    save_model(tiny_pit_model("llama"), out["pit"], tiny_tokenizer())
    return out


def _edited(source: Path, tmp_path: Path, **changes) -> Path:
    target = tmp_path / source.name
    shutil.copytree(source, target)
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(changes)
    (target / "config.json").write_text(json.dumps(cfg))
    return target


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


@pytest.mark.parametrize("source, changes, said", [
    ("llama", {"num_hidden_layers": -2}, "num_hidden_layers (decoder layers) must be a positive integer, got -2"),
    ("llama", {"num_hidden_layers": 3}, "num_hidden_layers is 3, but model.safetensors holds 2 layers; set "
                                        "num_hidden_layers to 2"),
    ("llama", {"hidden_size": -64}, "hidden_size (hidden size) must be a positive integer, got -64"),
    ("llama", {"num_attention_heads": 0}, "num_attention_heads (attention heads) must be a positive integer, got 0"),
    ("llama", {"head_dim": 0}, "head_dim (width of an attention head) must be a positive integer, got 0"),
    ("llama", {"num_hidden_layers": 2.5}, "num_hidden_layers (decoder layers) must be a positive integer, got 2.5"),
    ("llama", {"num_key_value_heads": 3}, "num_key_value_heads is 3, but model.safetensors holds 2"),
    ("llama", {"intermediate_size": 100}, "intermediate_size is 100, but model.safetensors holds 128"),
    ("llama", {"vocab_size": 2}, "vocab_size is 2, but model.safetensors holds 512"),
    ("llama", {"vocab_size": 10**12}, "vocab_size is 1000000000000, but model.safetensors holds 512"),
    ("gpt2", {"n_layer": 5}, "n_layer is 5, but model.safetensors holds 2 layers"),
    ("gpt2", {"n_embd": 32}, "n_embd is 32, but model.safetensors holds 64"),
    ("pit", {"hidden_size": 32}, "hidden_size is 32, but model.safetensors holds 64"),
    ("pit", {"vocab_size": 100}, "vocab_size is 100, but model.safetensors holds 512 (pit_interface.Z has shape "
                                 "(512, 64)"),
])
def test_config_sizes_that_are_not_the_checkpoints_are_exit_2_naming_the_field(plain_sources, tmp_path, capsys,
                                                                              source, changes, said):
    """A size that is not a positive integer, or that is not what the checkpoint's tensors hold
    (read from the safetensors header), is one line naming the config.json field, its value and
    the checkpoint's; nothing is built or written."""
    src = _edited(plain_sources[source], tmp_path, **changes)
    out = tmp_path / "out"
    argv = (["export", str(src), "--out", str(out), "--recipe", "tiny-ci", "--runtime", "onnx"] if source == "pit"
            else ["convert", "--model", str(src), "--out", str(out), "--t-init", "output"])
    assert main(argv) == 2
    line = _one_error(capsys)
    assert said in line and str(src / "config.json") in line, line
    assert not out.exists()


def test_a_million_layers_over_a_two_layer_checkpoint_is_refused_before_any_layer_is_built(plain_sources, tmp_path):
    """The config is read without building anything: the layer count is compared with the
    checkpoint's header (a build of 10⁶ layers would take minutes and gigabytes)."""
    from pit_deploy.errors import PitError
    from pit_deploy.io.checkpoint import load_config

    for source in ("llama", "pit"):
        src = _edited(plain_sources[source], tmp_path / source, num_hidden_layers=10**6)
        with pytest.raises(PitError, match="num_hidden_layers is 1000000, but model.safetensors holds 2 layers"):
            load_config(src)


def test_a_vocabulary_smaller_than_the_hidden_size_is_exit_2(tmp_path, capsys):
    """PIT's Z (vocab_size × hidden_size) has orthonormal columns: a model of 2 tokens and 64
    dimensions (config and weights agreeing) cannot be converted, by any conversion."""
    from pit_deploy.converters.conversion import convert_model
    from pit_deploy.errors import PitError

    src = tmp_path / "two-tokens"
    save_model(tiny_model("llama", vocab_size=2), src)
    for t_init in ("preserve", "output"):
        assert main(["convert", "--model", str(src), "--out", str(tmp_path / t_init), "--t-init", t_init]) == 2
        line = _one_error(capsys)
        assert "vocab_size 2 is smaller than hidden_size 64" in line and str(src / "config.json") in line, line
    for t_init in ("preserve", "identity"):  # a model in memory (a GGUF file, the API) is refused alike
        with pytest.raises(PitError, match=r"vocabulary \(2 tokens, vocab_size\) is smaller than the hidden size"):
            convert_model(tiny_model("llama", vocab_size=2), t_init)


# ----------------------------------------------------------------------------------------
# A source's tokenizer: present but unreadable is exit 2 naming the file
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["convert", "export"])
@pytest.mark.parametrize("content, said", [
    (bytes(range(256)) * 16, "not JSON"),
    (b"[" * 200_000 + b"]" * 200_000, "nested too deep to read"),
    (b"{}", "cannot be read as a tokenizer"),
], ids=["random-bytes", "nested-200000-deep", "not-a-tokenizer"])
def test_a_corrupt_tokenizer_json_is_exit_2_naming_the_file(plain_sources, tmp_path, capsys, command, content, said):
    """Random bytes, JSON nested 200 000 deep, or a JSON object that is no tokenizer: refused
    before the model loads, never dropped with a warning (the artifacts would lose their
    tokenizer and verify its text prompts)."""
    src = _edited(plain_sources["pit" if command == "export" else "llama"], tmp_path)
    (src / "tokenizer.json").write_bytes(content)
    out = tmp_path / "out"
    argv = (["export", str(src), "--out", str(out), "--recipe", "tiny-ci", "--runtime", "onnx"] if command == "export"
            else ["convert", "--model", str(src), "--out", str(out), "--t-init", "output"])
    assert main(argv) == 2
    line = _one_error(capsys)
    assert str(src / "tokenizer.json") in line and said in line, line
    assert not out.exists()


def test_a_source_without_any_tokenizer_still_converts(plain_sources, tmp_path):
    src = _edited(plain_sources["llama"], tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (src / name).unlink(missing_ok=True)
    assert main(["convert", "--model", str(src), "--out", str(tmp_path / "out"), "--t-init", "output"]) == 0


# ----------------------------------------------------------------------------------------
# Run recipes are TOML files
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, content, said", [
    ("some.json", '{"train": {"steps": 3}}', "some.json is not a run recipe: a .json file that is not TOML; run "
                                             "recipes are TOML files ending in .toml"),
    ("recipe.txt", "[train]\nsteps = 3\n", "it reads as TOML: rename it to recipe.toml"),
    ("missing.json", None, "run recipe missing.json does not exist, and a .json file is not a run recipe"),
])
def test_a_run_recipe_that_is_not_a_toml_file_says_so(tmp_path, capsys, monkeypatch, name, content, said):
    monkeypatch.chdir(tmp_path)
    if content is not None:
        (tmp_path / name).write_text(content)
    assert main(["run", name]) == 2
    line = _one_error(capsys)
    assert said in line and "did you mean" not in line, line
    assert not (tmp_path / "runs").exists()

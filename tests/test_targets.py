"""Targets, schemes and configuration as single extension points (docs/design.md).

The proof that a target is one module: a throwaway target registered from this test module
alone — optimum's ONNX exporter and onnxruntime driver under another name, with a check of its
own — exports, verifies, benches and bundles a tiny model with no edit to generic code. Two
schemes of one dtype share an export directory and are judged by their own bounds; the run
recipe's ``[export]`` table is the export recipe."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from pit_deploy.cli import main
from pit_deploy.errors import PitError
from pit_deploy.io.checkpoint import save_model
from pit_deploy.io.manifest import Manifest
from pit_deploy.targets import Target, get_target, register_target, target_names, unregister_target
from pit_deploy.tiny import tiny_pit_model, tiny_tokenizer

NAME = "onnx-copy"


class CopyTarget(Target):
    """The ``onnx`` target's exporter and driver under another name, plus a check of its own."""

    name = NAME
    title = "throwaway test target"
    module = "onnxruntime"
    package = "onnxruntime"
    dtypes = ("float32", "int4")
    exporter = "pit_deploy.targets.onnx.export:export_artifact"
    driver = "pit_deploy.targets.onnx.driver:OnnxDriver"
    primary_file = "onnx/model.onnx"
    standalone = ("pit_deploy.runtime.standalone", "OrtDecoder")
    bundle_install = "onnxruntime numpy"
    checked: list[str] = []

    def interface_checks(self, folder: Path, dim: int) -> tuple[bool | None, list[str]]:
        self.checked.append(folder.name)
        return None, [f"{NAME} looked at {folder.name}"]


@pytest.fixture
def copy_target():
    target = register_target(CopyTarget())
    yield target
    unregister_target(NAME)


@pytest.fixture(scope="module")
def pit_source(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("targets") / "pit-src"
    save_model(tiny_pit_model("llama"), src, tiny_tokenizer())
    return src


def test_a_target_registered_from_outside_exports_verifies_and_benches(copy_target, pit_source, tmp_path, capsys):
    assert NAME in target_names()
    out = tmp_path / "exp"
    assert main(["export", str(pit_source), "--out", str(out), "--recipe", "tiny-ci", "--runtime", NAME,
                 "--mode", "factorized"]) == 0
    manifest = Manifest.read(out)
    (art,) = manifest.artifacts
    assert (art.runtime, art.key, art.scheme_name) == (NAME, f"{NAME}-factorized", "float32")
    assert main(["verify", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (result,) = report["artifacts"]
    assert result["passed"] and result["delta_ti"] <= 1e-5
    assert f"{NAME} looked at {NAME}-factorized" in result["notes"]  # the target's own check ran
    assert CopyTarget.checked == [f"{NAME}-factorized"]
    rows = tmp_path / "rows.json"
    assert main(["bench", str(out), "--prompt-len", "6", "--gen-len", "4", "--reps", "1", "--json",
                 "--out", str(rows)]) == 0
    (row,) = json.loads(rows.read_text())["rows"]
    assert row["runtime"] == NAME and row["verified"] is True and row["first_divergence"] is None
    bundle = tmp_path / "b.tar.gz"
    assert main(["bench", str(out), "--prompt-len", "6", "--gen-len", "4", "--bundle", str(bundle)]) == 0
    with tarfile.open(bundle) as tar:
        spec = json.loads(tar.extractfile("pit-bench/bundle.json").read())
    (packed,) = spec["artifacts"]
    assert packed["decoder"] == {"module": "pit_bench_runtime", "class": "OrtDecoder"}
    assert packed["file"] == "onnx/model.onnx" and packed["requires"]["module"] == "onnxruntime"


def test_an_unregistered_runtime_is_exit_2_naming_the_known_ones(pit_source, tmp_path, capsys):
    assert main(["export", str(pit_source), "--out", str(tmp_path / "e"), "--runtime", "tflite"]) == 2
    err = capsys.readouterr().err
    assert "unknown runtime 'tflite'" in err and "onnx" in err and "executorch" in err


def test_two_schemes_of_one_dtype_share_an_export_directory(pit_source, tmp_path, capsys):
    out = tmp_path / "exp"
    assert main(["export", str(pit_source), "--out", str(out), "--runtime", "onnx", "--mode", "factorized",
                 "--dtype", "int4,int4-compact", "--max-seq-len", "64"]) == 0
    manifest = Manifest.read(out)
    assert sorted(a.key for a in manifest.artifacts) == ["onnx-factorized-int4", "onnx-factorized-int4-compact"]
    compact = manifest.artifact("onnx", "factorized", "int4-compact")
    assert compact.dtype == "int4" and compact.details["scheme"]["table_bits"] == 4
    assert compact.details["scheme"]["int4_8bit_layers"] == ["v_proj"]
    assert manifest.artifact("onnx", "factorized", "int4").details["scheme"]["table_bits"] == 8
    assert main(["verify", str(out), "--json"]) == 0
    results = {a["scheme"]: a for a in json.loads(capsys.readouterr().out)["artifacts"]}
    assert set(results) == {"int4", "int4-compact"} and all(r["passed"] for r in results.values())
    assert main(["verify", str(out), "--dtype", "int4-compact", "--no-record"]) == 0  # a scheme selects one


def test_a_scheme_is_refused_where_it_was_not_measured_and_a_setting_no_target_reads(pit_source, tmp_path, capsys):
    assert main(["export", str(pit_source), "--out", str(tmp_path / "a"), "--runtime", "executorch",
                 "--dtype", "int4-compact"]) == 2
    assert "meant for onnx, onnx-genai only" in capsys.readouterr().err  # executorch still refused
    assert main(["export", str(pit_source), "--out", str(tmp_path / "b"), "--runtime", "onnx",
                 "--dtype", "int4", "--pte-head-bits", "4"]) == 2
    assert "pte_head_bits applies to the executorch runtime(s) only" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("bounds", [{"kl_mean": float("inf")}, {"kl_mean": float("nan")}, {"kl_mean": "0.1"}])
def test_non_finite_bounds_are_refused(bounds):
    from pit_deploy.exporters.recipes import Recipe

    with pytest.raises(PitError, match="must be a finite number"):
        Recipe(dtype="int4", bounds={"int4": bounds})


def test_targets_declare_what_generic_code_asks():
    onnx, pte = get_target("onnx"), get_target("executorch")
    assert not onnx.static_cache and pte.static_cache
    assert pte.phone and not onnx.phone
    assert pte.ship_priority < onnx.ship_priority
    assert "pte_head_bits" in pte.scheme_settings and "pte_head_bits" not in onnx.scheme_settings
    with pytest.raises(PitError, match="unknown runtime"):
        get_target("tflite")


# --------------------------------------------------------------------------------------
# One configuration: the run recipe's [export] table is the export recipe
# --------------------------------------------------------------------------------------


def _run_recipe(*overrides: str) -> Any:
    from pit_deploy.workflow.recipe import load_run_recipe

    return load_run_recipe("smoke", list(overrides))


def test_every_export_recipe_field_is_reachable_with_set():
    recipe = _run_recipe("export.table_bits=4", "export.group_size=16", 'export.int4_8bit_layers=["v_proj"]')
    exp = recipe.export_recipe()
    (scheme,) = [s for s in exp.schemes() if s.quantized]
    assert (scheme.table_bits, scheme.group_size, scheme.int4_8bit_layers) == (4, 16, ("v_proj",))
    assert exp.modes == ("factorized",) and exp.max_seq_len == 64  # the smoke recipe's own values stand


def test_a_shipped_export_recipe_drives_the_run():
    exp = _run_recipe('export.recipe="int4-compact"').export_recipe()
    # named with --set, the export recipe replaces the run recipe file's export settings
    assert exp.dtype == ("int4-compact",) and exp.runtimes == ("onnx",) and exp.modes == ("factorized",)
    assert exp.schemes()[0].table_bits == 4 and exp.max_seq_len == 256
    exp = _run_recipe('export.recipe="int4-compact"', "export.max_seq_len=64").export_recipe()
    assert exp.dtype == ("int4-compact",) and exp.max_seq_len == 64  # other --set keys still refine it


@pytest.mark.parametrize("override, message", [
    ("export.table_bit=4", "unknown key export.table_bit; did you mean 'table_bits'?"),
    ("export.table_bits=5", "table_bits must be 4 or 8"),
    ("export.dtype=[\"int3\"]", "unknown dtype 'int3'; choose from float32, int8, int4, int4-compact"),
    ("export.recipe=\"nope\"", "unknown recipe 'nope'"),
    ("train.lr=-1", "--lr must be positive"),
    ("bench.gen_len=100000", "--gen-len must be from 2"),
])
def test_a_wrong_run_key_or_value_is_exit_2_before_any_stage(override, message, tmp_path, capsys):
    assert main(["run", "smoke", "--out", str(tmp_path / "run"), "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert not (tmp_path / "run").exists()


def test_old_run_recipes_spell_dtypes_and_still_load():
    recipe = _run_recipe('export.dtypes=["float32"]')
    assert recipe.export_recipe().dtype == ("float32",)


def test_the_train_table_is_the_training_config():
    from pit_deploy.workflow.recipe import table_keys
    from pit_deploy.training.config import TrainConfig, default_of
    from dataclasses import fields

    keys = set(table_keys("train"))
    assert {f.name for f in fields(TrainConfig)} - {"out", "model", "data", "resume", "force", "plot", "progress"} <= keys
    recipe = _run_recipe()
    assert recipe.value("train", "grad_clip") == default_of("grad_clip")  # not copied: the config's own
    assert recipe.value("train", "weight_decay") == 0.0  # a documented run default (docs/run.md)


def test_a_torchrun_child_gets_its_config_as_a_file(tmp_path):
    from pit_deploy.training.config import TrainConfig, read_config, write_config

    cfg = TrainConfig(out=str(tmp_path / "o"), steps=3, betas=(0.8, 0.9), lora_targets=["q_proj"], lr=1e-4)
    path = write_config(cfg, tmp_path / "cfg.json")
    assert read_config(path) == cfg
    (tmp_path / "bad.json").write_text('{"steps": 3, "nonsense": 1}')
    with pytest.raises(PitError, match="unknown: nonsense"):
        read_config(tmp_path / "bad.json")

"""Export recipes and the manifest."""

from __future__ import annotations

import json

import pytest

from pit_deploy.errors import PitError
from pit_deploy.io.manifest import Manifest
from pit_deploy.exporters.recipes import Recipe, available_recipes, load_recipe, parse_list


def test_shipped_recipes_load():
    names = available_recipes()
    assert {"default", "onnx-fp32", "executorch-xnnpack-fp32", "tiny-ci", "int4-compact"} <= set(names)
    for name in names:
        r = load_recipe(name)
        assert r.runtimes and r.modes and r.dtypes and r.max_seq_len >= 2
    assert load_recipe("tiny-ci").max_seq_len == 64
    for name in ("default", "onnx-fp32", "executorch-xnnpack-fp32", "tiny-ci"):
        assert "float32" in load_recipe(name).dtypes
    compact = load_recipe("int4-compact")  # int4 only: no 545 MB fp32 twin beside a 95 MB artifact
    assert compact.dtypes == ("int4-compact",) and compact.runtimes == ("onnx",)
    (scheme,) = compact.schemes()
    assert scheme.dtype == "int4" and scheme.table_bits == 4 and scheme.int4_8bit_layers == ("v_proj",)


def test_flags_override_recipe():
    r = load_recipe("default").override(runtimes="onnx", modes=None, max_seq_len=128)
    assert r.runtimes == ("onnx",) and r.modes == ("materialized", "factorized") and r.max_seq_len == 128


@pytest.mark.parametrize("bad", [dict(runtimes="onnx,tflite"), dict(modes="quantized"),
                                 dict(dtype="int3"), dict(max_seq_len=1), dict(runtimes="")])
def test_bad_recipe_values(bad):
    with pytest.raises(PitError):
        Recipe(**bad)


def test_recipe_files(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"runtimes": ["executorch"], "modes": ["factorized"], "max_seq_len": 96}))
    r = load_recipe(str(path))
    assert r.runtimes == ("executorch",) and r.max_seq_len == 96 and r.name == "mine"
    bad = tmp_path / "bad.toml"
    bad.write_text('runtimes = ["onnx"]\nquantize = "int8"\n')
    with pytest.raises(PitError, match="unknown field"):
        load_recipe(str(bad))
    with pytest.raises(PitError, match="unknown recipe"):
        load_recipe("no-such-recipe")


def test_parse_list_dedups_in_order():
    assert parse_list("factorized, materialized,factorized", ("materialized", "factorized"), "mode") == [
        "factorized", "materialized"]


def test_manifest_read_errors(tmp_path):
    with pytest.raises(PitError, match="not an export directory"):
        Manifest.read(tmp_path)
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(PitError, match="not valid JSON"):
        Manifest.read(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": "other"}')
    with pytest.raises(PitError, match="not a pit-deploy export manifest"):
        Manifest.read(tmp_path)
    with pytest.raises(PitError, match="not a directory"):
        Manifest.read(tmp_path / "missing")


def test_a_scheme_setting_is_declared_once():
    """Each ``SETTINGS`` entry is the ``Scheme`` field with its default, the export recipe's
    override field with its help, flag and choices, the run's ``[export]`` key, and the check of a
    value; every target reads only declared settings."""
    import dataclasses

    from pit_deploy.workflow.recipe import table_keys
    from pit_deploy.schemes import SETTINGS, Scheme
    from pit_deploy.targets import get_target, target_names

    scheme_fields = {f.name: f for f in dataclasses.fields(Scheme)}
    recipe_fields = {f.name: f for f in dataclasses.fields(Recipe)}
    for s in SETTINGS:
        assert scheme_fields[s.name].default == s.default and scheme_fields[s.name].type == s.annotation
        f = recipe_fields[s.name]
        assert f.default is None and f.type == f"{s.annotation} | None"
        assert (f.metadata["help"], f.metadata["flag"], f.metadata["group"]) == (s.help, s.flag, "quantization")
        assert f.metadata["choices"] == (s.values if s.cli_choices else None)
        assert s.name in table_keys("export")
        s.check(s.default)
        wrong = "x" if s.annotation != "str" else 3
        with pytest.raises(PitError, match=f"{s.name} must be"):
            s.check(wrong)
    for name in target_names():
        assert set(get_target(name).scheme_settings) <= {s.name for s in SETTINGS}, name


def test_scheme_and_recipe_fields_are_the_settings_typed():
    """Every SETTINGS entry is a typed field of Scheme (its default the entry's) and of Recipe (an
    optional override with the entry's flag), and neither has a setting field the entries lack."""
    from dataclasses import fields

    from pit_deploy.exporters.recipes import Recipe
    from pit_deploy.schemes import SETTINGS, Scheme

    scheme = {f.name: f for f in fields(Scheme)}
    recipe = {f.name: f for f in fields(Recipe)}
    for entry in SETTINGS:
        assert scheme[entry.name].type == entry.annotation and scheme[entry.name].default == entry.default
        assert recipe[entry.name].type == f"{entry.annotation} | None" and recipe[entry.name].default is None
        assert recipe[entry.name].metadata["flag"] == entry.flag and recipe[entry.name].metadata["help"] == entry.help
    quantization = {name for name, f in recipe.items() if f.metadata.get("group") == "quantization"}
    assert quantization == {entry.name for entry in SETTINGS}


def test_the_manifest_record_of_a_scheme_comes_from_the_settings():
    """``Scheme.settings()`` (what the manifest records) lists every SETTINGS entry a quantized
    scheme carries, as the entry says: the always-recorded ones always, the others only where
    the scheme changed them, each under its own name; a float32 scheme records its name only."""
    from pit_deploy.schemes import SETTINGS, get_scheme

    plain = get_scheme("int8").with_settings(head_activations="float32")
    assert set(plain.settings()) == {"name", "dtype"} | {e.name for e in SETTINGS if e.always_recorded}
    changed = get_scheme("int4").with_settings(pte_shared_table=True, rotate_residual=True, head_activations="int8",
                                               genai_group_size=64)
    record = changed.settings()
    assert set(record) == {"name", "dtype"} | {e.name for e in SETTINGS}
    assert record["int4_8bit_layers"] == list(changed.int4_8bit_layers) and record["pte_head_bits"] == changed.table_bits
    assert get_scheme("int8").with_settings(int4_8bit_layers=("v_proj",)).settings()["int4_8bit_layers"] == []
    assert get_scheme("float32").settings() == {"name": "float32", "dtype": "float32"}


def test_a_genai_group_size_that_does_not_fit_the_model_is_refused_before_any_work():
    """``genai_group_size`` is checked against the hidden size as ``group_size`` is, and names itself."""
    from types import SimpleNamespace

    from pit_deploy.errors import PitError
    from pit_deploy.exporters.recipes import Recipe

    config = SimpleNamespace(hidden_size=64, max_position_embeddings=512, model_type="llama")
    Recipe(runtimes=("onnx-genai",), dtype=("int4",), genai_group_size=64).check_model(config)
    with pytest.raises(PitError, match="genai_group_size 128 does not divide the hidden size 64"):
        Recipe(runtimes=("onnx-genai",), dtype=("int4",), genai_group_size=128).check_model(config)

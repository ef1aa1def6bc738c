"""Your own model, end to end: the README's "your own model" commands run as they are written, on
a tiny checkpoint of every family saved with ``save_pretrained``; and the checks that refuse
settings that cannot fit a model before any work.

The README block (between ``<!-- own-model:start -->`` and ``<!-- own-model:end -->``) is read
from README.md itself and run by bash with ``set -e``, ``MODEL`` set to the checkpoint and this
checkout's ``.venv/bin`` first on ``PATH``. One test per model, each in an xdist group of its own
pair, so the two CI workers share them (``tests/conftest.py`` otherwise keeps a file on one).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pit_deploy.cli import main
from pit_deploy.errors import PitError
from pit_deploy.tiny import tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
START, END = "<!-- own-model:start -->", "<!-- own-model:end -->"

#: the models the README's commands run on: every family, one with an untied head and one with
#: another vocabulary size (folded into two of the families: each model costs a full export)
MODELS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "qwen3-untied": ("qwen3", {"tie_word_embeddings": False}),
    "granite-vocab384": ("granite", {"vocab_size": 384}),
    "gemma": ("gemma", {}),
    "gpt2": ("gpt2", {}),
}


def readme_commands() -> str:
    """The one ```bash fence of the README's own-model block."""
    text = README.read_text(encoding="utf-8")
    assert text.count(START) == 1 and text.count(END) == 1, "README.md needs one own-model block"
    block = text[text.index(START) + len(START):text.index(END)]
    fences = re.findall(r"```bash\n(.*?)```", block, flags=re.S)
    assert len(fences) == 1, "the own-model block holds one ```bash fence"
    return fences[0]


def save_checkpoint(family: str, options: dict, out: Path) -> Path:
    """A tiny random model of ``family`` and its tokenizer, saved as a user would save theirs."""
    model = tiny_model(family, max_positions=512, **options)
    model.save_pretrained(out)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(out)
    return out


def venv_bin() -> Path:
    candidate = ROOT / ".venv" / "bin"
    return candidate if (candidate / "pit-deploy").exists() else Path(sys.executable).parent


def test_readme_block_is_short():
    commands = [line for line in readme_commands().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(commands) <= 6, commands
    assert any("--runtime all" in line for line in commands)


def _model_param(i: int, name: str):
    """The first model runs in the default tier, the others in the full tier only (each costs a
    full export of every target): the README's commands are the same for every family, and each
    family's export, verify and bench run in the default tier on tiny models elsewhere."""
    marks = [pytest.mark.xdist_group(f"test_own_model_{i % 2}")]
    if i > 0:
        marks.append(pytest.mark.full)
    return pytest.param(name, marks=marks)


@pytest.mark.parametrize("name", [_model_param(i, name) for i, name in enumerate(MODELS)])
def test_readme_commands_run_on_your_own_model(name, tmp_path):
    from pit_deploy.io.manifest import Manifest
    from pit_deploy.targets import get_target, target_names

    family, options = MODELS[name]
    model_dir = save_checkpoint(family, options, tmp_path / "your-model")
    env = {**os.environ, "MODEL": str(model_dir), "HF_HUB_OFFLINE": "1",
           "PATH": f"{venv_bin()}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(["bash", "-c", "set -e\n" + readme_commands()], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stderr[-4000:]}"
    exports = [p.parent for p in tmp_path.glob("**/manifest.json") if "reference" not in p.parts]
    assert len(exports) == 1, exports
    manifest = Manifest.read(exports[0])
    # fp32 and int4 of every installed target that builds this family's factorized model
    expected = {n for n in target_names() if get_target(n).installed() and "factorized" in get_target(n).modes
                and (get_target(n).model_types is None or family in get_target(n).model_types)}
    assert {a.runtime for a in manifest.artifacts} == expected
    for runtime in expected:
        assert {a.dtype for a in manifest.artifacts if a.runtime == runtime} == {"float32", "int4"}
    verified = json.loads((exports[0] / "manifest.json").read_text())["verification"]
    assert verified and verified.get("passed") is True


# --------------------------------------------------------------------------------------
# settings that cannot fit the model: exit 2 before any work
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint of 128 positions."""
    model = tiny_model("llama", max_positions=128)
    out = tmp_path_factory.mktemp("own") / "llama"
    model.save_pretrained(out)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(out)
    return out


def test_export_refuses_an_8bit_layer_that_names_no_linear(llama_dir, tmp_path, capsys):
    out = tmp_path / "export"
    code = main(["export", str(llama_dir), "--out", str(out), "--runtime", "onnx", "--mode", "factorized",
                 "--dtype", "int4", "--max-seq-len", "64", "--t-init", "identity", "--int4-8bit-layers", "v_proj,foo_proj"])
    err = capsys.readouterr().err
    assert code == 2
    assert "int4_8bit_layers" in err and "'foo_proj'" in err and "v_proj" in err.split("its linears:")[1]
    assert not out.exists()


def test_run_refuses_a_sequence_past_the_positions_before_convert(llama_dir, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["run", "default", "--model", str(llama_dir), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "train.seq_len 256" in err and "128 positions" in err and "train.seq_len=128" in err
    assert not out.exists()  # nothing converted, nothing written
    code = main(["run", "smoke", "--model", str(llama_dir), "--out", str(out), "--set", "export.max_seq_len=200"])
    assert code == 2 and "export.max_seq_len 200" in capsys.readouterr().err and not out.exists()


def test_run_refuses_layers_and_targets_that_do_not_fit(llama_dir, tmp_path):
    from pit_deploy.workflow.recipe import load_run_recipe
    from pit_deploy.workflow.validate import check_run_fits

    recipe = load_run_recipe("smoke", [f"run.model='{llama_dir}'", "export.int4_8bit_layers=['layers.7.mlp.down_proj']"])
    with pytest.raises(PitError, match=r"int4_8bit_layers: 'layers.7.mlp.down_proj' matches no linear"):
        check_run_fits(recipe)  # a 2-layer model
    gpt2 = tmp_path / "gpt2"
    tiny_model("gpt2").save_pretrained(gpt2)
    recipe = load_run_recipe("smoke", [f"run.model='{gpt2}'", "export.runtimes=['onnx-genai']"])
    with pytest.raises(PitError, match=r"onnx-genai.*'gpt2'"):
        check_run_fits(recipe)
    recipe = load_run_recipe("smoke", [f"run.model='{gpt2}'", "export.runtimes=['all']"])
    check_run_fits(recipe)
    chosen = recipe.export_recipe().for_model(recipe.source_config).runtimes
    assert "onnx-genai" not in chosen and "gguf" not in chosen and "onnx" in chosen


def test_int4_layers_are_named_as_the_family_names_them():
    """A scheme's 8-bit linears (``v_proj``, ``down_proj``) are GPT-2's ``attn.c_attn`` and
    ``mlp.c_proj``, each naming linears of the model; names a recipe gives stay as they are."""
    from pit_deploy.exporters.recipes import Recipe
    from pit_deploy.model.families import body_linears, skeleton
    from pit_deploy.schemes import get_scheme, names_linear
    from pit_deploy.tiny import tiny_config

    for family in ("llama", "gpt2"):
        config = tiny_config(family)
        linears = body_linears(skeleton(config))
        (int4,) = Recipe(runtimes=["onnx"], dtype=["int4"]).schemes(config)
        if family == "llama":
            assert int4.int4_8bit_layers == get_scheme("int4").int4_8bit_layers
        else:
            assert int4.int4_8bit_layers == ("attn.c_attn", "mlp.c_proj")
        assert all(any(names_linear(p, (n,)) for p in linears) for n in int4.int4_8bit_layers)
        (given,) = Recipe(runtimes=["onnx"], dtype=["int4"], int4_8bit_layers=["c_fc"]).schemes(config)
        assert given.int4_8bit_layers == ("c_fc",)


def test_the_default_models_settings_come_from_its_own_recipe():
    """The default run resolves table_bits and int4_8bit_layers from ``smollm2-135m`` (the bundled
    model, or a config of its shape); another model's run leaves them to the schemes; a key the
    run sets wins."""
    from pit_deploy.exporters.recipes import MODEL_RECIPES, load_recipe, model_recipe
    from pit_deploy.workflow.recipe import load_run_recipe

    tuned = load_recipe("smollm2-135m")
    default = load_run_recipe("default").export_recipe()
    assert (default.table_bits, default.int4_8bit_layers) == (tuned.table_bits, tuned.int4_8bit_layers)
    assert len(default.int4_8bit_layers) == 56
    other = load_run_recipe("default", ["run.model='some/dir'"]).export_recipe()
    assert other.table_bits is None and other.int4_8bit_layers is None
    assert model_recipe("some/dir", MODEL_RECIPES["smollm2-135m"]["config"]) == "smollm2-135m"
    assert load_run_recipe("default", ["export.table_bits=8"]).export_recipe().table_bits == 8


def test_list_shows_what_the_registries_hold(capsys):
    from pit_deploy.model.families import _REGISTRY, FamilyAdapter, register_family
    from pit_deploy.schemes import INT4_BOUNDS, SCHEMES, Scheme, register_scheme
    from pit_deploy.targets import get_target, target_names

    register_scheme(Scheme("test-own-int4", "int4", INT4_BOUNDS, "a scheme registered by a test", runtimes=("onnx",)))
    register_family(FamilyAdapter("testfamily", ("test-model-type",)))
    try:
        assert main(["list"]) == 0
        out = capsys.readouterr().out
    finally:
        SCHEMES.pop("test-own-int4", None)
        _REGISTRY.pop("test-model-type", None)
    sections = {s.split(":\n", 1)[0]: s.split(":\n", 1)[1] for s in out.strip().split("\n\n")}
    assert set(sections) == {"targets", "schemes", "recipes", "families"}
    for name in target_names():
        row = next(line for line in sections["targets"].splitlines() if line.split()[0] == name)
        assert ",".join(get_target(name).dtypes) in row
    row = next(line for line in sections["schemes"].splitlines() if line.startswith("test-own-int4 "))
    assert row.split()[1:3] == ["int4", "onnx"]
    assert any(line.split()[:2] == ["testfamily", "test-model-type"] for line in sections["families"].splitlines())
    assert any(line.split()[:2] == ["export", "smollm2-135m"] for line in sections["recipes"].splitlines())
    assert main(["list", "schemes"]) == 0 and "targets:" not in capsys.readouterr().out
    assert main(["list", "nothing"]) == 2

"""Commands that write one export directory at once never lose data or record into the wrong
export; paths a target's own config names stay inside the artifact; a model or input the
exporters cannot serve is one exit-2 line before any work (docs/conventions.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pit_deploy.cli import main
from pit_deploy.io.checkpoint import save_model
from pit_deploy.tiny import tiny_model, tiny_pit_model, tiny_tokenizer

PIT_DEPLOY = Path(sys.executable).with_name("pit-deploy")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("reliability") / "pit"
    save_model(tiny_pit_model("llama"), src, tiny_tokenizer())
    return src


@pytest.fixture(scope="module")
def onnx_export(source) -> Path:
    out = source.parent / "exp"
    assert main(["export", str(source), "--out", str(out), "--recipe", "tiny-ci", "--runtime", "onnx",
                 "--mode", "materialized"]) == 0
    return out


def _copy(export: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(export, target)
    return target


def _hold_lock(target: Path, what: str, then: str = "", keep: bool = True) -> subprocess.Popen:
    """A real process that holds ``target``'s lock (as a command writing it does), runs the
    Python statements ``then`` under it, and keeps it (``keep``) until :func:`_stop`; returns
    once it holds it."""
    code = textwrap.dedent(f"""
        import json, sys, time
        from pathlib import Path
        from pit_deploy.io.fs import lock_target
        with lock_target({str(target)!r}, {what!r}):
            print("locked", flush=True)
            {then or "pass"}
            if {keep}:
                sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=ENV)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


# ----------------------------------------------------------------------------------------
# Locks: export and verify take the export directory's lock; replacement is one step
# ----------------------------------------------------------------------------------------


def test_export_while_another_command_writes_the_directory_is_exit_2_naming_it(onnx_export, tmp_path):
    """A second export into a directory another process is writing (here: replacing it with
    --force) is refused, naming the first by its PID; the existing export is left as it was."""
    out = _copy(onnx_export, tmp_path)
    before = (out / "manifest.json").read_bytes()
    holder = _hold_lock(out, "export")
    try:
        run = subprocess.run([str(PIT_DEPLOY), "export", str(onnx_export / "reference"), "--out", str(out), "--force",
                              "--recipe", "tiny-ci", "--runtime", "onnx", "--mode", "materialized"],
                             capture_output=True, text=True, env=ENV, timeout=240)
    finally:
        _stop(holder)
    assert run.returncode == 2, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"pid {holder.pid}" in errors[0] and "Traceback" not in run.stderr
    assert (out / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]  # nothing hidden or left beside it


def test_force_replaces_a_directory_in_one_step_and_leaves_nothing_beside_it(tmp_path, monkeypatch):
    from pit_deploy.io import fs

    out = tmp_path / "exp"
    out.mkdir()
    (out / "old.txt").write_text("old")
    for exchange in (True, False):  # renameat2(RENAME_EXCHANGE), and the two renames elsewhere
        if not exchange:
            monkeypatch.setattr(fs, "exchange_paths", lambda a, b: False)
        seen = []
        with fs.atomic_directory(out, force=True, lock="export") as tmp:
            (tmp / "new.txt").write_text(str(exchange))
            seen.append(fs.target_lock_path(out).is_file())
        assert seen == [True]
        assert sorted(p.name for p in out.iterdir()) == ["new.txt"] and (out / "new.txt").read_text() == str(exchange)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]  # no .exp.old-PID, no lock file left


def test_exchange_keeps_the_path_present(tmp_path):
    from pit_deploy.io.fs import exchange_paths

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    (b / "x").write_text("b")
    if not exchange_paths(a, b):
        pytest.skip("this system cannot exchange two paths in one step")
    assert (a / "x").read_text() == "b" and (b / "x").read_text() == "a"


def test_a_replacement_a_killed_process_left_is_removed_by_the_next_write(tmp_path):
    from pit_deploy.io.fs import atomic_directory

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    for name in (f".exp.partial-{dead}-old", f".exp.old-{dead}"):  # this version's, and earlier versions'
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.onnx").write_text("a previous export")
    with atomic_directory(tmp_path / "exp", force=True, lock="export") as tmp:
        (tmp / "f").write_text("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]


def test_verify_records_only_into_the_export_it_measured(onnx_export, tmp_path, capsys, monkeypatch):
    """The export is replaced (its manifest changes) while verify measures the old files: the
    results are not written into the new export's manifest."""
    from pit_deploy.evaluate import verify

    out = _copy(onnx_export, tmp_path)
    load = verify.load_reference

    def replaced_meanwhile(directory):
        data = json.loads((out / "manifest.json").read_text())
        data["source"]["replaced"] = True  # what another export --force into it would do
        (out / "manifest.json").write_text(json.dumps(data, indent=2))
        return load(directory)

    monkeypatch.setattr(verify, "load_reference", replaced_meanwhile)
    capsys.readouterr()
    assert main(["verify", str(out)]) == 2
    err = capsys.readouterr().err
    assert "replaced" in err and "not recorded" in err
    assert json.loads((out / "manifest.json").read_text())["verification"] is None


def test_two_verifies_recording_at_once_both_keep_their_results(onnx_export, tmp_path, capsys, monkeypatch):
    """Another process records into the manifest (under the lock, read-modify-write taking a
    while) just as this verify records: neither result is lost."""
    from pit_deploy.evaluate import verify

    out = _copy(onnx_export, tmp_path)
    other = {"runtime": "onnx", "mode": "factorized", "dtype": "float32", "scheme": "float32", "passed": True}
    then = textwrap.dedent(f"""
        path = Path({str(out / "manifest.json")!r})
        data = json.loads(path.read_text())
        print("read", flush=True)
        time.sleep(4)
        data["verification"] = {{"passed": True, "artifacts": [{other!r}]}}
        path.write_text(json.dumps(data, indent=2))
    """).replace("\n", "\n            ")
    load, holders = verify.load_reference, []

    def another_verify_records(directory):
        holders.append(_hold_lock(out, "verify", then=then, keep=False))
        return load(directory)

    monkeypatch.setattr(verify, "load_reference", another_verify_records)
    try:
        assert main(["verify", str(out)]) == 0
    finally:
        for proc in holders:
            _stop(proc)
    recorded = json.loads((out / "manifest.json").read_text())["verification"]
    keys = sorted(f"{a['runtime']}-{a['mode']}" for a in recorded["artifacts"])
    assert keys == ["onnx-factorized", "onnx-materialized"], keys


# ----------------------------------------------------------------------------------------
# Paths: what a runtime opens is a manifest-listed file inside the artifact
# ----------------------------------------------------------------------------------------


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


def _unlist(directory: Path, rel: str) -> None:
    """Drop ``rel`` from the manifest's file tables (as an export that never wrote it)."""
    def edit(data):
        for art in data["artifacts"]:
            art["files"].pop(rel, None)
    _edit_json(directory / "manifest.json", edit)


@pytest.fixture(scope="module")
def gguf_export(source) -> Path:
    out = source.parent / "gguf"
    assert main(["export", str(source), "--out", str(out), "--runtime", "gguf", "--mode", "materialized",
                 "--dtype", "float32"]) == 0
    return out


def _refused(args: list[str], capsys, *names: str) -> str:
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and all(n in errors[0] for n in names), err[-1500:]
    return errors[0]


@pytest.mark.parametrize("how", ["absolute", "dotdot", "unlisted", "symlink"])
def test_gguf_spec_naming_a_file_the_digests_do_not_cover_is_exit_2(gguf_export, tmp_path, capsys, how):
    from scramble import rehash

    out = _copy(gguf_export, tmp_path)
    folder = out / "gguf-materialized"
    gguf = folder / "model-f32.gguf"
    outside = tmp_path / "other.gguf"
    shutil.copy(gguf, outside)
    if how == "symlink":  # the listed name, a link to a file anywhere (its digest still matches)
        gguf.unlink()
        gguf.symlink_to(outside)
        name = "model-f32.gguf"
    else:
        name = {"absolute": str(outside), "dotdot": "../../other.gguf", "unlisted": "other.gguf"}[how]
        if how == "unlisted":
            shutil.copy(gguf, folder / "other.gguf")
        _edit_json(folder / "llama_cpp.json", lambda spec: spec.update(file=name))
    rehash(out)
    named = ("model-f32.gguf", "outside") if how == "symlink" else ("llama_cpp.json", '"file"')
    _refused(["verify", str(out), "--no-record"], capsys, *named)
    if how == "absolute":
        _refused(["bench", str(out), "--threads", "1", "--reps", "1"], capsys, "llama_cpp.json", '"file"')


@pytest.mark.parametrize("key, value", [("context_length", 8), ("kv_cache_type", "q4_0")])
def test_gguf_spec_settings_llama_cpp_cannot_use_are_exit_2_naming_them(gguf_export, tmp_path, capsys, key, value):
    from scramble import rehash

    out = _copy(gguf_export, tmp_path)
    _edit_json(out / "gguf-materialized" / "llama_cpp.json", lambda spec: spec.update({key: value}))
    rehash(out)
    _refused(["verify", str(out), "--no-record"], capsys, "llama_cpp.json", key)


def test_a_bundle_naming_a_file_outside_it_is_refused_on_the_device(tmp_path, capsys):
    from pit_deploy.runtime.standalone import BUNDLE_SPEC, bundle_main

    spec = {"threads": [1], "reps": 1, "gen_len": 4, "prompts": {}, "reference_tokens": {},
            "artifacts": [{"artifact": "x/gguf-materialized", "runtime": "gguf", "folder": "artifacts/x",
                           "file": "/etc/hostname", "requires": {"module": "json", "pip": "json"}}]}
    (tmp_path / BUNDLE_SPEC).write_text(json.dumps(spec))
    assert bundle_main([], root=tmp_path) == 2
    assert "not a plain relative path" in capsys.readouterr().err


@pytest.fixture(scope="module")
def genai_export(source) -> Path:
    pytest.importorskip("onnxruntime_genai")
    out = source.parent / "genai"
    assert main(["export", str(source), "--out", str(out), "--runtime", "onnx-genai", "--mode", "materialized",
                 "--dtype", "float32"]) == 0
    return out


GENAI = "onnx-genai-materialized"


@pytest.mark.parametrize("how, names", [
    ("another decoder", ["genai_config.json", "model.decoder.filename"]),
    ("absolute", ["genai_config.json", "model.decoder.filename"]),
    ("head_size", ["genai_config.json", "head_size"]),
    ("context_length", ["genai_config.json", "model.context_length"]),
    ("no tokenizer", ["tokenizer.json"]),
])
def test_genai_folder_its_runtime_would_load_otherwise_is_exit_2(genai_export, tmp_path, capsys, how, names):
    from scramble import rehash

    out = _copy(genai_export, tmp_path)
    folder = out / GENAI
    config = folder / "genai_config.json"
    if how == "another decoder":  # a listed file, but not the decoder verify measures
        _edit_json(config, lambda c: c["model"]["decoder"].update(filename="interface.onnx"))
    elif how == "absolute":
        _edit_json(config, lambda c: c["model"]["decoder"].update(filename=str(folder / "model.onnx")))
    elif how == "head_size":
        _edit_json(config, lambda c: c["model"]["decoder"].update(head_size=8))
    elif how == "context_length":  # shorter than any generation: onnxruntime-genai's RuntimeError before
        _edit_json(config, lambda c: c["model"].update(context_length=4))
    else:
        (folder / "tokenizer.json").unlink()
        _unlist(out, f"{GENAI}/tokenizer.json")
    rehash(out)
    _refused(["verify", str(out), "--no-record"], capsys, *names)


def test_genai_interface_file_that_is_not_an_interface_graph_is_exit_2(genai_export, tmp_path, capsys):
    from scramble import rehash

    out = _copy(genai_export, tmp_path)
    folder = out / GENAI
    import onnx

    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "g",
                                   [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, folder / "interface.onnx")
    rehash(out)
    _refused(["verify", str(out), "--no-record"], capsys, "interface.onnx", "not an interface graph")


def test_genai_generator_that_differs_from_the_measured_session_fails(genai_export, monkeypatch):
    """The generator check is a bound (exit 1 through the artifact's failures), not a note."""
    from types import SimpleNamespace

    import numpy as np
    import onnxruntime_genai as og

    from pit_deploy.evaluate.verify import ArtifactResult
    from pit_deploy.targets.onnx_genai.driver import check_generator

    real = og.Generator

    class Other:  # what another decoder named by the config would compute
        def __init__(self, *args):
            self.inner = real(*args)

        def append_tokens(self, tokens):
            self.inner.append_tokens(tokens)

        def get_output(self, name):
            return np.asarray(self.inner.get_output(name)) * 1.5

    result = ArtifactResult(runtime="onnx-genai", mode="materialized", logits_rel_l2=0.0, top1_agreement=1.0,
                            greedy_match=True, greedy_tokens=32, delta_ti=0.0)
    ctx = SimpleNamespace(directory=genai_export)
    check_generator(ctx, SimpleNamespace(path=GENAI), result, False)
    assert result.judge().passed  # the honest folder: the generator runs the measured graph
    monkeypatch.setattr(og, "Generator", Other)
    check_generator(ctx, SimpleNamespace(path=GENAI), result, False)
    assert not result.judge().passed
    assert any("generator differs" in f for f in result.failures), result.failures


# ----------------------------------------------------------------------------------------
# A model or input the exporters cannot serve: one exit-2 line before any work
# ----------------------------------------------------------------------------------------


def _saved(tmp_path: Path, pit: bool = True, **kwargs) -> Path:
    from pit_deploy.tiny import tiny_model

    src = tmp_path / "src"
    save_model(tiny_pit_model("llama", **kwargs) if pit else tiny_model("llama", **kwargs), src, tiny_tokenizer())
    return src


def test_genai_export_of_a_head_size_its_attention_cannot_run_is_exit_2(tmp_path, capsys):
    pytest.importorskip("onnxruntime_genai")
    src = _saved(tmp_path, hidden_size=96)  # 4 heads of 24
    out = tmp_path / "exp"
    _refused(["export", str(src), "--out", str(out), "--runtime", "onnx-genai", "--mode", "materialized"], capsys,
             "head size", "24", "16")
    assert not out.exists()


def test_gguf_q8_0_of_widths_not_in_blocks_of_32_is_exit_2_before_writing(tmp_path, capsys):
    src = _saved(tmp_path, hidden_size=100)  # MLP width 200
    out = tmp_path / "exp"
    _refused(["export", str(src), "--out", str(out), "--runtime", "gguf", "--mode", "materialized",
              "--dtype", "float32,q8_0"], capsys, "q8_0", "intermediate_size 200", "32")
    assert not out.exists()


@pytest.mark.parametrize("command", ["convert-preserve", "export-identity-gguf", "export-pit"])
def test_a_tokenizer_with_more_ids_than_the_vocabulary_is_exit_2(tmp_path, capsys, command):
    ids = len(tiny_tokenizer())
    src = _saved(tmp_path, pit=command == "export-pit", vocab_size=ids - 64)
    out = tmp_path / "out"
    args = {"convert-preserve": ["convert", "--model", str(src), "--out", str(out), "--t-init", "preserve"],
            "export-identity-gguf": ["export", str(src), "--out", str(out), "--t-init", "identity", "--runtime", "gguf",
                                     "--mode", "materialized"],
            "export-pit": ["export", str(src), "--out", str(out), "--runtime", "onnx", "--mode", "materialized"]}[command]
    _refused(args, capsys, f"{ids} ids", f"vocabulary {ids - 64}")
    assert not out.exists()


def test_foreign_load_is_never_more_cores_than_the_machine_has():
    """Busy time is counted in clock ticks per core: over a few milliseconds the difference can
    exceed the cores there are; such a window reports nothing, a longer one at most every core."""
    from pit_deploy.runtime.standalone import LoadWindow

    cores = os.cpu_count() or 1
    short = LoadWindow(wall_s=0.008, machine_busy_s=0.03 * cores, process_cpu_s=0.0)
    assert short.foreign_cores is None
    long = LoadWindow(wall_s=2.0, machine_busy_s=2.0 * cores + 0.5, process_cpu_s=0.0)
    assert long.foreign_cores == cores


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_genai_export_leaves_no_builder_and_no_checkpoint_copy(source, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    from pit_deploy.io.fs import remove_stale_partials

    out = tmp_path / "exp"
    temp = tmp_path / "system-temp"
    temp.mkdir()
    export = subprocess.Popen([str(PIT_DEPLOY), "export", str(source), "--out", str(out), "--runtime", "onnx-genai",
                               "--mode", "materialized"], env={**ENV, "TMPDIR": str(temp)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while not (builders := _children(export.pid)) and export.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert builders, "the export started no builder"
        export.kill()
        export.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
                  for pid in builders) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = [pid for pid in builders if Path(f"/proc/{pid}").exists()
                 and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
        assert not alive, "the builder outlived the killed export"
    finally:
        if export.poll() is None:
            export.kill()
    assert not list(temp.iterdir())  # no checkpoint copy in the system temp folder
    remove_stale_partials(tmp_path, "exp")  # what the next export of exp does first
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != ".exp.pit-deploy.lock")  # taken over next time
    assert left == ["system-temp"]


# ----------------------------------------------------------------------------------------
# Settings that do not apply are refused before any work, naming the key and the fix
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["rounding flag", "rounding key", "rotate_residual key", "group_size flag",
                                 "table_bits flag", "pit_correction flag", "int4_8bit_layers key", "pte_head_bits key"])
def test_a_quantization_setting_without_a_quantized_dtype_is_exit_2(source, tmp_path, capsys, how):
    out = tmp_path / "exp"
    args = ["export", str(source), "--out", str(out), "--runtime", "executorch", "--mode", "factorized",
            "--dtype", "float32", "--max-seq-len", "64"]
    key, kind = how.split(" ")
    flags = {"rounding": ["--rounding", "gptq"], "group_size": ["--group-size", "64"],
             "table_bits": ["--table-bits", "8"], "pit_correction": ["--no-pit-correction"]}
    keys = {"rounding": 'rounding = "gptq"', "rotate_residual": "rotate_residual = true",
            "int4_8bit_layers": 'int4_8bit_layers = ["down_proj"]', "pte_head_bits": "pte_head_bits = 8"}
    if kind == "flag":
        args += flags[key]
    else:
        recipe = tmp_path / "mine.toml"
        recipe.write_text(keys[key] + "\n")
        args += ["--recipe", str(recipe)]
    _refused(args, capsys, key, "float32", "int4")
    assert not out.exists()


def test_a_run_that_exports_float32_beside_a_quantized_scheme_gives_each_its_own_settings():
    """``pit-deploy run`` writes one export directory a scheme: the float32 one gets none of the
    quantization settings (which it would refuse), the int4 one all of them."""
    from pit_deploy.exporters.recipes import Recipe

    recipe = Recipe(runtimes=("onnx",), dtype=("float32", "int4"), group_size=64, rounding="rtn",
                    bounds={"int4": {"kl_mean": 1.0}})
    assert recipe.only("float32").overrides() == {} and recipe.only("float32").bounds == {}
    assert recipe.only("int4").overrides() == {"group_size": 64, "rounding": "rtn"}
    assert recipe.only("int4").bounds == {"int4": {"kl_mean": 1.0}}


def test_a_max_seq_len_past_the_model_positions_is_exit_2_on_every_target(source, tmp_path, capsys):
    from types import SimpleNamespace

    from pit_deploy.errors import PitError
    from pit_deploy.exporters.recipes import MAX_SEQ_LEN_CEILING, Recipe

    out = tmp_path / "exp"
    _refused(["export", str(source), "--out", str(out), "--runtime", "gguf", "--mode", "materialized",
              "--max-seq-len", "1000000000000"], capsys, "max_seq_len 1000000000000", "128 positions", "--max-seq-len")
    assert not out.exists()
    gguf = Recipe(runtimes=("gguf",), modes=("materialized",), max_seq_len=MAX_SEQ_LEN_CEILING + 1)
    with pytest.raises(PitError, match="declares no limit"):  # a config without positions: the ceiling
        gguf.check_model(SimpleNamespace(hidden_size=64, model_type="llama"))
    Recipe(runtimes=("gguf",), modes=("materialized",)).check_model(SimpleNamespace(hidden_size=64,
                                                                                    max_position_embeddings=128))


# ----------------------------------------------------------------------------------------
# Refusals a target can make from the model and the recipe come before any slow work
# ----------------------------------------------------------------------------------------


def test_a_linear_the_genai_builder_has_no_node_for_is_refused_before_gptq(source, tmp_path, capsys, monkeypatch):
    """A linear the model has but the builder does not write (simulated: the model-side name
    check passes) is refused by the target's precheck, before calibration or GPTQ starts."""
    pytest.importorskip("onnxruntime_genai")
    from pit_deploy.exporters import pipeline, recipes
    from pit_deploy.exporters.recipes import Recipe
    from pit_deploy.targets import get_target

    def no_gptq(*args, **kwargs):
        raise AssertionError("GPTQ started")

    monkeypatch.setattr(recipes, "check_layer_names", lambda *a, **k: None)
    monkeypatch.setattr(pipeline._Calibration, "model", no_gptq)
    out = tmp_path / "exp"
    _refused(["export", str(source), "--out", str(out), "--runtime", "onnx-genai", "--mode", "factorized",
              "--dtype", "int4", "--int4-8bit-layers", "v_proj,c_fc"], capsys,
             "int4_8bit_layers", "'c_fc'", "builder", "down_proj")
    assert not out.exists()
    from pit_deploy.io.checkpoint import load_config

    config = load_config(source)
    target = get_target("onnx-genai")
    target.precheck(config, Recipe(runtimes=("onnx-genai",), dtype=("float32", "int4")))  # the scheme's own names
    with pytest.raises(Exception, match="c_fc"):
        target.precheck(config, Recipe(runtimes=("onnx-genai",), dtype=("int4",), int4_8bit_layers=("c_fc",)))


def test_a_pre_tokenizer_llama_cpp_lacks_is_refused_before_any_conversion(tmp_path, capsys, monkeypatch):
    from tokenizers import pre_tokenizers

    from pit_deploy.targets.gguf import export as to_gguf

    tokenizer = tiny_tokenizer()
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    src = tmp_path / "src"
    save_model(tiny_pit_model("llama"), src, tokenizer)

    def no_conversion(*args, **kwargs):
        raise AssertionError("the GGUF conversion started")

    monkeypatch.setattr(to_gguf, "gguf_tensors", no_conversion)
    out = tmp_path / "exp"
    _refused(["export", str(src), "--out", str(out), "--runtime", "gguf", "--mode", "materialized"], capsys,
             "pre-tokenizer", "WhitespaceSplit", "--runtime")
    assert not out.exists()


def test_run_refuses_a_pre_tokenizer_llama_cpp_lacks_before_any_stage(tmp_path, capsys):
    """``pit-deploy run`` with the gguf target checks the source's tokenizer with the recipe, not
    at its export stage after conversion and training."""
    from tokenizers import pre_tokenizers
    from transformers import AutoConfig

    tokenizer = tiny_tokenizer()
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    src = tmp_path / "src"
    model = tiny_model("llama")
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)
    assert AutoConfig.from_pretrained(src).model_type == "llama"
    out = tmp_path / "run"
    _refused(["run", "smoke", "--model", str(src), "--data", "default", "--out", str(out),
              "--set", 'export.runtimes=["gguf"]', "--set", 'export.modes=["materialized"]',
              "--set", 'export.dtype=["float32"]'], capsys, "[export]", "pre-tokenizer", "WhitespaceSplit")
    assert not list(out.glob("*-convert"))


# ----------------------------------------------------------------------------------------
# Resuming a training run: run.json says what the resumed run used; a refusal names the flag
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def train_assets(tmp_path_factory):
    from train_fixtures import make_corpus, make_model_dir

    root = tmp_path_factory.mktemp("train")
    return make_model_dir(root), make_corpus(root, n_docs=12)


def test_a_resumed_run_records_the_values_it_used_and_which_changed(train_assets, tmp_path, capsys):
    from train_fixtures import config

    from pit_deploy.training.loop import train

    model, corpus = train_assets  # identity: a conversion of no cost, the same on resume
    run = tmp_path / "r"
    train(config(run, model, corpus, t_init="identity", steps=2, save_every=2, eval_every=0))
    assert json.loads((run / "run.json").read_text())["steps"] == 2
    capsys.readouterr()
    train(config(run, model, corpus, t_init="identity", steps=3, t_max_cond=500.0, save_every=2, eval_every=0,
                 resume=True))
    record = json.loads((run / "run.json").read_text())
    assert record["steps"] == 3 and record["t_max_cond"] == 500.0 and record["resume"] is True
    (resumed,) = record["resumes"]
    assert resumed["step"] == 2 and resumed["changed"] == {"steps": [2, 3], "t_max_cond": [1000.0, 500.0]}
    err = capsys.readouterr().err
    assert "--steps 2 → 3" in err and "--t-max-cond 1000.0 → 500.0" in err, err[-800:]



def test_a_changed_interface_only_on_resume_is_named_by_its_flag(train_assets, tmp_path):
    from train_fixtures import config

    from pit_deploy.errors import PitError
    from pit_deploy.training.loop import train

    model, corpus = train_assets  # identity: a conversion of no cost, the same on resume
    run = tmp_path / "r"
    train(config(run, model, corpus, t_init="identity", steps=2, save_every=2, eval_every=0))
    with pytest.raises(PitError) as refused:
        train(config(run, model, corpus, t_init="identity", steps=4, save_every=2, eval_every=0, train_body=False,
                     resume=True))
    message = str(refused.value)
    assert "--interface-only" in message and "train_body" not in message, message


# ----------------------------------------------------------------------------------------
# llama.cpp's log: a warning at most once per process
# ----------------------------------------------------------------------------------------


def test_llama_cpp_context_warning_is_printed_at_most_once(gguf_export):
    """The model has 128 positions and llama.cpp rounds every context up to 256: its warning of a
    possible overflow came once per context (decoders, the interface read), about ten times per
    verify of a quantized file; errors still pass through."""
    pytest.importorskip("llama_cpp")
    gguf = gguf_export / "gguf-materialized" / "model-f32.gguf"
    code = textwrap.dedent(f"""
        from pit_deploy.targets.gguf.decoder import LlamaCppDecoder
        from pit_deploy.targets.gguf.interface import runtime_interface
        for _ in range(3):
            LlamaCppDecoder({str(gguf)!r}, 1).close()
        runtime_interface({str(gguf)!r}, 1)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-1500:]
    assert done.stderr.count("n_ctx_train (128)") == 1, done.stderr[-1500:]

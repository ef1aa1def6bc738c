"""``verify --isa aarch64 --full``: a tiny model's fp32 and int4 ONNX artifacts run on onnxruntime's
aarch64 kernels under qemu (``scripts/setup_aarch64.sh``), judged by verify's own bounds (the
default compact check is ``test_cross_isa.py``'s); a
corrupted weight fails there as on x86; the same model's fp32 and int4 ``.pte`` programs run on the
ExecuTorch runtime's aarch64 wheel and pass, and are not checked (never passed) on ARMv8.0; a
``.gguf`` is listed as not checked, never passed; a missing set-up is exit 2 naming the script;
``bench`` cannot be pointed at the emulated runtime.

Emulated code runs 50-100x slower than native: one export (fp32 + int4, ``--max-seq-len 64``)
serves every test, and each verify asks for the fewest CPU profiles that show the point.
"""

from __future__ import annotations

import json
import platform
import shutil
from pathlib import Path

import numpy as np
import pytest

from pit_deploy.cli import main
from pit_deploy.evaluate.verify import verify_directory
from pit_deploy.io.checkpoint import save_model
from pit_deploy.io.manifest import MANIFEST_NAME, Manifest
from pit_deploy.tiny import tiny_pit_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def _export_tiny(tmp_path_factory, runtime: str) -> Path:
    """A tiny Llama's factorized fp32 and int4 artifacts of ``runtime`` (plain rounding: quick)."""
    root = tmp_path_factory.mktemp(f"arm-{runtime}")
    src = root / "src"
    save_model(tiny_pit_model("llama"), src, tiny_tokenizer())
    out = root / "exp"
    assert main(["export", str(src), "--out", str(out), "--runtime", runtime, "--mode", "factorized",
                 "--dtype", "float32,int4", "--rounding", "rtn", "--max-seq-len", "64"]) == 0
    return out


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    return _export_tiny(tmp_path_factory, "onnx")


@pytest.fixture(scope="module")
def pte_export(tmp_path_factory) -> Path:
    """The same tiny model's fp32 and int4 ``.pte`` programs."""
    return _export_tiny(tmp_path_factory, "executorch")


def _copy(export: Path, tmp_path: Path) -> Path:
    out = tmp_path / "exp"
    shutil.copytree(export, out)
    return out


def _verify_json(capsys, *argv: str) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(["verify", *argv, "--no-record", "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_fp32_and_int4_pass_on_two_cpu_profiles(arm_setup, export, capsys):
    before = json.loads((export / MANIFEST_NAME).read_text()).get("verification")
    capsys.readouterr()
    assert main(["verify", str(export), "--isa", "aarch64", "--arm-cpu", "cortex-a53,max", "--full", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["artifacts"]
    assert [(r["scheme"], r["arm_cpu"]) for r in rows] == [
        ("float32", "cortex-a53"), ("float32", "max"), ("int4", "cortex-a53"), ("int4", "max")]
    for r in rows:
        assert r["isa"] == "aarch64" and r["kleidiai"] == "on" and r["checked"] and r["passed"], r["failures"]
        assert r["delta_ti"] <= 1e-5 and r["emulated_s"] > 0
        assert any("aarch64 kernels" in n and "not a latency" in n for n in r["notes"])
        if r["scheme"] == "float32":
            assert r["logits_rel_l2"] <= 1e-4 and r["top1_agreement"] == 1 and r["greedy_match"]
        else:
            assert r["kl_mean"] is not None and r["heldout_tokens"] > 0 and r["logits_rel_l2"] is None
    # only x86-64 results are recorded: the manifest's verification block is untouched
    assert json.loads((export / MANIFEST_NAME).read_text()).get("verification") == before


def test_a_corrupted_weight_fails_on_aarch64_as_on_x86(arm_setup, export, tmp_path, capsys):
    import onnx

    from pit_deploy.targets.onnx import data_name, decoder_file
    from scramble import rehash

    out = _copy(export, tmp_path)
    art = next(a for a in Manifest.read(out).artifacts if a.scheme_name == "float32")
    decoder = decoder_file(out / art.path)
    graph = onnx.load(str(decoder), load_external_data=False).graph
    body = [i for i in graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL and len(i.dims) == 2
            and not i.name.startswith("pit")]  # a body linear's weight, not the interface's factors
    assert body, "no external 2-D body weight"
    where = {e.key: e.value for e in body[0].external_data}
    offset, length = int(where["offset"]), int(where["length"])
    data = decoder.with_name(data_name(decoder.name))
    raw = bytearray(data.read_bytes())
    raw[offset:offset + length] = np.random.default_rng(0).standard_normal(length // 4).astype(np.float32).tobytes()
    data.write_bytes(bytes(raw))
    rehash(out)
    code, report = _verify_json(capsys, str(out), "--dtype", "float32", "--isa", "x86_64,aarch64",
                                "--arm-cpu", "cortex-a53")
    assert code == 1
    x86, arm = report["artifacts"]
    assert (x86["isa"], arm["isa"], arm["arm_cpu"]) == ("x86_64", "aarch64", "cortex-a53")
    for r in (x86, arm):
        assert not r["passed"] and any("rel_l2" in f for f in r["failures"]), r["failures"]


def test_a_gguf_is_listed_as_not_checked_never_passed(arm_setup, export, tmp_path, capsys):
    """A ``.gguf`` artifact beside the ONNX one (a stand-in file: llama.cpp has no emulated build,
    so it must never be loaded, only reported); a selection of nothing but it is refused, exit 2."""
    from scramble import rehash

    out = _copy(export, tmp_path)
    data = json.loads((out / MANIFEST_NAME).read_text())
    fp32 = next(a for a in data["artifacts"] if a.get("scheme", a["dtype"]) == "float32")
    folder = out / "gguf-materialized"
    folder.mkdir()
    (folder / "model.gguf").write_bytes(b"\0" * 64)
    (folder / "llama_cpp.json").write_text(json.dumps({"file": "model.gguf"}))
    gguf = {**fp32, "target": "gguf", "mode": "materialized", "path": folder.name, "details": {},
            "files": {f"{folder.name}/{name}": {"sha256": "", "bytes": 0} for name in ("model.gguf", "llama_cpp.json")}}
    data["artifacts"].append(gguf)
    (out / MANIFEST_NAME).write_text(json.dumps(data))
    rehash(out)
    report = verify_directory(out, dtypes="float32", isa="aarch64", arm_cpu="cortex-a53", record=False)
    onnx_row, gguf_row = report.artifacts
    assert onnx_row.checked and onnx_row.passed, onnx_row.failures
    assert gguf_row.runtime == "gguf" and not gguf_row.checked and not gguf_row.passed and gguf_row.notes
    assert report.passed  # what exit code 0 says: every checked artifact passed, at least one checked
    table = str(report)
    row = next(line for line in table.splitlines() if line.startswith("gguf-materialized"))
    assert "not checked on aarch64" in row and "pass" not in row.split("not checked")[0]
    assert "1 not checked" in table and "all artifacts passed" not in table
    capsys.readouterr()
    assert main(["verify", str(out), "--runtime", "gguf", "--isa", "aarch64", "--no-record"]) == 2
    assert "none of the selected artifacts can run on aarch64" in capsys.readouterr().err


def test_pte_fp32_and_int4_pass_on_max_and_are_not_checked_on_a53(arm_setup, pte_export, capsys):
    """Both programs run in one emulated process on ``max`` and pass verify's bounds there, with
    ``delta_ti`` measured through the program's own ``embed``/``head``; on ARMv8.0 (cortex-a53)
    the wheel cannot run, so those rows are not checked, never passed, and exit 0 still needs the
    checked ones to pass. Only ARMv8.0 profiles selected: nothing would be checked, exit 2."""
    code, report = _verify_json(capsys, str(pte_export), "--isa", "aarch64", "--arm-cpu", "cortex-a53,max", "--full")
    assert code == 0, report
    rows = report["artifacts"]
    assert [(r["scheme"], r["arm_cpu"]) for r in rows] == [
        ("float32", "cortex-a53"), ("float32", "max"), ("int4", "cortex-a53"), ("int4", "max")]
    for r in rows:
        assert r["isa"] == "aarch64" and r["runtime"] == "executorch" and r["kleidiai"] is None
        if r["arm_cpu"] == "cortex-a53":
            assert not r["checked"] and not r["passed"] and any("ARMv8.0" in n for n in r["notes"]), r
            continue
        assert r["checked"] and r["passed"], r["failures"]
        assert r["delta_ti"] <= 1e-5 and r["emulated_s"] > 0
        assert any("ExecuTorch runtime's aarch64 kernels" in n and "not a latency" in n for n in r["notes"])
        if r["scheme"] == "float32":
            assert r["logits_rel_l2"] <= 1e-4 and r["top1_agreement"] == 1 and r["greedy_match"]
        else:
            assert r["kl_mean"] is not None and r["heldout_tokens"] > 0
    assert main(["verify", str(pte_export), "--isa", "aarch64", "--arm-cpu", "cortex-a53", "--no-record"]) == 2
    assert "none of the selected artifacts runs on the aarch64 CPU profiles cortex-a53" in capsys.readouterr().err


def test_a_missing_setup_is_exit_2_naming_the_script(export, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIT_DEPLOY_AARCH64_ROOT", str(tmp_path / "empty"))
    (tmp_path / "empty").mkdir()
    capsys.readouterr()
    assert main(["verify", str(export), "--isa", "aarch64", "--no-record"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[pit-deploy")]
    assert len(err) == 1 and err[0].startswith("error:") and "bash scripts/setup_aarch64.sh" in err[0]


def test_an_emulator_that_cannot_start_onnxruntime_is_exit_2(export, tmp_path, monkeypatch, capsys):
    """A set-up whose emulated Python dies before importing onnxruntime is the set-up's fault,
    not the artifact's: exit 2 naming the script, no failed rows."""
    root = tmp_path / "broken"
    for folder in ("bin", "sysroot/usr/bin", "site"):
        (root / folder).mkdir(parents=True)
    (root / "bin" / "qemu-aarch64").write_text("#!/bin/sh\necho 'qemu: cannot run this' >&2\nexit 1\n")
    (root / "bin" / "qemu-aarch64").chmod(0o755)
    (root / "sysroot/usr/bin/python3.11").write_text("")
    err = _verify_with_setup(export, root, "sysroot/usr/bin/python3.11", monkeypatch, capsys)
    assert "does not start" in err and "qemu: cannot run this" in err and "setup_aarch64.sh" in err


def _verify_with_setup(export: Path, root: Path, python: str, monkeypatch, capsys) -> str:
    """``verify --isa aarch64`` of ``export``'s float32 artifacts with the set-up at ``root``
    (its ``qemu-aarch64`` in ``bin/``, the emulated ``python``); it must exit 2: its stderr."""
    (root / "setup.json").write_text(json.dumps({"qemu": "bin/qemu-aarch64", "sysroot": "sysroot",
                                                 "python": python, "site": "site"}))
    monkeypatch.setenv("PIT_DEPLOY_AARCH64_ROOT", str(root))
    capsys.readouterr()
    assert main(["verify", str(export), "--dtype", "float32", "--isa", "aarch64", "--arm-cpu", "max",
                 "--no-record"]) == 2
    return capsys.readouterr().err


@pytest.mark.skipif(platform.machine() == "aarch64", reason="a native run is an aarch64 run on this machine")
def test_an_emulator_that_runs_the_child_natively_is_exit_2(export, tmp_path, monkeypatch, capsys):
    """A ``qemu-aarch64`` that only execs its argument (here with this machine's own Python,
    numpy and onnxruntime, so that every job would run) checks the host's kernels under the
    aarch64 name: the child's ``platform.machine()`` gives it away, exit 2 naming the script,
    before any artifact runs."""
    import os
    import sys
    import sysconfig

    root = tmp_path / "native"
    (root / "bin").mkdir(parents=True)
    (root / "sysroot").mkdir()
    (root / "sysroot" / "usr").symlink_to(sys.base_prefix)  # PYTHONHOME of the (host) Python
    (root / "site").symlink_to(sysconfig.get_paths()["purelib"])
    (root / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    qemu = root / "bin" / "qemu-aarch64"
    qemu.write_text('#!/bin/sh\nwhile [ "$#" -gt 0 ]; do case "$1" in -L|-cpu) shift 2 ;; *) break ;; esac; done\n'
                    'exec "$@"\n')
    qemu.chmod(0o755)
    said = _verify_with_setup(export, root, "bin/python", monkeypatch, capsys)
    err = [line for line in said.splitlines() if not line.startswith("[pit-deploy")]
    assert len(err) == 1 and err[0].startswith("error:"), err
    assert "does not emulate" in err[0] and repr(platform.machine()) in err[0] and "setup_aarch64.sh" in err[0]


def test_a_setup_without_the_executorch_runtime_is_exit_2_for_a_pte(pte_export, tmp_path, monkeypatch, capsys):
    """A set-up installed before the script installed ExecuTorch runs the ONNX graphs but not a
    ``.pte``: exit 2 naming the script, before any work."""
    root = tmp_path / "old"
    for folder in ("bin", "sysroot/usr/bin", "site"):
        (root / folder).mkdir(parents=True)
    (root / "bin" / "qemu-aarch64").write_text("")
    (root / "sysroot/usr/bin/python3.11").write_text("")
    (root / "setup.json").write_text(json.dumps({"qemu": "bin/qemu-aarch64", "sysroot": "sysroot",
                                                 "python": "sysroot/usr/bin/python3.11", "site": "site"}))
    monkeypatch.setenv("PIT_DEPLOY_AARCH64_ROOT", str(root))
    capsys.readouterr()
    assert main(["verify", str(pte_export), "--isa", "aarch64", "--arm-cpu", "max", "--no-record"]) == 2
    err = capsys.readouterr().err
    assert "lacks the ExecuTorch runtime" in err and "setup_aarch64.sh" in err


@pytest.mark.parametrize("argv, said", [(["--arm-cpu", "max"], "apply to --isa aarch64 only"),
                                        (["--full"], "apply to --isa aarch64 only"),
                                        (["--isa", "riscv64"], "unknown ISA 'riscv64'"),
                                        (["--isa", "aarch64", "--arm-cpu", "pentium"], "unknown aarch64 CPU profile"),
                                        (["--isa", "aarch64", "--kleidiai", "maybe"], "unknown KleidiAI setting")])
def test_bad_isa_flags_are_exit_2(export, argv, said, capsys):
    capsys.readouterr()
    assert main(["verify", str(export), "--no-record", *argv]) == 2
    assert said in capsys.readouterr().err


def test_bench_cannot_time_the_emulated_runtime():
    """Timings under emulation are not a device's latency: bench has no way to ask for them (no
    ISA flag, no import of the emulation); the emulated runner imports nothing of the package."""
    import ast

    from bundle_device import assert_self_contained

    from pit_deploy.runtime import emulated_runner
    from pit_deploy.targets.executorch import emulated_pte_runner

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--isa", "aarch64", "x"])
    assert exit_.value.code == 2
    for path in (ROOT / "pit_deploy" / "evaluate").glob("bench*.py"):
        names = {getattr(n, "module", None) or "" for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.ImportFrom)}
        assert not any("emulated" in name or "verify_aarch64" in name for name in names), path
    assert_self_contained(Path(emulated_runner.__file__), ("transformers", "optimum", "torch"))
    assert_self_contained(Path(emulated_pte_runner.__file__), ("transformers", "optimum"))  # torch: the runtime's


def test_an_export_named_by_a_relative_path_runs_emulated(arm_setup, export, monkeypatch, capsys):
    """The emulated runtime runs in a folder of its own: the artifacts' paths it gets are absolute."""
    monkeypatch.chdir(export.parent)
    assert main(["verify", export.name, "--dtype", "float32", "--isa", "aarch64", "--arm-cpu", "max",
                 "--no-record"]) == 0, capsys.readouterr().err

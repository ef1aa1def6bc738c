"""Hostile or broken input never overwrites what a command reads, never passes as verified, and
never ends as an internal error: bundles that refuse to clobber files, manifests whose paths
must be plain and whose artifacts must be unique, verification tied to the digests it checked,
device and ingested figures that must be finite, strict JSON everywhere, and exit 2 (one
``error:`` line) for every problem that is the user's (``docs/conventions.md``)."""

from __future__ import annotations

import json
import math
import shutil
import tarfile
from pathlib import Path

import pytest

from pit_deploy.cli import main
from pit_deploy.errors import PitError
from pit_deploy.evaluate.bench import BenchOptions, plan_cells
from pit_deploy.io.checkpoint import save_model
from pit_deploy.io.fs import json_text, sha256_file
from pit_deploy.io.manifest import pin_sha256
from pit_deploy.tiny import tiny_pit_model, tiny_tokenizer

SMALL = ["--prompt-len", "4", "--gen-len", "3", "--reps", "1"]


def strict_json(text: str):
    """Parse as RFC 8259 JSON: ``NaN``, ``Infinity`` and ``-Infinity`` are errors."""
    def refuse(name: str):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A tiny PIT export (ONNX, factorized) verified with its pin; the pin; what verify --json printed."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("inputs")
    src = root / "pit-src"
    save_model(tiny_pit_model("llama"), src, tiny_tokenizer())
    out = root / "exp"
    assert main(["export", str(src), "--out", str(out), "--recipe", "tiny-ci", "--runtime", "onnx",
                 "--mode", "factorized"]) == 0
    pin = sha256_file(out / "manifest.json")  # what a user pins: the fresh export's sha256sum
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["verify", str(out), "--expect-sha256", pin, "--json"]) == 0
    return out, pin, printed.getvalue()


def _copy(export: Path, where: Path) -> Path:
    shutil.copytree(export, where)
    return where


def _edit_manifest(directory: Path, edit) -> None:
    data = json.loads((directory / "manifest.json").read_text())
    edit(data)
    (directory / "manifest.json").write_text(json.dumps(data))


def _rehash(directory: Path) -> None:
    """Re-record every digest of the manifest (its verification block kept)."""
    def edit(data):
        for table in [data["reference"]["files"]] + [a["files"] for a in data["artifacts"]]:
            for rel, info in table.items():
                info["sha256"], info["bytes"] = sha256_file(directory / rel), (directory / rel).stat().st_size

    _edit_manifest(directory, edit)


# --------------------------------------------------------------------------------------
# 1, 3: bundles never overwrite, never mix two exports of one name
# --------------------------------------------------------------------------------------


def test_bundle_refuses_the_exports_own_files_an_existing_file_and_a_directory(export, tmp_path, capsys):
    exp = export[0]
    manifest = (exp / "manifest.json").read_bytes()
    assert main(["bench", str(exp), "--bundle", str(exp / "manifest.json"), "--force"]) == 2
    assert "lies inside the input" in capsys.readouterr().err
    assert (exp / "manifest.json").read_bytes() == manifest
    assert main(["bench", str(exp), "--bundle", str(exp)]) == 2
    assert "is a directory" in capsys.readouterr().err
    existing = tmp_path / "edge.tar.gz"
    existing.write_text("keep")
    assert main(["bench", str(exp), "--bundle", str(existing)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert existing.read_text() == "keep"
    assert main(["bench", str(exp), "--force", *SMALL]) == 2  # --force means nothing without --bundle
    assert "--force applies to --bundle only" in capsys.readouterr().err


def test_bundle_of_two_exports_of_one_name_keeps_them_apart(export, tmp_path, capsys):
    exp = export[0]
    twin = _copy(exp, tmp_path / "elsewhere" / exp.name)
    bundle = tmp_path / "edge.tar.gz"
    bundle.write_text("old")
    assert main(["bench", str(exp), str(twin), "--bundle", str(bundle), "--force", *SMALL]) == 0
    with tarfile.open(bundle) as tar:
        names = tar.getnames()
        spec = json.loads(tar.extractfile("pit-bench/bundle.json").read())
    assert not any(".." in n.split("/") or n.startswith("/") for n in names)
    assert all(tarfile.open(bundle).getmember(n).isfile() for n in names)  # files, never links
    labels = [a["artifact"] for a in spec["artifacts"]]
    assert labels == [f"{exp.name}/onnx-factorized", f"{exp.name}-2/onnx-factorized"]
    assert {f"pit-bench/artifacts/{label}/onnx/model.onnx" for label in labels} <= set(names)
    assert set(spec["prompts"]) == {f"{exp.name}:4", f"{exp.name}-2:4"}


# --------------------------------------------------------------------------------------
# 2, 5, 7: manifests that cannot be trusted are exit 2 on read
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["artifacts"][0].__setitem__("path", "../exp/onnx-factorized"), "not a plain relative path"),
    (lambda m: m["artifacts"][0].__setitem__("path", "/elsewhere/onnx-factorized"), "not a plain relative path"),
    (lambda m: m["artifacts"][0]["files"].__setitem__("onnx-factorized/../reference/config.json",
                                                      {"sha256": "0" * 64, "bytes": 1}), "not a plain relative path"),
    (lambda m: m["reference"]["files"].__setitem__("reference/./config.json", {"sha256": "0" * 64}),
     "not a plain relative path"),
    (lambda m: m["artifacts"].append(json.loads(json.dumps(m["artifacts"][0]))), "have the same key"),
    (lambda m: m["artifacts"].append({**json.loads(json.dumps(m["artifacts"][0])), "mode": "materialized"}),
     "have the same path"),
])
@pytest.mark.parametrize("command", ["verify", "bench"])
def test_untrustworthy_manifests_are_exit_2_on_read(export, tmp_path, capsys, edit, message, command):
    d = _copy(export[0], tmp_path / "exp")
    _edit_manifest(d, edit)
    args = ["verify", str(d), "--no-record"] if command == "verify" else ["bench", str(d), *SMALL]
    assert main(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err


def test_binary_manifest_is_exit_2(export, tmp_path, capsys):
    d = _copy(export[0], tmp_path / "exp")
    (d / "manifest.json").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe" + bytes(range(256)))
    assert main(["verify", str(d), "--no-record"]) == 2
    assert "is not text" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# 4: verified means "these very files passed"
# --------------------------------------------------------------------------------------


def test_an_artifact_changed_after_verification_is_not_verified(export, tmp_path):
    exp = export[0]
    record = json.loads((exp / "manifest.json").read_text())["verification"]["artifacts"][0]
    assert record["passed"] and record["digests"]["onnx-factorized/onnx/model.onnx"] == sha256_file(exp / "onnx-factorized" / "onnx" / "model.onnx")
    opts = BenchOptions(prompt_lens=(4,), gen_len=3, reps=1)
    cells, _, warnings = plan_cells([exp], opts)
    assert cells[0]["meta"]["verified"] is True and not warnings

    d = _copy(exp, tmp_path / "exp")
    data = d / "onnx-factorized" / "onnx" / "model.onnx_data"
    blob = bytearray(data.read_bytes())
    blob[100] ^= 1
    data.write_bytes(bytes(blob))
    _rehash(d)  # digests updated to match: the manifest alone no longer tells
    cells, _, warnings = plan_cells([d], opts)
    assert cells[0]["meta"]["verified"] is None
    assert any("changed since verification" in w and "model.onnx_data" in w for w in warnings)


def test_the_pin_outlives_recorded_results(export, tmp_path, capsys):
    """verify recorded its results into the manifest (the fixture): the pin of the fresh export
    still holds, so a second pinned verify gets past the pin (to the selection, here empty)."""
    exp, pin, _ = export
    assert sha256_file(exp / "manifest.json") != pin and pin_sha256(exp) == pin
    assert main(["verify", str(exp), "--no-record", "--expect-sha256", pin, "--runtime", "executorch"]) == 2
    assert "no artifact" in capsys.readouterr().err
    assert main(["verify", str(exp), "--no-record", "--expect-sha256", "0" * 64]) == 2
    assert "not the pinned" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# 7: the user's problems are exit 2, not internal errors
# --------------------------------------------------------------------------------------


def test_unknown_model_type_is_exit_2_naming_the_families(tmp_path, capsys):
    src = tmp_path / "pit"
    save_model(tiny_pit_model("llama"), src, tiny_tokenizer())
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "frobnicator"
    (src / "config.json").write_text(json.dumps(cfg))
    assert main(["diagnose", str(src)]) == 2
    err = capsys.readouterr().err
    assert "'frobnicator'" in err and "llama" in err and "internal error" not in err


def test_a_truncated_onnx_with_matching_digests_is_exit_2(export, tmp_path, capsys):
    d = _copy(export[0], tmp_path / "exp")
    model = d / "onnx-factorized" / "onnx" / "model.onnx"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    _rehash(d)
    assert main(["verify", str(d), "--no-record"]) == 2
    err = capsys.readouterr().err  # caught where verify reads each graph's external-data locations
    assert f"{model} cannot be read as ONNX" in err and "re-export" in err


def test_a_corrupted_pte_is_exit_2(tmp_path):
    pytest.importorskip("executorch")
    from pit_deploy.targets.executorch.driver import ExecuTorchDriver

    import torch

    (tmp_path / "model.pte").write_bytes(b"ET12" + bytes(range(256)) * 16)
    driver = ExecuTorchDriver(tmp_path)  # the program is opened on first use: each use says why it cannot be
    with pytest.raises(PitError, match="cannot be loaded by the ExecuTorch runtime"):
        driver.interface(16, 4)
    with pytest.raises(PitError, match="cannot be loaded by the ExecuTorch runtime"):
        driver.prefill(torch.tensor([1, 2]))


def test_generation_past_the_model_positions_is_exit_2_before_measuring(export, capsys):
    # the tiny model has 128 positions; an ONNX artifact has no static cache to say so
    assert main(["bench", str(export[0]), "--prompt-len", "100", "--gen-len", "40", "--reps", "1"]) == 2
    assert "exceed the 128 positions the model supports" in capsys.readouterr().err


def _row(**changes):
    row = {"artifact": "exp/onnx-factorized", "runtime": "onnx", "mode": "factorized", "dtype": "float32",
           "tying": "pit", "threads": 1, "prompt_len": 4, "gen_len": 3, "prefill_tok_s": 100.0,
           "prefill_tok_s_std": 1.0, "decode_tok_s": 50.0, "decode_tok_s_std": 0.5, "ttft_ms": 10.0,
           "decode_ms_p50": 20.0, "decode_ms_p90": 21.0, "load_s": 0.1, "peak_rss_mb": None, "size_mb": 0.5,
           "verified": True}
    row.update(changes)
    return row


@pytest.mark.parametrize("row, message", [
    (_row(threads="2"), "row 0 ('exp/onnx-factorized') key 'threads' must be a positive integer"),
    (_row(decode_tok_s=float("nan")), "key 'decode_tok_s' is nan"),
    (_row(ttft_ms=float("-inf")), "key 'ttft_ms' is -inf"),
    (_row(load_s=-1.0), "key 'load_s' is -1.0"),
    (_row(size_mb="big"), "key 'size_mb' must be a number or null"),
    (_row(verified="yes"), "key 'verified' has the wrong type"),
    (_row(artifact=["x"]), "key 'artifact' must be a string"),
    ("a row", "row 0 is a str"),
])
def test_malformed_ingested_rows_are_exit_2_naming_row_and_key(tmp_path, capsys, row, message):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"rows": [row]}))  # Python's json writes NaN and Infinity
    assert main(["bench", "--ingest", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# --------------------------------------------------------------------------------------
# 8: strict JSON from every command
# --------------------------------------------------------------------------------------


def test_every_json_output_is_strict(export, tmp_path, capsys, monkeypatch):
    import pit_deploy.analysis.diagnostics as diagnostics

    exp = export[0]
    strict_json((exp / "manifest.json").read_text())
    # a figure that cannot be computed (a rank-deficient polar factor) is null, not NaN
    monkeypatch.setattr(diagnostics, "_polar_distance", lambda e, w: math.nan)
    assert main(["diagnose", str(exp / "reference"), "--json", "--extended"]) == 0
    assert strict_json(capsys.readouterr().out)["polar_distance"] is None
    assert main(["probe", str(exp / "reference"), "--ids", "1,2,3", "--json"]) == 0
    strict_json(capsys.readouterr().out)
    rows, out = tmp_path / "rows.json", tmp_path / "out.json"
    rows.write_text(json.dumps({"rows": [_row(), _row(tying="tied", artifact="tt/onnx-tied", mode="tied")]}))
    assert main(["bench", "--ingest", str(rows), "--json", "--out", str(out)]) == 0
    printed = strict_json(capsys.readouterr().out)
    assert strict_json(out.read_text()) == printed
    assert printed["rows"][0]["peak_rss_mb"] is None and printed["ratios"][0]["rss_ratio"] is None
    assert json_text({"a": [math.inf, -math.inf, math.nan, 1.5]}) == '{"a": [null, null, null, 1.5]}'


def test_verify_json_and_written_manifests_are_strict(export, tmp_path):
    from pit_deploy.io.fs import write_json_atomic

    exp, pin, printed = export
    report = strict_json(printed)
    assert report["passed"] and report["manifest_sha256"] == pin
    strict_json((exp / "manifest.json").read_text())
    # what a manifest update writes (e.g. a result an older pit-deploy recorded with a NaN figure)
    write_json_atomic(tmp_path / "m.json", {"verification": {"artifacts": [{"delta_ti": math.nan}]}})
    assert strict_json((tmp_path / "m.json").read_text())["verification"]["artifacts"][0]["delta_ti"] is None


# --------------------------------------------------------------------------------------
# 9: plots, terminals, static caches
# --------------------------------------------------------------------------------------


def test_plot_paths_and_escape_sequences(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({"rows": [_row(artifact="exp/\x1b[2J\x1b]0;owned\x07onnx")],
                                "warnings": ["\x1b[31mred\x1b[0m"]}))
    (tmp_path / "charts").mkdir()
    assert main(["bench", "--ingest", str(rows), "--plot", "charts"]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert not (tmp_path / "charts.png").exists()
    assert main(["bench", "--ingest", str(rows), "--plot", "chart"]) == 0
    captured = capsys.readouterr()
    assert "wrote chart.png" in captured.err and (tmp_path / "chart.png").is_file()
    assert "\x1b" not in captured.out and "\x07" not in captured.out
    assert "\\x1b[2J" in captured.out and "\\x1b[31mred" in captured.out


def test_a_static_cache_too_short_to_verify_is_refused(tmp_path, capsys):
    from pit_deploy.exporters.recipes import Recipe

    with pytest.raises(PitError, match="needs at least 33"):
        Recipe(runtimes=("executorch",), max_seq_len=32)
    Recipe(runtimes=("executorch",), max_seq_len=33)
    Recipe(runtimes=("onnx",), max_seq_len=32)  # no static cache: nothing to fit
    Recipe(runtimes=("executorch",), dtype=("int8",), max_seq_len=32)  # no fp32 greedy check
    assert main(["export", "default", "--out", str(tmp_path / "x"), "--runtime", "executorch",
                 "--max-seq-len", "32"]) == 2
    assert "--max-seq-len 33" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()

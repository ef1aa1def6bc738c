"""The bench machinery on tiny models: rows with every documented field, measured in separate
processes, PIT/TT ratios from a --keep-tying baseline, loud flags for unverified or failing
exports, and exit 2 for unusable input. Speeds themselves are never asserted (benchmarks/)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bundle_device import assert_self_contained, run_bundle
from pit_deploy.cli import main
from pit_deploy.errors import PitError
from pit_deploy.evaluate.bench import ROW_FIELDS, BenchOptions, bench_directories
from pit_deploy.runtime.standalone import first_divergence
from pit_deploy.io.checkpoint import save_model
from pit_deploy.tiny import tiny_model, tiny_pit_model, tiny_tokenizer


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A verified PIT export (ONNX factorized) and a verified TT baseline (ONNX, --keep-tying)."""
    root = tmp_path_factory.mktemp("bench")
    pit_src, tt_src = root / "pit-src", root / "tt-src"
    save_model(tiny_pit_model("llama"), pit_src, tiny_tokenizer())
    save_model(tiny_model("llama"), tt_src, tiny_tokenizer())
    pit, tt = root / "pit", root / "tt"
    assert main(["export", str(pit_src), "--out", str(pit), "--recipe", "tiny-ci", "--runtime", "onnx", "--mode", "factorized"]) == 0
    assert main(["export", str(tt_src), "--out", str(tt), "--recipe", "tiny-ci", "--runtime", "onnx", "--keep-tying"]) == 0
    assert main(["verify", str(pit)]) == 0
    assert main(["verify", str(tt)]) == 0
    return pit, tt


def test_rows_ratios_and_json(exports, tmp_path, capsys):
    pit, tt = exports
    out = tmp_path / "rows.json"
    png = tmp_path / "bench.png"
    code = main(["bench", str(pit), str(tt), "--threads", "1,2", "--prompt-len", "8", "--gen-len", "6",
                 "--reps", "2", "--json", "--out", str(out), "--plot", str(png)])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == data
    assert png.stat().st_size > 1000
    rows = data["rows"]
    assert len(rows) == 4  # 2 artifacts × 2 thread counts
    for r in rows:
        assert set(ROW_FIELDS) <= set(r)
        for k in ("prefill_tok_s", "decode_tok_s", "ttft_ms", "decode_ms_p50", "decode_ms_p90", "load_s", "peak_rss_mb"):
            assert math.isfinite(r[k]) and r[k] > 0, k
        assert r["decode_ms_p90"] >= r["decode_ms_p50"]
        assert r["first_divergence"] is None  # verified artifacts reproduce the reference's greedy tokens
        assert r["verified"] is True
    assert {(r["tying"], r["mode"]) for r in rows} == {("pit", "factorized"), ("tied", "tied")}
    pit_size = next(r["size_mb"] for r in rows if r["tying"] == "pit")
    assert pit_size == pytest.approx(sum(f["bytes"] for a in json.loads((pit / "manifest.json").read_text())["artifacts"]
                                         for f in a["files"].values()) / 1e6)
    ratios = data["ratios"]
    assert {q["threads"] for q in ratios} == {1, 2}
    for q in ratios:
        r = next(x for x in rows if x["tying"] == "pit" and x["threads"] == q["threads"])
        t = next(x for x in rows if x["tying"] == "tied" and x["threads"] == q["threads"])
        assert q["decode_time_ratio"] == pytest.approx(t["decode_tok_s"] / r["decode_tok_s"])
    assert len(data["prompts"][f"{pit.name}:8"]) == 8


def test_cells_run_in_their_own_processes(exports, tmp_path):
    """Peak RSS is per process: the parent's own memory never shows up in a row."""
    import resource

    pit, _ = exports
    ballast = bytearray(300 * 2**20)  # the parent grows by 300 MB
    ballast[::4096] = b"x" * len(ballast[::4096])
    parent_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = bench_directories([pit], BenchOptions(prompt_lens=(4,), gen_len=3, reps=1))
    # a cell inherits nothing of the parent's ballast (ru_maxrss would: Linux carries the
    # parent's resident size at fork into the child's high-water mark)
    assert result.rows[0]["peak_rss_mb"] < parent_peak - 200
    del ballast


def test_unverified_and_failing_exports_are_flagged(exports, tmp_path, capsys):
    pit, _ = exports
    manifest = json.loads((pit / "manifest.json").read_text())
    unverified = tmp_path / "unverified"
    import shutil

    shutil.copytree(pit, unverified)
    data = dict(manifest)
    data["verification"] = None
    (unverified / "manifest.json").write_text(json.dumps(data))
    failing = tmp_path / "failing"
    shutil.copytree(pit, failing)
    data = json.loads(json.dumps(manifest))
    for a in data["verification"]["artifacts"]:
        a["passed"] = False
    (failing / "manifest.json").write_text(json.dumps(data))
    assert main(["bench", str(unverified), str(failing), "--prompt-len", "4", "--gen-len", "3", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "WARNING: unverified/onnx-factorized was never verified" in out
    assert "WARNING: failing/onnx-factorized FAILED verification" in out


@pytest.mark.parametrize("args, message", [
    (["--threads", "0"], "threads must be integers from 1 to 256"),
    (["--threads", "100000"], "threads must be integers from 1 to 256"),
    (["--prompt-len", "60", "--gen-len", "8"], "exceed the artifact's context of 64"),
    (["--gen-len", "100000"], "--gen-len must be from 2"),
    (["--reps", "0"], "--reps must be from 1 to 1000"),
])
def test_bad_options_are_exit_2(exports, capsys, args, message):
    pit, _ = exports
    # the static-cache context applies to .pte artifacts; give the ONNX one a recorded context too
    code = main(["bench", str(pit), *args]) if "--prompt-len" not in args else _with_context(pit, args)
    assert code == 2
    assert message in capsys.readouterr().err


def _with_context(pit: Path, args: list[str]) -> int:
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp()) / "ctx"
    shutil.copytree(pit, tmp)
    data = json.loads((tmp / "manifest.json").read_text())
    for a in data["artifacts"]:
        a["shapes"]["max_seq_len"] = 64
    (tmp / "manifest.json").write_text(json.dumps(data))
    return main(["bench", str(tmp), *args])


def test_missing_directory_and_uninstalled_runtime_are_exit_2(exports, tmp_path, capsys, monkeypatch):
    assert main(["bench", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    from pit_deploy.targets import get_target

    monkeypatch.setattr(get_target("onnx"), "driver", "a_runtime_that_is_not_installed:Driver")
    pit, _ = exports
    assert main(["bench", str(pit), "--prompt-len", "4", "--gen-len", "3"]) == 2
    assert "runtime is not installed" in capsys.readouterr().err


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 9, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([1, 2], None) is None
    with pytest.raises(PitError):
        BenchOptions(gen_len=1)


def test_bundle_runs_without_the_package_and_its_rows_ingest(exports, tmp_path, capsys):
    """--bundle packs a standalone run_bench.py; run in a subprocess where importing
    pit_deploy or transformers fails, it measures every artifact (rows with every field, the
    reference's greedy tokens reproduced) and reports from each cell's own sys.modules that it
    loaded neither; --ingest reads its rows back into the same table."""
    pit, tt = exports
    bundle = tmp_path / "edge.tar.gz"
    assert main(["bench", str(pit), str(tt), "--bundle", str(bundle), "--prompt-len", "8", "--gen-len", "6",
                 "--reps", "2"]) == 0
    rows = run_bundle(bundle, tmp_path, threads="1,2")
    rows_path = tmp_path / "rows.json"
    assert len(rows) == 2 * 2 and {r["tying"] for r in rows} == {"pit", "tied"}
    for r in rows:
        assert all(k in r for k in ROW_FIELDS)
        assert r["first_divergence"] is None
        assert not {"pit_deploy", "transformers"} & set(r["imported"]), r["imported"]
        assert r["decode_tok_s"] > 0 and r["peak_rss_mb"] > 0
    capsys.readouterr()
    assert main(["bench", "--ingest", str(rows_path), "--json"]) == 0
    ingested = json.loads(capsys.readouterr().out)
    assert ingested["rows"] == rows and len(ingested["ratios"]) == 2  # PIT/TT at 1 and 2 threads


@pytest.mark.parametrize("args,message", [
    (["--ingest", "missing.json"], "no such file"),
    (["--ingest", "{bad}"], "expected an object with a 'rows' list"),
    (["--bundle", "out.tar.gz", "--torch", "default"], "--bundle packs exported artifacts only"),
    (["--bundle", "out.tar.gz", "--ingest", "x.json"], "use one at a time"),
])
def test_bundle_and_ingest_bad_input_is_exit_2(exports, tmp_path, capsys, monkeypatch, args, message):
    pit, _ = exports
    monkeypatch.chdir(tmp_path)
    (tmp_path / "{bad}").write_text(json.dumps({"rows": "not a list"}))
    extra = [str(pit)] if "--bundle" in args else []
    assert main(["bench", *extra, *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out.tar.gz").exists()


def test_standalone_runtime_imports_nothing_of_the_package():
    """The file a bundle carries is this package's own runtime/standalone.py, unchanged: it
    must not import pit_deploy (or it would not run on a device)."""
    from pit_deploy.runtime import standalone

    assert_self_contained(Path(standalone.__file__), ("transformers", "optimum"))


def test_the_torch_driver_gives_the_callers_thread_count_back():
    """``--threads`` sizes torch's pool, which is the whole process's: closing the driver puts the
    caller's size back (a later computation in the same process keeps its own reduction order)."""
    import torch

    from pit_deploy.runtime.torch_driver import TorchDriver
    from pit_deploy.tiny import tiny_model

    before = torch.get_num_threads()
    other = 2 if before == 1 else 1
    with TorchDriver(threads=other, model=tiny_model("llama")):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before

"""Every reusable benchmark in ``benchmarks/`` runs once, on a tiny random model with minimal
settings, so that it cannot rot unnoticed. Only the shape of what it writes is asserted: the
result JSON parses, has its rows, and records its provenance (command, code version, library
versions, timestamp). Speeds are never asserted (``docs/conventions.md``).

What is smoked, and what is left out:

* ``bench_default.py`` and ``quantization.py`` orchestrate ``pit-deploy export``, ``verify`` and
  ``bench`` in subprocesses. Their exports are made here once, in this process, and both scripts
  run with ``--reuse`` on them and ``--runtime onnx``: what is smoked is their own code — the
  verify and bench subprocesses, the goals, the ratios, the tables and the result file. Left out
  is ExecuTorch: lowering even one tiny ``.pte`` took about a minute on a 2-core machine, and
  ``bench_default.py`` would need two plus their stock-runner cells; the exporters and the bench
  have their own tests. These two are marked ``slow`` (one to two minutes each on a busy 2-core
  machine, mostly ``verify`` and ``bench`` subprocesses); ``quantization.py`` runs in the default
  tier, ``bench_default.py`` in the full one.
* ``export_sizes.py`` runs its own stock ONNX export and PIT export (``--runtime onnx``).
* ``onnx_decode_profile.py`` profiles the tiny ONNX export, ``decode_bytes.py`` counts what its
  decode step reads; ``web_decode.py`` runs it in Node,
  headless Chromium and native onnxruntime; ``onnx_head_kernels.py`` and
  ``pte_head_kernels.py`` run their head-shaped kernels at a tiny shape (``--vocab/--hidden``);
  ``train_pit_vs_tt.py`` trains the tiny model for a few hundred tokens on the default corpus;
  ``kl_chunk_size.py`` times the held-out KL on small synthetic logits.
* The scripts run in this process through their ``main(argv)`` (no interpreter start-up each),
  except ``onnx_head_kernels.py``, which runs as ``python benchmarks/onnx_head_kernels.py`` to
  check that the scripts still run the way the docs say. The orchestrating scripts start their
  own ``pit-deploy`` subprocesses either way.

Tiers: the scripts that orchestrate whole pipelines or build the peers' artifacts
(``bench_default.py``, ``pte_anchors.py``, ``int4_quality_peers.py``, ``genai_side_by_side.py``,
``onnx_targets.py``, ``pipeline_time.py``, ``pte_data_file.py``: a minute or more each) are smoked in the full tier
(``bash scripts/test.sh --full``); the rest, and the index and writer checks, in the default tier.

``studies/`` are one-off studies that need the default model; they are not run here, but the
checks at the end keep their index and the single result writer honest.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pit_deploy.cli import main as cli
from pit_deploy.io.checkpoint import save_model
from pit_deploy.tiny import tiny_model, tiny_pit_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS, STUDIES = ROOT / "benchmarks", ROOT / "studies"
VERSIONED = ("torch", "transformers", "onnxruntime", "executorch", "optimum-onnx", "onnxruntime-genai")


def run_benchmark(name: str, argv: list[str]) -> int:
    """``benchmarks/NAME.py``'s ``main(argv)``, loaded from its file (some import a neighbouring
    script, as they would when run)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # torch.export looks classes up by their module's name
    try:
        spec.loader.exec_module(module)
        return module.main(argv)
    finally:
        del sys.modules[spec.name]


def well_formed(path: Path, script: str, rows: str) -> dict:
    """The result at ``path`` parses, has non-empty ``rows`` and a complete provenance block."""
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data[rows], f"{path.name}: no {rows}"
    prov = data["provenance"]
    assert prov["command"].startswith(f"python benchmarks/{script}.py"), prov["command"]
    assert isinstance(prov["argv"], list)
    code = prov["code_version"]
    assert {"git_commit", "git_dirty", "pit_deploy"} <= set(code)
    assert code["git_commit"] or code["pit_deploy"], "neither a git commit nor a package version"
    if code["git_commit"]:
        assert len(code["git_commit"]) == 40 and isinstance(code["git_dirty"], bool)
    assert set(VERSIONED) <= set(prov["versions"]) and prov["versions"]["torch"]
    assert datetime.datetime.fromisoformat(prov["timestamp"]).tzinfo is not None
    return data


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A tiny tied source ``src/``, a tiny PIT model ``pit-src/`` (exported as is, no conversion to
    wait for) and, for the orchestrating scripts' ``--reuse`` (ONNX, factorized, the tiny-ci
    recipe): ``bench/pit`` and ``bench/tt`` (``src/`` with ``--keep-tying``) for
    ``bench_default.py``, ``quant/pit`` (fp32 + int8) for ``quantization.py``."""
    root = tmp_path_factory.mktemp("benchmarks")
    src, pit_src = str(root / "src"), str(root / "pit-src")
    save_model(tiny_model("llama"), src, tiny_tokenizer())
    save_model(tiny_pit_model("llama"), pit_src, tiny_tokenizer())
    common = ["--recipe", "tiny-ci", "--runtime", "onnx"]
    assert cli(["export", pit_src, "--out", str(root / "bench" / "pit"), *common, "--mode", "factorized"]) == 0
    assert cli(["export", src, "--out", str(root / "bench" / "tt"), *common, "--keep-tying"]) == 0
    assert cli(["export", pit_src, "--out", str(root / "quant" / "pit"), *common, "--mode", "factorized",
                "--dtype", "float32,int8"]) == 0
    return root


BENCH = ["--threads", "1", "--prompt-len", "4", "--gen-len", "3", "--reps", "1"]


@pytest.mark.slow
@pytest.mark.full
def test_bench_default(work, tmp_path):
    out = tmp_path / "bench_default.json"
    assert run_benchmark("bench_default", ["--model", str(work / "src"), "--work", str(work / "bench"),
                                           "--runtime", "onnx", "--max-seq-len", "64", "--reuse", "--out", str(out), *BENCH]) == 0
    data = well_formed(out, "bench_default", "rows")
    assert {r["runtime"] for r in data["rows"]} == {"onnx", "torch"}
    assert data["goals"] and set(data["verify"]) == {"pit", "tt"}
    assert out.with_suffix(".md").read_text(encoding="utf-8").startswith("| artifact |")


@pytest.mark.slow
def test_quantization(work, tmp_path):
    out = tmp_path / "quantization.json"
    assert run_benchmark("quantization", ["--model", str(work / "src"), "--work", str(work / "quant"), "--runtime", "onnx",
                                          "--mode", "factorized", "--dtype", "float32,int8", "--baselines", "none",
                                          "--reuse", "--out", str(out), *BENCH]) == 0
    data = well_formed(out, "quantization", "bench_rows")
    assert data["verify"]["pit"] and {r["dtype"] for r in data["ratios"]} == {"int8"}


@pytest.mark.slow
def test_gguf_pit_vs_tt(work, tmp_path):
    """The tiny PIT model and the tiny tied source as q8_0 GGUF files, one interleaved round."""
    pytest.importorskip("llama_cpp")
    pit, tt = tmp_path / "pit", tmp_path / "tt"
    assert cli(["export", str(work / "pit-src"), "--out", str(pit), "--runtime", "gguf", "--mode", "materialized",
                "--dtype", "q8_0"]) == 0
    assert cli(["export", str(work / "src"), "--out", str(tt), "--runtime", "gguf", "--keep-tying", "--dtype", "q8_0"]) == 0
    out = tmp_path / "gguf_pit_vs_tt.json"
    assert run_benchmark("gguf_pit_vs_tt", ["--pit", str(pit), "--tt", str(tt), "--schemes", "q8_0", "--threads", "1",
                                            "--rounds", "1", "--prompt-len", "4", "--gen-len", "3", "--out", str(out)]) == 0
    data = well_formed(out, "gguf_pit_vs_tt", "schemes")
    assert set(data["schemes"]) == {"q8_0"} and data["schemes"]["q8_0"]["decode_ratio"] > 0


@pytest.mark.slow
@pytest.mark.full
def test_pte_anchors(work, tmp_path):
    """The tiny PIT model's int4-shared ``.pte`` in the stock runner against the builder's int4 of
    the tiny source, one round, one thread; the llama.cpp anchor has no GGUF of a tiny source and
    must be reported missing, not silently dropped."""
    pytest.importorskip("onnxruntime_genai")
    ours = tmp_path / "ours"
    assert cli(["export", str(work / "pit-src"), "--out", str(ours), "--runtime", "executorch", "--mode", "factorized",
                "--dtype", "int4-shared", "--max-seq-len", "64"]) == 0
    out = tmp_path / "pte_anchors.json"
    assert run_benchmark("pte_anchors", ["--model", str(work / "src"), "--ours", str(ours), "--schemes", "int4-shared",
                                         "--work", str(tmp_path / "anchors"), "--threads", "1", "--rounds", "1",
                                         "--prompt-len", "4", "--gen-len", "3", "--out", str(out)]) == 0
    data = well_formed(out, "pte_anchors", "rows")
    assert {r["artifact"] for r in data["rows"]} == {"ours-pte-int4-shared", "genai-builder-int4"}
    assert data["peers_missing"] and "llama.cpp" in data["peers_missing"][0]
    assert {(r["artifact"], r["peer"]) for r in data["ratios"]} == {("ours-pte-int4-shared", "genai-builder-int4")}


@pytest.mark.slow
@pytest.mark.full
def test_int4_quality_peers(work, tmp_path):
    """The tiny PIT model's int8 ONNX artifact and the builder's int4 of the tiny source on the
    three held-out kinds (blocks of 32); the llama.cpp peers have no GGUF of a tiny source and must
    be reported left out."""
    pytest.importorskip("onnxruntime_genai")
    out = tmp_path / "int4_quality_peers.json"
    assert run_benchmark("int4_quality_peers", ["--ours", str(work / "quant" / "pit"), "--model", str(work / "src"),
                                                "--work", str(tmp_path / "peers"), "--block", "32",
                                                "--out", str(out)]) == 0
    data = well_formed(out, "int4_quality_peers", "rows")
    names = {r["artifact"] for r in data["rows"]}
    assert names == {"ours:pit/onnx-factorized-int8", "genai-builder-int4"}, names
    for row in data["rows"]:
        assert set(data["tokens"]) == {"code", "prose", "chat"} and row["code"]["kl_mean"] >= 0
    assert any("llama.cpp" in m for m in data["left_out"]) and out.with_suffix(".png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.full
def test_genai_side_by_side(work, tmp_path):
    """The tiny source through the builder (int4, fp32) against the tiny PIT model's factorized
    onnx-genai folders, one round, one thread."""
    pytest.importorskip("onnxruntime_genai")
    ours = tmp_path / "ours"
    assert cli(["export", str(work / "pit-src"), "--out", str(ours), "--runtime", "onnx-genai", "--mode", "factorized",
                "--dtype", "float32,int4,int4-compact"]) == 0
    out = tmp_path / "genai_side_by_side.json"
    assert run_benchmark("genai_side_by_side", ["--model", str(work / "src"), "--ours", str(ours), "--work",
                                                str(tmp_path / "genai"), "--threads", "1", "--rounds", "1",
                                                "--prompt-len", "4", "--gen-len", "3", "--out", str(out)]) == 0
    data = well_formed(out, "genai_side_by_side", "rows")
    assert {r["artifact"] for r in data["rows"]} == {"builder-int4", "builder-fp32", "ours-factorized-int4",
                                                     "ours-factorized-int4-compact", "ours-factorized-fp32"}
    assert {(r["artifact"], r["peer"]) for r in data["ratios"]} == {
        ("ours-factorized-int4", "builder-int4"), ("ours-factorized-int4-compact", "builder-int4"),
        ("ours-factorized-fp32", "builder-fp32")}


@pytest.mark.slow
@pytest.mark.full
def test_onnx_targets(work, tmp_path):
    """Both ONNX targets of the tiny PIT model, fp32 and int4, through one bench run."""
    pytest.importorskip("onnxruntime_genai")
    out = tmp_path / "onnx_targets.json"
    assert run_benchmark("onnx_targets", ["--model", str(work / "pit-src"), "--work", str(tmp_path / "targets"),
                                          "--dtype", "float32,int4", "--out", str(out), *BENCH]) == 0
    data = well_formed(out, "onnx_targets", "rows")
    assert {(r["scheme"], r["threads"]) for r in data["ratios"]} == {("float32", 1), ("int4", 1)}
    assert all(r["decode_tok_s"]["genai_over_onnx"] > 0 for r in data["ratios"])
    assert len(data["verify"]) == 4 and all(v["passed"] for v in data["verify"])


def test_export_sizes(tmp_path):
    src, out = tmp_path / "src", tmp_path / "export_sizes.json"
    save_model(tiny_model("llama"), src, tiny_tokenizer())
    assert run_benchmark("export_sizes", ["--model", str(src), "--runtime", "onnx", "--out", str(out)]) == 0
    data = well_formed(out, "export_sizes", "pit")
    assert {(r["runtime"], r["mode"]) for r in data["pit"]} == {("onnx", "materialized"), ("onnx", "factorized")}


def test_onnx_decode_profile(work, tmp_path):
    out = tmp_path / "onnx_decode_profile.json"
    assert run_benchmark("onnx_decode_profile", [str(work / "bench" / "pit" / "onnx-factorized"), "--threads", "1",
                                                 "--steps", "2", "--prompt-len", "4", "--out", str(out)]) == 0
    data = well_formed(out, "onnx_decode_profile", "rows")
    assert data["rows"][0]["nodes_per_step"] > 0


def test_decode_bytes(work, tmp_path):
    """The bytes a decode step reads, from the graphs of the tiny fp32 and int4 exports."""
    out = tmp_path / "decode_bytes.json"
    assert run_benchmark("decode_bytes", [f"fp32={work / 'bench' / 'pit' / 'onnx-factorized'}", "--baseline", "fp32",
                                          "--out", str(out)]) == 0
    data = well_formed(out, "decode_bytes", "rows")
    (row,) = data["rows"]
    assert row["total_over_baseline"] == 1.0 and row["float_matmul"] > 0 and row["gathered_row"] > 0


@pytest.mark.slow
@pytest.mark.full
def test_pte_data_file(work, tmp_path, monkeypatch):
    """The tiny PIT model's float32 factorized .pte as the exporter writes it (with model.ptd) and
    as one file (the exporter's own lowering with its data kept in the program), one bench run."""
    import pit_deploy.targets.executorch.export as pte_export

    args = [str(work / "pit-src"), "--runtime", "executorch", "--mode", "factorized", "--max-seq-len", "64"]
    assert cli(["export", *args, "--out", str(tmp_path / "ptd")]) == 0
    lone = pte_export.export_pte
    monkeypatch.setattr(pte_export, "export_pte", lambda *a, **kw: lone(*a, **{**kw, "external_data": False}))
    assert cli(["export", *args, "--out", str(tmp_path / "one")]) == 0
    monkeypatch.undo()
    out = tmp_path / "pte_data_file.json"
    assert run_benchmark("pte_data_file", [str(tmp_path / "one"), str(tmp_path / "ptd"), "--threads", "1",
                                           "--prompt-len", "4", "--gen-len", "3", "--reps", "1", "--out", str(out)]) == 0
    data = well_formed(out, "pte_data_file", "rows")
    assert "model.ptd" in data["files"]["with-ptd"] and "model.ptd" not in data["files"]["one-file"]
    assert sum(data["files"]["with-ptd"].values()) < sum(data["files"]["one-file"].values())
    assert {q["variant"] for q in data["ratios"]} >= {"driver"}


def test_web_decode(work, tmp_path):
    out = tmp_path / "web_decode.json"
    assert run_benchmark("web_decode", [str(work / "bench" / "pit" / "onnx-factorized"), "--rounds", "1",
                                        "--prompt-len", "4", "--gen-len", "3", "--out", str(out)]) == 0
    data = well_formed(out, "web_decode", "table")
    assert {row["engine"] for row in data["table"]} == {"onnxruntime", "node", "chromium"}
    assert all(row["decode_ms_per_token"] > 0 for row in data["table"])


def test_verify_aarch64(work, tmp_path):
    """One emulated CPU profile over the tiny fp32 ONNX export (the set-up comes with the test
    command, ``bash scripts/setup_aarch64.sh``)."""
    out = tmp_path / "verify_aarch64.json"
    assert run_benchmark("verify_aarch64", ["--export", str(work / "bench" / "pit"), "--runtime", "onnx",
                                            "--arm-cpu", "max", "--kleidiai", "on",
                                            "--out", str(out)]) == 0
    data = well_formed(out, "verify_aarch64", "rows")
    assert [row["arm_cpu"] for row in data["rows"]] == ["max"] and data["passed"] is True
    assert data["rows"][0]["cross_isa"]["greedy_identical"] is True


def test_onnx_head_kernels_as_a_script(tmp_path):
    """Run the way the docs say, from the repository root in a fresh interpreter."""
    out = tmp_path / "onnx_head_kernels.json"
    proc = subprocess.run([sys.executable, "benchmarks/onnx_head_kernels.py", "--threads", "1", "--reps", "3",
                           "--vocab", "256", "--hidden", "64", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = well_formed(out, "onnx_head_kernels", "rows")
    assert data["shape"] == {"vocab": 256, "hidden": 64, "block": 32}


def test_pte_head_kernels(tmp_path):
    out = tmp_path / "pte_head_kernels.json"
    assert run_benchmark("pte_head_kernels", ["--threads", "1", "--calls", "2", "--vocab", "256", "--hidden", "64",
                                              "--out", str(out)]) == 0
    data = well_formed(out, "pte_head_kernels", "rows")
    assert len(data["rows"]) == 5


def test_kl_chunk_size(tmp_path):
    """Every chunk size gives the same figures; the module's chunk size is left as it was."""
    from pit_deploy.data import heldout

    before = heldout.KL_ELEMENTS
    out = tmp_path / "kl_chunk_size.json"
    assert run_benchmark("kl_chunk_size", ["--vocab", "300,1000", "--elements", "2^10,4000", "--positions", "9",
                                           "--rounds", "2", "--out", str(out)]) == 0
    data = well_formed(out, "kl_chunk_size", "rows")
    assert len(data["rows"]) == 4 and all(row["same_figures"] for row in data["rows"])
    assert [row["positions_per_chunk"] for row in data["rows"]] == [3, 13, 1, 4]
    assert heldout.KL_ELEMENTS == before == data["default_kl_elements"]


def test_train_pit_vs_tt(work, tmp_path):
    out = tmp_path / "train_pit_vs_tt.json"
    assert run_benchmark("train_pit_vs_tt", ["--model", str(work / "src"), "--tokens", "128", "--seq-len", "32",
                                             "--batch-size", "2", "--eval-every", "2", "--eval-blocks", "1",
                                             "--timing-steps", "1", "--device", "cpu", "--work-dir",
                                             str(tmp_path / "runs"), "--out", str(out)]) == 0
    data = well_formed(out, "train_pit_vs_tt", "runs")
    assert set(data["runs"]) == {"pit", "tt"} and out.with_suffix(".png").is_file()


# -- the layout of benchmarks/ and studies/ (no model needed) ------------------------------------

SCRIPTS = sorted(p for p in (*BENCHMARKS.glob("*.py"), *STUDIES.glob("*.py")))
HELPERS = {"preserve_probe.py"}  # shared code of the preserve studies


@pytest.mark.parametrize("script", [p for p in SCRIPTS if p.name not in HELPERS], ids=lambda p: p.name)
def test_one_writer(script):
    """Every benchmark and study writes its result through ``pit_deploy.io.result_file.write_result`` and
    never writes JSON itself."""
    text = script.read_text(encoding="utf-8")
    assert "write_result(" in text
    assert "json.dump(" not in text and "write_text(json.dumps" not in text


def test_every_benchmark_is_smoked():
    smoked = {name.removeprefix("test_").removesuffix("_as_a_script") for name in globals() if name.startswith("test_")}
    benchmarks = {p.stem for p in BENCHMARKS.glob("*.py")}
    assert benchmarks <= smoked, f"not smoked: {sorted(benchmarks - smoked)}"


@pytest.mark.parametrize("folder", [BENCHMARKS, STUDIES], ids=lambda p: p.name)
def test_index_names_every_script_and_result(folder):
    """``benchmarks/README.md`` and ``studies/README.md`` name every script and result file."""
    index = (folder / "README.md").read_text(encoding="utf-8")
    names = [p.name for p in folder.glob("*.py") if p.name not in HELPERS]
    names += [f"results/{p.name}" for p in (folder / "results").iterdir() if p.suffix in (".json", ".md")]
    missing = [n for n in names if n not in index]
    assert not missing, f"{folder.name}/README.md does not name {missing}"
    for result in (folder / "results").glob("*.json"):
        json.loads(result.read_text(encoding="utf-8"))  # every committed result parses


def test_command_cost(work, tmp_path):
    """``convert`` of the tiny source, then ``export`` (ONNX fp32, tiny-ci) and ``verify``, each
    timed in its own process with its peak memory beside the model's fp32 size."""
    out = tmp_path / "command_cost.json"
    assert run_benchmark("command_cost", ["--model", str(work / "src"), "--runtime", "onnx", "--dtype", "float32",
                                          "--recipe", "tiny-ci", "--convert-arg=--calib-tokens=256",
                                          "--work", str(tmp_path / "w"), "--out", str(out)]) == 0
    data = well_formed(out, "command_cost", "rows")
    assert [(r["command"], r["exit_code"]) for r in data["rows"]] == [("convert", 0), ("export", 0), ("verify", 0)]
    assert data["complete"] and data["model"]["parameters"] > 0
    assert all(r["peak_rss_mib"] > 0 and r["peak_over_fp32"] > 0 for r in data["rows"])
    assert data["rows"][1]["output_mib"] > 0


@pytest.mark.slow
@pytest.mark.full
def test_pipeline_time(work, tmp_path):
    """``pit-deploy run smoke`` on the tiny source (ONNX only, no bench): each stage's record and
    the timed progress lines (a GPTQ grid, each artifact) are read into the result, beside the
    command line's answer times."""
    out = tmp_path / "pipeline_time.json"
    assert run_benchmark("pipeline_time", ["--recipe", "smoke", "--model", str(work / "src"), "--label", "smoke",
                                           "--set", "export.runtimes=['onnx']", "--set", "bench.enabled=false",
                                           "--out", str(out)]) == 0
    data = well_formed(out, "pipeline_time", "runs")
    run = data["runs"]["smoke"]
    assert run["exit_code"] == 0 and run["stages"]["export"]["status"] == "done"
    assert {"convert", "train", "export", "verify", "report"} <= set(run["stages"])
    kinds = {p["kind"] for p in run["parts"]}
    assert {"gptq", "artifact", "stage"} <= kinds, run["parts"]
    assert run["cli"]["help_s"] > 0 and run["cli"]["list_s"] > 0


def test_command_cost_of_a_random_model(tmp_path):
    """``--random-model``: a Gemma 3 structure past 65,536 tokens with random weights is built in
    the work folder, converted and exported; the result says the weights were random."""
    out = tmp_path / "command_cost.json"
    assert run_benchmark("command_cost", ["--random-model", "gemma3-tiny", "--runtime", "onnx", "--dtype", "float32",
                                          "--convert-arg=--accept-loss", "--convert-arg=--calib-tokens=256",
                                          "--work", str(tmp_path / "w"), "--out", str(out)]) == 0
    data = well_formed(out, "command_cost", "rows")
    assert data["model"]["vocab_size"] == 70_000 and data["model"]["weights"] == "random (gemma3-tiny)"
    assert [r["command"] for r in data["rows"]] == ["convert", "export", "verify"]
    assert data["rows"][1]["exit_code"] == 0


def test_provenance_records_the_checkout_the_script_started_from(tmp_path):
    """A result written after a tracked file changed (or a commit was made) during the run
    records the code the script started with: clean, at the first commit."""
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    script = repo / "benchmarks" / "probe.py"
    script.write_text(
        "import sys, subprocess\n"
        "from pathlib import Path\n"
        "from pit_deploy.io.result_file import write_result\n"
        "root = Path(__file__).resolve().parents[1]\n"
        "(root / 'notes.txt').write_text('changed while the benchmark ran')\n"
        "write_result(sys.argv[1], {'rows': [1]}, __file__)\n", encoding="utf-8")
    (repo / "notes.txt").write_text("as committed")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "-C", str(repo), "add", "."], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-q", "-m", "first"], check=True)
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, str(script), str(out)], check=True, cwd=repo)
    code = json.loads(out.read_text(encoding="utf-8"))["provenance"]["code_version"]
    assert code["git_commit"] == head and code["git_dirty"] is False
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True)
    assert "notes.txt" in status.stdout  # the checkout was dirty when the result was written

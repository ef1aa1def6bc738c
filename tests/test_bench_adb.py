"""``bench --adb`` without a phone: a stand-in ``adb`` on PATH emulates a device in a temporary
directory (``devices`` listings, ``-s``, ``push``, ``pull``, ``shell`` with the device's paths
mapped into that directory, ``getprop``) and a stand-in ``llama_main`` prints the stock
runner's kind of output, stats line included. Checked: the order and arguments of the adb
calls, the prompt reaching the runner verbatim through the device shell, the rows' numbers
derived from the stats lines, and exit 2 with a clear message for each unusable input."""

from __future__ import annotations

import json
import math
import os
import stat
import sys
from pathlib import Path

import pytest

from pit_deploy.cli import main
from pit_deploy.evaluate.bench import ROW_FIELDS
from pit_deploy.targets.executorch.bench_adb import (DEFAULT_DEVICE_DIR, Adb, parse_peak_rss_kib, parse_stats,
                                           pass_figures, runner_command)
from pit_deploy.targets.executorch.llm_runner import stats_problem
from pit_deploy.io.fs import write_json_atomic
from pit_deploy.io.manifest import MANIFEST_NAME, Artifact, Manifest, file_table, library_versions

SERIAL = "R5CT20ABCDE"
#: what the stand-in runner takes per thread count: (prefill ms, decode ms per token)
TIMINGS = {1: (40, 25), 2: (25, 16)}
LOAD_MS = 412
RSS_KIB = 183500
PROMPT_TOKENS = 8  # what the stand-in runner's "tokenizer" counts (tests ask for --prompt-len 8)
SMALL = ["--prompt-len", "8", "--gen-len", "6", "--reps", "1"]  # fits the exports' 64-token context

# --------------------------------------------------------------------------------------
# The stand-ins
# --------------------------------------------------------------------------------------

ADB_SCRIPT = r'''
"""Stand-in adb: one emulated device whose file system is $STANDIN_ADB_ROOT."""
import json, os, re, shutil, subprocess, sys
from pathlib import Path

root = Path(os.environ["STANDIN_ADB_ROOT"])
args = sys.argv[1:]
with open(os.environ["STANDIN_ADB_LOG"], "a") as fh:
    fh.write(json.dumps(args) + "\n")
devices = [tuple(d.split(":", 1)) for d in os.environ.get("STANDIN_ADB_DEVICES", "").split(",") if d]
serial = None
if args[:1] == ["-s"]:
    serial, args = args[1], args[2:]
if args == ["devices"]:
    print("List of devices attached")
    for name, state in devices:
        print(f"{name}\t{state}")
    print()
    sys.exit(0)
ready = [name for name, state in devices if state == "device"]
if serial is None and len(devices) > 1:
    sys.exit(print("adb: error: more than one device/emulator", file=sys.stderr) or 1)
if (serial or (ready[0] if ready else None)) not in ready:
    sys.exit(print(f"adb: device '{serial}' not found", file=sys.stderr) or 1)


def on_device(path):
    return root / path.lstrip("/")


def mapped(command):
    # device paths at the start of a shell word (or after '=') live under the emulated root
    return re.sub(r"(?<![\w.-])/(data|system)/", lambda m: f"{root}/{m.group(1)}/", command)


verb, rest = args[0], args[1:]
if verb == "shell":
    command = " ".join(rest)
    if command.startswith("getprop "):
        print(json.loads(os.environ.get("STANDIN_ADB_PROPS", "{}")).get(command.split()[1], ""))
        sys.exit(0)
    sys.exit(subprocess.run(["/bin/sh", "-c", mapped(command)], cwd=root).returncode)
if verb == "push":
    src, dst = Path(rest[0]), on_device(rest[1])
    if rest[1].endswith("/") or dst.is_dir():
        dst = dst / src.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)
    print(f"{src}: 1 file pushed, 0 skipped.")
    sys.exit(0)
if verb == "pull":
    src = on_device(rest[0])
    if not src.is_file():
        sys.exit(print(f"adb: error: failed to stat remote object '{rest[0]}'", file=sys.stderr) or 1)
    shutil.copy2(src, rest[1])
    print(f"{rest[0]}: 1 file pulled, 0 skipped.")
    sys.exit(0)
sys.exit(print(f"adb: unknown command {verb}", file=sys.stderr) or 1)
'''

# toybox's `time -v` (stderr): the child's exit status is time's own
TIME_SCRIPT = r'''
import os, subprocess, sys
args = sys.argv[1:]
verbose = args[:1] == ["-v"]
proc = subprocess.run(args[1:] if verbose else args)
if verbose:
    rss = os.environ.get("STANDIN_RSS_KIB", "0")
    if os.environ.get("STANDIN_TIME_FORMAT") == "gnu":
        print(f"\tCommand being timed: \"{' '.join(args[1:])}\"\n\tMaximum resident set size (kbytes): {rss}",
              file=sys.stderr)
    else:
        print(f"Real time (s): 1.204\nSystem time (s): 0.151\nUser time (s): 1.022\nMax RSS (KiB): {rss}\n"
              "Major faults: 0\nMinor faults: 41544\nFile system inputs: 0\nFile system outputs: 0\n"
              "Voluntary context switches: 312\nInvoluntary context switches: 45", file=sys.stderr)
sys.exit(proc.returncode)
'''

# a llama_main-like transcript: ET_LOG lines on stderr, prompt echo and text on stdout, one stats line
RUNNER_SCRIPT = r'''
import json, os, sys

TIMINGS, LOAD_MS, PROMPT_TOKENS = {timings!r}, {load_ms!r}, {prompt_tokens!r}
flags = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.jsonl"), "a") as fh:
    fh.write(json.dumps(sys.argv[1:]) + "\n")
log = lambda msg: print(f"I 00:00:00.{{len(msg):06d}} executorch:{{msg}}", file=sys.stderr)
threads = int(flags.get("cpu_threads", 1))
PROMPT_TOKENS = int(os.environ.get("STANDIN_PROMPT_TOKENS", PROMPT_TOKENS))  # 9: a tokenizer adding BOS
log(f"main.cpp:86] Resetting threadpool with num threads = {{threads}}")
for key in ("model_path", "tokenizer_path"):
    if not os.path.isfile(flags.get(key, "")):
        print(f"E 00:00:00.000100 executorch:file_data_loader.cpp:97] open() failed: No such file {{flags.get(key)}}",
              file=sys.stderr)
        sys.exit(1)
log("llm_runner.cpp:57] Loaded json tokenizer")
log("llm_runner.cpp:110] Reading metadata from model")
log("llm_runner.cpp:140] Metadata: get_max_seq_len = 64")
mode = os.environ.get("STANDIN_RUNNER", "ok")
if mode == "crash":
    print("E 00:00:00.004200 executorch:method.cpp:1090] Missing operator: [0] llama::custom_sdpa.out", file=sys.stderr)
    print("E 00:00:00.004300 executorch:main.cpp:110] Failed to create llama runner", file=sys.stderr)
    sys.exit(1)
log("text_llm_runner.cpp:96] RSS after loading model: 171.820312 MiB (0 if unsupported)")
prefill_ms, step_ms = TIMINGS[threads]
generated = int(flags["seq_len"]) - PROMPT_TOKENS - 1
print(flags["prompt"], end="")
print(" def value name data model" + "\n")
t0 = 1718000000000
stats = {{"prompt_tokens": PROMPT_TOKENS, "generated_tokens": generated, "model_load_start_ms": t0,
          "model_load_end_ms": t0 + LOAD_MS, "inference_start_ms": t0 + LOAD_MS + 3,
          "inference_end_ms": t0 + LOAD_MS + 3 + prefill_ms + step_ms * generated,
          "prompt_eval_end_ms": t0 + LOAD_MS + 3 + prefill_ms, "first_token_ms": t0 + LOAD_MS + 3 + prefill_ms,
          "aggregate_sampling_time_ms": 2, "SCALING_FACTOR_UNITS_PER_SECOND": 1000}}
if mode == "impossible":  # a broken or foreign runner: a first token 1e308 ms before the start
    stats["first_token_ms"] = -1e308
if mode != "nostats":
    print("PyTorchObserver " + json.dumps(stats, separators=(",", ":")))
log(f"stats.h:105] \tPrompt Tokens: {{PROMPT_TOKENS}}    Generated Tokens: {{generated}}")
'''


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


class Phone:
    """The stand-in adb's environment, its call log and the emulated device's files."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root, self.log, self.monkeypatch = tmp / "device", tmp / "adb-calls.jsonl", monkeypatch
        self.root.mkdir()
        bindir = tmp / "bin"
        _script(bindir / "adb", ADB_SCRIPT)
        _script(self.root / "system" / "bin" / "time", TIME_SCRIPT)
        self.runner = _script(tmp / "host" / "llama_main", RUNNER_SCRIPT.format(
            timings=TIMINGS, load_ms=LOAD_MS, prompt_tokens=PROMPT_TOKENS))
        monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.delenv("ANDROID_SERIAL", raising=False)
        for key, value in {"STANDIN_ADB_ROOT": str(self.root), "STANDIN_ADB_LOG": str(self.log),
                           "STANDIN_ADB_DEVICES": f"{SERIAL}:device", "STANDIN_RSS_KIB": str(RSS_KIB),
                           "STANDIN_ADB_PROPS": json.dumps({"ro.product.model": "Pixel 8",
                                                            "ro.product.cpu.abi": "arm64-v8a"})}.items():
            monkeypatch.setenv(key, value)

    def devices(self, listing: str) -> None:
        self.monkeypatch.setenv("STANDIN_ADB_DEVICES", listing)

    def calls(self) -> list[list[str]]:
        return [json.loads(l) for l in self.log.read_text().splitlines()] if self.log.exists() else []

    def runner_calls(self) -> list[list[str]]:
        path = self.root / DEFAULT_DEVICE_DIR.lstrip("/") / "calls.jsonl"
        return [json.loads(l) for l in path.read_text().splitlines()]


@pytest.fixture
def phone(tmp_path, monkeypatch) -> Phone:
    return Phone(tmp_path, monkeypatch)


# --------------------------------------------------------------------------------------
# Minimal export directories (what `pit-deploy export` writes, without lowering a model:
# the phone path only pushes the .pte, so its bytes need not be a real program)
# --------------------------------------------------------------------------------------


def _export(root: Path, name: str, arts: list[tuple[str, str, str]], *, verified: bool = True,
            tokenizer_in_artifact: bool = False, reference_tokenizer: bool = True) -> Path:
    from pit_deploy.tiny import tiny_tokenizer

    directory = root / name
    (directory / "reference").mkdir(parents=True)
    if reference_tokenizer:
        tiny_tokenizer().save_pretrained(directory / "reference")
    (directory / "reference" / "config.json").write_text("{}")
    artifacts = []
    for runtime, mode, tying in arts:
        folder = directory / f"{runtime}-{mode}"
        folder.mkdir()
        if runtime == "executorch":
            (folder / "model.pte").write_bytes(b"ET12" + bytes(range(256)) * 40)
            if tokenizer_in_artifact:
                tiny_tokenizer().save_pretrained(folder)
        else:
            (folder / "model.onnx").write_bytes(b"onnx" * 100)
        artifacts.append(Artifact(target=runtime, mode=mode, dtype="float32", path=folder.name,
                                  files=file_table(directory, folder), tying=tying,
                                  shapes={"vocab_size": 512, "max_seq_len": 64}))
    manifest = Manifest(source={"kind": "test"}, reference={"files": file_table(directory, directory / "reference")},
                        artifacts=artifacts, versions=library_versions(),
                        verification={"artifacts": [{"runtime": a.runtime, "mode": a.mode, "dtype": a.dtype, "passed": True,
                                                     "digests": {rel: f["sha256"] for rel, f in a.files.items()}}
                                                    for a in artifacts]} if verified else None)
    write_json_atomic(directory / MANIFEST_NAME, manifest.to_dict())
    return directory


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A PIT export (a .pte with its own tokenizer, and an ONNX artifact the phone skips) and a
    transpose-tied one (a .pte whose tokenizer is the reference's)."""
    root = tmp_path_factory.mktemp("adb-exports")
    pit = _export(root, "pit", [("executorch", "factorized", "pit"), ("onnx", "factorized", "pit")],
                  tokenizer_in_artifact=True)
    tt = _export(root, "tt", [("executorch", "tied", "tied")])
    onnx_only = _export(root, "onnx-only", [("onnx", "factorized", "pit")])
    no_tok = _export(root, "no-tok", [("executorch", "factorized", "pit")], reference_tokenizer=False)
    return {"pit": pit, "tt": tt, "onnx-only": onnx_only, "no-tok": no_tok}


def _shell_kind(command: str) -> str:
    """A short name for a device shell command line (to compare call sequences)."""
    for prefix, kind in (("getprop ", "getprop"), ("mkdir -p ", "mkdir"), ("chmod +x ", "chmod"),
                         ("/system/bin/time -v true", "probe-time"), ("rm -r ", "rm"), ("cd ", "run")):
        if command.startswith(prefix):
            return kind
    return command


# --------------------------------------------------------------------------------------
# A whole run
# --------------------------------------------------------------------------------------


def test_push_run_pull_sequence_and_rows(phone, exports, tmp_path, capsys):
    out, png = tmp_path / "rows.json", tmp_path / "phone.png"
    code = main(["bench", "--adb", "--runner", str(phone.runner), str(exports["pit"]), str(exports["tt"]),
                 "--threads", "1,2", "--prompt-len", "8", "--gen-len", "6", "--reps", "2",
                 "--json", "--out", str(out), "--plot", str(png)])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    data = json.loads(captured.out)
    assert json.loads(out.read_text()) == data and png.stat().st_size > 1000
    assert "skipping pit/onnx-factorized" in captured.err

    # --- the adb calls, in order ---
    calls = phone.calls()
    assert calls[0] == ["devices"]
    assert all(c[:2] == ["-s", SERIAL] for c in calls[1:])
    steps = [(c[2], _shell_kind(c[3]) if c[2] == "shell" else c[3:]) for c in calls[1:]]
    d = DEFAULT_DEVICE_DIR
    per_cell = [("shell", "run"), ("pull", [f"{d}/run.log"])] * 3  # warm-up + 2 reps
    expected = [("shell", "getprop"), ("shell", "getprop"), ("shell", "mkdir"),
                ("push", [str(phone.runner), f"{d}/llama_main"]), ("shell", "chmod"), ("shell", "probe-time")]
    for i, (export, tok_dir) in enumerate(((exports["pit"], "executorch-factorized"), (exports["tt"], "reference"))):
        art = next(export.glob("executorch-*"))
        expected += [("shell", "mkdir"),
                     ("push", [str(art / "model.pte"), f"{d}/artifact-{i}/model.pte"]),
                     ("push", [str(export / tok_dir / "tokenizer.json"), f"{d}/artifact-{i}/tokenizer.json"])]
        expected += [step for _threads in (1, 2) for step in per_cell] + [("shell", "rm")]
    # the pull's local target is a temporary file: compare its device side only
    norm = lambda s: (s[0], s[1][0]) if s[0] == "pull" else s
    assert [norm(s) for s in steps] == [norm(s) for s in expected]
    getprops = [c[3] for c in calls if c[2:3] == ["shell"] and c[3].startswith("getprop")]
    assert getprops == ["getprop ro.product.model", "getprop ro.product.cpu.abi"]
    assert [c[3] for c in calls if c[2:3] == ["shell"] and c[3].startswith("chmod")] == [f"chmod +x {d}/llama_main"]

    # --- what the runner was given: the prompt text verbatim, the flags of llama_main ---
    runs = phone.runner_calls()
    assert len(runs) == 2 * 2 * 3
    texts = data["machine"]["prompt_texts"]
    for argv, (artifact, threads) in zip(runs, [(a, t) for a in (0, 1) for t in (1, 2) for _ in range(3)]):
        flags = dict(a[2:].split("=", 1) for a in argv)
        assert flags["prompt"] == texts["pit:8" if artifact == 0 else "tt:8"]
        assert flags["model_path"].endswith(f"{d}/artifact-{artifact}/model.pte")
        assert flags["tokenizer_path"].endswith(f"{d}/artifact-{artifact}/tokenizer.json")
        assert (flags["seq_len"], flags["temperature"], flags["cpu_threads"]) == ("14", "0", str(threads))
    assert any(q in texts["pit:8"] for q in "'\"") and " " in texts["pit:8"]  # the held-out text is Python source
    assert len(data["prompts"]["pit:8"]) == 8

    # --- the rows: every bench field, the numbers the stats lines imply ---
    rows = data["rows"]
    assert [(r["artifact"], r["threads"]) for r in rows] == [
        ("pit/executorch-factorized", 1), ("pit/executorch-factorized", 2), ("tt/executorch-tied", 1), ("tt/executorch-tied", 2)]
    for r in rows:
        assert set(ROW_FIELDS) <= set(r)
        prefill_ms, step_ms = TIMINGS[r["threads"]]
        assert r["runtime"] == "executorch-llama_main" and r["verified"] is True
        assert r["device"] == {"serial": SERIAL, "model": "Pixel 8", "abi": "arm64-v8a"}
        assert (r["prompt_len"], r["gen_len"], r["prompt_tokens"], r["generated_tokens"]) == (8, 6, 8, 5)
        assert r["prefill_tok_s"] == pytest.approx(8 / (prefill_ms / 1e3))
        assert r["decode_tok_s"] == pytest.approx(1e3 / step_ms)
        assert r["prefill_tok_s_std"] == 0 and r["decode_tok_s_std"] == 0
        assert r["ttft_ms"] == pytest.approx(prefill_ms)
        assert r["decode_ms_p50"] == pytest.approx(step_ms) and r["decode_ms_p90"] == pytest.approx(step_ms)
        assert r["load_s"] == pytest.approx(LOAD_MS / 1e3)
        assert r["peak_rss_mb"] == pytest.approx(RSS_KIB / 1024)
        assert r["size_mb"] == pytest.approx((4 + 256 * 40 + (0 if r["tying"] == "tied" else _tok_bytes(exports["pit"]))) / 1e6)
    assert {(q["artifact"], q["threads"]) for q in data["ratios"]} == {("pit/executorch-factorized", 1),
                                                                     ("pit/executorch-factorized", 2)}
    assert data["machine"]["device"]["model"] == "Pixel 8"
    assert not data["warnings"]
    assert not (phone.root / d.lstrip("/") / "artifact-0").exists()  # removed after its cells
    assert (phone.root / d.lstrip("/") / "llama_main").is_file()


def _tok_bytes(export: Path) -> int:
    return sum(p.stat().st_size for p in (export / "executorch-factorized").iterdir() if p.name != "model.pte")


def test_table_and_peak_memory_in_gnu_wording(phone, exports, monkeypatch, capsys):
    """The plain table prints; GNU time's "Maximum resident set size" parses like toybox's."""
    monkeypatch.setenv("STANDIN_TIME_FORMAT", "gnu")
    monkeypatch.setenv("STANDIN_RSS_KIB", "204800")
    assert main(["bench", "--adb", "--runner", str(phone.runner), str(exports["tt"]), "--prompt-len", "8",
                 "--gen-len", "6", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "tt/executorch-tied (float32)" in out and "pp8" in out and "tg6" in out
    assert " 200 |" in out  # 204800 KiB = 200 MiB in the RSS column


def test_device_without_time_reports_no_memory(phone, exports, tmp_path, capsys):
    (phone.root / "system" / "bin" / "time").unlink()
    out = tmp_path / "rows.json"
    assert main(["bench", "--adb", "--runner", str(phone.runner), str(exports["tt"]), "--prompt-len", "8",
                 "--gen-len", "6", "--reps", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["rows"][0]["peak_rss_mb"] is None  # not measured: null in strict JSON
    assert any("no toybox `time -v`" in w for w in data["warnings"])
    runs = [c[3] for c in phone.calls() if c[2:3] == ["shell"] and c[3].startswith("cd ")]
    assert runs and not any("/system/bin/time" in r for r in runs)


def test_seq_len_follows_the_device_token_count(phone, exports, monkeypatch, tmp_path):
    """--seq_len is prompt + generated tokens as the runner counts them: when its tokenizer
    makes 9 tokens of the 8-token text (a BOS), the measured invocations still generate
    --gen-len tokens, and the row says whose count its rates use."""
    monkeypatch.setenv("STANDIN_PROMPT_TOKENS", "9")
    out = tmp_path / "rows.json"
    assert main(["bench", "--adb", "--runner", str(phone.runner), str(exports["tt"]), *SMALL, "--reps", "2",
                 "--out", str(out)]) == 0
    seq_lens = [dict(a[2:].split("=", 1) for a in argv)["seq_len"] for argv in phone.runner_calls()]
    assert seq_lens == ["14", "15", "15"]  # warm-up with the local count, then the device's
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert (row["prompt_tokens"], row["generated_tokens"]) == (9, 5)
    assert row["prefill_tok_s"] == pytest.approx(9 / (TIMINGS[1][0] / 1e3))
    assert any("made 9 prompt tokens of the text (asked 8)" in w for w in data["warnings"])
    assert not any("stopped after" in w for w in data["warnings"])


def test_prompt_with_spaces_quotes_and_newlines_reaches_the_runner_verbatim(phone):
    """One level of quoting for the device's sh (adb joins its arguments and hands them to it)."""
    adb = Adb("adb", SERIAL)
    d = DEFAULT_DEVICE_DIR
    adb.shell(f"mkdir -p {d}/a")
    adb.push(phone.runner, f"{d}/llama_main")
    adb.shell(f"chmod +x {d}/llama_main")
    for name in ("model.pte", "tokenizer.json"):
        adb.push(phone.runner, f"{d}/a/{name}")  # any file: the stand-in only checks they exist
    prompt = 'it\'s a "test" with $HOME, `uname`; rm -rf / && echo \\n done\n--second line\ttab \'\' ""'
    said = adb.shell(runner_command(d, f"{d}/llama_main", f"{d}/a/model.pte", f"{d}/a/tokenizer.json", prompt,
                                    20, 2, f"{d}/run.log", time_wrapper=True))
    assert said.strip().endswith("PIT_BENCH_EXIT=0")
    (argv,) = phone.runner_calls()
    assert f"--prompt={prompt}" in argv and "--cpu_threads=2" in argv and "--seq_len=20" in argv
    log = phone.root / d.lstrip("/") / "run.log"
    assert parse_stats(log.read_text())["prompt_tokens"] == PROMPT_TOKENS
    assert parse_peak_rss_kib(log.read_text()) == RSS_KIB


# --------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------

TRANSCRIPT = """I 00:00:00.000210 executorch:main.cpp:86] Resetting threadpool with num threads = 4
I 00:00:00.041233 executorch:text_llm_runner.cpp:96] RSS after loading model: 512.4 MiB (0 if unsupported)
Once upon a time there was a model
PyTorchObserver {"prompt_tokens":64,"generated_tokens":127,"model_load_start_ms":1718000000000,"model_load_end_ms":1718000000381,"inference_start_ms":1718000000390,"inference_end_ms":1718000003565,"prompt_eval_end_ms":1718000000590,"first_token_ms":1718000000590,"aggregate_sampling_time_ms":31,"SCALING_FACTOR_UNITS_PER_SECOND":1000}
I 00:00:03.566000 executorch:stats.h:105] \tPrompt Tokens: 64    Generated Tokens: 127
Real time (s): 3.610
Max RSS (KiB): 524800
"""


def test_stats_line_and_memory_parse_into_figures():
    stats = parse_stats(TRANSCRIPT)
    fig = pass_figures(stats)
    assert fig["prefill_tok_s"] == pytest.approx(64 / 0.200)
    assert fig["decode_tok_s"] == pytest.approx(127 / 2.975)
    assert fig["decode_ms_per_token"] == pytest.approx(2975 / 127)
    assert fig["ttft_ms"] == pytest.approx(200.0) and fig["load_s"] == pytest.approx(0.381)
    assert parse_peak_rss_kib(TRANSCRIPT) == 524800
    assert parse_stats("no stats here\nPyTorchObserver {not json}\n") is None
    zero = dict(stats, prompt_eval_end_ms=stats["inference_start_ms"])  # below the 1 ms clock
    assert math.isnan(pass_figures(zero)["prefill_tok_s"])


@pytest.mark.parametrize("change, message", [
    ({"first_token_ms": -1e308}, "first_token_ms is -1e+308; it must be finite and non-negative"),
    ({"generated_tokens": -5}, "generated_tokens is -5"),
    ({"prompt_tokens": 0}, "the runner read no prompt"),
    ({"prompt_tokens": 7.5}, "prompt_tokens is 7.5, not a whole number"),
    ({"inference_end_ms": float("inf")}, "inference_end_ms is inf"),
    ({"model_load_end_ms": "soon"}, "model_load_end_ms is 'soon', not a number"),
    ({"inference_end_ms": 1718000000000}, "inference_end_ms (1718000000000) precedes prompt_eval_end_ms"),
    ({"SCALING_FACTOR_UNITS_PER_SECOND": 0}, "SCALING_FACTOR_UNITS_PER_SECOND is 0"),
])
def test_impossible_stats_are_refused(change, message):
    stats = {**parse_stats(TRANSCRIPT), **change}
    assert message in stats_problem(stats)
    with pytest.raises(ValueError, match="impossible runner stats"):
        pass_figures(stats)
    assert stats_problem(parse_stats(TRANSCRIPT)) is None


def test_impossible_stats_from_the_device_are_exit_2(phone, exports, monkeypatch, capsys):
    """The runner's output is input from outside pit-deploy: exit 2 naming the field, no row."""
    monkeypatch.setenv("STANDIN_RUNNER", "impossible")
    assert main(["bench", "--adb", "--runner", str(phone.runner), str(exports["tt"]), *SMALL, "--json"]) == 2
    captured = capsys.readouterr()
    assert "llama_main printed an impossible stats line (first_token_ms is -1e+308" in captured.err
    assert captured.out == ""


# --------------------------------------------------------------------------------------
# Unusable input: exit 2, one line naming the problem and what to do
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("devices, extra, message", [
    ("", [], "no device attached"),
    (f"{SERIAL}:unauthorized", [], "accept the \"Allow USB debugging?\" prompt (the computer's RSA key)"),
    (f"{SERIAL}:device,emulator-5554:device", [], "several devices attached"),
    (f"{SERIAL}:device,emulator-5554:device", ["--serial", "0123456789"], "--serial 0123456789 is not attached"),
    (f"{SERIAL}:offline", [], "is offline, not ready"),
])
def test_device_problems_are_exit_2(phone, exports, capsys, devices, extra, message):
    phone.devices(devices)
    code = main(["bench", "--adb", "--runner", str(phone.runner), str(exports["tt"]), *SMALL, *extra])
    assert code == 2
    assert message in capsys.readouterr().err
    assert phone.calls() == [["devices"]]  # nothing pushed, nothing run


def test_serial_picks_one_of_several(phone, exports, capsys):
    phone.devices(f"emulator-5554:device,{SERIAL}:device")
    assert main(["bench", "--adb", "--serial", SERIAL, "--runner", str(phone.runner), str(exports["tt"]),
                 "--prompt-len", "8", "--gen-len", "6", "--reps", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["device"]["serial"] == SERIAL
    assert all(c[:2] == ["-s", SERIAL] for c in phone.calls()[1:])


def test_adb_not_on_path_is_exit_2(phone, exports, tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert main(["bench", "--adb", "--runner", str(phone.runner), str(exports["tt"]), *SMALL]) == 2
    assert "adb is not on PATH" in capsys.readouterr().err


def test_runner_missing_or_not_executable_is_exit_2(phone, exports, tmp_path, capsys):
    assert main(["bench", "--adb", "--runner", str(tmp_path / "nope"), str(exports["tt"]), *SMALL]) == 2
    assert "no such file" in capsys.readouterr().err
    plain = tmp_path / "llama_main.txt"
    plain.write_text("not a program")
    assert main(["bench", "--adb", "--runner", str(plain), str(exports["tt"]), *SMALL]) == 2
    assert "is not executable" in capsys.readouterr().err
    assert phone.calls() == []


@pytest.mark.parametrize("which, message", [
    ("onnx-only", "no .pte artifact in"),
    ("no-tok", "no tokenizer file (tokenizer.json, tokenizer.model, tokenizer.bin)"),
])
def test_unusable_exports_are_exit_2(phone, exports, capsys, which, message):
    assert main(["bench", "--adb", "--runner", str(phone.runner), str(exports[which]), *SMALL]) == 2
    assert message in capsys.readouterr().err
    assert phone.calls() == []  # found before the device is touched


def test_context_too_short_is_exit_2(phone, exports, capsys):
    assert main(["bench", "--adb", "--runner", str(phone.runner), str(exports["tt"]), "--prompt-len", "60",
                 "--gen-len", "8"]) == 2
    assert "exceed the artifact's context of 64" in capsys.readouterr().err


@pytest.mark.parametrize("mode, message", [
    ("crash", "llama_main failed on the device (exit 1)"),
    ("nostats", "exit 0 but no `PyTorchObserver` stats line"),
])
def test_runner_failing_on_the_device_is_exit_2_with_its_last_lines(phone, exports, monkeypatch, capsys, mode, message):
    monkeypatch.setenv("STANDIN_RUNNER", mode)
    code = main(["bench", "--adb", "--runner", str(phone.runner), str(exports["tt"]), "--prompt-len", "8",
                 "--gen-len", "6", "--reps", "1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and "tt/executorch-tied (1 threads)" in err
    tail = "Failed to create llama runner" if mode == "crash" else "Prompt Tokens: 8"
    assert tail in err and "Max RSS" not in err  # the runner's last lines are in the message, time's report not
    assert len(phone.runner_calls()) == 1  # it stopped at the warm-up


@pytest.mark.parametrize("args, message", [
    (["--bundle", "out.tar.gz"], "does not combine with --bundle"),
    (["--ingest", "rows.json"], "does not combine with --ingest"),
    (["--torch", "default"], "does not combine with --torch"),
])
def test_adb_refuses_bundle_ingest_and_torch(phone, exports, tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--adb", "--runner", str(phone.runner), str(exports["tt"]), *SMALL, *args]) == 2
    assert message in capsys.readouterr().err
    assert phone.calls() == [] and not (tmp_path / "out.tar.gz").exists()


@pytest.mark.parametrize("args, message", [
    (["--adb"], "--adb needs --runner PATH"),
    (["--runner", "llama_main"], "apply to --adb only"),
    (["--serial", SERIAL], "apply to --adb only"),
    (["--adb", "--runner", "{runner}", "--device-dir", "relative/dir"], "must be an absolute directory"),
])
def test_adb_flag_mistakes_are_exit_2(phone, exports, capsys, args, message):
    args = [a.replace("{runner}", str(phone.runner)) for a in args]
    assert main(["bench", str(exports["tt"]), *SMALL, *args]) == 2
    assert message in capsys.readouterr().err
    assert phone.calls() == []

"""``pit-deploy bench --adb``: the ``.pte`` artifacts of export directories timed on an Android
phone by ExecuTorch's stock LLM runner (``llama_main``), driven over ``adb``.

Why the stock runner rather than the bundle's Python cells (``bench --bundle``): a phone has
no Python, and what an app ships is the C++ runner; its figures are the ones a deployment
sees. The ``.pte`` files follow that runner's conventions (``targets/executorch/export.py``), so
they run unchanged.

What happens (``docs/bench.md``, "Phones over adb"): every check that needs no device runs
first (flags, the runner binary, manifests, ``.pte`` files, tokenizers); then the device is
picked from ``adb devices``; the runner is pushed once, each artifact's ``.pte`` and
tokenizer to a folder of its own under ``--device-dir``; for each prompt length and thread
count one warm-up invocation, then ``reps`` measured invocations, each a fresh process run
through ``adb shell`` under the device's ``/system/bin/time -v`` with its output redirected
to a log file on the device, which is pulled back and parsed. The runner prints one stats
line, ``PyTorchObserver {json}`` (``extension/llm/runner/stats.h`` in ExecuTorch), from which
the rows' rates and times are derived; ``time -v`` gives the process's peak resident set.

Nothing here needs a phone to be tested: ``tests/test_bench_adb.py`` puts a stand-in ``adb``
on ``PATH`` that emulates a device in a temporary directory.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ...errors import PitError
from ...evaluate.bench import BenchOptions, BenchResult, prompt_text
from ...evaluate.bench_rows import check_context, export_names, reference_positions, runner_row, verification_state
from ...io.manifest import REFERENCE_DIR, Manifest
from ...runtime.standalone import pte_data_file
from .. import get_target
from . import PTE_NAME
from .llm_runner import pass_figures, stats_problem

Progress = Callable[[str], None]

RUNTIME = "executorch-llama_main"
DEFAULT_DEVICE_DIR = "/data/local/tmp/pit-bench"
RUNNER_NAME = "llama_main"
STATS_PREFIX = "PyTorchObserver "
#: the device's toybox ``time``; an absolute path so that no shell builtin ``time`` is used
DEVICE_TIME = "/system/bin/time"
#: printed after the runner by the device shell: its exit status, whatever adb's own exit
#: status means on this adb version (old adb without the shell protocol always exits 0)
EXIT_MARKER = "PIT_BENCH_EXIT="
#: tokenizer files llama_main loads (HF ``tokenizer.json`` first), in order of preference
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer.bin")
#: toybox ``time -v`` prints ``Max RSS (KiB): N``; GNU time ``Maximum resident set size (kbytes): N``
_RSS = re.compile(r"(?:Max RSS \(KiB\)|Maximum resident set size \(kbytes\)):\s*(\d+)")
_STATS_KEYS = ("prompt_tokens", "generated_tokens", "model_load_start_ms", "model_load_end_ms",
               "inference_start_ms", "prompt_eval_end_ms", "first_token_ms", "inference_end_ms")


@dataclass(frozen=True)
class AdbOptions:
    """Where and with what the phone runs (validated by :func:`bench_adb` before any device work)."""

    runner: str
    serial: str | None = None
    device_dir: str = DEFAULT_DEVICE_DIR
    #: seconds one adb call may take (a push of a large ``.pte``, one runner invocation)
    timeout_s: float = 3600.0


# --------------------------------------------------------------------------------------
# adb
# --------------------------------------------------------------------------------------


class Adb:
    """``adb [-s SERIAL] ...`` as subprocesses; a failure is a :class:`PitError` naming the call.

    Every call after the device is picked carries ``-s SERIAL``, so a second phone plugged in
    mid-run cannot make adb ambiguous."""

    def __init__(self, exe: str, serial: str | None = None, timeout_s: float = 3600.0) -> None:
        self.exe, self.serial, self.timeout_s = exe, serial, timeout_s

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        argv = [self.exe, *(["-s", self.serial] if self.serial else []), *args]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            raise PitError(f"`adb {_short(args)}` did not finish within {self.timeout_s:.0f} s; "
                           "is the device still connected and awake?") from None
        if check and proc.returncode != 0:
            said = (proc.stderr.strip() or proc.stdout.strip())[-800:]
            raise PitError(f"`adb {_short(args)}` failed (exit {proc.returncode}): {said}; "
                           "check the connection with `adb devices`")
        return proc

    def shell(self, command: str, check: bool = True) -> str:
        """Run one device shell command line (already quoted for the device's ``sh``)."""
        return self.run("shell", command, check=check).stdout

    def push(self, src: str | Path, dst: str) -> None:
        self.run("push", str(src), dst)

    def pull(self, src: str, dst: str | Path) -> None:
        self.run("pull", src, str(dst))


def _short(args: Sequence[str]) -> str:
    text = " ".join(args)
    return text if len(text) <= 120 else text[:117] + "..."


def find_adb() -> str:
    """The ``adb`` executable on ``PATH``."""
    exe = shutil.which("adb")
    if exe is None:
        raise PitError("adb is not on PATH: install Android's platform-tools (the `adb` client) and put it on PATH")
    return exe


def list_devices(adb: Adb) -> list[tuple[str, str]]:
    """``(serial, state)`` of every device ``adb devices`` lists (states: ``device``,
    ``unauthorized``, ``offline``, ``no permissions (...)``, ...)."""
    out = adb.run("devices").stdout
    devices = []
    for line in out.splitlines():
        line = line.strip()
        if not line or line.startswith("*") or line.startswith("List of devices"):
            continue
        serial, _, state = line.partition("\t") if "\t" in line else line.partition(" ")
        devices.append((serial.strip(), state.strip()))
    return devices


def pick_device(devices: list[tuple[str, str]], serial: str | None) -> str:
    """The serial to use: ``serial`` if given (else ``$ANDROID_SERIAL``, as adb itself does),
    else the only device; a clear :class:`PitError` for every other situation."""
    listing = ", ".join(f"{s} ({st})" for s, st in devices) or "none"
    serial = serial or os.environ.get("ANDROID_SERIAL") or None
    if serial is not None:
        states = dict(devices)
        if serial not in states:
            raise PitError(f"--serial {serial} is not attached; `adb devices` lists: {listing}")
        chosen = (serial, states[serial])
    elif not devices:
        raise PitError("no device attached: connect a phone by USB with USB debugging on (Settings → Developer "
                       "options), accept its prompt, and check that `adb devices` lists it")
    elif len(devices) > 1:
        raise PitError(f"several devices attached ({listing}): pick one with --serial")
    else:
        chosen = devices[0]
    serial, state = chosen
    if state == "device":
        return serial
    if state == "unauthorized":
        raise PitError(f"device {serial} is unauthorized: unlock the phone and accept the \"Allow USB debugging?\" "
                       "prompt (the computer's RSA key), then rerun")
    if state.startswith("no permissions"):
        raise PitError(f"device {serial}: no permissions to open it over USB ({state}); fix the udev rules "
                       "or run `adb kill-server` and retry")
    raise PitError(f"device {serial} is {state}, not ready: reconnect it (or `adb reconnect`) until "
                   "`adb devices` shows it as 'device'")


def check_runner(path: str | Path) -> Path:
    """The runner binary on this machine: an existing, executable file."""
    runner = Path(path)
    if not runner.is_file():
        raise PitError(f"--runner {path}: no such file; build ExecuTorch's llama_main for the phone "
                       "(docs/bench.md, \"Phones over adb\") and pass its path")
    if not os.access(runner, os.X_OK):
        raise PitError(f"--runner {path} is not executable; `chmod +x {path}` (and check it is the llama_main binary)")
    return runner


# --------------------------------------------------------------------------------------
# What to run
# --------------------------------------------------------------------------------------


@dataclass
class PhoneArtifact:
    """One ``.pte`` artifact of an export directory, with the files the runner needs."""

    label: str
    directory: Path
    #: the export's name in labels and prompt keys (unique among the directories, :func:`export_names`)
    export: str
    pte: Path
    tokenizer: Path
    meta: dict[str, Any]
    vocab: int
    context: int | None
    #: the program's named data file (``model.ptd``: constants kept outside the ``.pte``), if any
    data: Path | None = None


def find_tokenizer(folder: Path, reference: Path) -> Path | None:
    """The tokenizer file for the runner: the artifact folder's own first, else the export's
    reference checkpoint's (where every export keeps one)."""
    for where in (folder, reference):
        for name in TOKENIZER_FILES:
            if (where / name).is_file():
                return where / name
    return None


def plan_phone(directories: Sequence[str | Path], opts: BenchOptions,
               say: Progress) -> tuple[list[PhoneArtifact], list[str]]:
    """Every ``.pte`` artifact of ``directories`` (ONNX ones skipped with a note), checked
    before the device is touched; plus the warnings about unverified exports."""
    if not directories:
        raise PitError("--adb needs export directories with .pte artifacts")
    found, warnings, skipped = [], [], []
    manifests = [(Path(d), Manifest.read(d)) for d in directories]  # every manifest is read before any work
    for (directory, manifest), name in zip(manifests, export_names(directories)):
        positions = reference_positions(directory)
        for art in manifest.artifacts:
            label = f"{name}/{art.path}"
            if not get_target(art.target).phone:
                skipped.append(label)
                continue
            folder = directory / art.path
            pte = folder / PTE_NAME
            if not pte.is_file():
                candidates = sorted(folder.glob("*.pte"))
                if not candidates:
                    raise PitError(f"{label}: no .pte file in {folder}; the export is incomplete — re-export it")
                pte = candidates[0]
            tokenizer = find_tokenizer(folder, directory / REFERENCE_DIR)
            if tokenizer is None:
                raise PitError(f"{label}: no tokenizer file ({', '.join(TOKENIZER_FILES)}) in {folder} or "
                               f"{directory / REFERENCE_DIR}; llama_main needs one — re-export from a model "
                               "with a tokenizer")
            check_context(label, art, opts, positions)
            verified = verification_state(manifest, art, label, directory, warnings)
            found.append(PhoneArtifact(
                label=label, directory=directory, export=name, pte=pte, tokenizer=tokenizer,
                data=pte_data_file(pte),
                vocab=int(art.shapes.get("vocab_size") or 1), context=art.shapes.get("max_seq_len"),
                meta={"artifact": label, "runtime": RUNTIME, "mode": art.mode, "dtype": art.dtype,
                      "tying": getattr(art, "tying", "pit"), "gen_len": opts.gen_len,
                      "size_mb": art.bytes / 1e6, "verified": verified}))
    for label in skipped:
        say(f"skipping {label}: the phone path runs ExecuTorch's llama_main, which reads .pte artifacts only")
    if not found:
        raise PitError("no .pte artifact in " + ", ".join(map(str, directories))
                       + (f" (skipped {', '.join(skipped)}: ONNX)" if skipped else "")
                       + "; export with `--runtime executorch`")
    return found, warnings


def load_tokenizer(art: PhoneArtifact) -> Any:
    """The Hugging Face tokenizer that builds the prompt text here: the one beside the file
    pushed to the phone, else the export's reference one."""
    from ...io.sources import maybe_tokenizer

    tokenizer = (maybe_tokenizer(art.tokenizer.parent, True, False)
                 or maybe_tokenizer(art.directory / REFERENCE_DIR, True, False))
    if tokenizer is None:
        raise PitError(f"{art.label}: the tokenizer in {art.tokenizer.parent} cannot be loaded here to build the "
                       "prompt text; re-export from a model with a Hugging Face tokenizer")
    return tokenizer


def runner_command(device_dir: str, runner: str, pte: str, tokenizer: str, prompt: str, seq_len: int,
                   threads: int, log: str, time_wrapper: bool, data: str | None = None) -> str:
    """One device shell command line: the runner's flags (``examples/models/llama/main.cpp`` in
    ExecuTorch), each argument quoted for the device's ``sh`` (the prompt holds spaces, quotes
    and newlines), stdout and stderr into ``log``, then the exit status after a marker."""
    argv = ([DEVICE_TIME, "-v"] if time_wrapper else []) + [
        runner, f"--model_path={pte}", f"--tokenizer_path={tokenizer}", f"--prompt={prompt}",
        f"--seq_len={seq_len}", "--temperature=0", f"--cpu_threads={threads}"]
    if data:
        argv.append(f"--data_paths={data}")
    return (f"cd {shlex.quote(device_dir)} && {shlex.join(argv)} > {shlex.quote(log)} 2>&1; "
            f"echo {EXIT_MARKER}$?")


# --------------------------------------------------------------------------------------
# Parsing the runner's output
# --------------------------------------------------------------------------------------


def parse_stats(output: str) -> dict[str, Any] | None:
    """The last ``PyTorchObserver {json}`` line of the runner's output (``None``: none)."""
    stats = None
    for line in output.splitlines():
        at = line.find(STATS_PREFIX)
        if at < 0:
            continue
        try:
            data = json.loads(line[at + len(STATS_PREFIX):].strip())
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict) and all(k in data for k in _STATS_KEYS):
            stats = data
    return stats


def parse_peak_rss_kib(output: str) -> int | None:
    """``time -v``'s maximum resident set size in KiB (toybox or GNU wording)."""
    hits = _RSS.findall(output)
    return int(hits[-1]) if hits else None


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def runner_output(log: str) -> str:
    """The runner's own lines of a log: what precedes ``time -v``'s report (which comes last)."""
    cut = max(log.rfind("Real time (s):"), log.rfind("\tCommand being timed:"))
    return log[:cut] if cut >= 0 else log


# --------------------------------------------------------------------------------------
# The whole run
# --------------------------------------------------------------------------------------


def bench_adb(directories: Sequence[str | Path], opts: BenchOptions, adb_opts: AdbOptions,
              progress: Progress | None = None) -> BenchResult:
    """Measure every ``.pte`` artifact of ``directories`` on the phone (module docstring).

    Raises:
        PitError: no adb, no usable device, a bad runner path, no ``.pte`` artifact or
            tokenizer, a prompt longer than an artifact's context, an adb call that fails, or
            the runner failing on the device (its last lines of output in the message).
    """
    say = progress or (lambda _m: None)
    if opts.torch_model:
        raise PitError("--adb runs .pte artifacts on a phone; a --torch row runs here: use one at a time")
    device_dir = adb_opts.device_dir.rstrip("/") or "/"
    if not device_dir.startswith("/") or device_dir == "/":
        raise PitError(f"--device-dir {adb_opts.device_dir!r} must be an absolute directory on the device "
                       f"below / (default {DEFAULT_DEVICE_DIR})")
    runner = check_runner(adb_opts.runner)
    exe = find_adb()
    artifacts, warnings = plan_phone(directories, opts, say)
    serial = pick_device(list_devices(Adb(exe, timeout_s=adb_opts.timeout_s)), adb_opts.serial)
    adb = Adb(exe, serial, adb_opts.timeout_s)

    device = {"serial": serial}
    for key, prop in (("model", "ro.product.model"), ("abi", "ro.product.cpu.abi")):
        device[key] = adb.shell(f"getprop {prop}").strip()
    say(f"device {serial}: {device['model'] or '?'} ({device['abi'] or '?'})")

    prompts: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    for art in artifacts:
        if any(f"{art.export}:{p}" not in texts for p in opts.prompt_lens):
            tokenizer = load_tokenizer(art)
            for p in opts.prompt_lens:
                key = f"{art.export}:{p}"
                texts[key], prompts[key] = prompt_text(tokenizer, art.vocab, p)

    remote_runner = f"{device_dir}/{RUNNER_NAME}"
    adb.shell(f"mkdir -p {shlex.quote(device_dir)}")
    say(f"pushing {runner} to {remote_runner}")
    adb.push(runner, remote_runner)
    adb.shell(f"chmod +x {shlex.quote(remote_runner)}")
    time_wrapper = parse_peak_rss_kib(adb.shell(f"{DEVICE_TIME} -v true 2>&1", check=False)) is not None
    if not time_wrapper:
        warnings.append(f"the device has no toybox `time -v` at {DEVICE_TIME}: peak_rss_mb is not measured (null in JSON)")

    rows = []
    n_cells = len(artifacts) * len(opts.prompt_lens) * len(opts.threads)
    with tempfile.TemporaryDirectory(prefix="pit-adb-") as local:
        for i, art in enumerate(artifacts):
            folder = f"{device_dir}/artifact-{i}"
            remote_pte, remote_tok = f"{folder}/{art.pte.name}", f"{folder}/{art.tokenizer.name}"
            adb.shell(f"mkdir -p {shlex.quote(folder)}")
            say(f"pushing {art.label} ({art.meta['size_mb']:.1f} MB) and {art.tokenizer.name}")
            adb.push(art.pte, remote_pte)
            adb.push(art.tokenizer, remote_tok)
            remote_data = None
            if art.data is not None:
                remote_data = f"{folder}/{art.data.name}"
                adb.push(art.data, remote_data)
            for p in opts.prompt_lens:
                key = f"{art.export}:{p}"
                for t in opts.threads:
                    meta = {**art.meta, "threads": t, "prompt_len": p, "device": device}
                    say(f"[{len(rows) + 1}/{n_cells}] {art.label} {meta['dtype']} threads={t} pp{p} "
                        f"tg{opts.gen_len} on {device['model'] or serial}")
                    passes, rss = [], []
                    seq_len = p + opts.gen_len
                    for rep in range(opts.reps + 1):  # invocation 0 is the warm-up
                        output = _invoke(adb, local, runner_command(
                            device_dir, remote_runner, remote_pte, remote_tok, texts[key], seq_len, t,
                            f"{device_dir}/run.log", time_wrapper, remote_data), f"{device_dir}/run.log", art.label, t)
                        if rep:
                            passes.append(pass_figures(parse_stats(output)))
                            rss.append(parse_peak_rss_kib(output))
                        else:  # --seq_len counts prompt + generated tokens as the device's tokenizer counts
                            seq_len = parse_stats(output)["prompt_tokens"] + opts.gen_len
                            seq_len = min(seq_len, art.context) if art.context else seq_len
                    row = runner_row(meta, passes, rss)
                    _check_counts(row, p, opts.gen_len, warnings)
                    say(f"    pp{p} {row['prefill_tok_s']:.1f} tok/s, tg{opts.gen_len} {row['decode_tok_s']:.1f} tok/s, "
                        f"RSS {row['peak_rss_mb']:.0f} MB")
                    rows.append(row)
            adb.shell(f"rm -r {shlex.quote(folder)}")  # a phone's storage is small; the runner stays
    machine = {"device": device, "runner": str(runner), "device_dir": device_dir, "prompt_texts": texts,
               "host": {"platform": platform.platform(), "python": platform.python_version()}}
    return BenchResult(rows=rows, prompts=prompts, warnings=warnings, machine=machine)


def _invoke(adb: Adb, local: str, command: str, remote_log: str, label: str, threads: int) -> str:
    """Run one runner invocation, pull its log, and return it; a :class:`PitError` with the
    log's last lines when the runner exits nonzero or prints no stats line."""
    said = adb.shell(command, check=False)
    status = [l.strip()[len(EXIT_MARKER):] for l in said.splitlines() if l.strip().startswith(EXIT_MARKER)]
    if not status:
        raise PitError(f"{label}: the device shell did not run the runner ({_tail(said, 5) or 'no output'}); "
                       "check the connection with `adb devices`")
    target = Path(local) / "run.log"
    target.unlink(missing_ok=True)
    adb.pull(remote_log, target)
    output = target.read_text(encoding="utf-8", errors="replace")
    code = status[-1]
    if code != "0" or parse_stats(output) is None:
        why = f"exit {code}" if code != "0" else "exit 0 but no `PyTorchObserver` stats line"
        raise PitError(f"{label} ({threads} threads): llama_main failed on the device ({why}); its last lines:\n"
                       f"{_tail(runner_output(output)) or '(no output)'}\nCheck that the runner was built for this phone's ABI "
                       "and from the ExecuTorch version that exported the .pte")
    problem = stats_problem(parse_stats(output))
    if problem:  # the device's own output: unusable input, like a runner that fails (exit 2)
        raise PitError(f"{label} ({threads} threads): llama_main printed an impossible stats line ({problem}); "
                       "its figures cannot be used. Check that --runner is ExecuTorch's stock llama_main, "
                       f"unmodified; its last lines:\n{_tail(runner_output(output))}")
    return output


def _check_counts(row: dict[str, Any], prompt_len: int, gen_len: int, warnings: list[str]) -> None:
    """Say when the device's counts differ from what was asked (the rates use its counts)."""
    where = f"{row['artifact']} ({row['threads']} threads, pp{prompt_len})"
    if row["prompt_tokens"] != prompt_len:
        warnings.append(f"{where}: the runner's tokenizer made {row['prompt_tokens']} prompt tokens of the text "
                        f"(asked {prompt_len}); prefill rates are over its count")
    if row["generated_tokens"] < gen_len - 1:
        warnings.append(f"{where}: the runner stopped after {row['generated_tokens']} decode steps (an end-of-sequence "
                        f"token; asked {gen_len - 1}); decode rates are over its count")

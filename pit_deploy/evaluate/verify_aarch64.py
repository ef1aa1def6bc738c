"""``pit-deploy verify --isa aarch64``: the same verification, with the runtimes' aarch64 kernels.

A phone runs onnxruntime's aarch64 build, whose MLAS picks its kernels by the CPU's features
(NEON, dotprod, i8mm, Arm's KleidiAI), and ExecuTorch's XNNPACK, which does the same: other
arithmetic than the x86 kernels ``verify`` runs by default, so an int4 artifact's logits on a
phone need not be the ones checked on x86. Here each artifact runs in an emulated aarch64 Python
(:mod:`pit_deploy.runtime.emulated`) on each CPU profile (and, for onnxruntime, each KleidiAI
setting). By default each artifact runs the compact set of :mod:`.cross_isa` and is judged
against the same artifact on x86 and against the reference; with ``full``, it runs every call
x86 ``verify`` makes and is judged by the very code and bounds of :mod:`.verify`:

1. **record** — the compact set runs on the x86 runtime (:func:`.cross_isa.prepare`), or
   :func:`~.verify.verify_artifact` / :func:`~.verify.verify_quantized_artifact` run on x86 against
   a :class:`RecordingDriver`, which answers zeros and notes every call (prompt prefills, greedy
   steps, held-out blocks, the interface); the PyTorch references are computed here, on x86;
2. **run** — the emulated Python makes the same calls on the artifact
   (:mod:`pit_deploy.runtime.emulated_runner` for the ONNX graphs,
   :mod:`pit_deploy.targets.executorch.emulated_pte_runner` for the ``.pte`` programs: one process per CPU
   profile and runtime, for all its artifacts, as many at once as there are cores) and writes the
   outputs as ``.npz`` files into a temporary folder;
3. **judge** — a :class:`ReplayDriver` serves those outputs to :func:`.cross_isa.judge`, or to the
   same functions again, so the figures, bounds and failures are computed exactly as on x86; each
   row names its ISA, CPU profile and KleidiAI setting (none for a ``.pte``).

Artifacts whose target has no ``aarch64_layout`` (``.gguf``), and ``.pte`` programs on the ARMv8.0
profiles (ExecuTorch's aarch64 wheel needs ARMv8.1+ instructions), are reported "not checked on
aarch64" with the target's ``aarch64_blocker`` — never as passed, and they fail nothing by
themselves (:attr:`~.verify.VerifyReport.passed`); a selection of which nothing can be checked is
refused (exit 2). A runtime that cannot load or run an artifact on aarch64 fails that row (a phone
would fail the same way); an emulated Python that cannot even import its runtime, or that does not
run as aarch64 at all (an emulator that runs it natively), is a broken set-up (exit 2). Target extras that run other x86 programs (the genai generator,
transformers.js, ExecuTorch's stock LLM runner) stay with the x86 rows; the interface graph's
weight-sharing check is a file check and runs in both.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..errors import PitError
from ..exporters.recipes import parse_list
from ..runtime.base import Driver
from ..runtime.emulated import (ARMV8_0_CPUS, KLEIDIAI_SETTINGS, OTHER_CPUS, PROFILES, SETUP_COMMAND, Aarch64Setup,
                                check_emulates, find_setup, kleidiai_applies, run_job)
from ..runtime.emulated_runner import JOB_NAME, RESULTS_NAME
from ..targets import get_target
from ..targets.base import EmulatedEngine

#: intra-op threads of the emulated sessions (the kernels chosen do not depend on it)
THREADS = 1


class RecordingDriver(Driver):
    """Answers every call with zeros of the right shape and records it: the calls verification
    makes depend on the reference and the prompts only, never on what the runtime answers."""

    def __init__(self, vocab: int, dim: int = 0) -> None:
        super().__init__(".")
        self.vocab, self.dim, self.calls = vocab, dim, []

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls.append(["prefill", [int(i) for i in ids.tolist()]])
        return torch.zeros(len(ids), self.vocab)

    def step(self, token: int, pos: int) -> torch.Tensor:
        self.calls.append(["step", int(token), int(pos)])
        return torch.zeros(self.vocab)

    def interface(self, vocab: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append(["interface", int(vocab), int(dim)])
        return torch.zeros(vocab, dim), torch.zeros(dim, vocab)

    def interface_rows(self, ids: list[int], rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The interface graph on the token ids ``ids`` and the head's basis rows ``rows``."""
        self.calls.append(["interface_rows", [int(i) for i in ids], [int(r) for r in rows], self.dim])
        return torch.zeros(len(ids), self.dim), torch.zeros(len(rows), self.vocab)


class ReplayDriver(Driver):
    """Serves the emulated runtime's outputs for the recorded calls, in their order.

    Raises:
        RuntimeError: a call other than the recorded one (an internal error, exit 3).
    """

    def __init__(self, calls: list[list[Any]], outputs: dict[str, np.ndarray]) -> None:
        super().__init__(".")
        self.calls, self.outputs, self.n = calls, outputs, 0

    def _next(self, call: list[Any], prefix: bool = False) -> int:
        """The index of the next recorded call, which must be ``call`` (or start with it)."""
        n, self.n = self.n, self.n + 1
        if n >= len(self.calls) or (self.calls[n][:len(call)] if prefix else self.calls[n]) != call:
            raise RuntimeError(f"aarch64 replay: call {n} is {call[:1]}, the recorded one "
                               f"{self.calls[n][:1] if n < len(self.calls) else 'none'}")
        return n

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.outputs[str(self._next(["prefill", [int(i) for i in ids.tolist()]]))])

    def step(self, token: int, pos: int) -> torch.Tensor:
        return torch.from_numpy(self.outputs[str(self._next(["step", int(token), int(pos)]))])

    def interface(self, vocab: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self._next(["interface", int(vocab), int(dim)])
        return torch.from_numpy(self.outputs[f"{n}.emb"]), torch.from_numpy(self.outputs[f"{n}.head"])

    def interface_rows(self, ids: list[int], rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        n = self._next(["interface_rows", [int(i) for i in ids], [int(r) for r in rows]], prefix=True)
        return torch.from_numpy(self.outputs[f"{n}.emb"]), torch.from_numpy(self.outputs[f"{n}.head"])


def _emulated(art: Any) -> bool:
    return get_target(art.target).aarch64_engine is not None


def _engine(art: Any) -> EmulatedEngine:
    """The emulated runtime build that runs ``art`` (its target's)."""
    engine = get_target(art.target).aarch64_engine
    assert engine is not None, "only artifacts of targets with an aarch64 engine run emulated"
    return engine


def _runs_on(art: Any, cpu: str) -> bool:
    """Whether ``art``'s emulated runtime runs on CPU profile ``cpu`` at all (ARMv8.0 cores)."""
    return cpu not in ARMV8_0_CPUS or _engine(art).armv8_0


def _illegal_instruction(proc: Any) -> bool:
    """Whether the emulated process was stopped by an instruction the emulated CPU lacks."""
    return proc is not None and (proc.returncode in (-4, 132) or "Illegal instruction" in (proc.stderr or ""))


def _last_line(proc: Any) -> str:
    said = (proc.stderr or "").strip().splitlines() if proc is not None else []
    return said[-1][:300] if said else ""


class EmulatedVerify:
    """One ``verify --isa aarch64`` over the selected artifacts; constructing it checks the
    selection and the set-up before any work (both the user's to fix: exit 2)."""

    def __init__(self, directory: Path, selected: Sequence[Any], arm_cpu: Sequence[str] | str | None,
                 kleidiai: Sequence[str] | str | None, row: Callable[..., Any], full: bool = False,
                 jobs: int | None = None) -> None:
        """``row(**fields)`` makes one result row (verify's ``ArtifactResult``, passed in so that
        this module does not import :mod:`.verify`, which imports it); ``full``: the whole
        verification emulated instead of the compact cross-ISA check (:mod:`.cross_isa`);
        ``jobs``: emulated processes at once (default: one per core)."""
        self.directory = Path(directory).resolve()  # the emulated process runs in a folder of its own
        self.row, self.full = row, full
        self.jobs = max(1, jobs or os.cpu_count() or 1)
        self.cpus = parse_list(arm_cpu, PROFILES + OTHER_CPUS, "aarch64 CPU profile") if arm_cpu else list(PROFILES)
        self.kleidiai = parse_list(kleidiai, KLEIDIAI_SETTINGS, "KleidiAI setting") if kleidiai else ["on"]
        self.runnable = [a for a in selected if _emulated(a)]
        self.skipped = [a for a in selected if not _emulated(a)]
        if not self.runnable:
            raise PitError("none of the selected artifacts can run on aarch64 here, so nothing would be checked: "
                           + "; ".join(f"{a.key}: {self.reason(a)}" for a in self.skipped)
                           + " (select onnx, onnx-genai or executorch artifacts)")
        if not any(_runs_on(a, cpu) for a in self.runnable for cpu in self.cpus):
            raise PitError(f"none of the selected artifacts runs on the aarch64 CPU profiles {', '.join(self.cpus)}, "
                           "so nothing would be checked: "
                           + "; ".join(f"{a.key}: {self.reason(a)}" for a in self.runnable)
                           + f" (choose a profile other than {', '.join(ARMV8_0_CPUS)})")
        self.setup: Aarch64Setup = find_setup()
        for engine in dict.fromkeys(_engine(a) for a in self.runnable):
            self.setup.require(engine)
        check_emulates(self.setup)  # an emulator that runs the child natively would check x86 kernels

    @staticmethod
    def reason(art: Any) -> str:
        return get_target(art.target).aarch64_blocker

    def settings(self, art: Any, cpu: str) -> list[str | None]:
        """The KleidiAI settings ``art`` runs under on ``cpu`` (an onnxruntime session setting;
        ``None``: one run): one where KleidiAI has no kernels for it there (both would run the
        same kernels)."""
        if not _engine(art).kleidiai:
            return [None]
        return list(self.kleidiai) if kleidiai_applies(cpu, art.dtype != "float32") else list(self.kleidiai[:1])

    def run(self, check: Callable[..., tuple[Any, Any, bool]], compact: Callable[[Any], Any] | None = None
            ) -> list[Any]:
        """Rows for every runnable artifact × CPU profile × KleidiAI setting (one per profile for a
        ``.pte``), then the not-checked ones. ``check(art, driver)`` is verify's own
        ``(result, bounds, quantized)`` of one artifact (``full``); ``compact(art)`` gives what its
        compact check needs of verify, which :func:`.cross_isa.prepare` runs on x86."""
        from .cross_isa import execute, prepare

        jobs = []
        self.cases: dict[int, Any] = {}
        for n, art in enumerate(self.runnable):
            recorder = RecordingDriver(int(art.shapes["vocab_size"]), int(art.shapes["hidden_size"]))
            if self.full or compact is None:
                check(art, recorder)
            else:
                self.cases[n] = case = prepare(self.directory, **compact(art))
                execute(case.plan, recorder, recorder.interface_rows)
            target = get_target(art.target)
            decoder, interface = target.aarch64_graphs(self.directory / art.path)
            jobs.append({"name": art.key, "decoder": str(decoder), "interface": str(interface),
                         "layout": target.aarch64_layout, "calls": recorder.calls, **target.aarch64_job()})
        rows: dict[tuple[int, str, str | None], Any] = {}
        with tempfile.TemporaryDirectory(prefix="pit-aarch64-") as tmp:
            work = []
            engines = list(dict.fromkeys(_engine(a) for a in self.runnable))
            for cpu in self.cpus:
                for engine in engines:
                    mine = [i for i, a in enumerate(self.runnable) if _engine(a) == engine]
                    for i in [i for i in mine if not _runs_on(self.runnable[i], cpu)]:
                        rows[i, cpu, None] = self._not_checked(self.runnable[i], cpu, self.reason(self.runnable[i]))
                    mine = [i for i in mine if _runs_on(self.runnable[i], cpu)]
                    if mine:
                        work.append((cpu, engine, mine))
            # one emulated process per CPU profile and runtime, as many at once as there are cores
            # (each runs single-threaded), the slow engines' (ExecuTorch's) first; judged in the
            # order they were listed
            work.sort(key=lambda w: not w[1].slow)
            with concurrent.futures.ThreadPoolExecutor(max_workers=min(self.jobs, max(1, len(work)))) as pool:
                futures = [pool.submit(self._run_job, Path(tmp), cpu, engine, mine, jobs, check)
                           for cpu, engine, mine in work]
                for future in futures:
                    rows.update(future.result())
        ordered = []
        for i, art in enumerate(self.runnable):
            for cpu in self.cpus:
                keys = self.settings(art, cpu)
                keys += [None] if None not in keys else []  # a not-checked row of a KleidiAI-run artifact
                ordered += [rows[i, cpu, k] for k in keys if (i, cpu, k) in rows]
        return ordered + [self._row(a, arm_cpu=None, checked=False, notes=[self.reason(a)]) for a in self.skipped]

    def _run_job(self, tmp: Path, cpu: str, engine: EmulatedEngine, indices: list[int], jobs: list[dict[str, Any]],
                 check: Callable[..., tuple[Any, Any, bool]]) -> dict[tuple[int, str, str | None], Any]:
        """One emulated process on ``cpu`` for the artifacts ``indices`` of one runtime; their rows."""
        job_dir = tmp / f"{cpu}-{engine.key}"
        job_dir.mkdir()
        settings = {i: self.settings(self.runnable[i], cpu) for i in indices}
        (job_dir / JOB_NAME).write_text(json.dumps({"threads": THREADS, "artifacts": [
            {**jobs[i], "kleidiai": settings[i]} for i in indices]}))
        proc = run_job(self.setup, cpu, job_dir, engine)
        rows: dict[tuple[int, str, str | None], Any] = {}
        if not (job_dir / RESULTS_NAME).is_file():  # written once the runtime imports
            if _illegal_instruction(proc):  # the wheel cannot run on this CPU profile at all
                for i in indices:
                    rows[i, cpu, None] = self._not_checked(
                        self.runnable[i], cpu, f"{self.reason(self.runnable[i])} ({_last_line(proc)})")
                return rows
            said = _last_line(proc)
            raise PitError(f"the emulated aarch64 Python ({cpu}) could not start {engine.title} (exit status "
                           f"{proc.returncode}{': ' + said if said else ''}); rerun `{SETUP_COMMAND}`")
        finished = self._finished(job_dir, cpu)
        for n, i in enumerate(indices):
            art = self.runnable[i]
            for setting in settings[i]:
                run = finished.get((n, setting))
                if run is None and _illegal_instruction(proc):
                    rows[i, cpu, None] = self._not_checked(art, cpu, f"{self.reason(art)} ({_last_line(proc)})")
                    break
                rows[i, cpu, setting] = self._judge(art, jobs[i]["calls"], job_dir, n, cpu, setting, run, proc,
                                                    check, engine)
        return rows

    def _row(self, art: Any, **kw: Any) -> Any:
        return self.row(runtime=art.target, mode=art.mode, dtype=art.dtype, scheme=art.scheme_name,
                        tying=getattr(art, "tying", "pit"), isa="aarch64", **kw)

    def _not_checked(self, art: Any, cpu: str, reason: str) -> Any:
        """The row of an artifact whose runtime cannot run on CPU profile ``cpu``: never a pass."""
        return self._row(art, arm_cpu=cpu, checked=False, notes=[f"on {cpu}: {reason}"])

    def _finished(self, job_dir: Path, cpu: str) -> dict[tuple[int, str | None], dict[str, Any]]:
        """The runner's ``results.json`` by (artifact, setting); empty if it never started."""
        try:
            data = json.loads((job_dir / RESULTS_NAME).read_text())
        except (OSError, ValueError):
            return {}
        if data.get("machine") != "aarch64":
            raise PitError(f"the emulated runner on {cpu} reports machine {data.get('machine')!r}, not aarch64: the "
                           f"set-up in {self.setup.root} does not emulate; rerun `{SETUP_COMMAND}`")
        return {(int(r["artifact"]), r["kleidiai"]): r for r in data.get("runs", [])}

    def _judge(self, art: Any, calls: list, job_dir: Path, i: int, cpu: str, setting: str | None,
               run: dict | None, proc: Any, check: Callable[..., tuple[Any, Any, bool]], engine: EmulatedEngine) -> Any:
        where = {"arm_cpu": cpu, "kleidiai": setting}
        name = engine.title
        if run is None or run.get("error"):
            if run is None:
                said = _last_line(proc)
                error = f"the emulated runtime exited with status {proc.returncode}" + (f": {said}" if said else "")
            else:
                error = run["error"]
            return self._row(art, **where, failures=[f"{name} on aarch64 ({cpu}) failed: {error}"],
                             emulated_s=None if run is None else run.get("seconds"))
        npz = f"{i}-{setting}.npz" if setting is not None else f"{i}.npz"
        with np.load(job_dir / npz) as data:
            outputs = {key: data[key] for key in data.files}
        replay = ReplayDriver(calls, outputs)
        case = self.cases.get(next(k for k, a in enumerate(self.runnable) if a is art))
        if case is None:
            result, bounds, _ = check(art, replay)
        else:
            from .cross_isa import execute, judge

            result = self._row(art, **where, expected_kl_mean=case.expected.get("kl_mean") if case.expected else None,
                               expected_kl_p99=case.expected.get("kl_p99") if case.expected else None)
            judge(result, case.plan, case.x86, execute(case.plan, replay, replay.interface_rows), case.reference,
                  case.bounds, case.quantized)
            bounds = case.bounds
        result.isa, result.arm_cpu, result.kleidiai, result.emulated_s = "aarch64", cpu, setting, run["seconds"]
        kernels = f"{name}'s aarch64 kernels on qemu's {cpu} CPU" + (f", KleidiAI {setting}" if setting else "")
        if setting is not None and len(self.kleidiai) > 1 and not kleidiai_applies(cpu, art.dtype != "float32"):
            result.notes.append(f"one KleidiAI setting on {cpu}: KleidiAI has no kernels for this artifact there "
                                f"(it needs {'dot products' if art.dtype != 'float32' else 'SME'}), so on and off "
                                "run the same kernels")
        result.notes.append(f"{kernels} ({self.setup.describe(engine)}); emulated wall {run['seconds']:.1f} s, "
                            "not a latency")
        return result.judge(bounds)

"""Launching the runtimes' aarch64 builds (onnxruntime, the ExecuTorch runtime) under user-mode
emulation (qemu), on an x86-64 machine.

Phones run the same runtimes as ``verify`` checks on x86, but other kernels: onnxruntime's MLAS
picks NEON, dotprod, i8mm or Arm's KleidiAI code by what the CPU reports. qemu's user-mode
emulator runs the aarch64 wheels unchanged, and ``-cpu`` sets the features the guest reports, so
one x86 machine can run the kernels of several phone CPUs (:data:`PROFILES`). Emulated code runs
50-100x slower than native code and its speed says nothing about a phone's: only outputs are used.

``scripts/setup_aarch64.sh`` installs the emulator, an arm64 Python and the pinned wheels into
:func:`aarch64_root` and describes them in ``setup.json``; :func:`find_setup` reads it (a missing
set-up is the user's to install: exit 2 naming the script), and :func:`check_emulates` checks that
its emulator really runs the arm64 Python as aarch64 (not natively). :func:`run_job` copies a
runner and :mod:`.standalone` into a job folder and runs the runner there in the emulated Python.
Which runner, and which of the set-up's folders it needs, is the engine's
(:class:`~pit_deploy.targets.base.EmulatedEngine`) that the artifact's target declares: both ONNX
targets run on onnxruntime's wheel (:mod:`.emulated_runner`; the standard library, numpy and
onnxruntime), ExecuTorch's ``.pte`` programs on its own runner and wheels
(:attr:`pit_deploy.targets.executorch.ExecuTorchXnnpackTarget.aarch64_engine`), which need
ARMv8.1+ cores: on the ARMv8.0 profiles (:data:`ARMV8_0_CPUS`) qemu stops it with an illegal
instruction, so its programs are not checked there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from ..errors import PitError
from ..targets.base import ONNXRUNTIME_AARCH64, EmulatedEngine

#: where the set-up lives (default ``~/.cache/pit_deploy/aarch64``)
ROOT_ENV = "PIT_DEPLOY_AARCH64_ROOT"
SETUP_COMMAND = "bash scripts/setup_aarch64.sh"
#: qemu CPU models and the kernels they select in onnxruntime's MLAS: ``cortex-a53`` plain NEON,
#: ``cortex-a76`` dotprod, ``max`` dotprod + i8mm (and so KleidiAI's 4-bit kernels)
PROFILES = ("cortex-a53", "cortex-a76", "max")
#: other qemu aarch64 CPU models accepted by ``--arm-cpu``
OTHER_CPUS = ("cortex-a55", "cortex-a72", "cortex-a710", "neoverse-n1", "neoverse-n2", "neoverse-v1")
#: the profiles above of ARMv8.0 cores (no LSE atomics, no dot products)
ARMV8_0_CPUS = ("cortex-a53", "cortex-a72")
KLEIDIAI_SETTINGS = ("on", "off")
#: what each qemu CPU model reports of the instructions Arm's KleidiAI kernels in onnxruntime's
#: MLAS are written for: dot products (``dotprod``, its integer kernels; ``i8mm`` the faster ones)
#: and the Scalable Matrix Extension (``sme``, its fp32 GEMM)
CPU_FEATURES: dict[str, frozenset[str]] = {
    "cortex-a53": frozenset(), "cortex-a72": frozenset(),
    "cortex-a55": frozenset({"dotprod"}), "cortex-a76": frozenset({"dotprod"}), "neoverse-n1": frozenset({"dotprod"}),
    "cortex-a710": frozenset({"dotprod", "i8mm"}), "neoverse-n2": frozenset({"dotprod", "i8mm"}),
    "neoverse-v1": frozenset({"dotprod", "i8mm"}), "max": frozenset({"dotprod", "i8mm", "sme"}),
}


def kleidiai_applies(cpu: str, quantized: bool) -> bool:
    """Whether KleidiAI has kernels for an artifact on CPU profile ``cpu``: an fp32 graph's GEMMs
    only with SME, a quantized graph's integer matrix products with dot products. Where it has
    none, ``--kleidiai on`` and ``off`` run the same kernels."""
    return ("dotprod" if quantized else "sme") in CPU_FEATURES.get(cpu, frozenset())


_HERE = Path(__file__).resolve().parent
#: copied beside every runner: the ONNX runner's helpers (job format, results) and the decoders
RUNNER_FILES = (_HERE / "emulated_runner.py", _HERE / "standalone.py")


def runner_file(engine: EmulatedEngine) -> Path:
    """The file of ``engine``'s runner module (found without importing it: it runs only emulated)."""
    spec = importlib.util.find_spec(engine.runner)
    if spec is None or spec.origin is None:
        raise PitError(f"the emulated runner {engine.runner} of {engine.title} is not installed with this package; "
                       "reinstall pit_deploy")
    return Path(spec.origin)


def aarch64_root() -> Path:
    """The set-up folder: ``$PIT_DEPLOY_AARCH64_ROOT``, else ``~/.cache/pit_deploy/aarch64``."""
    value = os.environ.get(ROOT_ENV)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "pit_deploy" / "aarch64"


class _Versions(dict):
    """``setup.json``'s record, ``?`` for a version it does not hold."""

    def __missing__(self, key: str) -> str:
        return "?"


@dataclass(frozen=True)
class Aarch64Setup:
    """The emulator, the arm64 Python's root and the wheels' folder, with the pinned versions."""

    root: Path
    qemu: Path
    sysroot: Path
    python: Path
    site: Path
    versions: dict

    def folder(self, key: str) -> Path | None:
        """The set-up's folder ``setup.json`` records under ``key`` (``None``: it records none)."""
        value = self.versions.get(key)
        return self.root / value if isinstance(value, str) and value else None

    def describe(self, engine: EmulatedEngine = ONNXRUNTIME_AARCH64) -> str:
        """The emulator's and ``engine``'s versions, for a result's notes (``?`` where the set-up
        records none)."""
        return engine.describe.format_map(_Versions(self.versions))

    def require(self, engine: EmulatedEngine) -> None:
        """Check that the set-up holds what ``engine`` needs beyond the shared wheels.

        Raises:
            PitError: a set-up installed before the script installed it (exit 2).
        """
        for key in (k for k in (engine.site, engine.library_path) if k):
            folder = self.folder(key)
            if folder is None or not folder.is_dir():
                raise PitError(f"the aarch64 emulation set-up in {self.root} lacks {engine.title} (its {key!r} folder), "
                               f"which the selected artifacts need; rerun `{SETUP_COMMAND}`")


def find_setup() -> Aarch64Setup:
    """The set-up :data:`SETUP_COMMAND` installed.

    Raises:
        PitError: no set-up, or an incomplete one (exit 2, naming the command that installs it).
    """
    root = aarch64_root()
    spec = root / "setup.json"
    fix = f"run `{SETUP_COMMAND}` (or point {ROOT_ENV} at a folder it installed)"
    try:
        data = json.loads(spec.read_text())
        setup = Aarch64Setup(root=root, qemu=root / data["qemu"], sysroot=root / data["sysroot"],
                             python=root / data["python"], site=root / data["site"], versions=data)
    except (OSError, ValueError, KeyError, TypeError):
        raise PitError(f"verifying on aarch64 needs the emulation set-up, and {root} holds none; {fix}") from None
    missing = [p for p in (setup.qemu, setup.python, setup.site) if not p.exists()]
    if missing:
        raise PitError(f"the aarch64 emulation set-up in {root} is incomplete ({missing[0]} is missing); {fix}")
    return setup


def check_cpu(name: str) -> str:
    """A qemu CPU model ``--arm-cpu`` accepts."""
    if name not in PROFILES + OTHER_CPUS:
        raise PitError(f"unknown aarch64 CPU profile {name!r}; choose from {', '.join(PROFILES + OTHER_CPUS)}")
    return name


def _environment(setup: Aarch64Setup, engine: EmulatedEngine = ONNXRUNTIME_AARCH64) -> dict[str, str]:
    """The environment of the emulated Python: its own home, the set-up's wheels only (``engine``'s
    own ahead of the shared ones), and ``engine``'s library folder."""
    sites = [setup.folder(engine.site) if engine.site else None, setup.site]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/"),
        "LANG": "C.UTF-8",
        "PYTHONHOME": str(setup.sysroot / "usr"),
        "PYTHONPATH": os.pathsep.join(str(s) for s in sites if s is not None),
        "PYTHONNOUSERSITE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",  # the set-up byte-compiled everything; the cache stays as installed
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
    }
    library = setup.folder(engine.library_path) if engine.library_path else None
    if library is not None:
        env["LD_LIBRARY_PATH"] = str(library)
    return env


def _command(setup: Aarch64Setup, cpu: str, *args: str) -> list[str]:
    return [str(setup.qemu), "-L", str(setup.sysroot), "-cpu", cpu, str(setup.python), *args]


#: what the emulated Python prints to say which machine it runs on
_MACHINE_PROBE = "import platform; print(platform.machine())"
#: set-ups already seen to emulate, by (emulator, Python): the probe runs once per process
_EMULATING: set[tuple[str, str]] = set()


def check_emulates(setup: Aarch64Setup, timeout: float = 300) -> None:
    """Check that the set-up's emulator runs its Python as aarch64: the child reports
    ``platform.machine()``. An emulator that runs its argument natively (a ``qemu-aarch64`` that
    is a wrapper script, a binfmt entry that runs a host Python) would check x86 kernels under
    the aarch64 name; one whose Python does not start checks nothing. About a second under qemu,
    once per process.

    Raises:
        PitError: the child is not aarch64, or does not start (exit 2, naming the set-up script).
    """
    key = (str(setup.qemu), str(setup.python))
    if key in _EMULATING:
        return
    fix = f"rerun `{SETUP_COMMAND}` (or point {ROOT_ENV} at a folder it installed)"
    try:
        proc = subprocess.run(_command(setup, "max", "-S", "-c", _MACHINE_PROBE), env=_environment(setup),
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except OSError as exc:
        raise PitError(f"cannot start the aarch64 emulator {setup.qemu}: {exc.strerror or exc}; {fix}") from None
    except subprocess.TimeoutExpired:
        raise PitError(f"the emulated aarch64 Python of {setup.root} did not answer within {timeout:.0f} s; {fix}") from None
    said = (proc.stderr or "").strip().splitlines()
    if proc.returncode != 0:
        last = f": {said[-1][:300]}" if said else ""
        raise PitError(f"the emulated aarch64 Python of {setup.root} does not start ({setup.qemu} exited with status "
                       f"{proc.returncode}{last}); {fix}")
    machine = (proc.stdout or "").strip().splitlines()[-1:] or [""]
    if machine[0] != "aarch64":
        raise PitError(f"the aarch64 emulation set-up in {setup.root} does not emulate: its Python reports machine "
                       f"{machine[0]!r}, not 'aarch64' ({setup.qemu} ran it natively, so the kernels checked would be "
                       f"the host's); {fix}")
    _EMULATING.add(key)


def run_job(setup: Aarch64Setup, cpu: str, job_dir: Path, engine: EmulatedEngine = ONNXRUNTIME_AARCH64,
            timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run ``engine``'s runner on ``job_dir`` (which holds its ``job.json``) in the emulated Python
    on qemu CPU model ``cpu``; its stdout and stderr are captured, its exit status returned for the
    caller to judge (what it finished is in ``job_dir/results.json``)."""
    setup.require(engine)
    runner = runner_file(engine)
    for src in {runner, *RUNNER_FILES}:
        shutil.copy2(src, job_dir / src.name)
    cmd = _command(setup, cpu, str(job_dir / runner.name), str(job_dir))
    try:
        return subprocess.run(cmd, env=_environment(setup, engine), cwd=job_dir, capture_output=True, text=True,
                              timeout=timeout)
    except OSError as exc:
        raise PitError(f"cannot start the aarch64 emulator {setup.qemu}: {exc}; "
                       f"{SETUP_COMMAND} reinstalls it") from None

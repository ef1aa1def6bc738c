"""Shared fixtures: tiny random models of every family, built in code (no network)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _share_the_cores() -> None:
    """Under pytest-xdist, give each worker its share of the cores for torch's thread pool, and
    the processes it starts the same (``OMP_NUM_THREADS``, unless set already).

    Why: each worker's torch sized its pool to every core, so two workers ran four busy threads on
    two cores, and OpenMP threads spin while they wait for each other: three heavy test files took
    276 s on two workers that way and 173 s with one thread each (the same 66 tests passing). What
    a test asks of a runtime's threads (``--threads``) is unchanged."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or "PYTEST_XDIST_WORKER" not in os.environ:
        return
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_share_the_cores()

from pit_deploy.tiny import FAMILIES, tiny_model  # noqa: E402


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Keep what shares an expensive fixture on one pytest-xdist worker.

    ``scripts/test.sh`` runs two workers with ``--dist loadgroup``: every test file is one group
    (its module fixtures, an export or a pipeline run, are built once), and the whole runtime
    suite is one group (its session fixture exports every tiny family and the default model
    once for both of its files). Without xdist the marker does nothing. ``tryfirst``: xdist's
    worker reads the markers in this same hook to name each test's group, so they must be on the
    items before its implementation runs (pluggy calls the later-registered plugin first).
    """
    rank = {group: i for i, group in enumerate(SLOWEST_GROUPS_FIRST)}
    order: dict[str, int] = {}
    for item in items:
        path = Path(str(item.fspath))
        group = _group(path)
        order[item.nodeid] = rank.get(group, len(rank))
        item.add_marker(pytest.mark.xdist_group(group))
        if _full_tier_only(item, path):
            item.add_marker(pytest.mark.full)
    # the slowest groups first, the rest in collection order after them (a stable sort: a group's
    # own tests keep their order, so its module fixtures are built once)
    items.sort(key=lambda item: order[item.nodeid])


#: the test groups that take longest in the default tier, longest first: the time each took summed
#: over its tests (``bash scripts/test.sh --durations=0``), nearly all of it ``.pte`` lowerings and
#: pipeline runs. ``scripts/test.sh`` hands groups to the two workers in collection order
#: (``--no-loadscope-reorder``: pytest-xdist's own reordering puts the groups with the most tests
#: first, which left these few-test groups to the end, one worker running them while the other had
#: nothing left); started first, the shorter groups fill in behind them and both workers end
#: together.
SLOWEST_GROUPS_FIRST: tuple[str, ...] = (
    "runtime_tests", "test_weight_check", "test_own_model", "test_run", "test_quantize", "test_pte_shared_table",
    "test_benchmarks_smoke", "test_genai_target", "test_gemma_families", "test_quantized_scaling",
    "test_deployed_families", "test_web_clients", "test_fold_onnx", "test_train_ddp", "test_calibrated_rounding",
    "test_train", "test_gguf_target", "test_reliability", "test_typing", "test_residual_rotation", "test_cross_isa",
)


def _group(path: Path) -> str:
    """A test's worker group: its file, or the runtime suite as a whole."""
    return "runtime_tests" if "runtime_tests" in path.parts else path.stem


#: test files that run only in the full tier: notebooks (minutes of kernels each) and the aarch64
#: emulation's runs (50-100x slower than native); their argument and set-up checks stay default
FULL_TIER_FILES = {"test_notebooks"}
#: fixtures whose presence puts a test in the full tier: emulated runs and the tiny .pte export
#: that only the emulated tests read
FULL_TIER_FIXTURES = {"arm_setup", "pte_export"}


def _full_tier_only(item, path: Path) -> bool:
    """Whether ``item`` runs only under ``bash scripts/test.sh --full``.

    The default tier keeps every target x family x mode on tiny models; the full tier adds what
    costs minutes per test and guards the same code paths at a larger scale: the bundled default
    model (``real_model``), the notebooks and the emulated aarch64 runs. A test can also carry
    ``@pytest.mark.full`` itself (the README block on the families beyond the first).
    """
    if item.get_closest_marker("real_model") is not None:
        return True
    if path.stem in FULL_TIER_FILES:
        return True
    return bool(FULL_TIER_FIXTURES & set(getattr(item, "fixturenames", ())))


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def tiny(family):
    """A fresh tiny tied model of each family."""
    return tiny_model(family)


def _install_arm_setup() -> None:
    """Run ``scripts/setup_aarch64.sh`` (a no-op once installed); skip only where the script
    itself says the platform cannot run the emulation."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "setup_aarch64.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    if proc.returncode != 0:
        said = proc.stderr.strip()
        if "unsupported platform" in said:
            pytest.skip(f"scripts/setup_aarch64.sh reports that this platform cannot run the emulation: {said}")
        pytest.fail(f"scripts/setup_aarch64.sh failed: {said}")


@pytest.fixture(scope="module")
def arm_setup() -> None:
    """The aarch64 emulation set-up for ``verify --isa aarch64`` (full tier: the emulated runs
    of the whole verification)."""
    _install_arm_setup()


@pytest.fixture(scope="module")
def arm_compact() -> None:
    """The same set-up for the default tier's compact cross-ISA checks on a tiny model (seconds
    under emulation)."""
    _install_arm_setup()

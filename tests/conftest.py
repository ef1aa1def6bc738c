"""Shared fixtures: tiny random models of every family, built in code (no network)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

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
    for item in items:
        path = Path(str(item.fspath))
        group = "runtime_tests" if "runtime_tests" in path.parts else path.stem
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def tiny(family):
    """A fresh tiny tied model of each family."""
    return tiny_model(family)


@pytest.fixture(scope="module")
def arm_setup() -> None:
    """The aarch64 emulation set-up for ``verify --isa aarch64``, installed by its script (a no-op
    once installed). Skipped only where the script itself says the platform cannot run it."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "setup_aarch64.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    if proc.returncode != 0:
        said = proc.stderr.strip()
        if "unsupported platform" in said:
            pytest.skip(f"scripts/setup_aarch64.sh reports that this platform cannot run the emulation: {said}")
        pytest.fail(f"scripts/setup_aarch64.sh failed: {said}")

"""Shared fixtures: tiny random models of every family, built in code (no network)."""

from __future__ import annotations

import os
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

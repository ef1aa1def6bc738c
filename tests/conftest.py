"""Shared fixtures: tiny random models of every family, built in code (no network)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from pit_deploy.tiny import FAMILIES, tiny_model  # noqa: E402


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def tiny(family):
    """A fresh tiny tied model of each family."""
    return tiny_model(family)

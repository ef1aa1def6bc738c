"""Giving the heap's free pages back between the stages of a check (:mod:`pit_deploy.evaluate.heap`)."""

from __future__ import annotations

import platform

import pytest

from pit_deploy.evaluate import heap


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_glibc_is_asked_to_trim_its_heap():
    assert heap._libc_trim() is not None and heap.give_back_freed_memory() is True


def test_without_malloc_trim_nothing_is_asked(monkeypatch):
    monkeypatch.setattr(heap, "_libc_trim", lambda: None)
    assert heap.give_back_freed_memory() is False

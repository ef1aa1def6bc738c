"""Giving the heap's free pages back between the stages of a check (:mod:`pit_deploy.io.heap`)."""

from __future__ import annotations

import platform

import pytest

from pit_deploy.io import heap


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_glibc_is_asked_to_trim_its_heap():
    assert heap._libc_trim() is not None and heap.give_back_freed_memory() is True


def test_without_malloc_trim_nothing_is_asked(monkeypatch):
    monkeypatch.setattr(heap, "_libc_trim", lambda: None)
    assert heap.give_back_freed_memory() is False


def test_an_export_gives_the_heap_back_after_each_artifact(tmp_path, monkeypatch):
    """The heap's free pages are handed back once each artifact is written, before the next one is
    made (an export's peak is one artifact's work on top of the models, not the leftovers of the
    artifacts before it)."""
    from pit_deploy.cli import main
    from pit_deploy.exporters import pipeline
    from pit_deploy.io.checkpoint import save_model
    from pit_deploy.tiny import tiny_pit_model, tiny_tokenizer

    save_model(tiny_pit_model("llama"), tmp_path / "src", tiny_tokenizer())
    target = pipeline.get_target("onnx")
    export, written, at_trim = target.export, [], []

    def recorded(source, out_dir, **kwargs):
        details = export(source, out_dir, **kwargs)
        written.append(out_dir.name)
        return details

    monkeypatch.setattr(target, "export", recorded)
    monkeypatch.setattr(pipeline, "give_back_freed_memory", lambda: at_trim.append(list(written)))
    assert main(["export", str(tmp_path / "src"), "--out", str(tmp_path / "x"), "--runtime", "onnx",
                 "--mode", "factorized", "--dtype", "float32,int8"]) == 0
    assert at_trim == [written[:1], written] and len(written) == 2

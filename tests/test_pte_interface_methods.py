"""The `.pte`'s ``embed``/``head`` interface methods take bounded chunks, so the runtime does not
allocate a ``V×d`` plan for them when it loads the program, and verification still measures the
whole interface through them (chunk limits made small here so that a tiny model needs several)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pit_deploy.cli import main
from pit_deploy.io.checkpoint import save_model
from pit_deploy.tiny import tiny_pit_model, tiny_tokenizer

IDS, ROWS = 96, 16  # tiny llama: V = 512, d = 64 -> 6 and 4 chunks


@pytest.fixture(scope="module")
def chunked_export(tmp_path_factory) -> Path:
    import pit_deploy.targets.executorch.export as exporter
    import pit_deploy.targets.executorch.driver as driver

    root = tmp_path_factory.mktemp("pte-chunks")
    save_model(tiny_pit_model("llama"), root / "pit", tiny_tokenizer())
    patch = pytest.MonkeyPatch()
    for module in (exporter, driver):
        patch.setattr(module, "INTERFACE_IDS", IDS)
        patch.setattr(module, "INTERFACE_HIDDEN_ROWS", ROWS)
    try:
        assert main(["export", str(root / "pit"), "--out", str(root / "exp"), "--runtime", "executorch",
                     "--mode", "factorized", "--max-seq-len", "64"]) == 0
        yield root / "exp"
    finally:
        patch.undo()


def test_interface_methods_plan_only_one_chunk(chunked_export):
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary((chunked_export / "executorch-factorized" / "model.pte").read_bytes()).program
    plans = {plan.name: sum(plan.non_const_buffer_sizes) for plan in program.execution_plan}
    d, v = 64, 512
    assert 0 < plans["embed"] <= 3 * IDS * d * 4 < v * d * 4
    assert 0 < plans["head"] <= 3 * ROWS * v * 4 < d * v * 4


def test_the_interface_is_measured_whole_through_the_chunks(chunked_export, capsys, monkeypatch):
    import pit_deploy.targets.executorch.driver as driver

    monkeypatch.setattr(driver, "INTERFACE_IDS", IDS)
    monkeypatch.setattr(driver, "INTERFACE_HIDDEN_ROWS", ROWS)
    from pit_deploy.model.quantized_interface import identity_defect
    from pit_deploy.targets.executorch.driver import ExecuTorchDriver

    emb, head = ExecuTorchDriver(chunked_export / "executorch-factorized").interface(512, 64)
    assert tuple(emb.shape) == (512, 64) and tuple(head.shape) == (64, 512)
    # what verify measures: W_out E summed over the embedding's parts, the whole tables' figure
    monkeypatch.setattr("pit_deploy.model.core.POLAR_CHUNK_ROWS", 96)
    defect = ExecuTorchDriver(chunked_export / "executorch-factorized").interface_defect(512, 64)
    assert defect == identity_defect(emb, head) and 0 < defect < 1e-4
    assert main(["verify", str(chunked_export), "--no-record"]) == 0
    assert "pass" in capsys.readouterr().out

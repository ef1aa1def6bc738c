"""One 4-bit token table for a factorized ``.pte`` (the ``int4-shared`` scheme): the quantized head
behind the grid-exact ``S`` keeps ``W_out E = I`` on the runtime, the gather reads the head's own
codes, the table is stored once (in ``model.ptd``), and corrupting it fails verification."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from pit_deploy.cli import main
from pit_deploy.errors import PitError
from pit_deploy.evaluate.verify import verify_directory
from pit_deploy.targets.executorch.head import _quantized, int8_grid_rows
from pit_deploy.io.manifest import MANIFEST_NAME
from pit_deploy.targets.executorch import PTD_NAME, PTE_NAME
from pit_models import dense_t_pit_dir
from scramble import rehash

ART = "executorch-factorized-int4-shared"


def test_int8_grid_rows_span_255_steps_with_zero_on_the_grid():
    """Each row becomes ``c · k`` with integer ``k`` spanning exactly 255 steps from ``min(k, 0)`` to
    ``max(k, 0)``, every entry moved by at most half a step."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(50, 64, generator=gen, dtype=torch.float64)
    a[3] = a[3].abs() + 0.1  # all positive: the range starts at 0
    a[4] = -a[4].abs()  # all negative: the range ends at 0
    a[5] = 0.0
    s = int8_grid_rows(a)
    for row, snapped in zip(a, s):
        lo, hi = min(float(row.min()), 0.0), max(float(row.max()), 0.0)
        if hi == lo:
            assert torch.equal(snapped, torch.zeros_like(snapped))
            continue
        top, bottom = max(float(snapped.max()), 0.0), min(float(snapped.min()), 0.0)
        step = (top - bottom) / 255
        k = snapped / step
        assert float((k - k.round()).abs().max()) < 1e-9
        assert round((top - bottom) / step) == 255 and abs(bottom / step - round(bottom / step)) < 1e-9
        assert float((snapped - row).abs().max()) <= 0.5 * step * (1 + 1e-9)


def test_grid_rows_pass_xnnpack_dynamic_quantization_unchanged():
    """Through a lowered 8da4w linear, rows on the grid come out as the exact product with the
    dequantized weights; the same rows off the grid are rounded (what made ``delta_ti`` 0.28)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    torch.manual_seed(0)
    d, v = 64, 96
    raw = torch.randn(d, d, dtype=torch.float64) @ torch.diag(torch.logspace(-2, 0, d, dtype=torch.float64))
    linear = _quantized(nn.Linear(d, v, bias=False), 4, 32)
    weight = linear.weight
    dequantized = (weight.qdata.to(torch.float64).view(v, -1, 32)
                   * weight.scale.to(torch.bfloat16).to(torch.float64)[..., None]).view(v, d)
    errors = {}
    for name, rows in (("raw", raw), ("grid", int8_grid_rows(raw))):
        x = rows.to(torch.float32)
        program = to_edge_transform_and_lower(
            torch.export.export(nn.Sequential(linear).eval(), (x,)), partitioner=[XnnpackPartitioner()],
            compile_config=EdgeCompileConfig(_check_ir_validity=False)).to_executorch()
        got = _load_for_executorch_from_buffer(program.buffer).forward((x,))[0].to(torch.float64)
        exact = x.to(torch.float64) @ dequantized.T
        errors[name] = float((got - exact).norm() / exact.norm())
    assert errors["grid"] < 1e-6 < 1e-3 < errors["raw"], errors


@pytest.fixture(scope="module")
def shared_export(tmp_path_factory) -> Path:
    """``int4-shared`` in ``exp/``, and beside it in ``unshared/`` the same program with the table
    twice (``--no-pte-shared-table``: the gather's own 4-bit table, the same 4-bit head). Rounded
    to nearest (``--rounding rtn``), so that :func:`_table_bytes` can rebuild the table's bytes from
    the checkpoint alone; the calibrated table is tested in ``tests/test_calibrated_rounding.py``."""
    root = tmp_path_factory.mktemp("shared")
    src = dense_t_pit_dir("llama", root)
    common = ["--runtime", "executorch", "--mode", "factorized", "--max-seq-len", "64", "--rounding", "rtn"]
    assert main(["export", str(src), "--out", str(root / "exp"), "--dtype", "int4-shared", *common]) == 0
    assert main(["export", str(src), "--out", str(root / "unshared"), "--dtype", "int4-shared", "--table-bits", "4",
                 "--pte-head-bits", "4", "--no-pte-shared-table", *common]) == 0
    return root / "exp"


def _table_bytes(directory: Path, bits: int = 4) -> bytes:
    """The shared table's packed codes, rebuilt from the reference checkpoint as the exporter builds
    them (the same deterministic quantization)."""
    from pit_deploy.exporters.passes import prepare
    from pit_deploy.targets.executorch.token_table import quantize_token_table
    from pit_deploy.targets.executorch.export import quantize_linears
    from pit_deploy.io.checkpoint import load_pit_model

    model, _ = quantize_linears(prepare(load_pit_model(directory / "reference"), "factorized"), "int4", 32,
                                ("v_proj", "down_proj"))
    quantize_token_table(model, 32, True, table_bits=bits, head_bits=bits, shared=True)
    return model.get_input_embeddings().packed.numpy().tobytes()


def test_shared_table_is_stored_once_and_keeps_the_interface_exact(shared_export):
    """The packed table occurs once in ``model.ptd`` and nowhere in ``model.pte``; the pair is
    smaller than the unshared program with the same 4-bit head and table (which stores it twice) by
    about one table; verify passes with ``delta_ti ≤ 1e-4`` measured on the runtime."""
    folder, plain = shared_export / ART, shared_export.parent / "unshared" / ART
    table = _table_bytes(shared_export)
    ptd, pte = (folder / PTD_NAME).read_bytes(), (folder / PTE_NAME).read_bytes()
    assert len(table) > 1000 and ptd.count(table) == 1 and pte.count(table) == 0
    unshared = (plain / PTE_NAME).stat().st_size
    assert not (plain / PTD_NAME).exists()
    saved = unshared - (len(ptd) + len(pte))
    assert 0.8 * len(table) < saved, (unshared, len(ptd), len(pte), len(table))
    for directory, shared in ((shared_export, True), (shared_export.parent / "unshared", False)):
        report = verify_directory(directory, record=False)
        assert report.passed, str(report)
        result = report.result("executorch", "factorized", "int4-shared")
        assert result.interface_exact is True and result.delta_ti <= 1e-4, (directory.name, result.delta_ti)
        (art,) = json.loads((directory / MANIFEST_NAME).read_text())["artifacts"]
        assert art["details"]["quantization"]["shared_table"] is shared


def test_int4_shares_an_8bit_table(tmp_path):
    """The ``int4`` scheme's ``.pte``: per-channel int8 codes of the head, which XNNPACK stores as
    they are and ``embedding_byte`` reads with one scale a row — one blob again, exact interface
    (rounded to nearest, as the fixture above, for :func:`_table_bytes`)."""
    out = tmp_path / "exp"
    assert main(["export", str(dense_t_pit_dir("qwen3", tmp_path)), "--out", str(out), "--runtime", "executorch",
                 "--mode", "factorized", "--dtype", "int4", "--max-seq-len", "64", "--rounding", "rtn"]) == 0
    art = "executorch-factorized-int4"
    table = _table_bytes(out, bits=8)
    ptd, pte = (out / art / PTD_NAME).read_bytes(), (out / art / PTE_NAME).read_bytes()
    assert ptd.count(table) == 1 and pte.count(table) == 0
    report = verify_directory(out, record=False)
    assert report.passed, str(report)
    result = report.result("executorch", "factorized", "int4")
    assert result.interface_exact is True and result.delta_ti <= 1e-4, result.delta_ti


def test_corrupting_the_shared_table_fails_verify(shared_export, tmp_path):
    """Random codes in a quarter of the table's rows (digests re-recorded, so only the numbers can
    tell): the head and the gather both read them, the correction no longer matches, and verify
    exits 1."""
    import shutil

    copy = tmp_path / "exp"
    shutil.copytree(shared_export, copy)
    table = _table_bytes(copy)
    data = copy / ART / PTD_NAME
    raw = bytearray(data.read_bytes())
    start = raw.find(table)
    assert start >= 0
    gen = torch.Generator().manual_seed(0)
    quarter = len(table) // 4
    raw[start:start + quarter] = torch.randint(0, 256, (quarter,), generator=gen, dtype=torch.uint8).numpy().tobytes()
    data.write_bytes(bytes(raw))
    rehash(copy)
    assert main(["verify", str(copy)]) == 1
    result = verify_directory(copy, record=False).result("executorch", "factorized", "int4-shared")
    assert result.delta_ti > 1e-3, result.delta_ti


def test_shared_table_needs_equal_head_and_table_bits():
    from pit_deploy.schemes import get_scheme

    with pytest.raises(PitError, match="shared token table needs pte_head_bits equal to table_bits"):
        get_scheme("int4-shared").with_settings(pte_head_bits=8)
    assert get_scheme("int4").pte_quantized_head_bits == 8 and get_scheme("int4-shared").pte_quantized_head_bits == 4
    assert get_scheme("int4").with_settings(pte_shared_table=False).pte_quantized_head_bits == 0
    assert get_scheme("int8").pte_quantized_head_bits == 0

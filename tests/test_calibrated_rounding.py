"""Calibrated (GPTQ) rounding: it beats plain rounding where the inputs have outliers, its codes sit
on each runtime's grid, and the exporters write exactly those codes (``--rounding gptq``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pit_deploy.cli import main
from pit_deploy.errors import PitError
from pit_deploy.exporters.calibrated_rounding import RoundingGrid, calibrate, gptq, round_to_nearest
from pit_deploy.exporters.onnx_tables import block_table_from_codes
from pit_deploy.io.manifest import MANIFEST_NAME
from pit_deploy.schemes import get_scheme
from pit_models import dense_t_pit_dir

GRIDS = [RoundingGrid(4, 32, True), RoundingGrid(4, 32, False), RoundingGrid(8, None, True), RoundingGrid(8, 32, False)]


def _outlier_inputs(n: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Correlated inputs (one fixed mixing, ``seed`` draws the samples) with a few channels 20×
    larger than the rest (the activation outliers of real language models that make plain 4-bit
    rounding costly)."""
    mixing = torch.eye(cols, dtype=torch.float64) + \
        0.3 * torch.randn(cols, cols, generator=torch.Generator().manual_seed(100), dtype=torch.float64)
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) @ mixing
    x[:, :4] *= 20.0
    return x


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g.bits}bit-{g.group}-{'sym' if g.symmetric else 'asym'}")
def test_gptq_beats_round_to_nearest_on_outlier_inputs(grid):
    """The error of the layer's *outputs* on held-out inputs: GPTQ's, in order or by act-order,
    at most 70 % of plain rounding's with the same grid and scale search; the codes on the grid, the scales
    bfloat16-exact on a symmetric grid."""
    cols, rows = 128, 48
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 0.05
    calib, held = _outlier_inputs(2048, cols, 0), _outlier_inputs(1024, cols, 2)
    h = calib.T @ calib
    errors = {}
    for name, rounded in (("rtn", round_to_nearest(weight, grid)), ("gptq", gptq(weight, h, grid)),
                          ("gptq-act-order", gptq(weight, h, grid, act_order=True))):
        assert int(rounded.codes.min()) >= grid.qmin and int(rounded.codes.max()) <= grid.qmax
        if grid.symmetric:
            assert torch.equal(rounded.zeros, torch.zeros_like(rounded.zeros))
            assert torch.equal(rounded.scales, rounded.scales.to(torch.bfloat16).to(torch.float32))
        errors[name] = float((held @ (weight - rounded.dequantize().double()).T).norm())
    assert errors["gptq"] < 0.7 * errors["rtn"], errors
    assert errors["gptq-act-order"] < 0.7 * errors["rtn"], errors


@pytest.mark.parametrize("grid", [RoundingGrid(4, 32, False), RoundingGrid(4, 32, True), RoundingGrid(8, 32, False)],
                         ids=["4bit-asym", "4bit-sym", "8bit-asym"])
def test_matmulnbits_layout_holds_the_codes(grid):
    """The ONNX block table of a rounded weight dequantizes (as ``MatMulNBits`` computes it) to
    exactly the weight the calibrated model holds; three groups a row (an odd count: the 4-bit
    zero points are padded)."""
    weight = torch.randn(10, 96, generator=torch.Generator().manual_seed(3))
    rounded = round_to_nearest(weight, grid)
    table = block_table_from_codes(rounded)
    assert np.array_equal(table.dequantize(), rounded.dequantize().numpy())


def test_calibrate_rounds_every_body_linear_layer_by_layer():
    """``calibrate`` rounds the linears it is given a grid for, in place, and leaves the others."""
    from pit_deploy.tiny import tiny_model

    model = tiny_model("llama").eval()
    before = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    grid = RoundingGrid(4, 32, True)
    ids = [torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(k)) for k in range(4)]
    codes = calibrate(model, ids, lambda name: None if "lm_head" in name or "o_proj" in name else grid)
    body = {n for n in before if "lm_head" not in n and "o_proj" not in n}
    assert set(codes) == body
    for name, module in model.named_modules():
        if name in before:
            changed = not torch.equal(module.weight, before[name])
            assert changed == (name in body), name
            if name in body:
                assert torch.equal(module.weight, codes[name].dequantize())


def test_8bit_layers_name_every_layer_or_one():
    """``int4_8bit_layers`` takes a linear's last name (every layer's) or a dotted suffix of its
    module path (one layer's): the GPTQ grids, torchao's ``.pte`` linears and onnxruntime's
    ``MatMul`` nodes pick the same linears, and ``layers.1`` is not ``layers.11``."""
    import onnx

    from pit_deploy.exporters.calibrated_rounding import scheme_grids
    from pit_deploy.exporters.onnx_graph import layer_matmuls
    from pit_deploy.targets.executorch.export import quantize_linears
    from pit_deploy.targets import get_target
    from pit_deploy.tiny import tiny_model

    model = tiny_model("llama").eval()
    scheme = get_scheme("int4").with_settings(int4_8bit_layers=("v_proj", "layers.1.mlp.down_proj"))
    assert scheme.keeps_8bit("model.layers.1.mlp.down_proj") and not scheme.keeps_8bit("model.layers.11.mlp.down_proj")
    grid_of = scheme_grids(model, scheme, get_target("executorch").weight_grid(scheme, "materialized"))
    eight = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and (grid_of(n) or GRIDS[0]).bits == 8}
    expected = {f"model.layers.{i}.self_attn.v_proj" for i in range(model.config.num_hidden_layers)}
    assert eight == expected | {"model.layers.1.mlp.down_proj"}
    _, details = quantize_linears(model, "int4", 32, scheme.int4_8bit_layers)
    assert f"({len(eight)} layers)" in details["linear_8bit"]
    nodes = [onnx.helper.make_node("MatMul", ["x", "w"], ["y"], name=f"/model/{n.replace('model.', '', 1).replace('.', '/')}/MatMul")
             for n in ("model.layers.1.mlp.down_proj", "model.layers.11.mlp.down_proj", "model.layers.0.self_attn.v_proj",
                       "model.layers.0.self_attn.q_proj")]
    graph = onnx.helper.make_graph(nodes, "g", [], [])
    assert layer_matmuls(graph, scheme.int4_8bit_layers) == [nodes[0].name, nodes[2].name]


@pytest.fixture(scope="module")
def gptq_export(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gptq")
    out = root / "exp"
    assert main(["export", str(dense_t_pit_dir("llama", root)), "--out", str(out), "--runtime", "onnx,executorch",
                 "--mode", "factorized", "--dtype", "int4", "--max-seq-len", "64", "--rounding", "gptq"]) == 0
    return out


def test_gptq_export_writes_the_calibrated_codes_and_verifies(gptq_export):
    """Both artifacts say they carry GPTQ codes and where the calibration text came from; the
    ONNX decoder's body is the calibrated ``MatMulNBits`` (one per body linear, none rounded again
    by onnxruntime's quantizer); verify passes with the exact interface."""
    import onnx

    from pit_deploy.evaluate.verify import verify_directory

    manifest = json.loads((gptq_export / MANIFEST_NAME).read_text())
    by_runtime = {a["target"]: a for a in manifest["artifacts"]}
    assert set(by_runtime) == {"onnx", "executorch"}
    for art in by_runtime.values():
        assert art["details"]["scheme"]["rounding"] == "gptq"
        assert "seed" in art["details"]["calibration"]
        assert "GPTQ" in art["details"]["expected"]["method"]
    # the onnx decoder's token table: rounded by GPTQ on the same text
    assert by_runtime["onnx"]["details"]["quantization"]["table_rounding"].startswith("GPTQ")
    pte_quantization = by_runtime["executorch"]["details"]["quantization"]
    assert "GPTQ" in pte_quantization["linear"]
    # the .pte's shared 8-bit token table: the head's codes, calibrated on the same text
    assert pte_quantization["shared_table"] and "GPTQ" in pte_quantization["token_table"]
    onnx_art = by_runtime["onnx"]
    graph = onnx.load(str(gptq_export / onnx_art["path"] / onnx_art["details"]["decoder"]), load_external_data=False).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    calibrated = [n for n in nbits if n.input[1].startswith("pit_gptq.")]
    layers = json.loads((gptq_export / "reference" / "config.json").read_text())["num_hidden_layers"]
    others = [n for n in nbits if not n.input[1].startswith("pit_gptq.")]
    assert len(calibrated) == 7 * layers and others and all(n.input[1].startswith("pit_q.head") for n in others)
    report = verify_directory(gptq_export, record=False)
    assert report.passed, str(report)
    for runtime in ("onnx", "executorch"):
        result = report.result(runtime, "factorized", "int4")
        assert result.delta_ti <= 1e-4, (runtime, result.delta_ti)


def test_rounding_is_checked():
    with pytest.raises(PitError, match="rounding must be one of rtn, gptq"):
        get_scheme("int4").with_settings(rounding="awq")
    with pytest.raises(PitError, match="web schemes folded at load"):
        get_scheme("int4-web").with_settings(rounding="gptq")
    assert get_scheme("int4").with_settings(rounding="gptq").settings()["rounding"] == "gptq"


def test_rounding_flag_on_a_runtime_that_ignores_it_is_a_user_error(tmp_path, capsys):
    """``--rounding`` with only the gguf runtime (llama.cpp's own quantizer) is exit 2, one line."""
    src = dense_t_pit_dir("llama", tmp_path)
    code = main(["export", str(src), "--out", str(tmp_path / "x"), "--runtime", "gguf", "--dtype", "q4_0",
                 "--rounding", "gptq"])
    assert code == 2
    err = capsys.readouterr().err
    assert "error: rounding applies to the" in err and not (tmp_path / "x").exists()


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_head_table_beats_round_to_nearest(bits):
    """A ``.pte``'s quantized head re-rounded by GPTQ against the second moments of the hidden
    states it reads (:meth:`RotatedQuantizedHead.round_calibrated`): on held-out hidden states of
    the same kind (outlier channels) its logits are closer to the float head's than with torchao's
    rounding, the codes stay on the head's grid, and the table read back is what the head holds."""
    from pit_deploy.targets.executorch.head import RotatedQuantizedHead

    d, v = 64, 512
    gen = torch.Generator().manual_seed(5)
    zt = torch.linalg.qr(torch.randn(v, d, generator=gen, dtype=torch.float64))[0].T.contiguous()
    a = torch.randn(d, d, generator=gen, dtype=torch.float64)
    t = a @ a.T / d + 0.5 * torch.eye(d, dtype=torch.float64)
    calib, held = _outlier_inputs(4096, d, 0), _outlier_inputs(1024, d, 2)
    errors = {}
    for name in ("rtn", "gptq"):
        head = RotatedQuantizedHead(zt.float(), t.float(), bits, 32)
        if name == "gptq":
            head.round_calibrated(zt.float(), calib.T @ calib)
        qdata = head.linear.weight.qdata
        assert int(qdata.min()) >= -(2 ** (bits - 1)) and int(qdata.max()) <= 2 ** (bits - 1) - 1
        assert head.calibrated == (name == "gptq") and ("GPTQ" in head.describe()) == (name == "gptq")
        u = held @ head.transform()
        exact = u @ head.rotated_rows(zt.float()).T
        errors[name] = float((u @ torch.from_numpy(head.dequantized_rows()).T - exact).norm() / exact.norm())
    assert errors["gptq"] < 0.8 * errors["rtn"], errors


def test_onnx_table_by_gptq_beats_onnxruntime_rounding():
    """The ONNX targets' token table (:func:`calibrated_table`, no ``T`` in the graph: weighted by
    the head's input alone) on ``MatMulNBits``' 4-bit grid: on held-out hidden states with outlier
    channels the head's outputs are closer to the float table's than with onnxruntime's own block
    rounding, and the table dequantizes as a ``MatMulNBits`` block table."""
    import onnx

    from pit_deploy.exporters.onnx_graph import Interface
    from pit_deploy.exporters.onnx_tables import block_quantize, calibrated_table

    d, v = 64, 256
    rows = torch.randn(v, d, generator=torch.Generator().manual_seed(7), dtype=torch.float64).numpy() * 0.05
    calib, held = _outlier_inputs(4096, d, 0).numpy(), _outlier_inputs(1024, d, 2).numpy()
    iface = Interface(gather=None, head=None, embed_rows=rows, head_rows=rows)
    graph = onnx.helper.make_graph([], "g", [], [])
    tables = {"ort": block_quantize(rows, 4, 32), "gptq": calibrated_table(graph, iface, 4, 32, calib.T @ calib)}
    errors = {name: float(np.linalg.norm(held @ (t.dequantize().astype(np.float64) - rows).T)) for name, t in tables.items()}
    assert tables["gptq"].packed.shape == tables["ort"].packed.shape
    assert errors["gptq"] < 0.7 * errors["ort"], errors


# --------------------------------------------------------------------------------------
# the codes kept between exports (pit_deploy/exporters/gptq_cache.py)
# --------------------------------------------------------------------------------------


def test_cached_codes_come_back_exactly_and_a_damaged_entry_is_not_used(tmp_path, monkeypatch):
    """Codes on every grid (signed 4-bit, unsigned 8-bit with zero points, per-row) read back
    bit for bit; an entry whose file was changed, or with the cache off, reads as no entry."""
    from pit_deploy.exporters import gptq_cache
    from pit_deploy.io.cache_dir import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    codes = {f"layer{i}": round_to_nearest(w * (i + 1), grid) for i, grid in enumerate(GRIDS)}
    assert gptq_cache.load_codes("ab" * 32) is None
    folder = gptq_cache.store_codes("ab" * 32, codes)
    back = gptq_cache.load_codes("ab" * 32)
    assert back is not None and set(back) == set(codes)
    for name, r in codes.items():
        got = back[name]
        assert got.grid == r.grid and got.codes.dtype == r.codes.dtype
        assert torch.equal(got.codes, r.codes) and torch.equal(got.scales, r.scales)
        assert torch.equal(got.zeros.to(r.zeros.dtype), r.zeros)
    assert gptq_cache.load_codes("cd" * 32) is None, "another key is another entry"
    record = json.loads((folder / gptq_cache.META).read_text())
    (folder / gptq_cache.META).write_text(json.dumps({**record, "grids": {"layer0": {"bits": 4}}}))
    assert gptq_cache.load_codes("ab" * 32) is None, "a record that does not describe its file is not used"
    (folder / gptq_cache.META).write_text(json.dumps(record))
    assert gptq_cache.load_codes("ab" * 32) is not None
    data = bytearray((folder / gptq_cache.CODES).read_bytes())
    data[-1] ^= 1
    (folder / gptq_cache.CODES).write_bytes(bytes(data))
    assert gptq_cache.load_codes("ab" * 32) is None, "a changed file is never used"
    monkeypatch.setenv(CACHE_ENV, "off")
    assert gptq_cache.store_codes("ab" * 32, codes) is None and gptq_cache.load_codes("ab" * 32) is None


def test_the_cache_key_changes_with_every_input_of_the_rounding():
    """One weight moved by one float32 step, another calibration token, another grid setting:
    each is another key; a copy of the same model on the same text is the same key."""
    import copy

    from pit_deploy.exporters.gptq_cache import codes_key
    from pit_deploy.tiny import tiny_model

    model = tiny_model("llama")
    blocks = [torch.arange(16), torch.arange(16, 32)]
    key = codes_key(model, blocks, "int4 g32")
    assert codes_key(copy.deepcopy(model), [b.clone() for b in blocks], "int4 g32") == key
    moved = copy.deepcopy(model)
    with torch.no_grad():
        w = moved.model.layers[1].mlp.down_proj.weight
        w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(float("inf")))
    assert codes_key(moved, blocks, "int4 g32") != key
    assert codes_key(model, [blocks[0], blocks[1].flip(0)], "int4 g32") != key
    assert codes_key(model, blocks, "int4 g64") != key


@pytest.mark.parametrize("shape, transpose", [((300, 7, 5), (0, 1)), ((40, 64), (0, 1)), ((), None), ((9,), None)])
def test_the_cache_key_reads_a_tensor_by_slices_as_its_whole_bytes(shape, transpose):
    """The key hashes a tensor a slice of its first axis at a time (a factorized model's ``Zᵀ``,
    a transposed view, is never copied whole): the same digest as its C-order bytes at once,
    for views, a 0-d tensor and parts that do not divide the axis."""
    import hashlib

    from pit_deploy.exporters.gptq_cache import _hash_bytes

    t = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    t = t.transpose(*transpose) if transpose else t
    whole = hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    for part_bytes in (1, 100, 16 << 20):
        h = hashlib.sha256()
        _hash_bytes(h, t, part_bytes)
        assert h.hexdigest() == whole, part_bytes


def test_a_second_export_reads_the_codes_from_the_cache(tmp_path, monkeypatch, capsys):
    """The same checkpoint exported twice with GPTQ: the second export reads the codes of the
    first from the cache instead of calibrating again, and writes the very same artifact."""
    from pit_deploy.io.cache_dir import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    source = dense_t_pit_dir("llama", tmp_path)
    outs = []
    for i in range(2):
        out = tmp_path / f"exp{i}"
        capsys.readouterr()
        assert main(["export", str(source), "--out", str(out), "--runtime", "onnx", "--mode", "factorized",
                     "--dtype", "int4", "--rounding", "gptq"]) == 0
        said = capsys.readouterr().err
        assert ("read from the cache" in said) == (i == 1) and ("GPTQ rounding of the body" in said) == (i == 0), said
        outs.append(out)
    arts = [json.loads((o / MANIFEST_NAME).read_text())["artifacts"][0] for o in outs]
    assert arts[0]["details"]["weight_codes"] == arts[1]["details"]["weight_codes"]
    first, second = (o / a["path"] for o, a in zip(outs, arts))
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert files and all((first / f).read_bytes() == (second / f).read_bytes() for f in files)


def test_progress_line_says_the_layer_and_the_time_left():
    """GPTQ prints one line a layer with the time left (the mean layer time × the layers left)."""
    from pit_deploy.exporters.calibrated_rounding import progress_line

    assert progress_line("gptq", 3, 30, 7, 12.0) == "GPTQ: layer 3/30 (7 linears), 12 s, about 1 min 48 s left"
    assert progress_line("gptq", 30, 30, 7, 120.0).endswith("120 s, done")


def test_a_tables_gptq_reports_each_row_chunk_where_asked(monkeypatch, tmp_path):
    """Within ``rounding_progress``, GPTQ of a matrix of several row chunks (a token table) says
    each chunk with the time left; a one-chunk matrix, or GPTQ outside the block, says nothing.
    An export prints those lines while a factorized table is rounded."""
    from pit_deploy import api
    from pit_deploy.data import calibration
    from pit_deploy.exporters import calibrated_rounding
    from pit_deploy.exporters.calibrated_rounding import rounding_progress
    from pit_deploy.io.checkpoint import save_model
    from pit_deploy.tiny import tiny_pit_model, tiny_tokenizer

    monkeypatch.setattr(calibrated_rounding, "ROW_CHUNK", 8)
    weight, h = torch.randn(20, 64, generator=torch.Generator().manual_seed(1)), torch.eye(64)
    lines: list[str] = []
    gptq(weight, h, RoundingGrid(4, 32, False))
    with rounding_progress(lines.append):
        gptq(weight[:8], h, RoundingGrid(4, 32, False))
        assert not lines
        gptq(weight, h, RoundingGrid(4, 32, False))
    gptq(weight, h, RoundingGrid(4, 32, False))
    assert [line.split(" rows, ")[0] for line in lines] == [f"GPTQ of a 20-row table: {n}/20" for n in (8, 16, 20)]
    assert "left" in lines[0] and lines[-1].endswith(" s, done")

    monkeypatch.setattr(calibrated_rounding, "ROW_CHUNK", 128)
    monkeypatch.setattr(calibration, "CALIBRATION_TOKENS", 256)
    save_model(tiny_pit_model("llama"), tmp_path / "pit", tiny_tokenizer())
    said: list[str] = []
    api.export(tmp_path / "pit", tmp_path / "out", runtime="onnx", mode="factorized", dtype="int4",
               max_seq_len=64, say=said.append)
    table = [line.strip() for line in said if line.strip().startswith("GPTQ of a 512-row table")]
    assert [line.split(" rows, ")[0] for line in table] == [f"GPTQ of a 512-row table: {n}/512" for n in
                                                            (128, 256, 384, 512)], said


def test_gptq_by_row_chunks_gives_the_codes_of_one_pass(monkeypatch):
    """Each output row's rounding depends only on that row and ``H``: rounding the rows a few at
    a time (as a 262k-token table is, to bound the float64 copies) gives the same codes, scales
    and zero points as one pass, in order and by act-order."""
    from pit_deploy.exporters import calibrated_rounding

    weight = torch.randn(37, 256, generator=torch.Generator().manual_seed(5))
    x = _outlier_inputs(512, 256)
    h = x.T @ x
    for grid in (RoundingGrid(4, 32, False), RoundingGrid(8, None, True)):
        for act_order in (False, True):
            whole = gptq(weight, h, grid, act_order)
            monkeypatch.setattr(calibrated_rounding, "ROW_CHUNK", 8)
            chunked = gptq(weight, h, grid, act_order)
            monkeypatch.undo()
            assert torch.equal(whole.codes, chunked.codes) and torch.equal(whole.scales, chunked.scales)
            assert torch.equal(whole.zeros, chunked.zeros)


def test_rounded_copies_share_the_token_table_and_leave_the_model_alone(monkeypatch):
    """The calibrated copy of a PIT model holds its body linears' rounded weights in tensors of
    its own and reads the very token-table tensors of the model it was copied from (no second
    copy of a large table); the model it came from keeps its weights."""
    from pit_deploy.exporters import calibrated_rounding
    from pit_deploy.tiny import tiny_pit_model

    monkeypatch.setattr(calibrated_rounding, "SHARE_MIN_ELEMENTS", 1)
    model = tiny_pit_model("llama").eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    table_ptrs = {p.data_ptr() for n, p in model.named_parameters() if "pit_interface" in n}
    copy = calibrated_rounding.copy_for_rounding(model)
    ids = [torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(k)) for k in range(2)]
    codes = calibrate(copy, ids, lambda name: None if "lm_head" in name else RoundingGrid(4, 32, True))
    assert codes
    assert table_ptrs and {p.data_ptr() for n, p in copy.named_parameters() if "pit_interface" in n} == table_ptrs
    for name in codes:
        assert copy.get_submodule(name).weight.data_ptr() != model.get_submodule(name).weight.data_ptr()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name

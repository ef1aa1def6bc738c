"""Quantized ONNX exports (int8, int4) of tiny models of every family: they export, verify
within their bounds, fail verification when a weight is corrupted, and the PIT correction keeps
``W_out E = I`` on the runtime; bad input is exit 2."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pit_deploy.cli import main
from pit_deploy.converters.conversion import convert_model
from pit_deploy.errors import PitError
from pit_deploy.evaluate.verify import verify_directory
from pit_deploy.exporters.onnx_tables import block_quantize, split_nibbles
from pit_deploy.model.quantized_interface import correction_matrix
from pit_deploy.io.checkpoint import save_model
from pit_deploy.io.fs import sha256_file
from pit_deploy.io.manifest import MANIFEST_NAME
from pit_deploy.targets.onnx import decoder_file
from pit_deploy.tiny import FAMILIES, tiny_model
from pit_models import dense_t_pit_dir

QUANTIZED = ("int8", "int4")


_pit_dir = dense_t_pit_dir


@pytest.fixture(scope="module", params=FAMILIES)
def quantized_export(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp(f"q-{request.param}")
    out = root / "exp"
    assert main(["export", str(_pit_dir(request.param, root)), "--out", str(out), "--runtime", "onnx",
                 "--dtype", "float32,int8,int4", "--max-seq-len", "64"]) == 0
    return out


def test_every_quantized_artifact_verifies(quantized_export):
    report = verify_directory(quantized_export, record=False)
    assert report.passed, str(report)
    for mode in ("materialized", "factorized"):
        fp32 = report.result("onnx", mode)
        assert fp32.kl_mean is None and fp32.logits_rel_l2 <= 1e-4
        for dtype in QUANTIZED:
            r = report.result("onnx", mode, dtype)
            assert r.logits_rel_l2 is None and r.heldout_tokens >= 2048
            assert 0.0 <= r.kl_mean <= r.bounds["kl_mean"] and 0.0 <= r.kl_p99 <= r.bounds["kl_p99"]
            assert r.same_top1 >= r.bounds["same_top1"] and r.ppl_ratio <= r.bounds["ppl_ratio"]
            assert r.weights_shared is True  # interface.onnx reads the decoder's quantized bytes
    for dtype in QUANTIZED:
        # the correction: W_out E = I on the runtime, up to fp32 rounding
        fact = report.result("onnx", "factorized", dtype)
        assert fact.pit_correction is True and fact.delta_ti <= 1e-4, fact.delta_ti
        # materialized quantization moves the interface away from the identity (reported, not bounded)
        assert report.result("onnx", "materialized", dtype).delta_ti > 10 * fact.delta_ti


def test_factorized_table_is_stored_once(quantized_export):
    manifest = json.loads((quantized_export / MANIFEST_NAME).read_text())
    arts = {a["path"]: a for a in manifest["artifacts"]}
    for dtype in QUANTIZED:
        details = arts[f"onnx-factorized-{dtype}"]["details"]["quantization"]
        assert details["token_table_shared"] is True and details["pit_correction"] is True
        assert "Z R" in details["table_rotation"]  # the factorized table is turned before it is rounded
        assert "table_rotation" not in arts[f"onnx-materialized-{dtype}"]["details"]["quantization"]
        assert not arts[f"onnx-materialized-{dtype}"]["details"]["quantization"]["token_table_shared"]
    # int4 < int8 < fp32 on disk, and the factorized int4 artifact is the smallest of all
    size = {p: a_bytes(a) for p, a in arts.items()}
    for mode in ("materialized", "factorized"):
        assert size[f"onnx-{mode}-int4"] < size[f"onnx-{mode}-int8"] < size[f"onnx-{mode}"]
    # on disk the head's MatMulNBits and the embedding's GatherBlockQuantized read one byte range:
    # the 8-bit table read whole by a head with int8 activations (the schemes' default), the
    # 8-bit kernel being fast there
    import onnx

    for dtype in QUANTIZED:
        graph = onnx.load(str(decoder_file(quantized_export / f"onnx-factorized-{dtype}")),
                          load_external_data=False).graph
        where = {i.name: {e.key: e.value for e in i.external_data} for i in graph.initializer}
        heads = [n for n in graph.node if n.op_type == "MatMulNBits" and n.input[1].startswith("pit_q.head.")]
        embeds = [n for n in graph.node if n.op_type == "GatherBlockQuantized"]
        assert len(heads) == len(embeds) == 1
        for head, embed in zip(heads, embeds):
            attrs = {a.name: a.i for a in head.attribute}
            assert attrs["bits"] == 8 and attrs["accuracy_level"] == 4
            assert where[head.input[1]]["offset"] == where[embed.input[0]]["offset"]


def test_int4_keeps_v_proj_and_down_proj_at_8_bits(quantized_export):
    """``int4_8bit_layers`` (default ``v_proj``, ``down_proj``, named as the family names them:
    GPT-2's ``attn.c_attn`` and ``mlp.c_proj``) on ONNX: those linears' MatMulNBits have 8-bit
    weights, every other body linear 4-bit, and the manifest counts them, two a layer."""
    import onnx

    from pit_deploy.schemes import names_linear

    manifest = json.loads((quantized_export / MANIFEST_NAME).read_text())
    arts = {a["path"]: a for a in manifest["artifacts"]}
    config = json.loads((quantized_export / "reference" / "config.json").read_text())
    names = ("attn.c_attn", "mlp.c_proj") if config["model_type"] == "gpt2" else ("v_proj", "down_proj")
    assert tuple(arts["onnx-factorized-int4"]["details"]["scheme"]["int4_8bit_layers"]) == names
    graph = onnx.load(str(decoder_file(quantized_export / "onnx-factorized-int4")), load_external_data=False).graph
    bits = {n.name: next(a.i for a in n.attribute if a.name == "bits")
            for n in graph.node if n.op_type == "MatMulNBits" and not n.input[1].startswith("pit_q.head.")}
    kept = {name for name in bits if names_linear(".".join(name.split("/")[1:-1]), names)}
    assert all(bits[name] == 8 for name in kept) and all(b == 4 for name, b in bits.items() if name not in kept)
    assert len(bits) > len(kept)
    details = arts["onnx-factorized-int4"]["details"]["quantization"]
    assert details["body_8bit"] == f"8-bit for {', '.join(names)} ({len(kept)} linears)"
    assert len(kept) == 2 * config.get("num_hidden_layers", config.get("n_layer", 0))


def a_bytes(art: dict) -> int:
    return sum(f["bytes"] for f in art["files"].values())


def test_a_corrupted_quantized_weight_fails_verification(quantized_export, tmp_path, capsys):
    """Scales of a quantized artifact scrambled *and* its digests re-recorded (a broken exporter,
    not a tampered file): the KL bounds catch it (exit 1)."""
    d = tmp_path / "copy"
    shutil.copytree(quantized_export, d)
    data = d / "onnx-materialized-int4" / "onnx" / "model_q4.onnx_data"
    raw = np.frombuffer(data.read_bytes(), dtype=np.uint8).copy()
    rng = np.random.default_rng(0)
    raw[rng.choice(raw.size, raw.size // 3, replace=False)] ^= 0x5A
    data.write_bytes(raw.tobytes())
    manifest = json.loads((d / MANIFEST_NAME).read_text())
    for art in manifest["artifacts"]:
        for rel, info in art["files"].items():
            info["sha256"] = sha256_file(d / rel)
            info["bytes"] = (d / rel).stat().st_size
    (d / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert main(["verify", str(d), "--dtype", "int4", "--mode", "materialized", "--no-record"]) == 1
    out = capsys.readouterr().out
    assert "onnx-materialized-int4" in out and "FAIL" in out


@pytest.mark.parametrize("bits", [8, 4])
def test_correction_makes_the_quantized_interface_exact(bits):
    """``T Ẑᵀ Ẑ M = I`` in float64 for the dequantized table onnxruntime's quantizer makes."""
    rng = np.random.default_rng(bits)
    v, d = 300, 64
    z, _ = np.linalg.qr(rng.standard_normal((v, d)))
    a = rng.standard_normal((d, d))
    t = a @ a.T + d * np.eye(d)
    table = block_quantize(z.astype(np.float32), bits, 32)
    zq = table.dequantize().astype(np.float64)
    assert 0 < np.abs(zq - z).max() < (0.2 if bits == 4 else 0.02)
    m = correction_matrix(zq, zq, t)
    uncorrected = np.linalg.norm(t @ zq.T @ zq @ np.linalg.inv(t) - np.eye(d))
    corrected = np.linalg.norm(t @ zq.T @ zq @ m - np.eye(d))
    assert corrected < 1e-10 < 1e-3 < uncorrected


def test_nibble_planes_reproduce_the_8bit_table_on_onnxruntime():
    """An 8-bit table split into two 4-bit planes: ``16·hi + lo`` dequantizes to the 8-bit
    table exactly, and onnxruntime's two 4-bit ``MatMulNBits`` (fp32 activations) summed equal
    the product with the 8-bit table to fp32 rounding."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    v, d, block = 96, 64, 32
    rows = rng.standard_normal((v, d)).astype(np.float32)
    rows[:, 5] *= 40.0  # an outlier column: zero points spread over the whole 0..255 range
    table = block_quantize(rows, 8, block)
    hi, lo = split_nibbles(table)
    assert hi.bits == lo.bits == 4 and hi.packed.nbytes + lo.packed.nbytes == table.packed.nbytes
    ones = np.ones_like(table.scales)  # integer codes: (q - z) = 16·(hi - z_hi) + (lo - z_lo) exactly
    codes = [dataclasses.replace(t, scales=ones).dequantize() for t in (table, hi, lo)]
    np.testing.assert_array_equal(16 * codes[1] + codes[2], codes[0])
    assert codes[0].min() < -100 and codes[0].max() > 100
    inits, nodes = [], []
    for k, plane in enumerate((hi, lo)):
        inits += [numpy_helper.from_array(plane.packed, f"b{k}"), numpy_helper.from_array(plane.scales, f"s{k}"),
                  numpy_helper.from_array(plane.zero_points, f"z{k}")]
        nodes.append(helper.make_node("MatMulNBits", ["x", f"b{k}", f"s{k}", f"z{k}"], [f"y{k}"],
                                      domain="com.microsoft", K=d, N=v, bits=4, block_size=block))
    inits.append(numpy_helper.from_array(np.array(16.0, np.float32), "sixteen"))
    nodes += [helper.make_node("Mul", ["y0", "sixteen"], ["y0x"]), helper.make_node("Add", ["y0x", "y1"], ["y"])]
    graph = helper.make_graph(nodes, "planes", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, d])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, v])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    x = rng.standard_normal((3, d)).astype(np.float32)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = x.astype(np.float64) @ table.dequantize().astype(np.float64).T
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def _factorized_interface_graph(v: int, d: int, seed: int = 0):
    """A factorized token interface as the exporters write it: ``Gather(Zᵀ, ids, axis=1) →
    Transpose → MatMul(T⁻¹)`` and ``MatMul(h, T) → MatMul(Zᵀ)``, with ``T`` SPD."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    z, _ = np.linalg.qr(rng.standard_normal((v, d)))
    z[:, 3] *= 6.0  # a few large coordinates in every row, as the default model's Z has
    a = rng.standard_normal((d, d))
    t = a @ a.T / d + np.eye(d)
    inits = [numpy_helper.from_array(z.T.astype(np.float32), "Zt"), numpy_helper.from_array(t.astype(np.float32), "T"),
             numpy_helper.from_array(np.linalg.inv(t).astype(np.float32), "T_inv")]
    nodes = [helper.make_node("Gather", ["Zt", "ids"], ["g"], axis=1),
             helper.make_node("Transpose", ["g"], ["gt"], perm=[1, 2, 0]),
             helper.make_node("MatMul", ["gt", "T_inv"], ["emb"]),
             helper.make_node("MatMul", ["h", "T"], ["ht"]),
             helper.make_node("MatMul", ["ht", "Zt"], ["logits"])]
    graph = helper.make_graph(nodes, "interface", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "n"]),
                                                   helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, "m", d])],
                              [helper.make_tensor_value_info("emb", TensorProto.FLOAT, [1, "n", d]),
                               helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "m", v])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_rotated_table_computes_the_same_interface_on_onnxruntime():
    """The factorized table turned by R (Z R, T R, Rᵀ T⁻¹): the graph's embedding rows and
    logits are unchanged to fp32 rounding on onnxruntime, T Tᵀ is T's, and the rows' largest
    coordinate shrinks (what the 4-bit scales gain); a quantized table then keeps W_out E = I."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from pit_deploy.exporters.onnx_graph import find_graph_interface
    from pit_deploy.exporters.onnx_tables import rotate_table
    from pit_deploy.exporters.quantize_onnx import rewrite_interface

    v, d = 200, 64
    model = _factorized_interface_graph(v, d)
    turned = onnx.ModelProto()
    turned.CopyFrom(model)
    iface = find_graph_interface(turned.graph, v, d)
    before = np.abs(iface.head_rows).max()
    assert rotate_table(turned.graph, iface)
    assert np.abs(iface.head_rows).max() < 0.6 * before
    feeds = {"ids": np.array([[0, 7, 199, 42, 7]], np.int64),
             "h": np.random.default_rng(1).standard_normal((1, 5, d)).astype(np.float32)}
    run = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
           for m in (model, turned)]
    for want, got in zip(*run):
        assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)
    inits = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in turned.graph.initializer}
    t = numpy_helper.to_array(model.graph.initializer[1]).astype(np.float64)
    assert np.abs(inits["T"] @ inits["T"].T - t @ t.T).max() < 1e-5 * np.abs(t @ t.T).max()
    assert np.abs(inits["T"] - t).max() > 1e-2 * np.abs(t).max()
    # quantized at 4 bits after the turn: on the runtime W_out E = I (W_out the logits of h = I,
    # E the embedding of every token), the correction computed from the turned factor
    iface = find_graph_interface(model.graph, v, d)
    details = rewrite_interface(model, iface, 4, 32, correct=True)
    assert "Z R" in details["table_rotation"]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    emb, _ = session.run(None, {"ids": np.arange(v)[None], "h": np.zeros((1, v, d), np.float32)})
    _, w_out = session.run(None, {"ids": np.zeros((1, d), np.int64), "h": np.eye(d, dtype=np.float32)[None]})
    assert np.abs(w_out[0].astype(np.float64) @ emb[0] - np.eye(d)).max() < 1e-4


def test_unused_initializers_are_removed_in_place_and_in_order():
    """Dead nodes go, then every initializer no node reads; the others stay in their order, the
    very messages they were (not copies: a copy of a decoder's weights stays in upb's arena)."""
    from onnx import helper, numpy_helper

    from pit_deploy.exporters.onnx_graph import remove_unused_initializers

    inits = [numpy_helper.from_array(np.full((2, 2), k, np.float32), f"w{k}") for k in range(5)]
    nodes = [helper.make_node("MatMul", ["x", "w3"], ["a"]), helper.make_node("MatMul", ["a", "w1"], ["y"]),
             helper.make_node("MatMul", ["x", "w4"], ["dead"])]
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("y", 1, [2, 2])], inits)
    kept = [graph.initializer[1], graph.initializer[3]]
    remove_unused_initializers(graph)
    assert [i.name for i in graph.initializer] == ["w1", "w3"] and [n.output[0] for n in graph.node] == ["a", "y"]
    kept[0].name = "renamed"  # the same message, not a copy
    assert graph.initializer[0].name == "renamed"


def test_a_table_turned_for_a_quantizer_is_left_out_of_the_graph():
    """``rotate_table(write_table=False)``: the turned rows in the interface record only (the
    quantizer replaces the table's readers next), the graph's float32 table as it was; the
    factors turned all the same."""
    import onnx
    from onnx import numpy_helper

    from pit_deploy.exporters.onnx_graph import find_graph_interface
    from pit_deploy.exporters.onnx_tables import rotate_table

    v, d = 200, 64
    model = _factorized_interface_graph(v, d)
    turned, kept = onnx.ModelProto(), onnx.ModelProto()
    turned.CopyFrom(model), kept.CopyFrom(model)
    written, left = find_graph_interface(turned.graph, v, d), find_graph_interface(kept.graph, v, d)
    assert rotate_table(turned.graph, written) and rotate_table(kept.graph, left, write_table=False)
    assert np.array_equal(written.head_rows, left.head_rows)
    arrays = [{i.name: numpy_helper.to_array(i) for i in m.graph.initializer} for m in (model, turned, kept)]
    assert np.array_equal(arrays[2]["Zt"], arrays[0]["Zt"]) and not np.array_equal(arrays[1]["Zt"], arrays[0]["Zt"])
    for name in ("T", "T_inv"):
        assert np.array_equal(arrays[2][name], arrays[1][name])


def test_an_interface_graph_run_in_parts_gives_the_whole_runs_tables(monkeypatch):
    """verify runs an interface graph over a few thousand ids and a few basis rows at a time
    (onnxruntime keeps the memory of its largest run): the same ``E`` and head logits as one run
    of every id and every basis row, on a 4-bit table with the correction."""
    import onnxruntime as ort

    import pit_deploy.runtime.ort_driver as ort_driver
    from pit_deploy.exporters.onnx_graph import find_graph_interface
    from pit_deploy.exporters.quantize_onnx import rewrite_interface

    v, d = 200, 64
    model = _factorized_interface_graph(v, d)
    rewrite_interface(model, find_graph_interface(model.graph, v, d), 4, 32, correct=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    emb, _ = session.run(None, {"ids": np.arange(v)[None], "h": np.zeros((1, 1, d), np.float32)})
    _, logits = session.run(None, {"ids": np.zeros((1, 1), np.int64), "h": np.eye(d, dtype=np.float32)[None]})
    calls = []

    def run(ids, hidden):
        calls.append((len(ids), len(hidden)))
        e, lg = session.run(None, {"ids": ids[None], "h": hidden[None]})
        return e[0], lg[0]

    monkeypatch.setattr(ort_driver, "INTERFACE_IDS", 37)
    monkeypatch.setattr(ort_driver, "INTERFACE_ROWS", 10)
    parts_emb, parts_logits = ort_driver.interface_in_parts(run, v, d)
    assert max(n for n, _ in calls) == 37 and max(m for _, m in calls) == 10 and len(calls) == 6 + 7
    assert np.allclose(parts_emb.numpy(), emb[0], rtol=1e-6, atol=1e-7)
    assert np.allclose(parts_logits.numpy(), logits[0], rtol=1e-6, atol=1e-7)



def test_the_interface_defect_summed_by_parts_is_the_whole_tables_figure(monkeypatch):
    """verify measures delta_ti without the runtime's whole E (640 MiB at a 262k vocabulary):
    W_out E summed over the interface graph's runs gives the very figure of the two whole tables
    where each run is a whole number of the float64 sum's row chunks, and the same to rounding
    where it is not."""
    import onnxruntime as ort

    import pit_deploy.model.core as core
    import pit_deploy.runtime.ort_driver as ort_driver
    from pit_deploy.exporters.onnx_graph import find_graph_interface
    from pit_deploy.exporters.quantize_onnx import rewrite_interface
    from pit_deploy.model.quantized_interface import identity_defect, identity_defect_by_parts

    v, d = 200, 64
    model = _factorized_interface_graph(v, d)
    rewrite_interface(model, find_graph_interface(model.graph, v, d), 4, 32, correct=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

    def run(ids, hidden):
        e, lg = session.run(None, {"ids": ids[None], "h": hidden[None]})
        return e[0], lg[0]

    monkeypatch.setattr(core, "POLAR_CHUNK_ROWS", 16)
    monkeypatch.setattr(ort_driver, "INTERFACE_ROWS", 10)
    monkeypatch.setattr(ort_driver, "INTERFACE_IDS", 32)
    whole = identity_defect(*ort_driver.interface_in_parts(run, v, d))
    assert 0 < whole < 1e-3
    assert ort_driver.defect_in_parts(run, v, d) == whole
    monkeypatch.setattr(ort_driver, "INTERFACE_IDS", 37)
    assert ort_driver.defect_in_parts(run, v, d) == pytest.approx(whole, rel=1e-9)
    # W_out a group of basis rows at a time (neither table whole): the same sums, row by row
    import pit_deploy.model.quantized_interface as quantized_interface

    monkeypatch.setattr(quantized_interface, "DEFECT_HEAD_ROWS", 24)
    assert ort_driver.defect_in_parts(run, v, d) == pytest.approx(whole, rel=1e-9)
    monkeypatch.setattr(ort_driver, "INTERFACE_IDS", 32)
    assert ort_driver.defect_in_parts(run, v, d) == pytest.approx(whole, rel=1e-12)
    emb, head = ort_driver.interface_in_parts(run, v, d)
    with pytest.raises(ValueError, match="expected 0"):
        identity_defect_by_parts(head.numpy(), [(10, emb.numpy()[10:])])
    with pytest.raises(ValueError, match="cover 100 ids of 200"):
        identity_defect_by_parts(head.numpy(), [(0, emb.numpy()[:100])])

def test_int8_grid_rows_pass_the_int8_activation_kernel_unrounded():
    """A row on the grid of int8_block_grid_rows goes through MatMulNBits' int8 activations
    (accuracy_level 4) as through its float32 ones; a row off the grid does not (the premise)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from pit_deploy.exporters.onnx_tables import block_quantize, int8_block_grid_rows

    rng = np.random.default_rng(0)
    k, n, block = 128, 96, 32
    table = block_quantize(rng.standard_normal((n, k)).astype(np.float32), 4, block)
    x = rng.standard_normal((16, k)) * np.exp(2 * rng.standard_normal(k))  # outlier channels
    snapped = int8_block_grid_rows(x, block)
    assert np.abs(snapped - x).max() <= np.abs(x).max() / 254 + 1e-12
    # float32 values, as a graph stores them: integers times the block's step to float32 rounding
    # (127 · 2⁻²⁴ ≈ 8e-6), far inside the kernel's rounding to the nearest code
    blocks = np.abs(snapped.reshape(16, -1, block)).astype(np.float64)
    steps = blocks.max(axis=2, keepdims=True) / 127
    assert snapped.dtype == np.float32 and np.abs(blocks / steps - np.round(blocks / steps)).max() < 2e-5

    def run(a: np.ndarray, level: int) -> np.ndarray:
        node = helper.make_node("MatMulNBits", ["a", "b", "s", "z"], ["y"], domain="com.microsoft", K=k, N=n,
                                bits=4, block_size=block, accuracy_level=level)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [None, k])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
                                  [numpy_helper.from_array(table.packed, "b"), numpy_helper.from_array(table.scales, "s"),
                                   numpy_helper.from_array(table.zero_points, "z")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid("com.microsoft", 1)], ir_version=8)
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run(None, {"a": a.astype(np.float32)})[0].astype(np.float64)

    def gap(a: np.ndarray) -> float:
        return float(np.linalg.norm(run(a, 4) - run(a, 0)) / np.linalg.norm(run(a, 0)))

    assert gap(x) > 1e-3
    assert gap(snapped) < 1e-5


def test_int8_head_keeps_the_identity_on_onnxruntime():
    """head_int8: the head's MatMulNBits read int8 activations (accuracy_level 4), its d×d factor
    is on their grid, and with the correction W_out E = I holds through that kernel; the logits of
    a general hidden state stay those of the float32 head up to the activations' rounding."""
    import onnx
    import onnxruntime as ort

    from pit_deploy.exporters.onnx_graph import find_graph_interface
    from pit_deploy.exporters.quantize_onnx import rewrite_interface

    v, d = 200, 64
    results = {}
    for bits, head_int8 in ((4, False), (4, True), (8, True)):
        model = _factorized_interface_graph(v, d)
        details = rewrite_interface(model, find_graph_interface(model.graph, v, d), bits, 32, correct=True,
                                    head_int8=head_int8)
        heads = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
        levels = {a.i for n in heads for a in n.attribute if a.name == "accuracy_level"}
        assert levels == ({4} if head_int8 else set())
        # int8 activations read an 8-bit table whole (a fast kernel), not as two nibble planes
        assert len(heads) == 1 and details["table_planes"] == 1
        assert details["head_activations"].startswith("int8" if head_int8 else "float32")
        # the int8 head's factor is stored as its 8-bit codes, folded to float32 at load: the one
        # float32 d×d tensor left is the embedding's M
        square = [i.name for i in model.graph.initializer if list(i.dims) == [d, d] and i.data_type == 1]
        codes = [i for i in model.graph.initializer if i.name.endswith(".grid8")]
        assert len(square) == (1 if head_int8 else 2) and len(codes) == (1 if head_int8 else 0)
        assert ("head_factor" in details) == head_int8
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        emb, _ = session.run(None, {"ids": np.arange(v)[None], "h": np.zeros((1, v, d), np.float32)})
        _, w_out = session.run(None, {"ids": np.zeros((1, d), np.int64), "h": np.eye(d, dtype=np.float32)[None]})
        assert np.abs(w_out[0].astype(np.float64) @ emb[0] - np.eye(d)).max() < 1e-4
        h = np.random.default_rng(2).standard_normal((1, 8, d)).astype(np.float32)
        results[bits, head_int8] = session.run(None, {"ids": np.zeros((1, 8), np.int64), "h": h})[1].astype(np.float64)
        onnx.checker.check_model(model)
    reference = _factorized_interface_graph(v, d)
    want = ort.InferenceSession(reference.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"ids": np.zeros((1, 8), np.int64), "h": h})[1].astype(np.float64)
    rel = {key: np.linalg.norm(got - want) / np.linalg.norm(want) for key, got in results.items()}
    # the 4-bit table's rounding dominates; int8 activations add little to it, and an 8-bit table
    # with int8 activations is closer than either
    assert rel[4, True] < 1.2 * rel[4, False] and rel[8, True] < 0.3 * rel[4, False], rel


def test_without_the_correction_the_identity_drifts(tmp_path):
    out = tmp_path / "exp"
    assert main(["export", str(_pit_dir("llama", tmp_path)), "--out", str(out), "--runtime", "onnx",
                 "--mode", "factorized", "--dtype", "int4", "--table-bits", "4", "--no-pit-correction",
                 "--max-seq-len", "64"]) == 0
    r = verify_directory(out, record=False).result("onnx", "factorized", "int4")
    assert r.pit_correction is False and r.delta_ti > 1e-3  # reported; the KL bounds still apply


def test_recipe_bounds_override_the_builtin_ones(quantized_export, tmp_path, capsys):
    d = tmp_path / "copy"
    shutil.copytree(quantized_export, d)
    manifest = json.loads((d / MANIFEST_NAME).read_text())
    manifest["recipe"]["bounds"] = {"int4": {"kl_mean": 0.0}}
    (d / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert main(["verify", str(d), "--dtype", "int4", "--no-record", "--json"]) == 1
    arts = json.loads(capsys.readouterr().out)["artifacts"]
    assert all(a["bounds"]["kl_mean"] == 0.0 and not a["passed"] for a in arts)


@pytest.mark.parametrize("argv, needle", [
    (["--runtime", "onnx", "--dtype", "float16"], "unknown dtype 'float16'"),
    (["--runtime", "onnx", "--dtype", "int3"], "unknown dtype 'int3'"),
    (["--runtime", "onnx", "--dtype", "int4", "--group-size", "48"], "group_size must be one of"),
    (["--runtime", "onnx", "--dtype", "int4", "--group-size", "128"], "does not divide the hidden size 64"),
    (["--runtime", "onnx", "--dtype", "int4", "--genai-group-size", "64"], "genai_group_size"),
])
def test_bad_quantization_input_is_exit_2(tmp_path, capsys, argv, needle):
    src = _pit_dir("llama", tmp_path)
    assert main(["export", str(src), "--out", str(tmp_path / "exp"), *argv]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "exp").exists()


def test_quantizing_an_export_again_is_exit_2(quantized_export, tmp_path, capsys):
    for target in (quantized_export, quantized_export / "onnx-factorized-int4"):
        assert main(["export", str(target), "--out", str(tmp_path / "again"), "--runtime", "onnx", "--dtype", "int4"]) == 2
        err = capsys.readouterr().err
        assert "already an export" in err and "reference" in err


# qwen3-int4 (two int4 lowerings, about 100 s) runs in the full tier; in the default tier the
# factorized int4 .pte verifies on Llama (tests/test_residual_rotation.py, test_weight_check.py)
@pytest.mark.parametrize("family, dtype", [pytest.param("qwen3", "int4", marks=pytest.mark.full), ("gpt2", "int8")])
def test_executorch_quantized_pte_verifies(tmp_path, family, dtype):
    """8da4w/8da8w linears on XNNPACK and an 8-bit embedding table (``embedding_byte``): the
    materialized head is quantized (its identity drifts), the factorized head reads the fp32
    ``Zᵀ`` and the corrected embedding keeps the interface exact (bounded)."""
    out = tmp_path / "exp"
    assert main(["export", str(_pit_dir(family, tmp_path)), "--out", str(out), "--runtime", "executorch",
                 "--dtype", dtype, "--max-seq-len", "64"]) == 0
    report = verify_directory(out, record=False)
    assert report.passed, str(report)
    fact = report.result("executorch", "factorized", dtype)
    mat = report.result("executorch", "materialized", dtype)
    assert fact.interface_exact is True and fact.delta_ti <= 1e-4
    assert mat.interface_exact is False and mat.delta_ti > 1e-3
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    for art in manifest["artifacts"]:
        assert "embedding_byte" in art["details"]["quantization"]["token_table"]


@pytest.mark.parametrize("correct", [True, False])
def test_pte_token_table_correction_keeps_the_interface_exact(tmp_path, correct):
    """The 8-bit embedding of a factorized ExecuTorch export, in eager PyTorch: with
    ``M = (ZᵀẐ)⁻¹T⁻¹`` the head (fp32 ``Zᵀ``) undoes the embedding to fp32 rounding; with
    ``T⁻¹`` it drifts by the table's quantization error."""
    from pit_deploy.exporters.passes import InterfaceProbe, prepare
    from pit_deploy.targets.executorch.token_table import quantize_token_table
    from pit_deploy.io.checkpoint import load_pit_model

    model = prepare(load_pit_model(_pit_dir("llama", tmp_path)), "factorized")
    details = quantize_token_table(model, 32, correct=correct)
    assert details["interface_exact"] is correct and "embedding_byte" in details["token_table"]
    probe = InterfaceProbe(model)
    v, d = model.config.vocab_size, model.config.hidden_size
    with torch.no_grad():
        e = probe.embed(torch.arange(v)).to(torch.float64)  # (V, d): rows of E
        w = probe.head_logits(torch.eye(d)).to(torch.float64)  # (d, V): W_out acting on a basis
    err = float((e.T @ w.T - torch.eye(d, dtype=torch.float64)).abs().max())  # (W_out E) - I
    assert (err < 1e-4) if correct else (err > 1e-3), err


def test_executorch_int4_scheme_keeps_named_layers_at_8_bits():
    """``int4_8bit_layers`` (default ``v_proj``, ``down_proj``) get per-channel int8 weights, every
    other linear symmetric int4 in groups; the twin stays close to the fp32 model, the source is
    untouched."""
    from pit_deploy.targets.executorch.export import quantize_linears
    from pit_deploy.tiny import tiny_model

    model = tiny_model("llama").eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    twin, details = quantize_linears(model, "int4", 32, ("v_proj", "down_proj"))
    layer = twin.model.layers[0]
    in_features = layer.mlp.down_proj.in_features
    assert layer.mlp.down_proj.weight.block_size[-1] == in_features  # per channel: one block a row
    assert layer.self_attn.v_proj.weight.block_size[-1] == layer.self_attn.v_proj.in_features
    assert layer.self_attn.q_proj.weight.block_size[-1] == 32 and layer.mlp.up_proj.weight.block_size[-1] == 32
    assert "v_proj, down_proj" in details["linear_8bit"] and "HQQ" in details["linear"]
    assert type(model.model.layers[0].mlp.down_proj.weight) is torch.nn.Parameter  # the source is a copy
    with torch.no_grad():
        ref, got = model(input_ids=ids).logits, twin(input_ids=ids).logits
    assert float((got - ref).norm() / ref.norm()) < 0.2
    _, none_kept = quantize_linears(model, "int4", 32, ())
    assert "none (0 layers)" in none_kept["linear_8bit"]


def test_recipe_refuses_a_bad_int4_8bit_layers():
    from pit_deploy.exporters.recipes import Recipe

    with pytest.raises(PitError, match="int4_8bit_layers must be a list"):
        Recipe(int4_8bit_layers="down_proj")
    assert Recipe(dtype=("int4",), int4_8bit_layers=["o_proj"]).to_dict()["int4_8bit_layers"] == ["o_proj"]


def test_a_tied_export_stores_its_quantized_table_once(tmp_path):
    """The transpose-tied baseline: the head read ``Transpose(E)``; once the head is quantized
    no node may keep the fp32 table alive in the file."""
    import onnx

    out = tmp_path / "exp"
    src = tmp_path / "tied"
    save_model(tiny_model("llama"), src)
    assert main(["export", str(src), "--out", str(out), "--runtime", "onnx", "--keep-tying", "--dtype", "int8",
                 "--max-seq-len", "64"]) == 0
    folder = next(p for p in out.iterdir() if p.name.endswith("-int8"))
    graph = onnx.load(str(decoder_file(folder)), load_external_data=False).graph
    vocab_rows = [i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT and
                  len(i.dims) == 2 and i.dims[0] * i.dims[1] >= 64 * 256]
    assert not vocab_rows, vocab_rows
    assert verify_directory(out, record=False).passed


@pytest.mark.parametrize("bits", [8, 4])
def test_rotated_quantized_head_keeps_the_weight_identity(tmp_path, bits):
    """``pte_head_bits``: the factorized head becomes ``(h · S) Ŷᵀ`` with ``S`` the rows of ``T R``
    on the int8 grid and ``Ŷ`` the torchao-quantized ``Z T S⁻ᵀ ≈ Z R``. The logits stay close to
    the fp32 model's (the rotation changes nothing but the rounding), the weights keep
    ``W_out E = I`` exactly, and so does the head on basis vectors: its per-token rounding leaves
    the grid rows of ``S`` unchanged."""
    from pit_deploy.exporters.passes import FACTORS_ATTR, InterfaceProbe, prepare
    from pit_deploy.targets.executorch.head import random_rotation
    from pit_deploy.targets.executorch.token_table import dequantize_rows, quantize_token_table
    from pit_deploy.io.checkpoint import load_pit_model

    fp32 = prepare(load_pit_model(_pit_dir("llama", tmp_path)), "factorized")
    model = prepare(load_pit_model(_pit_dir("llama", tmp_path / "again")), "factorized")
    details = quantize_token_table(model, 32, correct=True, head_bits=bits)
    assert details["head_bits"] == bits and details["interface_exact"] is True
    assert ("8da8w" if bits == 8 else "8da4w") in details["token_table"]
    assert not hasattr(model, FACTORS_ATTR)  # the fp32 table is gone from the program
    head = model.pit_quantized_head
    r = random_rotation(head.hidden_size)
    assert float((r.T @ r - torch.eye(r.shape[0], dtype=torch.float64)).abs().max()) < 1e-12
    probe = InterfaceProbe(model)
    v, d = model.config.vocab_size, model.config.hidden_size
    m = probe.embedding.M.to(torch.float64)
    weights = torch.from_numpy(head.transform() @ head.dequantized_rows().T)  # S Ŷᵀ: d×V
    e = torch.from_numpy(dequantize_rows(probe.embedding.q, probe.embedding.scales)) @ m  # V×d, in float64
    assert e.shape == (v, d)
    identity = weights @ e
    assert float((identity - torch.eye(d, dtype=torch.float64)).abs().max()) < 1e-5  # M's float32 rounding
    with torch.no_grad():
        on_basis = probe.head_logits(torch.eye(d)).to(torch.float64)  # rows of S: nothing to round
        measured = float((on_basis @ e - torch.eye(d, dtype=torch.float64)).norm())
        ids = torch.randint(0, v, (1, 16), generator=torch.Generator().manual_seed(0))
        ref, got = fp32(input_ids=ids).logits, model(input_ids=ids).logits
    # torchao's eager 8da4w picks its int8 activation grid unlike XNNPACK (measured 7.7e-3 here);
    # the lowered program, which verify measures, is exact: tests/test_pte_shared_table.py
    assert measured < (1e-4 if bits == 8 else 0.05), measured
    assert float((got - ref).norm() / ref.norm()) < (0.05 if bits == 8 else 0.2)


# Full tier (two int8 lowerings and verifications): in the default tier the rotated 8-bit head verifies
# on the runtime as int4's .pte head (the README block, tests/test_own_model.py) and the fp32 head as
# int8's (test_executorch_quantized_pte_verifies above); this test adds int8 with the quantized head, and its size.
@pytest.mark.full
def test_executorch_rotated_quantized_head_exports_and_verifies(tmp_path):
    """``--pte-head-bits 8`` on a factorized int8 ``.pte``: it verifies within the int8 bounds,
    is smaller than the program with the fp32 head, and keeps ``delta_ti ≤ 1e-4`` on the runtime
    like the fp32 head (the grid-exact ``S``, :mod:`pit_deploy.targets.executorch.head`)."""
    src = _pit_dir("qwen3", tmp_path)
    sizes = {}
    for bits in (0, 8):
        out = tmp_path / f"exp{bits}"
        assert main(["export", str(src), "--out", str(out), "--runtime", "executorch", "--mode", "factorized",
                     "--dtype", "int8", "--max-seq-len", "64", "--pte-head-bits", str(bits)]) == 0
        report = verify_directory(out, record=False)
        assert report.passed, str(report)
        result = report.result("executorch", "factorized", "int8")
        assert result.interface_exact is True
        assert result.delta_ti <= 1e-4, (bits, result.delta_ti)
        sizes[bits] = (out / "executorch-factorized-int8" / "model.pte").stat().st_size
        manifest = json.loads((out / MANIFEST_NAME).read_text())
        assert manifest["artifacts"][0]["details"]["quantization"]["head_bits"] == bits
    assert sizes[8] < sizes[0], sizes


def test_recipe_refuses_a_bad_pte_head_bits():
    from pit_deploy.exporters.recipes import Recipe

    for bad in (2, 16, True, "8"):
        with pytest.raises(PitError, match="pte_head_bits must be 0"):
            Recipe(pte_head_bits=bad)
    assert Recipe(dtype=("int4",), pte_head_bits=4, pte_shared_table=False).to_dict()["pte_head_bits"] == 4


def test_pack_nibbles_is_what_embedding_4bit_reads():
    """``embedding_4bit`` over :func:`pack_nibbles` returns the rows ``q · s`` (PyTorch's reference
    implementation of the op; the runtime's kernel is checked by the export test below)."""
    from pit_deploy.targets.executorch.token_table import QuantizedRows, dequantize_rows, quantize_rows

    rows = torch.randn(40, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    q, scales = quantize_rows(rows, 32, bits=4)
    assert int(q.min()) >= -7 and int(q.max()) <= 7
    table = QuantizedRows(q, scales, bits=4)
    assert table.packed.dtype == torch.uint8 and table.packed.shape == (40, 32) and table.embedding_dim == 64
    ids = torch.tensor([[3, 0, 39, 3]])
    got = table(ids)[0].to(torch.float64)
    assert torch.allclose(got, torch.from_numpy(dequantize_rows(q, scales))[ids[0]], atol=1e-6)
    assert float((got - rows[ids[0]]).abs().max()) < float(scales.max()) * 0.51  # within half a step


def test_executorch_4bit_token_table_keeps_the_interface_exact(tmp_path):
    """``--table-bits 4`` on a factorized int4 ``.pte``: the gather reads packed 4-bit rows through
    ``embedding_4bit`` and the correction, computed from our reading of the packing, holds on
    the runtime's own kernel (``delta_ti ≤ 1e-4``)."""
    src = _pit_dir("llama", tmp_path)
    out = tmp_path / "exp"
    assert main(["export", str(src), "--out", str(out), "--runtime", "executorch", "--mode", "factorized",
                 "--dtype", "int4", "--max-seq-len", "64", "--table-bits", "4"]) == 0
    report = verify_directory(out, record=False)
    assert report.passed, str(report)
    result = report.result("executorch", "factorized", "int4")
    assert result.interface_exact is True and result.delta_ti <= 1e-4, result.delta_ti
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert "embedding_4bit" in manifest["artifacts"][0]["details"]["quantization"]["token_table"]


def test_int4_compact_recipe_exports_the_smallest_int4_artifacts(tmp_path):
    """The shipped ``int4-compact`` recipe (the default model's int4 ONNX artifact under 100 MB,
    ``docs/quantization.md``): factorized int4 with a 4-bit token table and only ``v_proj`` at 8
    bits. It verifies within the int4 bounds, the table is one plane that the head and the
    embedding read from one byte range, and the interface stays exact."""
    import onnx

    out = tmp_path / "exp"
    assert main(["export", str(_pit_dir("qwen3", tmp_path)), "--out", str(out), "--recipe", "int4-compact",
                 "--max-seq-len", "64"]) == 0
    report = verify_directory(out, record=False)
    assert report.passed, str(report)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["recipe"]["name"] == "int4-compact"
    arts = {a["path"]: a for a in manifest["artifacts"]}
    assert sorted(arts) == ["onnx-factorized-int4-compact"]  # the scheme names the artifact
    onnx_details = arts["onnx-factorized-int4-compact"]["details"]["quantization"]
    assert onnx_details["table_bits"] == 4 and onnx_details["table_planes"] == 1
    assert onnx_details["interface_exact"] is True
    assert report.result("onnx", "factorized", "int4-compact").delta_ti <= 1e-4
    graph = onnx.load(str(decoder_file(out / "onnx-factorized-int4-compact")), load_external_data=False).graph
    where = {i.name: {e.key: e.value for e in i.external_data} for i in graph.initializer}
    (head,) = [n for n in graph.node if n.op_type == "MatMulNBits" and n.input[1].startswith("pit_q.head.")]
    (embed,) = [n for n in graph.node if n.op_type == "GatherBlockQuantized"]
    assert where[head.input[1]]["offset"] == where[embed.input[0]]["offset"]
    body = {n.name: next(a.i for a in n.attribute if a.name == "bits")
            for n in graph.node if n.op_type == "MatMulNBits" and n is not head}
    assert {name for name, b in body.items() if b == 8} == {name for name in body if "v_proj" in name.split("/")}
    assert any("down_proj" in name.split("/") and b == 4 for name, b in body.items())


def test_the_token_gather_is_told_from_a_position_table_of_the_same_shape(tmp_path):
    """GPT-2 with as many positions as tokens has two ``V×d`` Gathers (``wte`` and ``wpe``): the
    quantizer must rewrite the one of ``input_ids``, never the position table's."""
    from onnx import load

    from pit_deploy.exporters.onnx_graph import _reads_token_ids, find_graph_interface

    model = convert_model(tiny_model("gpt2", max_positions=512))  # vocabulary 512 too
    assert model.config.n_positions == model.config.vocab_size
    save_model(model, tmp_path / "pit")
    out = tmp_path / "exp"
    assert main(["export", str(tmp_path / "pit"), "--out", str(out), "--runtime", "onnx", "--mode", "factorized",
                 "--max-seq-len", "32"]) == 0
    graph = load(str(decoder_file(out / "onnx-factorized")), load_external_data=True).graph
    same_shape = [n for n in graph.node if n.op_type == "Gather" and n.input[0] in {i.name for i in graph.initializer}
                  and {tuple(i.dims) for i in graph.initializer if i.name == n.input[0]} & {(512, 64), (64, 512)}]
    assert len(same_shape) == 2  # the case this test is about
    iface = find_graph_interface(graph, 512, 64)
    assert _reads_token_ids(graph, iface.gather.input[1]) and iface.gather.input[0] == iface.head.input[1]

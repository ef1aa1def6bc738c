"""Which quantized variant of the factorized ONNX decoder loads and decodes fast in the browser?

The int4 artifact (``MatMulNBits`` body and head, ``GatherBlockQuantized`` embedding) does not
load in onnxruntime-web's default WASM build (no ``GatherBlockQuantized``), and its
``MatMulNBits`` are slow there. This study builds quantized variants of an fp32 factorized
folder (transformers.js layout) with standard operators only and runs each through
transformers.js in headless Chromium and Node (``pit_deploy.runtime.web_clients``):

* ``q8_dynamic_pc`` / ``q8_dynamic_pt``: ``onnxruntime.quantization.quantize_dynamic`` as it
  comes (int8 weights per channel / per tensor, ``DynamicQuantizeLinear`` + ``MatMulInteger``:
  transformers.js's own "q8" format);
* ``q8_shared``: ``MatMulInteger`` (``quantize_dynamic``, uint8 weights) for q/k/v/o/gate/up only, and the token
  table as uint8 codes with a scale and zero point per token, read by both the head (``DynamicQuantizeLinear``
  + ``MatMulInteger``) and the embedding (``Gather(axis=1)`` of the codes, ``Cast``, ``Sub``, ``Mul`` by the
  gathered scales); ``down_proj`` int8 dequantized at load (below); ``T``, ``T⁻¹`` fp32;
* ``w8_fold``: every weight but ``T``, ``T⁻¹`` stored as int8 codes + scales and dequantized by
  ``Cast`` and ``Mul`` on initializers only, which onnxruntime's constant folding computes once
  when the session is created: fp32 kernels at run time, int8 bytes in the file;
* ``w4_fold``: the same with 4-bit codes in blocks of 32 (two a byte, unpacked with
  ``BitwiseAnd``/``BitShift``), ``v_proj``/``down_proj`` and the table at 8 bits (the int4
  artifact's choice); ``w4_fold_t4`` with a 4-bit table as well;
* ``q4_dq``: ``w4_fold`` with the 4-bit weights behind ``DequantizeLinear`` (opset 21, int4,
  ``block_size``) instead, which onnxruntime does *not* fold (it may fuse them into ``MatMulNBits``).

Measured per variant: the file size, whether it loads in Chromium and Node, Chromium's decode
ms/token and prefill (threads=1, 32 greedy tokens after each of four 64-token prompts, the best
of ``--reps`` runs taken round-robin over the variants), the KL of the prompt logits from the
fp32 folder's in the same client, how the token table is stored, the build time, and the
operators native onnxruntime runs after its graph optimizations (folding, fusions). Apart from
the models, one ``[1, K] × [K, N]`` product per weight format is timed in onnxruntime-web's WASM
build (in Node): which formats have a fast path there at one token.

The ``*_fold`` variants save download and disk, not memory: the session holds fp32 weights.

Usage::

    python studies/web_int8.py --folder EXPORT/onnx-factorized [--out studies/results/web_int8.json]
                               [--work WORK] [--variants q8_shared,w8_fold]
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pit_deploy.io.result_file import write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TABLE = "pit_factors.Zt"  # [d, V]: the embedding gathers its columns (axis=1), the head multiplies by it
FACTORS = ("pit_factors.T", "pit_factors.T_inv")  # d×d, kept fp32 (8-bit T alone costs a mean KL of ~7)
BODY_INT8_IN_INT4 = ("v_proj", "down_proj")  # 8-bit linears of the int4 schemes
SUFFIX = {"fp32": "", "q8": "_quantized", "q4": "_q4"}  # transformers.js dtype -> onnx/model{suffix}.onnx
TEXTS = [
    "The old lighthouse keeper climbed the spiral stairs every evening, carrying a lantern and a small "
    "notebook in which he recorded the weather, the ships that passed, and the thoughts that came to him "
    "as the sun went down over the grey water. Nobody had asked him to keep such a record, and nobody "
    "would ever read it, but he wrote in it all the same.",
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light into chemical "
    "energy. In the chloroplasts, chlorophyll absorbs sunlight, and that energy is used to split water "
    "molecules, releasing oxygen, and to build sugars from carbon dioxide taken from the air. Most of the "
    "oxygen we breathe was made this way.",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n    i = j = 0\n"
    "    out = []\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i])\n"
    "            i += 1\n        else:\n            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n"
    "    out.extend(b[j:])\n    return out\n",
    "function debounce(fn, wait) {\n  let timer = null;\n  return function (...args) {\n    clearTimeout(timer);\n"
    "    timer = setTimeout(() => fn.apply(this, args), wait);\n  };\n}\n\nconst onResize = debounce(() => {\n"
    "  console.log(window.innerWidth, window.innerHeight);\n}, 200);\nwindow.addEventListener('resize', onResize);\n",
]


# --- graph helpers --------------------------------------------------------------------------


def weight_names(graph: onnx.GraphProto) -> list[str]:
    """Initializers read as a ``MatMul``'s B or a ``Gather``'s data (2-D), in graph order."""
    inits = {i.name: i for i in graph.initializer}
    names = [n.input[1] for n in graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    names += [n.input[0] for n in graph.node if n.op_type == "Gather" and n.input[0] in inits
              and len(inits[n.input[0]].dims) == 2]
    return list(dict.fromkeys(names))


def consumers(graph: onnx.GraphProto, name: str) -> list[onnx.NodeProto]:
    return [n for n in graph.node if name in n.input]


def replace_initializers(model: onnx.ModelProto, plan: dict[str, callable]) -> None:
    """Replace each initializer ``name`` by ``plan[name](name, W) -> (initializers, nodes)``, nodes
    that compute a tensor of the same name (put first in the graph: they read initializers only)."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    new_inits, new_nodes = [], []
    for name, build in plan.items():
        extra, nodes = build(name, numpy_helper.to_array(inits[name]))
        g.initializer.remove(inits[name])
        new_inits += extra
        new_nodes += nodes
    g.initializer.extend(new_inits)
    old = list(g.node)
    del g.node[:]
    g.node.extend(new_nodes + old)


def _t(array: np.ndarray, name: str) -> TensorProto:
    return numpy_helper.from_array(np.ascontiguousarray(array), name)


# --- codes ----------------------------------------------------------------------------------


def int8_columns(W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 codes with one scale per column of ``W`` [K, N] (per output; per token for Zᵀ)."""
    s = np.abs(W).max(0) / 127
    s[s == 0] = 1
    return np.clip(np.round(W / s), -127, 127).astype(np.int8), s.astype(np.float32)


def uint4_blocks(W: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric 4-bit codes (0..15) in blocks of ``block`` along K of ``W`` [K, N]: codes
    [K/block, block, N], fp16-representable scales and integer zero points [K/block, 1, N]."""
    K, N = W.shape
    Wb = W.reshape(K // block, block, N)
    lo, hi = np.minimum(Wb.min(1, keepdims=True), 0), np.maximum(Wb.max(1, keepdims=True), 0)
    s = ((hi - lo) / 15).astype(np.float16).astype(np.float32)
    s[s == 0] = 1
    zp = np.clip(np.round(-lo / s), 0, 15)
    q = np.clip(np.round(Wb / s) + zp, 0, 15).astype(np.uint8)
    return q, s, zp.astype(np.uint8)


def fold_int8(name: str, W: np.ndarray):
    """``name = Cast(codes) * scale``: folded to fp32 by onnxruntime when the session is created."""
    q, s = int8_columns(W)
    return ([_t(q, name + "_q8"), _t(s, name + "_scale")],
            [helper.make_node("Cast", [name + "_q8"], [name + "_f"], name + "_cast", to=TensorProto.FLOAT),
             helper.make_node("Mul", [name + "_f", name + "_scale"], [name], name + "_dequant")])


def fold_int4(name: str, W: np.ndarray, block: int = 32):
    """4-bit codes two a byte (rows 2k low nibble, 2k+1 high), unpacked and dequantized with
    standard operators on initializers only, so onnxruntime folds them to fp32 at load."""
    K, N = W.shape
    q, s, zp = uint4_blocks(W, block)
    q = q.reshape(K // 2, 2, N)
    packed = q[:, 0] | (q[:, 1] << 4)
    n = lambda op, ins, out, **kw: helper.make_node(op, [name + i for i in ins], [name + out], name + out, **kw)  # noqa: E731
    inits = [_t(packed, name + "_q4"), _t(s.astype(np.float16), name + "_scale"), _t(zp, name + "_zp"),
             _t(np.array([15], np.uint8), name + "_mask"), _t(np.array([4], np.uint8), name + "_four"),
             _t(np.array([1], np.int64), name + "_axis1"),
             _t(np.array([K // block, block, N], np.int64), name + "_blocks_shape"),
             _t(np.array([K, N], np.int64), name + "_shape")]
    nodes = [n("BitwiseAnd", ["_q4", "_mask"], "_lo"), n("BitShift", ["_q4", "_four"], "_hi", direction="RIGHT"),
             n("Unsqueeze", ["_lo", "_axis1"], "_lo3"), n("Unsqueeze", ["_hi", "_axis1"], "_hi3"),
             n("Concat", ["_lo3", "_hi3"], "_pairs", axis=1), n("Reshape", ["_pairs", "_blocks_shape"], "_codes"),
             n("Cast", ["_codes"], "_codes_f", to=TensorProto.FLOAT), n("Cast", ["_zp"], "_zp_f", to=TensorProto.FLOAT),
             n("Cast", ["_scale"], "_scale_f", to=TensorProto.FLOAT), n("Sub", ["_codes_f", "_zp_f"], "_centred"),
             n("Mul", ["_centred", "_scale_f"], "_w3"),
             helper.make_node("Reshape", [name + "_w3", name + "_shape"], [name], name + "_dequant")]
    return inits, nodes


def dq_int4(name: str, W: np.ndarray, block: int = 32):
    """``DequantizeLinear`` (opset 21) of uint4 codes with ``block_size`` along K (axis 0)."""
    K, N = W.shape
    q, s, zp = uint4_blocks(W, block)
    pack = lambda a: (a.reshape(-1)[0::2] | (a.reshape(-1)[1::2] << 4)).tobytes()  # noqa: E731 — low nibble first
    codes = helper.make_tensor(name + "_u4", TensorProto.UINT4, [K, N], pack(q.reshape(K, N)), raw=True)
    zps = helper.make_tensor(name + "_zp", TensorProto.UINT4, [K // block, N], pack(zp.reshape(K // block, N)), raw=True)
    return ([codes, _t(s.reshape(K // block, N), name + "_scale"), zps],
            [helper.make_node("DequantizeLinear", [name + "_u4", name + "_scale", name + "_zp"], [name],
                              name + "_dequant", axis=0, block_size=block)])


def uint8_columns(W: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric uint8 codes with one scale and zero point per column of ``W`` [K, N] (per token for Zᵀ)."""
    lo, hi = np.minimum(W.min(0), 0), np.maximum(W.max(0), 0)
    s = (hi - lo) / 255
    s[s == 0] = 1
    zp = np.clip(np.round(-lo / s), 0, 255)
    q = np.clip(np.round(W / s) + zp, 0, 255).astype(np.uint8)
    return q, s.astype(np.float32), zp.astype(np.uint8)


def shared_uint8_table(model: onnx.ModelProto) -> None:
    """One 8-bit table (uint8 codes [d, V], a scale and a zero point per token) for both readers
    of ``TABLE``. The head ``MatMul(x, Zᵀ)`` becomes ``DynamicQuantizeLinear(x)``,
    ``MatMulInteger(x_q, codes, x_zp, zp)``, ``Cast``, ``Mul(x_scale · scale)``; the embedding
    ``Gather(Zᵀ, ids, axis=1)`` becomes ``Gather(codes, ids, axis=1)``, ``Cast``, ``Sub`` the
    gathered zero points, ``Mul`` by the gathered scales ([d, n] · [n])."""
    g = model.graph
    init = next(i for i in g.initializer if i.name == TABLE)
    q, s, zp = uint8_columns(numpy_helper.to_array(init))
    codes, scale, zero = TABLE + "_u8", TABLE + "_scale", TABLE + "_zp"
    g.initializer.remove(init)
    g.initializer.extend([_t(q, codes), _t(s, scale), _t(zp, zero)])
    mk = helper.make_node
    nodes = []
    for node in g.node:
        if TABLE not in node.input:
            nodes.append(node)
        elif node.op_type == "Gather":  # embedding: [d, n] codes -> fp32, per-token zero point and scale
            ids, out, p = node.input[1], node.output[0], node.name
            nodes += [mk("Gather", [codes, ids], [p + "_codes"], p + "_codes", axis=1),
                      mk("Gather", [zero, ids], [p + "_zp"], p + "_zp", axis=0),
                      mk("Gather", [scale, ids], [p + "_scales"], p + "_scales", axis=0),
                      mk("Cast", [p + "_codes"], [p + "_codes_f"], p + "_cast", to=TensorProto.FLOAT),
                      mk("Cast", [p + "_zp"], [p + "_zp_f"], p + "_cast_zp", to=TensorProto.FLOAT),
                      mk("Sub", [p + "_codes_f", p + "_zp_f"], [p + "_centred"], p + "_centre"),
                      mk("Mul", [p + "_centred", p + "_scales"], [out], p + "_dequant")]
        elif node.op_type == "MatMul" and node.input[1] == TABLE:  # head
            x, out, p = node.input[0], node.output[0], node.name
            nodes += [mk("DynamicQuantizeLinear", [x], [p + "_xq", p + "_xs", p + "_xzp"], p + "_quant"),
                      mk("MatMulInteger", [p + "_xq", codes, p + "_xzp", zero], [p + "_i32"], p + "_int"),
                      mk("Cast", [p + "_i32"], [p + "_f"], p + "_cast", to=TensorProto.FLOAT),
                      mk("Mul", [p + "_xs", scale], [p + "_scales"], p + "_scales"),
                      mk("Mul", [p + "_f", p + "_scales"], [out], p + "_dequant")]
        else:
            raise ValueError(f"unexpected reader of {TABLE}: {node.op_type} {node.name}")
    del g.node[:]
    g.node.extend(nodes)


# --- variants -------------------------------------------------------------------------------


def q8_dynamic(src: Path, per_channel: bool, only: tuple[str, ...] = (), weight_type: str = "QInt8") -> onnx.ModelProto:
    """``quantize_dynamic`` (8-bit weights, ``MatMulInteger``; its default int8 weights unless
    ``weight_type``); ``only``: quantize just the MatMuls whose name contains one of these."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    nodes = None
    if only:
        graph = onnx.load(src, load_external_data=False).graph
        nodes = [n.name for n in graph.node if n.op_type == "MatMul" and any(o in n.name for o in only)]
    with tempfile.TemporaryDirectory(prefix="web-int8-") as tmp:
        quantize_dynamic(src, Path(tmp) / "q.onnx", per_channel=per_channel, weight_type=QuantType[weight_type],
                         use_external_data_format=True, nodes_to_quantize=nodes)
        return onnx.load(Path(tmp) / "q.onnx")


def q8_shared(src: Path) -> onnx.ModelProto:
    # uint8 weights: u8u8 products, which x86's AVX2 kernels (Node, native) do not saturate as u8s8
    model = q8_dynamic(src, True, only=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"),
                       weight_type="QUInt8")
    shared_uint8_table(model)
    replace_initializers(model, {w: fold_int8 for w in weight_names(model.graph)  # down_proj: int8 folded at load
                                 if w not in FACTORS and not w.startswith(TABLE) and not w.endswith("_quantized")})
    return model


def folded(src: Path, bits: int, table_bits: int = 8, four_bit=fold_int4) -> onnx.ModelProto:
    model = onnx.load(src)
    names = {n.input[1]: n.name for n in model.graph.node if n.op_type == "MatMul"}
    plan = {}
    for w in weight_names(model.graph):
        if w in FACTORS:
            continue
        eight = (table_bits == 8) if w == TABLE else (bits == 8 or any(b in names.get(w, "") for b in BODY_INT8_IN_INT4))
        plan[w] = fold_int8 if eight else (fold_int4 if w == TABLE else four_bit)
    replace_initializers(model, plan)
    if four_bit is dq_int4:  # blocked DequantizeLinear needs opset 21
        for o in model.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = max(o.version, 21)
        model.ir_version = max(model.ir_version, 10)
    return model


VARIANTS = {  # name -> (transformers.js dtype, builder)
    "q8_dynamic_pc": ("q8", lambda src: q8_dynamic(src, True)),
    "q8_dynamic_pt": ("q8", lambda src: q8_dynamic(src, False)),
    "q8_shared": ("q8", q8_shared),
    "w8_fold": ("q8", lambda src: folded(src, 8)),
    "w4_fold": ("q4", lambda src: folded(src, 4)),
    "w4_fold_t4": ("q4", lambda src: folded(src, 4, table_bits=4)),
    "q4_dq": ("q4", lambda src: folded(src, 4, four_bit=dq_int4)),
}


def write_folder(src: Path, out: Path, dtype: str, model: onnx.ModelProto) -> Path:
    """``src``'s tokenizer and config (``transformers.js_config.dtype`` set) plus ``model`` as
    ``onnx/model{suffix}.onnx`` with its data in ``model{suffix}.onnx_data``."""
    if out.exists():
        shutil.rmtree(out)
    (out / "onnx").mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["transformers.js_config"] = {**config.get("transformers.js_config", {}), "dtype": dtype,
                                        "use_external_data_format": True}
    config_text = json.dumps(config, indent=2) + "\n"  # the variant's own config, not a result
    (out / "config.json").write_text(config_text)
    name = f"model{SUFFIX[dtype]}"
    onnx.save_model(model, out / "onnx" / f"{name}.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
                    location=f"{name}.onnx_data", size_threshold=1024)
    return out


# --- inspection -----------------------------------------------------------------------------


def graph_file(folder: Path) -> Path:
    dtype = json.loads((folder / "config.json").read_text())["transformers.js_config"]["dtype"]
    return folder / "onnx" / f"model{SUFFIX[dtype]}.onnx"


def size_mb(folder: Path) -> float:
    path = graph_file(folder)
    return round(sum(p.stat().st_size for p in path.parent.glob(path.stem + ".onnx*")) / 1e6, 1)


def table_storage(model: onnx.ModelProto, vocab: int) -> list[dict]:
    """Every initializer with a vocabulary-sized axis of at least d·V/2 elements, with its readers."""
    out = []
    for i in model.graph.initializer:
        if vocab in i.dims and np.prod(i.dims) > vocab * 64:
            out.append({"name": i.name, "dims": list(i.dims), "dtype": TensorProto.DataType.Name(i.data_type),
                        "readers": [f"{n.op_type}:{n.name}" for n in consumers(model.graph, i.name)]})
    return out


def ort_optimized_ops(path: Path) -> dict[str, int]:
    """Operator counts after native onnxruntime's graph optimizations (level extended, CPU):
    shows what it folds at load and what it fuses (e.g. into ``MatMulNBits``)."""
    import onnxruntime as ort

    interesting = ("MatMul", "MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "MatMulNBits",
                   "DynamicQuantizeLinear", "DequantizeLinear", "Gather", "GatherBlockQuantized", "BitShift", "Cast")
    with tempfile.TemporaryDirectory(prefix="web-int8-opt-") as tmp:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        so.optimized_model_filepath = str(Path(tmp) / "opt.onnx")
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "opt.onnx_data")
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        nodes = onnx.load(Path(tmp) / "opt.onnx", load_external_data=False).graph.node
    counts = collections.Counter(n.op_type for n in nodes)
    return {k: counts[k] for k in interesting if counts[k]}


# --- measurement ----------------------------------------------------------------------------


def kl_stats(ref: list[np.ndarray], got: list[np.ndarray]) -> dict:
    """KL(ref ‖ got) per prompt position, pooled over prompts; same top-1 share."""
    kls, same = [], []
    for p, q in zip(ref, got):
        lp = p.astype(np.float64) - np.logaddexp.reduce(p.astype(np.float64), axis=1, keepdims=True)
        lq = q.astype(np.float64) - np.logaddexp.reduce(q.astype(np.float64), axis=1, keepdims=True)
        kls.append((np.exp(lp) * (lp - lq)).sum(1))
        same.append(p.argmax(1) == q.argmax(1))
    k = np.concatenate(kls)
    return {"kl_mean": round(float(k.mean()), 4), "kl_p99": round(float(np.percentile(k, 99)), 4),
            "same_top1": round(float(np.concatenate(same).mean()), 4)}


def run_client(client: str, folder: Path, prompts: list[list[int]], greedy: int):
    """One transformers.js run (a ``WebRun``), or the client's one-line error (a failure to load is a finding)."""
    from pit_deploy.runtime.web_clients import run_web_client

    try:
        return run_web_client(client, folder, prompts, greedy, threads=1)
    except Exception as e:  # noqa: BLE001
        return str(e)[:400]


def summarize(runs: list) -> dict:
    """The best load/prefill/decode over runs (each a mean over the prompts), the first run's tokens."""
    failed = [r for r in runs if isinstance(r, str)]
    if failed:
        return {"loads": False, "error": failed[0]}
    best = lambda key: round(min(getattr(r, key) for r in runs), 2)  # noqa: E731
    return {"loads": True, "dtype": runs[0].dtype, "load_ms": best("load_ms"), "prefill_ms": best("prefill_ms"),
            "decode_ms_per_token": best("decode_ms_per_token"),
            "decode_ms_per_token_runs": [round(r.decode_ms_per_token, 2) for r in runs],
            "greedy": runs[0].greedy}


KERNEL_JS = """
import * as ort from "%s";
import { readFileSync } from "node:fs";
ort.env.wasm.numThreads = 1;
ort.env.wasm.wasmPaths = "%s/";
const out = {};
for (const [name, K] of JSON.parse(process.argv[2])) {
  try {
    const s = await ort.InferenceSession.create(readFileSync(name), { executionProviders: ["wasm"] });
    const x = new ort.Tensor("float32", Float32Array.from({ length: K }, (_, i) => Math.sin(i)), [1, K]);
    for (let i = 0; i < 3; ++i) await s.run({ x });
    const t = [];
    for (let i = 0; i < 15; ++i) { const t0 = performance.now(); await s.run({ x }); t.push(performance.now() - t0); }
    out[name] = +t.sort((a, b) => a - b)[0].toFixed(3);
    await s.release();
  } catch (e) { out[name] = String(e).split("\\n")[0]; }
}
console.log(JSON.stringify(out));
"""


def wasm_kernels(shapes=((576, 49152), (576, 1536))) -> dict:
    """One [1, K] × [K, N] product per weight format, timed in onnxruntime-web's WASM build (in
    Node, 1 thread, the best of 15 calls after 3 warm-ups): which formats have a fast path."""
    import subprocess

    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    from pit_deploy.runtime.web_clients import web_dir

    rng = np.random.default_rng(0)
    mk = helper.make_node
    result = {}
    with tempfile.TemporaryDirectory(prefix="web-int8-kernels-") as tmp:
        jobs = []
        for K, N in shapes:
            W = (rng.standard_normal((K, N)) * 0.02).astype(np.float32)
            q, s, zp = uint8_columns(W)
            q8, s8 = int8_columns(W)
            dyn = [mk("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xzp"]), mk("Cast", ["i"], ["f"], to=TensorProto.FLOAT),
                   mk("Mul", ["xs", "s"], ["ss"]), mk("Mul", ["f", "ss"], ["y"])]
            matmul = [mk("MatMul", ["x", "W"], ["y"])]
            formats = {
                "fp32 MatMul": ([_t(W, "W")], matmul),
                "MatMulInteger u8u8 (uint8 weights, zero point per column)":
                    ([_t(q, "Wq"), _t(s, "s"), _t(zp, "zp")], dyn + [mk("MatMulInteger", ["xq", "Wq", "xzp", "zp"], ["i"])]),
                "MatMulInteger u8s8 (int8 weights)":
                    ([_t(q8, "Wq"), _t(s8, "s")], dyn + [mk("MatMulInteger", ["xq", "Wq", "xzp"], ["i"])]),
                "int8 Cast+Mul folded at load, fp32 MatMul": [*(lambda i, n: (i, n + matmul))(*fold_int8("W", W))],
                "int4 DequantizeLinear block 32 + MatMul": [*(lambda i, n: (i, n + matmul))(*dq_int4("W", W))],
            }
            fp32_path = f"{tmp}/{len(jobs)}.onnx"
            for label, (inits, nodes) in formats.items():
                graph = helper.make_graph(nodes, "k", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
                                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])], inits)
                model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
                path = f"{tmp}/{len(jobs)}.onnx"
                onnx.save(model, path)
                jobs.append((path, K, f"{label} {K}x{N}"))
            for acc in (0, 4):
                qz = MatMulNBitsQuantizer(onnx.load(fp32_path), block_size=32, is_symmetric=False, accuracy_level=acc)
                qz.process()
                path = f"{tmp}/{len(jobs)}.onnx"
                onnx.save(qz.model.model, path)
                jobs.append((path, K, f"MatMulNBits 4-bit block 32 accuracy_level {acc} {K}x{N}"))
        dist = web_dir() / "node_modules" / "onnxruntime-web" / "dist"
        (Path(tmp) / "k.mjs").write_text(KERNEL_JS % (dist / "ort.wasm.min.mjs", dist))
        proc = subprocess.run(["node", f"{tmp}/k.mjs", json.dumps([[p, k] for p, k, _ in jobs])],
                              capture_output=True, text=True, timeout=900)
        times = json.loads(proc.stdout.strip().splitlines()[-1])
        result = {label: times.get(path) for path, _, label in jobs}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, required=True, help="fp32 factorized folder (transformers.js layout)")
    parser.add_argument("--out", default=str(ROOT / "studies" / "results" / "web_int8.json"))
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "pit-web-variants", help="where the variant folders go")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    parser.add_argument("--greedy", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2, help="Chromium runs per variant (timings: the best)")
    parser.add_argument("--no-kernels", action="store_true", help="skip the WASM kernel timings")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    src = args.folder.resolve()
    fp32_graph = graph_file(src)
    tok = AutoTokenizer.from_pretrained(src)
    prompts = [tok(t)["input_ids"][:64] for t in TEXTS]
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]

    kernels = None
    if not args.no_kernels:
        kernels = wasm_kernels()
        print("wasm kernels (ms per call):", json.dumps(kernels, indent=1), flush=True)

    folders = {"fp32": (src, None)}
    for name in [v for v in args.variants.split(",") if v]:
        dtype, build = VARIANTS[name]
        start = time.perf_counter()
        model = build(fp32_graph)
        folders[name] = (write_folder(src, args.work / name, dtype, model), round(time.perf_counter() - start, 1))
        print(f"built {name} in {folders[name][1]} s", flush=True)
        del model

    # Chromium round-robin over the variants (fp32 first), so that a change in the machine's load
    # between variants shows up in every variant's runs rather than in one ratio
    runs = {name: {"chromium": [], "node": []} for name in folders}
    for rep in range(args.reps):
        for name, (folder, _) in folders.items():
            if rep and isinstance(runs[name]["chromium"][0], str):
                continue
            runs[name]["chromium"].append(run_client("chromium", folder, prompts, args.greedy))
            print(f"chromium run {rep + 1}/{args.reps} of {name}: "
                  f"{getattr(runs[name]['chromium'][-1], 'decode_ms_per_token', runs[name]['chromium'][-1])}", flush=True)
    for name, (folder, _) in folders.items():
        runs[name]["node"].append(run_client("node", folder, prompts, 8))

    rows = []
    for name, (folder, build_s) in folders.items():
        model = onnx.load(graph_file(folder), load_external_data=False)
        row = {"variant": name, "folder": str(folder), "build_s": build_s, "size_mb": size_mb(folder),
               "table": table_storage(model, vocab), "ort_cpu_ops_after_optimization": ort_optimized_ops(graph_file(folder))}
        for client in ("chromium", "node"):
            row[client] = summarize(runs[name][client])
            first, ref = runs[name][client][0], runs["fp32"][client][0]
            if name != "fp32" and not isinstance(first, str) and not isinstance(ref, str):
                row[client].update(kl_stats(ref.logits, first.logits))
                row[client]["greedy_same_prefix"] = [int(np.argmin(np.r_[np.equal(a, b), False]))
                                                     for a, b in zip(ref.greedy, first.greedy)]
        print(json.dumps({k: row[k] for k in ("variant", "size_mb", "build_s")} | {
            c: {k: v for k, v in row[c].items() if k != "greedy"} for c in ("chromium", "node")}), flush=True)
        rows.append(row)
    fp32_decode = rows[0]["chromium"].get("decode_ms_per_token")
    for row in rows:
        d = row["chromium"].get("decode_ms_per_token")
        row["chromium"]["decode_vs_fp32"] = round(d / fp32_decode, 3) if d and fp32_decode else None
    return write_result(args.out, {
        "question": "a quantized variant of the factorized ONNX decoder that loads and decodes fast in "
                    "onnxruntime-web's default WASM build through transformers.js",
        "model_folder": str(src), "prompts_tokens": [len(p) for p in prompts], "greedy_tokens": args.greedy,
        "threads": 1, "chromium_reps": args.reps, "kl": "KL(fp32 ‖ variant) of the prompt logits, same client, pooled over positions",
        "variants": rows,
        "wasm_kernels_ms": kernels,
        "wasm_kernels_how": "onnxruntime-web WASM in Node, 1 thread, [1, K] x [K, N], best of 15 calls",
    }, __file__, argv)


if __name__ == "__main__":
    raise SystemExit(main())

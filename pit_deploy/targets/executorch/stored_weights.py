"""The weight-level check of an ExecuTorch ``.pte`` (:mod:`pit_deploy.evaluate.weight_check`
compares what this module reads and pairs).

* **What is read** (:func:`pte_stored`, through ExecuTorch's own program reader): every
  quantized constant weight of every XNNPACK delegate (4-bit group-wise and 8-bit per-channel
  linears), located by the delegate graph (``backends/xnnpack/serialization/schema.fbs``,
  decompiled by ExecuTorch's bundled ``flatc``) and read unpacked from the program's named data
  or from the data file the manifest lists (``model.ptd``) (XNNPACK serializes weights unpacked,
  each under the sha256 of its bytes: 4-bit codes as nibbles ``q + 8`` with the even column low,
  grouped scales as bfloat16); and every quantized gather table (``embedding_byte``/``embedding_4bit``)
  from the program's constants. A GPTQ-rounded quantized head, and a gather sharing its codes, are
  checked against the digests the export records for them (``details.quantization.weight_codes``);
  an export made before those were recorded has them listed in the check's ``note`` as not
  covered, never counted as checked.
* **Pairing** (:func:`pte_pairing`): XNNPACK keeps no module names (each weight is a named-data
  entry under the sha256 of its bytes), so the delegates' linears are paired by program order:
  ``forward``'s quantized linears (delegate by delegate, node by node) cut into runs of the sizes
  of the model's groups, the linears one forward pass calls in order, those that read one input
  (``q``/``k``/``v``, ``gate``/``up``) one group; a program whose linears differ from the model's
  in number or shape at any position fails. Within a group, members of one shape are told apart
  by their role, what their output flows into before it meets another linear's
  (:class:`_RoleTrace`: through an activation or a norm; added to a transform of itself, a rotary
  embedding; neither), followed through the program's delegates and kernels (:func:`_plan_roles`)
  and through the reference's forward pass (:func:`_body_linears`). Members of one shape and one
  role (``q`` and ``k`` of one shape), or whose roles in the program are not the model's (named
  in the check's ``note``), are paired by their recorded GPTQ codes, else by value. Their
  reference is the model the body was rounded from (after ``rotate_residual`` where the scheme
  rotates it). The head (the one quantized linear with ``V`` rows) and the gather tables (the
  program's quantized embedding operators) are paired by role: the token table's forms, and with
  a quantized head its table ``Y = Z T S⁻ᵀ`` (:func:`pte_table_candidates`). What the pairing
  trusts: the program's node order and graph; a program whose computation was reordered with its
  weights is beyond the weight level, and the KL bounds judge it.
* **Its own rounding.** A 4-bit grouped tensor off the generic grid passes when it is torchao's
  HQQ scale-only rounding of the reference (the exporter's own; its least-squares scale may clip
  a group's largest weight): each code within one of torchao's, each scale torchao's to bfloat16
  rounding (:func:`torchao_hqq_rounding`).
"""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ...evaluate.weight_check import Pairing, ReferenceWeights, Stored, WeightCheck, artifact_mode, \
    best_candidate, compare, from_codes, holds_codes, recorded_codes, section, table_candidates
from ...io.weight_codes import CODES_FIELD, unpack_codes


#: XNNPACK's datatypes of a quantized constant weight: ``(bits, zero point)``. ExecuTorch's XNNPACK
#: serializer stores 4-bit codes ``q ∈ [−8, 7]`` as unsigned nibbles ``q + 8``, two a byte, the even
#: column in the low nibble (``convert_to_qc4w``), and its runtime defines them with zero point 8
#: (``XNNCompiler.cpp``); 8-bit codes are signed bytes without a zero point
XNN_WEIGHTS = {"xnn_datatype_qcint8": (8, 0), "xnn_datatype_qcint4": (4, 8), "xnn_datatype_qbint4": (4, 8)}
#: the quantized gathers of a ``.pte`` (outside the delegate): bits of the codes of each op
PTE_TABLE_OPS = {"quantized_decomposed::embedding_byte": 8, "quantized_decomposed::embedding_4bit": 4}
#: ExecuTorch's scalar types of the tables' tensors: numpy dtype by ``ScalarType`` value
_ET_DTYPES = {0: np.uint8, 1: np.int8, 5: np.float16, 6: np.float32, 15: "bfloat16"}

#: the roles a linear's output may have in the graph that computes with it (:class:`_RoleTrace`):
#: it goes through an operator that is not linear in it (an activation: ``gate``; a norm: the
#: ``q``/``k`` of Qwen3) before it meets another linear's output; else it is added to a transform
#: of itself (a rotary embedding: ``q``, ``k``); else neither (``v``, ``up``)
NONLINEAR, SELF_SUM, PLAIN = "nonlinear", "added to a transform of itself", "plain"
#: operators not linear in their input, by name in :func:`_op_kind`'s spelling: XNNPACK's nodes
#: (``XNNSigmoid`` → ``sigmoid``) and aten's operators (``aten.silu`` → ``silu``)
_NONLINEAR_OPS = frozenset({
    "sigmoid", "silu", "tanh", "gelu", "elu", "selu", "celu", "relu", "relu6", "leakyrelu", "prelu", "hardswish",
    "hardsigmoid", "hardtanh", "mish", "softplus", "softmax", "logsoftmax", "exp", "exp2", "expm1", "log", "log1p",
    "log2", "rsqrt", "reciprocalsquareroot", "reciprocal", "sqrt", "squareroot", "square", "pow", "abs", "sin",
    "cos", "erf", "clamp", "clampmin", "clampmax", "floor", "ceil", "ceiling", "round", "sign"})
#: products (and anything named for attention): not linear in a tensor that both factors come from
_PRODUCT_OPS = frozenset({"mul", "multiply", "div", "divide", "mm", "bmm", "matmul", "baddbmm", "addmm",
                          "batchmatrixmultiply", "maximum", "minimum"})
#: sums and concatenations: a tensor that two of their terms come from is added to a transform of itself
_SUM_OPS = frozenset({"add", "sub", "rsub", "subtract", "cat", "concatenate", "stack"})


def _op_kind(name: str) -> str | None:
    """How the operator ``name`` (an XNNPACK node type, ``XNNMultiply``; an aten operator,
    ``add_``) treats the tensors it reads: ``"nonlinear"``, ``"product"``, ``"sum"``, or ``None``
    (linear in each: a reshape, a transpose, a slice, a type conversion, a mean)."""
    name = re.sub(r"^xnn|\d+$", "", name.lower()).replace("_", "")
    if name in _NONLINEAR_OPS:
        return "nonlinear"
    if name in _PRODUCT_OPS or "attention" in name:
        return "product"
    return "sum" if name in _SUM_OPS else None


class _RoleTrace:
    """The roles of several linears in one graph: each linear's output followed through the
    operators that read it, in the order they run, until it meets another linear's output (the
    product of ``gate`` and ``up``, the attention of ``q``, ``k`` and ``v``) or leaves the graph. A
    product of two tensors that both come from the one linear, or an operator not linear in its
    input, makes it :data:`NONLINEAR`; else a sum of two such tensors :data:`SELF_SUM`; else it
    is :data:`PLAIN`. Other operators — and a product or sum with a tensor no linear computes (a
    norm's gain, a rotary embedding's ``cos``) — pass it on. The same rules for a program's
    delegates and kernels (:func:`_plan_roles`) and for the reference model's forward pass
    (:func:`_body_linears`), so that a program's linear and the model's are given one role for
    one computation, without a table of module names."""

    def __init__(self) -> None:
        self.source: dict[Any, Any] = {}  # a tensor (its key) -> the linear it comes from; None: several
        self.kinds: dict[Any, set[str]] = {}

    def linear(self, key: Any, outputs: list[Any]) -> None:
        self.kinds.setdefault(key, set())
        for out in outputs:
            self.source[out] = key

    def op(self, name: str, inputs: list[Any], outputs: list[Any]) -> bool:
        """Follow one operator; whether it read a tensor that comes from a linear."""
        found = [self.source[i] for i in inputs if i in self.source]
        if not found:
            return False
        first = found[0]
        if first is None or any(f != first for f in found):  # met another linear's output
            for out in outputs:
                self.source[out] = None
            return True
        kind = _op_kind(name)
        if kind == "nonlinear" or (kind == "product" and len(found) > 1):
            self.kinds[first].add(NONLINEAR)
        elif kind == "sum" and len(found) > 1:
            self.kinds[first].add(SELF_SUM)
        for out in outputs:
            self.source[out] = first
        return True

    def roles(self) -> dict[Any, str]:
        return {key: NONLINEAR if NONLINEAR in kinds else SELF_SUM if SELF_SUM in kinds else PLAIN
                for key, kinds in self.kinds.items()}


def _bf16(raw: bytes) -> np.ndarray:
    """bfloat16 bytes as float32 values (exact: a bfloat16 is the upper half of a float32)."""
    return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)


def _scales(raw: bytes, count: int) -> np.ndarray:
    """``count`` scales stored as bfloat16 (grouped weights) or float32 (per-channel ones)."""
    if len(raw) == 2 * count:
        return _bf16(raw)
    if len(raw) == 4 * count:
        return np.frombuffer(raw, dtype="<f4").astype(np.float32)
    raise ValueError(f"{len(raw)} bytes for {count} scales")


def _xnn_graph(blob: bytes) -> dict[str, Any]:
    """An XNNPACK delegate blob's graph as JSON (``XNNHeader``, then a flatbuffer of
    ``schema.fbs``), decompiled by ExecuTorch's bundled ``flatc``."""
    import importlib.resources
    import json
    import tempfile

    from executorch.backends.xnnpack.serialization.xnnpack_graph_serialize import XNNHeader
    from executorch.exir._serialize._flatbuffer import _flatc_decompile

    header = XNNHeader.from_bytes(blob[:XNNHeader.EXPECTED_LENGTH])
    schema = importlib.resources.files("executorch.backends.xnnpack.serialization") / "schema.fbs"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "schema.fbs").write_bytes(schema.read_bytes())
        (Path(tmp) / "graph.bin").write_bytes(blob[header.flatbuffer_offset:header.flatbuffer_offset
                                                  + header.flatbuffer_size])
        try:
            _flatc_decompile(tmp, str(Path(tmp) / "schema.fbs"), str(Path(tmp) / "graph.bin"), ["--raw-binary"])
        except (OSError, subprocess.CalledProcessError) as exc:
            raise ValueError(f"flatc could not read an XNNPACK delegate's graph: {exc}") from exc
        graph = json.loads((Path(tmp) / "graph.json").read_text())
    graph["_constants"] = blob[header.constant_data_offset:header.constant_data_offset + header.constant_data_size]
    return graph


class _PteData:
    """The stored bytes of a ``.pte`` and of its named data file (``model.ptd``) if it has one."""

    def __init__(self, path: Path, data_files: list[Path] | None = None):
        from executorch.exir._serialize._program import deserialize_pte_binary

        pte = deserialize_pte_binary(Path(path).read_bytes())
        self.program = pte.program
        self.named: dict[str, bytes] = {}
        if pte.named_data is not None:
            self.named.update({key: bytes(pte.named_data.buffers[entry.buffer_index])
                               for key, entry in pte.named_data.pte_data.items()})
        self.external: dict[str, bytes] = {}
        # the data files the artifact lists (what its runtime is given), else every one beside it
        ptds = sorted(Path(path).parent.glob("*.ptd")) if data_files is None else list(data_files)
        if ptds:
            from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer
        for ptd in ptds:
            payload = FlatTensorSerializer().deserialize(ptd.read_bytes())  # it reads bytes(blob)
            self.external.update({key: bytes(payload.buffers[entry.buffer_index])
                                  for key, entry in payload.named_data.items()})

    def key(self, key: str) -> bytes | None:
        return self.named.get(key, self.external.get(key))

    def constant(self, tensor: Any) -> bytes | None:
        """A program constant's bytes: its constant buffer, or its named entry in the data file."""
        info = getattr(tensor, "extra_tensor_info", None)
        if info is not None and int(info.location) == 1:  # TensorDataLocation.EXTERNAL
            return self.external.get(info.fully_qualified_name or "")
        index = int(tensor.data_buffer_idx)
        if index <= 0 or index >= len(self.program.constant_buffer):
            return None
        return bytes(self.program.constant_buffer[index].storage)


def _quantized_weights(graph: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """An XNNPACK delegate's quantized constant weights: each value's ``xvalue_union`` by its id."""
    values = {}
    for value in graph.get("xvalues") or []:
        if value.get("xvalue_union_type") != "XNNQuantizedTensorValue":
            continue
        tensor = value["xvalue_union"]["tensor_value"]
        if int(tensor.get("constant_buffer_idx") or 0) and tensor.get("datatype") in XNN_WEIGHTS:
            values[int(tensor.get("id_out", -1))] = value["xvalue_union"]
    return values


def _plan_roles(plan: Any, graphs: dict[int, dict[str, Any]]) -> dict[int, dict[int, str]]:
    """The role (:class:`_RoleTrace`) of each quantized linear of one method of a program, by
    delegate index and the index of the linear's node in the delegate's graph (``graphs``: the
    method's XNNPACK delegates' graphs, by delegate index), in node order. Each linear's output
    is followed through the method's instructions in order: through each XNNPACK delegate's nodes
    (``schema.fbs``: a node writes its fields ``output…_id`` and reads its other fields ``…_id``;
    a delegate call's arguments are the values of the graph's ``input_ids``, then of its
    ``output_ids``), and through the kernels between delegates (the slices of a rotary
    embedding, the cache update, an attention outside the delegates: each kernel's last argument
    is what it writes, ExecuTorch's out-variant convention, its other arguments what it reads)."""
    trace = _RoleTrace()

    def tensors(index: int) -> list[tuple[str, int]]:
        value = plan.values[index].val if 0 <= index < len(plan.values) else None
        listed = "TensorList" in type(value).__name__  # a list of tensors: their value indices
        indices = [int(i) for i in value.items] if listed else [index]
        return [("value", i) for i in indices if i >= 0]

    for chain in plan.chains:
        for instruction in chain.instructions:
            call = instruction.instr_args
            kind = type(call).__name__
            if kind == "DelegateCall" and int(call.delegate_index) in graphs:
                j = int(call.delegate_index)
                graph, args = graphs[j], [int(a) for a in call.args]
                inputs, outputs = ([int(i) for i in graph.get(key) or []] for key in ("input_ids", "output_ids"))
                called = len(args) == len(inputs) + len(outputs)
                for i, arg in zip(inputs, args if called else []):
                    trace.op("", [("value", arg)], [(j, i)])
                weights = set(_quantized_weights(graph))
                for index, node in enumerate(graph.get("xnodes") or []):
                    fields = node.get("xnode_union")
                    if not isinstance(fields, dict):
                        continue
                    ids = {f: int(v) for f, v in fields.items() if f.endswith("_id") and isinstance(v, int)}
                    written = [(j, v) for f, v in ids.items() if f.startswith("output")]
                    if ids.get("filter_id") in weights:
                        trace.linear((j, index), written)
                    else:
                        trace.op(str(node.get("xnode_union_type") or ""),
                                 [(j, v) for f, v in ids.items() if not f.startswith("output")], written)
                for o, arg in zip(outputs, args[len(inputs):] if called else []):
                    trace.op("", [(j, o)], [("value", arg)])
            elif kind == "KernelCall" and len(call.args):
                args = [int(a) for a in call.args]
                read = [t for a in args[:-1] if a != args[-1] for t in tensors(a)]
                trace.op(str(plan.operators[call.op_index].name).split("::")[-1], read, tensors(args[-1]))
            elif kind == "MoveCall":
                trace.op("", tensors(int(call.move_from)), tensors(int(call.move_to)))
    roles: dict[int, dict[int, str]] = {}
    for (j, index), role in trace.roles().items():
        roles.setdefault(j, {})[index] = role
    return roles


def _delegate_weights(graph: dict[str, Any], data: _PteData, where: str,
                      elsewhere: set[str], skipped: list[str], roles: dict[int, str] | None = None) -> list[Stored]:
    """The quantized constant weights of one XNNPACK delegate, in the order of the nodes that read
    them (a fully-connected node's ``filter_id``: the program's order), each with its node's role
    (``roles``, by node index: :func:`_plan_roles`), then any other; a weight whose named-data
    entry another method read already (the head, in ``forward`` and ``head``) is skipped, one
    read twice within a method is read twice."""
    constants = graph.get("constant_data") or []

    def raw(index: int) -> tuple[str, bytes | None]:
        entry = constants[index]
        key = entry.get("named_key") or ""
        if key:
            return key, data.key(key)
        offset, size = int(entry["offset"]), int(entry["size"])
        return f"{where}@{offset}", graph["_constants"][offset:offset + size]

    values = _quantized_weights(graph)
    nodes = graph.get("xnodes") or []
    order: list[tuple[int, str | None]] = []
    for index, node in enumerate(nodes):
        fields = node.get("xnode_union")
        if isinstance(fields, dict) and int(fields.get("filter_id", -1)) in values:
            order.append((int(fields["filter_id"]), (roles or {}).get(index)))
    order += [(i, None) for i in values if all(i != ident for ident, _ in order)]

    out = []
    for ident, role in order:
        quantized = values[ident]
        tensor, params = quantized["tensor_value"], quantized.get("quant_params") or {}
        key, codes = raw(int(tensor["constant_buffer_idx"]))
        if key in elsewhere:
            continue
        name = f"{where}/{key[:16]}"
        dims = [int(x) for x in tensor.get("dims") or []]
        if len(dims) != 2 or int(params.get("channel_dim", 0)) != 0 or codes is None:
            skipped.append(f"{name} {tuple(dims)}")
            continue
        rows, cols = dims
        bits, zero = XNN_WEIGHTS[tensor["datatype"]]
        count = int(params.get("num_scales") or 0)
        _, scale_raw = raw(int(params.get("scale_buffer_idx") or 0))
        if scale_raw is None or not count:
            skipped.append(f"{name} {tuple(dims)}")
            continue
        scales = _scales(scale_raw, count).reshape(rows, -1)
        block = cols // scales.shape[1]
        if bits == 4:
            q = unpack_codes(np.frombuffer(codes, np.uint8), 4, rows, scales.shape[1], block).reshape(rows, cols)
        else:
            q = np.frombuffer(codes, np.int8).astype(np.int16).reshape(rows, cols)
        q -= zero  # int16 (every code minus its zero point fits): the digest reads it as it is
        stored = from_codes(name, q, scales, bits, block, cols)
        stored.places, stored.role = (where, key), role
        out.append(stored)
    return out


def _array(raw: bytes, tensor: Any) -> np.ndarray:
    kind = _ET_DTYPES.get(int(tensor.scalar_type))
    sizes = [int(s) for s in tensor.sizes]
    count = int(np.prod(sizes)) if sizes else 1
    if kind == "bfloat16":
        return _bf16(raw[:2 * count]).reshape(sizes)
    if kind is None:
        raise ValueError(f"scalar type {tensor.scalar_type}")
    dtype = np.dtype(kind)
    return np.frombuffer(raw[:dtype.itemsize * count], dtype=dtype).reshape(sizes)


def _table_weights(plan: Any, data: _PteData, seen: set[str], skipped: list[str]) -> list[Stored]:
    """The quantized gathers (``embedding_byte``/``embedding_4bit``) of one method of the program."""
    out = []
    for chain in plan.chains:
        for instruction in chain.instructions:
            call = instruction.instr_args
            if not hasattr(call, "op_index") or not hasattr(call, "args"):
                continue
            op = plan.operators[call.op_index]
            bits = PTE_TABLE_OPS.get(f"{op.name}")
            if bits is None:
                continue
            weight, scales, zero = (plan.values[i].val for i in call.args[:3])
            name = f"{plan.name}/{op.name.split('::')[-1]}"
            raw_w, raw_s = data.constant(weight), data.constant(scales)
            raw_z = data.constant(zero) if hasattr(zero, "sizes") else b""
            if raw_w is None or raw_s is None or raw_z is None:
                skipped.append(f"{name} (its constants are not in the program or its data file)")
                continue
            ident = hashlib.sha256(raw_w + b"|" + raw_s + b"|" + raw_z).hexdigest()
            if ident in seen:  # one table read by two methods (embed and forward)
                continue
            seen.add(ident)
            codes = _array(raw_w, weight)
            s = _array(raw_s, scales).astype(np.float32)
            rows = codes.shape[0]
            s = s.reshape(rows, -1)
            if bits == 4:  # the even column in the high nibble, codes q + 8 (the op's reference kernel)
                packed = codes.astype(np.uint8)
                q = np.empty((rows, packed.shape[1] * 2), np.int16)  # int16: half an int32 table
                q[:, 0::2], q[:, 1::2] = packed >> 4, packed & 0x0F
                q -= 8
            else:
                q = codes.astype(np.int16)
            block = q.shape[1] // s.shape[1]
            if raw_z:
                q -= np.repeat(_array(raw_z, zero).astype(np.int16).reshape(rows, -1), block, axis=1)
            stored = from_codes(name, q, s, bits, block, q.shape[1])
            stored.places, stored.gather = (name,), True
            out.append(stored)
    return out


def pte_stored(path: Path, skipped: list[str] | None = None, data_files: list[Path] | None = None) -> list[Stored]:
    """Every quantized constant weight of every XNNPACK delegate of the ``.pte`` at ``path``
    (4-bit group-wise and 8-bit per-channel linears, read from the program's named data or from
    the data files ``data_files``, by default every ``.ptd`` beside it) and every quantized
    gather table of the program, dequantized to ``(rows, K)`` with their codes and scales, in
    program order (method by method, delegate by delegate, node by node: what
    :func:`check_pte_weights` pairs the body by). A tensor that two methods read (the head's
    named-data entry in ``forward`` and ``head``, one table in ``embed`` and ``forward``) is read
    once. What cannot be read is appended to ``skipped``."""
    data = _PteData(Path(path), data_files)
    program = data.program
    skipped = [] if skipped is None else skipped
    tables: set[str] = set()
    read_by: dict[str, str] = {}  # named-data key -> the method that read it first
    out: list[Stored] = []
    for plan in program.execution_plan:
        elsewhere = {key for key, method in read_by.items() if method != plan.name}
        graphs = {j: _xnn_graph(bytes(program.backend_delegate_data[delegate.processed.index].data))
                  for j, delegate in enumerate(plan.delegates) if "xnnpack" in delegate.id.lower()}
        try:
            roles = _plan_roles(plan, graphs)
        except (IndexError, AttributeError, TypeError, ValueError):
            # a program laid out in a way this reader does not follow: its linears get no role and
            # are paired by value within their groups, as pte_pairing does for unknown roles
            roles = {}
        for j, graph in graphs.items():
            found = _delegate_weights(graph, data, f"{plan.name}/xnnpack{j}", elsewhere, skipped, roles.get(j))
            for stored in found:
                read_by.setdefault(stored.places[1], plan.name)
            out += found
        out += _table_weights(plan, data, tables, skipped)
    return out


def pte_table_candidates(prepared: Any, details: dict[str, Any], vocab: int) -> list[tuple[str, np.ndarray]]:
    """The forms ``(V, d)`` a ``.pte``'s quantized head and gather tables may hold: the prepared
    reference's token table (:func:`table_candidates`); with ``rotate_residual`` the same of the
    rotated model the body was rounded from (:func:`pit_deploy.exporters.residual_rotation.rotate_residual`);
    with a quantized head the rotated table ``Y = Z T S⁻ᵀ`` it and its gather read
    (:class:`pit_deploy.targets.executorch.head.RotatedQuantizedHead`), with each nibble pair
    swapped where a 4-bit gather shares its codes
    (:func:`pit_deploy.targets.executorch.token_table.nibble_pair_swap`)."""
    from ...exporters.passes import FACTORS_ATTR
    from ...exporters.residual_rotation import rotate_residual, rotation_blocker
    from .head import head_factors, rotated_table
    from .token_table import nibble_pair_swap

    scheme, quant = section(details, "scheme"), section(details, "quantization")
    found = table_candidates(prepared, vocab, False)
    if scheme.get("rotate_residual") and rotation_blocker(prepared) is None:
        found += [("rotated " + n, a) for n, a in table_candidates(rotate_residual(prepared), vocab, False)]
    factors = getattr(prepared, FACTORS_ATTR, None)
    head_bits = int(quant.get("head_bits") or 0)
    if head_bits and factors is not None:
        _, table_map = head_factors(factors.T.detach())
        y = rotated_table(factors.Zt.detach(), table_map).numpy()
        found.append(("Y = Z T S⁻ᵀ", y.astype(np.float32)))
        if quant.get("shared_table") and int(scheme.get("table_bits") or 8) == 4:
            swap = nibble_pair_swap(y.shape[1]).numpy()
            found.append(("Y = Z T S⁻ᵀ, nibble pairs swapped", np.ascontiguousarray(y[:, swap], np.float32)))
    return found


def _body_linears(model: Any) -> tuple[list[list[str]], dict[str, str]]:
    """The module paths of ``model``'s linears that a ``.pte`` quantizes (every ``nn.Linear`` but
    the head: :func:`pit_deploy.targets.executorch.export.quantize_linears`), as the groups a
    program computes in a fixed order: in the order one forward pass calls them, linears that
    read the very same input (``q``/``k``/``v``, ``gate``/``up``) one group. A program may compute
    the members of a group in any order (none depends on another: the partitioner is free to
    place them), never a later group before an earlier one. And each linear's role in that
    forward pass (:class:`_RoleTrace`, over the aten operators it runs, a linear's own operators
    left out), by module path: what a program's node must do with its output to be that linear."""
    import torch
    from torch import nn
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    head = model.get_output_embeddings()
    paths = {module: name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and module is not head}
    calls: list[tuple[str, int]] = []
    trace = _RoleTrace()
    alive: list[Any] = []  # every tensor the trace follows, held so that no other tensor takes its id
    inside = [0]  # within a linear's own forward

    def tensors(tree: Any) -> list[Any]:
        return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]

    class Follow(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not inside[0]:
                written = tensors(out)
                if trace.op(func.overloadpacket.__name__, [id(t) for t in tensors((args, kwargs))],
                            [id(t) for t in written]):
                    alive.extend(written)
            return out

    def enter(module: Any, args: Any) -> None:
        inside[0] += 1

    def leave(module: Any, args: Any, out: Any) -> None:
        inside[0] -= 1
        calls.append((paths[module], id(args[0])))
        if paths[module] not in trace.kinds:  # a linear called twice: its first call
            trace.linear(paths[module], [id(t) for t in tensors(out)])
            alive.extend(tensors(out))

    hooks = [hook for module in paths for hook in (module.register_forward_pre_hook(enter),
                                                   module.register_forward_hook(leave))]
    try:
        with torch.no_grad(), Follow():
            model(input_ids=torch.tensor([[1, 2, 3]]))
    finally:
        for hook in hooks:
            hook.remove()
    groups: list[list[str]] = []
    inputs: list[int] = []
    grouped: set[str] = set()
    for path, source in calls:
        if path in grouped:  # a linear called twice is placed where it is first called
            continue
        grouped.add(path)
        if inputs and inputs[-1] == source:
            groups[-1].append(path)
        else:
            groups.append([path])
            inputs.append(source)
    missing = [p for p in paths.values() if p not in grouped]
    return groups + [[p] for p in missing], trace.roles()


def pte_pairing(stored: list[Stored], reference: ReferenceWeights, body: list[list[str]],
                vocab: int, details: Any = None, roles: dict[str, str] | None = None,
                by_value: list[str] | None = None) -> Callable[[Stored], Pairing | str]:
    """How a ``.pte``'s tensors find their reference weights. XNNPACK keeps no module names: its
    delegates' weights are named-data entries under the sha256 of their bytes. So the quantized
    linears of the delegates that are not the head (``V`` rows) are paired by program order
    (:func:`pte_stored`'s order: ``forward``'s delegates, each node by node) with ``body``'s
    groups (:func:`_body_linears`): the program's linears, cut into runs of the groups' sizes,
    must be the groups in order, so a weight moved to another layer or another stage of a layer
    fails. Within a group, members of one shape (``gate``/``up``; ``k``/``v``; ``q``/``k``/``v``
    without grouped attention) may stand in any order (Gemma's program computes ``k`` before
    ``q``), so they are told apart by their role: the model's (``roles``, by module path,
    :func:`_body_linears`) and each stored tensor's in the program (:attr:`Stored.role`,
    :func:`_plan_roles`). ``gate``'s output goes through the activation, ``up``'s straight into
    the product; ``k``'s through the rotary embedding (Qwen3's also through its norm), ``v``'s
    through neither. A tensor is the member of its own role, so ``gate`` and ``up`` swapped, or
    ``k`` and ``v``, fail. What roles cannot tell apart is paired by value, as before: among
    members of one shape and one role (``q`` and ``k`` of one shape: both rotated) a tensor is
    the member whose recorded calibrated codes it holds, else the member closest in value; and
    so are all the members of one shape when their roles in the program are not the model's (a
    program computing them through operators the trace does not follow), those members appended
    to ``by_value`` (``model.layers.0.self_attn.{k_proj,v_proj}``). Each member is paired once.
    The head (the one quantized linear with ``V`` rows) and the gather tables (the program's
    quantized embedding operators) are paired by their role in the model."""
    from collections import Counter

    linears = [s for s in stored if not s.gather and s.shape[0] != vocab]
    order = {id(s): i for i, s in enumerate(linears)}
    flat = [path for group in body for path in group]
    member_of: dict[int, list[str]] = {}
    by_role: set[int] = set()  # stored tensors whose roles, among their group's of their shape, are the model's
    at = 0
    for group in body:
        run = linears[at:at + len(group)]
        for s in run:
            member_of[id(s)] = group
        at += len(group)
        if roles is None:
            continue
        shapes = {path: (None if hit is None else hit.candidates[0][1].shape)
                  for path, hit in ((path, reference.linear(path)) for path in group)}
        for shape in dict.fromkeys(shapes.values()):
            members = [path for path in group if shapes[path] == shape]
            if shape is None or len(members) < 2:
                continue
            held = [s for s in run if s.shape == shape]
            if None not in [roles.get(path) for path in members] and \
                    Counter(roles.get(path) for path in members) == Counter(s.role for s in held):
                by_role.update(id(s) for s in held)
            elif by_value is not None:
                parent = {path.rpartition(".")[0] for path in members}
                by_value.append(f"{parent.pop()}.{{{','.join(p.rpartition('.')[2] for p in members)}}}"
                                if len(parent) == 1 else "/".join(members))
    recorded = recorded_codes(details)

    def pair(s: Stored) -> Pairing | str:
        if s.gather:
            return reference.table(True, ("token_table",))
        if s.shape[0] == vocab:
            return reference.table(False, ("head",), once=True)
        i = order[id(s)]
        if len(linears) != len(flat):
            return (f"the program holds {len(linears)} quantized linears besides its head, the reference model "
                    f"{len(flat)}; the program's weights cannot be paired with the model's in order")
        group = member_of[id(s)]
        found = [(path, reference.linear(path)) for path in group]
        fits = [(path, hit) for path, hit in found if hit is not None
                and hit.candidates[0][1].shape == s.shape]
        if not fits:
            shapes = ", ".join(str(tuple(hit.candidates[0][1].shape)) for _, hit in found if hit is not None)
            return (f"the program's linear #{i + 1} has shape {s.shape}, but the reference model "
                    f"computes {', '.join(group)} there ({shapes}): the program does not compute the model's "
                    "linears in its order")
        if id(s) in by_role and roles is not None:
            fits = [(path, hit) for path, hit in fits if roles.get(path) == s.role]
        if len(fits) == 1:
            return fits[0][1]
        held = [hit for _, hit in fits if any(holds_codes(s, recorded, names) for names in hit.codes)]
        if held:
            return held[0]
        pick = best_candidate(s, [(path, hit.candidates[0][1]) for path, hit in fits])
        return next(hit for path, hit in fits if pick is not None and path == pick[0])

    return pair


def check_pte_weights(directory: Path, art: Any, reference: Any) -> WeightCheck:
    """An ExecuTorch ``.pte`` artifact: its delegates' quantized linears and its quantized gather
    tables (:func:`pte_stored`) against the weights of the reference as the exporter prepared it,
    paired by :func:`pte_pairing`."""
    from ...exporters.passes import prepare
    from ...exporters.residual_rotation import rotate_residual, rotation_blocker
    from .. import get_target

    folder = directory / art.path
    skipped: list[str] = []
    listed = [directory / rel for rel in art.files if rel.endswith(".ptd")]
    stored = pte_stored(folder / get_target(art.target).primary_path(folder), skipped, listed)
    details = art.details if isinstance(art.details, dict) else {}
    vocab = int(art.shapes["vocab_size"])
    left = _uncovered_head(stored, details, vocab)
    covered = [s for s in stored if all(s is not x for x in left)]
    notes = []
    if left:
        notes.append("not covered: " + ", ".join(f"{s.name} {s.shape}" for s in left)
                     + " (the quantized head, and a gather that reads its codes: rounded by GPTQ at export, "
                     "and their codes match no digest the manifest records; re-export to record them; "
                     "KL and interface bounds only)")
    if skipped:
        notes.append("not read: " + "; ".join(skipped))
    if left and not covered:
        # every quantized tensor is one of those not covered (an older GPT-2 export: torchao leaves
        # its Conv1D body float32, so the head and its gather are all there is): not checked, never
        # passed or failed
        return WeightCheck(checked=False, note="not checked at the weight level: " + "; ".join(notes))
    prepared = prepare(reference, artifact_mode(art))
    rotated = section(details, "scheme").get("rotate_residual") and rotation_blocker(prepared) is None
    body_model = rotate_residual(prepared) if rotated else prepared
    weights = ReferenceWeights(body_model, vocab, lambda: pte_table_candidates(prepared, details, vocab))
    groups, roles = _body_linears(body_model)
    by_value: list[str] = []
    pair = pte_pairing(stored, weights, groups, vocab, details, roles, by_value)
    if by_value:
        notes.append(f"paired by value within {by_value[0]}" + (f" and {len(by_value) - 1} more groups"
                     if len(by_value) > 1 else "") + " (their roles in the program are not the model's: a swap "
                     "within such a group is left to the KL bounds)")
    result = compare(covered, pair, details, torchao_hqq_rounding, complete=not skipped)
    result.note = "; ".join(notes)
    return result


def torchao_hqq_rounding(stored: Stored, reference: np.ndarray) -> bool:
    """Whether a ``.pte``'s 4-bit grouped tensor holds torchao's HQQ scale-only rounding of
    ``reference`` (how the exporter rounds its 4-bit linears to nearest,
    :func:`pit_deploy.targets.executorch.head.xnnpack_linear_config`): each scale torchao's to bfloat16
    rounding (XNNPACK stores them so) and each code within one of torchao's. HQQ picks the scale
    that minimizes the group's squared error, which may clip a group's largest weight past one
    step of the widest grid; random codes or scales are neither."""
    if stored.bits != 4 or stored.qz is None or stored.scales is None or stored.block >= stored.qz.shape[1]:
        return False
    import torch
    from torchao.quantization.quant_primitives import _choose_qparams_and_quantize_scale_only_hqq

    codes, scales = _choose_qparams_and_quantize_scale_only_hqq(
        torch.from_numpy(np.ascontiguousarray(reference, dtype=np.float32)), [1, stored.block], -8, 7)
    scales = scales.to(torch.bfloat16).to(torch.float32).numpy()
    return bool(np.all(np.abs(stored.scales - scales) <= 2.0 ** -7 * np.abs(scales))
                and np.all(np.abs(stored.qz - codes.numpy()) <= 1))


def _uncovered_head(stored: list[Stored], details: dict[str, Any], vocab: int) -> list[Stored]:
    """The tensors of a GPTQ-rounded quantized head (its ``V×d`` linear, and a gather sharing its
    codes) whose codes match no digest the export recorded (an export from before the head's
    digests were recorded: :func:`pit_deploy.targets.executorch.token_table.quantize_token_table`):
    GPTQ moves codes past one grid step on purpose, so the grid comparison does not apply to them
    (:meth:`pit_deploy.targets.executorch.head.RotatedQuantizedHead.round_calibrated`)."""
    scheme, quant = section(details, "scheme"), section(details, "quantization")
    if scheme.get("rounding") != "gptq" or not int(quant.get("head_bits") or 0):
        return []
    if "head" in section(section(quant, CODES_FIELD), "tensors"):
        return []  # recorded: a head that matches no digest is compared on the grid, and fails
    recorded = recorded_codes(details)
    rows = [s for s in stored if s.shape[0] == vocab and not s.gather]
    tables = [s for s in stored if s.shape[0] == vocab and s.gather]
    left = [s for s in rows if not holds_codes(s, recorded, ("head",))]
    if left and quant.get("shared_table"):
        left += [s for s in tables if not holds_codes(s, recorded, ("token_table",))]
    return left

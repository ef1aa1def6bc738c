"""The weight-level check of quantized artifacts (:mod:`pit_deploy.evaluate.weight_check`, each
format's reader beside it or in its target's folder), and the checks that follow from the scheme
and target rather than from manifest fields.

Random bytes in the body weights of a quantized artifact (digests re-recorded, so only the
numbers can give it away) fail ``verify`` with exit 1, naming the first corrupted tensor, however
little the model's output depends on its body; honest exports pass.

Cost: every quantized scheme of the ``onnx``, ``onnx-genai`` and ``gguf`` targets on Llama (one
export per target, every scheme at once); every other family on one scheme per target (``onnx``
int8 on Qwen3, Granite and GPT-2; ``gguf`` q8_0 on Qwen3; ``onnx-genai`` and ``executorch`` int8 on
Qwen3 and Granite, ``executorch`` int8 also on Gemma; GPT-2's ``.pte`` keeps its Conv1D body
float32, so it has no quantized body).
The Qwen3 model's attention and MLP outputs are scaled down 200-fold, so that its logits depend
little on its body: random bytes in its int8 body then stay within 10× the expected error (the KL
check alone passed it; the weight-level check does not). GPTQ calibration reads 256 tokens instead
of 8192 here (the rounding and the codes' digests are the same code). The ``executorch`` target on
Llama, factorized, int8 (torchao's rounding) and int4 (GPTQ codes, the rotated residual stream, the
head's shared 8-bit table): random bytes go into one body weight's named-data entry of the ``.pte``
(or of its ``model.ptd``), found through ExecuTorch's own reading of the program, and, in the int4
program, into the GPTQ-rounded head's.

Two tensors of one shape swapped (``q_proj`` of two layers, ``gate_proj`` and ``up_proj`` of one,
``k_proj`` and ``v_proj`` of one in a ``.pte``; plain rounding and GPTQ) fail on every target, in
copies of the Llama exports above (and, in the full tier, of a Gemma ``.pte``, whose program
computes ``k`` before ``q`` and its rotary embeddings in other delegates than the projections);
the same exports serve the checks of what an ONNX artifact may read and of the scheme a
manifest records.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pit_deploy.cli import main
from pit_deploy.io.checkpoint import save_model
from pit_deploy.io.manifest import MANIFEST_NAME
from pit_deploy.tiny import tiny_pit_model, tiny_tokenizer

from scramble import rehash

pytestmark = pytest.mark.filterwarnings("ignore")

CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None
HAVE_GENAI = importlib.util.find_spec("onnxruntime_genai") is not None

#: the Llama ``.pte`` export: torchao's rounding, GPTQ with an 8-bit shared head, and a 4-bit shared head
LLAMA_PTE = ("llama", "executorch", "factorized", "int8,int4,int4-shared")
#: (family, runtime, mode, schemes): every scheme of every target on Llama, one per target elsewhere
EXPORTS = [
    ("llama", "onnx", "factorized", "int8,int4,int4-compact,int8-web,int4-web"),
    ("llama", "gguf", "materialized", "f16,q8_0" + (",q4_0,q4_k_m" if HAVE_LLAMA else "")),
    ("llama", "onnx-genai", "factorized", "int8,int4,int4-compact"),
    ("qwen3", "onnx", "factorized", "int8"),
    ("granite", "onnx", "materialized", "int8"),
    ("gpt2", "onnx", "factorized", "int8"),
    ("qwen3", "gguf", "materialized", "q8_0"),
    ("qwen3", "onnx-genai", "factorized", "int8"),
    ("granite", "onnx-genai", "materialized", "int8"),
    LLAMA_PTE,
    ("qwen3", "executorch", "factorized", "int8"),
    ("granite", "executorch", "materialized", "int8"),
    ("gemma", "executorch", "factorized", "int8"),
]
#: the ``.pte`` programs of the families after Llama lower in the full tier only (a minute or more
#: each); the ``.pte`` reader and its checks run on Llama's in the default tier
FULL_TIER = {("qwen3", "executorch"), ("granite", "executorch"), ("gemma", "executorch")}


def _cases(cases):
    return [pytest.param(c, marks=pytest.mark.full, id=_id(c)) if c[:2] in FULL_TIER else pytest.param(c, id=_id(c))
            for c in cases]


def _id(case) -> str:
    return f"{case[0]}-{case[1]}-{case[3].split(',')[0]}"


@pytest.fixture(scope="module")
def cheap_calibration():
    """GPTQ on 256 calibration tokens: the same rounding code, a tenth of the time."""
    import pit_deploy.data.calibration as calibration

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibration, "CALIBRATION_TOKENS", 256)
        yield


#: the body's output projections of the Qwen3 model are scaled by this (see the module docstring)
QUIET_BODY = 0.005


def _model(family: str):
    import torch

    model = tiny_pit_model(family)
    if family == "qwen3":
        with torch.no_grad():
            for name, module in model.named_modules():
                if name.endswith(("o_proj", "down_proj")):
                    module.weight.mul_(QUIET_BODY)
    return model


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wcheck-src")
    out = {}
    for family in sorted({case[0] for case in EXPORTS}):
        tokenizer = tiny_tokenizer()
        tokenizer.chat_template = CHAT_TEMPLATE
        out[family] = root / family
        save_model(_model(family), out[family], tokenizer)
    return out


_MADE: dict[tuple, Path] = {}


def _exported(case: tuple, sources: dict[str, Path], tmp_path_factory) -> Path:
    """The export of ``case`` (made once for the module)."""
    family, runtime, mode, schemes = case
    if runtime == "onnx-genai" and not HAVE_GENAI:
        pytest.skip("onnxruntime-genai is not installed")
    if case not in _MADE:
        out = tmp_path_factory.mktemp(f"wcheck-{_id(case)}") / "exp"
        assert main(["export", str(sources[family]), "--out", str(out), "--runtime", runtime, "--mode", mode,
                     "--dtype", schemes, "--max-seq-len", "64"]) == 0
        _MADE[case] = out
    return _MADE[case]


@pytest.fixture(scope="module", params=_cases(EXPORTS))
def export(request, sources, cheap_calibration, tmp_path_factory) -> Path:
    return _exported(request.param, sources, tmp_path_factory)


def _copy(export: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(export, target)
    return target


def _verify(directory: Path, capsys, code: int) -> list[dict]:
    capsys.readouterr()
    assert main(["verify", str(directory), "--no-record", "--json"]) == code
    return json.loads(capsys.readouterr().out)["artifacts"]


# --------------------------------------------------------------------------------------
# scrambling the stored codes of each format in place (then the digests are re-recorded)
# --------------------------------------------------------------------------------------


def _random(raw: bytearray, offset: int, length: int, rng) -> None:
    raw[offset:offset + length] = rng.integers(0, 256, length, dtype=np.uint8).tobytes()


def scramble_onnx_graph(path: Path, vocab: int, seed: int = 0) -> str:
    """Random bytes in every body weight's codes of the ONNX graph at ``path`` (external data):
    ``MatMulNBits`` and the folded web codes, not the token tables (``vocab`` rows). Returns the
    name of the first one in graph order (initializer order for the folded codes)."""
    import onnx
    from onnx import helper

    graph = onnx.load(str(path), load_external_data=False).graph
    where = {i.name: {e.key: e.value for e in i.external_data} for i in graph.initializer}
    dims = {i.name: tuple(i.dims) for i in graph.initializer}

    first, targets = None, []
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "MatMulNBits" and attrs["N"] != vocab:
            targets.append(node.input[1])
            first = first or node.name or node.input[1]
    folded = [name for name in dims if name.endswith((".q4", ".q8")) and dims[name][0] != vocab]
    targets += folded
    if first is None and folded:
        first = folded[0][:-3]
    assert targets, f"no body weight in {path}"
    rng = np.random.default_rng(seed)
    files: dict[str, bytearray] = {}
    for name in targets:
        entry = where[name]
        raw = files.setdefault(entry["location"], bytearray((path.parent / entry["location"]).read_bytes()))
        _random(raw, int(entry["offset"]), int(entry["length"]), rng)
    for location, raw in files.items():
        (path.parent / location).write_bytes(bytes(raw))
    return first


def scramble_gguf(path: Path, seed: int = 0) -> str:
    """Random bytes in every quantized (not float32) body tensor of the GGUF file; returns the
    name of the first one in the file's order."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = [t for t in reader.tensors if t.tensor_type.name != "F32" and t.name.startswith("blk.")]
    assert tensors
    raw = bytearray(path.read_bytes())
    rng = np.random.default_rng(seed)
    for t in tensors:
        _random(raw, int(t.data_offset), int(t.n_bytes), rng)
    del reader
    path.write_bytes(bytes(raw))
    return tensors[0].name


def _pte_entries(path: Path) -> dict[str, tuple[int, int]]:
    """``key → (offset, size)`` in the file of every named-data entry of a ``.pte`` or ``.ptd``, as
    ExecuTorch's own readers locate them (the extended header's segment base, then each segment)."""
    raw = path.read_bytes()
    if path.suffix == ".ptd":
        from executorch.extension.flat_tensor.serialize.serialize import FlatTensorHeader, _deserialize_to_flat_tensor

        header = FlatTensorHeader.from_bytes(raw[8:])
        flat = _deserialize_to_flat_tensor(raw[:header.flatbuffer_offset + header.flatbuffer_size])
        base, segments, named = header.segment_base_offset, flat.segments, flat.named_data
    else:
        from executorch.exir._serialize._program import _flatbuffer_to_program, _get_extended_header

        header = _get_extended_header(raw)
        program = _flatbuffer_to_program(raw[:header.program_size])
        base, segments, named = header.segment_base_offset, program.segments, program.named_data
    return {e.key: (base + segments[e.segment_index].offset, segments[e.segment_index].size) for e in named or ()}


def scramble_pte(folder: Path, vocab: int, seed: int = 0, head: bool = False) -> str:
    """Random bytes in the codes of the first body weight (a delegate's quantized linear that is
    not the ``vocab``-row head; ``head``: the head itself) of the ``.pte`` in ``folder``, in place,
    in whichever file holds its named-data entry; returns the tensor's name."""
    from pit_deploy.targets.executorch.stored_weights import pte_stored

    stored = next(s for s in pte_stored(folder / "model.pte")
                  if "/xnnpack" in s.name and (s.shape[0] == vocab) == head)
    prefix = stored.name.rsplit("/", 1)[1]
    for path in sorted(folder.glob("model.pt[ed]")):
        hits = [entry for key, entry in _pte_entries(path).items() if key.startswith(prefix)]
        if hits:
            (offset, size), = hits
            raw = bytearray(path.read_bytes())
            _random(raw, offset, size, np.random.default_rng(seed))
            path.write_bytes(bytes(raw))
            return stored.name
    raise AssertionError(f"no named-data entry {prefix} in {folder}")


def scramble_artifact(directory: Path, art: dict) -> str:
    folder = directory / art["path"]
    if art["target"] == "executorch":
        return scramble_pte(folder, art["shapes"]["vocab_size"])
    if art["target"] == "gguf":
        return scramble_gguf(folder / art["details"]["file"])
    if art["target"] == "onnx-genai":
        return scramble_onnx_graph(folder / "model.onnx", art["shapes"]["vocab_size"])
    from pit_deploy.targets.onnx import decoder_file

    return scramble_onnx_graph(decoder_file(folder), art["shapes"]["vocab_size"])


# --------------------------------------------------------------------------------------
# the tests
# --------------------------------------------------------------------------------------


def _weight_checks(directory: Path) -> dict[str, dict]:
    """The weight-level check of every artifact of ``directory``, by artifact folder."""
    from pit_deploy.evaluate.verify import load_reference, weight_level_check
    from pit_deploy.io.manifest import Manifest

    reference, _ = load_reference(directory)
    return {art.path: weight_level_check(directory, art, reference) for art in Manifest.read(directory).artifacts}


def _scrambled(export: Path, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A copy of ``export`` with random bytes in every artifact's body weights, digests re-recorded;
    and the first corrupted tensor of each artifact."""
    directory = _copy(export, tmp_path)
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    first = {a["path"]: scramble_artifact(directory, a) for a in manifest["artifacts"]}
    rehash(directory)
    return directory, first


def test_honest_exports_pass_the_weight_level_check(export):
    for path, check in _weight_checks(export).items():
        assert check["checked"] and check["tensors"] > 0 and check["failure"] is None, (path, check)
        if path.endswith(("-int4", "-int4-compact")):  # GPTQ-rounded: the codes recorded at export
            assert check["calibrated"] > 0, (path, check)


def test_random_body_bytes_fail_the_weight_level_check_naming_the_first_tensor(export, tmp_path):
    directory, first = _scrambled(export, tmp_path)
    for path, check in _weight_checks(directory).items():
        assert (check["failure"] or "").startswith(f"quantized tensor {first[path]}:"), (path, first[path], check)


#: the scrambled cases run through ``pit-deploy verify`` itself (the others through its weight check)
VERIFIED = ("qwen3-onnx-int8", "llama-onnx-genai-int8", "llama-gguf-f16", "llama-executorch-int8")


def test_random_body_bytes_fail_verify(export, tmp_path, capsys, request):
    """Through the command: exit 1, the artifact failed by the weight-level check, naming the
    first corrupted tensor. The Qwen3 ``onnx`` factorized int8 case passed on its KL alone (the
    model's logits depend little on its body)."""
    case = request.node.callspec.id
    if case not in VERIFIED:
        pytest.skip("checked through the weight check alone (the same code verify calls)")
    if "gguf" in case and not HAVE_LLAMA:
        pytest.skip("llama-cpp-python is not installed")
    directory, first = _scrambled(export, tmp_path)
    capsys.readouterr()
    assert main(["verify", str(directory), "--no-record", "--json", "--dtype", case.rsplit("-", 1)[1]]) == 1
    (result,) = json.loads(capsys.readouterr().out)["artifacts"]
    key = "-".join((result["runtime"], result["mode"], result["scheme"]))
    assert not result["passed"], result
    assert f"weight-level check: quantized tensor {first[key]}:" in " ".join(result["failures"]), result["failures"]
    if case == "qwen3-onnx-int8":  # the KL alone is within its bounds: only the weight-level check fails it
        assert all(f.startswith("weight-level check:") for f in result["failures"]), result["failures"]


def _edit(export: Path, tmp_path: Path, edit) -> Path:
    directory = _copy(export, tmp_path)
    data = json.loads((directory / MANIFEST_NAME).read_text())
    for art in data["artifacts"]:
        edit(art["details"])
    (directory / MANIFEST_NAME).write_text(json.dumps(data))
    return directory


@pytest.fixture(scope="module")
def onnx_int8(sources, cheap_calibration, tmp_path_factory) -> Path:
    """The Qwen3 ``onnx`` factorized int8 export (one of :data:`EXPORTS`)."""
    return _exported(("qwen3", "onnx", "factorized", "int8"), sources, tmp_path_factory)


@pytest.fixture(scope="module")
def llama_pte(sources, cheap_calibration, tmp_path_factory) -> Path:
    """The Llama ``executorch`` factorized int8, int4 and int4-shared export (one of :data:`EXPORTS`)."""
    return _exported(LLAMA_PTE, sources, tmp_path_factory)


def test_a_table_holding_its_recorded_codes_is_never_dequantized_nor_its_forms_made(sources, cheap_calibration,
                                                                                      tmp_path_factory, monkeypatch):
    """A GPTQ-rounded factorized table matches its recorded digest: the check makes none of the
    table's reference forms (each a float32 ``V×d`` array, 671 MB at a 262k vocabulary) and
    dequantizes none of the calibrated tensors; an 8-bit table rounded to nearest is compared by
    value, so there the forms are made."""
    import pit_deploy.evaluate.onnx_weights as onnx_weights
    from pit_deploy.evaluate import weight_check

    export = _exported(EXPORTS[0], sources, tmp_path_factory)  # llama onnx factorized int8, int4, …
    made, dense = [], []
    real_forms, real_dense = onnx_weights.table_candidates, weight_check.Stored.dense

    def forms(*args, **kwargs):
        made.append(True)
        return real_forms(*args, **kwargs)

    def dequantize(self, rows=None):
        dense.append((self.name, self.values is None, rows))
        return real_dense(self, rows)

    monkeypatch.setattr(onnx_weights, "table_candidates", forms)
    monkeypatch.setattr(weight_check.Stored, "dense", dequantize)
    checks = _weight_checks(export)
    assert checks["onnx-factorized-int4"]["failure"] is None and checks["onnx-factorized-int4"]["calibrated"] > 0
    made.clear(), dense.clear()
    from pit_deploy.evaluate.verify import load_reference
    from pit_deploy.io.manifest import Manifest

    reference, _ = load_reference(export)
    art = next(a for a in Manifest.read(export).artifacts if a.path == "onnx-factorized-int4")
    check = weight_check.check_artifact_weights(export, art, reference)
    assert check.failure is None and check.calibrated == check.tensors, check
    assert not made and not dense, (made, dense)
    art = next(a for a in Manifest.read(export).artifacts if a.path == "onnx-factorized-int8")
    check = weight_check.check_artifact_weights(export, art, reference)
    assert check.failure is None and made and any(lazy for _, lazy, _ in dense), (made, dense)


def test_a_gguf_file_is_dequantized_one_tensor_at_a_time(sources, tmp_path_factory):
    """The GGUF reader keeps each tensor as a loader (gguf-py's dequantization of the file's bytes)
    with its shape: the values come when the tensor is compared, equal to gguf-py's, and are not
    kept after (the whole file in float32 is the model's fp32 size)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from pit_deploy.targets.gguf.stored_weights import gguf_stored

    export = _exported(EXPORTS[1], sources, tmp_path_factory)
    path = next(export.rglob("*q8_0*.gguf"))
    stored = gguf_stored(path)
    raw = {t.name: t for t in GGUFReader(str(path)).tensors}
    assert stored and all(s.values is None and s.qz is None for s in stored)
    for s in stored:
        t = raw[s.name]
        want = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(-1, int(t.shape[0]))
        assert s.shape == want.shape and np.array_equal(s.dense(), want) and s.values is None
        assert np.array_equal(s.dense(np.array([0, want.shape[0] - 1])), want[[0, -1]])
        assert np.array_equal(s.dense(slice(1, 3)), want[1:3])


def test_the_grid_check_dequantizes_a_gguf_tensor_a_slice_of_rows_at_a_time(sources, tmp_path_factory,
                                                                           monkeypatch):
    """``off_grid`` asks a loader for :data:`GRID_ROWS` rows at a time, never the whole tensor
    (gguf-py's temporaries for a 262k-token table were several times the table), and finds what
    the whole tensor compared at once finds."""
    from pit_deploy.evaluate import weight_check
    from pit_deploy.evaluate.weight_check import off_grid
    from pit_deploy.targets.gguf.stored_weights import gguf_stored

    export = _exported(EXPORTS[1], sources, tmp_path_factory)
    stored = max(gguf_stored(next(export.rglob("*q8_0*.gguf"))), key=lambda s: s.shape[0])
    whole = stored.dense()
    rng = np.random.default_rng(0)
    reference = whole + rng.normal(0, 1e-3, whole.shape).astype(np.float32)
    want = off_grid(stored, reference)
    assert want[0] > 0  # the noise puts some values off the grid: the counts below are compared
    asked = []
    load = stored.load
    monkeypatch.setattr(stored, "load", lambda rows=None: asked.append(rows) or load(rows))
    monkeypatch.setattr(weight_check, "GRID_ROWS", 5)
    assert off_grid(stored, reference) == want
    assert len(asked) == -(-stored.shape[0] // 5) and all(isinstance(r, slice) for r in asked)


def test_a_deleted_expected_error_is_refused_before_any_work(onnx_int8, tmp_path, capsys):
    """Without ``details.expected`` the scaled KL check would be dropped: unusable input (exit 2,
    re-export), not a pass on the absolute bounds alone."""
    directory = _edit(onnx_int8, tmp_path, lambda d: d.pop("expected"))
    capsys.readouterr()
    assert main(["verify", str(directory), "--no-record"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "details.expected" in err and "re-export" in err, err


@pytest.mark.parametrize("edit", ["delete", "false"])
def test_interface_exact_follows_from_the_scheme_not_the_manifest(onnx_int8, tmp_path, capsys, edit):
    """Deleting or flipping ``details.quantization.interface_exact`` keeps the ``delta_ti`` bound of a
    factorized artifact with the PIT correction."""
    def change(details):
        if edit == "delete":
            details["quantization"].pop("interface_exact")
        else:
            details["quantization"]["interface_exact"] = False

    directory = _edit(onnx_int8, tmp_path, change)
    (result,) = _verify(directory, capsys, 0)
    assert result["interface_exact"] is True and result["delta_ti"] <= result["bounds"]["delta_ti"]


def test_the_interface_is_bounded_where_the_export_corrects_it():
    from pit_deploy.targets import get_target

    assert get_target("onnx").interface_exact(True, "factorized")
    assert not get_target("onnx").interface_exact(False, "factorized")
    assert not get_target("onnx").interface_exact(True, "materialized")
    assert get_target("gguf").interface_exact(True, "materialized")


def test_a_pte_reads_every_body_linear_its_head_and_its_gather(llama_pte):
    """The ``.pte``'s check reads all of its body linears (7 a layer) and its gather table; the int4
    program's body matches the GPTQ digests recorded at export (so the nibble order, the zero
    point 8 and the bfloat16 scales are read as XNNPACK stores them), and so do its GPTQ-rounded
    quantized head and the gather that shares the head's codes: nothing is left out."""
    checks = _weight_checks(llama_pte)
    config = json.loads((llama_pte / "reference" / "config.json").read_text())
    layers = config["num_hidden_layers"]
    int8 = checks["executorch-factorized-int8"]
    assert int8["tensors"] == 7 * layers + 1 and int8["note"] == "", int8
    for name in ("executorch-factorized-int4", "executorch-factorized-int4-shared"):  # 8- and 4-bit shared head
        assert checks[name]["calibrated"] == 7 * layers + 2 == checks[name]["tensors"], (name, checks[name])
        assert checks[name]["note"] == "", (name, checks[name])


def test_a_pte_exported_without_head_digests_lists_its_head_as_not_covered(llama_pte, tmp_path):
    """A manifest without the head's digests (an export made before they were recorded): the body
    is still checked, the GPTQ head and its gather are named as not covered, never passed."""
    layers = json.loads((llama_pte / "reference" / "config.json").read_text())["num_hidden_layers"]
    directory = _edit(llama_pte, tmp_path, lambda d: d.get("quantization", {}).pop("weight_codes", None))
    check = _weight_checks(directory)["executorch-factorized-int4"]
    assert check["checked"] and check["failure"] is None and check["calibrated"] == 7 * layers == check["tensors"]
    assert check["note"].startswith("not covered: ") and "re-export" in check["note"], check


@pytest.mark.parametrize("scheme", ["int4", "int4-shared"])
def test_random_bytes_in_a_gptq_head_of_a_pte_fail(llama_pte, tmp_path, scheme):
    """The GPTQ-rounded head of the int4 programs (its codes shared with the gather: 8-bit, and
    4-bit in ``model.ptd``) is held to the digests the export records for it: random bytes in its
    named-data entry fail the check, naming the head or the gather that reads the same codes."""
    from pit_deploy.targets.executorch.stored_weights import pte_stored

    folder = f"executorch-factorized-{scheme}"
    vocab = json.loads((llama_pte / "reference" / "config.json").read_text())["vocab_size"]
    head_side = [s.name for s in pte_stored(llama_pte / folder / "model.pte") if s.shape[0] == vocab]
    directory = _copy(llama_pte, tmp_path)
    assert scramble_pte(directory / folder, vocab, head=True) in head_side
    rehash(directory)
    failure = _weight_checks(directory)[folder]["failure"] or ""
    assert any(failure.startswith(f"quantized tensor {name}:") for name in head_side), (failure, head_side)


def test_a_target_without_a_reader_is_reported_not_checked(monkeypatch):
    """A target that names no weight check: the check says so in the result and in verify's table,
    and never counts it as a pass of its own."""
    from types import SimpleNamespace

    from pit_deploy.evaluate.verify import ArtifactResult, VerifyReport, weight_level_check
    from pit_deploy.targets import get_target

    monkeypatch.setattr(get_target("executorch"), "weight_check", None)
    art = SimpleNamespace(target="executorch", mode="factorized", path="executorch-factorized-int8", details={},
                          files={}, shapes={"vocab_size": 8})
    check = weight_level_check(Path("."), art, None)
    assert check["checked"] is False and check["failure"] is None and check["tensors"] == 0
    assert "not checked at the weight level" in check["note"]
    result = ArtifactResult(runtime="executorch", mode="factorized", dtype="int8", scheme="int8", kl_mean=0.0,
                            kl_p99=0.0, same_top1=1.0, ppl_ratio=1.0, delta_ti=0.0, weight_check=check).judge()
    assert "not checked at the weight level" in str(VerifyReport("exp", [result]))


def test_torchao_hqq_rounding_passes_the_exporters_own_codes_and_no_others():
    """A ``.pte``'s 4-bit linears rounded to nearest hold torchao's HQQ scale-only codes, whose
    least-squares scale clips a group's outlier past one step of the widest grid: those pass as the
    exporter's own rounding; random codes, or a scale off by more than bfloat16 rounding, do not."""
    import torch
    from torch import nn
    from torchao.quantization import quantize_

    from pit_deploy.evaluate.weight_check import from_codes, off_grid
    from pit_deploy.targets.executorch.stored_weights import torchao_hqq_rounding
    from pit_deploy.targets.executorch.head import xnnpack_linear_config

    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    weight[:, ::32] *= 4  # one outlier a group
    holder = nn.Sequential(nn.Linear(128, 64, bias=False))
    with torch.no_grad():
        holder[0].weight.copy_(weight)
    quantize_(holder, xnnpack_linear_config(4, 32))
    codes = holder[0].weight.qdata.numpy().astype(np.int32)
    scales = holder[0].weight.scale.to(torch.bfloat16).to(torch.float32).numpy()  # as XNNPACK stores them
    reference = weight.numpy()

    stored = from_codes("w", codes, scales, 4, 32, 128)
    assert off_grid(stored, reference)[0] > 0  # clipped past one step of the widest grid
    assert torchao_hqq_rounding(stored, reference)
    rng = np.random.default_rng(0)
    assert not torchao_hqq_rounding(from_codes("w", rng.integers(-8, 8, codes.shape), scales, 4, 32, 128), reference)
    assert not torchao_hqq_rounding(from_codes("w", codes, scales * 1.02, 4, 32, 128), reference)


# --------------------------------------------------------------------------------------
# tensors swapped between places of one shape: each is paired with the weight of its own name
# --------------------------------------------------------------------------------------


def _node_module(node_name: str) -> str:
    """The module path an ONNX node's name is made of (``/model/layers.0/mlp/up_proj/MatMul_Q8``
    → ``model.layers.0.mlp.up_proj``)."""
    return ".".join(node_name.strip("/").split("/")[:-1])


def swap_onnx(path: Path, first: str, second: str) -> str:
    """Swap the stored codes, scales and zero points of the quantized weights read by the nodes
    named for the module paths ``first`` and ``second`` in the ONNX graph at ``path`` (in the
    external data file, in place, or in the graph where a small tensor is stored inline); returns
    the name the weight-level check gives the first of them."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}

    def tensors(module: str) -> tuple[str, list[str]]:
        for node in model.graph.node:
            if _node_module(node.name) != module:
                continue
            if node.op_type == "MatMulNBits":
                return node.name, [n for n in node.input[1:] if n in inits]
            if node.op_type == "MatMul" and any(f"{node.input[1]}.q{b}" in inits for b in (4, 8)):  # folded codes
                base = node.input[1]
                return base, [n for n in inits if n in (f"{base}.q4", f"{base}.q8", f"{base}.scales",
                                                        f"{base}.zero_points")]
        raise AssertionError(f"no quantized weight read by a node of {module} in {path}")

    name, ours = tensors(first)
    _, theirs = tensors(second)
    assert len(ours) == len(theirs) >= 2, (ours, theirs)
    files: dict[str, bytearray] = {}
    for a, b in zip(ours, theirs):
        ta, tb = inits[a], inits[b]
        assert tuple(ta.dims) == tuple(tb.dims) and ta.data_location == tb.data_location, (a, b)
        if ta.data_location == onnx.TensorProto.EXTERNAL:
            where = [{e.key: e.value for e in t.external_data} for t in (ta, tb)]
            raw = files.setdefault(where[0]["location"],
                                   bytearray((path.parent / where[0]["location"]).read_bytes()))
            assert where[0]["location"] == where[1]["location"] and where[0]["length"] == where[1]["length"]
            (oa, ob), n = (int(w["offset"]) for w in where), int(where[0]["length"])
            raw[oa:oa + n], raw[ob:ob + n] = raw[ob:ob + n], raw[oa:oa + n]
        else:
            copy = onnx.TensorProto()
            copy.CopyFrom(ta)
            ta.CopyFrom(tb)
            tb.CopyFrom(copy)
            ta.name, tb.name = a, b
    for location, raw in files.items():
        (path.parent / location).write_bytes(bytes(raw))
    onnx.save(model, str(path))
    return name


def swap_gguf(path: Path, first: str, second: str) -> str:
    """Swap the data of two GGUF tensors of one type and size, in place; returns ``first``."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    found = {t.name: (int(t.data_offset), int(t.n_bytes), t.tensor_type) for t in reader.tensors}
    (oa, n, kind), (ob, m, other) = found[first], found[second]
    assert (n, kind) == (m, other), (found[first], found[second])
    del reader
    raw = bytearray(path.read_bytes())
    raw[oa:oa + n], raw[ob:ob + n] = raw[ob:ob + n], raw[oa:oa + n]
    path.write_bytes(bytes(raw))
    return first


def _pte_linear_keys(path: Path) -> list[tuple[str, str]]:
    """``(codes key, scales key)`` of the named-data entries of every quantized linear of the
    XNNPACK delegates of ``forward``, in the order the weight-level check reads them."""
    from pit_deploy.targets.executorch.stored_weights import XNN_WEIGHTS, _PteData, _xnn_graph

    program = _PteData(path).program
    plan = next(p for p in program.execution_plan if p.name == "forward")
    keys = []
    for delegate in plan.delegates:
        graph = _xnn_graph(bytes(program.backend_delegate_data[delegate.processed.index].data))
        constants = graph["constant_data"]
        values = {v["xvalue_union"]["tensor_value"]["id_out"]: v["xvalue_union"] for v in graph["xvalues"]
                  if v.get("xvalue_union_type") == "XNNQuantizedTensorValue"
                  and v["xvalue_union"]["tensor_value"].get("constant_buffer_idx")
                  and v["xvalue_union"]["tensor_value"].get("datatype") in XNN_WEIGHTS}
        for node in graph["xnodes"]:
            value = values.get(node["xnode_union"].get("filter_id", -1))
            if value is not None:
                keys.append((constants[value["tensor_value"]["constant_buffer_idx"]]["named_key"],
                             constants[value["quant_params"]["scale_buffer_idx"]]["named_key"]))
    return keys


def swap_pte(folder: Path, first: int, second: int) -> str:
    """Swap the codes and the scales of the ``first``-th and ``second``-th quantized linear of the
    ``.pte``'s ``forward`` (program order) in their named-data entries, in whichever file holds
    them, in place; returns the end of the name the weight-level check gives the first of them."""
    (codes_a, scales_a), (codes_b, scales_b) = (_pte_linear_keys(folder / "model.pte")[i] for i in (first, second))
    swapped = 0
    for path in sorted(folder.glob("model.pt[ed]")):
        entries = _pte_entries(path)
        raw = bytearray(path.read_bytes())
        for a, b in ((codes_a, codes_b), (scales_a, scales_b)):
            if a in entries:
                (oa, n), (ob, m) = entries[a], entries[b]
                assert n == m, (a, b, n, m)
                raw[oa:oa + n], raw[ob:ob + n] = raw[ob:ob + n], raw[oa:oa + n]
                swapped += 1
        path.write_bytes(bytes(raw))
    assert swapped == 2, (folder, swapped)
    return codes_a[:16]  # the check names a delegate's weight "<method>/xnnpack<j>/<key[:16]>"


Q0, Q1, K0 = "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj", "model.layers.0.self_attn.k_proj"
GATE0, GATE1, UP0 = "model.layers.0.mlp.gate_proj", "model.layers.1.mlp.gate_proj", "model.layers.0.mlp.up_proj"
LLAMA_ONNX, LLAMA_GGUF, LLAMA_GENAI = EXPORTS[0], EXPORTS[1], EXPORTS[2]
GEMMA_PTE = ("gemma", "executorch", "factorized", "int8")
#: a .pte's quantized linears in program order: seven a layer, q k v o gate up down (Llama; k and v
#: of one shape, the tiny models' grouped attention); Gemma's program computes k before q
PTE_Q0, PTE_K0, PTE_V0, PTE_Q1, PTE_GATE0, PTE_UP0 = 0, 1, 2, 7, 4, 5
GEMMA_PTE_K0, GEMMA_PTE_V0 = 0, 2
#: (export, artifact folder, the two tensors swapped, the reference weight the first must be
#: compared with): across layers and within one, plain rounding and GPTQ (its codes match the
#: digest recorded for the other weight), for every target with a weight-level check
SWAPS = {
    "onnx-int8-q_proj-layers": (LLAMA_ONNX, "onnx-factorized-int8", (Q0, Q1), Q0),
    "onnx-int4-gptq-q_proj-layers": (LLAMA_ONNX, "onnx-factorized-int4", (Q0, Q1), Q0),
    "onnx-int4-gptq-gate-up": (LLAMA_ONNX, "onnx-factorized-int4", (GATE0, UP0), GATE0),
    "onnx-int8-web-gate-up": (LLAMA_ONNX, "onnx-factorized-int8-web", (GATE0, UP0), GATE0),
    "genai-int8-qkv-layers": (LLAMA_GENAI, "onnx-genai-factorized-int8",
                              ("model.layers.0.attn.qkv_proj", "model.layers.1.attn.qkv_proj"),
                              "model.layers.0.self_attn.{q_proj,k_proj,v_proj}"),
    "genai-int8-gate-layers": (LLAMA_GENAI, "onnx-genai-factorized-int8", (GATE0, GATE1), GATE0),
    "genai-int4-gptq-gate-up": (LLAMA_GENAI, "onnx-genai-factorized-int4", (GATE0, UP0), GATE0),
    "gguf-q8_0-attn_q-layers": (LLAMA_GGUF, "gguf-materialized-q8_0", ("blk.0.attn_q.weight", "blk.1.attn_q.weight"),
                                "blk.0.attn_q.weight"),
    "gguf-q8_0-gate-up": (LLAMA_GGUF, "gguf-materialized-q8_0", ("blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"),
                          "blk.0.ffn_gate.weight"),
    "pte-int8-q_proj-layers": (LLAMA_PTE, "executorch-factorized-int8", (PTE_Q0, PTE_Q1), Q0),
    "pte-int8-gate-up": (LLAMA_PTE, "executorch-factorized-int8", (PTE_GATE0, PTE_UP0), GATE0),
    "pte-int8-k-v": (LLAMA_PTE, "executorch-factorized-int8", (PTE_K0, PTE_V0), K0),
    "pte-int4-gptq-q_proj-layers": (LLAMA_PTE, "executorch-factorized-int4", (PTE_Q0, PTE_Q1), Q0),
    "pte-int4-gptq-gate-up": (LLAMA_PTE, "executorch-factorized-int4", (PTE_GATE0, PTE_UP0), GATE0),
    "pte-gemma-int8-k-v": (GEMMA_PTE, "executorch-factorized-int8", (GEMMA_PTE_K0, GEMMA_PTE_V0), K0),
    "pte-gemma-int8-gate-up": (GEMMA_PTE, "executorch-factorized-int8", (PTE_GATE0, PTE_UP0), GATE0),
}


def _swapped(case: str, sources, tmp_path_factory, tmp_path: Path) -> tuple[Path, str, str, str]:
    """A copy of the case's export with its two tensors swapped, digests re-recorded: the copy,
    the artifact folder, the name the check gives the first tensor and its reference weight."""
    export_case, folder, (first, second), weight = SWAPS[case]
    directory = _copy(_exported(export_case, sources, tmp_path_factory), tmp_path)
    art = next(a for a in json.loads((directory / MANIFEST_NAME).read_text())["artifacts"] if a["path"] == folder)
    if art["target"] == "executorch":
        name = swap_pte(directory / folder, first, second)
    elif art["target"] == "gguf":
        name = swap_gguf(directory / folder / art["details"]["file"], first, second)
    elif art["target"] == "onnx-genai":
        name = swap_onnx(directory / folder / "model.onnx", first, second)
    else:
        from pit_deploy.targets.onnx import decoder_file

        name = swap_onnx(decoder_file(directory / folder), first, second)
    rehash(directory)
    return directory, folder, name, weight


def _weight_check(directory: Path, folder: str) -> dict:
    from pit_deploy.evaluate.verify import load_reference, weight_level_check
    from pit_deploy.io.manifest import Manifest

    art = next(a for a in Manifest.read(directory).artifacts if a.path == folder)
    return weight_level_check(directory, art, load_reference(directory)[0])


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.full) if SWAPS[c][0][:2] in FULL_TIER else c
                                  for c in SWAPS])
def test_tensors_swapped_between_places_of_one_shape_fail_naming_both(case, sources, cheap_calibration,
                                                                       tmp_path_factory, tmp_path):
    """Two stored tensors of one shape swapped (the same projection of two layers, or gate_proj and
    up_proj of one layer, or a .pte's k_proj and v_proj; GPTQ codes swapped with their digests left
    as recorded): each is compared with the reference weight of its own name, so the check fails,
    naming the stored tensor and the weight it was paired with. Pairing by shape passed every one
    of them; a .pte's members of one group (gate/up, k/v), paired by value, passed theirs: they are
    paired by their role in the program now."""
    directory, folder, name, weight = _swapped(case, sources, tmp_path_factory, tmp_path)
    failure = _weight_check(directory, folder)["failure"] or ""
    assert failure.startswith("quantized tensor ") and name in failure.split(": ", 1)[0], (name, failure)
    assert f"its reference weight {weight}" in failure, (weight, failure)


#: the swaps run through ``pit-deploy verify`` itself (the others through its weight check, the
#: same code verify calls; a failing ``.pte`` and GGUF go through verify in
#: ``test_random_body_bytes_fail_verify``)
SWAPS_VERIFIED = ("onnx-int4-gptq-q_proj-layers", "genai-int8-gate-layers")


@pytest.mark.parametrize("case", SWAPS_VERIFIED)
def test_swapped_tensors_fail_verify(case, sources, cheap_calibration, tmp_path_factory, tmp_path, capsys):
    """Through the command: exit 1, the artifact failed by the weight-level check, naming the
    swapped tensor and the weight it stands for."""
    directory, folder, name, weight = _swapped(case, sources, tmp_path_factory, tmp_path)
    data = json.loads((directory / MANIFEST_NAME).read_text())
    data["artifacts"] = [a for a in data["artifacts"] if a["path"] == folder]  # verify this one alone
    (directory / MANIFEST_NAME).write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["verify", str(directory), "--no-record", "--json"]) == 1
    (result,) = json.loads(capsys.readouterr().out)["artifacts"]
    failures = [f for f in result["failures"] if f.startswith("weight-level check: quantized tensor ")]
    assert not result["passed"] and failures, result["failures"]
    assert name in failures[0] and f"its reference weight {weight}" in failures[0], failures


# --------------------------------------------------------------------------------------
# what an artifact may read, and the scheme a manifest records
# --------------------------------------------------------------------------------------


def _point_onnx_data(path: Path, location: str) -> None:
    """Point every external-data tensor of the ONNX graph at ``path`` at ``location``."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save(model, str(path))


@pytest.mark.parametrize("target", ["onnx", "onnx-genai"])
@pytest.mark.parametrize("how", ["unlisted", "symlink"])
def test_external_data_outside_the_listed_files_is_refused(target, how, onnx_int8, sources, cheap_calibration,
                                                           tmp_path_factory, tmp_path, capsys):
    """The decoder's external data moved to a copy of its data file that the manifest does not
    list (``unlisted``), or to a symbolic link to it that the manifest lists (``symlink``; its
    digest is the file's): onnxruntime reads it as it reads the original, so only the files it
    reads can tell. Refused before any work (exit 2, naming the graph and the location); nothing
    is recorded. The unlisted copy passed verify and was recorded; the link made the ONNX loader
    raise, an internal error (exit 3)."""
    if target == "onnx":
        from pit_deploy.targets.onnx import data_name, decoder_file

        directory = _copy(onnx_int8, tmp_path)
        folder = "onnx-factorized-int8"
        decoder = decoder_file(directory / folder)
        data = decoder.with_name(data_name(decoder.name))
    else:
        directory = _copy(_exported(LLAMA_GENAI, sources, tmp_path_factory), tmp_path)
        folder = "onnx-genai-factorized-int8"
        decoder = directory / folder / "model.onnx"
        data = decoder.with_name("model.onnx.data")
    stray = data.with_name("stray.data")
    if how == "unlisted":
        shutil.copyfile(data, stray)
    else:
        stray.symlink_to(data.name)
    _point_onnx_data(decoder, stray.name)
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    if how == "symlink":
        art = next(a for a in manifest["artifacts"] if a["path"] == folder)
        art["files"][stray.relative_to(directory).as_posix()] = {"sha256": "", "bytes": 0}
        (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    rehash(directory)
    before = (directory / MANIFEST_NAME).read_bytes()
    capsys.readouterr()
    assert main(["verify", str(directory), "--runtime", target, "--dtype", "int8"]) == 2
    err = capsys.readouterr().err
    assert f"reads its data from '{stray.name}'" in err and decoder.name in err, err
    assert ("symbolic link" if how == "symlink" else "not a file of the artifact that its manifest lists") in err, err
    assert (directory / MANIFEST_NAME).read_bytes() == before  # nothing recorded


@pytest.mark.parametrize("edit", ["scheme", "scheme-and-dtype", "rounding"])
def test_a_scheme_edited_in_the_manifest_is_refused(edit, sources, cheap_calibration, tmp_path_factory, tmp_path,
                                                    capsys):
    """The scheme picks the bounds (int8's scaled KL factor is 10, int4's 4; a GPTQ int4 body has
    tighter bounds of its own): an int4 artifact whose manifest says ``int8`` (``scheme`` alone, or
    with its ``dtype``), or ``rounding: rtn`` beside its recorded GPTQ codes, no longer agrees with
    what else records the scheme, and is refused as a tampered manifest (exit 2) before any work.
    Each was verified against the looser bounds."""
    directory = _copy(_exported(LLAMA_ONNX, sources, tmp_path_factory), tmp_path)
    data = json.loads((directory / MANIFEST_NAME).read_text())
    data["artifacts"] = [a for a in data["artifacts"] if a["scheme"] == "int4"]  # no int8 artifact to collide with
    (art,) = data["artifacts"]
    if edit.startswith("scheme"):
        art["scheme"] = "int8"
        if edit == "scheme-and-dtype":
            art["dtype"] = "int8"
    else:
        art["details"]["scheme"]["rounding"] = "rtn"
    (directory / MANIFEST_NAME).write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["verify", str(directory), "--no-record"]) == 2
    err = capsys.readouterr().err
    field = {"scheme": "scheme 'int8' stores int8 weights", "scheme-and-dtype": "details.scheme.name is 'int4'",
             "rounding": "details.scheme.rounding is 'rtn'"}[edit]
    assert err.count("error:") == 1 and field in err and "tampered" in err, err


def test_a_weight_is_paired_once_and_every_recorded_digest_is_held():
    """Two stored tensors read by nodes named for one weight fail (a model stores each weight
    once), and so does a digest recorded for a weight that no tensor paired with it holds; the
    honest pair passes. On the tiny model's own weights, stored exactly."""
    from pit_deploy.evaluate.onnx_weights import onnx_pairing
    from pit_deploy.evaluate.weight_check import ReferenceWeights, Stored, compare, table_candidates
    from pit_deploy.exporters.passes import prepare

    prepared = prepare(_model("llama"), "materialized")
    vocab = prepared.config.vocab_size
    weights = ReferenceWeights(prepared, vocab, table_candidates(prepared, vocab, False))

    def stored(module: str, node: str) -> Stored:
        s = Stored(node, weights.weight(module), 8, 32)
        s.places = (node,)
        return s

    q0 = stored(Q0, "/model/layers.0/self_attn/q_proj/MatMul_Q8")
    q1 = stored(Q1, "/model/layers.1/self_attn/q_proj/MatMul_Q8")
    pair = onnx_pairing(weights)
    assert compare([q0, q1], pair, {}).failure is None
    twice = stored(Q1, "/model/layers.0/self_attn/q_proj/MatMul_Q8_copy")
    twice.places = q0.places
    failure = compare([q0, twice], pair, {}).failure or ""
    assert failure.startswith("quantized tensor /model/layers.0/self_attn/q_proj/MatMul_Q8_copy:") \
        and f"paired with {Q0}" in failure, failure
    codes = {"weight_codes": {"tensors": {"model.layers.0.self_attn.k_proj": {"rows": 32, "cols": 64,
                                                                             "sha256": "0" * 64}}}}
    failure = compare([q0, q1], pair, codes).failure or ""
    assert "recorded for model.layers.0.self_attn.k_proj are held by no quantized tensor" in failure, failure
    unknown = stored(Q0, "/model/layers.9/self_attn/q_proj/MatMul_Q8")
    assert "named for no weight of the reference model" in (compare([unknown], pair, {}).failure or "")


@pytest.mark.parametrize("family", ["llama", "qwen3", "granite", "gemma"])
def test_the_roles_of_a_models_linears_come_from_its_forward_pass(family):
    """The role each linear's output has before it meets another linear's, traced through one
    forward pass of the model, no table of names: ``gate`` through the activation, ``up``
    straight into the product; ``q`` and ``k`` through the rotary embedding (Qwen3's through
    their norm first), ``v`` through neither."""
    from pit_deploy.targets.executorch.stored_weights import NONLINEAR, PLAIN, SELF_SUM, _body_linears
    from pit_deploy.exporters.passes import prepare

    groups, roles = _body_linears(prepare(_model(family), "materialized"))
    attention = NONLINEAR if family == "qwen3" else SELF_SUM
    layer = "model.layers.0"
    assert groups[0] == [f"{layer}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")], groups[:4]
    assert groups[2] == [f"{layer}.mlp.gate_proj", f"{layer}.mlp.up_proj"], groups[:4]
    assert [roles[p] for p in groups[0] + groups[2]] == [attention, attention, PLAIN, NONLINEAR, PLAIN], roles


def test_members_of_one_shape_in_a_pte_group_are_paired_by_their_role():
    """A program's linears, each with its role in the program (here the model's own weights,
    stored exactly, in program order): gate_proj's and up_proj's weights swapped, or k_proj's and
    v_proj's, fail naming the place and the weight of its role; paired by value (no roles) the
    swap passed. A group whose roles in the program are not the model's is paired by value, and
    named."""
    from pit_deploy.evaluate.weight_check import ReferenceWeights, Stored, compare, table_candidates
    from pit_deploy.targets.executorch.stored_weights import _body_linears, pte_pairing
    from pit_deploy.exporters.passes import prepare

    prepared = prepare(_model("llama"), "materialized")
    vocab = prepared.config.vocab_size
    weights = ReferenceWeights(prepared, vocab, table_candidates(prepared, vocab, False))
    groups, roles = _body_linears(prepared)
    places = [path for group in groups for path in group]

    def program(swap=(), known=True) -> list[Stored]:
        held = dict(zip(swap, reversed(swap)))
        out = []
        for path in places:
            s = Stored(path, weights.weight(held.get(path, path)), 8, 32)
            s.role = roles[path] if known else None
            out.append(s)
        return out

    def check(stored, **options):
        return compare(stored, pte_pairing(stored, weights, groups, vocab, **options), {})

    assert check(program(), roles=roles).failure is None
    for first, second in ((GATE0, UP0), (K0, "model.layers.0.self_attn.v_proj")):
        failure = check(program((first, second)), roles=roles).failure or ""
        assert failure.startswith(f"quantized tensor {first}:") and f"its reference weight {first}.weight" in failure, \
            failure
        assert check(program((first, second))).failure is None  # by value: what was paired before
    by_value: list[str] = []
    assert check(program((GATE0, UP0), known=False), roles=roles, by_value=by_value).failure is None
    assert "model.layers.0.mlp.{gate_proj,up_proj}" in by_value and \
        "model.layers.0.self_attn.{k_proj,v_proj}" in by_value, by_value

"""The RMSNorm / RoPE / view rewrites that keep exported decoder layers inside XNNPACK."""

from __future__ import annotations

import pytest
import torch

from pit_deploy.targets.executorch import llm_ops
from pit_deploy.exporters.passes import prepare
from pit_deploy.targets.executorch.export import StaticKVDecoder, _kv_geometry, lower_to_edge
from pit_deploy.targets.executorch.xnnpack_rewrites import LinearRMSNorm, rotate_half_matrix, xnnpack_friendly
from pit_deploy.tiny import tiny_pit_model

REWRITTEN = ("llama", "qwen3", "granite")


def test_rotate_half_matrix_is_rotate_half():
    from transformers.models.llama.modeling_llama import rotate_half

    x = torch.randn(2, 3, 5, 16)
    assert torch.equal(torch.nn.functional.linear(x, rotate_half_matrix(16)), rotate_half(x))
    with pytest.raises(ValueError):
        rotate_half_matrix(7)


@pytest.mark.parametrize("family", REWRITTEN)
def test_rewrites_keep_the_logits_and_are_undone(family):
    model = prepare(tiny_pit_model(family), "factorized")
    norms_before = [type(m) for m in model.modules()]
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        decoder = StaticKVDecoder(model, 32).eval()
        _, head_dim = _kv_geometry(model.config)
        with xnnpack_friendly(decoder, model, head_dim):
            assert any(isinstance(m, LinearRMSNorm) for m in model.modules())
            got = model(input_ids=ids).logits
    assert float((got - ref).norm() / ref.norm()) < 1e-6
    assert [type(m) for m in model.modules()] == norms_before
    assert not hasattr(decoder, "pit_rope_rotation")


# Full tier (two lowerings of a three-layer model): a structure that decode speed depends on, which
# benchmarks/pte_anchors.py measures; the default tier's .pte verifications check the numbers.
@pytest.mark.full
def test_each_layer_lowers_to_one_partition_per_side_of_the_attention():
    """Between two consecutive attention calls (the ``llama::custom_sdpa`` custom op, which has
    to run outside XNNPACK) lies exactly one delegate: the output projection, the MLP, the next
    layer's RMSNorm, its q/k/v projections and RoPE. Without the rewrites the RMSNorm mean, the
    RoPE slices and the views of the dynamic length split it into about five. After the last
    attention, one slice outside the delegate picks the last position (a dynamic offset, which
    XNNPACK's static slice cannot take) for the head."""
    assert llm_ops.available()
    model = prepare(tiny_pit_model("llama", num_layers=3), "factorized")
    nodes, gaps = _partition_gaps(model, rewrites=True)
    last_attention = max(i for i, n in enumerate(nodes) if "custom_sdpa" in str(n.target))
    slices = [i for i, n in enumerate(nodes) if "aten.slice_copy" in str(n.target)]
    assert len(slices) == 1 and slices[0] > last_attention, slices
    outside = " ".join(str(n.target) for n in nodes)
    for refused in ("aten.mean.dim", "aten.rsqrt", "aten.mul.Tensor"):
        assert refused not in outside, refused
    assert gaps == [1] * (model.config.num_hidden_layers - 1), gaps
    _, plain = _partition_gaps(model, rewrites=False)
    assert min(plain) > 1, plain  # what the rewrites remove


def _partition_gaps(model, rewrites: bool):
    """The forward's operators outside delegates, and the number of delegate calls between each
    pair of consecutive attention calls."""
    edge, used = lower_to_edge(model, 32, interface_methods=False, rewrites=rewrites)
    assert used
    nodes = [n for n in edge.exported_program("forward").graph.nodes if n.op == "call_function"]
    gaps, current = [], None
    for node in nodes:
        name = str(node.target)
        if "custom_sdpa" in name:
            if current is not None:
                gaps.append(current)
            current = 0
        elif "executorch_call_delegate" in name and current is not None:
            current += 1
    return nodes, gaps


def test_a_pass_runs_where_its_operator_is_and_is_skipped_where_none_is():
    """The trimming rule: a listed pass is kept when a partition holds an operator it rewrites,
    skipped when none is there; a pass the table does not list always runs."""
    from pit_deploy.targets.executorch.idle_passes import TRIGGERS, needed, operator_names

    class Cat(torch.nn.Module):
        def forward(self, x):
            return torch.cat([x, x, x], dim=-1) * 2

    operators = operator_names(torch.fx.symbolic_trace(Cat()))
    assert any("cat" in op for op in operators), operators
    assert needed("DecomposeConcatenate", {"aten.cat.default", "aten.mul.Tensor"})
    assert not needed("DecomposeConcatenate", {"aten.mul.Tensor", "aten.linear.default"})
    assert needed("FuseBatchNormPass", {"aten._native_batch_norm_legit_no_training.default"})
    assert needed("ConvertToSDPAPass", {"aten._softmax.default"})
    assert needed("ChannelsLastTaggedReshapePass", set())  # not listed: always runs
    assert all(not needed(name, {"aten.linear.default"}) for name in TRIGGERS)


# Full tier (four lowerings): a skipped pass that did change the program would change its numbers,
# which every .pte verification of the default tier checks; this test says it is the same bytes.
@pytest.mark.full
@pytest.mark.parametrize("dtype", ["float32", "int4"])
def test_skipping_idle_passes_lowers_the_same_program(dtype):
    """What :mod:`pit_deploy.targets.executorch.idle_passes` skips changes nothing: a tiny
    factorized program, fp32 and int4 (its quantized linears and gather), lowers to the very same
    ``.pte`` bytes with every XNNPACK pass and with the idle ones skipped — and some were skipped."""
    import collections
    import contextlib
    import hashlib

    from pit_deploy.schemes import get_scheme
    from pit_deploy.targets.executorch.export import quantize_linears
    from pit_deploy.targets.executorch.idle_passes import skip_idle_passes
    from pit_deploy.targets.executorch.token_table import quantize_token_table

    model = prepare(tiny_pit_model("llama", num_layers=1), "factorized")
    if dtype == "int4":
        scheme = get_scheme("int4")
        model, _ = quantize_linears(model, scheme.dtype, scheme.group_size, scheme.int4_8bit_layers)
        quantize_token_table(model, scheme.group_size, scheme.pit_correction, table_bits=scheme.table_bits)
    digests, skipped = {}, {}
    for trim in (False, True):
        with skip_idle_passes() if trim else contextlib.nullcontext([]) as names:
            edge, _ = lower_to_edge(model, 32, trim_passes=False)
        digests[trim] = hashlib.sha256(edge.to_executorch().buffer).hexdigest()
        skipped[trim] = collections.Counter(names)
    assert digests[True] == digests[False]
    assert not skipped[False] and {"DecomposeBatchNorm", "Conv1dUnsqueezePass"} <= set(skipped[True]), skipped

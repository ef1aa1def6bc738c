"""The materialize / factorize passes on tiny models of every family."""

from __future__ import annotations

import pytest
import torch

from pit_deploy.model.inspect import find_interface
from pit_deploy.errors import PitError
from pit_deploy.exporters.passes import InterfaceProbe, PITFactors, factorize, materialize, prepare
from pit_deploy.model.modules import PITEmbedding, PITHead
from pit_deploy.tiny import FAMILIES, tiny_model, tiny_pit_model


def _pit(family):
    return tiny_pit_model(family, t_seed=3)


@pytest.mark.parametrize("family", FAMILIES)
def test_passes_preserve_logits(family):
    model = _pit(family)
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
        for twin in (factorize(model), materialize(model)):
            got = twin(ids).logits
            rel = float((got - ref).norm() / ref.norm())
            assert rel < 1e-5, rel


def test_factorized_state_holds_z_once_and_no_solve():
    model = _pit("llama")
    twin = factorize(model)
    state = twin.state_dict()
    big = [k for k, v in state.items() if v.numel() == 512 * 64]
    assert big == ["pit_factors.Zt"]
    assert tuple(state["pit_factors.Zt"].shape) == (64, 512)
    assert not any(k.startswith("pit_interface") for k in state)
    emb, head = twin.get_input_embeddings(), twin.get_output_embeddings()
    assert isinstance(emb, PITEmbedding) and isinstance(head, PITHead)
    # the same modules as training, reading the export-time constants (one shared object)
    assert isinstance(emb.interface, PITFactors) and emb.interface is head.interface
    assert "pit" not in twin.config.to_dict()
    # the original is untouched
    assert find_interface(model) is not None


def test_factorize_copies_no_token_table_and_leaves_the_model_alone():
    """Cast, the factorized copy's ``Zᵀ`` and body are its own tensors, ``Zᵀ`` equal to the float64
    route's rounding; the model keeps its interface, dtype and values (the copy shares the
    interface object while it is made, never after)."""
    model = _pit("llama")
    interface = find_interface(model)
    z = interface.Z.detach().clone()
    twin = factorize(model, torch.bfloat16)
    zt = twin.pit_factors.Zt
    assert zt.dtype == torch.bfloat16 and torch.equal(zt, z.to(torch.float64).T.to(torch.bfloat16))
    assert interface.Z.dtype == torch.float32 and torch.equal(interface.Z.detach(), z)
    assert find_interface(model) is interface and find_interface(twin) is None
    ours = {t.data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    assert not ours & {t.data_ptr() for t in list(twin.parameters()) + list(twin.buffers())}


def test_factorize_in_the_model_dtype_reads_the_model_tensors_and_swaps_none_of_them():
    """In the model's own dtype the copy holds no second token table or body: ``Zᵀ`` is a view of
    ``Z`` and each body weight is the model's data under the copy's own ``Parameter`` — so a
    ``.data`` swap or a cast of the copy (what the exporters do) leaves the model as it was."""
    model = _pit("llama")
    interface = find_interface(model)
    z = interface.Z.detach().clone()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    twin = factorize(model)
    assert torch.equal(twin.pit_factors.Zt, z.T) and twin.pit_factors.Zt.data_ptr() == interface.Z.data_ptr()
    ours = dict(model.named_parameters())
    theirs = dict(twin.named_parameters())
    body = [name for name in theirs if name in ours]
    assert body and all(theirs[n].data_ptr() == ours[n].data_ptr() and theirs[n] is not ours[n] for n in body)
    weight = theirs[body[0]]
    weight.data = torch.zeros_like(weight)  # what onnx-genai's builder hook does to the embedding table
    twin.to(torch.float16)
    assert all(p.dtype == torch.float32 and torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    assert find_interface(model) is interface


def test_materialize_copies_the_body_unless_the_export_pass_shares_it():
    """``materialize_model`` gives a model of its own (it may be trained); the export pass's copy
    reads the PIT model's body tensors, holds its own two tables, and is the same model."""
    from pit_deploy.converters.materialize import materialize_model

    model = _pit("llama")
    ours = {p.data_ptr() for p in model.parameters()}
    own = materialize_model(model)
    assert not ours & {p.data_ptr() for p in own.parameters()}
    shared = materialize(model)
    tables = {shared.get_input_embeddings().weight.data_ptr(), shared.get_output_embeddings().weight.data_ptr()}
    body = {p.data_ptr() for p in shared.parameters()} - tables
    assert body and body <= ours and not tables & ours
    assert all(torch.equal(a, b) for a, b in zip(own.state_dict().values(), shared.state_dict().values()))
    assert all(p.dtype == torch.float16 for p in materialize(model, torch.float16).parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("family", ["llama", "granite", "gemma3"])
def test_table_rows_are_the_materialized_tables_a_slice_at_a_time(family):
    """``TableRows`` computes the rows ``materialize_model`` stores (the family's multipliers
    undone), for a slice or an index array; ``tables=False`` gives the same body without them."""
    import numpy as np

    from pit_deploy.converters.materialize import TableRows, materialize_model

    model = _pit(family)
    plain = materialize_model(model, torch.float32, share_body=True)
    bare = materialize_model(model, torch.float32, share_body=True, tables=False)
    table, head = plain.get_input_embeddings().weight.detach(), plain.get_output_embeddings().weight.detach()
    rows = np.array([3, 0, table.shape[0] - 1])
    for which, full in (("table", table), ("head", head)):
        lazy = TableRows(model, which)
        assert lazy.shape == tuple(full.shape)
        np.testing.assert_array_equal(lazy[5:40], full[5:40].numpy())
        np.testing.assert_array_equal(lazy[rows], full[torch.from_numpy(rows)].numpy())
    tables = {"model.embed_tokens.weight", "lm_head.weight"}
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in bare.state_dict().items() if k not in tables)
    with pytest.raises(PitError, match="plain embeddings"):
        TableRows(tiny_model("llama"), "table")


def test_t_inverse_is_float64_accurate():
    model = _pit("qwen3")
    f = factorize(model).pit_factors
    eye = torch.eye(64, dtype=torch.float64)
    assert float((f.T.double() @ f.T_inv.double() - eye).abs().max()) < 1e-5


@pytest.mark.parametrize("family", ["granite", "gpt2"])
def test_probe_gives_effective_interface(family):
    model = _pit(family)
    e_ref, w_ref = find_interface(model).materialize()
    for twin in (factorize(model), materialize(model)):
        probe = InterfaceProbe(twin)
        with torch.no_grad():
            e = probe.embed(torch.arange(512)).double()
            w = probe.head_logits(torch.eye(64)).double()
        assert torch.allclose(e, e_ref, atol=1e-5) and torch.allclose(w, w_ref, atol=1e-5)
        delta = torch.linalg.matrix_norm(w @ e - torch.eye(64, dtype=torch.float64))
        assert delta < 1e-5


def test_passes_refuse_plain_models_and_unknown_modes():
    with pytest.raises(PitError, match="PIT model"):
        factorize(tiny_model("llama"))
    with pytest.raises(PitError, match="unknown export mode"):
        prepare(_pit("llama"), "quantized")


def test_onnx_export_leaves_no_forward_on_the_model(tmp_path):
    """optimum's patcher assigns the restored `forward` on the instance; the exporter removes it
    so a later `.pte` export of the same model traces the class's forward (Gemma failed)."""
    from pit_deploy.targets.onnx.export import export_onnx

    model = prepare(tiny_pit_model("llama"), "factorized")
    assert "forward" not in vars(model)
    export_onnx(model, tmp_path / "onnx")
    assert "forward" not in vars(model)


def test_llm_ops_decoder_matches_the_model_in_eager():
    """The custom-op cache update and attention (ExecuTorch's llama::update_cache and
    llama::custom_sdpa, run eagerly through their CPU kernels) give the model's own logits,
    one-call prefill then single-token decode, for every family that uses them."""
    from pit_deploy.targets.executorch import llm_ops
    from pit_deploy.targets.executorch.export import StaticKVDecoder

    assert llm_ops.available(), "the pinned executorch ships its LLM custom ops"
    for family in ("llama", "qwen3", "granite"):
        model = prepare(tiny_pit_model(family), "factorized")
        ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref = model(input_ids=ids).logits
            saved = model.config._attn_implementation
            model.config._attn_implementation = llm_ops.ATTN_NAME
            try:
                dec = StaticKVDecoder(model, 64, llm_ops=True).eval()
                parts = [dec(ids[:, :12], torch.tensor([0]))]
                parts += [dec(ids[:, i:i + 1], torch.tensor([i])) for i in range(12, 20)]
            finally:
                model.config._attn_implementation = saved
        got = torch.cat(parts, dim=1)
        assert float((got - ref).norm() / ref.norm()) < 1e-5, family

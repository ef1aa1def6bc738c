"""The source-preserving conversion on tiny models of every family it covers: the body is
exact after folding and rotation, W_out E = I, the fitted head is closer to the source than
every paper init, the checkpoint round-trips, and LayerNorm families are refused clearly.

Gemma is the family whose norms multiply by ``1 + w`` and whose embeddings are scaled by
``√d``: its gains are set through the effective gain, so it meets negative gains too."""

from __future__ import annotations

import torch
import pytest

from pit_deploy.converters import convert_model
from pit_deploy.converters.preserve import PRESERVE_FAMILIES, fit_symmetric, weighted_misfit
from pit_deploy.errors import PitError
from pit_deploy.io.checkpoint import load_pit_model, save_model
from pit_deploy.model.families import adapter_for
from pit_deploy.model.inspect import effective_interface, interface_delta_ti
from pit_deploy.tiny import ALL_FAMILIES, GEMMA_FAMILIES, tiny_config, tiny_model

#: the families whose conversion rotates the residual stream: llama, qwen3, granite, gemma, …
FAMILIES = [f for f in ALL_FAMILIES if tiny_config(f).model_type in PRESERVE_FAMILIES
            and not adapter_for(tiny_config(f)).post_norms]
#: Gemma 2 and 3: their blocks normalize their outputs, the body is kept as it is
POST_NORM_FAMILIES = list(GEMMA_FAMILIES)


def _source(family: str) -> torch.nn.Module:
    """A tiny model whose effective norm gains are not all one (block norms and the final
    norm, one negative): with unit gains ``A = H²`` is symmetric and any method would look
    exact. The stored weight is the gain less the family's offset (Gemma stores ``w = g − 1``)."""
    model = tiny_model(family).eval()
    offset = PRESERVE_FAMILIES[model.config.model_type]
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.5 * torch.randn(param.shape, generator=gen) - offset)
        final = adapter_for(model.config).final_norm(model).weight
        gain0 = float(final[0]) + offset
        final[0] = -abs(gain0) - 0.5 - offset
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(3))


def _kl(ref: torch.Tensor, logits: torch.Tensor) -> float:
    lp_ref, lp = torch.log_softmax(ref.double(), -1), torch.log_softmax(logits.double(), -1)
    return float((lp_ref.exp() * (lp_ref - lp)).sum(-1).mean())


@pytest.mark.parametrize("family", FAMILIES)
def test_body_is_exact_after_folding_and_rotation(family):
    src = _source(family)
    ids = _ids()
    captured = {}

    def hook(name):
        return lambda _m, args: captured.__setitem__(name, args[0].detach().double())

    h = adapter_for(src.config).final_norm(src).register_forward_pre_hook(hook("src"))
    with torch.no_grad():
        src(ids)
    h.remove()
    pit = convert_model(_source(family), "preserve")
    rot = pit.pit_interface.Z.detach().double()  # Z = U R
    h = adapter_for(pit.config).final_norm(pit).register_forward_pre_hook(hook("pit"))
    with torch.no_grad():
        pit(ids)
    h.remove()
    # R from Z = U R (U: polar factor of the source embedding): R = Uᵀ Z
    from pit_deploy.model.core import polar_factor

    e_eff, _, _ = effective_interface(_source(family))
    u, _ = polar_factor(e_eff)
    r = u.double().T @ rot
    assert torch.allclose(r.T @ r, torch.eye(r.shape[0], dtype=torch.float64), atol=1e-5)
    expected = captured["src"] @ r
    scale = expected.abs().max()
    assert float((captured["pit"] - expected).abs().max() / scale) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_interface_is_exact_and_closer_than_every_paper_init(family):
    ids = _ids()
    src = _source(family)
    with torch.no_grad():
        ref = src(ids).logits
    kls = {}
    for t_init in ("identity", "input", "output", "preserve"):
        model = convert_model(_source(family), t_init)
        assert interface_delta_ti(model) < 1e-5
        with torch.no_grad():
            kls[t_init] = _kl(ref, model(ids).logits)
    assert kls["preserve"] < min(kls[t] for t in ("identity", "input", "output")), kls


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_checkpoint_round_trip_keeps_the_logits(tmp_path, family):
    model = convert_model(_source(family), "preserve")
    assert model.config.pit["t_init"] == "preserve"
    assert model.config.pit["preserve"]["misfit_fitted"] <= model.config.pit["preserve"]["misfit_identity_rotation"]
    save_model(model, tmp_path / "pit")
    again = load_pit_model(tmp_path / "pit")
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)


def test_layernorm_family_is_refused_with_a_paper_init_named():
    with pytest.raises(PitError, match="LayerNorm.*--t-init identity, input or output"):
        convert_model(tiny_model("gpt2"), "preserve")


def test_gemma_gains_are_stored_as_one_plus_w():
    """Gemma's norms multiply by ``1 + w``: the source has negative effective block gains, the
    folded block norms are left at ``w = 0`` (gain 1) and the final norm stores ``w = D − 1``."""
    src = _source("gemma")
    block = [p for n, p in src.named_parameters() if n.endswith("layernorm.weight")]
    assert any(bool((1.0 + p < 0).any()) for p in block)
    model = convert_model(src, "preserve")
    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight"):
            assert torch.count_nonzero(param) == 0, name
    stored = 1.0 + adapter_for(model.config).final_norm(model).weight.detach().double()
    fit = model.config.pit["preserve"]
    assert abs(float(stored.min()) - fit["gain_min"]) < 1e-5 * max(1.0, abs(fit["gain_min"]))
    assert abs(float(stored.max()) - fit["gain_max"]) < 1e-5 * max(1.0, abs(fit["gain_max"]))
    # the effective interface is what Gemma's forward uses: the body reads √d · E_stored = E
    # (the PIT embedding divides by √d, Gemma multiplies it back) and the logits are h W_out
    ids = _ids()
    e, w, _ = effective_interface(model)
    with torch.no_grad():
        out = model.model(ids, output_hidden_states=True)
        logits = model(ids).logits.double()
    first = out.hidden_states[0].double()
    assert torch.allclose(first, e[ids], rtol=1e-5, atol=1e-6 * float(e.abs().max()))
    head = out.last_hidden_state.double() @ w
    assert float((logits - head).abs().max() / logits.abs().max()) < 1e-5


@pytest.mark.parametrize("family", POST_NORM_FAMILIES)
def test_post_norm_families_keep_the_body_and_fit_a_diagonal_gain(family):
    """Gemma 2 and 3 normalize block outputs before they join the residual stream, so no
    rotation is a symmetry: the conversion keeps every body weight and the embedding (``Z = U``,
    ``E = E0``), fits only the final gain, and the fitted gain is no worse than the source's on
    the weighted objective; ``W_out E = I`` as for every conversion."""
    src = _source(family)
    model = convert_model(_source(family), "preserve")
    assert interface_delta_ti(model) < 1e-5
    final = adapter_for(model.config).final_norm(model)
    source = dict(src.named_parameters())
    for name, param in model.named_parameters():
        if name in source and param is not final.weight and "embed" not in name and "lm_head" not in name:
            assert torch.equal(param, source[name]), name
    e_src, _, _ = effective_interface(src)
    e_pit, _, _ = effective_interface(model)
    assert float((e_pit - e_src).abs().max() / e_src.abs().max()) < 1e-5
    fit = model.config.pit["preserve"]
    assert fit["misfit_fitted"] <= fit["misfit_identity_rotation"]
    ids = _ids()
    with torch.no_grad():  # the first hidden state is the source's: the body reads E0
        first = model.model(ids, output_hidden_states=True).hidden_states[0]
        first_src = src.model(ids, output_hidden_states=True).hidden_states[0]
    assert float((first - first_src).abs().max() / first_src.abs().max()) < 1e-5


def test_diagonal_fit_solves_the_summed_problem():
    """The diagonal fit's gradient on the diagonal vanishes and it beats diagonal perturbations."""
    from pit_deploy.converters.preserve import fit_diagonal_grouped, grouped_misfit

    gen = torch.Generator().manual_seed(2)
    d = 6
    a = torch.randn(d, d, generator=gen, dtype=torch.float64)
    terms = [(w, _spd(gen, d), _spd(gen, d)) for w in (1.0, 2.0)]
    g = fit_diagonal_grouped(a, terms)
    assert torch.equal(g, torch.diag(torch.diagonal(g)))
    grad = sum(w * (ck @ (g - a) @ pk) for w, ck, pk in terms)
    assert float(torch.diagonal(grad).abs().max()) < 1e-9 * float(sum(w * (ck @ a @ pk) for w, ck, pk in terms).abs().max())
    best = grouped_misfit(g, a, terms)
    for _ in range(20):
        e = torch.diag(torch.randn(d, generator=gen, dtype=torch.float64) * 1e-3)
        assert grouped_misfit(g + e, a, terms) >= best


def test_fit_solves_the_weighted_problem():
    """The closed form beats random symmetric perturbations of itself (it is the minimizer)."""
    gen = torch.Generator().manual_seed(0)
    d = 6
    a = torch.randn(d, d, generator=gen, dtype=torch.float64)
    m1, m2 = torch.randn(d, d, generator=gen, dtype=torch.float64), torch.randn(d, d, generator=gen, dtype=torch.float64)
    c, p = m1 @ m1.T + 0.1 * torch.eye(d, dtype=torch.float64), m2 @ m2.T + 0.1 * torch.eye(d, dtype=torch.float64)
    g = fit_symmetric(a, c, p)
    assert torch.allclose(g, g.T)
    best = weighted_misfit(g, a, c, p)
    for _ in range(20):
        e = torch.randn(d, d, generator=gen, dtype=torch.float64) * 1e-3
        assert weighted_misfit(g + e + e.T, a, c, p) >= best
    # a symmetric A is recovered exactly
    s = a + a.T
    assert torch.allclose(fit_symmetric(s, c, p), s, atol=1e-8)


def _spd(gen: torch.Generator, d: int) -> torch.Tensor:
    m = torch.randn(d, d, generator=gen, dtype=torch.float64)
    return m @ m.T + 0.1 * torch.eye(d, dtype=torch.float64)


def test_grouped_fit_solves_the_summed_problem():
    """With one term the grouped fit is the closed form; with several, its gradient projected on
    symmetric matrices vanishes, it beats symmetric perturbations of itself and both the
    pooled closed form and each term's own fit on the summed objective."""
    from pit_deploy.converters.preserve import fit_symmetric_grouped, grouped_misfit

    gen = torch.Generator().manual_seed(1)
    d = 7
    a = torch.randn(d, d, generator=gen, dtype=torch.float64)
    c, p = _spd(gen, d), _spd(gen, d)
    assert torch.allclose(fit_symmetric_grouped(a, [(3.0, c, p)]), fit_symmetric(a, c, p), atol=1e-10)
    terms = [(w, _spd(gen, d), _spd(gen, d)) for w in (1.0, 4.0, 0.5)]
    g = fit_symmetric_grouped(a, terms)
    assert torch.allclose(g, g.T)
    grad = sum(w * (ck @ (g - a) @ pk + pk @ (g - a).T @ ck) for w, ck, pk in terms)
    # the iterations run in float32: the gradient vanishes to float32 precision
    assert float(grad.norm()) < 1e-5 * float(sum(w * (ck @ a @ pk) for w, ck, pk in terms).norm())
    best = grouped_misfit(g, a, terms)
    for _ in range(20):
        e = torch.randn(d, d, generator=gen, dtype=torch.float64) * 1e-3
        assert grouped_misfit(g + e + e.T, a, terms) >= best
    total = sum(w for w, _, _ in terms)
    pooled = fit_symmetric(a, sum(w * ck for w, ck, _ in terms) / total, sum(w * pk for w, _, pk in terms) / total)
    for other in [pooled] + [fit_symmetric(a, ck, pk) for _, ck, pk in terms]:
        assert grouped_misfit(other, a, terms) > best


def test_position_groups_and_the_shared_chat_prefix():
    """A chat row's positions split into prompt, first answer token and answer; a plain row is
    all text; the chat template's shared prefix counts once: left out of every chat row after
    the first."""
    from pit_deploy.converters.preserve import (ANSWER, FIRST_ANSWER, PROMPT, TEXT, CalibrationSet, _shared_prefix,
                                             position_groups)

    assert position_groups(4, None) == [TEXT] * 4
    assert position_groups(6, 3) == [PROMPT, PROMPT, FIRST_ANSWER, ANSWER, ANSWER, ANSWER]
    assert position_groups(6, 3, skip=1) == [None, PROMPT, FIRST_ANSWER, ANSWER, ANSWER, ANSWER]
    rows = [torch.tensor([5, 6, 7, 8, 9]), torch.tensor([5, 6, 2, 3]), torch.tensor([5, 1, 2])]
    assert _shared_prefix(CalibrationSet(rows[:2], [None, None], [3, 3])) == 2
    assert _shared_prefix(CalibrationSet(rows, [None] * 3, [3, 3, None])) == 2
    assert _shared_prefix(CalibrationSet(rows, [None] * 3, [3, 3, 2])) == 1
    assert _shared_prefix(CalibrationSet(rows[:1], [None], [3])) == 0


def test_conversion_study_holds_out_the_calibration_prompts():
    """``studies/conversion.py`` scores chat fidelity on prompts the conversion never saw:
    none of its held-out chat prompts may be one of the calibration prompts."""
    import ast
    from pathlib import Path

    from pit_deploy.converters.preserve import CALIB_PROMPTS

    tree = ast.parse((Path(__file__).parents[1] / "studies" / "conversion.py").read_text())
    held_out = next(ast.literal_eval(node.value) for node in tree.body
                    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "CHAT_PROMPTS")
    assert len(held_out) == 16
    assert not set(held_out) & set(CALIB_PROMPTS)


def test_chat_rows_batched_equal_one_by_one_generation():
    """Calibration chat rows are generated in left-padded batches; each row must be what greedy
    generation of that prompt alone gives (prompt + answer up to its end-of-sequence token), and
    the budget stops adding rows once reached."""
    from pit_deploy.converters.preserve import CALIB_PROMPTS, chat_rows
    from pit_deploy.tiny import tiny_model, tiny_tokenizer

    model = tiny_model("llama").eval()
    tok = tiny_tokenizer(model.config.vocab_size)
    tok.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}<s>"
    prompts = CALIB_PROMPTS[:5]
    rows = chat_rows(model, tok, prompts, max_new_tokens=12, batch=3)
    assert len(rows) == 5
    for text, row in zip(prompts, rows):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = list(ids) if isinstance(ids, list) else list(ids["input_ids"])
        alone = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                               pad_token_id=tok.eos_token_id)[0].tolist()
        assert row.tolist() == alone
    first_two = sum(len(r) for r in rows[:2])
    assert len(chat_rows(model, tok, prompts, max_new_tokens=12, batch=3, budget=first_two)) == 2


@pytest.mark.parametrize("family", FAMILIES + ["gemma2"])  # Gemma 2: the final soft-capping too
def test_generation_states_give_the_forward_pass_statistics(family):
    """The chat rows' statistics come from the hidden states their batched, left-padded
    generation computed (no second pass): they must equal the statistics of a forward pass
    over each row (fp32 rounding apart), with only the last position of a row still
    generating at the final step left out."""
    from pit_deploy.converters.preserve import (CALIB_PROMPTS, CalibrationSet, _shared_prefix, calibration_stats,
                                             chat_calibration)
    from pit_deploy.model.core import polar_factor
    from pit_deploy.tiny import tiny_tokenizer

    model = _source(family)
    tok = tiny_tokenizer(model.config.vocab_size)
    tok.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}<s>"
    calib = chat_calibration(model, tok, CALIB_PROMPTS[:5], max_new_tokens=10, batch=3)
    assert [len(s) for s in calib.states] != [len(r) for r in calib.rows]  # some row hit the step limit
    assert all(len(r) - 1 <= len(s) <= len(r) for r, s in zip(calib.rows, calib.states))
    u, _ = polar_factor(effective_interface(model)[0])
    reused = calibration_stats(model, calib, u)
    trimmed = [r[:len(s)] for r, s in zip(calib.rows, calib.states)]  # the positions that have states
    forward = calibration_stats(model, CalibrationSet(trimmed, [None] * len(trimmed), calib.prompt_lens), u)
    assert reused.tokens == forward.tokens
    shared = _shared_prefix(calib)  # counted in the first chat row only
    assert shared > 0 and reused.tokens == sum(len(s) for s in calib.states) - shared * (len(calib.rows) - 1)
    assert [g.name for g in reused.groups] == [g.name for g in forward.groups]
    for mine, theirs in zip(reused.groups, forward.groups):
        assert mine.tokens == theirs.tokens
        for got, want in ((mine.second_moment, theirs.second_moment), (mine.fisher, theirs.fisher)):
            assert float((got - want).norm() / want.norm()) < 1e-5


def test_the_calibration_softmax_in_place_is_the_softmax_of_the_whole():
    """The probabilities are written over the logits a few rows at a time (no second
    sequence-long tensor at a 262k-token vocabulary): bit for bit one softmax of the whole."""
    from pit_deploy.converters.preserve import SOFTMAX_ROWS, softmax_in_place

    logits = 4 * torch.randn(2 * SOFTMAX_ROWS + 3, 1001, generator=torch.Generator().manual_seed(0))
    expected = torch.softmax(logits, dim=-1)
    got = softmax_in_place(logits)
    assert got.data_ptr() == logits.data_ptr() and torch.equal(got, expected)

"""The compact check of ``verify --isa aarch64`` (:mod:`pit_deploy.evaluate.cross_isa`): a tiny
model's fp32 and int4 ONNX artifacts pass on two emulated CPU profiles, a scrambled int4 body
fails there (it computes the same wrong logits on both ISAs, so the reference catches it), and
the judgement itself fails what it must on made-up outputs, without emulation.

The emulated runs take seconds for a tiny model, so they run in the default tier; the whole
emulated verification (``--full``) is in ``test_verify_aarch64.py`` (full tier)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from pit_deploy.cli import main
from pit_deploy.evaluate.cross_isa import KL_FRACTION, PROMPT_STEPS, Outputs, Plan, judge
from pit_deploy.evaluate.verify import ArtifactResult
from pit_deploy.io.checkpoint import save_model
from pit_deploy.io.manifest import Manifest
from pit_deploy.schemes import bounds_for
from pit_deploy.tiny import tiny_pit_model, tiny_tokenizer

PROFILES = "cortex-a76,max"


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """A tiny Llama's factorized fp32 and int4 onnx artifacts (plain rounding: quick)."""
    root = tmp_path_factory.mktemp("cross-isa")
    save_model(tiny_pit_model("llama"), root / "src", tiny_tokenizer())
    out = root / "exp"
    assert main(["export", str(root / "src"), "--out", str(out), "--runtime", "onnx", "--mode", "factorized",
                 "--dtype", "float32,int4", "--rounding", "rtn", "--max-seq-len", "64"]) == 0
    return out


def _verify(capsys, *argv: str) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(["verify", *argv, "--no-record", "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_an_honest_export_passes_the_compact_check_on_two_profiles(arm_compact, export, capsys):
    code, report = _verify(capsys, str(export), "--isa", "aarch64", "--arm-cpu", PROFILES)
    assert code == 0, report
    rows = report["artifacts"]
    assert [(r["scheme"], r["arm_cpu"]) for r in rows] == [
        ("float32", "cortex-a76"), ("float32", "max"), ("int4", "cortex-a76"), ("int4", "max")]
    for r in rows:
        c = r["cross_isa"]
        assert r["isa"] == "aarch64" and r["passed"] and not c["failures"], r["failures"]
        assert c["positions"] > 3 * PROMPT_STEPS and c["interface_rel_l2"] <= 1e-4
        assert any("delta_ti is not measured on aarch64" in n for n in r["notes"])
        assert r["delta_ti"] is None or math.isnan(r["delta_ti"])  # not measured, never reported as a pass
        if r["scheme"] == "float32":
            assert c["rel_l2"] <= 1e-4 and c["greedy_identical"] and c["kl_bound"] is None
            assert r["logits_rel_l2"] <= 1e-4 and r["top1_agreement"] == 1
        else:
            assert c["kl_mean"] <= c["kl_bound"] and r["kl_mean"] is not None and r["heldout_tokens"] > 0
            assert c["kl_bound"] == pytest.approx(KL_FRACTION * r["expected_kl_mean"])


def test_a_scrambled_int4_body_fails_the_compact_check(arm_compact, export, tmp_path, capsys):
    from scramble import rehash, scramble_onnx_body

    out = tmp_path / "exp"
    shutil.copytree(export, out)
    art = next(a for a in Manifest.read(out).artifacts if a.scheme_name == "int4")
    assert scramble_onnx_body(out / art.path) > 0
    rehash(out)
    code, report = _verify(capsys, str(out), "--dtype", "int4", "--isa", "aarch64", "--arm-cpu", "cortex-a76")
    assert code == 1
    (row,) = report["artifacts"]
    # the same wrong weights on both ISAs: the comparison with the reference is what fails it
    assert not row["passed"] and any("kl_mean" in f for f in row["failures"]), row["failures"]


def _plan(vocab: int = 50) -> Plan:
    prompt = [1, 2, 3]
    return Plan(sequences=[(prompt + [4] * (PROMPT_STEPS - 1), len(prompt)), (list(range(10, 30)), 16)],
                prompts=1, greedy=[[4] * PROMPT_STEPS], ids=[0, 5, 7], rows=[0, 1])


def _outputs(plan: Plan, seed: int, vocab: int = 50, dim: int = 8) -> Outputs:
    gen = torch.Generator().manual_seed(seed)
    logits = [torch.randn(len(ids), vocab, generator=gen) * 3 for ids, _ in plan.sequences]
    for i in range(plan.prompts):  # the x86 artifact's greedy choices are its own argmaxes
        ids, prefill = plan.sequences[i]
        logits[i][prefill - 1:, 4] = 50.0
    return Outputs(logits, torch.randn(len(plan.ids), dim, generator=gen), torch.randn(len(plan.rows), vocab,
                                                                                       generator=gen))


def _row(scheme: str, expected: float | None = None) -> ArtifactResult:
    return ArtifactResult(runtime="onnx", mode="factorized", dtype=scheme, scheme=scheme, isa="aarch64",
                          expected_kl_mean=expected, expected_kl_p99=None if expected is None else 10 * expected)


def test_the_judgement_fails_a_deviation_beyond_a_tenth_of_the_expected_kl():
    plan = _plan()
    x86 = _outputs(plan, 0)
    close = Outputs([t + 1e-4 * torch.randn_like(t) for t in x86.logits], x86.emb, x86.head)
    far = Outputs([t + 0.3 * torch.randn_like(t) for t in x86.logits], x86.emb, x86.head)
    bounds = bounds_for("int4")
    quiet = judge(_row("int4", 0.05), plan, x86, close, x86.logits, bounds, True)
    assert quiet.passed and quiet.cross_isa["kl_bound"] == pytest.approx(0.005), quiet.failures
    loud = judge(_row("int4", 0.05), plan, x86, far, x86.logits, bounds, True)
    assert not loud.passed and any("KL from x86 to aarch64" in f for f in loud.failures), loud.failures
    assert loud.cross_isa["kl_mean"] > 0.005
    # no expected figure in the manifest: a tenth of the scheme's kl_mean bound, and said so
    fallback = judge(_row("int4"), plan, x86, far, x86.logits, bounds, True)
    assert fallback.cross_isa["kl_bound"] == pytest.approx(KL_FRACTION * bounds.kl_mean)


def test_the_judgement_fails_other_greedy_tokens_and_another_interface_in_fp32():
    plan = _plan()
    x86 = _outputs(plan, 0)
    bounds = bounds_for("float32")
    same = judge(_row("float32"), plan, x86, x86, x86.logits, bounds, False)
    assert same.passed and same.cross_isa["greedy_identical"], same.failures
    flipped = [t.clone() for t in x86.logits]
    flipped[0][-1, 9] = 100.0  # the last greedy step picks another token on aarch64
    other = judge(_row("float32"), plan, x86, Outputs(flipped, x86.emb, x86.head), x86.logits, bounds, False)
    assert not other.passed and any("greedy tokens differ" in f for f in other.failures), other.failures
    moved = Outputs(x86.logits, x86.emb * 1.01, x86.head)
    iface = judge(_row("float32"), plan, x86, moved, x86.logits, bounds, False)
    assert not iface.passed and any("interface sample" in f for f in iface.failures), iface.failures
    nan = [t.clone() for t in x86.logits]
    nan[1][3, 0] = float("nan")
    bad = judge(_row("float32"), plan, x86, Outputs(nan, x86.emb, x86.head), x86.logits, bounds, False)
    assert not bad.passed and any("non-finite" in f for f in bad.failures), bad.failures

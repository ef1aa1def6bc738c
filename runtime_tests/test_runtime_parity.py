"""Parity of every family × mode × runtime on tiny random PIT models, and of the real model.

Each test asserts the FP32 bounds of ``pit_deploy.evaluate.verify`` one by one, so a failure names the
bound and the measured number.
"""

from __future__ import annotations

import pytest

from pit_deploy.exporters.recipes import MODES
from pit_deploy.targets import default_target_names
from pit_deploy.tiny import FAMILIES
from pit_deploy.evaluate.verify import DELTA_TI_BOUND, GREEDY_TOKENS, REL_L2_BOUND

RUNTIMES = default_target_names()  # the opt-in onnx-genai has its own tests

# What the session exports of the real model: every runtime × mode (conftest.py).
REAL_PAIRS = [(runtime, mode) for runtime in RUNTIMES for mode in MODES]


def assert_bounds(r) -> None:
    assert r.logits_rel_l2 <= REL_L2_BOUND, f"logits_rel_l2 {r.logits_rel_l2:.3e}"
    assert r.decode_rel_l2 <= REL_L2_BOUND, f"decode_rel_l2 {r.decode_rel_l2:.3e}"
    assert r.top1_agreement == 1.0, f"top1_agreement {r.top1_agreement:.4%}"
    assert r.greedy_tokens == GREEDY_TOKENS
    assert r.greedy_match, "greedy continuation differs"
    assert r.delta_ti <= DELTA_TI_BOUND, f"delta_ti {r.delta_ti:.3e}"
    if r.runtime == "onnx":
        assert r.weights_shared is True, r.notes
    if r.runtime == "executorch":  # ExecuTorch's stock LLM runner (TextLLMRunner) with the folder's tokenizer
        runner = r.stock_runner
        assert runner and runner["skipped"] is None and runner["error"] is None, runner
        assert runner["prompts"] >= 3 and runner["identical"], runner["mismatches"]
    assert r.passed and not r.failures, r.failures


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_parity(exports, record_figures, family, runtime, mode):
    _, report = exports.tiny(family)
    r = report.result(runtime, mode)
    record_figures(f"tiny-{family} {runtime}-{mode}", r)
    assert_bounds(r)


@pytest.mark.real_model
@pytest.mark.parametrize("runtime,mode", REAL_PAIRS, ids=[f"{r}-{m}" for r, m in REAL_PAIRS])
def test_real_parity(exports, record_figures, runtime, mode):
    _, report = exports.real()
    r = report.result(runtime, mode)
    record_figures(f"SmolLM2-135M {runtime}-{mode}", r)
    assert r.prompts == 3 and "random" not in " ".join(r.notes), "real model must use tokenized prompts"
    assert_bounds(r)

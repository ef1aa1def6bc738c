"""Fixtures of the runtime parity suite.

Tiny random PIT models of every family (with a non-trivial ``T``) are exported once per
session into a temporary directory (every default runtime × mode, static cache of 64; the
opt-in ``onnx-genai`` target has its own tests, ``tests/test_genai_target.py``) and verified
once; each parametrized test then asserts the bounds of one artifact. The real default model
(SmolLM2-135M-Instruct, converted as the main job converts it: the source-preserving conversion,
whose ``T = Rᵀ H⁻¹ R`` is dense and far from the identity) is exported once in both modes for both
runtimes, the materialized ``.pte`` included.

Point the suite at your own export directories with ``--export-dir DIR`` (repeatable) or the
environment variable ``PIT_EXPORT_DIR`` (paths separated by ``os.pathsep``); then
``test_runtime_user_export.py`` verifies every artifact they hold.

The measured figures are printed in the terminal summary (``parity figures``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pit_deploy.exporters.recipes import MODES, Recipe
from pit_deploy.targets import default_target_names
from pit_deploy.tiny import tiny_pit_model, tiny_tokenizer

TINY_MAX_SEQ_LEN = 64
REAL_MAX_SEQ_LEN = 64  # prompts (< 32 tokens) + 32 greedy tokens
REAL_T_INIT = "preserve"  # the main job's conversion (pit-deploy run default, convert's default)

_FIGURES: list[tuple[str, dict]] = []


def pytest_addoption(parser):
    parser.addoption(
        "--export-dir", action="append", default=[],
        help="an export directory to verify (repeatable; also env PIT_EXPORT_DIR)",
    )


def user_export_dirs(config) -> list[str]:
    dirs = list(config.getoption("--export-dir") or [])
    env = os.environ.get("PIT_EXPORT_DIR", "")
    dirs += [d for d in env.split(os.pathsep) if d]
    return dirs


def pytest_generate_tests(metafunc):
    if "user_artifact" in metafunc.fixturenames:
        from pit_deploy.io.manifest import Manifest

        params = []
        for d in user_export_dirs(metafunc.config):
            for art in Manifest.read(d).artifacts:
                params.append(pytest.param((d, art.runtime, art.mode, art.scheme_name), id=f"{Path(d).name}-{art.key}"))
        metafunc.parametrize("user_artifact", params)


@pytest.fixture(scope="session")
def record_figures():
    """``record_figures(label, result)`` keeps one artifact's figures for the terminal summary."""

    def record(label: str, result) -> None:
        _FIGURES.append((label, result))

    return record


def pytest_terminal_summary(terminalreporter):
    if not _FIGURES:
        return
    tr = terminalreporter
    tr.section("parity figures (measured on the runtimes)")
    tr.write_line(f"{'artifact':<38}{'rel_l2':>10}{'max_abs':>10}{'top1':>9}{'greedy':>8}{'delta_ti':>10}  result")
    for label, r in _FIGURES:
        if r.logits_rel_l2 is None:  # a quantized artifact: its KL figures instead of the logit ones
            tr.write_line(f"{label:<38}{'KL':>10}{_num(r.kl_mean):>10}{_pct(r.same_top1):>9}{'':>8}"
                          f"{r.delta_ti:>10.2e}  {'pass' if r.passed else 'FAIL'}")
            continue
        tr.write_line(
            f"{label:<38}{r.logits_rel_l2:>10.2e}{r.logits_max_abs:>10.2e}{r.top1_agreement:>9.2%}"
            f"{'yes' if r.greedy_match else 'NO':>8}{r.delta_ti:>10.2e}  {'pass' if r.passed else 'FAIL'}"
        )


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.2e}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.2%}"


class _Exports:
    """Session cache: export + verify each family once."""

    def __init__(self, root: Path):
        self.root = root
        self.reports: dict[str, object] = {}
        self.dirs: dict[str, Path] = {}

    def tiny(self, family: str):
        if family not in self.reports:
            from pit_deploy.exporters.pipeline import export_model
            from pit_deploy.io.sources import LoadedModel
            from pit_deploy.evaluate.verify import verify_directory

            out = self.root / f"tiny-{family}"
            # with a tokenizer, so the .pte folders carry one and the stock LLM runner runs them
            loaded = LoadedModel(tiny_pit_model(family), tiny_tokenizer(), {"kind": "tiny", "family": family})
            recipe = Recipe(runtimes=default_target_names(), modes=MODES, max_seq_len=TINY_MAX_SEQ_LEN, name="tiny-ci")
            export_model(loaded, out, recipe)
            self.dirs[family] = out
            self.reports[family] = verify_directory(out)
        return self.dirs[family], self.reports[family]

    def real(self):
        if "real" not in self.reports:
            from pit_deploy.exporters.pipeline import export_model, load_pit_source
            from pit_deploy.evaluate.verify import verify_directory

            out = self.root / "real-default"
            loaded = load_pit_source("default", REAL_T_INIT)
            recipe = Recipe(runtimes=default_target_names(), modes=MODES, max_seq_len=REAL_MAX_SEQ_LEN, name="real-ci")
            export_model(loaded, out, recipe)
            self.dirs["real"] = out
            self.reports["real"] = verify_directory(out)
        return self.dirs["real"], self.reports["real"]


@pytest.fixture(scope="session")
def exports(tmp_path_factory) -> _Exports:
    return _Exports(tmp_path_factory.mktemp("exports"))


"""User documentation stays user documentation: a short README that opens with the two set-up
commands, pages of bounded length, generated tables that match the registries and result files,
and no lab-notebook residue (run dates, commit hashes, issue numbers, first-person narration,
in-house jargon) in README.md, docs/, the package (docstrings, comments, CLI help) or its recipes.
Dated history belongs in CHANGELOG.md and the narrative of an experiment in studies/."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: pattern → what it catches
RESIDUE: dict[str, str] = {
    r"\b20\d\d-[01]\d-[0-3]\d\b": "a run date",
    r"`[0-9a-f]{7,40}`|\bcommit [0-9a-f]{7,40}\b|\bat [0-9a-f]{7,12}\b": "a commit hash",
    r"(?<![\w&/])#\d{1,4}\b|\b[Ii]ssue \d+\b": "an issue number",
    r"\b[Mm]ain job\b": "in-house jargon ('main job': say `pit-deploy run default`)",
    r"\b(?:I|[Ww]e)\s+(?:ran|re-?ran|measured|tried|found|saw|timed|chose|picked|checked|noticed)\b": "first-person narration",
    r"\b[Mm]y\b|\bof mine\b": "first-person narration",
}


def _user_facing_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += sorted(p for p in (ROOT / "pit_deploy").rglob("*.py"))
    files += sorted((ROOT / "pit_deploy" / "recipes").rglob("*.toml"))
    return files


def test_no_lab_notebook_residue_in_user_documentation():
    hits = []
    for path in _user_facing_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for pattern, what in RESIDUE.items():
                match = re.search(pattern, line)
                if match:
                    hits.append(f"{path.relative_to(ROOT)}:{number}: {what}: {match.group(0)!r}")
    assert not hits, "\n".join(hits)


def test_the_residue_patterns_catch_what_they_name():
    """The grep above is only as good as its patterns: each one flags a typical offender and
    leaves ordinary text alone."""
    offenders = ["run on 2026-11-25", "fixed in `fb26821`", "blocked by #29", "the main job's int4",
                 "I measured 0.06", "beside a test run of mine"]
    ordinary = ["W_out E = I by construction", "pit-deploy run default", "see docs/run.md#stages",
                "int4 in groups of 32", "we rely on those names", "a 2-core machine"]
    for text in offenders:
        assert any(re.search(p, text) for p in RESIDUE), text
    for text in ordinary:
        assert not any(re.search(p, text) for p in RESIDUE), text


def test_readme_is_short_and_opens_with_the_two_setup_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; keep it at most 150"
    first_block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert first_block is not None and first_block.start() < 200, "README.md must open with a bash block"
    commands = [ln.split("#")[0].strip() for ln in first_block.group(1).splitlines() if ln.strip()]
    assert commands == ["bash scripts/main.sh", "bash scripts/test.sh"], commands
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "bash scripts/test.sh" in ci, ".ci/run must call the README's test command"


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_docs_pages_are_of_bounded_length(page):
    limit = 300 if page.name == "quantization.md" else 400
    count = len(page.read_text(encoding="utf-8").splitlines())
    assert count <= limit, f"docs/{page.name} has {count} lines; the limit is {limit}"


def _readme_tables():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "scripts" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_tables_match_the_registries_and_result_files():
    """The support matrix and the headline figures are what ``scripts/readme_tables.py``
    renders now from the target/scheme/family registries and ``benchmarks/results/``."""
    tables = _readme_tables()
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert tables.render(text) == text, "run `python scripts/readme_tables.py` and commit README.md"


def test_readme_check_fails_on_a_figure_that_drifted(tmp_path, monkeypatch):
    tables = _readme_tables()
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    rendered = tables.headline_figures()
    first_figure = re.search(r"\| (\d+\.\d) \|", rendered)
    assert first_figure is not None
    drifted = text.replace(first_figure.group(0), "| 1.0 |", 1)
    assert drifted != text
    readme = tmp_path / "README.md"
    readme.write_text(drifted, encoding="utf-8")
    monkeypatch.setattr(tables, "README", readme)
    assert tables.main(["--check"]) == 1
    assert tables.main([]) == 0 and readme.read_text(encoding="utf-8") == text


def test_support_matrix_lists_every_registered_target_and_scheme():
    from pit_deploy.schemes import scheme_names
    from pit_deploy.targets import target_names

    matrix = _readme_tables().support_matrix()
    for name in target_names():
        assert f"| `{name}`" in matrix, name
    for name in scheme_names():
        assert f"`{name}`" in matrix, name

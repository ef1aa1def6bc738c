"""Scripts in ``studies/`` and ``benchmarks/`` cannot rot unnoticed: each one compiles, and every
name it imports resolves — a module of this package and the names taken from it, a neighbouring
script and the names defined there, or an installed distribution — without running a model.
A study that backs a shipped default is re-run by hand; this keeps it runnable between runs."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*(ROOT / "studies").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")])


def _top_level_names(path: Path) -> set[str]:
    """Names a module defines at its top level (functions, classes, assignments, imports)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _submodule(package, name: str) -> bool:
    """Whether ``name`` is a submodule of ``package`` (a plain module has none)."""
    if not hasattr(package, "__path__"):
        return False
    return importlib.util.find_spec(f"{package.__name__}.{name}") is not None


def unresolved_imports(script: Path, root: Path = ROOT) -> list[str]:
    """What ``script`` imports that does not exist, as readable lines (empty: all resolve)."""
    tree = ast.parse(script.read_text(encoding="utf-8"), filename=str(script))
    problems = []
    local_dirs = (script.parent, root / "tests")  # a script's neighbours, and the tests' helpers it may share
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            wanted = [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            wanted = [(node.module, tuple(a.name for a in node.names))]
        else:
            continue
        for module, names in wanted:
            where = f"{script.relative_to(root)}:{node.lineno}"
            top = module.split(".")[0]
            local = next((d / f"{top}.py" for d in local_dirs if (d / f"{top}.py").is_file()), None)
            if local is not None and top != "pit_deploy":
                missing = [n for n in names if n != "*" and n not in _top_level_names(local)]
                problems += [f"{where}: {module} (a neighbouring script) defines no {n}" for n in missing]
            elif top == "pit_deploy":
                try:
                    loaded = importlib.import_module(module)
                except ImportError as exc:
                    problems.append(f"{where}: {module} cannot be imported ({exc})")
                    continue
                for n in names:
                    if n != "*" and not hasattr(loaded, n) and not _submodule(loaded, n):
                        problems.append(f"{where}: {module} has no {n}")
            elif importlib.util.find_spec(top) is None:
                problems.append(f"{where}: {top} is not installed")
    return problems


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_compiles_and_its_imports_resolve(script):
    compile(script.read_text(encoding="utf-8"), str(script), "exec")
    assert unresolved_imports(script) == []


def test_a_moved_module_is_caught(tmp_path):
    """The check fails on an import of a module that moved (as ``pit_deploy.training.metrics``
    did), on a name a module lacks, and on a name a neighbouring script lacks."""
    (tmp_path / "helper.py").write_text("def shared():\n    return 1\n")
    script = tmp_path / "study.py"
    script.write_text("from pit_deploy.training.metrics import read_metrics\n"
                      "from pit_deploy.io.metrics import no_such_name\n"
                      "from helper import shared, gone\n")
    problems = unresolved_imports(script, root=tmp_path)
    text = "\n".join(problems)
    assert "pit_deploy.training.metrics cannot be imported" in text
    assert "pit_deploy.io.metrics has no no_such_name" in text
    assert "defines no gone" in text and "defines no shared" not in text

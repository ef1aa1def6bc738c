"""The package's shape: stages as sub-packages, dependencies pointing one way, light modules
that stay light, recipes found in a normal (non-editable) install, no references to documents
outside the repository."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from pit_deploy.targets import BUILTIN

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pit_deploy"


def _imports(path: Path) -> set[str]:
    """Absolute names of the project modules ``path`` imports (relative imports resolved)."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    else:
        parts = parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level + 1]
                out.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m.startswith("pit_deploy")}


def _package_files(sub: str) -> list[Path]:
    return sorted((PACKAGE / sub).rglob("*.py"))


#: the built-in targets' declarations (``targets/<name>/__init__.py``: onnx, executorch, onnx_genai,
#: gguf): standard library only
TARGET_DECLARATIONS = tuple(BUILTIN.values())


@pytest.mark.parametrize("light", ["pit_deploy.io.manifest", "pit_deploy.io.fs", "pit_deploy.exporters.recipes",
                                   "pit_deploy.targets", "pit_deploy.targets.base", *TARGET_DECLARATIONS,
                                   "pit_deploy.runtime.base", "pit_deploy.runtime.drivers",
                                   "pit_deploy.schemes", "pit_deploy.options", "pit_deploy.io.hub",
                                   "pit_deploy.training.config", "pit_deploy.io.metrics", "pit_deploy.workflow.recipe"])
def test_light_modules_import_without_torch(light):
    """A manifest is read on a device: the standard library must be enough."""
    code = (
        f"import sys; import {light}; "
        "heavy = [m for m in ('torch', 'transformers', 'numpy', 'onnxruntime', 'executorch') if m in sys.modules]; "
        "print(','.join(heavy)); sys.exit(1 if heavy else 0)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{light} pulled in: {proc.stdout.strip()} {proc.stderr[-500:]}"


def test_target_declarations_are_light():
    """A target's declaration imports nothing of the package but the registry, its base and
    ``errors`` (what it runs is named as "module:attribute" and imported on first use)."""
    assert len(TARGET_DECLARATIONS) >= 4
    allowed = {"pit_deploy.errors", "pit_deploy.targets", "pit_deploy.targets.base"}
    heavy = {name: _imports(PACKAGE / "targets" / name.rpartition(".")[2] / "__init__.py") - allowed
             for name in TARGET_DECLARATIONS}
    heavy.update({f"pit_deploy.targets.{stem}": _imports(PACKAGE / "targets" / f"{stem}.py") - allowed
                  for stem in ("__init__", "base")})
    assert not any(heavy.values()), heavy


#: A target's folder (``targets/<name>/``): its declaration (``__init__.py``) and the modules only
#: that target uses, each on one side, by file name: the export side (what writes the artifact:
#: it may import ``export``, ``model``, ``io``… as the exporters always did), the runtime side
#: (what runs an artifact: a driver, a standalone decoder, the interface reader, a runner; it
#: never imports the export side, its own target's export modules included) and the check side
#: (what ``verify`` and ``bench`` add for the target: it may import ``evaluate``). Each side ranks
#: just above the shared unit of its kind (:data:`LAYERS`). A module of a new name joins a side here.
TARGET_SIDES: dict[str, frozenset[str]] = {
    "export": frozenset({"export", "head", "token_table", "xnnpack_rewrites", "idle_passes", "llm_ops",
                         "runner_tokenizer", "web_fold", "builder_child", "vocab"}),
    "runtime": frozenset({"driver", "decoder", "interface", "interface_weights", "llm_runner",
                          "emulated_pte_runner"}),
    "evaluate": frozenset({"stock_runner", "web_check", "bench_adb", "stored_weights"}),
}


def _target_side(module: str) -> tuple[str, str] | None:
    """``(target folder, side)`` of a module of a target's folder other than its declaration."""
    parts = module.split(".")
    if len(parts) != 4 or parts[1] != "targets":
        return None
    side = next((s for s, stems in TARGET_SIDES.items() if parts[3] in stems), "unknown")
    return parts[2], side


def _export_side(module: str) -> bool:
    side = _target_side(module)
    return module.startswith("pit_deploy.exporters") or (side is not None and side[1] == "export")


def test_every_target_module_has_a_side():
    unknown = [m for m in _graph() if (_target_side(m) or ("", ""))[1] == "unknown"]
    assert not unknown, f"add {unknown} to TARGET_SIDES"


#: what ``evaluate`` may take from the export side: the recipe (a manifest's settings), and for
#: the weight-level check the exporter's own preparation of the reference (the weights it wrote
#: are compared with what these functions make of the reference, so they cannot be rewritten apart;
#: a ``.pte``'s quantized head and shared gather read the rotated table and the nibble order that
#: the ``.pte``'s ``head`` and ``token_table`` make)
EVALUATE_MAY_IMPORT = {
    "pit_deploy/evaluate/*": {"pit_deploy.exporters.recipes"},
    "pit_deploy/evaluate/weight_check.py": {"pit_deploy.exporters.residual_rotation"},
    "pit_deploy/evaluate/onnx_weights.py": {"pit_deploy.exporters.passes", "pit_deploy.exporters.residual_rotation"},
    "pit_deploy/targets/gguf/stored_weights.py": {"pit_deploy.exporters.passes", "pit_deploy.targets.gguf.export"},
    "pit_deploy/targets/executorch/stored_weights.py": {"pit_deploy.exporters.passes",
                                                        "pit_deploy.exporters.residual_rotation",
                                                        "pit_deploy.targets.executorch.head",
                                                        "pit_deploy.targets.executorch.token_table"},
}


def test_runtime_side_never_imports_export_side():
    """``runtime``, ``evaluate`` and the runtime and check sides of every target folder."""
    def allowed(path: Path, mod: str) -> bool:
        rel = path.relative_to(ROOT).as_posix()
        checks = rel.startswith("pit_deploy/evaluate/") or (_target_side(_module_name(path)) or ("", ""))[1] == "evaluate"
        return (checks and mod in EVALUATE_MAY_IMPORT["pit_deploy/evaluate/*"]
                or mod in EVALUATE_MAY_IMPORT.get(rel, set()))

    runtime_side = [path for sub in ("runtime", "evaluate") for path in _package_files(sub)]
    runtime_side += [path for path in _package_files("targets")
                     if (_target_side(_module_name(path)) or ("", ""))[1] in ("runtime", "evaluate")]
    graph = _graph()
    offenders = [
        (str(path.relative_to(ROOT)), mod)
        for path in runtime_side
        for mod in _imports(path) | graph[_module_name(path)]
        if _export_side(mod) and not allowed(path, mod)
    ]
    assert not offenders, offenders


def test_no_target_imports_another_targets_folder():
    """A target's folder is its own: none of its modules imports a module of another target's
    folder (declaration included); what two targets share lives in a shared unit."""
    offenders = []
    for module, deps in _graph().items():
        parts = module.split(".")
        if len(parts) < 3 or parts[1] != "targets" or parts[2] in ("base",):
            continue
        for dep in deps:
            other = dep.split(".")
            if len(other) >= 3 and other[1] == "targets" and other[2] != "base" and other[2] != parts[2]:
                offenders.append(f"{module} -> {dep}")
    assert not offenders, offenders


#: The package's layers, lowest first: a unit (a top-level module or sub-package) may import only
#: units of lower layers (docs/design.md). Targets are declarations at the bottom: what they run
#: is named as "module:attribute" and imported on first use, so every layer can ask a target; the
#: scheme registry sits just above them, since it reads the schemes a target declares as its own.
#: The other modules of a target's folder are units of their own, one per target and side
#: (:data:`TARGET_SIDES`), each just above the shared unit of its kind: ``targets/*/runtime``
#: stands for every target's runtime side.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("options", "targets"),
    ("schemes",),
    ("model",),
    ("io",),
    ("data",),
    ("converters", "analysis"),
    ("training",),
    ("runtime",),
    ("targets/*/runtime",),
    ("exporters",),
    ("targets/*/export",),
    ("evaluate",),
    ("targets/*/evaluate",),
    ("workflow",),
    ("api",),
    ("cli", "tiny"),
    ("__main__",),
)
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _rank(unit: str) -> int:
    parts = unit.split("/")
    return RANK[f"targets/*/{parts[2]}"] if len(parts) == 3 else RANK[unit]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str | None:
    side = _target_side(module)
    if side is not None:
        return f"targets/{side[0]}/{side[1]}"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _graph() -> dict[str, set[str]]:
    """Every project module → the project modules it imports (lazy imports inside functions too)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for imported in _imports(path):
            # "from .x import y" names a module x.y or an attribute y of x: keep the module
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                deps.add(imported)
        graph[name] = deps
    return graph


def test_no_unit_imports_another_units_private_names():
    """A name with a leading underscore is its module's own: another unit (a sub-package, a
    target's side) that needs it gets a public name instead, so that a private helper can change
    without breaking code elsewhere."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        parts = list(path.relative_to(ROOT).with_suffix("").parts)[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = (".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                      if node.level else node.module or "")
            if not source.startswith("pit_deploy.") or _unit(source) == _unit(module):
                continue
            offenders += [f"{module} imports {source}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert not offenders, offenders


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in _graph()} - {None}
    missing = sorted(u for u in units if (f"targets/*/{u.split('/')[2]}" if u.count("/") == 2 else u) not in RANK)
    assert not missing, f"add {missing} to LAYERS (or TARGET_SIDES)"


def test_dependencies_point_down():
    """No unit imports one of its own layer or a higher one (lazy imports count too)."""
    upward = []
    for module, deps in _graph().items():
        src = _unit(module)
        for dep in deps:
            dst = _unit(dep)
            if src and dst and src != dst and _rank(dst) >= _rank(src):
                upward.append(f"{module} -> {dep}")
    assert not upward, upward


def test_no_import_cycles():
    """No module reaches itself through imports (lazy ones included): a cycle is a layering
    mistake even when Python happens to resolve it."""
    graph = _graph()
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def test_no_runtime_name_outside_its_target():
    """Generic code asks a target; only a target's own modules (its declaration, exporter,
    driver, quantizer) may spell its runtime name in a comparison."""
    import re

    hits = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        for match in re.finditer(r"""(==|!=|\bin\b)\s*\(?\s*["'](onnx|executorch)["']|["'](onnx|executorch)["']\s*(==|!=)""", text):
            hits.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
    assert not hits, hits


def test_core_math_imports_nothing_of_the_project():
    """Nothing but the table of its choices' names, which itself imports nothing."""
    assert _imports(PACKAGE / "model" / "core.py") == {"pit_deploy.model.choices"}
    assert _imports(PACKAGE / "model" / "choices.py") == set()


def _project_files() -> list[Path]:
    skip = (".git", ".venv", "__pycache__", "runs", "build", "node_modules")  # node_modules: npm's, not ours
    return [p for p in ROOT.rglob("*") if p.is_file() and p.suffix in (".py", ".md", ".toml", ".sh", ".ipynb", ".cfg")
            and not any(part in skip or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)]


def test_no_reference_to_documents_outside_the_repository():
    """Every Markdown document a file names exists in the repository, and no relative path
    climbs out of it: the project stands on its own."""
    import re

    from pit_deploy.workflow.report import REPORT_NAME

    in_repo = {p.name for p in ROOT.rglob("*.md") if ".venv" not in p.parts} | {REPORT_NAME}  # + what a run writes
    hits = []
    for path in _project_files():
        text = path.read_text(errors="replace")
        for name in re.findall(r"[\w./-]*?([A-Za-z0-9_-]+\.md)\b", text):
            if name not in in_repo:
                hits.append(f"{path.relative_to(ROOT)}: names {name}, which is not in the repository")
        if path.is_relative_to(ROOT / "tests"):
            continue  # tests build hostile paths (tampered manifests) on purpose
        for rel in re.findall(r"(?<![\w.])((?:\.\./)+[\w.-]+)", text):
            if not (path.parent / rel).resolve().is_relative_to(ROOT):
                hits.append(f"{path.relative_to(ROOT)}: {rel} points outside the repository")
    assert not hits, hits


def test_recipes_are_package_data():
    from pit_deploy.exporters.recipes import PACKAGE_RECIPES, available_recipes

    assert PACKAGE_RECIPES.is_relative_to(PACKAGE)
    assert {"default", "tiny-ci", "onnx-fp32", "executorch-xnnpack-fp32"} <= set(available_recipes())


@pytest.mark.slow
def test_non_editable_install_finds_its_recipes(tmp_path):
    """`pip install .` (a wheel, not editable) into a fresh virtual environment, then
    `pit-deploy export --recipe tiny-ci` on a tiny model, run from a directory with no
    `export/` folder: the recipes must come from the installed package."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    # Dependencies (torch, transformers, onnxruntime, ...) come from this interpreter's
    # site-packages through a .pth file, so nothing is downloaded; the project itself is
    # installed as a built wheel with pip from this environment.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wheel_dir = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheel_dir), str(ROOT)],
        check=True, cwd=tmp_path,
    )
    wheel = next(wheel_dir.glob("pit_deploy-*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True, cwd=tmp_path,
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    work = tmp_path / "work"
    work.mkdir()
    where = subprocess.check_output([str(py), "-c", "import pit_deploy; print(pit_deploy.__file__)"], text=True, env=env, cwd=work)
    assert Path(where.strip()).is_relative_to(site), where
    make = (
        "from pit_deploy.tiny import tiny_pit_model; from pit_deploy.io.checkpoint import save_model; "
        "save_model(tiny_pit_model('llama'), 'tiny')"
    )
    subprocess.run([str(py), "-c", make], check=True, env=env, cwd=work)
    proc = subprocess.run(
        [str(py), "-m", "pit_deploy", "export", "tiny", "--out", "exp", "--recipe", "tiny-ci", "--runtime", "onnx",
         "--mode", "factorized"],
        capture_output=True, text=True, env=env, cwd=work,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (work / "exp" / "manifest.json").is_file()
    assert '"name": "tiny-ci"' in (work / "exp" / "manifest.json").read_text()

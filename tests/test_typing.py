"""The public API type-checks: mypy on ``pit_deploy/api.py`` and the package's exports, and on a
user's script that calls them (the checker sees each call's signature, not a module)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

USER_SCRIPT = '''
import pit_deploy

manifest = pit_deploy.export("pit", "exp", runtime="onnx", dtype=["float32", "int4"])
report = pit_deploy.verify("exp")
passed: bool = report.passed
conversion = pit_deploy.convert("default", "pit")
'''


def _mypy(*paths: str | Path, cache: Path) -> subprocess.CompletedProcess:
    pytest.importorskip("mypy", reason="mypy is in requirements/cpu.txt; bash scripts/setup.sh installs it")
    return subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent", "--ignore-missing-imports",
                           "--cache-dir", str(cache), *map(str, paths)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One mypy cache for the module's runs (the second reuses what the first checked)."""
    return tmp_path_factory.mktemp("mypy-cache")


def test_the_public_api_type_checks(tmp_path, cache):
    script = tmp_path / "user_script.py"
    script.write_text(USER_SCRIPT)
    proc = _mypy("pit_deploy/api.py", "pit_deploy/__init__.py", script, cache=cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_a_wrong_call_is_a_type_error(tmp_path, cache):
    """The check can fail: a misspelt keyword and a wrong argument type are reported."""
    script = tmp_path / "wrong.py"
    script.write_text("import pit_deploy\n\npit_deploy.verify('exp', runtimes='onnx')\n"
                      "ok: int = pit_deploy.verify('exp')\n")
    proc = _mypy(script, cache=cache)
    assert proc.returncode == 1
    assert 'Unexpected keyword argument "runtimes"' in proc.stdout and 'variable has type "int"' in proc.stdout

"""The suite's two workers keep each test file on one worker (``tests/conftest.py``), so a
file's module fixtures — most of them exports that take minutes — are built once, not once per
worker. Checked by running a fast test file of many tests under the suite's own xdist options."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_test_file_runs_on_one_worker():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                           "-v", "tests/test_scripts_resolve.py"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTEST_ADDOPTS": ""}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    workers = re.findall(r"^\[(gw\d+)\] .*PASSED", proc.stdout, flags=re.M)
    assert len(workers) > 10 and len(set(workers)) == 1, sorted(set(workers))


def test_the_slowest_groups_name_groups_of_the_suite():
    """The groups ``tests/conftest.py`` hands out first are files of the suite (or the runtime
    suite): a renamed or deleted file left in the list would silently order nothing."""
    import importlib.util

    # by path: both suites have a conftest.py, and the name alone finds whichever was imported last
    spec = importlib.util.spec_from_file_location("tests_conftest", ROOT / "tests" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    SLOWEST_GROUPS_FIRST = conftest.SLOWEST_GROUPS_FIRST
    stems = {p.stem for p in (ROOT / "tests").glob("test_*.py")} | {"runtime_tests"}
    assert set(SLOWEST_GROUPS_FIRST) <= stems, sorted(set(SLOWEST_GROUPS_FIRST) - stems)
    assert len(set(SLOWEST_GROUPS_FIRST)) == len(SLOWEST_GROUPS_FIRST)

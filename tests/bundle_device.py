"""Running a ``bench --bundle`` archive as a device would: unpacked in a folder of its own, with
``pit_deploy`` and ``transformers`` made unimportable (a module of each name that raises), so a
test proves the bundle needs neither. Shared by the bundle tests of every target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

#: modules a bundle must not import on the device
BLOCKED = ("pit_deploy", "transformers")


def run_bundle(bundle: Path, work: Path, threads: str = "1") -> list[dict]:
    """Unpack ``bundle`` under ``work/device``, run its runner at ``threads`` (a comma list) with
    the blocked modules shadowed, and return its rows; a failed run fails the test."""
    device = work / "device"
    with tarfile.open(bundle) as tar:
        tar.extractall(device, filter="data")
    blockers = work / "blockers"
    blockers.mkdir()
    for name in BLOCKED:
        (blockers / f"{name}.py").write_text(f"raise ImportError('the bundle imported {name}')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(blockers)
    rows_path = work / "rows.json"
    proc = subprocess.run([sys.executable, str(device / "pit-bench" / "run_bench.py"), "--threads", threads,
                           "--out", str(rows_path)], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(rows_path.read_text())["rows"]


def assert_self_contained(path: Path, banned: tuple[str, ...]) -> None:
    """The module at ``path`` (a file a bundle carries as it is) imports nothing relative and no
    module under ``pit_deploy`` or ``banned`` (the top-level names it would not find on a device)."""
    import ast

    roots = ("pit_deploy", *banned)
    for node in ast.walk(ast.parse(Path(path).read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and not (node.module or "").startswith("pit_deploy"), ast.dump(node)
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith(roots) for a in node.names), ast.dump(node)

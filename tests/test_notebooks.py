"""The walkthroughs in notebooks/ run top to bottom (their cells assert what they claim)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
#: notebooks that load the real default model (the rest build tiny models in code)
REAL_MODEL = {"quickstart"}


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=[pytest.mark.real_model] if p.stem in REAL_MODEL else []) for p in NOTEBOOKS],
    ids=[p.stem for p in NOTEBOOKS],
)
def test_notebook_executes(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors

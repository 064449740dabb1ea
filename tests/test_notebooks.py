"""Every notebook in notebooks/ runs top to bottom on the CPU, so none can rot."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert any(p.name == "00_quickstart.ipynb" for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_executed(path):
    """The stored copy shows its outputs (GitHub renders what is stored): every code cell ran, in order, without an
    error, and a notebook that plots stores its figure (refresh with scripts/execute_notebooks.py)."""
    nb = nbformat.read(path, as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code"]
    counts = [c.get("execution_count") for c in cells]
    assert all(counts) and counts == sorted(counts), f"{path.name} is not stored executed: {counts}"
    outputs = [o for c in cells for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    if any("plt." in c.source or "plot_" in c.source for c in cells):
        assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} stores no figure"

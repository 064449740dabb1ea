"""Every notebook in notebooks/ runs top to bottom on the CPU, so none can rot.

The cells run in this process, in one IPython shell with a fresh namespace per notebook, rather than in a Jupyter
kernel per notebook: torch, Lightning and the package are imported once for all of them (a kernel start and those
imports cost more than most notebooks' own cells on the two-core CI machine). What a notebook changes in the process
is put back after it: the working directory (a temporary folder, for the files it writes), the environment, the
global RNG states, torch's thread count and the open figures. The stored copies, executed in real kernels by
scripts/execute_notebooks.py, are checked separately.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import matplotlib
import nbformat
import numpy as np
import pytest
import torch

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert any(p.name == "00_quickstart.ipynb" for p in NOTEBOOKS)


@pytest.fixture(scope="module")
def shell(tmp_path_factory):
    """One IPython shell for every notebook (no history file, no display hooks outside a cell)."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    os.environ.setdefault("IPYTHONDIR", str(tmp_path_factory.mktemp("ipython")))
    config = Config()
    config.HistoryManager.enabled = False
    sh = InteractiveShell.instance(config=config)
    yield sh
    sh.reset(new_session=False)
    InteractiveShell.clear_instance()


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """What a notebook may change in this process, put back afterwards."""
    import matplotlib.pyplot as plt

    monkeypatch.chdir(tmp_path)
    env = dict(os.environ)
    states = (random.getstate(), np.random.get_state(), torch.random.get_rng_state(), torch.get_num_threads())
    backend = matplotlib.get_backend()
    matplotlib.use("Agg")
    # One thread: the notebooks' models are tiny, and on two shared cores a second OpenMP thread only spins.
    torch.set_num_threads(1)
    try:
        yield tmp_path
    finally:
        plt.close("all")
        matplotlib.use(backend)
        os.environ.clear()
        os.environ.update(env)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        torch.set_num_threads(states[3])


def _execute(path: Path, shell) -> None:
    nb = nbformat.read(path, as_version=4)
    shell.reset(new_session=False)
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        result = shell.run_cell(cell.source, store_history=False)  # the traceback is printed (captured) on failure
        if not result.success:
            err = result.error_in_exec or result.error_before_exec
            pytest.fail(f"{path.name}: code cell {i} raised {type(err).__name__}: {err}\n--- cell ---\n{cell.source}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, shell, isolated):
    _execute(path, shell)


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


def test_a_failing_cell_fails_the_test(shell, isolated, tmp_path):
    """The runner itself: a cell that raises is reported (so the tests above can fail)."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("1 / 0")])
    path = tmp_path / "broken.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(pytest.fail.Exception, match="code cell 1 raised ZeroDivisionError"):
        _execute(path, shell)

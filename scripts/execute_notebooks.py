"""Execute notebooks in place, so the stored copies show their outputs and plots (as GitHub renders them).

    .venv/bin/python scripts/execute_notebooks.py [notebooks/NAME.ipynb ...]   # default: every notebook

The tests execute each notebook again on the CPU (tests/test_notebooks.py); this only refreshes the stored outputs.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def execute(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as tmp:  # files the notebook writes (runs, profiles) stay out of the repo
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": tmp}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    if errors:
        raise SystemExit(f"{path}: a cell failed: {errors[0].get('ename')}: {errors[0].get('evalue')}")
    nbformat.write(nb, path)
    print(f"executed {path.relative_to(ROOT)}")


def main(argv: list[str]) -> int:
    paths = [Path(a).resolve() for a in argv] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for p in paths:
        execute(p)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The example notebook runs as shipped (its code cells, in order, in one namespace)."""

import json
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "single_process.ipynb"


def test_single_process_notebook_runs():
    pytest.importorskip("mpi4py")
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    namespace = {}
    for cell in cells:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{NOTEBOOK.name}[{cell['id']}]", "exec"), namespace)
    assert namespace["combined"].shape == namespace["x"].shape

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


def test_single_process_notebook_does_what_its_title_promises():
    """Its first cell promises layout, dispatch, combine, the low-latency pair and destroy: each is called."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    intro = "".join(cells[0]["source"])
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    for call in (".get_dispatch_layout(", ".dispatch(", ".combine(", ".low_latency_dispatch(",
                 ".low_latency_combine(", ".destroy()"):
        assert call in code, call
    for word in ("dispatch", "combine", "low-latency", "destroy"):
        assert word in intro, word
    assert code.rstrip().splitlines()[-2:][0].startswith("buffer.destroy()")

"""The examples beyond the quickstart: the notebooks are committed with their outputs and run as shipped; the
torch MoE layer script matches its dense computation on the reference backend, in one process and under
mpiexec. Jupyter is not needed: without it the notebooks' code cells run in order in one namespace, and only
the test that runs them in a Jupyter kernel is skipped."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NOTEBOOKS = ("single_process.ipynb", "moe_layer.ipynb")


def _cells(name):
    return [c for c in json.loads((EXAMPLES / name).read_text())["cells"] if c["cell_type"] == "code"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_saved_with_its_outputs(name):
    cells = _cells(name)
    # Run top to bottom in one kernel, and each cell left what it printed or returned.
    assert [c["execution_count"] for c in cells] == list(range(1, len(cells) + 1))
    assert all(c["outputs"] for c in cells)
    assert not any(o["output_type"] == "error" for c in cells for o in c["outputs"])


def test_moe_notebook_runs(monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("mpi4py")
    monkeypatch.chdir(EXAMPLES)  # where Jupyter runs it
    namespace = {}
    for cell in _cells("moe_layer.ipynb"):
        exec(compile("".join(cell["source"]), f"moe_layer.ipynb[{cell['id']}]", "exec"), namespace)
    assert namespace["combined"].shape == namespace["x"].shape
    assert namespace["err"] < 2e-2


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_in_jupyter(name, tmp_path, monkeypatch):
    for module in ("nbclient", "nbformat", "ipykernel"):
        pytest.importorskip(module, reason=f"{module} is not installed (pip install -e '.[notebooks]'); the "
                                           "notebooks' cells run without Jupyter in the other tests")
    if name == "moe_layer.ipynb":
        pytest.importorskip("torch")
    import nbformat
    from nbclient import NotebookClient

    # The kernel's connection file and IPython's profile go to the test's directory, not the home directory.
    for var in ("JUPYTER_RUNTIME_DIR", "IPYTHONDIR", "MPLCONFIGDIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))

    nb = nbformat.read(EXAMPLES / name, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}).execute()
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors, errors


def _env():
    # Open MPI refuses to run as root without these; MPICH ignores them.
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def test_moe_script_one_rank():
    pytest.importorskip("torch")
    pytest.importorskip("mpi4py")
    got = subprocess.run([sys.executable, str(EXAMPLES / "moe_layer.py"), "--tokens", "32"], capture_output=True,
                         text=True, timeout=120, env=_env())
    assert got.returncode == 0, got.stdout + got.stderr
    assert "all ranks match the dense layer" in got.stdout


def test_moe_script_under_mpiexec():
    pytest.importorskip("torch")
    pytest.importorskip("mpi4py")
    mpiexec = os.environ.get("MPIEXEC") or shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("no mpiexec on PATH (pip install -e '.[mpi]')")
    got = subprocess.run([mpiexec, "-n", "2", sys.executable, str(EXAMPLES / "moe_layer.py"), "--tokens", "32"],
                         capture_output=True, text=True, timeout=180, env=_env())
    assert got.returncode == 0, got.stdout + got.stderr
    assert got.stdout.count(": OK") == 2 and "all ranks match the dense layer" in got.stdout


@pytest.mark.parametrize("script", ["moe_layer.py", "compiled_moe.py"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_torch_examples_without_torch_print_one_line(script, ranks, tmp_path):
    """Where torch is not installed, a torch example says so once (from rank 0), with the pip command, and
    fails: no traceback per rank."""
    pytest.importorskip("mpi4py")
    hide = tmp_path / "no_torch" / "torch"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text('raise ImportError("No module named \'torch\'")\n')
    env = dict(_env(), PYTHONPATH=os.pathsep.join(p for p in (str(hide.parent), os.environ.get("PYTHONPATH")) if p))
    command = [sys.executable, str(EXAMPLES / script)]
    if ranks > 1:
        mpiexec = os.environ.get("MPIEXEC") or shutil.which("mpiexec")
        if mpiexec is None:
            pytest.skip("no mpiexec on PATH (pip install -e '.[mpi]')")
        command = [mpiexec, "-n", str(ranks), *command]
    got = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=EXAMPLES)
    assert got.returncode != 0
    out = got.stdout + got.stderr
    assert "Traceback" not in out, out
    assert out.count("this example needs PyTorch") == 1, out
    assert 'pip install -e ".[torch,mpi]"' in out

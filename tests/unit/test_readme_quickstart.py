"""The README's Quick start runs as written: its python block, saved as a script, under ``mpiexec -n 2`` (and
alone, as one rank) on the reference backend, every rank checking that combine gives its tokens back."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _quickstart() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the Quick start should hold exactly one python block"
    return blocks[0]


def _mpiexec() -> str | None:
    # The mpich wheel puts mpiexec next to the interpreter, which need not be on PATH.
    found = os.environ.get("MPIEXEC") or shutil.which("mpiexec")
    beside = Path(sys.executable).with_name("mpiexec")
    return found or (str(beside) if beside.exists() else None)


def _run(tmp_path, ranks: int):
    pytest.importorskip("mpi4py")
    script = tmp_path / "quickstart.py"
    script.write_text(_quickstart())
    command = [sys.executable, str(script)]
    if ranks > 1:
        mpiexec = _mpiexec()
        if mpiexec is None:
            pytest.skip("no mpiexec (pip install -e '.[mpi]')")
        command = [mpiexec, "-n", str(ranks), *command]
    # This tree's package first; Open MPI refuses to run as root without the two variables (MPICH ignores them).
    env = dict(os.environ, DEEPEP_CUPY_BACKEND="reference", DEEPEP_CUPY_TIMEOUT_S="60",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)


def test_quickstart_is_one_complete_script():
    code = _quickstart()
    compile(code, "README.md[Quick start]", "exec")
    # Every step the README promises, in order: nothing left for the reader to fill in.
    steps = ["import deepep_cupy", "MPI.COMM_WORLD", "get_dispatch_layout(", ".dispatch(", "expert_out =",
             ".combine(", "allclose(", ".destroy()"]
    positions = [code.find(step) for step in steps]
    assert -1 not in positions, [s for s, p in zip(steps, positions, strict=True) if p < 0]
    assert positions == sorted(positions)


def test_quickstart_is_the_example_script():
    """One quickstart: the README's block is ``examples/quickstart.py`` below its docstring."""
    script = (ROOT / "examples" / "quickstart.py").read_text()
    assert script.startswith('"""')
    assert script.split('"""', 2)[2].lstrip("\n") == _quickstart()
    assert "deepep_cupy." not in _quickstart().replace("import deepep_cupy as deep_ep", ""), \
        "the quickstart uses public names only (deep_ep.<name>)"


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_quickstart_runs_as_written(tmp_path, ranks):
    got = _run(tmp_path, ranks)
    assert got.returncode == 0, got.stdout + got.stderr
    assert got.stdout.count("combine matches") == ranks, got.stdout
    assert "DIFFERS" not in got.stdout
    # Rank 0 prints every rank's line, in rank order, then the verdict.
    ranks_printed = [int(line.split()[1]) for line in got.stdout.splitlines() if line.startswith("rank ")]
    assert ranks_printed == list(range(ranks)), got.stdout
    assert got.stdout.rstrip().endswith("quickstart: all ranks OK"), got.stdout

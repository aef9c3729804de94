"""The README's set-up: two commands; the first installs the CUDA wheels only where a GPU driver answers.

CI runs the first command as written on a machine without a GPU and checks that no CUDA wheel came with it;
here its pip target is expanded by bash with a fake ``nvidia-smi`` on PATH (one that finds a GPU, one that
finds none) and with none at all."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Set up\n", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_two_one_line_commands():
    commands = _setup_commands()
    assert len(commands) == 2 and all("\n" not in c for c in commands)
    assert commands[0].endswith("mpiexec -n 4 python examples/quickstart.py")
    assert "tools/run_tests.sh" in commands[1]
    # CI runs the test command as written.
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("driver, extras", [(None, ".[mpi]"), ("exit 0", ".[mpi,cuda13]"), ("exit 6", ".[mpi]")])
def test_cuda_extra_only_where_a_gpu_driver_answers(tmp_path, driver, extras):
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    install = _setup_commands()[0].rsplit(" && ", 1)[0]
    assert install.startswith("pip install -e ")
    # The pip target as bash expands it, with only the fake driver tool (or nothing) on PATH.
    if driver is not None:
        (tmp_path / "nvidia-smi").write_text(f"#!{bash}\n{driver}\n")
        (tmp_path / "nvidia-smi").chmod(0o755)
    echo = "printf '%s\\n' " + install.removeprefix("pip install -e ")
    got = subprocess.run([bash, "-c", echo], capture_output=True, text=True, timeout=30, env={"PATH": str(tmp_path)})
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == extras


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_readme_is_short():
    assert len(_readme().splitlines()) <= 200


def test_examples_table_lists_every_example():
    section = _readme().split("\n## Examples\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"\[`examples/([^`]+)`\]", section))
    shipped = {p.name for p in (ROOT / "examples").iterdir() if p.suffix in (".py", ".ipynb")}
    assert listed == shipped


def test_extras_paragraph_names_every_extra():
    tomllib = pytest.importorskip("tomllib")

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    section = _readme().split("\n## Set up\n", 1)[1].split("\n## ", 1)[0]
    paragraph = section[section.index("Extras:"):]
    assert {name for name in extras if f"`{name}`" not in paragraph} == set()


def test_torch_version_is_one_number():
    """pyproject's torch floor is the version the docs name for the custom ops."""
    tomllib = pytest.importorskip("tomllib")

    (spec,) = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["torch"]
    floor = spec.removeprefix("torch>=")
    assert f"torch {floor} or later" in (ROOT / "docs" / "frameworks.md").read_text()
    assert f"PyTorch ≥ {floor}" in _readme()
    # Read as text: importing the module needs torch, which the suite's first pass runs without.
    assert f"torch >= {floor}" in (ROOT / "deepep_cupy" / "custom_ops" / "common.py").read_text()

"""The opt-in ``deep_ep`` alias: ``DEEPEP_CUPY_AS_DEEP_EP`` through the ``.pth`` start-up hook, and ``as_deep_ep()``.

The hook is checked as it runs for users: in fresh interpreters of a throw-away virtual environment whose
site-packages holds the ``.pth`` file (and a path line to this interpreter's packages for numpy, torch, ...),
with this checkout first on ``PYTHONPATH``. The wheel and editable builds are checked where hatchling is
importable, and the installed environment where the package was installed with pip (as CI does).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

import deepep_cupy
from deepep_cupy import alias

ROOT = Path(__file__).resolve().parents[2]
PTH = ROOT / "deepep_cupy" / "deepep_cupy_alias.pth"
LINE = "deepep_cupy: deep_ep is deepep_cupy"


def _make_venv(path: Path) -> tuple[Path, Path]:
    """A virtual environment without pip whose site-packages reaches this interpreter's packages (a plain path
    line, so their own .pth files do not run); returns (python, site-packages)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    (purelib / "zz_base_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python, purelib


@pytest.fixture(scope="module")
def hooked(tmp_path_factory):
    """(python, site-packages) of a virtual environment with the alias's .pth file installed."""
    python, purelib = _make_venv(tmp_path_factory.mktemp("alias") / "venv")
    (purelib / PTH.name).write_text(PTH.read_text())
    return python, purelib


def _run(python, code: str, value: str | None, *, path=(ROOT,), args=(), cwd=None):
    env = {k: v for k, v in os.environ.items() if k not in (alias.ENV, "PYTHONPATH")}
    if value is not None:
        env[alias.ENV] = value
    if path:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
    return subprocess.run([str(python), *(("-c", code) if code else ()), *args], env=env, capture_output=True,
                          text=True, timeout=120, cwd=cwd)


SURFACE = textwrap.dedent("""
    import importlib.util, json, sys
    lazy = "deepep_cupy" not in sys.modules
    found = importlib.util.find_spec("deep_ep") is not None
    from deep_ep import Buffer, Config, EventOverlap, topk_idx_t
    from deep_ep.utils import EventHandle, EventOverlap as UtilsOverlap, check_nvlink_connections
    import deep_ep, deep_ep.utils, deep_ep.buffer
    import deepep_cupy
    try:
        from deep_ep import HybridEPBuffer
        hybrid = "imported"
    except ImportError:
        hybrid = "ImportError"
    def annotated(x) -> deep_ep.Config | None:
        return None
    try:
        import torch
        idx_ok = topk_idx_t is torch.int64
    except ImportError:
        idx_ok = topk_idx_t == deepep_cupy.topk_idx_t
    print(json.dumps({
        "lazy": lazy, "found": found, "hybrid": hybrid, "elastic": hasattr(deep_ep, "ElasticBuffer"),
        "same": [Buffer is deepep_cupy.Buffer, Config is deepep_cupy.Config, EventOverlap is UtilsOverlap,
                 EventHandle is deepep_cupy.EventHandle,
                 deep_ep.buffer.Buffer is Buffer, callable(check_nvlink_connections),
                 deep_ep.ElasticBuffer is deepep_cupy.ElasticBuffer, deep_ep.EPBuffer is deepep_cupy.EPBuffer,
                 deep_ep.EPHandle is deepep_cupy.EPHandle, deep_ep.EventHandle is EventHandle,
                 deep_ep.get_physical_domain_size is deepep_cupy.get_physical_domain_size],
        "version": hasattr(deep_ep, "__version__"),
        "idx_ok": idx_ok, "top": sorted(deep_ep.__all__), "utils": sorted(deep_ep.utils.__all__),
        "event": EventOverlap(EventHandle()).event is not None}))
""")


def test_without_the_variable_nothing_is_named_deep_ep(hooked):
    python, _ = hooked
    code = ("import importlib.util, sys\nassert importlib.util.find_spec('deep_ep') is None\n"
            "assert 'deepep_cupy' not in sys.modules\nimport deep_ep")
    for value in (None, "", "0", "off"):
        proc = _run(python, code, value)
        assert proc.returncode == 1 and "ModuleNotFoundError: No module named 'deep_ep'" in proc.stderr, proc.stderr
        assert LINE not in proc.stderr


def test_the_variable_gives_deepep_v1_and_v2_names(hooked):
    python, _ = hooked
    proc = _run(python, SURFACE, "1")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    # The start-up hook imports nothing; the names are deepep_cupy's own objects: V1's and V2's, no fork names.
    assert got["lazy"] and got["found"] and got["idx_ok"] and got["event"]
    assert all(got["same"]), got["same"]
    assert got["hybrid"] == "ImportError" and got["elastic"] and not got["version"]
    assert got["top"] == ["Buffer", "Config", "EPBuffer", "EPHandle", "ElasticBuffer", "EventHandle", "EventOverlap",
                          "get_logical_domain_size", "get_physical_domain_size", "topk_idx_t"]
    assert got["utils"] == ["EventHandle", "EventOverlap", "check_nvlink_connections"]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("deepep_cupy:")]
    assert len(lines) == 1 and lines[0].startswith(LINE) and str(ROOT / "deepep_cupy") in lines[0], proc.stderr


def test_spawned_workers_find_deep_ep(hooked, tmp_path):
    """vLLM's workers are new interpreters that probe ``find_spec("deep_ep")`` before importing it."""
    python, _ = hooked
    script = tmp_path / "spawn_job.py"
    script.write_text(textwrap.dedent("""
        import importlib.util, multiprocessing as mp

        def probe(_):
            found = importlib.util.find_spec("deep_ep") is not None
            import deep_ep
            return found, deep_ep.Buffer.__module__

        if __name__ == "__main__":
            with mp.get_context("spawn").Pool(2) as pool:
                print(pool.map(probe, range(2)))
    """))
    proc = _run(python, "", "1", args=(str(script),))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[(True, 'deepep_cupy.buffer'), (True, 'deepep_cupy.buffer')]"


def test_a_real_deep_ep_is_never_shadowed_silently(hooked, tmp_path):
    python, _ = hooked
    real = tmp_path / "real" / "deep_ep"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("REAL = True\n")
    path = (ROOT, tmp_path / "real")
    check = "import deep_ep\nprint(getattr(deep_ep, 'REAL', False), deep_ep.__spec__.origin)"
    proc = _run(python, check, None, path=path)
    assert proc.returncode == 0 and proc.stdout.startswith("True"), proc.stderr
    # Opted in with DeepEP installed: an error naming both, on stderr too (Megatron-Core catches ImportError).
    megatron = ("try:\n    from deep_ep import Buffer\n    HAVE_DEEP_EP = True\nexcept ImportError:\n"
                "    HAVE_DEEP_EP = False\nprint(HAVE_DEEP_EP)")
    proc = _run(python, megatron, "1", path=path)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr
    assert str(real) in proc.stderr and str(ROOT / "deepep_cupy") in proc.stderr and "force" in proc.stderr
    proc = _run(python, check, "force", path=path)
    assert proc.returncode == 0 and proc.stdout.startswith("False deepep_cupy alias"), proc.stderr
    assert f"in place of DeepEP at {real}" in proc.stderr


def test_module_command_tells_what_deep_ep_is(hooked):
    python, _ = hooked
    on = _run(python, "", "1", args=("-m", "deepep_cupy.alias"))
    assert on.returncode == 0 and "deepep_cupy.buffer.Buffer" in on.stdout, on.stdout + on.stderr
    off = _run(python, "", None, args=("-m", "deepep_cupy.alias"))
    assert off.returncode == 1 and f"set {alias.ENV}=1" in off.stdout, off.stdout + off.stderr


# --------------------------------------------------------------------------------------------- as_deep_ep()
@pytest.fixture
def clean_alias(monkeypatch):
    """Undo what as_deep_ep() does to this process: modules, finders, the request."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(alias, "_requested", None)
    monkeypatch.delenv(alias.ENV, raising=False)
    yield
    for name in [n for n in sys.modules if n == "deep_ep" or n.startswith("deep_ep.")]:
        del sys.modules[name]


def test_as_deep_ep_in_process(clean_alias, capsys):
    assert importlib.util.find_spec("deep_ep") is None
    module = deepep_cupy.as_deep_ep()
    import deep_ep
    from deep_ep.utils import EventHandle

    assert module is deep_ep and deep_ep.Buffer is deepep_cupy.Buffer and EventHandle is deepep_cupy.EventHandle
    assert importlib.util.find_spec("deep_ep") is deep_ep.__spec__
    assert importlib.util.find_spec("deep_ep.utils") is not None
    assert deepep_cupy.as_deep_ep() is deep_ep  # idempotent
    assert capsys.readouterr().err.count(LINE) == 1


def test_as_deep_ep_refuses_a_real_deep_ep_already_imported(clean_alias, monkeypatch):
    real = type(sys)("deep_ep")
    real.__file__ = "/somewhere/deep_ep/__init__.py"
    monkeypatch.setitem(sys.modules, "deep_ep", real)
    with pytest.raises(ImportError, match="already imported"):
        deepep_cupy.as_deep_ep()
    assert sys.modules["deep_ep"] is real
    assert deepep_cupy.as_deep_ep(force=True).Buffer is deepep_cupy.Buffer


# --------------------------------------------------------------------------------------------- packaging
def test_wheel_and_editable_builds_carry_the_hook(tmp_path):
    build = pytest.importorskip("hatchling.build")
    pytest.importorskip("editables")
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        wheel = tmp_path / "wheel" / build.build_wheel(str(tmp_path / "wheel"))
        editable = tmp_path / "editable" / build.build_editable(str(tmp_path / "editable"))
    finally:
        os.chdir(cwd)
    for archive in (wheel, editable):
        with zipfile.ZipFile(archive) as zf:
            assert zf.read(PTH.name).decode() == PTH.read_text()
            python, purelib = _make_venv(tmp_path / (archive.parent.name + "-venv"))
            zf.extractall(purelib)
        proc = _run(python, "import deep_ep, deepep_cupy; print(deepep_cupy.__file__)", "1", path=(), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        where = Path(proc.stdout.strip()).parent.parent
        assert where == (purelib if archive is wheel else ROOT), (archive.name, where)


def test_installed_environment_has_the_hook():
    """Where the package was installed with pip (as CI does), the variable works in a new interpreter."""
    installed = [Path(p) / PTH.name for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}]
    if not any(p.is_file() for p in installed):
        pytest.skip(f"this interpreter's site-packages has no {PTH.name} (the package is not pip-installed here)")
    proc = _run(sys.executable, "import deep_ep; print(deep_ep.Buffer.__module__)", "1")
    assert proc.returncode == 0 and proc.stdout.strip() == "deepep_cupy.buffer", proc.stderr

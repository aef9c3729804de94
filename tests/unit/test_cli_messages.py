"""What the command-line tools tell a newcomer: ``--help`` says what each command does and shows the default of
every option (and the tuner's lists its commands); the benchmarks, the tuner and its sweeps on a machine without
a GPU say "no GPU found" in one line, with what they need, whether CuPy is installed or not; ``precompile``
without NVRTC says once which extra brings it.

No GPU is simulated by faking the detection (the driver's device count, CuPy's), never by skipping, so each test
holds on a machine with GPUs as well."""

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from deepep_cupy.device import gpus
from deepep_cupy.jit import precompile as pre
from deepep_cupy.jit.compiler import Toolchain

HELP = [("deepep_cupy.jit", ()), ("deepep_cupy.jit", ("precompile",)), ("deepep_cupy.bench", ()),
        ("deepep_cupy.tuning", ()), ("deepep_cupy.tuning", ("sms",)), ("deepep_cupy.tuning", ("internode",))]
OPTION_RE = re.compile(r"^  (-\S+|[a-z]\w*)")  # an option's (or a positional's) first help line


def _module(module, *argv, env=None):
    env = dict(os.environ, DEEPEP_CUPY_FORCE_NO_GPU="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=120,
                          env=env)


def _entries(help_text: str) -> dict[str, str]:
    """``{first word: help text}`` of each argument listed under a heading ending in ':' (e.g. "options:")."""
    entries, name, section = {}, None, False
    for line in help_text.splitlines():
        if not line.strip():
            section, name = False, None
        elif not line.startswith(" ") and line.endswith(":"):
            section = line != "commands:"
        elif section and OPTION_RE.match(line):
            name = line.split()[0].rstrip(",")
            entries[name] = line
        elif section and name:
            entries[name] += " " + line.strip()
    return entries


# ------------------------------------------------------------------------------------------------------ --help
@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("module, argv", HELP)
def test_help_describes_the_command_and_every_default(module, argv, flag):
    got = _module(module, *argv, flag)
    assert got.returncode == 0, got.stderr
    assert got.stderr == ""
    usage, _, rest = got.stdout.partition("\n\n")
    assert usage.startswith(f"usage: python -m {module} {' '.join(argv)}".rstrip())
    description = rest.split("\n\n")[0]
    assert not description.startswith(("options:", "positional arguments:"))
    assert len(description.split()) >= 8, description  # what it does, not a bare usage line
    assert "default" in got.stdout
    entries = _entries(got.stdout)
    assert set(re.findall(r"\[(-[-\w]+)", usage)) <= set(entries) and "-h" in entries  # each option explained
    for name, text in entries.items():
        if name != "-h":
            assert "default" in text, f"{module} {' '.join(argv)} {name}: no default in {text!r}"


def test_help_of_the_jit_lists_its_commands(capsys):
    from deepep_cupy.jit.__main__ import COMMANDS, main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n  {name} " in out for name in COMMANDS)
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "no command given" in err and "precompile" in err


def test_help_of_the_tuner_lists_its_commands_with_defaults(capsys):
    from deepep_cupy.tuning import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert set(cli.COMMANDS) == {"sms", "internode"}
    listing = out.split("\ncommands:\n", 1)[1].split("\n\n")[0]
    entries = {}
    for line in listing.splitlines():
        if not line.startswith("   "):
            name = line.split()[0]
            entries[name] = line
        else:
            entries[name] += " " + line.strip()
    assert set(entries) == set(cli.COMMANDS), listing
    assert all("(default: " in text for text in entries.values()), listing
    assert "<command> --help" in out
    with pytest.raises(SystemExit) as info:
        cli.main(["sweep"])
    assert info.value.code == 2
    assert "unknown command 'sweep'; choose from sms, internode" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------ no GPU
def _cupy(devices=0, error=None):
    """A stand-in for the ``cupy`` module: ``getDeviceCount()`` returns ``devices`` or raises ``error``."""

    def count():
        if error is not None:
            raise error
        return devices

    return SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(getDeviceCount=count)))


@pytest.mark.parametrize("cupy", [None, _cupy(0), _cupy(2), _cupy(error=RuntimeError("cudaErrorNoDevice"))],
                         ids=["no CuPy", "CuPy, no device", "CuPy, two devices", "CuPy raises"])
def test_no_driver_or_device_is_no_gpu_found(monkeypatch, cupy):
    monkeypatch.setattr(gpus, "gpu_count", lambda: 0)
    monkeypatch.setitem(sys.modules, "cupy", cupy)  # None: `import cupy` raises ImportError
    assert gpus.no_gpu_reason() == "no GPU found"
    line = gpus.no_gpu_message("the benchmarks need")
    assert line.startswith("no GPU found; the benchmarks need a CUDA GPU and CuPy: pip install ")
    assert '"deepep_cupy[cuda13]"' in line and '"deepep_cupy[cuda12]"' in line


@pytest.mark.parametrize("cupy, want", [
    (None, "CuPy is not installed"),
    (_cupy(0), "CuPy sees no GPU"),
    (_cupy(error=RuntimeError("cudaErrorInsufficientDriver: driver too old\nsecond line")),
     "CuPy cannot use the GPU (RuntimeError: cudaErrorInsufficientDriver: driver too old)"),
    (_cupy(1), None),
], ids=["no CuPy", "CuPy, no device", "CuPy raises", "CuPy, a device"])
def test_with_a_driver_and_a_device_cupy_is_checked(monkeypatch, cupy, want):
    monkeypatch.setattr(gpus, "gpu_count", lambda: 1)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    assert gpus.no_gpu_reason() == want
    assert (gpus.no_gpu_message("tuning needs") is None) == (want is None)


def _exit_line(main, argv) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    line = info.value.code
    assert isinstance(line, str) and "\n" not in line, line  # sys.exit(message): one line on stderr, status 1
    return line


@pytest.mark.parametrize("cupy", [None, _cupy(0)], ids=["no CuPy", "CuPy"])
def test_bench_and_tuning_without_a_gpu(monkeypatch, cupy):
    from deepep_cupy.bench import __main__ as bench
    from deepep_cupy.tuning import cli as tune

    monkeypatch.setattr(gpus, "gpu_count", lambda: 0)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    for argv in (["host"], [], ["all", "compiled"], ["--quick"]):
        line = _exit_line(bench.main, argv)
        assert line.startswith("python -m deepep_cupy.bench: no GPU found; the benchmarks (all but the compiled "
                               "and ep suites) need a CUDA GPU and CuPy: pip install \"deepep_cupy[cuda13]\""), line
    line = _exit_line(tune.main, ["--hidden", "4096"])
    assert line.startswith("python -m deepep_cupy.tuning: no GPU found; tuning (all but --show) needs a CUDA GPU "
                           "and CuPy: pip install \"deepep_cupy[cuda13]\""), line
    assert "cuda12" in line


def test_bench_and_tuning_with_a_gpu_but_no_cupy(monkeypatch):
    from deepep_cupy.bench import __main__ as bench
    from deepep_cupy.tuning import cli as tune

    monkeypatch.setattr(gpus, "gpu_count", lambda: 1)
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert _exit_line(bench.main, ["host"]).startswith("python -m deepep_cupy.bench: CuPy is not installed; ")
    assert _exit_line(tune.main, []).startswith("python -m deepep_cupy.tuning: CuPy is not installed; ")


@pytest.mark.parametrize("cupy", [None, _cupy(0)], ids=["no CuPy", "CuPy"])
@pytest.mark.parametrize("command, needs", [("sms", "the block-shape sweep needs"),
                                            ("internode", "the internode sweep needs")])
def test_tuning_sweeps_without_a_gpu(monkeypatch, cupy, command, needs):
    from deepep_cupy.tuning import cli as tune

    monkeypatch.setattr(gpus, "gpu_count", lambda: 0)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    line = _exit_line(tune.main, [command, "--num-sms", "8"])
    assert line.startswith(f"python -m deepep_cupy.tuning {command}: no GPU found; {needs} a CUDA GPU and CuPy: "
                           "pip install \"deepep_cupy[cuda13]\""), line
    monkeypatch.setattr(gpus, "gpu_count", lambda: 1)
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert _exit_line(tune.main, [command]).startswith(f"python -m deepep_cupy.tuning {command}: CuPy is not "
                                                       "installed; ")


@pytest.mark.parametrize("module, argv, prog", [
    ("deepep_cupy.bench", ("host",), "python -m deepep_cupy.bench"),
    ("deepep_cupy.tuning", (), "python -m deepep_cupy.tuning"),
    ("deepep_cupy.tuning", ("sms",), "python -m deepep_cupy.tuning sms"),
    ("deepep_cupy.tuning", ("internode",), "python -m deepep_cupy.tuning internode"),
])
def test_without_a_gpu_the_commands_print_one_line(module, argv, prog):
    got = _module(module, *argv)  # DEEPEP_CUPY_FORCE_NO_GPU=1: no GPU, whatever this machine has
    assert got.returncode == 1, got.stdout + got.stderr
    assert got.stdout == "" and "Traceback" not in got.stderr
    lines = got.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: no GPU found; "), got.stderr


# -------------------------------------------------------------------------------------------- precompile, NVRTC
def _without(monkeypatch, *libs):
    """Make cuda.pathfinder's loader (the one cuda.bindings loads NVRTC and nvJitLink with) miss ``libs``."""
    from cuda import pathfinder

    real = pathfinder.load_nvidia_dynamic_lib

    def load(name):
        if name in libs:
            raise pathfinder.DynamicLibNotFoundError(f'Failure finding "lib{name}.so": not in any search path')
        return real(name)

    monkeypatch.setattr(pathfinder, "load_nvidia_dynamic_lib", load)


def _no_compiles(monkeypatch):
    def run(*args, **kwargs):
        raise AssertionError("precompile started compiling")

    monkeypatch.setattr(pre, "run", run)


@pytest.mark.parametrize("argv, named", [
    (["--arch", "sm_90"], "libnvrtc.so, libnvJitLink.so"),  # the README's command: NVSHMEM kernels link too
    (["--arch", "sm_90", "layout"], "libnvrtc.so"),
])
def test_precompile_without_nvrtc_says_so_once(monkeypatch, capsys, argv, named):
    pytest.importorskip("cuda.pathfinder")
    _without(monkeypatch, "nvrtc", "nvJitLink")
    _no_compiles(monkeypatch)
    assert pre.main(argv) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [f"precompile: cannot compile, not found: {named}; pip install "
                                "\"deepep_cupy[compile]\" (or the cuda13 or cuda12 extra, which include it)"]


def test_precompile_without_headers_names_them(monkeypatch, capsys):
    monkeypatch.setattr(pre, "toolchain", lambda: Toolchain((), None, None, {}))
    _no_compiles(monkeypatch)
    assert pre.main(["--arch", "sm_90", "internode"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    for piece in ("the CUDA headers", "the CCCL headers", "the NVSHMEM headers and libnvshmem_device.a",
                  'pip install "deepep_cupy[compile]"'):
        assert piece in line


def test_precompile_finds_what_this_install_has():
    # The test environment has the compile extra: nothing is missing, so a false alarm would show here.
    jobs = pre.plan(list(pre.FAMILIES), ["sm_90"])
    assert any(job.spec.nvshmem for job in jobs)
    assert pre.missing_toolkit(jobs) == []


_NO_NVRTC = r"""
import runpy, sys
from cuda import pathfinder

real = pathfinder.load_nvidia_dynamic_lib

def load(name):
    if name in ("nvrtc", "nvJitLink"):
        raise pathfinder.DynamicLibNotFoundError(f'Failure finding "lib{name}.so": not in any search path')
    return real(name)

pathfinder.load_nvidia_dynamic_lib = load
sys.argv = ["deepep_cupy.jit", *sys.argv[1:]]
runpy.run_module("deepep_cupy.jit", run_name="__main__")
"""


def test_precompile_command_without_nvrtc(tmp_path):
    pytest.importorskip("cuda.pathfinder")
    env = dict(os.environ, DEEPEP_CUPY_CACHE_DIR=str(tmp_path / "cache"))
    # One family, one worker: were NVRTC not checked first, the test would fail after a few short compiles.
    got = subprocess.run([sys.executable, "-c", _NO_NVRTC, "precompile", "--arch", "sm_90", "-j", "1", "layout"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert got.returncode == 1, got.stdout + got.stderr
    assert got.stdout == "" and "Traceback" not in got.stderr
    (line,) = got.stderr.splitlines()
    assert "libnvrtc.so" in line and 'pip install "deepep_cupy[compile]"' in line
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.cubin"))

"""The benchmark command line on a machine without GPUs: suites parse on every Python, and the run stops with
one line saying why instead of a traceback; the compiled suite runs on the reference backend."""

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest


def _bench(*argv, timeout=120):
    # DEEPEP_CUPY_FORCE_NO_GPU keeps the library's own GPU lookups off even where a driver is present.
    env = dict(os.environ, DEEPEP_CUPY_FORCE_NO_GPU="1")
    return subprocess.run([sys.executable, "-m", "deepep_cupy.bench", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("argv", [(), ("--quick",), ("all",), ("host",), ("host", "low_latency", "--quick"),
                                  ("compiled", "host")])
def test_without_gpus_one_clear_line(argv):
    got = _bench(*argv)
    assert got.returncode != 0
    assert "Traceback" not in got.stderr
    assert "invalid choice" not in got.stderr
    lines = [line for line in got.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, got.stderr
    assert lines[0].startswith("python -m deepep_cupy.bench: no GPU found; ") and "deepep_cupy[cuda13]" in lines[0]


@pytest.mark.parametrize("argv", [("--help",), ("host", "--help")])
def test_help(argv):
    got = _bench(*argv)
    assert got.returncode == 0, got.stderr
    assert "host" in got.stdout and "low_latency" in got.stdout and "compiled" in got.stdout


def test_unknown_suite_is_a_usage_error():
    got = _bench("nope")
    assert got.returncode == 2
    assert "unknown suite 'nope'" in got.stderr
    assert "Traceback" not in got.stderr


def test_num_sms_is_one_count_or_a_comma_list(capsys):
    from deepep_cupy.bench import __main__ as cli
    from deepep_cupy.bench.timing import sm_counts

    parse = cli.command_line().parse_args
    assert parse([]).num_sms == (24,)
    assert parse(["--num-sms", "20"]).num_sms == (20,)
    assert parse(["intranode", "--num-sms", "8,12,24"]).num_sms == (8, 12, 24)
    assert parse(["--num-sms", "24, 8,24"]).num_sms == (24, 8)  # in the order given, each once
    assert sm_counts(parse(["--num-sms", "8,12"])) == (8, 12)
    assert sm_counts(SimpleNamespace(num_sms=16)) == (16,)  # a plain int, as older callers pass it
    for bad in ("", "x", "8,,y", "0", "8,-2"):
        with pytest.raises(SystemExit):
            parse(["--num-sms", bad])
        assert "comma list" in capsys.readouterr().err


def test_a_suite_per_sm_count_gets_its_time_per_count(monkeypatch):
    import faulthandler

    from deepep_cupy.bench import __main__ as cli

    seen = []
    monkeypatch.setattr(cli, "comm_barrier", lambda comm, op: None)
    monkeypatch.setattr(faulthandler, "dump_traceback_later", lambda timeout, exit: seen.append(timeout))
    monkeypatch.setattr(faulthandler, "cancel_dump_traceback_later", lambda: None)
    per_count = SimpleNamespace(run=lambda comm, args: [], PER_SM_COUNT=True, SUITE_TIMEOUT_S=100)
    once = SimpleNamespace(run=lambda comm, args: [], SUITE_TIMEOUT_S=100)
    args = cli.command_line().parse_args(["--num-sms", "8,12,24"])
    cli.run_suite(per_count, "intranode", None, args)
    cli.run_suite(once, "internode", None, args)
    cli.run_suite(per_count, "intranode", None, cli.command_line().parse_args(["--num-sms", "8,24",
                                                                              "--suite-timeout", "50"]))
    assert seen == [300, 100, 50]


def test_host_suite_imports_without_a_gpu():
    from deepep_cupy.bench import __main__ as cli
    from deepep_cupy.bench import host

    assert "host" in cli.SUITES
    assert callable(host.run)
    assert host.CALLS % host.BATCH == 0


def test_host_suite_clocks():
    from deepep_cupy.bench import host

    calls = []
    (t,) = host._clock(lambda: calls.append(1))()
    assert calls == [1] and t >= 0
    send, recv = host._clock_hook(lambda: (lambda: calls.append(2)))()
    assert calls == [1, 2] and send >= 0 and recv >= 0


def test_host_suite_inputs_follow_the_arguments():
    pytest.importorskip("ml_dtypes")
    from deepep_cupy.bench import host

    class Comm:
        def Get_rank(self):
            return 0

        def Get_size(self):
            return 2

    args = argparse.Namespace(tokens=64, hidden=256, experts=16, topk=4, ll_tokens=8, ll_experts=24)
    suite = host._Suite(Comm(), args)
    assert suite.host["x"].shape == (64, 256)
    idx = suite.host["idx"]
    assert idx.shape == (64, 4) and idx.dtype.name == "int64"
    assert all(len(set(r)) == 4 for r in idx.tolist()) and idx.min() >= 0 and idx.max() < 16
    assert suite.host["ll_out"].shape == (12, 16, 256)


# ---------------------------------------------------------------------------------------------------- compiled
def test_compiled_suite_runs_only_when_named():
    from deepep_cupy.bench import __main__ as cli

    assert "compiled" in cli.OPT_IN and "compiled" not in cli.SUITES
    assert cli.command_line().parse_args(["compiled"]).suites == ["compiled"]


def test_a_failing_suite_fails_the_run_only_where_it_says_so(monkeypatch):
    from deepep_cupy.bench import __main__ as cli

    monkeypatch.setattr(cli, "comm_barrier", lambda comm, op: None)
    args = cli.command_line().parse_args([])

    def raising(comm, args):
        raise RuntimeError("results differ")

    strict = SimpleNamespace(run=raising, FAIL_RUN=True, SUITE_TIMEOUT_S=30)
    rows, failure = cli.run_suite(strict, "compiled", None, args)
    assert "results differ" in failure and rows[0]["suite"] == "compiled" and "failed" in rows[0]["note"]
    rows, failure = cli.run_suite(SimpleNamespace(run=raising), "host", None, args)
    assert failure is None and "results differ" in rows[0]["note"]
    rows, failure = cli.run_suite(SimpleNamespace(run=lambda comm, args: [{"op": "x", "us": 1.0}], FAIL_RUN=True),
                                  "compiled", None, args)
    assert failure is None and rows == [{"op": "x", "us": 1.0, "suite": "compiled"}]


# The compiled suite on the reference backend (CPU, aot_eager), small shapes and few calls. --perturb adds 1
# to the last output of every compiled step (the combined tokens): the checks must catch it. With
# --rank-1-cannot-compile, torch.compile raises on rank 1 only.
_COMPILED_SUITE = r"""
import argparse, sys
from mpi4py import MPI
from deepep_cupy.bench import compiled

compiled.CALLS, compiled.CHECKS = 10, 2
if "--perturb" in sys.argv:
    real = compiled._compile

    def perturbed(fn, mode, backend):
        inner = real(fn, mode, backend)

        def call(*args):
            out = inner(*args)
            return (*out[:-1], out[-1] + 1)

        return call

    compiled._compile = perturbed
if "--rank-1-cannot-compile" in sys.argv:
    real = compiled._compile

    def broken(fn, mode, backend):
        if MPI.COMM_WORLD.Get_rank() == 1:
            raise RuntimeError("no compiler here")
        return real(fn, mode, backend)

    compiled._compile = broken
size = MPI.COMM_WORLD.Get_size()
args = argparse.Namespace(tokens=16, hidden=512, experts=4 * size, topk=2, ll_tokens=8, ll_experts=4 * size,
                          compiled_steps=4, suite_timeout=None)
compiled.run(MPI.COMM_WORLD, args)
"""


def _compiled_suite(ranks: int, *argv, **env):
    pytest.importorskip("torch")
    pytest.importorskip("mpi4py")
    command = [sys.executable, "-c", _COMPILED_SUITE, *argv]
    if ranks > 1:
        mpiexec = os.environ.get("MPIEXEC") or shutil.which("mpiexec") or \
            shutil.which("mpiexec", path=str(Path(sys.executable).parent))
        if mpiexec is None:
            pytest.skip("no mpiexec on PATH (pip install -e '.[mpi]')")
        command = [mpiexec, "-n", str(ranks), *command]
    env = dict(os.environ, DEEPEP_CUPY_FORCE_NO_GPU="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               **env)
    return subprocess.run(command, capture_output=True, text=True, timeout=400, env=env)


def test_compiled_suite_on_the_reference_backend():
    got = _compiled_suite(2)
    assert got.returncode == 0, got.stdout + got.stderr
    assert "2 ranks, the reference backend (CPU)" in got.stdout and "aot_eager" in got.stdout
    # Two ways of each step compared with the eager Buffer calls (custom ops eagerly, compiled), all equal.
    assert got.stdout.count("same, 2 checks") == 4 and "DIFFERS" not in got.stdout
    for op in ("get_dispatch_layout", "dispatch (cached handle)", "combine", "low_latency_dispatch (FP8)",
               "low_latency_combine"):
        assert f"\n{op} " in got.stdout


def test_compiled_suite_runs_without_a_gpu():
    # The command itself, one rank (MPI singleton), small shapes: no GPU is no reason to stop.
    pytest.importorskip("torch")
    pytest.importorskip("mpi4py")
    got = _bench("compiled", "--tokens", "16", "--hidden", "512", "--experts", "4", "--topk", "2", "--ll-tokens", "8",
                 "--ll-experts", "4", "--compiled-steps", "4", timeout=400)
    assert got.returncode == 0, got.stdout + got.stderr
    assert "1 ranks, the reference backend (CPU)" in got.stdout and "DIFFERS" not in got.stdout
    assert "targets not compared: no GPU: the reference backend ran" in got.stdout
    assert "no GPU found" not in got.stderr


def test_compiled_suite_fails_on_a_difference():
    got = _compiled_suite(1, "--perturb")
    assert got.returncode != 0
    assert got.stdout.count("DIFFERS on rank 0: combined (check 0)") == 2, got.stdout + got.stderr
    assert "Differs" in got.stderr


def test_compiled_suite_fails_when_one_rank_cannot_compile():
    # Rank 0 waits for rank 1 in the dispatch until the library's wait budget (short here) ends it.
    got = _compiled_suite(2, "--rank-1-cannot-compile", DEEPEP_CUPY_TIMEOUT_S="3")
    assert got.returncode != 0
    assert "CompileFailed" in got.stderr and "rank 1: RuntimeError: no compiler here" in got.stderr, got.stderr


# ---------------------------------------------------------------------------------------------------- ep
def test_ep_suite_runs_only_when_named_and_without_a_gpu():
    from deepep_cupy.bench import __main__ as cli
    from deepep_cupy.bench import ep

    assert "ep" in cli.OPT_IN and "ep" in cli.NO_GPU_SUITES and "ep" not in cli.SUITES
    assert ep.FAIL_RUN  # an implausible output fails the run


@pytest.mark.parametrize("ranks", [1, 2])
def test_ep_suite_on_the_reference_backend(ranks):
    """V2's ways beside their V1 calls, every row timed; at 2 ranks under mpiexec where there is one."""
    argv = ["ep", "--tokens", "32", "--hidden", "128", "--experts", "8", "--ll-tokens", "8", "--ll-experts", "8",
            "--topk", "2"]
    if ranks == 1:
        got = _bench(*argv)
    else:
        mpiexec = os.environ.get("MPIEXEC") or shutil.which("mpiexec")
        if mpiexec is None:
            pytest.skip("no mpiexec on PATH (pip install -e '.[mpi]')")
        env = dict(os.environ, DEEPEP_CUPY_FORCE_NO_GPU="1")
        got = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "deepep_cupy.bench", *argv],
                             capture_output=True, text=True, timeout=300, env=env)
    assert got.returncode == 0, got.stdout + got.stderr
    names = ["prefill, sizes read back", "prefill, expanded", "prefill, sync-free", "prefill, cached",
             "decode, cached"]
    rows = [line for line in got.stdout.splitlines() if line.startswith("V2 ")]
    assert [r.split(" (")[0][3:] for r in rows] == names, got.stdout
    assert all("failed" not in r for r in rows) and f"{ranks} ranks" in got.stdout


def test_ep_suite_checks_its_outputs():
    import numpy as np

    from deepep_cupy.bench.ep import _problem

    assert _problem(np.ones((4, 8), np.float32)) is None
    assert _problem(np.zeros((4, 8), np.float32)) == "all zero"
    assert _problem(np.array([[1.0, np.inf]], np.float32)) == "not finite"

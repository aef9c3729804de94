"""The benchmark command line on a machine without GPUs: suites parse on every Python, and the run stops with
one line saying why instead of a traceback."""

import argparse
import os
import subprocess
import sys

import pytest

from deepep_cupy.device.gpus import gpu_count


def _bench(*argv, timeout=120):
    # DEEPEP_CUPY_FORCE_NO_GPU keeps the library's own GPU lookups off even where a driver is present.
    env = dict(os.environ, DEEPEP_CUPY_FORCE_NO_GPU="1")
    return subprocess.run([sys.executable, "-m", "deepep_cupy.bench", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture
def no_gpu():
    if gpu_count() > 0:
        pytest.skip("a GPU is present: the benchmarks would run")


@pytest.mark.parametrize("argv", [(), ("--quick",), ("all",), ("host",), ("host", "low_latency", "--quick")])
def test_without_gpus_one_clear_line(no_gpu, argv):
    got = _bench(*argv)
    assert got.returncode != 0
    assert "Traceback" not in got.stderr
    assert "invalid choice" not in got.stderr
    lines = [line for line in got.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, got.stderr
    assert "need CUDA GPUs" in lines[0]


@pytest.mark.parametrize("argv", [("--help",), ("host", "--help")])
def test_help(argv):
    got = _bench(*argv)
    assert got.returncode == 0, got.stderr
    assert "host" in got.stdout and "low_latency" in got.stdout


def test_unknown_suite_is_a_usage_error():
    got = _bench("nope")
    assert got.returncode == 2
    assert "unknown suite 'nope'" in got.stderr
    assert "Traceback" not in got.stderr


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

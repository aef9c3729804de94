"""Whole jobs under ``mpiexec -n 2`` started from pytest: the launcher, the marks that skip without one,
and one run of a job script with a timeout budget for the library."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

MPIEXEC = os.environ.get("MPIEXEC", "mpiexec")
MARKS = [pytest.mark.skipif(shutil.which(MPIEXEC) is None, reason="needs mpiexec"),
         pytest.mark.timeout(120, method="thread")]


def run_job(tmp_path, script: str, mode: str, timeout_s: float, *launcher: str, **env):
    """Runs ``script`` (its text) on 2 ranks as ``python [launcher...] job.py mode`` with
    ``DEEPEP_CUPY_TIMEOUT_S=timeout_s`` and ``env``; returns the finished process and the seconds it took."""
    path = tmp_path / "job.py"
    path.write_text(script)
    full_env = dict(os.environ, DEEPEP_CUPY_TIMEOUT_S=str(timeout_s), **env)
    start = time.monotonic()
    proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, *launcher, str(path), mode], env=full_env,
                          capture_output=True, text=True, timeout=90)
    return proc, time.monotonic() - start

"""Whole jobs under ``mpiexec -n 2`` (started from here) where one rank goes wrong: the job must end on its
own, quickly, with the error named; nothing may hang at construction, in an op or at interpreter exit."""

import textwrap

import pytest
from mpi_job import MARKS, run_job

pytest.importorskip("mpi4py")
pytestmark = MARKS

SCRIPT = textwrap.dedent('''
    import os, sys, time
    import ml_dtypes, numpy as np
    from mpi4py import MPI
    from deepep_cupy import Buffer
    from deepep_cupy.errors import DeepEPTimeoutError

    comm, mode = MPI.COMM_WORLD, sys.argv[1]
    rank = comm.Get_rank()

    def dispatch(buf):
        idx = np.zeros((4, 1), np.int64)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 2 * comm.Get_size())
        buf.dispatch(np.ones((4, 128), ml_dtypes.bfloat16), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                     num_tokens_per_expert=per_expert)

    try:
        if mode == "construct":  # rank 1 never makes the Buffer
            if rank == 0:
                Buffer(comm=comm, backend="reference")
        elif mode == "skip":  # rank 1 makes it but never calls dispatch
            buf = Buffer(comm=comm, backend="reference", num_nvl_bytes=1 << 24)
            if rank == 0:
                dispatch(buf)
        elif mode == "raise":  # rank 0's own code fails; rank 1 waits in dispatch (for far longer than the test)
            buf = Buffer(comm=comm, backend="reference", num_nvl_bytes=1 << 24)
            if rank == 0:
                raise RuntimeError("the user's code failed on rank 0")
            dispatch(buf)
    except DeepEPTimeoutError as exc:
        print(f"rank {rank} TIMEOUT: {exc}", flush=True)
    print(f"rank {rank} exits", flush=True)
''')


def _job(tmp_path, mode, timeout_s, *launcher):
    proc, took = run_job(tmp_path, SCRIPT, mode, timeout_s, *launcher, DEEPEP_CUPY_BACKEND="reference")
    return proc.returncode, proc.stdout + proc.stderr, took


@pytest.mark.parametrize("mode", ["construct", "skip"])
def test_a_rank_that_never_comes_ends_in_a_named_timeout_and_the_job_exits(tmp_path, mode):
    rc, out, took = _job(tmp_path, mode, 2)
    assert rc == 0, out
    op = "Buffer" if mode == "construct" else "dispatch"
    assert f"rank 0 TIMEOUT: {op}" in out, out
    if mode == "skip":
        assert "for rank 1, which did not arrive" in out, out
    assert "rank 0 exits" in out and "rank 1 exits" in out, out
    assert took < 30, took


def test_launched_with_python_m_mpi4py_an_uncaught_error_ends_the_whole_job(tmp_path):
    # The library would let rank 1 wait 60 s; the launcher aborts the job as soon as rank 0 fails.
    rc, out, took = _job(tmp_path, "raise", 60, "-m", "mpi4py")
    assert rc != 0, out
    assert "the user's code failed on rank 0" in out, out
    assert "rank 1 exits" not in out, out
    assert took < 30, took

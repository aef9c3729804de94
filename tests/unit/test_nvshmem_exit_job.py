"""Interpreter exit under ``mpiexec -n 2`` (started from here) with NVSHMEM faked: the exit hook finalizes
only after a bounded barrier on the library's own communicator. When rank 1 never comes to it (it stopped
calling the library, as a masked rank does, and outlives rank 0), rank 0 must skip the collective finalize,
say which rank was missing in one line on stderr, and leave within the timeout; when both are there, both
finalize. (A rank that dies outright ends the whole job under MPICH's launcher; the GPU test
tests/gpu/test_teardown_dead_rank.py covers that case with processes no MPI launcher watches.)"""

import os
import subprocess
import sys
import textwrap
import time

import pytest
from mpi_job import MARKS, run_job

pytest.importorskip("mpi4py")
pytestmark = MARKS

SCRIPT = textwrap.dedent('''
    import atexit, os, sys, time
    from mpi4py import MPI
    from deepep_cupy.device import nvshmem as nv
    from deepep_cupy.device.group import MPIGroup

    comm, mode = MPI.COMM_WORLD, sys.argv[1]
    rank = comm.Get_rank()
    left = {}
    # Registered before the library's hook, so it runs after it: how long the exit took on this rank.
    atexit.register(lambda: print(f"rank {rank} left after {time.monotonic() - left['at']:.1f} s", flush=True))

    class Fake:
        def finalize(self):
            print(f"rank {rank} finalized", flush=True)

    fake = Fake()
    nv._modules = lambda: (fake, fake)
    group = MPIGroup(comm)
    # What nvshmem._init does around the library's own init call.
    nv._state.update(initialized=True, rank=rank, size=comm.Get_size(), device=0,
                     exit_group=nv._own_group(group))
    atexit.register(nv._finalize_at_exit)
    group.close()  # as Buffer.destroy does: the exit barrier must not need the Buffer's group
    comm.Barrier()
    if mode == "gone" and rank == 1:
        atexit.unregister(nv._finalize_at_exit)  # never comes to the exit barrier
        time.sleep(3 * float(os.environ["DEEPEP_CUPY_TIMEOUT_S"]))
    print(f"rank {rank} exits", flush=True)
    left["at"] = time.monotonic()
''')


def _job(tmp_path, mode, timeout_s):
    return run_job(tmp_path, SCRIPT, mode, timeout_s)


def test_every_rank_at_exit_finalizes(tmp_path):
    proc, _took = _job(tmp_path, "all", 30)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "rank 0 finalized" in out and "rank 1 finalized" in out, out
    assert "not finalized" not in out, out


def test_a_vanished_rank_skips_the_finalize_with_a_warning_and_the_survivor_exits(tmp_path):
    proc, took = _job(tmp_path, "gone", 2)
    out = proc.stdout + proc.stderr
    assert "rank 0 exits" in out, out
    assert "finalized" not in out.replace("not finalized", ""), out
    assert "deepep_cupy: NVSHMEM not finalized at exit: rank 1 of 2 did not arrive" in proc.stderr, out
    assert proc.stderr.count("not finalized") == 1, out
    seconds = float(out.split("rank 0 left after ")[1].split()[0])
    assert 1.5 < seconds < 5, out  # the barrier's 2 s, then gone
    assert proc.returncode == 0 and took < 30, (took, out)


TORCH_SCRIPT = textwrap.dedent('''
    import atexit, os, sys, time
    import torch.distributed as dist
    from deepep_cupy.errors import DeepEPTimeoutError
    from deepep_cupy.device import nvshmem as nv
    from deepep_cupy.device.group import TorchGroup

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    class Fake:
        def finalize(self):
            print(f"rank {rank} finalized", flush=True)

    fake = Fake()
    nv._modules = lambda: (fake, fake)
    group = TorchGroup(dist.group.WORLD)
    nv._state.update(initialized=True, rank=rank, size=2, device=0, exit_group=nv._own_group(group))
    atexit.register(nv._finalize_at_exit)
    group.barrier(op="setup")
    if rank == 1:
        os._exit(0)  # dies hard: no exit hooks, its connections close
    time.sleep(0.5)
    start = time.monotonic()
    try:
        group.barrier(op="Buffer.destroy")
        print("rank 0 destroy returned", flush=True)
    except DeepEPTimeoutError as exc:
        print(f"rank 0 destroy: DeepEPTimeoutError missing={exc.missing}", flush=True)
    print(f"rank 0 exits after {time.monotonic() - start:.1f} s", flush=True)
''')


def test_a_rank_that_dies_hard_under_gloo_ends_in_a_named_error_and_a_bounded_exit(tmp_path):
    pytest.importorskip("torch.distributed")
    import socket

    script = tmp_path / "job.py"
    script.write_text(TORCH_SCRIPT)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, DEEPEP_CUPY_TIMEOUT_S="2")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    start = time.monotonic()
    try:
        out0, err0 = procs[0].communicate(timeout=60)
        took = time.monotonic() - start
        procs[1].communicate(timeout=10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    out = out0 + err0
    assert procs[0].returncode == 0, out
    assert "rank 0 destroy: DeepEPTimeoutError missing=[1]" in out, out
    assert "finalized" not in out.replace("not finalized", ""), out
    assert "deepep_cupy: NVSHMEM not finalized at exit: rank 1 of 2 did not arrive" in err0, out
    assert took < 30, (took, out)

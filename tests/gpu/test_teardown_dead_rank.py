"""Teardown with a dead rank on 2 GPUs: rank 1 makes a low-latency Buffer (enable_shrink), runs one round,
then dies hard (``os._exit``: no destroy, no exit hooks). Rank 0 must mask it in its next dispatch, get a
DeepEPTimeoutError naming rank 1 from ``destroy()`` and leave the interpreter within the timeout, skipping
the collective NVSHMEM finalize with one warning line on stderr; a second job where both ranks destroy and
exit normally must finalize without that warning.

The two ranks are processes this test starts itself, joined by torch.distributed (gloo), so that no MPI
launcher ends the job when rank 1 dies. Run as ONE process (not under mpirun):

    python -m pytest tests/gpu/test_teardown_dead_rank.py -q
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from deepep_cupy.device.gpus import gpu_count

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 2, reason="needs 2 CUDA GPUs"),
              pytest.mark.timeout(300, method="thread")]

TIMEOUT_S = 3  # DEEPEP_CUPY_TIMEOUT_S of the ranks: the kernels' and the host waits' budget
LIMIT_S = 120  # rank 0 must be gone this long after it starts (compile of the kernels included)

RANK = textwrap.dedent('''
    import os, sys, time
    import torch
    import torch.distributed as dist
    import deepep_cupy
    from deepep_cupy.errors import DeepEPTimeoutError

    rank, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.cuda.set_device(rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    T, H, E = 32, 2048, 16
    buf = deepep_cupy.Buffer(group=dist.group.WORLD, low_latency_mode=True, enable_shrink=True,
                             explicitly_destroy=True,
                             num_rdma_bytes=deepep_cupy.Buffer.get_low_latency_rdma_size_hint(T, H, 2, E))
    gen = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    topk = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:4] for _ in range(T)])
    w = torch.rand(T, 4, device="cuda", generator=gen)

    def one_round():
        recv, count, handle, _e, _h = buf.low_latency_dispatch(x, topk, T, E, use_fp8=False)
        out, _e, _h = buf.low_latency_combine(recv, topk, w, handle)
        torch.cuda.synchronize()
        return out

    one_round()
    print(f"rank {rank} ran a round", flush=True)
    dist.barrier()
    if mode == "dead" and rank == 1:
        os._exit(0)  # no destroy, no NVSHMEM finalize: as a crashed or killed process
    if mode == "dead":
        time.sleep(1)  # rank 1 is gone by now
        start = time.monotonic()
        one_round()  # rank 1 masked after the kernels' budget
        status = torch.zeros(2, dtype=torch.int32, device="cuda")
        buf.low_latency_query_mask_buffer(status)
        print(f"rank 0 mask {status.tolist()} after {time.monotonic() - start:.1f} s", flush=True)
    start = time.monotonic()
    try:
        buf.destroy()
        print(f"rank {rank} destroy returned", flush=True)
    except DeepEPTimeoutError as exc:
        print(f"rank {rank} destroy: DeepEPTimeoutError missing={exc.missing}", flush=True)
    print(f"rank {rank} exits after {time.monotonic() - start:.1f} s", flush=True)
''')


def _job(tmp_path, mode):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, DEEPEP_CUPY_TIMEOUT_S=str(TIMEOUT_S), PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), mode], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    start = time.monotonic()
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(LIMIT_S - (time.monotonic() - start), 1))
            results.append((p.returncode, out, err, time.monotonic() - start))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{mode}: a rank still runs after {LIMIT_S} s (a hang); finished: {results}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results


def test_survivor_of_a_dead_rank_destroys_and_exits_within_the_timeout(tmp_path):
    pytest.importorskip("nvshmem.core")
    (rc0, out0, err0, _t0), (_rc1, out1, _err1, _t1) = _job(tmp_path, "dead")
    log = f"rank 0 stdout:\n{out0}\nrank 0 stderr:\n{err0[-4000:]}\nrank 1 stdout:\n{out1}"
    assert "rank 1 ran a round" in out1, log
    assert "rank 0 mask [0, 1]" in out0, log
    assert "rank 0 destroy: DeepEPTimeoutError missing=[1]" in out0, log
    took = float(out0.split("rank 0 exits after ")[1].split()[0])
    assert took < 2 * TIMEOUT_S + 5, log  # destroy bounded
    assert "deepep_cupy: NVSHMEM not finalized at exit: rank 1 of 2 did not arrive" in err0, log
    assert rc0 == 0, log  # the exit skipped the collective finalize and nothing crashed after it


def test_both_ranks_destroy_and_finalize_normally(tmp_path):
    pytest.importorskip("nvshmem.core")
    results = _job(tmp_path, "clean")
    for rank, (rc, out, err, _took) in enumerate(results):
        log = f"rank {rank} stdout:\n{out}\nstderr:\n{err[-4000:]}"
        assert f"rank {rank} destroy returned" in out, log
        assert "not finalized" not in err, log
        assert rc == 0, log

"""A low-latency Buffer whose set-up fails on one rank, on 2 GPUs: rank 1's engine raises right after the
collective NVSHMEM allocation. Every rank must end with a named error within the timeout (rank 1 its own,
rank 0 a ``DeepEPError`` naming rank 1), none may hang in a barrier or in the collective free, and both must
then make a new Buffer, run a round, destroy it and exit normally (NVSHMEM finalized at exit).

The two ranks are processes this test starts itself, joined by torch.distributed (gloo). Run as ONE process
(not under mpirun):

    python -m pytest tests/gpu/test_setup_failure.py -q
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

TIMEOUT_S = 30  # DEEPEP_CUPY_TIMEOUT_S of the ranks (the round after compiles its kernels on both)
LIMIT_S = 150  # both ranks must be gone this long after they start (compile of the kernels included)

RANK = textwrap.dedent('''
    import sys, time
    import torch
    import torch.distributed as dist
    import deepep_cupy
    from deepep_cupy.ops.low_latency import engine as ll_engine

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    torch.cuda.set_device(rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    T, H, E = 32, 2048, 16
    size = deepep_cupy.Buffer.get_low_latency_rdma_size_hint(T, H, 2, E)
    made = ll_engine.KernelErrorRecord
    if rank == 1:
        def broken():  # the first step after the NVSHMEM allocation that is this rank's alone
            raise RuntimeError("injected set-up failure on rank 1")
        ll_engine.KernelErrorRecord = broken
    start = time.monotonic()
    try:
        deepep_cupy.Buffer(group=dist.group.WORLD, low_latency_mode=True, num_rdma_bytes=size,
                           explicitly_destroy=True)
        print(f"rank {rank} set-up succeeded", flush=True)
    except Exception as exc:
        print(f"rank {rank} set-up: {type(exc).__name__}: {exc}", flush=True)
    print(f"rank {rank} set-up ended after {time.monotonic() - start:.1f} s", flush=True)
    ll_engine.KernelErrorRecord = made

    buf = deepep_cupy.Buffer(group=dist.group.WORLD, low_latency_mode=True, num_rdma_bytes=size,
                             explicitly_destroy=True)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    topk = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:4] for _ in range(T)])
    w = torch.rand(T, 4, device="cuda", generator=gen)
    recv, count, handle, _e, _h = buf.low_latency_dispatch(x, topk, T, E, use_fp8=False)
    out, _e, _h = buf.low_latency_combine(recv, topk, w, handle)
    torch.cuda.synchronize()
    print(f"rank {rank} ran a round on a new Buffer", flush=True)
    buf.destroy()
    print(f"rank {rank} destroyed", flush=True)
''')


def test_a_setup_failure_on_one_rank_ends_on_every_rank(tmp_path):
    pytest.importorskip("nvshmem.core")
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, DEEPEP_CUPY_TIMEOUT_S=str(TIMEOUT_S), PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    start = time.monotonic()
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(LIMIT_S - (time.monotonic() - start), 1))
            results.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        pytest.fail(f"a rank still runs after {LIMIT_S} s (a hang); finished: {results}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    (rc0, out0, err0), (rc1, out1, err1) = results
    log = f"rank 0:\n{out0}\n{err0[-3000:]}\nrank 1:\n{out1}\n{err1[-3000:]}"
    assert "rank 1 set-up: RuntimeError: injected set-up failure on rank 1" in out1, log
    assert ("rank 0 set-up: DeepEPError: low-latency buffer set-up: rank 1 failed (RuntimeError: injected set-up "
            "failure on rank 1); the symmetric memory was freed on every rank") in out0, log
    for rank, out in enumerate((out0, out1)):
        took = float(out.split(f"rank {rank} set-up ended after ")[1].split()[0])
        assert took < TIMEOUT_S, log  # the agreement ended it (the messages above: no timeout)
        assert f"rank {rank} ran a round on a new Buffer" in out and f"rank {rank} destroyed" in out, log
    assert "not finalized" not in err0 + err1, log
    assert rc0 == 0 and rc1 == 0, log

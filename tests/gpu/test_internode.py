"""Internode dispatch kernels on GPUs against the reference backend (``reference/internode.py``).

Run: ``DEEPEP_CUPY_NVL_RANKS=1 mpirun -np 2 python -m pytest tests/gpu/test_internode.py`` (2 GPUs as 2
domains of 1: every token crosses NVSHMEM). Drives ``InternodeEngine`` / ``DispatchPlan`` directly: the
kernels are not wired into ``Buffer`` until this passes. The combine is checked on the dispatch's own
handle, with integer-valued rows, weights and biases (exact in float32, whatever the summation order).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from gpu_common import COMM, MULTI_RANK_GPU

from deepep_cupy.runtime.device import gpu_count

pytestmark = MULTI_RANK_GPU
NUM_SMS = 8


@pytest.fixture(scope="module")
def env():
    import cupy

    from deepep_cupy.config import Config
    from deepep_cupy.ops.internode import InternodeEngine
    from deepep_cupy.runtime.group import MPIGroup

    rank, size = COMM.Get_rank(), COMM.Get_size()
    lsize = int(os.environ.get("DEEPEP_CUPY_NVL_RANKS", "1"))
    if size % lsize or size // lsize < 2:
        pytest.skip(f"needs at least 2 domains of {lsize} ranks")
    cupy.cuda.Device(rank % gpu_count()).use()
    group = MPIGroup(COMM)
    cfg = Config(num_sms=NUM_SMS, num_max_nvl_chunked_send_tokens=4, num_max_nvl_chunked_recv_tokens=16,
                 num_max_rdma_chunked_send_tokens=4, num_max_rdma_chunked_recv_tokens=16)
    hidden = 256
    rdma_bytes = cfg.get_rdma_buffer_size_hint(hidden * 2, size, lsize)
    nvl_bytes = 64 << 20
    engine = InternodeEngine(group, rank % gpu_count(), lsize, nvl_bytes, rdma_bytes)
    engine.timeout_s = 20.0
    yield {"rank": rank, "size": size, "L": lsize, "group": group, "engine": engine, "cfg": cfg, "hidden": hidden}
    COMM.Barrier()
    engine.destroy()


def _inputs(rng, n, hidden, num_experts, k, size):
    x = rng.integers(-8, 8, size=(n, hidden)).astype(np.float32)
    topk = np.argsort(rng.random((n, num_experts)), axis=1)[:, :k].astype(np.int64)  # k distinct experts per row
    if n:
        topk[rng.random((n, k)) < 0.1] = -1
    weights = rng.integers(1, 4, size=(n, k)).astype(np.float32)
    per_rank = num_experts // size
    in_rank = np.zeros((n, size), dtype=bool)
    for r in range(size):
        in_rank[:, r] = ((topk >= r * per_rank) & (topk < (r + 1) * per_rank)).any(axis=1)
    per_expert = np.bincount(topk[topk >= 0], minlength=num_experts).astype(np.int32)
    return x, topk, weights, in_rank, per_expert


@pytest.mark.parametrize("n", [0, 1, 3, 200])
def test_dispatch_matches_reference(env, n):
    import cupy
    import ml_dtypes

    from deepep_cupy.ops.internode_plans import DispatchPlan
    from deepep_cupy.reference import internode as ref

    rank, size, hidden, cfg = env["rank"], env["size"], env["hidden"], env["cfg"]
    rng = np.random.default_rng(1000 + 7 * rank + n)
    num_experts, k = 8 * size, 4
    x, topk, w, in_rank, per_expert = _inputs(rng, n, hidden, num_experts, k, size)
    per_expert = np.asarray(COMM.allreduce(per_expert))
    x_bf16 = x.astype(ml_dtypes.bfloat16)
    want = ref.dispatch(env["group"], x_bf16, None, handle=None, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, expert_alignment=1,
                        num_worst_tokens=0, num_channels=cfg.num_channels, num_nvl_ranks=env["L"])
    stream = cupy.cuda.Stream(non_blocking=True)
    dx = cupy.asarray(x_bf16.view(np.uint16)).view(cupy.uint16)
    args = dict(is_token_in_rank=cupy.asarray(in_rank), num_tokens_per_expert=cupy.asarray(per_expert),
                topk_idx=cupy.asarray(topk), topk_weights=cupy.asarray(w))
    plan = DispatchPlan(env["engine"], dx, None, handle=None, num_tokens_per_expert=args["num_tokens_per_expert"],
                        topk_idx=args["topk_idx"], topk_weights=args["topk_weights"], expert_alignment=1,
                        num_worst_tokens=0, config=cfg)
    recv_x, _, recv_idx, recv_w, counts, handle = plan.run(dx, None, None, args["is_token_in_rank"],
                                                           args["num_tokens_per_expert"], args["topk_idx"],
                                                           args["topk_weights"], stream)
    stream.synchronize()
    env["engine"].check_errors()
    np.testing.assert_array_equal(cupy.asnumpy(recv_x).view(ml_dtypes.bfloat16), want[0])
    np.testing.assert_array_equal(cupy.asnumpy(recv_idx), want[2])
    np.testing.assert_array_equal(cupy.asnumpy(recv_w), want[3])
    assert counts == list(want[4])
    for i, (ours, theirs) in enumerate(zip(handle, want[5], strict=True)):
        np.testing.assert_array_equal(cupy.asnumpy(ours), np.asarray(theirs), err_msg=f"handle[{i}]")

    # Cached dispatch with the kernels' own handle.
    cached = DispatchPlan(env["engine"], dx, None, handle=handle, num_tokens_per_expert=None, topk_idx=None,
                          topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=cfg)
    again = cached.run(dx, None, handle, None, None, None, None, stream)[0]
    stream.synchronize()
    env["engine"].check_errors()
    np.testing.assert_array_equal(cupy.asnumpy(again), cupy.asnumpy(recv_x))

    _check_combine(env, rng, recv_x, recv_w, handle, want, n, stream)


def _check_combine(env, rng, recv_x, recv_w, handle, want, n, stream):
    import cupy
    import ml_dtypes

    from deepep_cupy.ops.internode_plans import CombinePlan
    from deepep_cupy.reference import internode as ref

    hidden = env["hidden"]
    biases = [rng.integers(-4, 4, size=(n, hidden)).astype(np.float32).astype(ml_dtypes.bfloat16) for _ in range(2)]
    rows = cupy.asnumpy(recv_x).view(ml_dtypes.bfloat16)
    expect_x, expect_w = ref.combine(env["group"], rows, want[5], topk_weights=cupy.asnumpy(recv_w),
                                     bias_0=biases[0], bias_1=biases[1])
    dev_biases = [cupy.asarray(b.view(np.uint16)) for b in biases]
    plan = CombinePlan(env["engine"], recv_x, handle, topk_weights=recv_w, config=env["cfg"])
    for _ in range(2):  # twice: the progress counters carry over from one op to the next
        got_x, got_w = plan.run(recv_x, handle, recv_w, dev_biases[0], dev_biases[1], stream)
        stream.synchronize()
        env["engine"].check_errors()
        np.testing.assert_array_equal(cupy.asnumpy(got_x).view(ml_dtypes.bfloat16), expect_x)
        np.testing.assert_array_equal(cupy.asnumpy(got_w), expect_w)

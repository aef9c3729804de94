"""One Buffer with both an NVLink buffer and low-latency mode: normal kernels, then
``clean_low_latency_buffer``, then low-latency kernels, then normal kernels again, each compared with
the reference backend on fresh random data.

    mpirun -np 2 python -m pytest tests/gpu/test_mixed_modes.py -q
"""

import ml_dtypes
import numpy as np
import pytest
from reference_cases import ll_combine, ll_dispatch

from deepep_cupy.device.gpus import gpu_count

pytestmark = pytest.mark.skipif(gpu_count() == 0, reason="needs a CUDA GPU")
MPI = pytest.importorskip("mpi4py.MPI")
COMM = MPI.COMM_WORLD
BF16 = ml_dtypes.bfloat16


def routing(rng, n, k, num_experts):
    idx = np.stack([rng.choice(num_experts, k, replace=False) for _ in range(n)]).astype(np.int64)
    idx[rng.random(idx.shape) < 0.05] = -1
    return idx


def _bits(a):
    import cupy

    a = cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else np.asarray(a)
    return a.view(np.uint16) if a.dtype == BF16 else a


def _normal_round(buf, ref, rng, n, hidden, num_experts, k):
    import cupy

    x = rng.standard_normal((n, hidden)).astype(BF16)
    idx = routing(rng, n, k, num_experts)
    w = rng.random((n, k), dtype=np.float32)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(cupy.asarray(idx), num_experts)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        cupy.asarray(x), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=cupy.asarray(idx), topk_weights=cupy.asarray(w))
    r_layout = ref.get_dispatch_layout(idx, num_experts)
    r = ref.dispatch(x, None, handle=None, num_tokens_per_rank=r_layout[0], is_token_in_rank=r_layout[3],
                     num_tokens_per_expert=r_layout[2], topk_idx=idx, topk_weights=w, expert_alignment=1,
                     num_worst_tokens=0)
    np.testing.assert_array_equal(_bits(recv_x), _bits(r[0]))
    np.testing.assert_array_equal(cupy.asnumpy(recv_idx), r[2])
    np.testing.assert_array_equal(cupy.asnumpy(recv_w), r[3])
    assert counts == r[4]
    y = rng.standard_normal((recv_x.shape[0], hidden)).astype(BF16)
    combined, _, _ = buf.combine(cupy.asarray(y), handle)
    r_comb, _ = ref.combine(y, r[5], topk_weights=None, bias_0=None, bias_1=None)
    np.testing.assert_array_equal(_bits(combined), _bits(r_comb))


def _low_latency_round(buf, ref, rng, t, hidden, num_experts, k):
    import cupy

    size = COMM.Get_size()
    n = int(rng.integers(1, t + 1))
    x = rng.standard_normal((n, hidden)).astype(BF16)
    idx = routing(rng, n, k, num_experts)
    w = rng.random((n, k), dtype=np.float32)
    recv, count, handle, _, _ = buf.low_latency_dispatch(cupy.asarray(x), cupy.asarray(idx), t, num_experts,
                                                         use_fp8=False)
    r_recv, r_count, r_handle, _ = ll_dispatch(ref, x, idx, num_experts, num_max_dispatch_tokens_per_rank=t)
    np.testing.assert_array_equal(cupy.asnumpy(count), r_count)
    got, want = _bits(recv), _bits(r_recv)
    for e in range(num_experts // size):
        c = int(r_count[e])
        np.testing.assert_array_equal(got[e, :c], want[e, :c])
    np.testing.assert_array_equal(cupy.asnumpy(handle[1]), r_handle[1])
    y = rng.standard_normal((num_experts // size, size * t, hidden)).astype(BF16)
    combined, _, _ = buf.low_latency_combine(cupy.asarray(y), cupy.asarray(idx), cupy.asarray(w), handle)
    r_comb, _ = ll_combine(ref, y, idx, w, r_handle)
    np.testing.assert_array_equal(_bits(combined), _bits(r_comb))


def test_normal_then_low_latency_on_one_buffer():
    import cupy

    import deepep_cupy as deep_ep
    from deepep_cupy.device.group import MPIGroup
    from deepep_cupy.reference import ReferenceOracle

    rank, size = COMM.Get_rank(), COMM.Get_size()
    cupy.cuda.Device(rank % gpu_count()).use()
    hidden, k, t = 2048, 4, 32
    num_experts = 8 * size
    config = deep_ep.Buffer.get_dispatch_config(size)
    buf = deep_ep.Buffer(comm=COMM, num_nvl_bytes=config.get_nvl_buffer_size_hint(hidden * 2, size),
                         num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(t, hidden, size, num_experts),
                         low_latency_mode=True, explicitly_destroy=True)
    ref = ReferenceOracle(MPIGroup(COMM), num_nvl_ranks=size, low_latency_mode=True, enable_shrink=False)
    rng = np.random.default_rng(77 + rank)
    try:
        for _ in range(2):
            _normal_round(buf, ref, rng, 300, hidden, num_experts, k)
            buf.clean_low_latency_buffer(t, hidden, num_experts)
            for _ in range(3):
                _low_latency_round(buf, ref, rng, t, hidden, num_experts, k)
    finally:
        buf.destroy()

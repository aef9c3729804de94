"""Buffer over real process groups under mpiexec (reference backend): mpi4py communicators and
torch.distributed (gloo) groups give the same results.

    mpiexec -n 2 python -m pytest tests/mpi -q
"""

import ml_dtypes
import numpy as np
import pytest

from deepep_cupy import Buffer

MPI = pytest.importorskip("mpi4py.MPI")
COMM = MPI.COMM_WORLD
# Buffer sizes: the reference backend allocates nothing, but refuses what the GPU would (ops/limits.py).
NVL_BYTES = 1 << 28
LL_BYTES = 1 << 28
pytestmark = pytest.mark.skipif(COMM.Get_size() < 2, reason="run under mpiexec with 2 or more ranks")
BF16 = ml_dtypes.bfloat16


def _case(seed, n, hidden, num_experts, k):
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.choice(num_experts, k, replace=False) for _ in range(n)]).astype(np.int64) \
        if n else np.zeros((0, k), np.int64)
    if n:
        idx[rng.random((n, k)) < 0.1] = -1
    x = rng.integers(-16, 16, size=(n, hidden)).astype(BF16)
    w = rng.random((n, k)).astype(np.float32)
    return x, idx, w


def _round_trip(buf, x, idx, w, num_experts):
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w)
    combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    return per_rank, in_rank, recv_x, recv_idx, counts, handle, combined


@pytest.mark.parametrize("seed", range(3))
def test_dispatch_combine_over_mpi(seed):
    rank, size = COMM.Get_rank(), COMM.Get_size()
    num_experts, hidden, k = 4 * size, 128, 3
    n = 0 if (seed == 1 and rank == size - 1) else 5 + 3 * rank + seed
    x, idx, w = _case(100 * seed + rank, n, hidden, num_experts, k)
    buf = Buffer(comm=COMM, backend="reference", num_nvl_bytes=NVL_BYTES)
    per_rank, in_rank, recv_x, recv_idx, counts, handle, combined = _round_trip(buf, x, idx, w, num_experts)

    # What every rank sent to me must be exactly what I received, in rank then token order.
    sent = COMM.allgather((x, np.asarray(in_rank)))
    expected = np.concatenate([sx[m[:, rank]] for sx, m in sent]) if sum(len(sx) for sx, _ in sent) else \
        np.zeros((0, hidden), BF16)
    np.testing.assert_array_equal(np.asarray(recv_x).view(np.uint16), expected.view(np.uint16))
    prefix = np.asarray(handle[0])
    assert prefix[-1, rank] == len(recv_x)
    # Each local expert's count equals the number of received top-k entries naming it.
    local = np.asarray(recv_idx)
    assert counts == [int((local == e).sum()) for e in range(num_experts // size)]
    visits = np.asarray(in_rank).sum(axis=1).astype(np.float32)
    np.testing.assert_array_equal(combined.astype(np.float32), x.astype(np.float32) * visits[:, None])


def test_low_latency_over_mpi():
    rank, size = COMM.Get_rank(), COMM.Get_size()
    num_experts, hidden, k, t = 2 * size, 256, 2, 8
    x, idx, w = _case(7 + rank, 6, hidden, num_experts, k)
    buf = Buffer(comm=COMM, backend="reference", low_latency_mode=True, num_rdma_bytes=LL_BYTES)
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, t, num_experts, use_fp8=False)
    # The expert multiplies by (global expert id + 1); combine must give sum_k w_k * (e_k + 1) * x.
    e_local = num_experts // size
    scale = (np.arange(e_local) + rank * e_local + 1).astype(np.float32)
    out = (np.asarray(recv).astype(np.float32) * scale[:, None, None]).astype(BF16)
    combined, _, _ = buf.low_latency_combine(out, idx, w, handle)
    factor = np.where(idx >= 0, w * (idx + 1), 0).astype(np.float32)
    expected = (x.astype(np.float32)[:, None, :] * factor[:, :, None])
    # Bit-exactness is not expected here (products are rounded to bf16 before the sum), so compare closely.
    np.testing.assert_allclose(combined.astype(np.float32), expected.sum(axis=1), rtol=2e-2, atol=1e-1)
    assert int(np.asarray(count).sum()) == int(np.asarray(recv).shape[0] and sum(
        int(((i >= rank * e_local) & (i < (rank + 1) * e_local)).sum()) for i in COMM.allgather(idx)))


def _torch_group():
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from deepep_cupy.device.torch_dist import init_torch_distributed

    init_torch_distributed(COMM, "gloo")
    return torch, dist.group.WORLD


def test_torch_group_matches_mpi():
    torch, group = _torch_group()
    rank, size = COMM.Get_rank(), COMM.Get_size()
    num_experts, hidden, k = 2 * size, 64, 2
    x, idx, w = _case(55 + rank, 9, hidden, num_experts, k)
    with_mpi = _round_trip(Buffer(comm=COMM, backend="reference", num_nvl_bytes=NVL_BYTES), x, idx, w, num_experts)
    buf = Buffer(group, backend="reference", num_nvl_bytes=NVL_BYTES)
    assert buf.rank == rank and buf.group_size == size
    tx = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    with_torch = _round_trip(buf, tx, torch.from_numpy(idx), torch.from_numpy(w), num_experts)
    for a, b in zip(with_mpi, with_torch, strict=True):
        if isinstance(a, list):
            assert a == b
        elif isinstance(a, tuple):
            for ha, hb in zip(a, b, strict=True):
                np.testing.assert_array_equal(np.asarray(ha), hb.numpy())
        else:
            assert isinstance(b, torch.Tensor)
            bn = b.view(torch.int16).numpy().view(BF16) if b.dtype == torch.bfloat16 else b.numpy()
            np.testing.assert_array_equal(np.asarray(a).astype(np.float64), bn.astype(np.float64))

"""GPU layout kernel against the reference backend, on fresh random routing each repeat.

Runs on one GPU (``pytest tests/gpu/test_layout.py``) or on every rank under mpirun."""

import numpy as np
import pytest

from deepep_cupy.device.gpus import gpu_count

pytestmark = pytest.mark.skipif(gpu_count() == 0, reason="needs a CUDA GPU")


def _rank_size():
    try:
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    except ImportError:
        return 0, 1


@pytest.fixture(scope="module", autouse=True)
def _device():
    import cupy

    rank, _ = _rank_size()
    cupy.cuda.Device(rank % gpu_count()).use()


def _reference(topk_idx, num_experts, num_ranks, num_nvl_ranks):
    """Layout by brute force, independent of both backends."""
    n = topk_idx.shape[0]
    per_expert = np.zeros(num_experts, np.int32)
    in_rank = np.zeros((n, num_ranks), bool)
    e_local = num_experts // num_ranks
    for t in range(n):
        for e in topk_idx[t]:
            if e >= 0:
                per_expert[e] += 1
                in_rank[t, e // e_local] = True
    per_rank = in_rank.sum(0).astype(np.int32)
    per_rdma = None
    if num_ranks > num_nvl_ranks:
        nodes = in_rank.reshape(n, num_ranks // num_nvl_ranks, num_nvl_ranks).any(2)
        per_rdma = nodes.sum(0).astype(np.int32)
    return per_rank, per_rdma, per_expert, in_rank


CASES = [(4096, 8, 256, 2, 2), (4096, 8, 256, 8, 8), (1, 1, 8, 2, 2), (0, 4, 16, 2, 2), (777, 9, 288, 4, 2),
         (300, 32, 512, 8, 4), (513, 3, 6, 3, 1), (2000, 6, 64, 16, 8), (1001, 8, 96, 3, 3), (97, 4, 40, 40, 8)]


@pytest.mark.parametrize("n,k,num_experts,num_ranks,num_nvl", CASES)
def test_layout_matches_reference(n, k, num_experts, num_ranks, num_nvl):
    import cupy

    from deepep_cupy.ops.layout import get_dispatch_layout

    rng = np.random.default_rng(n * 31 + k)
    for repeat in range(5):
        idx = np.stack([rng.choice(num_experts, k, replace=False) for _ in range(n)]).astype(np.int64) \
            if n else np.zeros((0, k), np.int64)
        if n:
            idx[rng.random(idx.shape) < 0.05 * repeat] = -1
        want = _reference(idx, num_experts, num_ranks, num_nvl)
        got = get_dispatch_layout(cupy.asarray(idx), num_experts, num_ranks, num_nvl)
        for name, w, g in zip(("per_rank", "per_rdma", "per_expert", "in_rank"), want, got, strict=True):
            if w is None:
                assert g is None, name
                continue
            np.testing.assert_array_equal(cupy.asnumpy(g), w, err_msg=f"{name}, repeat {repeat}")


@pytest.mark.parametrize("k", [4, 8, 9])
def test_layout_rows_not_16_byte_aligned(k):
    """topk_idx 8 bytes past a 16-byte boundary: the kernel reads the ids one at a time instead of in pairs."""
    import cupy

    from deepep_cupy.ops.layout import get_dispatch_layout

    n, num_experts, num_ranks = 1003, 64, 4
    rng = np.random.default_rng(k)
    idx = np.stack([rng.choice(num_experts, k, replace=False) for _ in range(n)]).astype(np.int64)
    idx[rng.random(idx.shape) < 0.1] = -1
    flat = cupy.zeros(n * k + 2, cupy.int64)
    dev = flat[1:1 + n * k].reshape(n, k)
    assert dev.data.ptr % 16 == 8
    dev[...] = cupy.asarray(idx)
    want = _reference(idx, num_experts, num_ranks, num_ranks)
    got = get_dispatch_layout(dev, num_experts, num_ranks, num_ranks)
    for name, w, g in zip(("per_rank", "per_rdma", "per_expert", "in_rank"), want, got, strict=True):
        if w is None:
            assert g is None, name
            continue
        np.testing.assert_array_equal(cupy.asnumpy(g), w, err_msg=name)


def test_layout_through_buffer_with_torch():
    torch = pytest.importorskip("torch")
    from mpi4py import MPI

    import deepep_cupy as deep_ep

    rank, size = _rank_size()
    torch.cuda.set_device(rank % gpu_count())
    buf = deep_ep.Buffer(comm=MPI.COMM_WORLD)
    num_experts = 32 * size
    scores = torch.randn(1024, num_experts, device="cuda").abs() + 1
    idx = torch.topk(scores, 8, dim=-1).indices
    per_rank, per_rdma, per_expert, in_rank, event = buf.get_dispatch_layout(idx, num_experts, async_finish=True)
    event.current_stream_wait()
    want = _reference(idx.cpu().numpy(), num_experts, size, buf.num_nvl_ranks)
    assert isinstance(per_rank, torch.Tensor) and per_rank.is_cuda and in_rank.dtype == torch.bool
    np.testing.assert_array_equal(per_rank.cpu().numpy(), want[0])
    np.testing.assert_array_equal(per_expert.cpu().numpy(), want[2])
    np.testing.assert_array_equal(in_rank.cpu().numpy(), want[3])
    buf.destroy()

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


# V2's layout arrays (ops/recv_rows.py) against the array operations of ep/recv_rows.py on NumPy:
# (received rows, padding rows, top-k, local experts, ranks, tokens sent, expert alignment, spare expanded rows)
RECV_CASES = [(4000, 96, 8, 128, 2, 4096, 128, 0), (3000, 0, 8, 36, 8, 512, 64, 0), (0, 0, 8, 144, 2, 0, 128, 0),
              (700, 300, 6, 8, 2, 128, 1, 517), (1, 5, 1, 3, 3, 1, 16, 40), (2100, 40, 9, 288, 4, 2048, 32, 9),
              (513, 0, 32, 64, 8, 700, 128, 0)]


def _v2_inputs(rng, n_real, n_pad, k, e_local, num_ranks, tokens, rank):
    """What V1's dispatch gives V2 for one rank: received local top-k ids (some -1, padding rows all -1),
    the rank prefix matrix, source token indices, and this rank's own routing with its token -> rank map."""
    n = n_real + n_pad
    recv_topk = np.full((n, k), -1, np.int64)
    for i in range(n_real):
        picks = rng.choice(e_local, size=rng.integers(1, min(k, e_local) + 1), replace=False)
        recv_topk[i, rng.choice(k, size=len(picks), replace=False)] = picks
    per_source = np.bincount(rng.integers(0, num_ranks, n_real), minlength=num_ranks)
    prefix = rng.integers(0, 1 << 20, (num_ranks, num_ranks)).astype(np.int32)
    prefix[:, rank] = np.cumsum(per_source)
    src_idx = np.full(n, -1, np.int32)
    src_idx[:n_real] = rng.integers(0, 4096, n_real)
    experts = e_local * num_ranks
    topk = np.full((tokens, k), -1, np.int64)
    for t in range(tokens):
        picks = rng.choice(experts, size=rng.integers(0, min(k, experts) + 1), replace=False)
        topk[t, rng.choice(k, size=len(picks), replace=False)] = picks
    in_rank = np.zeros((tokens, num_ranks), bool)
    for t, e in zip(*np.nonzero(topk >= 0), strict=True):
        in_rank[t, topk[t, e] // e_local] = True
    return recv_topk, prefix, src_idx, topk, in_rank


@pytest.mark.parametrize("per_rank", [False, True])  # V1's intranode rank prefix matrix, or internode prefix sum
@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize("case", RECV_CASES)
def test_v2_layout_arrays_match_the_array_operations(case, expand, per_rank):
    import cupy

    from deepep_cupy.ep.arrays import ops_for
    from deepep_cupy.ep.recv_rows import dst_slots, recv_rows, row_sources
    from deepep_cupy.frameworks import frame_for
    from deepep_cupy.ops.recv_rows import RecvRowsPlan

    n_real, n_pad, k, e_local, num_ranks, tokens, alignment, spare = case
    rank, m = num_ranks - 1, 4096
    plan = RecvRowsPlan(frame_for("cupy", cupy.cuda.Device().id), num_local_experts=e_local, num_ranks=num_ranks,
                        rank=rank, per_rank=per_rank)
    rng = np.random.default_rng([n_real, k, e_local, int(expand)])
    np_ops = ops_for(np.zeros(1))
    for _ in range(3):  # fresh routing each repeat, into freshly poisoned memory
        recv_topk, prefix, src_idx, topk, in_rank = _v2_inputs(rng, n_real, n_pad, k, e_local, num_ranks, tokens,
                                                               rank)
        want = recv_rows(np_ops, recv_topk, np.ascontiguousarray(prefix[:, rank]), src_idx,
                         num_local_experts=e_local, num_max_tokens=m, expert_alignment=alignment, expand=expand)
        expanded = int(want.psum_expert[-1]) + spare
        pool = cupy.get_default_memory_pool()
        pool.free_all_blocks()
        poison = cupy.full(64 << 20, 0xAB, cupy.uint8)  # the outputs come from this memory once it is freed
        del poison
        given = np.ascontiguousarray(prefix[:, rank]) if per_rank else prefix
        dev = [cupy.asarray(a) for a in (recv_topk, src_idx, given, topk, in_rank)]
        rows, sources, counts, psum_expert, metadata, psum, dst = (
            None if a is None else cupy.asnumpy(a) for a in plan.run(
                *dev, num_max_tokens=m, expert_alignment=alignment, expand=expand, num_expanded_rows=expanded))
        np.testing.assert_array_equal(rows, want.rows)
        np.testing.assert_array_equal(counts, want.counts)
        np.testing.assert_array_equal(psum_expert, want.psum_expert)
        np.testing.assert_array_equal(metadata, want.metadata)
        np.testing.assert_array_equal(psum, prefix[:, rank])
        np.testing.assert_array_equal(dst, dst_slots(np_ops, topk, in_rank, num_local_experts=e_local,
                                                     num_max_tokens=m))
        if expand:
            np.testing.assert_array_equal(sources, row_sources(np_ops, want, expanded))
            assert (sources >= 0).sum() == (recv_topk >= 0).sum() > 0 or n_real == 0
        else:
            assert sources is None

"""A rank that never arrives, on the reference backend and in the library's own collectives, under mpiexec:

    mpiexec -n 2|4 python -m pytest tests/mpi -q

The ranks that wait must end with ``DeepEPTimeoutError`` naming the op, themselves and the missing rank
within ``DEEPEP_CUPY_TIMEOUT_S`` (short here), never hang; ``destroy()`` must return at once. The absent
rank is alive: it waits on the caller's own communicator until the others are done.
"""

import time

import ml_dtypes
import numpy as np
import pytest

from deepep_cupy import Buffer
from deepep_cupy.errors import DeepEPTimeoutError

MPI = pytest.importorskip("mpi4py.MPI")
COMM = MPI.COMM_WORLD
# Buffer sizes: the reference backend allocates nothing, but refuses what the GPU would (ops/limits.py).
NVL_BYTES = 1 << 28
LL_BYTES = 1 << 28
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
LAST = SIZE - 1
BF16 = ml_dtypes.bfloat16
TIMEOUT = 2.0  # DEEPEP_CUPY_TIMEOUT_S in these tests (tests/mpi/conftest.py)

pytestmark = [pytest.mark.skipif(SIZE < 2, reason="run under mpiexec with 2 or more ranks"),
              pytest.mark.timeout(60, method="thread")]  # a hang ends the job


def _times_out(call, op, missing, seconds=TIMEOUT):
    start = time.monotonic()
    with pytest.raises(DeepEPTimeoutError) as info:
        call()
    waited = time.monotonic() - start
    assert seconds * 0.9 <= waited < seconds + 2, waited
    text = str(info.value)
    assert op in text and f"rank {RANK} waited" in text, text
    assert f"rank {missing}," in text or f"ranks {missing}" in text, text
    assert info.value.missing == [missing]
    return info.value


def _case(buf):
    rng = np.random.default_rng(RANK)
    idx = np.stack([rng.choice(2 * SIZE, 2, replace=False) for _ in range(5)]).astype(np.int64)
    x = rng.integers(-8, 8, size=(5, 128)).astype(BF16)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 2 * SIZE)
    return dict(x=x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=idx, topk_weights=rng.random((5, 2)).astype(np.float32))


def test_absent_rank_in_dispatch_then_back_in_step():
    buf = Buffer(comm=COMM, backend="reference", num_nvl_bytes=NVL_BYTES)
    case = _case(buf)
    if RANK != LAST:
        _times_out(lambda: buf.dispatch(**case), "dispatch", LAST)
    COMM.Barrier()  # the absent rank comes only now
    # Its first call meets what the others left behind, then their new call: a named error on every rank...
    with pytest.raises(ValueError, match="different orders"):
        buf.dispatch(**case)
    # ...after which the ranks are in step again.
    recv_x, _, _, _, handle, _ = buf.dispatch(**case)
    combined, _, _ = buf.combine(recv_x, handle)
    assert combined.shape == case["x"].shape
    start = time.monotonic()
    buf.destroy()
    assert time.monotonic() - start < 1


def test_destroy_returns_when_a_rank_never_comes():
    buf = Buffer(comm=COMM, backend="reference", low_latency_mode=True, enable_shrink=True,
                 num_rdma_bytes=LL_BYTES)
    if RANK != LAST:
        buf.low_latency_update_mask_buffer(LAST, True)
        x = np.ones((3, 256), BF16)
        idx = np.zeros((3, 1), np.int64)
        # The reference backend exchanges with every rank, masked ones too (they send nothing): a rank that is
        # gone ends each op in a named timeout.
        _times_out(lambda: buf.low_latency_dispatch(x, idx, 4, 2 * SIZE), "low_latency_dispatch", LAST)
        start = time.monotonic()
        buf.destroy()
        assert time.monotonic() - start < 1
        with pytest.raises(RuntimeError, match="destroyed"):
            buf.low_latency_dispatch(x, idx, 4, 2 * SIZE)


def _group():
    from deepep_cupy.device.group import MPIGroup

    return MPIGroup(COMM)


@pytest.mark.parametrize("what", ["allgather", "alltoall", "barrier", "bcast"])
def test_group_collective_names_the_absent_rank(what, monkeypatch):
    monkeypatch.setenv("DEEPEP_CUPY_TIMEOUT_S", "1")
    group = _group()
    absent = 0 if what == "bcast" else LAST  # a broadcast waits for its root only
    calls = {"allgather": lambda: group.allgather_object(RANK, op="test allgather"),
             "alltoall": lambda: group.alltoall_object(list(range(SIZE)), op="test alltoall"),
             "barrier": lambda: group.barrier(op="test barrier"),
             "bcast": lambda: group.bcast_object(RANK, root=0, op="test bcast")}
    if RANK != absent:
        _times_out(calls[what], f"test {what}", absent, seconds=1.0)


def test_group_collectives_give_every_rank_its_data():
    group = _group()
    assert group.allgather_object(RANK * 10, op="a") == [r * 10 for r in range(SIZE)]
    assert group.alltoall_object([(RANK, r) for r in range(SIZE)], op="b") == [(r, RANK) for r in range(SIZE)]
    assert group.bcast_object("root" if RANK == LAST else None, root=LAST, op="c") == "root"
    group.barrier(op="d")
    group.close()
    with pytest.raises(RuntimeError, match="closed"):
        group.barrier(op="e")


def test_group_reports_ranks_out_of_step():
    group = _group()
    with pytest.raises(ValueError, match="different orders"):
        group.allgather_object(RANK, op="first" if RANK == 0 else "second")
    assert group.allgather_object(RANK, op="third") == list(range(SIZE))


def test_torch_group_times_out():
    pytest.importorskip("torch")
    import torch.distributed as dist

    from deepep_cupy.device.torch_dist import init_torch_distributed

    init_torch_distributed(COMM, "gloo")
    buf = Buffer(dist.group.WORLD, backend="reference", num_nvl_bytes=NVL_BYTES)
    case = _case(buf)
    if RANK != LAST:
        _times_out(lambda: buf.dispatch(**case), "dispatch", LAST)


def test_the_tools_barrier_names_the_absent_rank():
    """The benchmarks' and the tuner's barrier ends in a named timeout where ``comm.Barrier()`` would wait for
    ever; a later one on every rank works again."""
    from deepep_cupy.device.group import comm_barrier

    comm = COMM.Dup()  # its own library group, made by the first call on every rank
    comm_barrier(comm, "tools barrier: start")
    if RANK != LAST:
        _times_out(lambda: comm_barrier(comm, "tools barrier"), "tools barrier", LAST)
    COMM.Barrier()  # the absent rank comes only now; its barrier meets what the others left
    if RANK == LAST:
        comm_barrier(comm, "tools barrier")
    comm_barrier(comm, "tools barrier: again")

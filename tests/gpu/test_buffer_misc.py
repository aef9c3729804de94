"""GPU Buffer plumbing: raw buffer views, streams, events, lifetime, and errors raised before any kernel.

    mpirun -np 2 python -m pytest tests/gpu/test_buffer_misc.py -q
"""

import numpy as np
import pytest

from deepep_cupy.device.gpus import gpu_count

pytestmark = pytest.mark.skipif(gpu_count() == 0, reason="needs a CUDA GPU")
MPI = pytest.importorskip("mpi4py.MPI")
COMM = MPI.COMM_WORLD


@pytest.fixture(scope="module")
def buf():
    import cupy

    import deepep_cupy as deep_ep

    cupy.cuda.Device(COMM.Get_rank() % gpu_count()).use()
    b = deep_ep.Buffer(comm=COMM, num_nvl_bytes=64 << 20, explicitly_destroy=True)
    yield b
    b.destroy()


def test_local_buffer_views_share_memory(buf):
    import cupy
    import ml_dtypes

    torch = pytest.importorskip("torch")
    t = buf.get_local_buffer_tensor(torch.int32, torch.Size([4, 8]), offset=16)
    assert t.shape == (4, 8) and t.is_cuda
    t.copy_(torch.arange(32, dtype=torch.int32, device=t.device).view(4, 8) + 100 * COMM.Get_rank())
    torch.cuda.synchronize()
    raw = buf.get_local_buffer_tensor(np.int32)
    np.testing.assert_array_equal(cupy.asnumpy(raw[16:48]), np.arange(32) + 100 * COMM.Get_rank())
    half = buf.get_local_buffer_tensor(ml_dtypes.bfloat16, (2, 3))
    assert half.shape == (2, 3)
    with pytest.raises(ValueError):
        buf.get_local_buffer_tensor(np.int32, (64 << 20,))


def test_streams_and_events(buf):
    import cupy

    assert buf.is_sm90_compiled()
    stream = buf.get_comm_stream()
    assert isinstance(stream, cupy.cuda.Stream) and stream.ptr != 0
    event = buf.capture()
    assert event.event is not None
    event.current_stream_wait()
    with event:
        pass


def test_too_small_buffer_raises_before_launch():
    import cupy
    import ml_dtypes

    import deepep_cupy as deep_ep

    small = deep_ep.Buffer(comm=COMM, num_nvl_bytes=1 << 20, explicitly_destroy=True)
    try:
        n, hidden, experts = 64, 7168, 16
        rng = np.random.default_rng(COMM.Get_rank())
        idx = cupy.asarray(np.stack([rng.choice(experts, 2, replace=False) for _ in range(n)]).astype(np.int64))
        x = cupy.asarray(rng.standard_normal((n, hidden)).astype(ml_dtypes.bfloat16))
        per_rank, _, per_expert, in_rank, _ = small.get_dispatch_layout(idx, experts)
        with pytest.raises(ValueError, match="num_nvl_bytes|bytes"):
            small.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        # An expert id out of range is found by the kernel (no host sync on the call) and raised by the
        # next call; the bad id itself counted as "no expert".
        bad = idx.copy()
        bad[0, 0] = experts
        per_rank_bad = small.get_dispatch_layout(bad, experts)[0]
        cupy.cuda.Device().synchronize()
        with pytest.raises(ValueError, match="topk_idx"):
            small.get_dispatch_layout(idx, experts)
        expect = cupy.asnumpy(per_rank)
        got = cupy.asnumpy(per_rank_bad)
        assert got.sum() <= expect.sum()
        small.get_dispatch_layout(idx, experts)  # reported once: the next call works
    finally:
        small.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        small.get_dispatch_layout(idx, experts)

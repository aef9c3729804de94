"""A bad argument, an overflow or a disagreement on one rank, on the reference backend under mpiexec:

    mpiexec -n 2|4 python -m pytest tests/mpi -q

Every rank must end the call with the same named error (TypeError / ValueError naming the argument and
where it went wrong), at once rather than after a timeout, with its inputs untouched; and the next call
must work (the ranks are still in step).
"""

import time

import ml_dtypes
import numpy as np
import pytest

from deepep_cupy import Buffer

MPI = pytest.importorskip("mpi4py.MPI")
COMM = MPI.COMM_WORLD
# Buffer sizes: the reference backend allocates nothing, but refuses what the GPU would (ops/limits.py).
NVL_BYTES = 1 << 28
LL_BYTES = 1 << 28
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
LAST = SIZE - 1
BF16 = ml_dtypes.bfloat16
TIMEOUT = 3.0  # DEEPEP_CUPY_TIMEOUT_S in these tests (tests/mpi/conftest.py): an agreed error comes well before it

pytestmark = [pytest.mark.skipif(SIZE < 2, reason="run under mpiexec with 2 or more ranks"),
              pytest.mark.timeout(60, method="thread")]  # a hang ends the job


def routing(seed, n, num_experts, k):
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.choice(num_experts, k, replace=False) for _ in range(n)]).astype(np.int64)
    return idx, None, rng.random((n, k)).astype(np.float32)


def _normal_case(buf, n=6, hidden=128, num_experts=None, k=2):
    num_experts = num_experts or 2 * SIZE
    idx, _, w = routing(RANK, n, num_experts, k)
    x = np.random.default_rng(RANK).integers(-8, 8, size=(n, hidden)).astype(BF16)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    return dict(x=x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=idx, topk_weights=w)


def _copies(obj):
    if isinstance(obj, dict):
        return {k: _copies(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_copies(v) for v in obj)
    return obj.copy() if isinstance(obj, np.ndarray) else obj


def _same(a, b):
    if isinstance(a, dict):
        return all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return all(_same(u, v) for u, v in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b


def _everywhere(call, exc_type, *words, inputs=()):
    """``call`` must raise ``exc_type`` on this rank at once, naming every word, and leave ``inputs`` as they were."""
    keep = _copies(inputs)
    start = time.monotonic()
    with pytest.raises(exc_type) as info:
        call()
    assert time.monotonic() - start < TIMEOUT / 2, "an agreed error, not a wait for a timeout"
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert _same(keep, inputs), "the failed call modified its inputs"
    return str(info.value)


def _round_trip(buf, case):
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(**case)
    combined, _, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    visits = np.asarray(case["is_token_in_rank"]).sum(axis=1).astype(np.float32)
    np.testing.assert_array_equal(combined.astype(np.float32), case["x"].astype(np.float32) * visits[:, None])
    return handle


def _ll_buffer():
    return Buffer(comm=COMM, backend="reference", low_latency_mode=True, num_rdma_bytes=LL_BYTES)


def _ll_round_trip(buf, t=8, num_experts=None, **kw):
    num_experts = num_experts or 2 * SIZE
    idx, _, w = routing(RANK + 10, 5, num_experts, 2)
    x = np.random.default_rng(RANK).integers(-8, 8, size=(5, 256)).astype(BF16)
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, num_experts, **kw)
    combined, _, _ = buf.low_latency_combine(np.asarray(recv if not isinstance(recv, tuple) else recv[0]).astype(
        np.float32).astype(BF16), idx, w, handle)
    assert combined.shape == x.shape
    return x, idx, w, handle


def test_wrong_dtype_on_one_rank():
    buf = Buffer(comm=COMM, backend="reference", num_nvl_bytes=NVL_BYTES)
    case = _normal_case(buf)
    bad = dict(case, x=case["x"].astype(np.float32)) if RANK == 0 else case
    text = _everywhere(lambda: buf.dispatch(**bad), TypeError, "x must have dtype bfloat16", inputs=bad)
    assert RANK == 0 or "rank 0" in text
    _round_trip(buf, case)


def test_too_many_tokens_for_low_latency_on_one_rank():
    buf = _ll_buffer()
    idx, _, _ = routing(RANK, 9 if RANK == LAST else 4, 2 * SIZE, 2)
    x = np.ones((idx.shape[0], 256), BF16)
    _everywhere(lambda: buf.low_latency_dispatch(x, idx, 8, 2 * SIZE, use_fp8=False), ValueError,
                "num_max_dispatch_tokens_per_rank", inputs=(x, idx))
    _ll_round_trip(buf)


def test_num_worst_tokens_overflow_on_one_rank():
    buf = Buffer(comm=COMM, backend="reference", num_nvl_bytes=NVL_BYTES)
    case = _normal_case(buf, n=6 + RANK)
    worst = 1 if RANK == LAST else 64 * SIZE
    _everywhere(lambda: buf.dispatch(**case, num_worst_tokens=worst), ValueError, "num_worst_tokens=1",
                f"rank {LAST} receives", inputs=case)
    recv_x, *_ = buf.dispatch(**case, num_worst_tokens=64 * SIZE)
    assert recv_x.shape[0] == 64 * SIZE
    _round_trip(buf, case)


@pytest.mark.parametrize("what", ["t", "num_experts", "use_fp8", "round_scale"])
def test_low_latency_disagreement(what):
    buf = _ll_buffer()
    t = 8 if (what == "t" and RANK == 0) else 16
    num_experts = SIZE if (what == "num_experts" and RANK == 0) else 2 * SIZE
    flags = dict(use_fp8=what == "round_scale" or (what == "use_fp8" and RANK != 0),
                 round_scale=what == "round_scale" and RANK != 0)
    idx, _, _ = routing(RANK, 4, num_experts, 1)
    x = np.ones((4, 256), BF16)
    name = {"t": "num_max_dispatch_tokens_per_rank", "use_fp8": "use_fp8"}.get(what, what)
    text = _everywhere(lambda: buf.low_latency_dispatch(x, idx, t, num_experts, **flags), ValueError,
                       f"disagree on {name}", inputs=(x, idx))
    if what == "t":
        assert "rank 0: 8" in text and "rank 1: 16" in text
    _ll_round_trip(buf)


@pytest.mark.parametrize("what", ["hidden", "num_experts", "topk"])
def test_normal_disagreement(what):
    buf = Buffer(comm=COMM, backend="reference", num_nvl_bytes=NVL_BYTES)
    odd = RANK == LAST
    case = _normal_case(buf, hidden=256 if what == "hidden" and odd else 128,
                        num_experts=SIZE if what == "num_experts" and odd else 2 * SIZE,
                        k=1 if what == "topk" and odd else 2)
    name = {"hidden": "hidden", "num_experts": "num_tokens_per_expert", "topk": "topk_idx"}[what]
    text = _everywhere(lambda: buf.dispatch(**case), ValueError, "disagree on", name, inputs=case)
    assert f"rank {LAST}" in text
    _round_trip(buf, _normal_case(buf))


def test_bad_handles_on_one_rank():
    buf = Buffer(comm=COMM, backend="reference", num_nvl_bytes=NVL_BYTES)
    case = _normal_case(buf)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(**case)
    junk = (1, 2, 3, 4, 5, 6) if RANK == 0 else handle
    _everywhere(lambda: buf.combine(recv_x, junk), TypeError, "handle[0]", inputs=(recv_x, junk))
    assert len(recv_x) > 0
    corrupt = list(handle)
    if RANK == 0:
        corrupt[3] = handle[3].copy()
        corrupt[3][0] = 10 ** 6
    corrupt = tuple(corrupt)
    _everywhere(lambda: buf.combine(recv_x, corrupt), ValueError, "handle[3] (recv_src_idx) of rank 0",
                inputs=(recv_x, corrupt))
    combined, _, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    assert combined.shape == case["x"].shape


def test_num_tokens_per_expert_of_the_wrong_length():
    buf = Buffer(comm=COMM, backend="reference", num_nvl_bytes=NVL_BYTES)
    case = _normal_case(buf, num_experts=4 * SIZE)
    if RANK == 0:  # a multiple of the rank count, but shorter than the experts topk_idx names
        case["num_tokens_per_expert"] = case["num_tokens_per_expert"][:SIZE].copy()
        case["topk_idx"][:, 0] = 4 * SIZE - 1
    _everywhere(lambda: buf.dispatch(**case), ValueError, "num_tokens_per_expert", inputs=case)


def test_low_latency_bad_handles_on_one_rank():
    buf = _ll_buffer()
    x, idx, w, handle = _ll_round_trip(buf)
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 8, 2 * SIZE, use_fp8=False)
    fewer = idx[:1] if RANK == 0 else idx
    text = _everywhere(lambda: buf.low_latency_combine(recv, fewer, w[:len(fewer)], handle), ValueError,
                       "topk_idx", inputs=(recv, fewer))
    assert "rank 0" in text
    bad_t = (handle[0], handle[1], "8", handle[3], handle[4]) if RANK == LAST else handle
    _everywhere(lambda: buf.low_latency_combine(recv, idx, w, bad_t), ValueError, "handle[2]",
                "num_max_dispatch_tokens_per_rank", inputs=(recv, idx))
    with pytest.raises(ValueError, match=r"handle\[2\]"):  # a local call: only this rank raises
        buf.get_next_low_latency_combine_buffer((handle[0], handle[1], "8", handle[3], handle[4]))
    combined, _, _ = buf.low_latency_combine(recv, idx, w, handle)
    assert combined.shape == x.shape


def test_different_operations_at_the_same_point():
    buf = Buffer(comm=COMM, backend="reference", num_nvl_bytes=NVL_BYTES)
    case = _normal_case(buf)
    handle = _round_trip(buf, case)
    recv_x, *_ = buf.dispatch(case["x"], handle=handle)

    def call():
        if RANK == 0:
            buf.combine(recv_x, handle)
        else:
            buf.dispatch(case["x"], handle=handle)
    _everywhere(call, ValueError, "different")
    _round_trip(buf, case)


def test_torch_rendezvous_failure_reaches_every_rank(monkeypatch):
    """A store rank 0 cannot start (its port taken, say) is an error on every rank, not a wait for it."""
    pytest.importorskip("torch")
    import torch.distributed as dist

    from deepep_cupy.device.torch_dist import init_torch_distributed

    def no_store(*args, **kwargs):
        if kwargs.get("is_master"):
            raise OSError(98, "Address already in use")
        raise AssertionError("a rank went on to connect to a store that was never started")

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "TCPStore", no_store)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 could not start the rendezvous store"):
        init_torch_distributed(COMM, "gloo")
    assert time.monotonic() - start < 30


def test_torch_group_agrees_on_errors():
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from deepep_cupy.device.torch_dist import init_torch_distributed

    init_torch_distributed(COMM, "gloo")
    buf = Buffer(dist.group.WORLD, backend="reference", num_nvl_bytes=NVL_BYTES)
    case = _normal_case(buf)
    tcase = {k: torch.from_numpy(np.asarray(v).view(np.int16) if k == "x" else np.asarray(v)) for k, v in
             case.items()}
    tcase["x"] = tcase["x"].view(torch.bfloat16)
    bad = dict(tcase, x=tcase["x"].float()) if RANK == LAST else tcase
    _everywhere(lambda: buf.dispatch(**bad), TypeError, "x must have dtype bfloat16")
    recv_x, _, _, _, handle, _ = buf.dispatch(**tcase)
    combined, _, _ = buf.combine(recv_x, handle)
    assert combined.shape == tcase["x"].shape

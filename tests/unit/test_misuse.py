"""Settings and misuse that end in an error naming what is wrong (thread-ranks on the reference backend, and
the GPU path's own checks where they run without a GPU)."""

from __future__ import annotations

import math
import sys
import types

import ml_dtypes
import numpy as np
import pytest
from thread_group import run_ranks

from deepep_cupy import Buffer, Config
from deepep_cupy.device.group import make_group
from deepep_cupy.device.kernel_errors import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, timeout_seconds
from deepep_cupy.ops.handles import LowLatencyHandle
from deepep_cupy.ops.low_latency import plans as ll_plans

BF16 = ml_dtypes.bfloat16
NVL = Config().get_nvl_buffer_size_hint(2 * 128, 2)
LL = Buffer.get_low_latency_rdma_size_hint(8, 128, 2, 8)


def _routing(rng, n, k, num_experts):
    return np.argsort(rng.random((n, num_experts)), axis=1)[:, :k].astype(np.int64)


def _errors(size, fn, **kw):
    """Run ``fn(buffer, rng)`` on ``size`` thread-ranks, each with a reference Buffer; return each rank's
    exception (None where none)."""
    def body(group):
        buf = Buffer(comm=group, backend="reference", **kw)
        try:
            fn(buf, np.random.default_rng(group.rank))
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            return exc
        return None
    return run_ranks(size, body)


# ---------------------------------------------------------------------------------------------------- settings
@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "0", "-1", "1e10", "soon", "1e400"])
def test_timeout_must_be_a_finite_positive_number(text, monkeypatch):
    monkeypatch.setenv("DEEPEP_CUPY_TIMEOUT_S", text)
    with pytest.raises(ValueError, match=r"^DEEPEP_CUPY_TIMEOUT_S must be a finite positive number") as info:
        timeout_seconds()
    assert repr(text) in str(info.value)


@pytest.mark.parametrize("text,seconds", [("", DEFAULT_TIMEOUT_S), (" ", DEFAULT_TIMEOUT_S), ("2.5", 2.5),
                                          ("1e-3", 1e-3), (repr(MAX_TIMEOUT_S), MAX_TIMEOUT_S)])
def test_timeout_values_accepted(text, seconds, monkeypatch):
    monkeypatch.setenv("DEEPEP_CUPY_TIMEOUT_S", text)
    got = timeout_seconds()
    assert got == seconds and math.isfinite(got)
    assert 0 < int(got * 1e9) < 2**63  # the kernels' int64 nanoseconds


def test_an_infinite_timeout_is_refused_by_the_group_waits(monkeypatch):
    """The host waits read the setting too: making the group (its first wait) names it instead of waiting
    without end."""
    mpi = pytest.importorskip("mpi4py.MPI")
    monkeypatch.setenv("DEEPEP_CUPY_TIMEOUT_S", "inf")
    with pytest.raises(ValueError, match="^DEEPEP_CUPY_TIMEOUT_S must be a finite positive number"):
        Buffer(comm=mpi.COMM_SELF, backend="reference")


# ---------------------------------------------------------------------------------------------------- the group
def test_a_communicator_as_the_positional_group_is_named(monkeypatch):
    mpi = pytest.importorskip("mpi4py.MPI")
    with pytest.raises(TypeError, match=r"^group must be a torch.distributed.ProcessGroup, got an mpi4py communicator "
                                        r"\(Intracomm\); pass it as comm=") as info:
        Buffer(mpi.COMM_SELF, 1 << 20, backend="reference")
    assert "Buffer(comm=MPI.COMM_WORLD" in str(info.value)
    monkeypatch.setitem(sys.modules, "torch", None)  # where torch is not installed: the same error, no import
    with pytest.raises(TypeError, match="pass it as comm="):
        make_group(mpi.COMM_SELF)
    group = make_group(comm=mpi.COMM_SELF)
    assert group.size == 1
    group.close()


def test_other_objects_as_group_or_comm_are_named():
    with pytest.raises(TypeError, match="^group must be a torch.distributed.ProcessGroup, got int"):
        make_group(3)
    with pytest.raises(TypeError, match="^comm must be an mpi4py.MPI.Comm, got SimpleNamespace"):
        make_group(comm=types.SimpleNamespace(Get_rank=lambda: 0))


# ---------------------------------------------------------------------------------------------------- x
def _layout(buf, idx, num_experts=8):
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)


@pytest.mark.parametrize("make", [
    lambda x: x.tolist(),                              # rows as a Python list
    lambda x: [x, np.ones((x.shape[0], 1), np.float32)],  # the FP8 pair, as a list
    lambda x: [x],
    lambda x: (x, x, x),
])
def test_x_that_is_no_tensor_nor_the_fp8_tuple_is_named(make):
    def fn(buf, rng):
        idx = _routing(rng, 4, 2, 8)
        buf.dispatch(make(rng.standard_normal((4, 128)).astype(BF16)), **_layout(buf, idx))
    for exc in _errors(2, fn, num_nvl_bytes=NVL):
        assert type(exc) is TypeError and str(exc).startswith("x must be a bf16 tensor [num_tokens, hidden], or for "
                                                              "FP8 a tuple (x_e4m3"), exc


def test_row_counts_name_x_and_the_argument_that_differs():
    def fn(buf, rng):
        idx = _routing(rng, 5, 2, 8)
        buf.dispatch(rng.standard_normal((4, 128)).astype(BF16), **_layout(buf, idx))
    for exc in _errors(2, fn, num_nvl_bytes=NVL):
        assert isinstance(exc, ValueError) and str(exc) == ("is_token_in_rank has 5 rows but x has 4 tokens: they must "
                                                            "match (one row per token)"), exc

    def topk(buf, rng):
        idx = _routing(rng, 4, 2, 8)
        x = rng.standard_normal((4, 128)).astype(BF16)
        buf.dispatch(x, topk_idx=idx[:3].copy(), topk_weights=np.ones((3, 2), np.float32), **_layout(buf, idx))
    for exc in _errors(1, topk, num_nvl_bytes=NVL):
        assert str(exc) == "topk_idx has 3 rows but x has 4 tokens: they must match (one row per token)", exc


# ---------------------------------------------------------------------------------------------------- sizes
def test_a_float_num_experts_is_refused_after_an_int_one():
    def fn(buf, rng):
        idx = _routing(rng, 4, 2, 8)
        buf.get_dispatch_layout(idx, 8)
        with pytest.raises(ValueError, match=r"^num_experts must be a positive int, got 8.0$"):
            buf.get_dispatch_layout(idx, 8.0)
        x = rng.standard_normal((4, 128)).astype(BF16)
        buf.low_latency_dispatch(x, idx, 8, 8, use_fp8=False)
        with pytest.raises(ValueError, match=r"^num_experts must be a positive int, got 8.0$"):
            buf.low_latency_dispatch(x, idx, 8, 8.0, use_fp8=False)
        with pytest.raises(ValueError, match=r"^num_max_dispatch_tokens_per_rank must be a positive int, got 8.0$"):
            buf.low_latency_dispatch(x, idx, 8.0, 8, use_fp8=False)
        with pytest.raises(ValueError, match=r"^num_experts must be a positive int, got True$"):
            buf.get_dispatch_layout(_routing(rng, 4, 1, 1), True)
    assert _errors(1, fn, num_nvl_bytes=NVL, low_latency_mode=True, num_rdma_bytes=LL) == [None]


@pytest.mark.parametrize("num_nvl_ranks", [None, 1])
def test_combine_weights_must_have_the_dispatch_top_k(num_nvl_ranks):
    def fn(buf, rng):
        idx = _routing(rng, 6, 2, 8)
        x = rng.standard_normal((6, 128)).astype(BF16)
        kw = _layout(buf, idx)
        if num_nvl_ranks:
            kw["num_tokens_per_rdma_rank"] = buf.get_dispatch_layout(idx, 8)[1]
        with pytest.raises(ValueError, match=r"^topk_weights must have one column per column of topk_idx \(2\), got 3$"):
            buf.dispatch(x, topk_idx=idx, topk_weights=rng.random((6, 3), dtype=np.float32), **kw)
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=rng.random((6, 2),
                                                                                                 dtype=np.float32), **kw)
        wider = np.concatenate([recv_w, recv_w[:, :1]], axis=1)
        with pytest.raises(ValueError, match=r"^topk_weights has 3 columns, but the dispatch that returned the handle "
                                             r"had top-2"):
            buf.combine(recv_x, handle, topk_weights=wider)
        buf.combine(recv_x, handle, topk_weights=recv_w)  # the right width still works
    kw = dict(num_nvl_bytes=NVL) if num_nvl_ranks is None else dict(num_nvl_bytes=1 << 28, num_rdma_bytes=1 << 28,
                                                                    num_nvl_ranks=1)
    assert _errors(2, fn, **kw) == [None, None]


# ---------------------------------------------------------------------------------------------------- handles
def test_a_low_latency_handle_from_another_buffer_is_refused():
    def body(group):
        rng = np.random.default_rng(group.rank)
        a, b = (Buffer(comm=group, backend="reference", low_latency_mode=True, num_rdma_bytes=LL) for _ in range(2))
        idx = _routing(rng, 4, 2, 8)
        x = rng.standard_normal((4, 128)).astype(BF16)
        w = rng.random((4, 2), dtype=np.float32)
        recv, _, handle, _, _ = a.low_latency_dispatch(x, idx, 8, 8, use_fp8=False)
        with pytest.raises(ValueError, match=r"^handle was returned by another Buffer's low_latency_dispatch"):
            b.low_latency_combine(recv, idx, w, handle)
        with pytest.raises(ValueError, match=r"^handle was returned by another Buffer's"):
            b.low_latency_combine(recv, idx, w, handle, zero_copy=True)
        out, _, _ = a.low_latency_combine(recv, idx, w, handle)  # its own Buffer takes it
        rebuilt = tuple(handle)  # a handle the caller rebuilt: its values are checked instead
        np.testing.assert_array_equal(a.low_latency_combine(recv, idx, w, rebuilt)[0].astype(np.float32),
                                      out.astype(np.float32))
        return True
    assert run_ranks(2, body) == [True, True]


def test_the_gpu_combine_refuses_a_handle_of_another_engine():
    """The GPU plan's check: one attribute read before the launch, on the plan's engine."""
    plan = object.__new__(ll_plans.CombinePlan)
    plan.engine = object()
    foreign = LowLatencyHandle((None, None, 8, 128, 8), None, object())
    with pytest.raises(ValueError, match="^handle was returned by another Buffer's"):
        plan.run(None, None, None, foreign)
    for own in (LowLatencyHandle((None, None, 8, 128, 8), None, plan.engine), (None, None, 8, 128, 8)):
        with pytest.raises(AttributeError):  # past the check, where this stand-in plan has nothing more
            plan.run(None, None, None, own)


def test_handles_keep_their_attributes_through_pickle():
    import pickle

    from deepep_cupy.ops.handles import DispatchHandle

    h = pickle.loads(pickle.dumps(DispatchHandle((np.arange(3), 1), 4)))
    assert h.num_topk == 4 and h[1] == 1
    ll = pickle.loads(pickle.dumps(LowLatencyHandle((1, 2, 8, 128, 8), None, "engine")))
    assert ll.owner == "engine" and ll == (1, 2, 8, 128, 8)


@pytest.mark.parametrize("num_nvl_ranks", [None, 1])
def test_a_whole_dispatch_result_as_the_handle_names_its_fifth_element(num_nvl_ranks):
    def fn(buf, rng):
        idx = _routing(rng, 6, 2, 8)
        x = rng.standard_normal((6, 128)).astype(BF16)
        kw = _layout(buf, idx)
        if num_nvl_ranks:
            kw["num_tokens_per_rdma_rank"] = buf.get_dispatch_layout(idx, 8)[1]
        result = buf.dispatch(x, topk_idx=idx, topk_weights=rng.random((6, 2), dtype=np.float32), **kw)
        want = r"^handle got a whole result tuple of 6 values: pass its handle, the fifth result \(result\[4\]\)"
        with pytest.raises(ValueError, match=want):
            buf.combine(result[0], result)
        with pytest.raises(ValueError, match=want):
            buf.dispatch(x, handle=result)
        buf.combine(result[0], result[4])  # the handle itself still works
    kw = dict(num_nvl_bytes=NVL) if num_nvl_ranks is None else dict(num_nvl_bytes=1 << 28, num_rdma_bytes=1 << 28,
                                                                    num_nvl_ranks=1)
    assert _errors(2, fn, **kw) == [None, None]


def test_a_whole_low_latency_result_as_the_handle_names_its_third_element():
    def fn(buf, rng):
        idx = _routing(rng, 4, 2, 8)
        x = rng.standard_normal((4, 128)).astype(BF16)
        w = rng.random((4, 2), dtype=np.float32)
        result = buf.low_latency_dispatch(x, idx, 8, 8, use_fp8=False)
        with pytest.raises(ValueError, match=r"^handle got a whole result tuple of 5 values: pass its handle, the "
                                             r"third result \(result\[2\]\)"):
            buf.low_latency_combine(result[0], idx, w, result)
        buf.low_latency_combine(result[0], idx, w, result[2])
    assert _errors(2, fn, low_latency_mode=True, num_rdma_bytes=LL) == [None, None]


def test_a_strided_argument_names_the_fix():
    def fn(buf, rng):
        idx = _routing(rng, 6, 2, 8)
        x = rng.standard_normal((6, 128)).astype(BF16)
        weights = rng.random((6, 4), dtype=np.float32)[:, ::2]
        with pytest.raises(ValueError, match=r"^topk_weights must be contiguous, got a strided view of shape \[6, 2\]: "
                                             r"pass ascontiguousarray\(topk_weights\)$"):
            buf.dispatch(x, topk_idx=idx, topk_weights=weights, **_layout(buf, idx))
    assert _errors(1, fn, num_nvl_bytes=NVL) == [None]


def test_a_strided_torch_argument_names_contiguous():
    torch = pytest.importorskip("torch")

    def fn(buf, rng):
        idx = torch.from_numpy(_routing(rng, 6, 2, 8))
        x = torch.randn(6, 128, dtype=torch.bfloat16)
        weights = torch.rand(6, 4)[:, ::2]
        layout = buf.get_dispatch_layout(idx, 8)
        with pytest.raises(ValueError, match=r"^topk_weights must be contiguous, got a strided view of shape \[6, 2\]: "
                                             r"pass topk_weights.contiguous\(\)$"):
            buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                         num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=weights)
    assert _errors(1, fn, num_nvl_bytes=NVL) == [None]


@pytest.mark.parametrize("requested", [None, "cuda"])
def test_a_gpu_without_cupy_names_the_extra(requested, monkeypatch):
    import importlib.util

    from deepep_cupy import backends

    monkeypatch.delenv("DEEPEP_CUPY_BACKEND", raising=False)
    monkeypatch.setattr(backends, "gpu_count", lambda: 1)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cupy" else real(name, *a))
    with pytest.raises(ImportError, match=r"^a CUDA GPU is visible but CuPy is not installed: pip install "
                                          r"\"deepep_cupy\[cuda13\]\".*backend='reference'"):
        backends.choose_backend(requested)
    assert backends.choose_backend("reference") == "reference"

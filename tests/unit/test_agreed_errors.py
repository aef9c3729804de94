"""Errors every rank raises together (reference backend, thread-ranks): the exchange that starts each
collective op, the one that ends it, the Buffer's report of its own argument errors, and the messages of
the group's timeouts and disagreements."""

import gc
import weakref

import ml_dtypes
import numpy as np
import pytest
from thread_group import run_ranks

from deepep_cupy import Buffer, Config
from deepep_cupy.device.group import disagreement, timeout_error
from deepep_cupy.errors import DeepEPError, DeepEPTimeoutError
from deepep_cupy.reference import collective

BF16 = ml_dtypes.bfloat16
LL_BYTES = Buffer.get_low_latency_rdma_size_hint(8, 128, 1, 4)


def _outcomes(size, fn):
    """Run ``fn(group)`` on every thread-rank; return what each returned or raised."""
    def body(group):
        try:
            return fn(group)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            return exc
    return run_ranks(size, body, timeout=20)


def test_one_ranks_error_is_raised_on_every_rank():
    own = TypeError("x must have dtype bfloat16, got float32")

    def fn(g):
        collective.start(g, "dispatch", fields={"hidden": 8}, error=own if g.rank == 1 else None)
    got = _outcomes(3, fn)
    assert got[1] is own and collective.is_agreed(own)
    for r in (0, 2):
        assert type(got[r]) is TypeError and collective.is_agreed(got[r])
        assert "dispatch failed on rank 1" in str(got[r]) and "x must have dtype bfloat16" in str(got[r])


def test_other_errors_become_deepep_errors_and_all_failing_ranks_are_named():
    def fn(g):
        err = RuntimeError("broken") if g.rank in (0, 2) else None
        collective.start(g, "combine", error=err)
    got = _outcomes(3, fn)
    assert isinstance(got[1], DeepEPError) and "ranks 0, 2" in str(got[1]) and "RuntimeError: broken" in str(got[1])
    assert type(got[0]) is RuntimeError and type(got[2]) is RuntimeError


def test_disagreement_names_the_argument_and_each_ranks_value():
    def fn(g):
        return collective.start(g, "low_latency_dispatch", fields={"hidden": 256, "use_fp8": g.rank != 2},
                                info=g.rank * 10)
    got = _outcomes(3, fn)
    for exc in got:
        assert isinstance(exc, ValueError)
        assert str(exc) == str(disagreement("low_latency_dispatch", "use_fp8", [True, True, False]))
        assert "rank 0: True, rank 1: True, rank 2: False" in str(exc)
    assert _outcomes(2, lambda g: collective.start(g, "op", fields={"a": 1}, info=g.rank)) == [[0, 1], [0, 1]]


def test_different_operations_and_a_failure_found_after_the_exchange():
    got = _outcomes(2, lambda g: collective.start(g, "dispatch" if g.rank else "combine"))
    assert all(isinstance(e, ValueError) and "different operations" in str(e) for e in got)
    late = ValueError("handle[3] (recv_src_idx) of rank 0 names token 9")
    got = _outcomes(2, lambda g: collective.finish(g, "combine", late if g.rank == 0 else None))
    assert got[0] is late and isinstance(got[1], ValueError) and "combine failed on rank 0" in str(got[1])
    assert _outcomes(2, lambda g: collective.finish(g, "combine")) == [None, None]


def test_timeout_error_names_op_rank_and_missing_ranks():
    exc = timeout_error("dispatch (data)", 2, [0, 3], 1.5)
    assert isinstance(exc, DeepEPTimeoutError) and (exc.op, exc.rank, exc.missing) == ("dispatch (data)", 2, [0, 3])
    assert str(exc).startswith("dispatch (data): rank 2 waited 1.5 s for ranks 0, 3, which did not arrive")
    assert "cannot tell" in str(timeout_error("Buffer", 0, None, 3)) and timeout_error("b", 0, None, 3).missing is None


def test_bad_argument_on_one_rank_every_rank_raises_and_the_next_call_works():
    def fn(g):
        buf = Buffer(comm=g, backend="reference", num_nvl_bytes=Config().get_nvl_buffer_size_hint(128, 3))
        rng = np.random.default_rng(g.rank)
        idx = np.stack([rng.choice(6, 2, replace=False) for _ in range(4)]).astype(np.int64)
        x = np.ones((4, 64), BF16)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 6)
        kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        bad = np.full((4, 2), 99, np.int64) if g.rank == 2 else idx  # out-of-range expert ids on rank 2 only
        w = np.ones((4, 2), np.float32)
        with pytest.raises(ValueError, match="topk_idx") as info:
            buf.dispatch(x, topk_idx=bad, topk_weights=w, **kw)
        assert g.rank == 2 or "rank 2" in str(info.value)
        assert (g.rank != 2) or (bad == 99).all()
        recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **kw)
        combined, _, _ = buf.combine(recv_x, handle)
        return combined.shape
    assert run_ranks(3, fn, timeout=20) == [(4, 64)] * 3


def test_collective_methods_hand_their_errors_to_the_backend():
    """Each collective method gives an error raised before its first exchange to the backend's
    ``report_failure`` (the reference backend raises it on every rank; the GPU backend's does nothing), once
    per call, from the class's own methods: nothing is installed per instance, so a Buffer goes without a GC
    pass."""
    def fn(g):
        failing = Buffer(comm=g, backend="reference", low_latency_mode=True, num_rdma_bytes=LL_BYTES)
        seen = []
        failing.runtime.report_failure = lambda op, exc: seen.append((op, type(exc)))
        not_a_tensor = [[1.0, 2.0]]
        calls = {"dispatch": lambda: failing.dispatch(not_a_tensor, num_tokens_per_rank=None),
                 "combine": lambda: failing.combine(not_a_tensor, None),
                 "low_latency_dispatch": lambda: failing.low_latency_dispatch(not_a_tensor, None, 8, 4),
                 "low_latency_combine": lambda: failing.low_latency_combine(not_a_tensor, None, None, None)}
        for op, call in calls.items():
            with pytest.raises((TypeError, ValueError)):
                call()
            assert seen.pop()[0] == op and not seen
        assert not {"dispatch", "combine", "low_latency_dispatch"} & set(vars(failing))
        buf = Buffer(comm=g, backend="reference", low_latency_mode=True, num_rdma_bytes=LL_BYTES)
        ref = weakref.ref(buf)
        gc.disable()
        try:
            del buf
            return ref() is None
        finally:
            gc.enable()
    assert run_ranks(1, fn) == [True]

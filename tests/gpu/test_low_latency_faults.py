"""Low-latency faults and transports on GPUs through the public ``deepep_cupy.Buffer`` API: the NVSHMEM RMA
path (puts instead of NVLink stores), a silent rank masked with ``enable_shrink``, a silent rank
without it ending in DeepEPTimeoutError, and a grid the GPU cannot hold at once ending in one that says so.

Run on every rank:  mpirun -np 2 python -m pytest tests/gpu/test_low_latency_faults.py -q
Each test creates its own small Buffer (the module's fixture holds none); the silent-rank tests use a 2 s
kernel wait budget. Same conventions as test_low_latency.py otherwise.
"""

from __future__ import annotations

import re
import time

import numpy as np
from gpu_common import (
    TEST_TIMEOUT_S,
    agree,
    bf16,
    check,
    collective_buffer,
    sync,
    to_dev,
    to_np,
    with_wait_budget,
)
from ll_common import (
    E_SMALL,
    FRAMEWORKS,
    H_SMALL,
    LL_MARKS,
    SHORT_TIMEOUT_S,
    T_SMALL,
    combine_failures,
    dispatch_arrays,
    dispatch_failures,
    hint,
    reference_oracle,
    routing,
    run_round,
    small_data,
)
from reference_cases import ll_combine, ll_dispatch

pytestmark = LL_MARKS
ENV = with_wait_budget


def _small_buffer(**kwargs):
    """A low-latency Buffer for the small shape (T_SMALL, H_SMALL, E_SMALL), destroyed at the end."""
    return collective_buffer(num_rdma_bytes=hint(T_SMALL, H_SMALL, E_SMALL), low_latency_mode=True, **kwargs)


def test_rma_path(env, monkeypatch):
    """NVSHMEM puts, fences and signals instead of NVLink stores (DEEPEP_CUPY_LL_FORCE_RMA=1)."""
    monkeypatch.setenv("DEEPEP_CUPY_LL_FORCE_RMA", "1")
    failures = []
    with _small_buffer() as buf:
        monkeypatch.delenv("DEEPEP_CUPY_LL_FORCE_RMA")
        local = dict(env, buf=buf, ref=reference_oracle())
        assert buf.runtime.low_latency.staged
        for i, (fp8, logfmt, zero_copy) in enumerate([(False, False, False), (True, True, False), (True, False, True),
                                                      (True, True, True)]):
            f, _, _ = run_round(local, FRAMEWORKS[0], seed=20 + i, t_max=T_SMALL, hidden=H_SMALL, num_experts=E_SMALL,
                                k=8, fp8=fp8, logfmt=logfmt, zero_copy=zero_copy)
            failures += [f"fp8={fp8} logfmt={logfmt} zero_copy={zero_copy}: {m}" for m in f]
    agree(failures)


def test_shrink_masks_a_silent_rank(env, monkeypatch):
    """The last rank stops calling; the others finish with it masked and match the reference with that mask."""
    rank, size = env["rank"], env["size"]
    silent = size - 1
    monkeypatch.setenv("DEEPEP_CUPY_TIMEOUT_S", SHORT_TIMEOUT_S)
    fw = FRAMEWORKS[0]
    x, topk, w, expert_out = small_data(rank, 30)
    failures = []
    with _small_buffer(enable_shrink=True) as buf:
        ref = reference_oracle(enable_shrink=True)
        if rank != silent:
            t0 = time.time()
            recv, count, handle, _e, _h = buf.low_latency_dispatch(to_dev(x, fw, env), to_dev(topk, fw, env),
                                                                   T_SMALL, E_SMALL, use_fp8=False)
            sync()
            first = time.time() - t0
            status = to_dev(np.zeros(size, np.int32), fw, env)
            buf.low_latency_query_mask_buffer(status)
            expected_mask = np.zeros(size, np.int32)
            expected_mask[silent] = 1
            check(failures, "mask after timeout", lambda: np.testing.assert_array_equal(to_np(status), expected_mask))
            combined, _e, _h = buf.low_latency_combine(to_dev(expert_out, fw, env), to_dev(topk, fw, env),
                                                       to_dev(w, fw, env), handle)
            t1 = time.time()
            buf.low_latency_dispatch(to_dev(x, fw, env), to_dev(topk, fw, env), T_SMALL, E_SMALL, use_fp8=False)
            sync()
            again = time.time() - t1
            if again > 1.0:
                failures.append(f"dispatch after masking still waited {again:.1f} s (first call {first:.1f} s)")
            ours = dispatch_arrays(recv, count, handle)
        # The reference exchange involves every rank; each view masks the silent rank (itself, for it).
        # The silent rank gets here at once, the others only after their kernels gave up on it: the
        # reference's host exchange must outwait that, so it gets the suite's usual budget, not the short
        # one the kernels were planned with.
        monkeypatch.setenv("DEEPEP_CUPY_TIMEOUT_S", TEST_TIMEOUT_S)
        ref.low_latency_update_mask_buffer(silent, True)
        r_recv, r_count, r_handle, _ = ll_dispatch(ref, x, topk, E_SMALL, num_max_dispatch_tokens_per_rank=T_SMALL)
        r_combined, _ = ll_combine(ref, expert_out, topk, w, r_handle)
        if rank != silent:
            failures += dispatch_failures(ours, dispatch_arrays(r_recv, r_count, r_handle), fp8=False)
            failures += combine_failures(to_np(combined), np.asarray(r_combined), logfmt=False)
            buf.low_latency_clean_mask_buffer()
            status = to_dev(np.ones(size, np.int32), fw, env)
            buf.low_latency_query_mask_buffer(status)
            check(failures, "mask after clean", lambda: np.testing.assert_array_equal(to_np(status), 0))
            buf.low_latency_update_mask_buffer(silent, True)
            buf.low_latency_query_mask_buffer(status)
            check(failures, "mask after update", lambda: np.testing.assert_array_equal(to_np(status)[silent], 1))
    agree(failures)


def test_timeout_without_shrink_raises(env, monkeypatch):
    """Without enable_shrink a silent peer ends the wait with DeepEPTimeoutError (at the next call)."""
    from deepep_cupy.errors import DeepEPTimeoutError

    rank, size = env["rank"], env["size"]
    silent = size - 1
    monkeypatch.setenv("DEEPEP_CUPY_TIMEOUT_S", SHORT_TIMEOUT_S)
    fw = FRAMEWORKS[0]
    x, topk, _w, _eo = small_data(rank, 40)
    failures = []
    with _small_buffer() as buf:
        if rank != silent:
            buf.low_latency_dispatch(to_dev(x, fw, env), to_dev(topk, fw, env), T_SMALL, E_SMALL, use_fp8=False)
            sync()
            try:
                buf.low_latency_dispatch(to_dev(x, fw, env), to_dev(topk, fw, env), T_SMALL, E_SMALL, use_fp8=False)
                sync()
                failures.append("no DeepEPTimeoutError after a peer stayed silent")
            except DeepEPTimeoutError as exc:
                if f"peer {silent}" not in str(exc):
                    failures.append(f"timeout message does not name the peer: {exc}")
    agree(failures)


def test_a_grid_the_gpu_cannot_hold_ends_in_a_timeout_that_says_so(env, monkeypatch):
    """A low-latency launch whose blocks cannot all be resident at once (the engine is told the GPU has 8
    times its SMs, so its grid has more blocks than the GPU holds) waits for work its unstarted blocks hold.
    The timeout says so on every rank: how many of the grid's blocks had begun, fewer than all."""
    from deepep_cupy.errors import DeepEPTimeoutError

    rank = env["rank"]
    num_experts, tokens = 288, 8
    monkeypatch.setenv("DEEPEP_CUPY_TIMEOUT_S", SHORT_TIMEOUT_S)
    rng = np.random.default_rng((288, rank))
    x = bf16(rng, (tokens, H_SMALL))
    topk, _ = routing(rng, tokens, num_experts, 8, masked_slots=0)
    fw = FRAMEWORKS[0]
    failures = []
    with collective_buffer(num_rdma_bytes=hint(tokens, H_SMALL, num_experts), low_latency_mode=True) as buf:
        engine = buf.runtime.low_latency
        engine.num_sms *= 8  # a grid of more blocks than the SMs hold at once
        args = (to_dev(x, fw, env), to_dev(topk, fw, env), tokens, num_experts)
        try:
            for _ in range(3):  # blocks that finish free their SMs: a launch may still complete
                buf.low_latency_dispatch(*args, use_fp8=False)
                sync()
            failures.append("no DeepEPTimeoutError from a grid the GPU could not hold")
        except DeepEPTimeoutError as exc:
            begun = re.search(r"only (\d+) of the launch's (\d+) blocks had begun", str(exc))
            if begun is None or not 0 < int(begun[1]) < int(begun[2]):
                failures.append(f"the timeout does not say the grid only partly began: {exc}")
        engine.num_sms //= 8
        engine.clean(tokens, H_SMALL, num_experts)  # collective: the buffer is whole again for its teardown
    agree(failures)


def test_ranks_that_disagree_get_a_named_error_before_any_kernel(env):
    """Rank 0 passes another num_max_dispatch_tokens_per_rank than the others: every rank raises the same
    ValueError naming the argument and each rank's value, from the plan's agreement check (no kernel runs,
    so nothing times out); the next call with agreeing values works."""
    rank = env["rank"]
    fw = FRAMEWORKS[0]
    t_bad = T_SMALL if rank else T_SMALL // 2
    x, topk, _w, _eo = small_data(rank, 50)
    x, topk = x[: T_SMALL // 2], topk[: T_SMALL // 2]
    failures = []
    with _small_buffer() as buf:
        t0 = time.time()
        try:
            buf.low_latency_dispatch(to_dev(x, fw, env), to_dev(topk, fw, env), t_bad, E_SMALL, use_fp8=False)
            sync()
            failures.append("no ValueError when the ranks disagree on num_max_dispatch_tokens_per_rank")
        except ValueError as exc:
            text = str(exc)
            if "num_max_dispatch_tokens_per_rank" not in text or f"rank 0: {T_SMALL // 2}" not in text:
                failures.append(f"the error does not name the argument and the values: {text}")
        if time.time() - t0 > 1.0:
            failures.append(f"the disagreement took {time.time() - t0:.1f} s to report (a kernel ran?)")
        recv, count, _h, _e, _hook = buf.low_latency_dispatch(to_dev(x, fw, env), to_dev(topk, fw, env), T_SMALL,
                                                                E_SMALL, use_fp8=False)
        sync()
        check(failures, "a dispatch after the error", lambda: np.testing.assert_array_less(-1, to_np(count)))
    agree(failures)

"""Reference backend semantics of the low-latency ops in one process: a group of size 1 and thread-ranks
(R = 1..4); the normal ops are in test_reference_single.py.

Every rank derives all ranks' inputs from the same seeds, so each expectation is computed independently
by plain loops over every rank's data (tests/helpers/reference_cases.py, shared with tests/mpi).
"""

import ml_dtypes
import numpy as np
import pytest
from reference_cases import (
    T_MAX,
    apply_experts,
    expected_ll_combine,
    expert_fn,
    ll_combine,
    ll_dispatch,
    ll_expected,
    ll_expected_ranges,
    make_case,
)
from thread_group import run_ranks

from deepep_cupy.reference import ReferenceOracle, quant

BF16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn
RANKS = [1, 2, 3, 4]


# ------------------------------------------------------------------------------------------ low latency
def ll_backend(g, shrink=False):
    return ReferenceOracle(g, num_nvl_ranks=g.size, low_latency_mode=True, enable_shrink=shrink)


@pytest.mark.parametrize("num_ranks", RANKS)
@pytest.mark.parametrize("seed", [0, 1])
def test_ll_dispatch_and_combine_bf16(num_ranks, seed):
    e_local = 3
    sizes = [T_MAX, 0, 5, 9]

    def fn(g):
        cases = [make_case(seed, r, num_ranks, n=(sizes[r] if num_ranks > 1 else 7), e_local=e_local, k=4)
                 for r in range(num_ranks)]
        x, topk, w = cases[g.rank]
        b = ll_backend(g)
        stats = np.full(e_local, 5, np.int32)
        wait = np.zeros(num_ranks, np.int64)
        recv_x, count, handle, hook = ll_dispatch(b, x, topk, e_local * num_ranks,
                                                  cumulative_local_expert_recv_stats=stats,
                                                  dispatch_wait_recv_cost_stats=wait)
        assert hook is None and recv_x.dtype == BF16 and recv_x.shape == (e_local, num_ranks * T_MAX, 128)
        src_info, layout, t_max, hidden, ne = handle
        assert (t_max, hidden, ne) == (T_MAX, 128, e_local * num_ranks)
        assert count.dtype == np.int32 and src_info.dtype == np.int32 and layout.dtype == np.int64
        slabs = ll_expected(g.rank, cases, e_local)
        for i in range(e_local):
            assert count[i] == len(slabs[i])
            for row, (s, t) in enumerate(slabs[i]):
                np.testing.assert_array_equal(recv_x[i, row].astype(np.float32), cases[s][0][t].astype(np.float32))
                assert src_info[i, row] == t
            assert not recv_x[i, count[i]:].astype(np.float32).any() and (src_info[i, count[i]:] == -1).all()
            np.testing.assert_array_equal(layout[i], ll_expected_ranges(slabs[i], g.rank, num_ranks))
        np.testing.assert_array_equal(stats, 5 + count)
        assert not wait.any()
        y = apply_experts(g.rank, recv_x, e_local)
        combined, hook = ll_combine(b, y, topk, w, handle)
        assert hook is None and combined.dtype == BF16 and combined.shape == x.shape
        want = expected_ll_combine(x, topk, w, e_local)
        np.testing.assert_array_equal(combined.astype(np.float32), want.astype(np.float32).astype(BF16).astype(np.float32))
        return True

    assert all(run_ranks(num_ranks, fn))


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_ll_random_weights_match_independent_fma(num_ranks):
    e_local = 2

    def fn(g):
        rng = np.random.default_rng([41, g.rank])
        x, topk, _ = make_case(41, g.rank, num_ranks, n=8, e_local=e_local, k=3)
        x = rng.normal(size=x.shape).astype(BF16)
        w = rng.random(topk.shape).astype(np.float32)
        b = ll_backend(g)
        recv_x, _, handle, _ = ll_dispatch(b, x, topk, e_local * num_ranks)
        combined, _ = ll_combine(b, apply_experts(g.rank, recv_x, e_local), topk, w, handle)
        acc = np.zeros(x.shape, np.float32)
        for t in range(x.shape[0]):
            for j, e in enumerate(topk[t]):
                if e >= 0:
                    row = expert_fn(x[t:t + 1], e)[0].astype(np.float64)
                    exact = row * np.float64(w[t, j]) + acc[t].astype(np.float64)  # product exact in float64
                    acc[t] = exact.astype(np.float32)  # float64 rounding of the sum: compare within 1 ulp
        got = combined.astype(np.float32)
        np.testing.assert_allclose(got, acc.astype(BF16).astype(np.float32), rtol=2**-7, atol=1e-6)
        return True

    assert all(run_ranks(num_ranks, fn))


@pytest.mark.parametrize("num_ranks", [1, 2, 3])
@pytest.mark.parametrize("mode", ["fp8", "round", "ue8m0"])
def test_ll_dispatch_fp8(num_ranks, mode):
    e_local, hidden = 2, 512

    def fn(g):
        cases = []
        for r in range(num_ranks):
            xr, tr, wr = make_case(51, r, num_ranks, n=6, e_local=e_local, hidden=hidden)
            xr = np.random.default_rng([52, r]).normal(size=xr.shape).astype(BF16)
            cases.append((xr, tr, wr))
        x, topk, w = cases[g.rank]
        b = ll_backend(g)
        (q, s), count, handle, _ = ll_dispatch(b, x, topk, e_local * num_ranks, use_fp8=True,
                                                round_scale=(mode == "round"), use_ue8m0=(mode == "ue8m0"))
        assert q.dtype == FP8 and q.shape == (e_local, num_ranks * T_MAX, hidden)
        assert s.transpose(0, 2, 1).flags.c_contiguous
        if mode == "ue8m0":
            assert s.dtype == np.int32 and s.shape == (e_local, num_ranks * T_MAX, hidden // 512)
            scales = quant.ue8m0_to_scale(quant.unpack_ue8m0(s, hidden // 128))
        else:
            assert s.dtype == np.float32 and s.shape == (e_local, num_ranks * T_MAX, hidden // 128)
            scales = s
        if mode != "fp8":
            live = scales[scales != 0]
            assert not (live.view(np.uint32) & 0x7FFFFF).any()
        slabs = ll_expected(g.rank, cases, e_local)
        for i in range(e_local):
            assert count[i] == len(slabs[i])
            for row, (src, t) in enumerate(slabs[i]):
                xs = cases[src][0][t:t + 1].astype(np.float32)
                deq = quant.fp8_dequant_per_128(q[i, row:row + 1], scales[i, row:row + 1])
                bound = np.maximum(np.abs(xs) * 2.0**-4, np.repeat(scales[i, row], 128) * 2.0**-10)
                assert np.all(np.abs(deq - xs) <= bound * (1 + 1e-6))
            assert not q[i, count[i]:].astype(np.float32).any() and not scales[i, count[i]:].any()
        return True

    assert all(run_ranks(num_ranks, fn))


@pytest.mark.parametrize("num_ranks", [1, 2, 3])
def test_ll_hooks_zero_copy_out_logfmt(num_ranks):
    e_local = 2

    def fn(g):
        x, topk, w = make_case(61, g.rank, num_ranks, n=10, e_local=e_local, hidden=256)
        b = ll_backend(g)
        ref_x, ref_count, ref_handle, _ = ll_dispatch(b, x, topk, e_local * num_ranks)
        stats = np.zeros(e_local, np.int32)
        hx, hcount, handle, hook = ll_dispatch(b, x, topk, e_local * num_ranks, return_recv_hook=True,
                                                cumulative_local_expert_recv_stats=stats)
        assert callable(hook) and np.isnan(hx.astype(np.float32)).all() and (hcount == -1).all() and not stats.any()
        hook()
        np.testing.assert_array_equal(hx.astype(np.float32), ref_x.astype(np.float32))
        np.testing.assert_array_equal(hcount, ref_count)
        np.testing.assert_array_equal(stats, ref_count)
        (hq, hs), _, _, hook8 = ll_dispatch(b, x, topk, e_local * num_ranks, return_recv_hook=True, use_fp8=True)
        assert np.isnan(hs).all() and hs.transpose(0, 2, 1).flags.c_contiguous
        hook8()
        (rq, rs), _, _, _ = ll_dispatch(b, x, topk, e_local * num_ranks, use_fp8=True)
        np.testing.assert_array_equal(hq.view(np.uint8), rq.view(np.uint8))
        np.testing.assert_array_equal(hs, rs)

        y = apply_experts(g.rank, ref_x, e_local)
        want, _ = ll_combine(b, y, topk, w, ref_handle)
        # hook
        got, chook = ll_combine(b, y, topk, w, ref_handle, return_recv_hook=True)
        assert np.isnan(got.astype(np.float32)).all()
        chook()
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
        # out
        out = np.empty(x.shape, BF16)
        got, _ = ll_combine(b, y, topk, w, ref_handle, out=out)
        assert got is out
        np.testing.assert_array_equal(out.view(np.uint16), want.view(np.uint16))
        # zero copy: the combine reads the buffer, not the x argument
        buf = b.get_next_low_latency_combine_buffer(ref_handle)
        assert buf.shape == (e_local, num_ranks * T_MAX, 256) and buf.dtype == BF16
        assert b.get_next_low_latency_combine_buffer(ref_handle) is buf
        buf[...] = y
        got, _ = ll_combine(b, np.zeros_like(y), topk, w, ref_handle, zero_copy=True)
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
        b.clean_low_latency_buffer(T_MAX, 256, e_local * num_ranks)
        assert not buf.astype(np.float32).any()
        # logfmt: exact against an independent LogFMT round trip of each rank's part, and close to the plain
        # result (summed per rank in rank order, each rank's part an fma chain in top-k order, rounded to
        # bf16 and sent as LogFMT)
        got, _ = ll_combine(b, y, topk, w, ref_handle, use_logfmt=True)
        acc = np.zeros(x.shape, np.float32)
        for t in range(x.shape[0]):
            for o in range(num_ranks):
                part, held = np.zeros(x.shape[1], np.float32), False
                for j, e in enumerate(topk[t]):
                    if e >= 0 and e // e_local == o:
                        row = expert_fn(x[t:t + 1], e).astype(np.float32)[0]
                        part, held = quant.fma_f32(row, w[t, j], part), True
                if held:
                    acc[t] = acc[t] + quant.logfmt_roundtrip_bf16(part[None].astype(BF16)).astype(np.float32)[0]
        np.testing.assert_array_equal(got.view(np.uint16), acc.astype(BF16).view(np.uint16))
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=0.03, atol=0.03)
        return True

    assert all(run_ranks(num_ranks, fn))


@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_ll_masking_all_ranks_agree(num_ranks):
    e_local, victim = 2, num_ranks - 1

    def fn(g):
        cases = [make_case(71, r, num_ranks, n=9, e_local=e_local) for r in range(num_ranks)]
        x, topk, w = cases[g.rank]
        b = ll_backend(g, shrink=True)
        b.low_latency_update_mask_buffer(victim, True)
        status = np.full(num_ranks, 7, np.int32)
        b.low_latency_query_mask_buffer(status)
        np.testing.assert_array_equal(status, np.arange(num_ranks) == victim)
        recv_x, count, handle, _ = ll_dispatch(b, x, topk, e_local * num_ranks)
        slabs = ll_expected(g.rank, cases, e_local, masked={victim})
        np.testing.assert_array_equal(count, [len(sl) for sl in slabs])
        for i in range(e_local):
            np.testing.assert_array_equal(handle[1][i], ll_expected_ranges(slabs[i], g.rank, num_ranks))
        if g.rank == victim:
            assert not count.any()
        combined, _ = ll_combine(b, apply_experts(g.rank, recv_x, e_local), topk, w, handle)
        want = expected_ll_combine(x, topk, w, e_local, masked={victim}, me=g.rank)
        np.testing.assert_array_equal(combined.astype(np.float32), want.astype(np.float32).astype(BF16).astype(np.float32))
        b.low_latency_clean_mask_buffer()
        b.low_latency_query_mask_buffer(status)
        assert not status.any()
        _, count, _, _ = ll_dispatch(b, x, topk, e_local * num_ranks)
        np.testing.assert_array_equal(count, [len(sl) for sl in ll_expected(g.rank, cases, e_local)])
        return True

    assert all(run_ranks(num_ranks, fn))


def test_ll_masking_one_sided_view_does_not_hang():
    """Only rank 0 masks rank 1: nothing flows between them in either direction; rank 2 is unaffected."""
    num_ranks, e_local = 3, 2

    def fn(g):
        cases = [make_case(81, r, num_ranks, n=9, e_local=e_local) for r in range(num_ranks)]
        x, topk, w = cases[g.rank]
        b = ll_backend(g, shrink=True)
        if g.rank == 0:
            b.low_latency_update_mask_buffer(1, True)
        recv_x, count, handle, _ = ll_dispatch(b, x, topk, e_local * num_ranks)
        layout = handle[1]
        want_slabs = ll_expected(g.rank, cases, e_local, masked=())
        for i in range(e_local):
            for s in range(num_ranks):
                n_from_s = sum(1 for (ss, _) in want_slabs[i] if ss == s)
                blocked_pair = {g.rank, s} == {0, 1}
                assert layout[i, s] & 0xFFFFFFFF == (0 if blocked_pair else n_from_s)
        combined, _ = ll_combine(b, apply_experts(g.rank, recv_x, e_local), topk, w, handle)
        blocked = {1} if g.rank == 0 else ({0} if g.rank == 1 else set())
        want = expected_ll_combine(x, topk, w, e_local, masked=blocked, me=-1)
        np.testing.assert_array_equal(combined.astype(np.float32), want.astype(np.float32).astype(BF16).astype(np.float32))
        return True

    assert all(run_ranks(num_ranks, fn))


def test_ll_errors_and_mask_requires_shrink():
    def fn(g):
        b = ll_backend(g)
        x = np.zeros((3, 128), BF16)
        dup = np.array([[0, 1], [1, 1], [0, -1]], np.int64)
        with pytest.raises(ValueError, match="twice"):
            ll_dispatch(b, x, dup, 2)
        ll_dispatch(b, x, np.array([[0, -1], [-1, -1], [1, 0]], np.int64), 2)  # -1 repeated is fine
        with pytest.raises(ValueError):
            ll_dispatch(b, np.zeros((T_MAX + 1, 128), BF16), np.zeros((T_MAX + 1, 1), np.int64), 2)
        with pytest.raises(RuntimeError):
            b.low_latency_update_mask_buffer(0, True)
        return True

    assert run_ranks(1, fn)[0]
    with pytest.raises(ValueError):
        run_ranks(2, lambda g: ReferenceOracle(g, num_nvl_ranks=3, low_latency_mode=False, enable_shrink=False))


@pytest.mark.parametrize("one_sided", [False, True])
def test_ll_mask_set_between_dispatch_and_combine(one_sided):
    """Rows that the owner still returns are ignored by a source that now masks the owner."""
    num_ranks, e_local = 3, 2

    def fn(g):
        x, topk, w = make_case(91, g.rank, num_ranks, n=9, e_local=e_local)
        b = ll_backend(g, shrink=True)
        recv_x, _, handle, _ = ll_dispatch(b, x, topk, e_local * num_ranks)
        if g.rank == 0 or not one_sided:
            b.low_latency_update_mask_buffer(1, True)
        combined, _ = ll_combine(b, apply_experts(g.rank, recv_x, e_local), topk, w, handle)
        if one_sided:
            blocked = {1} if g.rank == 0 else ({0} if g.rank == 1 else set())
            want = expected_ll_combine(x, topk, w, e_local, masked=blocked, me=-1)
        else:
            want = expected_ll_combine(x, topk, w, e_local, masked={1}, me=g.rank)
        np.testing.assert_array_equal(combined.astype(np.float32), want.astype(np.float32).astype(BF16).astype(np.float32))
        return True

    assert all(run_ranks(num_ranks, fn))


def test_ll_combine_uses_fused_multiply_add():
    """acc = fma(3, w, 1) lands just above a bf16 tie; an unfused product would round to the tie and down."""
    w1 = np.array([0x3AAAAB56], np.uint32).view(np.float32)[0]

    def fn(g):
        x = np.ones((1, 128), BF16)
        topk = np.array([[0, 2]], np.int64)  # expert outputs 1 and 3 (expert_fn)
        w = np.array([[1.0, w1]], np.float32)
        b = ll_backend(g)
        recv_x, _, handle, _ = ll_dispatch(b, x, topk, 3)
        combined, _ = ll_combine(b, apply_experts(0, recv_x, 3), topk, w, handle)
        assert (combined.astype(np.float32) == np.float32(1.0078125)).all()
        unfused = (np.float32(1) + np.float32(3) * w1).astype(BF16)
        assert unfused.astype(np.float32) == 1.0
        return True

    assert run_ranks(1, fn)[0]


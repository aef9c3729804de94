"""Reference backend semantics in one process: a group of size 1 and thread-ranks (R = 1..4).

Every rank derives all ranks' inputs from the same seeds, so each expectation is computed independently
by plain loops over every rank's data (tests/helpers/reference_cases.py, shared with tests/mpi).
"""

import ml_dtypes
import numpy as np
import pytest
from reference_cases import (
    T_MAX,
    apply_experts,
    brute_layout,
    expected_dispatch,
    expected_ll_combine,
    expected_send_side,
    expert_fn,
    ll_combine,
    ll_dispatch,
    ll_expected,
    ll_expected_ranges,
    make_case,
)
from thread_group import run_ranks

from deepep_cupy.reference import ReferenceOracle, normal, quant

BF16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn
RANKS = [1, 2, 3, 4]


# ------------------------------------------------------------------------------------------ backends
def backend(group, **kw):
    kw.setdefault("num_nvl_ranks", group.size)
    kw.setdefault("low_latency_mode", False)
    kw.setdefault("enable_shrink", False)
    return ReferenceOracle(group, **kw)


def normal_dispatch(b, x, topk, w, num_experts, scales=None, alignment=1, worst=0):
    per_rank, _, per_expert, in_rank = b.get_dispatch_layout(topk, num_experts)
    return b.dispatch(x, scales, handle=None, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                      num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w,
                      expert_alignment=alignment, num_worst_tokens=worst)


# ------------------------------------------------------------------------------------------ layout
@pytest.mark.parametrize("num_ranks,nvl", [(1, 1), (2, 2), (2, 1), (4, 2), (4, 4), (3, 1)])
@pytest.mark.parametrize("seed", [0, 1])
def test_layout_matches_brute_force(num_ranks, nvl, seed):
    e_local = 3
    x, topk, _ = make_case(seed, 0, num_ranks, n=37, k=4, e_local=e_local)
    got = normal.dispatch_layout(topk, e_local * num_ranks, num_ranks, nvl)
    want = brute_layout(topk, e_local * num_ranks, num_ranks, nvl)
    assert got[0].dtype == np.int32 and got[2].dtype == np.int32 and got[3].dtype == bool
    np.testing.assert_array_equal(got[0], want[0])
    if num_ranks // nvl == 1:
        assert got[1] is None
    else:
        assert got[1].dtype == np.int32
        np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_array_equal(got[3], want[3])


# ------------------------------------------------------------------------------------------ dispatch
@pytest.mark.parametrize("num_ranks", RANKS)
@pytest.mark.parametrize("seed", [0, 1])
def test_dispatch_matches_brute_force(num_ranks, seed):
    e_local, channels = 2, 4
    sizes = [16, 0, 9, 24][:num_ranks] if num_ranks > 1 else [17]  # rank 1 has no tokens

    def fn(g):
        cases = [make_case(seed, r, num_ranks, n=sizes[r], e_local=e_local) for r in range(num_ranks)]
        x, topk, w = cases[g.rank]
        b = backend(g, num_channels=channels)
        recv_x, recv_s, recv_tk, recv_tw, lst, handle = normal_dispatch(b, x, topk, w, e_local * num_ranks)
        rows, src, tk, tw, rank_prefix, per_expert, recv_cpm = expected_dispatch(g.rank, cases, e_local, channels)
        assert recv_s is None
        assert recv_x.dtype == BF16 and recv_x.shape == (len(rows), 128)
        if rows:
            np.testing.assert_array_equal(recv_x.astype(np.float32), np.array(rows, np.float32))
            np.testing.assert_array_equal(recv_tk, np.array(tk))
            np.testing.assert_array_equal(recv_tw, np.array(tw, np.float32))
        assert recv_tk.dtype == np.int64 and recv_tw.dtype == np.float32
        assert lst == per_expert and all(isinstance(c, int) for c in lst)
        rpm, cpm, rcpm, rsrc, in_rank, head = handle
        assert rpm.dtype == np.int32 and cpm.dtype == np.int32 and rcpm.dtype == np.int32
        assert rsrc.dtype == np.int32 and head.dtype == np.int32
        np.testing.assert_array_equal(rpm, rank_prefix)
        np.testing.assert_array_equal(rsrc, np.array(src, np.int64))
        np.testing.assert_array_equal(rcpm, recv_cpm)
        want_cpm, want_head = expected_send_side(x, topk, e_local, num_ranks, channels)
        np.testing.assert_array_equal(cpm, want_cpm)
        np.testing.assert_array_equal(head, want_head)
        np.testing.assert_array_equal(in_rank, brute_layout(topk, e_local * num_ranks, num_ranks, num_ranks)[3])
        return True

    assert all(run_ranks(num_ranks, fn))


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_dispatch_cached_alignment_and_inputs_untouched(num_ranks):
    e_local = 3

    def fn(g):
        x, topk, w = make_case(5, g.rank, num_ranks, n=11, e_local=e_local)
        copies = [a.copy() for a in (x, topk, w)]
        b = backend(g)
        recv_x, _, _, _, lst, handle = normal_dispatch(b, x, topk, w, e_local * num_ranks, alignment=4)
        unaligned = normal_dispatch(b, x, topk, w, e_local * num_ranks)[4]
        assert lst == [-(-c // 4) * 4 for c in unaligned] and all(c % 4 == 0 for c in lst)
        again = b.dispatch(x, None, handle=handle, num_tokens_per_rank=None, is_token_in_rank=None,
                           num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1,
                           num_worst_tokens=0)
        np.testing.assert_array_equal(again[0].astype(np.float32), recv_x.astype(np.float32))
        assert again[1] is None and again[2] is None and again[3] is None
        for a, c in zip((x, topk, w), copies, strict=True):
            np.testing.assert_array_equal(a, c)
        return True

    assert all(run_ranks(num_ranks, fn))


@pytest.mark.parametrize("num_ranks", [1, 2, 3])
def test_dispatch_fp8_tuple(num_ranks):
    def fn(g):
        rng = np.random.default_rng([7, g.rank])
        x, topk, w = make_case(7, g.rank, num_ranks, n=10, hidden=256)
        q, s = quant.fp8_cast_per_128(rng.normal(size=(10, 256)).astype(np.float32))
        s_colmajor = np.asfortranarray(s)
        b = backend(g)
        recv_x, recv_s, _, _, _, handle = normal_dispatch(b, q, topk, w, 2 * num_ranks, scales=s_colmajor)
        assert recv_x.dtype == FP8 and recv_s.dtype == np.float32 and recv_s.flags.c_contiguous
        assert recv_s.shape == (recv_x.shape[0], 2)
        # every rank's (q, s) travel together: dequantised rows equal the source's dequantised rows
        srcs = handle[3]
        rpm = handle[0][:, g.rank]
        starts = np.concatenate([[0], rpm[:-1]])
        for src_rank in range(num_ranks):
            rng2 = np.random.default_rng([7, src_rank])
            make_case(7, src_rank, num_ranks, n=10, hidden=256)
            q2, s2 = quant.fp8_cast_per_128(rng2.normal(size=(10, 256)).astype(np.float32))
            sl = slice(starts[src_rank], rpm[src_rank])
            np.testing.assert_array_equal(recv_x[sl].view(np.uint8), q2[srcs[sl]].view(np.uint8))
            np.testing.assert_array_equal(recv_s[sl], s2[srcs[sl]])
        return True

    assert all(run_ranks(num_ranks, fn))


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_dispatch_num_worst_tokens_and_combine(num_ranks):
    e_local = 2

    def fn(g):
        x, topk, w = make_case(3, g.rank, num_ranks, n=9, e_local=e_local)
        b = backend(g)
        plain = normal_dispatch(b, x, topk, w, e_local * num_ranks)
        worst = num_ranks * 9 + 2
        rx, _, rtk, rtw, lst, handle = normal_dispatch(b, x, topk, w, e_local * num_ranks, worst=worst)
        n_real = plain[0].shape[0]
        assert lst == []
        assert rx.shape == (worst, 128) and rtk.shape == (worst, topk.shape[1]) and handle[3].shape == (worst,)
        np.testing.assert_array_equal(rx[:n_real].astype(np.float32), plain[0].astype(np.float32))
        assert not rx[n_real:].astype(np.float32).any()
        assert (rtk[n_real:] == -1).all() and not rtw[n_real:].any() and (handle[3][n_real:] == -1).all()
        np.testing.assert_array_equal(rtk[:n_real], plain[2])
        # padding rows of x are ignored by the combine
        rx_garbage = rx.copy()
        rx_garbage[n_real:] = 99
        comb, _ = b.combine(rx_garbage, handle, topk_weights=None, bias_0=None, bias_1=None)
        fan_out = brute_layout(topk, e_local * num_ranks, num_ranks, num_ranks)[3].sum(1)
        np.testing.assert_array_equal(comb.astype(np.float32), x.astype(np.float32) * fan_out[:, None])
        if g.rank == 0:
            with pytest.raises(ValueError):
                normal.dispatch(_Solo(), x, None, handle=None, is_token_in_rank=np.ones((9, 1), bool),
                                num_tokens_per_expert=np.zeros(2, np.int32), topk_idx=None, topk_weights=None,
                                expert_alignment=1, num_worst_tokens=3, num_channels=2)
        return True

    assert all(run_ranks(num_ranks, fn))


class _Solo:
    rank, size = 0, 1

    def allgather_object(self, obj):
        return [obj]

    def alltoall_object(self, objs):
        return list(objs)

    def barrier(self):
        pass


def test_rank_receiving_nothing():
    num_ranks, e_local = 3, 2

    def fn(g):
        x, topk, w = make_case(9, g.rank, num_ranks, n=8, e_local=e_local, only_ranks={0, 2})
        b = backend(g)
        rx, _, rtk, rtw, lst, handle = normal_dispatch(b, x, topk, w, e_local * num_ranks)
        if g.rank == 1:
            assert rx.shape == (0, 128) and rtk.shape == (0, 3) and lst == [0, 0]
            assert (handle[0][:, 1] == 0).all()
        comb, cw = b.combine(rx, handle, topk_weights=rtw, bias_0=None, bias_1=None)
        fan_out = brute_layout(topk, e_local * num_ranks, num_ranks, num_ranks)[3].sum(1)
        np.testing.assert_array_equal(comb.astype(np.float32), x.astype(np.float32) * fan_out[:, None])
        np.testing.assert_array_equal(cw, np.where(topk >= 0, w, 0))
        return True

    assert all(run_ranks(num_ranks, fn))


# ------------------------------------------------------------------------------------------ combine
@pytest.mark.parametrize("num_ranks", RANKS)
@pytest.mark.parametrize("with_bias", [0, 1, 2])
def test_combine_sums_rows_from_ranks(num_ranks, with_bias):
    e_local = 2
    sizes = [13, 0, 6, 20]

    def fn(g):
        n = sizes[g.rank] if num_ranks > 1 else 13
        x, topk, w = make_case(21, g.rank, num_ranks, n=n, e_local=e_local)
        b = backend(g)
        rx, _, rtk, rtw, _, handle = normal_dispatch(b, x, topk, w, e_local * num_ranks)
        # rank r multiplies what it received by (r + 1): the combine must bring each row back from r
        y = (rx.astype(np.float32) * (g.rank + 1)).astype(BF16)
        rng = np.random.default_rng([99, g.rank])
        biases = [rng.integers(-4, 5, x.shape).astype(np.float32).astype(BF16) for _ in range(with_bias)]
        biases += [None] * (2 - with_bias)
        comb, cw = b.combine(y, handle, topk_weights=rtw, bias_0=biases[0], bias_1=biases[1])
        in_rank = brute_layout(topk, e_local * num_ranks, num_ranks, num_ranks)[3]
        factor = (in_rank * (np.arange(num_ranks) + 1)).sum(1)
        want = x.astype(np.float32) * factor[:, None]
        for bias in biases:
            if bias is not None:
                want = want + bias.astype(np.float32)
        assert comb.dtype == BF16 and comb.shape == x.shape
        np.testing.assert_array_equal(comb.astype(np.float32), want)
        assert cw.dtype == np.float32
        np.testing.assert_array_equal(cw, np.where(topk >= 0, w, 0))
        none_w = b.combine(y, handle, topk_weights=None, bias_0=None, bias_1=None)[1]
        assert none_w is None
        return True

    assert all(run_ranks(num_ranks, fn))


def test_combine_rounds_float32_sum_once():
    """Non-integer data: float32 rank-ordered sum, one rounding to bf16 at the end."""
    num_ranks = 3

    def fn(g):
        rng = np.random.default_rng([31, g.rank])
        n, h = 6, 128
        topk = np.tile(np.arange(num_ranks, dtype=np.int64), (n, 1))  # every token to every rank
        x = rng.normal(size=(n, h)).astype(BF16)
        b = backend(g)
        rx, _, _, _, _, handle = normal_dispatch(b, x, topk, None, num_ranks)
        y = (rx.astype(np.float32) * np.float32(1.0 + 0.37 * g.rank)).astype(BF16)
        comb, _ = b.combine(y, handle, topk_weights=None, bias_0=None, bias_1=None)
        acc = np.zeros((n, h), np.float32)
        for r in range(num_ranks):
            acc = acc + (x.astype(np.float32) * np.float32(1.0 + 0.37 * r)).astype(BF16).astype(np.float32)
        np.testing.assert_array_equal(comb.view(np.uint16), acc.astype(BF16).view(np.uint16))
        return True

    assert all(run_ranks(num_ranks, fn))


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


"""Reference backend semantics of the normal ops in one process: a group of size 1 and thread-ranks
(R = 1..4); the low-latency ops are in test_reference_single_low_latency.py.

Every rank derives all ranks' inputs from the same seeds, so each expectation is computed independently
by plain loops over every rank's data (tests/helpers/reference_cases.py, shared with tests/mpi).
"""

import ml_dtypes
import numpy as np
import pytest
from reference_cases import (
    brute_layout,
    expected_dispatch,
    expected_send_side,
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


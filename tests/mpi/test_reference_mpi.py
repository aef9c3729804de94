"""Reference backend across real processes: ``mpiexec -n 2|4 python -m pytest tests/mpi -q``.

Every rank runs this file. Each test performs all of its collective calls first and checks afterwards,
so a failed check on one rank cannot leave the others waiting. Expectations come from the plain-loop
helpers of ``tests/helpers/reference_cases.py`` over every rank's inputs (each rank rebuilds all inputs
from the shared seeds).
"""

import ml_dtypes
import numpy as np
import pytest
from reference_cases import (
    apply_experts,
    brute_layout,
    expected_dispatch,
    expected_ll_combine,
    expected_send_side,
    ll_combine,
    ll_dispatch,
    ll_expected,
    make_case,
)

from deepep_cupy.reference import ReferenceOracle, quant

MPI = pytest.importorskip("mpi4py.MPI")
COMM = MPI.COMM_WORLD

pytestmark = pytest.mark.skipif(COMM.Get_size() < 2, reason="run under mpiexec with at least 2 ranks")

try:
    from deepep_cupy.device.group import MPIGroup
except ImportError:  # the runtime package is optional for this file
    class MPIGroup:
        def __init__(self, comm):
            self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()

        def allgather_object(self, obj):
            return self.comm.allgather(obj)

        def alltoall_object(self, objs):
            return self.comm.alltoall(objs)

        def barrier(self):
            self.comm.Barrier()


BF16 = ml_dtypes.bfloat16
SIZES = [10, 0, 7, 12]


@pytest.fixture
def group():
    g = MPIGroup(COMM)
    yield g
    COMM.Barrier()


def _n(rank):
    return SIZES[rank % len(SIZES)]


def _f32(a):
    return a.astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1])
def test_layout_dispatch_combine(group, seed):
    me, nranks, e_local, channels = group.rank, group.size, 2, 3
    cases = [make_case(seed, r, nranks, n=_n(r), e_local=e_local) for r in range(nranks)]
    x, topk, w = cases[me]
    # The layout with one rank per domain (per-domain counts); the exchange within one domain (the 6-tuple handle).
    layout = ReferenceOracle(group, num_nvl_ranks=1, low_latency_mode=False,
                              enable_shrink=False).get_dispatch_layout(topk, e_local * nranks)
    b = ReferenceOracle(group, num_nvl_ranks=nranks, low_latency_mode=False, enable_shrink=False,
                         num_channels=channels)
    recv_x, _, recv_tk, recv_tw, lst, handle = b.dispatch(
        x, None, handle=None, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
        num_tokens_per_expert=layout[2], topk_idx=topk, topk_weights=w, expert_alignment=2, num_worst_tokens=0)
    y = (_f32(recv_x) * (me + 1)).astype(BF16)
    bias = np.full(x.shape, 3, BF16)
    comb, comb_w = b.combine(y, handle, topk_weights=recv_tw, bias_0=bias, bias_1=None)
    cached = b.dispatch(x, None, handle=handle, num_tokens_per_rank=None, is_token_in_rank=None,
                        num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1,
                        num_worst_tokens=0)
    worst = b.dispatch(x, None, handle=None, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                       num_tokens_per_expert=layout[2], topk_idx=topk, topk_weights=w, expert_alignment=1,
                       num_worst_tokens=nranks * max(SIZES))
    worst_comb, _ = b.combine(worst[0], worst[5], topk_weights=None, bias_0=None, bias_1=None)

    want_layout = brute_layout(topk, e_local * nranks, nranks, 1)
    np.testing.assert_array_equal(layout[0], want_layout[0])
    np.testing.assert_array_equal(layout[1], want_layout[1])
    np.testing.assert_array_equal(layout[2], want_layout[2])
    rows, src, tk, tw, rank_prefix, per_expert, recv_cpm = expected_dispatch(me, cases, e_local, channels)
    assert recv_x.shape == (len(rows), 128)
    if rows:
        np.testing.assert_array_equal(_f32(recv_x), np.array(rows, np.float32))
        np.testing.assert_array_equal(recv_tk, np.array(tk))
        np.testing.assert_array_equal(recv_tw, np.array(tw, np.float32))
    assert lst == [-(-c // 2) * 2 for c in per_expert]
    np.testing.assert_array_equal(handle[0], rank_prefix)
    np.testing.assert_array_equal(handle[2], recv_cpm)
    np.testing.assert_array_equal(handle[3], np.array(src, np.int64))
    want_cpm, want_head = expected_send_side(x, topk, e_local, nranks, channels)
    np.testing.assert_array_equal(handle[1], want_cpm)
    np.testing.assert_array_equal(handle[5], want_head)
    in_rank = want_layout[3]
    factor = (in_rank * (np.arange(nranks) + 1)).sum(1)
    np.testing.assert_array_equal(_f32(comb), _f32(x) * factor[:, None] + 3)
    np.testing.assert_array_equal(comb_w, np.where(topk >= 0, w, 0))
    np.testing.assert_array_equal(_f32(cached[0]), _f32(recv_x))
    assert cached[2] is None and cached[3] is None
    assert worst[4] == [] and worst[0].shape[0] == nranks * max(SIZES)
    np.testing.assert_array_equal(_f32(worst[0][:len(rows)]), _f32(recv_x))
    assert (worst[2][len(rows):] == -1).all()
    np.testing.assert_array_equal(_f32(worst_comb), _f32(x) * in_rank.sum(1)[:, None])


def test_dispatch_fp8(group):
    me, nranks = group.rank, group.size
    data = []
    for r in range(nranks):
        _, topk_r, _ = make_case(3, r, nranks, n=_n(r), hidden=256)
        x_r = np.random.default_rng([3, r]).normal(size=(_n(r), 256)).astype(np.float32)
        data.append((quant.fp8_cast_per_128(x_r), topk_r))
    (q, s), topk = data[me]
    b = ReferenceOracle(group, num_nvl_ranks=nranks, low_latency_mode=False, enable_shrink=False)
    layout = b.get_dispatch_layout(topk, 2 * nranks)
    recv_q, recv_s, _, _, _, handle = b.dispatch(
        q, np.asfortranarray(s), handle=None, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
        num_tokens_per_expert=layout[2], topk_idx=topk, topk_weights=None, expert_alignment=1, num_worst_tokens=0)

    assert recv_q.dtype == ml_dtypes.float8_e4m3fn and recv_s.flags.c_contiguous
    ends = handle[0][:, me]
    for src in range(nranks):
        sl = slice(ends[src - 1] if src else 0, ends[src])
        (q2, s2), _ = data[src]
        np.testing.assert_array_equal(recv_q[sl].view(np.uint8), q2[handle[3][sl]].view(np.uint8))
        np.testing.assert_array_equal(recv_s[sl], s2[handle[3][sl]])


def _ll(group, shrink=False):
    return ReferenceOracle(group, num_nvl_ranks=group.size, low_latency_mode=True, enable_shrink=shrink)


@pytest.mark.parametrize("seed", [0, 1])
def test_low_latency_roundtrip(group, seed):
    me, nranks, e_local = group.rank, group.size, 3
    cases = [make_case(seed, r, nranks, n=_n(r), e_local=e_local, k=4, hidden=256) for r in range(nranks)]
    x, topk, w = cases[me]
    b = _ll(group)
    stats = np.zeros(e_local, np.int32)
    recv_x, count, handle, _ = ll_dispatch(b, x, topk, e_local * nranks, cumulative_local_expert_recv_stats=stats)
    hx, hcount, _, hook = ll_dispatch(b, x, topk, e_local * nranks, return_recv_hook=True)
    poisoned = bool(np.isnan(_f32(hx)).all() and (hcount == -1).all())
    hook()
    y = apply_experts(me, recv_x, e_local)
    combined, _ = ll_combine(b, y, topk, w, handle)
    buf = b.get_next_low_latency_combine_buffer(handle)
    buf[...] = y
    zc, _ = ll_combine(b, None, topk, w, handle, zero_copy=True)
    lf, lhook = ll_combine(b, y, topk, w, handle, use_logfmt=True, return_recv_hook=True)
    lhook()

    slabs = ll_expected(me, cases, e_local)
    np.testing.assert_array_equal(count, [len(sl) for sl in slabs])
    np.testing.assert_array_equal(stats, count)
    for i in range(e_local):
        for row, (src, t) in enumerate(slabs[i]):
            np.testing.assert_array_equal(_f32(recv_x[i, row]), _f32(cases[src][0][t]))
            assert handle[0][i, row] == t
    assert poisoned
    np.testing.assert_array_equal(_f32(hx), _f32(recv_x))
    np.testing.assert_array_equal(hcount, count)
    want = expected_ll_combine(x, topk, w, e_local)
    np.testing.assert_array_equal(_f32(combined), _f32(want.astype(np.float32).astype(BF16)))
    np.testing.assert_array_equal(zc.view(np.uint16), combined.view(np.uint16))
    np.testing.assert_allclose(_f32(lf), _f32(combined), rtol=0.03, atol=0.03)


@pytest.mark.parametrize("mode", ["fp8", "ue8m0"])
def test_low_latency_fp8(group, mode):
    me, nranks, e_local, hidden = group.rank, group.size, 2, 512
    cases = []
    for r in range(nranks):
        _, topk_r, w_r = make_case(5, r, nranks, n=_n(r), e_local=e_local, hidden=hidden)
        x_r = np.random.default_rng([5, r]).normal(size=(_n(r), hidden)).astype(BF16)
        cases.append((x_r, topk_r, w_r))
    x, topk, _ = cases[me]
    b = _ll(group)
    (q, s), count, handle, _ = ll_dispatch(b, x, topk, e_local * nranks, use_fp8=True,
                                             use_ue8m0=(mode == "ue8m0"))

    assert s.transpose(0, 2, 1).flags.c_contiguous
    scales = quant.ue8m0_to_scale(quant.unpack_ue8m0(s, hidden // 128)) if mode == "ue8m0" else s
    slabs = ll_expected(me, cases, e_local)
    for i in range(e_local):
        assert count[i] == len(slabs[i])
        for row, (src, t) in enumerate(slabs[i]):
            want_q, want_s = quant.fp8_cast_per_128(cases[src][0][t:t + 1], use_ue8m0=(mode == "ue8m0"))
            np.testing.assert_array_equal(q[i, row].view(np.uint8), want_q[0].view(np.uint8))
            np.testing.assert_array_equal(scales[i, row], want_s[0])


def test_low_latency_masking(group):
    me, nranks, e_local = group.rank, group.size, 2
    victim = nranks - 1
    cases = [make_case(7, r, nranks, n=_n(r), e_local=e_local) for r in range(nranks)]
    x, topk, w = cases[me]
    b = _ll(group, shrink=True)
    b.low_latency_update_mask_buffer(victim, True)
    status = np.zeros(nranks, np.int32)
    b.low_latency_query_mask_buffer(status)
    recv_x, count, handle, _ = ll_dispatch(b, x, topk, e_local * nranks)
    combined, _ = ll_combine(b, apply_experts(me, recv_x, e_local), topk, w, handle)
    b.low_latency_clean_mask_buffer()
    _, count_after, _, _ = ll_dispatch(b, x, topk, e_local * nranks)

    np.testing.assert_array_equal(status, np.arange(nranks) == victim)
    np.testing.assert_array_equal(count, [len(sl) for sl in ll_expected(me, cases, e_local, masked={victim})])
    want = expected_ll_combine(x, topk, w, e_local, masked={victim}, me=me)
    np.testing.assert_array_equal(_f32(combined), _f32(want.astype(np.float32).astype(BF16)))
    np.testing.assert_array_equal(count_after, [len(sl) for sl in ll_expected(me, cases, e_local)])

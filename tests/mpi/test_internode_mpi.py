"""Several NVLink domains on the reference backend: ``mpiexec -n 2|4|8 python -m pytest tests/mpi -q``.

Each test runs the same data through a ``Buffer`` whose group is one NVLink domain and through ``Buffer``s
with domains of 1, 2 and 4 ranks (those that give more than one domain at this size), and checks the results
against the single-domain ones, and the internode handle against plain loops over every rank's
routing (each rank rebuilds every rank's inputs from the shared seeds). The combine is the single-domain one
for domains of one; with larger domains each domain's partial sum is rounded first (checked by plain loops).
All collective calls come first.
"""

import ml_dtypes
import numpy as np
import pytest
from reference_cases import brute_layout, make_case

from deepep_cupy import Buffer
from deepep_cupy.reference import quant

MPI = pytest.importorskip("mpi4py.MPI")
COMM = MPI.COMM_WORLD
# Buffer sizes: the reference backend allocates nothing, but refuses what the GPU would (ops/limits.py).
NVL_BYTES = RDMA_BYTES = 1 << 28
SIZE = COMM.Get_size()

pytestmark = pytest.mark.skipif(SIZE < 2, reason="run under mpiexec with at least 2 ranks")

BF16 = ml_dtypes.bfloat16
SIZES = [9, 0, 14, 5, 11, 3, 8, 1]
E_LOCAL = 2
DOMAINS = [d for d in (1, 2, 4) if SIZE % d == 0 and d < SIZE]


def _f32(a):
    return np.asarray(a).astype(np.float32)


def _cases(seed, hidden=128):
    return [make_case(seed, r, SIZE, n=SIZES[r % len(SIZES)], hidden=hidden, e_local=E_LOCAL)
            for r in range(SIZE)]


def _buffer(nvl):
    return Buffer(comm=COMM, backend="reference", num_nvl_ranks=nvl, num_nvl_bytes=NVL_BYTES,
                  num_rdma_bytes=RDMA_BYTES)


def _run(buf, x, topk, w, *, worst=0, bias=None):
    """Layout, dispatch, combine (x scaled by (rank + 1) / 3) and a cached dispatch, all collective."""
    me = COMM.Get_rank()
    layout = buf.get_dispatch_layout(topk, E_LOCAL * SIZE)
    recv_x, recv_tk, recv_tw, lst, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1], is_token_in_rank=layout[3],
        num_tokens_per_expert=layout[2], topk_idx=topk, topk_weights=w, expert_alignment=2, num_worst_tokens=worst)
    y = (_f32(recv_x) * ((me + 1) / 3)).astype(BF16)  # thirds: sums that round differently per domain
    comb, comb_w, _ = buf.combine(y, handle, topk_weights=recv_tw, bias=bias)
    cached = buf.dispatch(x, handle=handle)[0]
    return dict(layout=layout, recv_x=recv_x, tk=recv_tk, tw=recv_tw, lst=lst, handle=handle, comb=comb,
                comb_w=comb_w, cached=cached)


def _expected_combine(x, in_rank, nvl, bias):
    """The combine of ``_run`` on this rank's tokens (``bias`` or None) by plain loops: rank r returns token t scaled by (r + 1) / 3
    (in bf16); a domain's rows of a token are summed in float32 and rounded (its forwarder's partial, one row per
    token across domains: exact for domains of one), and the source adds the partials to the bias in float32,
    in domain order, and rounds once."""
    acc = np.zeros(np.shape(x), np.float32) if bias is None else _f32(bias).copy()
    for d in range(0, SIZE, nvl):
        part = np.zeros_like(acc)
        for r in range(d, d + nvl):
            got = in_rank[:, r]
            part[got] += _f32((_f32(x) * ((r + 1) / 3)).astype(BF16))[got]
        reached = in_rank[:, d:d + nvl].any(1)
        acc[reached] += _f32(part[reached].astype(BF16))
    return acc.astype(BF16)


def _channel(t, n, c):
    return t // -(-n // c)


def _expected_handle(me, in_ranks, nvl, channels):
    """The internode handle of rank ``me``, by plain loops over every rank's ``is_token_in_rank``."""
    ndom, dom, local = SIZE // nvl, me // nvl, me % nvl
    reach = [ir.reshape(ir.shape[0], ndom, nvl) for ir in in_ranks]
    mine, n = reach[me], in_ranks[me].shape[0]
    rdma_cpm = np.zeros((ndom, channels), np.int32)
    head = np.full((n, ndom), -1, np.int32)
    count = {}
    for t in range(n):
        c = _channel(t, n, channels)
        for d in range(ndom):
            if mine[t, d].any():
                rdma_cpm[d, c:] += 1
                head[t, d] = count.get((c, d), 0)
                count[(c, d)] = head[t, d] + 1
    recv_rdma_cpm = np.zeros((ndom, channels), np.int32)
    prefix, nvl_head, total = [], [], 0
    for d in range(ndom):
        peer = d * nvl + local
        n_p, count = in_ranks[peer].shape[0], {}
        for t in range(n_p):
            if not reach[peer][t, dom].any():
                continue
            c = _channel(t, n_p, channels)
            recv_rdma_cpm[d, c:] += 1
            total += 1
            row = []
            for j in range(nvl):
                if reach[peer][t, dom, j]:
                    row.append(count.get((c, j), 0))
                    count[(c, j)] = row[-1] + 1
                else:
                    row.append(-1)
            nvl_head.append(row)
        prefix.append(total)
    meta = [(s // nvl, sum(int(b) << j for j, b in enumerate(reach[s][t, dom])))
            for s in range(SIZE) for t in range(in_ranks[s].shape[0]) if in_ranks[s][t, me]]
    return dict(rdma_cpm=rdma_cpm, send_rdma_head=head, recv_rdma_cpm=recv_rdma_cpm,
                recv_rdma_prefix=np.array(prefix, np.int32), meta=np.array(meta, np.int32).reshape(-1, 2),
                send_nvl_head=np.array(nvl_head, np.int32).reshape(-1, nvl))


@pytest.mark.parametrize("seed", [0, 1])
def test_internode_matches_one_domain(seed):
    me = COMM.Get_rank()
    cases = _cases(seed)
    x, topk, w = cases[me]
    bias = np.full(x.shape, 2, BF16)
    flat = _run(_buffer(SIZE), x, topk, w, bias=bias)
    runs = {nvl: _run(_buffer(nvl), x, topk, w, bias=bias) for nvl in DOMAINS}

    for nvl, got in runs.items():
        in_ranks = [brute_layout(c[1], E_LOCAL * SIZE, SIZE, nvl)[3] for c in cases]
        want_layout = brute_layout(topk, E_LOCAL * SIZE, SIZE, nvl)
        np.testing.assert_array_equal(got["layout"][1], want_layout[1])  # once per domain reached
        np.testing.assert_array_equal(got["layout"][1], in_ranks[me].reshape(-1, SIZE // nvl, nvl).any(2).sum(0))
        for key in ("recv_x", "tk", "tw", "comb_w", "cached"):
            np.testing.assert_array_equal(_f32(got[key]), _f32(flat[key]), err_msg=f"{key}, domains of {nvl}")
        # The combined rows: the single-domain ones for domains of one; with larger domains each domain's
        # partial sum is rounded before the domains are added.
        want = _expected_combine(x, in_ranks[me], nvl, bias)
        np.testing.assert_array_equal(_f32(got["comb"]), _f32(want), err_msg=f"comb, domains of {nvl}")
        if nvl == 1:
            np.testing.assert_array_equal(_f32(got["comb"]), _f32(flat["comb"]))
        assert got["lst"] == flat["lst"]

        h, fh = got["handle"], flat["handle"]
        assert isinstance(h, tuple) and len(h) == 10 and len(fh) == 6
        dtypes = [np.bool_, np.int32, np.int32, np.int32, np.int32, np.int32, np.int32, np.uint8, np.int32, np.int32]
        assert [a.dtype for a in h] == [np.dtype(d) for d in dtypes]
        np.testing.assert_array_equal(h[0], in_ranks[me])
        np.testing.assert_array_equal(h[-4], fh[0][:, me])  # rows received from ranks 0..s
        np.testing.assert_array_equal(h[2], fh[1])
        starts = np.concatenate([[0], fh[0][:-1, me]])
        np.testing.assert_array_equal(h[5], fh[2] + starts[:, None])
        want = _expected_handle(me, in_ranks, nvl, h[1].shape[1])
        np.testing.assert_array_equal(h[1], want["rdma_cpm"])
        np.testing.assert_array_equal(h[3], want["recv_rdma_cpm"])
        np.testing.assert_array_equal(h[4], want["recv_rdma_prefix"])
        np.testing.assert_array_equal(h[7].view("<i4").reshape(-1, 2), want["meta"])
        np.testing.assert_array_equal(h[8], want["send_rdma_head"])
        np.testing.assert_array_equal(h[9], want["send_nvl_head"])
        assert h[9].shape[0] == h[4][-1]


def test_internode_fp8_scales_row_and_column_major():
    me = COMM.Get_rank()
    cases = _cases(5, hidden=256)
    _, topk, w = cases[me]
    xf = np.random.default_rng([5, me]).normal(size=(topk.shape[0], 256)).astype(np.float32)
    data, scales = quant.fp8_cast_per_128(xf)
    col = np.asfortranarray(scales)
    results = {}
    for nvl in [SIZE] + DOMAINS:
        buf = _buffer(nvl)
        layout = buf.get_dispatch_layout(topk, E_LOCAL * SIZE)
        kw = dict(num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1], is_token_in_rank=layout[3],
                  num_tokens_per_expert=layout[2], topk_idx=topk, topk_weights=w)
        (rx, rs), *_, handle, _ = buf.dispatch((data, scales), **kw)
        (cx, cs), *_ = buf.dispatch((data, col), **kw)
        (kx, ks), *_ = buf.dispatch((data, col), handle=handle)
        results[nvl] = (rx, rs, cx, cs, kx, ks)
    for nvl in DOMAINS:
        for a, b in zip(results[nvl], results[SIZE], strict=True):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
        rx, rs, cx, cs, kx, ks = results[nvl]
        np.testing.assert_array_equal(rs, cs)
        np.testing.assert_array_equal(rs, ks)


def test_internode_num_worst_tokens():
    me = COMM.Get_rank()
    cases = _cases(7)
    x, topk, w = cases[me]
    worst = SIZE * max(SIZES)
    flat = _run(_buffer(SIZE), x, topk, w)
    runs = {nvl: _run(_buffer(nvl), x, topk, w, worst=worst) for nvl in DOMAINS}
    num_recv = flat["recv_x"].shape[0]
    for nvl, got in runs.items():
        h = got["handle"]
        assert got["lst"] == [] and got["recv_x"].shape[0] == worst and got["cached"].shape[0] == worst
        assert h[7].shape == (worst, 8) and h[-4][-1] == num_recv
        np.testing.assert_array_equal(_f32(got["recv_x"][:num_recv]), _f32(flat["recv_x"]))
        np.testing.assert_array_equal(_f32(got["cached"][:num_recv]), _f32(flat["recv_x"]))
        assert (got["tk"][num_recv:] == -1).all() and (_f32(got["recv_x"][num_recv:]) == 0).all()
        meta = h[7].view("<i4").reshape(-1, 2)
        assert (meta[num_recv:, 0] == -1).all() and (meta[num_recv:, 1] == 0).all()
        assert h[9].shape[0] == max(worst, int(h[4][-1])) and (h[9][h[4][-1]:] == -1).all()
        in_ranks = [brute_layout(c[1], E_LOCAL * SIZE, SIZE, nvl)[3] for c in cases]
        np.testing.assert_array_equal(_f32(got["comb"]), _f32(_expected_combine(x, in_ranks[me], nvl, None)))
        np.testing.assert_array_equal(got["comb_w"], flat["comb_w"])


def test_internode_rejects_a_domain_handle():
    """A 6-tuple handle on a group of several domains (and the reverse) is refused on every rank."""
    me = COMM.Get_rank()
    x, topk, w = _cases(9)[me]
    flat, multi = _buffer(SIZE), _buffer(DOMAINS[0])
    flat_handle = _run(flat, x, topk, w)["handle"]
    multi_handle = _run(multi, x, topk, w)["handle"]
    with pytest.raises(ValueError, match="10-tuple"):
        multi.dispatch(x, handle=flat_handle)
    with pytest.raises(ValueError, match="10-tuple"):
        multi.combine(x[:0], flat_handle)
    with pytest.raises(ValueError, match="6-tuple"):
        flat.dispatch(x, handle=multi_handle)
    broken = list(multi_handle)
    broken[6] = np.zeros(SIZE + 1, np.int32)
    with pytest.raises(ValueError, match="recv_gbl_rank_prefix_sum"):
        multi.combine(np.zeros((0, 128), BF16), tuple(broken))

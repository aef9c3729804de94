"""A NumPy model of the intranode kernels' index arithmetic, on the CPU, checked against the reference.

The models (``_model_dispatch`` / ``_model_direct_dispatch`` / ``_model_combine``) follow the kernels line
by line: which slot and which output row every token takes in the ring and the direct mode, the handle
matrices the notify kernel builds, and where the combine receiver looks for each rank's row. They catch
formula mistakes that would otherwise only show on a GPU.
"""

import numpy as np
import pytest
from intranode_cases import model_inputs, reference_dispatch
from thread_group import run_ranks

from deepep_cupy.ops.intranode import buffer_map as L
from deepep_cupy.ops.intranode import engine as intranode
from deepep_cupy.reference import normal


def _model_notify(all_in_rank, all_per_expert, C, alignment):
    """What notify_dispatch_kernel computes on every rank: (rpm, cpm[rank], rcpm[rank], meta[rank])."""
    R = len(all_in_rank)
    El = all_per_expert[0].shape[0] // R
    counts = []  # counts[s][r][c]
    for s in range(R):
        n = all_in_rank[s].shape[0]
        m = np.zeros((R, C), dtype=np.int64)
        for c in range(C):
            b, e = L.channel_bounds(n, C, c)
            m[:, c] = all_in_rank[s][b:e].sum(axis=0)
        counts.append(m)
    totals = np.stack([m.sum(axis=1) for m in counts])  # [s][r]
    rpm = np.cumsum(totals, axis=0).astype(np.int32)
    cpms, rcpms, metas = [], [], []
    for me in range(R):
        cpms.append(np.cumsum(counts[me], axis=1).astype(np.int32))
        rc = np.zeros((R, C), dtype=np.int32)
        for s in range(R):
            run = 0
            for c in range(C):
                rc[s, c] = run
                run += counts[s][me][c]
        rcpms.append(rc)
        per = sum(all_per_expert[s][me * El:(me + 1) * El].astype(np.int64) for s in range(R))
        per = [(-(-int(v) // alignment)) * alignment for v in per]
        metas.append([int(rpm[R - 1, me])] + per)
    return rpm, cpms, rcpms, metas


def _channel_rows(rpm, rcpm, src, me, c, C):
    """``(first row, count)`` of the rows rank ``me`` received from ``src`` in channel ``c`` (``rcpm``: me's
    recv_channel_prefix_matrix): where the dispatch's receiver writes them and the combine's sender reads them."""
    src_begin = rpm[src - 1, me] if src > 0 else 0
    ch_begin = rcpm[src, c]
    ch_end = rcpm[src, c + 1] if c + 1 < C else rpm[src, me] - src_begin
    return src_begin + ch_begin, ch_end - ch_begin


def _model_dispatch(xs, in_ranks, topks, per_experts, C, cap, warps, own_rows_warps, alignment):
    R = len(xs)
    rpm, cpms, rcpms, metas = _model_notify(in_ranks, per_experts, C, alignment)
    El = per_experts[0].shape[0] // R
    rings = {}  # (receiver, c, sender) -> {idx: payload}
    outs = []
    for me in range(R):
        num_recv = metas[me][0]
        outs.append({"x": np.full((num_recv,) + xs[me].shape[1:], -7, xs[me].dtype),
                     "src": np.full(num_recv, -9, np.int32),
                     "topk": np.full((num_recv, topks[me].shape[1]), -5, np.int64),
                     "send_head": np.full((xs[me].shape[0], R), -3, np.int32)})
    for me in range(R):  # sender blocks
        n = xs[me].shape[0]
        for c in range(C):
            tb, te = L.channel_bounds(n, C, c)
            for dst in range(R):
                send_base = cpms[me][dst, c - 1] if c > 0 else 0
                count = 0
                for t in range(tb, te):
                    if not in_ranks[me][t, dst]:
                        outs[me]["send_head"][t, dst] = -1
                        continue
                    idx = count
                    count += 1
                    outs[me]["send_head"][t, dst] = send_base + idx
                    local = topks[me][t] - dst * El
                    mine = (topks[me][t] >= 0) & (local >= 0) & (local < El)
                    topk = np.where(mine, local, -1)
                    if dst == me:
                        out_base = (rpm[me - 1, me] if me > 0 else 0) + rcpms[me][me, c]
                        row = out_base + idx
                        outs[me]["x"][row] = xs[me][t]
                        outs[me]["src"][row] = t
                        outs[me]["topk"][row] = topk
                    else:
                        ring = rings.setdefault((dst, c, me), {})
                        assert idx not in ring
                        ring[idx] = (idx % cap, xs[me][t], t, topk)
    for me in range(R):  # receiver blocks
        for c in range(C):
            for src in range(R):
                if src == me:
                    continue
                first, n = _channel_rows(rpm, rcpms[me], src, me, c, C)
                ring = rings.get((me, c, src), {})
                assert sorted(ring) == list(range(n))
                for idx in range(n):
                    slot, data, t, topk = ring[idx]
                    assert slot == idx % cap
                    row = first + idx
                    outs[me]["x"][row] = data
                    outs[me]["src"][row] = t
                    outs[me]["topk"][row] = topk
    handles = [(rpm, cpms[me], rcpms[me], outs[me]["src"], in_ranks[me], outs[me]["send_head"]) for me in range(R)]
    return outs, metas, handles


def _model_combine(ys, handles, C):
    """combine_kernel's lookups: every rank's row for token t, summed in rank order in float32."""
    R = len(ys)
    rings = {}
    for me in range(R):  # sender blocks: rows this rank got from dst go back to dst
        rpm, cpm, rcpm, _, _, _ = handles[me]
        for c in range(C):
            for dst in range(R):
                if dst == me:
                    continue
                first, n = _channel_rows(rpm, rcpm, dst, me, c, C)
                for idx in range(n):
                    rings[(dst, c, me, idx)] = ys[me][first + idx]
    outs = []
    for me in range(R):  # receiver blocks
        rpm, cpm, rcpm, _, in_rank, send_head = handles[me]
        n = in_rank.shape[0]
        out = np.zeros((n,) + ys[me].shape[1:], np.float32)
        for c in range(C):
            tb, te = L.channel_bounds(n, C, c)
            ch_prev = [cpm[r, c - 1] if c > 0 else 0 for r in range(R)]
            ch_count = [cpm[r, c] - ch_prev[r] for r in range(R)]
            own_base = (rpm[me - 1, me] if me > 0 else 0) + rcpm[me, c]
            for t in range(tb, te):
                acc = np.zeros(ys[me].shape[1:], np.float32)
                for r in range(R):
                    head = send_head[t, r]
                    if head < 0:
                        continue
                    idx = head - ch_prev[r]
                    assert 0 <= idx < ch_count[r]
                    row = ys[me][own_base + idx] if r == me else rings.pop((me, c, r, idx))
                    acc = acc + row.astype(np.float32)
                out[t] = acc
        outs.append(out)
    assert not rings, "rows sent back that no receiver read"
    return outs


def _model_direct_dispatch(xs, in_ranks, topks, per_experts, C):
    """The direct mode of dispatch_kernel (dispatch_direct.cuh): chunk masks and prefix counts per channel and
    destination, items (chunk, destination, part) in claim order, each token written straight into its row of
    the destination's outputs."""
    R = len(xs)
    rpm, cpms, _, metas = _model_notify(in_ranks, per_experts, C, 4)
    El = per_experts[0].shape[0] // R
    run, parts = 2, 16
    outs = [{"x": np.full((metas[d][0],) + xs[d].shape[1:], -7, xs[d].dtype),
             "src": np.full(metas[d][0], -9, np.int32),
             "topk": np.full((metas[d][0], topks[d].shape[1]), -5, np.int64),
             "send_head": np.full((xs[d].shape[0], R), -3, np.int32)} for d in range(R)]
    written = [np.zeros(metas[d][0], bool) for d in range(R)]
    for me in range(R):
        n = xs[me].shape[0]
        for c in range(C):
            tb, te = L.channel_bounds(n, C, c)
            chunks = -(-(te - tb) // 32)
            mask = np.zeros((chunks, R), np.int64)
            for j in range(chunks):
                for lane in range(32):
                    t = tb + 32 * j + lane
                    for d in range(R):
                        if t < te and in_ranks[me][t, d]:
                            mask[j, d] |= 1 << lane
            popc = np.vectorize(lambda m: bin(int(m)).count("1"))(mask) if chunks else mask
            prefix = np.cumsum(popc, axis=0) - popc
            sent_before = [cpms[me][d, c - 1] if c > 0 else 0 for d in range(R)]
            row_base = [(rpm[me - 1, d] if me > 0 else 0) + sent_before[d] for d in range(R)]
            for item in range(chunks * R * parts):
                j, i, part = item // (R * parts), item // parts % R, item % parts
                d = (me + i) % R
                m, chunk = int(mask[j, d]), tb + 32 * j
                bits_set = [b for b in range(32) if m >> b & 1]
                if part == 0:
                    for lane in range(32):
                        if chunk + lane < te:
                            before = sum(1 for b in bits_set if b < lane)
                            outs[me]["send_head"][chunk + lane, d] = (
                                sent_before[d] + prefix[j, d] + before if m >> lane & 1 else -1)
                for k in range(part * run, min(len(bits_set), (part + 1) * run)):
                    t, row = chunk + bits_set[k], row_base[d] + prefix[j, d] + k
                    assert not written[d][row]
                    written[d][row] = True
                    local = topks[me][t] - d * El
                    mine = (topks[me][t] >= 0) & (local >= 0) & (local < El)
                    outs[d]["x"][row] = xs[me][t]
                    outs[d]["src"][row] = t
                    outs[d]["topk"][row] = np.where(mine, local, -1)
    assert all(w.all() for w in written)
    return outs


@pytest.mark.parametrize("R,C,n_tokens", [(2, 3, 37), (3, 2, 0), (4, 5, 23), (2, 12, 1), (8, 4, 50), (2, 1, 100)])
def test_direct_dispatch_model_matches_reference(R, C, n_tokens):
    xs, in_ranks, topks, per_experts = model_inputs(np.random.default_rng(R * 1000 + C), R, n_tokens)
    outs = _model_direct_dispatch(xs, in_ranks, topks, per_experts, C)
    refs = reference_dispatch(xs, in_ranks, topks, per_experts, C)
    for me in range(R):
        rx, _, rtopk, _, _, rhandle = refs[me]
        np.testing.assert_array_equal(outs[me]["x"], rx)
        np.testing.assert_array_equal(outs[me]["topk"], rtopk)
        np.testing.assert_array_equal(outs[me]["src"], rhandle[3])
        np.testing.assert_array_equal(outs[me]["send_head"], rhandle[5])


def test_direct_shared_bytes_and_done_words():
    assert L.direct_shared_bytes(2, 4096, 12) == 8 * 2 * 11
    assert L.direct_shared_bytes(8, 0, 12) == 8 * 8
    bmap = L.buffer_map(4, 12, 7, L.dispatch_slot(7168, 56, 8))
    assert intranode.required_bytes(bmap, dispatch=True) == bmap.end + 8 * 4 * 24
    assert intranode.required_bytes(bmap) == bmap.end
    # The dest entries of buffer_map.cuh (8 words per rank after 2R + 2 control words), then the copy flags
    # and copy-done words (R each), fit in the control area.
    for r in range(1, 9):
        assert L.ctrl_bytes(r) >= 8 * (2 * r + 2 + 8 * r + 2 * r)
        assert L.copy_flag_offset(r, 0) == 8 * (2 * r + 2 + 8 * r)
        assert L.copy_flag_offset(r, r - 1) + 8 + 8 * r <= L.ctrl_bytes(r)


@pytest.mark.parametrize("R,C,n_tokens,cap", [(2, 3, 37, 4), (3, 2, 0, 2), (4, 5, 23, 1), (2, 12, 1, 8),
                                              (8, 4, 50, 3)])
def test_kernel_index_model_matches_reference(R, C, n_tokens, cap):
    rng = np.random.default_rng(R * 100 + C)
    xs, in_ranks, topks, per_experts = model_inputs(rng, R, n_tokens, skew=True)
    outs, metas, handles = _model_dispatch(xs, in_ranks, topks, per_experts, C, cap, 24, 12, alignment=4)
    refs = reference_dispatch(xs, in_ranks, topks, per_experts, C)
    for me in range(R):
        rx, _, rtopk, _, rlist, rhandle = refs[me]
        np.testing.assert_array_equal(outs[me]["x"], rx)
        np.testing.assert_array_equal(outs[me]["topk"], rtopk)
        assert metas[me][1:] == rlist and metas[me][0] == rx.shape[0]
        for k in range(6):
            np.testing.assert_array_equal(handles[me][k], rhandle[k], err_msg=f"handle[{k}] rank {me}")

    ys = [rng.standard_normal(outs[me]["x"].shape).astype(np.float32) for me in range(R)]
    combined = _model_combine(ys, handles, C)

    def ref_combine(group):
        me = group.rank
        return normal.combine(group, ys[me], refs[me][5], topk_weights=None, bias_0=None, bias_1=None)

    ref_c = run_ranks(R, ref_combine)
    for me in range(R):
        np.testing.assert_array_equal(combined[me], ref_c[me][0])

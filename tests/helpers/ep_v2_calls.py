"""DeepEP V2's test call sequence (2.1's ``tests/elastic/test_ep.py``, 2.5's ``tests/ep/test_ep.py``) on one rank,
checked against ``ep_v2_ref``.

Per mode, in V2's order: dispatch A (non-expanded), B (expanded, column-major scales), C (cached A), D (cached
B with weights and zero padding); the combine inputs built from the handles' metadata; combine A and B; then
dispatch E (with the receive stats) and the checks of handles, sizes, data and combines.
"""

from __future__ import annotations

import ep_v2_ref as R
import numpy as np
import torch

from deepep_cupy.frameworks import TensorKind, from_numpy, to_numpy

TORCH = TensorKind("torch", None)


def t(a):
    return None if a is None else from_numpy(np.ascontiguousarray(a), TORCH)


def n(a):
    return None if a is None else to_numpy(a)


def modes(version: str, defer: bool = True):
    """V2's ``enumerate_ep_modes``: 2.1 ``(do_handle_copy, alignment, fp8, bias, prev, async, alloc)``, 2.5
    the same without ``do_handle_copy`` (None)."""
    triples = [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 1), (1, 1, 1)]
    if version == "2.5" and defer:
        triples = [tr for tr in triples if tr[1]]
    copies = (1, 0) if version == "2.1" else (None,)
    for copy in copies:
        for alignment in (128, 1):
            for fp8 in (1, 0):
                for num_bias in (0, 1, 2):
                    for prev, async_, alloc in triples:
                        yield copy, alignment, fp8, num_bias, prev, async_, alloc


def launch(buffer, name, prev, async_, defer, params):
    if prev:
        params["previous_event"] = buffer.capture()
    if defer:
        ev = getattr(buffer, name)(**params, defer_epilogue=True)
        return (*ev.current_stream_wait(), ev)
    values = getattr(buffer, name)(**params)
    if async_:
        assert values[-1].current_stream_wait() is None
    return values


def split(recv_x):
    return recv_x if isinstance(recv_x, tuple) else (recv_x, None)


def run_mode(buffer, g, mode, *, seed, num_tokens, hidden, num_experts, num_topk, version, defer=False,
             do_cpu_sync=True):
    copy, alignment, fp8, num_bias, prev, async_, alloc = mode
    me, nranks = g.rank, g.size
    e_local, m = num_experts // nranks, num_tokens
    inputs = [R.rank_inputs(seed, r, num_tokens=num_tokens, hidden=hidden, num_experts=num_experts,
                            num_topk=num_topk, num_bias=num_bias) for r in range(nranks)]
    mine = inputs[me]
    ref = R.received(inputs, me, num_experts, m)
    x = (t(mine.fp8[0]), t(mine.fp8[1])) if fp8 else t(mine.x)
    topk_idx, topk_weights = t(mine.topk_idx), t(mine.topk_weights)
    bias = None if num_bias == 0 else t(mine.bias[0]) if num_bias == 1 else tuple(t(b) for b in mine.bias)
    defer = bool(defer and async_)

    dispatch_args = dict(x=x, topk_idx=topk_idx, topk_weights=topk_weights, num_sms=0, num_qps=0,
                         num_max_tokens_per_rank=m, num_experts=num_experts, expert_alignment=alignment,
                         async_with_compute_stream=bool(async_), allocate_on_comm_stream=bool(alloc),
                         do_cpu_sync=do_cpu_sync)
    if version == "2.1":
        dispatch_args["do_handle_copy"] = bool(copy)
    recv_x, recv_topk_idx, recv_topk_weights, handle, _ = launch(buffer, "dispatch", prev, async_, defer,
                                                                 dict(dispatch_args))
    expanded_x, expanded_topk_idx, expanded_w, expanded_handle, _ = launch(
        buffer, "dispatch", prev, async_, defer, dispatch_args | dict(do_expand=True, use_tma_aligned_col_major_sf=True))
    cached_args = dict(x=x, num_sms=handle.num_sms, num_qps=0, async_with_compute_stream=bool(async_),
                       allocate_on_comm_stream=bool(alloc), handle=handle)
    cached_x, cached_topk_idx, cached_w, cached_handle, _ = launch(buffer, "dispatch", prev, async_, defer,
                                                                   dict(cached_args))
    cached_ex_x, _, cached_ex_w, cached_ex_handle, _ = launch(
        buffer, "dispatch", prev, async_, defer,
        cached_args | dict(topk_weights=topk_weights, do_expand=True, use_tma_aligned_col_major_sf=True,
                           do_zero_padding=True, handle=expanded_handle))
    rows = int(n(handle.psum_num_recv_tokens_per_scaleup_rank)[-1])
    assert rows == int(n(expanded_handle.psum_num_recv_tokens_per_scaleup_rank)[-1]) == len(ref.src_global)
    psum_e = n(expanded_handle.psum_num_recv_tokens_per_expert).astype(np.int64)

    # Combine inputs from the handles' metadata (rows past the valid ones poisoned).
    meta = n(handle.recv_src_metadata)
    src = meta[:rows, 0].astype(np.int64)
    assert np.array_equal(np.sort(src), ref.src_global)
    local_topk = n(recv_topk_idx)[:rows]
    y = R.expert_outputs(src, num_topk, hidden, seed)
    combine_in = np.full((meta.shape[0], hidden), np.nan, dtype=np.float32).astype(R.BF16)
    combine_in[:rows] = R.rank_sum(y, local_topk)
    ex_meta = n(expanded_handle.recv_src_metadata)
    assert ex_meta.shape[0] == meta.shape[0]
    ex_src = ex_meta[:rows, 0].astype(np.int64)
    assert np.array_equal(np.sort(ex_src), ref.src_global)
    ex_rows = ex_meta[:rows, 2:].astype(np.int64)
    num_ex = expanded_handle.num_expanded_tokens
    ex_in = np.full((num_ex + 1, hidden), np.nan, dtype=np.float32).astype(R.BF16)
    ex_in[np.where(ex_rows >= 0, ex_rows, num_ex).ravel()] = R.expert_outputs(ex_src, num_topk, hidden, seed).reshape(-1, hidden)
    ex_in = ex_in[:num_ex]

    combine_args = dict(x=t(combine_in), topk_weights=recv_topk_weights, bias=bias, handle=handle, num_sms=0,
                        num_qps=0, async_with_compute_stream=bool(async_), allocate_on_comm_stream=bool(alloc))
    combined_x, combined_w, _ = launch(buffer, "combine", prev, async_, defer, combine_args)
    reduced_args = dict(x=t(ex_in), bias=bias, handle=expanded_handle, num_sms=0, num_qps=0,
                        async_with_compute_stream=bool(async_), allocate_on_comm_stream=bool(alloc))
    if buffer.allow_multiple_reduction:
        reduced_args["topk_weights"] = expanded_w
    reduced_x, reduced_w, _ = launch(buffer, "combine", prev, async_, defer, reduced_args)

    # Dispatch E: the receive stats (added to what the tensor held).
    stats = np.arange(e_local, dtype=np.int32) * 3 + 7
    stats_t = t(stats.copy())  # from_numpy may share the memory
    if do_cpu_sync:
        launch(buffer, "dispatch", prev, async_, defer, dispatch_args | dict(cumulative_local_expert_recv_stats=stats_t))
        assert np.array_equal(n(stats_t), stats + ref.per_expert)

    # Handles.
    if version == "2.1":
        assert (handle.topk_idx is not topk_idx) == bool(copy) and cached_handle is handle
        assert np.array_equal(n(handle.topk_idx), mine.topk_idx)
    else:
        assert handle.topk_idx is topk_idx and cached_handle.topk_idx is topk_idx
    assert cached_handle is handle and cached_ex_handle is expanded_handle
    assert expanded_topk_idx is None

    # Sizes and counts.
    counts = ref.per_expert
    assert np.array_equal(np.diff(n(handle.psum_num_recv_tokens_per_scaleup_rank), prepend=0), ref.per_source)
    assert np.array_equal(np.diff(n(handle.psum_num_recv_tokens_per_expert), prepend=0), R.align(counts, alignment))
    starts = np.concatenate([[0], R.align(psum_e[:-1], alignment)])
    assert np.array_equal(psum_e - starts, counts)
    assert np.array_equal(n(expanded_handle.num_unaligned_recv_tokens_per_expert), counts)
    if do_cpu_sync:
        assert handle.num_recv_tokens == rows
        assert handle.num_recv_tokens_per_expert_list == list(R.align(counts, alignment))
        assert num_ex == int(R.align(counts, alignment).sum())
    else:
        assert handle.num_recv_tokens == m * nranks and handle.num_recv_tokens_per_expert_list == []

    # Data: rows sorted by source, against the reference.
    order = np.argsort(src, kind="stable")
    data, sf = split(recv_x)
    want_data, want_sf = (ref.fp8 if fp8 else (ref.x, None))
    assert np.array_equal(n(data)[:rows][order].view(np.uint8), want_data.view(np.uint8))
    if fp8:
        assert np.array_equal(n(sf)[:rows][order], want_sf)
    assert np.array_equal(local_topk[order], ref.topk_idx)
    got_w = n(recv_topk_weights)[:rows][order]
    assert np.array_equal(np.where(ref.topk_idx >= 0, got_w, 0), np.where(ref.topk_idx >= 0, ref.topk_weights, 0))
    # Cached non-expanded equals A.
    cdata, csf = split(cached_x)
    assert np.array_equal(n(cdata)[:rows].view(np.uint8), n(data)[:rows].view(np.uint8))
    assert np.array_equal(n(cached_topk_idx)[:rows], n(recv_topk_idx)[:rows])
    assert np.array_equal(n(cached_handle.dst_buffer_slot_idx), n(handle.dst_buffer_slot_idx))
    # Expanded: every copy of a token equals its row, padding rows of D are zero.
    edata, esf = split(expanded_x)
    cedata, cesf = split(cached_ex_x)
    ex_order_rows = ex_rows[np.argsort(ex_src, kind="stable")]
    ex_local = np.where(ex_order_rows >= 0, 1, -1)
    assert np.array_equal(ex_local < 0, ref.topk_idx < 0)
    for j in range(num_topk):
        sel = ex_order_rows[:, j] >= 0
        r = ex_order_rows[sel, j]
        assert np.array_equal(n(edata)[r].view(np.uint8), want_data[sel].view(np.uint8))
        assert np.array_equal(n(cedata)[r].view(np.uint8), want_data[sel].view(np.uint8))
        assert np.array_equal(n(expanded_w)[r], ref.topk_weights[sel, j])
        assert np.array_equal(n(cached_ex_w)[r], ref.topk_weights[sel, j])
        if fp8:
            assert np.array_equal(n(esf)[r], want_sf[sel]) and np.array_equal(n(cesf)[r], want_sf[sel])
    if fp8:
        assert esf.stride() == (1, R.align(num_ex, 4)) and cesf.shape == (num_ex, want_sf.shape[1])
    for e in range(e_local):
        pad = slice(int(psum_e[e]), int(R.align(psum_e[e], alignment)))
        assert not n(cedata)[pad].astype(np.float32).any() and not n(cached_ex_w)[pad].any()
        if fp8:
            assert not n(cesf)[pad].any()

    # Combines, bitwise.
    y_src = R.expert_outputs(me * m + np.arange(len(mine.x)), num_topk, hidden, seed)
    want = R.combined(y_src, mine.topk_idx, e_local, mine.bias, reduce_per_rank=True)
    assert np.array_equal(n(combined_x).view(np.uint16), want.view(np.uint16))
    want_reduced = R.combined(y_src, mine.topk_idx, e_local, mine.bias,
                              reduce_per_rank=buffer.allow_multiple_reduction)
    assert np.array_equal(n(reduced_x).view(np.uint16), want_reduced.view(np.uint16))
    assert np.array_equal(n(combined_w), mine.topk_weights)
    if buffer.allow_multiple_reduction:
        assert np.array_equal(n(reduced_w), mine.topk_weights)
    else:
        assert reduced_w is None
    return True


def new_buffer(cls, g, *, num_tokens, hidden, **kw):
    return cls(g, num_max_tokens_per_rank=num_tokens, hidden=hidden, explicitly_destroy=True,
               prefer_overlap_with_compute=False, **kw)


__all__ = ["modes", "run_mode", "new_buffer", "launch", "t", "n", "torch"]

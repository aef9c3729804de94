"""DeepEP V2's test call sequence (2.1's ``tests/elastic/test_ep.py``, 2.5's ``tests/ep/test_ep.py``) on one rank,
checked against ``ep_v2_ref``.

Per mode, in V2's order: dispatch A (non-expanded), B (expanded, column-major scales), C (cached A), D (cached
B with weights and zero padding); the combine inputs built from the handles' metadata; combine A and B; then
dispatch E (with the receive stats) and the checks of handles, sizes, data and combines.

``make_calls`` makes every call of one mode and returns what ``check_calls`` checks, so that ranks of separate
processes can all finish their collective calls before any of them checks. Arrays reach the library through
``to``: torch CPU tensors (``t``) by default, NumPy arrays (``numpy``) or device tensors by the caller's choice.
"""

from __future__ import annotations

import traceback
from types import SimpleNamespace

import ep_v2_ref as R
import numpy as np

from deepep_cupy.frameworks import TensorKind, from_numpy, to_numpy

TORCH = TensorKind("torch", None)


def t(a):
    """A torch CPU tensor (it may share the NumPy array's memory)."""
    return None if a is None else from_numpy(np.ascontiguousarray(a), TORCH)


def numpy(a):
    """A NumPy copy (the library's NumPy outputs may alias its inputs; the test's arrays stay its own)."""
    return None if a is None else np.array(a)


def n(a):
    return None if a is None else to_numpy(a)


def strides(a) -> tuple:
    """Strides in elements, for torch, CuPy and NumPy arrays alike."""
    if callable(getattr(a, "stride", None)):
        return tuple(a.stride())
    return tuple(s // a.itemsize for s in a.strides)


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


def run_mode(buffer, g, mode, **kw):
    """``make_calls`` then ``check_calls``: one mode's calls, checked (AssertionError at the first difference)."""
    check_calls(make_calls(buffer, g, mode, **kw))
    return True


def combine_inputs(meta, local_topk, ex_meta, num_ex: int, *, rows: int, num_topk: int, hidden: int, seed: int):
    """The combine inputs V2's test builds from the handles' metadata, NumPy BF16: the non-expanded one (each
    valid row the per-rank sum of its token's expert outputs) and the expanded one (each (token, expert) row
    that expert's output); rows no token maps to are NaN. Also returns the rows' source indices (column 0 of
    each metadata) and the expanded rows of each top-k slot (columns 2..)."""
    src = meta[:rows, 0].astype(np.int64)
    combine_in = np.full((meta.shape[0], hidden), np.nan, dtype=np.float32).astype(R.BF16)
    combine_in[:rows] = R.rank_sum(R.expert_outputs(src, num_topk, hidden, seed), local_topk)
    ex_src = ex_meta[:rows, 0].astype(np.int64)
    ex_rows = ex_meta[:rows, 2:].astype(np.int64)
    ex_in = np.full((num_ex + 1, hidden), np.nan, dtype=np.float32).astype(R.BF16)
    ex_in[np.where(ex_rows >= 0, ex_rows, num_ex).ravel()] = R.expert_outputs(ex_src, num_topk, hidden,
                                                                              seed).reshape(-1, hidden)
    return combine_in, ex_in[:num_ex], src, ex_src, ex_rows


def make_calls(buffer, g, mode, *, seed, num_tokens, hidden, num_experts, num_topk, version, defer=False,
               do_cpu_sync=True, to=t, before=None):
    """Every call of one mode, in V2's order, on this rank (``g.rank`` of ``g.size``); returns what the checks
    need. ``before(name)``, if given, runs before each call ("dispatch A" .. "dispatch E", "combine A", "B")."""
    copy, alignment, fp8, num_bias, prev, async_, alloc = mode
    me, nranks = g.rank, g.size
    e_local, m = num_experts // nranks, num_tokens
    inputs = [R.rank_inputs(seed, r, num_tokens=num_tokens, hidden=hidden, num_experts=num_experts,
                            num_topk=num_topk, num_bias=num_bias) for r in range(nranks)]
    mine = inputs[me]
    x = (to(mine.fp8[0]), to(mine.fp8[1])) if fp8 else to(mine.x)
    topk_idx, topk_weights = to(mine.topk_idx), to(mine.topk_weights)
    bias = None if num_bias == 0 else to(mine.bias[0]) if num_bias == 1 else tuple(to(b) for b in mine.bias)
    defer = bool(defer and async_)

    def call(name, method, params):
        if before is not None:
            before(name)
        return launch(buffer, method, prev, async_, defer, params)

    dispatch_args = dict(x=x, topk_idx=topk_idx, topk_weights=topk_weights, num_sms=0, num_qps=0,
                         num_max_tokens_per_rank=m, num_experts=num_experts, expert_alignment=alignment,
                         async_with_compute_stream=bool(async_), allocate_on_comm_stream=bool(alloc),
                         do_cpu_sync=do_cpu_sync)
    if version == "2.1":
        dispatch_args["do_handle_copy"] = bool(copy)
    recv_x, recv_topk_idx, recv_topk_weights, handle, _ = call("dispatch A", "dispatch", dict(dispatch_args))
    expanded_x, expanded_topk_idx, expanded_w, expanded_handle, _ = call(
        "dispatch B", "dispatch", dispatch_args | dict(do_expand=True, use_tma_aligned_col_major_sf=True))
    cached_args = dict(x=x, num_sms=handle.num_sms, num_qps=0, async_with_compute_stream=bool(async_),
                       allocate_on_comm_stream=bool(alloc), handle=handle)
    cached_x, cached_topk_idx, cached_w, cached_handle, _ = call("dispatch C", "dispatch", dict(cached_args))
    cached_ex_x, _, cached_ex_w, cached_ex_handle, _ = call(
        "dispatch D", "dispatch",
        cached_args | dict(topk_weights=topk_weights, do_expand=True, use_tma_aligned_col_major_sf=True,
                           do_zero_padding=True, handle=expanded_handle))
    rows = int(n(handle.psum_num_recv_tokens_per_scaleup_rank)[-1])

    meta, ex_meta = n(handle.recv_src_metadata), n(expanded_handle.recv_src_metadata)
    local_topk = n(recv_topk_idx)[:rows]
    num_ex = expanded_handle.num_expanded_tokens
    combine_in, ex_in, src, ex_src, ex_rows = combine_inputs(meta, local_topk, ex_meta, num_ex, rows=rows,
                                                             num_topk=num_topk, hidden=hidden, seed=seed)

    combine_args = dict(x=to(combine_in), topk_weights=recv_topk_weights, bias=bias, handle=handle, num_sms=0,
                        num_qps=0, async_with_compute_stream=bool(async_), allocate_on_comm_stream=bool(alloc))
    combined_x, combined_w, _ = call("combine A", "combine", combine_args)
    reduced_args = dict(x=to(ex_in), bias=bias, handle=expanded_handle, num_sms=0, num_qps=0,
                        async_with_compute_stream=bool(async_), allocate_on_comm_stream=bool(alloc))
    if buffer.allow_multiple_reduction:
        reduced_args["topk_weights"] = expanded_w
    reduced_x, reduced_w, _ = call("combine B", "combine", reduced_args)

    # Dispatch E: the receive stats (added to what the tensor held).
    stats = np.arange(e_local, dtype=np.int32) * 3 + 7
    stats_t = to(stats.copy())  # from_numpy may share the memory
    if do_cpu_sync:
        call("dispatch E", "dispatch", dispatch_args | dict(cumulative_local_expert_recv_stats=stats_t))
    # Everything above, by name, for check_calls.
    return SimpleNamespace(**{k: v for k, v in locals().items() if k not in ("call", "before", "to", "buffer")},
                           allow_multiple_reduction=buffer.allow_multiple_reduction,
                           num_scaleup_ranks=buffer.num_scaleup_ranks,
                           ref=R.received(inputs, me, num_experts, m))


def check_calls(c) -> None:
    """The checks of V2's test on what ``make_calls`` returned (AssertionError at the first difference)."""
    ref, mine, rows, num_topk, alignment, fp8 = c.ref, c.mine, c.rows, c.num_topk, c.alignment, c.fp8
    handle, expanded_handle, num_ex = c.handle, c.expanded_handle, c.num_ex
    assert rows == int(n(expanded_handle.psum_num_recv_tokens_per_scaleup_rank)[-1]) == len(ref.src_global)
    psum_e = n(expanded_handle.psum_num_recv_tokens_per_expert).astype(np.int64)
    assert np.array_equal(np.sort(c.src), ref.src_global)
    assert c.ex_meta.shape[0] == c.meta.shape[0]
    assert np.array_equal(np.sort(c.ex_src), ref.src_global)
    if c.do_cpu_sync:
        assert np.array_equal(n(c.stats_t), c.stats + ref.per_expert)

    # Handles.
    if c.version == "2.1":
        assert (handle.topk_idx is not c.topk_idx) == bool(c.copy) and c.cached_handle is handle
        assert np.array_equal(n(handle.topk_idx), mine.topk_idx)
    else:
        assert handle.topk_idx is c.topk_idx and c.cached_handle.topk_idx is c.topk_idx
    assert c.cached_handle is handle and c.cached_ex_handle is expanded_handle
    assert c.expanded_topk_idx is None

    # Sizes and counts.
    counts = ref.per_expert
    # Rows per source scale-up index: per source rank in direct mode, summed over the domains in hybrid mode.
    per_scaleup = ref.per_source.reshape(-1, c.num_scaleup_ranks).sum(axis=0)
    assert np.array_equal(np.diff(n(handle.psum_num_recv_tokens_per_scaleup_rank), prepend=0), per_scaleup)
    assert np.array_equal(np.diff(n(handle.psum_num_recv_tokens_per_expert), prepend=0), R.align(counts, alignment))
    starts = np.concatenate([[0], R.align(psum_e[:-1], alignment)])
    assert np.array_equal(psum_e - starts, counts)
    assert np.array_equal(n(expanded_handle.num_unaligned_recv_tokens_per_expert), counts)
    if c.do_cpu_sync:
        assert handle.num_recv_tokens == rows
        assert handle.num_recv_tokens_per_expert_list == list(R.align(counts, alignment))
        assert num_ex == int(R.align(counts, alignment).sum())
    else:
        assert handle.num_recv_tokens == c.m * c.nranks and handle.num_recv_tokens_per_expert_list == []

    # Data: rows sorted by source, against the reference.
    order = np.argsort(c.src, kind="stable")
    data, sf = split(c.recv_x)
    want_data, want_sf = (ref.fp8 if fp8 else (ref.x, None))
    assert np.array_equal(n(data)[:rows][order].view(np.uint8), want_data.view(np.uint8))
    if fp8:
        assert np.array_equal(n(sf)[:rows][order], want_sf)
    assert np.array_equal(c.local_topk[order], ref.topk_idx)
    got_w = n(c.recv_topk_weights)[:rows][order]
    assert np.array_equal(np.where(ref.topk_idx >= 0, got_w, 0), np.where(ref.topk_idx >= 0, ref.topk_weights, 0))
    # Cached non-expanded equals A.
    cdata, _ = split(c.cached_x)
    assert np.array_equal(n(cdata)[:rows].view(np.uint8), n(data)[:rows].view(np.uint8))
    assert np.array_equal(n(c.cached_topk_idx)[:rows], n(c.recv_topk_idx)[:rows])
    assert np.array_equal(n(c.cached_handle.dst_buffer_slot_idx), n(handle.dst_buffer_slot_idx))
    # Expanded: every copy of a token equals its row, padding rows of D are zero.
    edata, esf = split(c.expanded_x)
    cedata, cesf = split(c.cached_ex_x)
    ex_order_rows = c.ex_rows[np.argsort(c.ex_src, kind="stable")]
    assert np.array_equal(ex_order_rows < 0, ref.topk_idx < 0)
    for j in range(num_topk):
        sel = ex_order_rows[:, j] >= 0
        r = ex_order_rows[sel, j]
        assert np.array_equal(n(edata)[r].view(np.uint8), want_data[sel].view(np.uint8))
        assert np.array_equal(n(cedata)[r].view(np.uint8), want_data[sel].view(np.uint8))
        assert np.array_equal(n(c.expanded_w)[r], ref.topk_weights[sel, j])
        assert np.array_equal(n(c.cached_ex_w)[r], ref.topk_weights[sel, j])
        if fp8:
            assert np.array_equal(n(esf)[r], want_sf[sel]) and np.array_equal(n(cesf)[r], want_sf[sel])
    if fp8:
        assert strides(esf) == (1, R.align(num_ex, 4)) and tuple(cesf.shape) == (num_ex, want_sf.shape[1])
    for e in range(c.e_local):
        pad = slice(int(psum_e[e]), int(R.align(psum_e[e], alignment)))
        assert not n(cedata)[pad].astype(np.float32).any() and not n(c.cached_ex_w)[pad].any()
        if fp8:
            assert not n(cesf)[pad].any()

    # Combines, bitwise.
    y_src = R.expert_outputs(c.me * c.m + np.arange(len(mine.x)), num_topk, c.hidden, c.seed)
    # Hybrid mode across domains (fewer scale-up ranks than ranks) adds the per-domain level where the ranks'
    # sums are reduced further (allow_multiple_reduction).
    hybrid = c.num_scaleup_ranks < c.nranks and c.allow_multiple_reduction
    per_domain = c.e_local * c.num_scaleup_ranks if hybrid else None
    want = R.combined(y_src, mine.topk_idx, c.e_local, mine.bias, reduce_per_rank=True, experts_per_domain=per_domain)
    assert np.array_equal(n(c.combined_x).view(np.uint16), want.view(np.uint16))
    want_reduced = R.combined(y_src, mine.topk_idx, c.e_local, mine.bias,
                              reduce_per_rank=c.allow_multiple_reduction, experts_per_domain=per_domain)
    assert np.array_equal(n(c.reduced_x).view(np.uint16), want_reduced.view(np.uint16))
    assert np.array_equal(n(c.combined_w), mine.topk_weights)
    if c.allow_multiple_reduction:
        assert np.array_equal(n(c.reduced_w), mine.topk_weights)
    else:
        assert c.reduced_w is None


def describe(exc: AssertionError) -> str:
    """Where a check of ``check_calls`` failed: its line and source (the helpers' asserts are not rewritten)."""
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return f"line {frame.lineno}: {frame.line} {exc}".rstrip()


def new_buffer(cls, g, *, num_tokens, hidden, **kw):
    return cls(g, num_max_tokens_per_rank=num_tokens, hidden=hidden, explicitly_destroy=True,
               prefer_overlap_with_compute=False, **kw)


__all__ = ["modes", "run_mode", "make_calls", "check_calls", "combine_inputs", "new_buffer", "launch", "split",
           "strides", "describe", "t", "numpy", "n"]

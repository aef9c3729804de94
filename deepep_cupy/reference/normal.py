"""Normal (high-throughput) mode of the reference backend: layout, dispatch and combine.

Notation: ``R`` ranks, ``me`` this rank, ``E`` experts, ``E_local = E // R`` experts per rank (expert
``e`` lives on rank ``e // E_local``), ``N`` tokens on this rank, ``C`` channels.

Channels: the ``N`` tokens of a rank are split among ``C`` channels in contiguous ranges of
``ceil(N / C)`` tokens (channel ``c`` covers ``[c * ceil(N/C), min((c + 1) * ceil(N/C), N))``; the last
channels may be empty). The channel matrices of the handle follow from that split.

Every function takes the ``group`` duck type (``rank``, ``size``, ``allgather_object``,
``alltoall_object``) and only exchanges Python objects holding freshly made NumPy arrays, so sender
and receiver never share memory.
"""

from __future__ import annotations

import numpy as np


def dispatch_layout(topk_idx: np.ndarray, num_experts: int, num_ranks: int, num_nvl_ranks: int):
    """Count tokens per rank, per RDMA rank (node) and per expert.

    A token counts once for every rank (and node) that holds at least one of its top-k experts;
    ``num_tokens_per_expert`` counts every ``(token, k)`` hit; ``-1`` selects nothing.
    Returns ``(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [R // nvl] int32 or None when there
    is only one node, num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool)``.
    """
    topk_idx = np.asarray(topk_idx, dtype=np.int64)
    n = topk_idx.shape[0]
    e_local = num_experts // num_ranks
    valid = topk_idx >= 0
    per_expert = np.bincount(topk_idx[valid], minlength=num_experts).astype(np.int32)
    is_token_in_rank = np.zeros((n, num_ranks), dtype=bool)
    rows, cols = np.nonzero(valid)
    is_token_in_rank[rows, topk_idx[rows, cols] // e_local] = True
    per_rank = is_token_in_rank.sum(axis=0, dtype=np.int64).astype(np.int32)
    num_rdma_ranks = num_ranks // num_nvl_ranks
    per_rdma = None
    if num_rdma_ranks > 1:
        in_node = is_token_in_rank.reshape(n, num_rdma_ranks, num_nvl_ranks).any(axis=2)
        per_rdma = in_node.sum(axis=0, dtype=np.int64).astype(np.int32)
    return per_rank, per_rdma, per_expert, is_token_in_rank


def channel_bounds(num_tokens: int, num_channels: int) -> np.ndarray:
    """End (exclusive) token index of each channel, ``[C]`` int64."""
    chunk = -(-num_tokens // num_channels) if num_tokens else 0
    return np.minimum(np.arange(1, num_channels + 1, dtype=np.int64) * chunk, num_tokens)


def channel_prefix_matrix(is_token_in_rank: np.ndarray, num_channels: int) -> np.ndarray:
    """``[R, C]`` int32: tokens sent to rank ``r`` by channels ``0..c`` (inclusive prefix)."""
    n, r = is_token_in_rank.shape
    cum = np.zeros((n + 1, r), dtype=np.int64)
    np.cumsum(is_token_in_rank, axis=0, out=cum[1:])
    return np.ascontiguousarray(cum[channel_bounds(n, num_channels)].T).astype(np.int32)


def send_head_matrix(is_token_in_rank: np.ndarray) -> np.ndarray:
    """``[N, R]`` int32: position of token ``t`` among the rows rank ``r`` receives from me, or -1."""
    pos = np.cumsum(is_token_in_rank, axis=0, dtype=np.int64) - 1
    return np.where(is_token_in_rank, pos, -1).astype(np.int32)


def _align(count: int, alignment: int) -> int:
    return -(-count // alignment) * alignment if alignment > 1 else count


def dispatch(group, x, x_scales, *, handle, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
             expert_alignment: int, num_worst_tokens: int, num_channels: int):
    """Send every token to every rank ``r`` with ``is_token_in_rank[t, r]``.

    Received rows are grouped by source rank (rank order), each group in source token order.
    ``recv_topk_idx`` holds ``e - me * E_local`` for experts of this rank and -1 elsewhere;
    ``recv_topk_weights`` the matching weight, 0.0 where -1. The per-expert list is the sum over source
    ranks of their ``num_tokens_per_expert`` entries for my experts (each source's own count of its
    ``(token, k)`` hits), each rounded up to a multiple of ``expert_alignment``.

    Cached mode (``handle`` given): routing comes from ``handle[4]``; only ``x``/``x_scales`` travel;
    the top-k outputs and the list are None and the given handle is returned unchanged.

    ``num_worst_tokens > 0``: every row output has exactly that many rows (ValueError if more were
    received); padding rows are 0 in data and scales, -1 in ``recv_topk_idx`` and ``recv_src_idx``,
    0.0 in weights; the list is ``[]``.

    Returns ``(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, list, handle)``.
    """
    me, nranks = group.rank, group.size
    cached = handle is not None
    if cached:
        is_token_in_rank = handle[4]
        topk_idx = topk_weights = None
    is_token_in_rank = np.asarray(is_token_in_rank, dtype=bool)
    scales = None if x_scales is None else np.array(x_scales, order="C")  # values, any input strides
    cpm = channel_prefix_matrix(is_token_in_rank, num_channels)
    e_local = None
    if not cached:
        if num_tokens_per_expert is None:
            raise ValueError("non-cached dispatch needs num_tokens_per_expert")
        num_tokens_per_expert = np.asarray(num_tokens_per_expert)
        e_local = num_tokens_per_expert.shape[0] // nranks

    payloads = []
    for r in range(nranks):
        idx = np.nonzero(is_token_in_rank[:, r])[0]
        p = {"x": x[idx], "src": idx.astype(np.int32), "cpm": cpm[r].copy()}
        if scales is not None:
            p["scales"] = scales[idx]
        if topk_idx is not None:
            p["topk_idx"] = np.asarray(topk_idx, dtype=np.int64)[idx]
        if topk_weights is not None:
            p["topk_weights"] = np.asarray(topk_weights, dtype=np.float32)[idx]
        if not cached:
            p["per_expert"] = num_tokens_per_expert[r * e_local:(r + 1) * e_local].astype(np.int64)
        payloads.append(p)
    got = group.alltoall_object(payloads)

    num_recv = sum(g["src"].shape[0] for g in got)
    rows = num_recv
    if num_worst_tokens > 0:
        if num_recv > num_worst_tokens:
            raise ValueError(f"rank {me} received {num_recv} tokens, more than num_worst_tokens={num_worst_tokens}")
        rows = num_worst_tokens

    def stack(key, dtype, tail, fill):
        out = np.full((rows,) + tail, fill, dtype=dtype)
        if num_recv:
            out[:num_recv] = np.concatenate([g[key] for g in got], axis=0)
        return out

    recv_x = stack("x", x.dtype, x.shape[1:], 0)
    recv_scales = None if scales is None else stack("scales", scales.dtype, scales.shape[1:], 0)
    if cached:
        return recv_x, recv_scales, None, None, None, handle

    recv_topk_idx = recv_topk_weights = None
    if topk_idx is not None:
        k = np.asarray(topk_idx).shape[1]
        glob = stack("topk_idx", np.int64, (k,), -1)
        mine = (glob >= me * e_local) & (glob < (me + 1) * e_local)
        recv_topk_idx = np.where(mine, glob - me * e_local, -1).astype(np.int64)
        if topk_weights is not None:
            w = stack("topk_weights", np.float32, (k,), 0)
            recv_topk_weights = np.where(mine, w, np.float32(0)).astype(np.float32)

    counts = group.allgather_object(is_token_in_rank.sum(axis=0, dtype=np.int64))
    rank_prefix = np.cumsum(np.stack(counts), axis=0).astype(np.int32)
    recv_cpm = np.zeros((nranks, num_channels), dtype=np.int32)
    for s, g in enumerate(got):
        recv_cpm[s, 1:] = g["cpm"][:-1]
    recv_src_idx = stack("src", np.int32, (), -1)
    new_handle = (rank_prefix, cpm, recv_cpm, recv_src_idx, is_token_in_rank.copy(),
                  send_head_matrix(is_token_in_rank))
    if num_worst_tokens > 0:
        per_expert_list = []
    else:
        total = np.sum([g["per_expert"] for g in got], axis=0, dtype=np.int64)
        per_expert_list = [_align(int(c), expert_alignment) for c in total]
    return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert_list, new_handle


def combine(group, x, handle, *, topk_weights, bias_0, bias_1):
    """Send each received row back to its source rank and sum there (no weights).

    For every original token ``t``: ``acc = float32(bias_0[t]) + float32(bias_1[t])`` (a missing bias is
    0), then for each rank ``r`` in rank order with ``is_token_in_rank[t, r]``: ``acc += float32(row r
    sends back for t)``; finally ``combined_x[t] = acc`` rounded to ``x.dtype`` (round to nearest even).
    ``combined_topk_weights`` is the same float32 rank-ordered sum of the ``topk_weights`` rows (no bias),
    None when ``topk_weights`` is None. Only the first ``rank_prefix_matrix[R-1, me]`` rows of ``x`` are
    used (``x`` may carry ``num_worst_tokens`` padding rows). Tokens sent nowhere combine to the bias.
    """
    me, nranks = group.rank, group.size
    rank_prefix, _, _, recv_src_idx, is_token_in_rank, _ = handle
    n = is_token_in_rank.shape[0]
    ends = np.asarray(rank_prefix)[:, me].astype(np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    payloads = []
    for s in range(nranks):
        b, e = int(starts[s]), int(ends[s])
        p = {"src": np.asarray(recv_src_idx[b:e], dtype=np.int64).copy(), "x": np.array(x[b:e])}
        if topk_weights is not None:
            p["w"] = np.array(topk_weights[b:e], dtype=np.float32)
        payloads.append(p)
    got = group.alltoall_object(payloads)

    acc = np.zeros((n,) + x.shape[1:], dtype=np.float32)
    if bias_0 is not None or bias_1 is not None:
        b0 = acc if bias_0 is None else np.asarray(bias_0, dtype=np.float32)
        b1 = acc if bias_1 is None else np.asarray(bias_1, dtype=np.float32)
        acc = (b0 + b1).astype(np.float32)
    acc_w = None
    if topk_weights is not None:
        acc_w = np.zeros((n, np.asarray(topk_weights).shape[1]), dtype=np.float32)
    for g in got:
        acc[g["src"]] += g["x"].astype(np.float32)
        if acc_w is not None:
            acc_w[g["src"]] += g["w"]
    return acc.astype(x.dtype), acc_w

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

from . import collective


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
    valid = (topk_idx >= 0) & (topk_idx < num_experts)  # an id out of range selects nothing (as in the kernels)
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


def _columns(a) -> str:
    return "None" if a is None else f"{np.shape(a)[1]} columns"


def _dispatch_prepare(group, x, x_scales, handle, is_token_in_rank, num_tokens_per_expert, topk_idx,
                      handle_in_rank: int = 4):
    """This rank's own checks and routing, before anything is exchanged."""
    nranks = group.size
    if handle is not None:
        is_token_in_rank = handle[handle_in_rank]
    if is_token_in_rank is None:
        raise ValueError("dispatch needs is_token_in_rank (from get_dispatch_layout) or a handle")
    is_token_in_rank = np.asarray(is_token_in_rank, dtype=bool)
    n = x.shape[0]
    if is_token_in_rank.shape != (n, nranks):
        where = f"handle[{handle_in_rank}] (is_token_in_rank)" if handle is not None else "is_token_in_rank"
        raise ValueError(f"{where} must have shape [{n}, {nranks}], got {list(is_token_in_rank.shape)}")
    e_local = None
    if handle is None:
        if num_tokens_per_expert is None:
            raise ValueError("non-cached dispatch needs num_tokens_per_expert")
        e = np.shape(num_tokens_per_expert)[0]
        if e == 0 or e % nranks:
            raise ValueError(f"num_tokens_per_expert must have one entry per expert, a positive multiple of the "
                             f"number of ranks ({nranks}); got {e} entries")
        e_local = e // nranks
        if topk_idx is not None and np.shape(topk_idx)[0] != n:
            raise ValueError(f"topk_idx must have {n} rows like x, got {np.shape(topk_idx)[0]}")
    if x_scales is not None and np.shape(x_scales)[0] != n:
        raise ValueError(f"x[1] (scales) must have {n} rows like x[0], got {np.shape(x_scales)[0]}")
    return is_token_in_rank, e_local


def _worst_overflow(counts: np.ndarray, worst: list) -> None:
    over = [(r, int(counts[:, r].sum()), w) for r, w in enumerate(worst) if w > 0 and counts[:, r].sum() > w]
    if over:
        text = "; ".join(f"rank {r} receives {got} tokens, more than its num_worst_tokens={w}" for r, got, w in over)
        raise collective.mark_agreed(ValueError(f"dispatch: {text}"))


def dispatch(group, x, x_scales, *, handle, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
             expert_alignment: int, num_worst_tokens: int, num_channels: int, handle_in_rank: int = 4,
             extra: list | None = None):
    """Send every token to every rank ``r`` with ``is_token_in_rank[t, r]``.

    Received rows are grouped by source rank (rank order), each group in source token order.
    ``recv_topk_idx`` holds ``e - me * E_local`` for experts of this rank and -1 elsewhere;
    ``recv_topk_weights`` the matching weight, 0.0 where -1. The per-expert list is the sum over source
    ranks of their ``num_tokens_per_expert`` entries for my experts (each source's own count of its
    ``(token, k)`` hits), each rounded up to a multiple of ``expert_alignment``.

    Cached mode (``handle`` given): routing comes from ``handle[4]``; only ``x``/``x_scales`` travel;
    the top-k outputs and the list are None and the given handle is returned unchanged.

    ``num_worst_tokens > 0``: every row output has exactly that many rows (a ``ValueError`` on every rank,
    before anything moves, when any rank would receive more); padding rows are 0 in data and scales, -1 in
    ``recv_topk_idx`` and ``recv_src_idx``, 0.0 in weights; the list is ``[]``.

    The ranks first exchange their token counts and the values they must agree on (``collective.start``):
    a rank's bad argument or a disagreement (hidden size, dtypes, expert count, top-k width, cached or not)
    raises on every rank.

    ``handle_in_rank``: where a cached handle holds ``is_token_in_rank`` (4 here, 0 in the internode
    handle). ``extra``: one dict per destination rank, merged into what this rank sends it; on return the
    list holds instead what every source rank sent this rank (its rows' token indices under ``"src"``).

    Returns ``(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, list, handle)``.
    """
    me, nranks = group.rank, group.size
    cached = handle is not None
    if cached:
        topk_idx = topk_weights = None
    error = fields = info = None
    try:
        is_token_in_rank, e_local = _dispatch_prepare(group, x, x_scales, handle, is_token_in_rank,
                                                      num_tokens_per_expert, topk_idx, handle_in_rank)
        fields = {"handle (a cached dispatch)": cached, "hidden": x.shape[1], "x dtype": str(x.dtype),
                  "x scales": _columns(x_scales)}
        if not cached:
            fields.update({"num_experts (entries of num_tokens_per_expert)": e_local * nranks,
                           "topk_idx": _columns(topk_idx), "topk_weights": _columns(topk_weights)})
        info = (is_token_in_rank.sum(axis=0, dtype=np.int64), int(num_worst_tokens))
    except Exception as exc:  # noqa: BLE001 - reported to every rank by start()
        error = exc
    infos = collective.start(group, "dispatch", fields=fields, error=error, info=info)
    counts = np.stack([i[0] for i in infos])  # [source, destination]
    _worst_overflow(counts, [i[1] for i in infos])

    scales = None if x_scales is None else np.array(x_scales, order="C")  # values, any input strides
    cpm = channel_prefix_matrix(is_token_in_rank, num_channels)
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
            p["per_expert"] = np.asarray(num_tokens_per_expert)[r * e_local:(r + 1) * e_local].astype(np.int64)
        if extra is not None:
            p.update(extra[r])
        payloads.append(p)
    got = collective.alltoall(group, payloads, "dispatch (data)")
    if extra is not None:
        extra[:] = got

    num_recv = int(counts[:, me].sum())
    rows = num_worst_tokens if num_worst_tokens > 0 else num_recv

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

    rank_prefix = np.cumsum(counts, axis=0).astype(np.int32)
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


def _combine_prepare(group, x, handle, topk_weights):
    """Check this rank's handle against itself (the bounds the exchange relies on); return the row range
    ``[start, end)`` of ``x`` each source rank gets back."""
    me, nranks = group.rank, group.size
    rank_prefix, _, _, recv_src_idx, is_token_in_rank, _ = handle
    rank_prefix = np.asarray(rank_prefix)
    if rank_prefix.shape != (nranks, nranks):
        raise ValueError(f"handle[0] (rank_prefix_matrix) must have shape [{nranks}, {nranks}], "
                         f"got {list(rank_prefix.shape)}")
    if np.ndim(is_token_in_rank) != 2 or np.shape(is_token_in_rank)[1] != nranks:
        raise ValueError(f"handle[4] (is_token_in_rank) must have shape [*, {nranks}], "
                         f"got {list(np.shape(is_token_in_rank))}")
    ends = rank_prefix[:, me].astype(np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    num_recv = int(ends[-1])
    rows = min(np.shape(recv_src_idx)[0], x.shape[0])
    if (starts > ends).any() or ends[0] < 0 or num_recv > rows:
        raise ValueError(f"handle[0] (rank_prefix_matrix) column {me} must rise from 0 to at most {rows} (the rows "
                         f"of x and of handle[3]), got {ends.tolist()}: the handle is not one dispatch returned")
    src = np.asarray(recv_src_idx[:num_recv], dtype=np.int64)
    if num_recv and src.min() < 0:
        raise ValueError("handle[3] (recv_src_idx) holds negative token indices among the received rows: the "
                         "handle is not one dispatch returned")
    if topk_weights is not None and np.shape(topk_weights)[0] < num_recv:
        raise ValueError(f"topk_weights must have at least {num_recv} rows, got {np.shape(topk_weights)[0]}")
    return starts, ends, np.asarray(is_token_in_rank, dtype=bool), rank_prefix


def _combine_received(got, me: int, in_rank: np.ndarray, prefix: str) -> None:
    """What each rank sent back must name exactly the tokens this rank sent it."""
    n = in_rank.shape[0]
    for r, g in enumerate(got):
        rows, sent = g["x"].shape[0], int(in_rank[:, r].sum())
        if rows != sent:
            raise ValueError(f"rank {r} returned {rows} rows for rank {me}, which sent it {sent} tokens: "
                             f"{prefix} of rank {r} does not match this rank's handle")
        src = g.get("src")
        if src is not None and src.size and (src.min() < 0 or src.max() >= n):
            raise ValueError(f"handle[3] (recv_src_idx) of rank {r} names token {int(src.max())} of rank {me}, "
                             f"which has {n} tokens: the handle is not one dispatch returned")


def combine(group, x, handle, *, topk_weights, bias_0, bias_1, order=None):
    """Send each received row back to its source rank and sum there (no weights).

    For every original token ``t``: ``acc = float32(bias_0[t]) + float32(bias_1[t])`` (a missing bias is
    0), then for each rank ``r`` in rank order with ``is_token_in_rank[t, r]``: ``acc += float32(row r
    sends back for t)``; finally ``combined_x[t] = acc`` rounded to ``x.dtype`` (round to nearest even).
    ``combined_topk_weights`` is the same float32 rank-ordered sum of the ``topk_weights`` rows (no bias),
    None when ``topk_weights`` is None. Only the first ``rank_prefix_matrix[R-1, me]`` rows of ``x`` are
    used (``x`` may carry ``num_worst_tokens`` padding rows). Tokens sent nowhere combine to the bias.

    ``order``: ``(topk_idx, num_local_experts)`` of the source tokens, for V2's order instead of rank order:
    the rows of token ``t`` are added in the order of each rank's last top-k slot of ``t`` (the slot ``j``
    with ``topk_idx[t, j] // num_local_experts == r``), a rank named by no slot after all slots, in rank order.

    A handle that does not describe what the ranks exchanged (another call's, or altered) raises a
    ``ValueError`` on every rank, before or right after the exchange (``collective.start``/``finish``).
    """
    error = fields = starts = ends = in_rank = None
    try:
        starts, ends, in_rank, rank_prefix = _combine_prepare(group, x, handle, topk_weights)
        fields = {"handle[0] (rank_prefix_matrix)": tuple(map(tuple, rank_prefix.tolist()))}
    except Exception as exc:  # noqa: BLE001 - reported to every rank by start()
        error = exc
    return combine_rows(group, x, starts, ends, in_rank, handle[3], topk_weights=topk_weights, bias_0=bias_0,
                        bias_1=bias_1, fields=fields, error=error, prefix="handle[0] (rank_prefix_matrix)",
                        order=order)


def combine_rows(group, x, starts, ends, in_rank, recv_src_idx, *, topk_weights, bias_0, bias_1, fields, error,
                 prefix, domain_size: int = 1, order=None):
    """``combine`` once the handle is read: rows ``[starts[s], ends[s])`` of ``x`` go back to rank ``s``.

    ``recv_src_idx`` names each row's source token; None: the source places the rows from rank ``r`` on its
    tokens with ``in_rank[:, r]``, in token order (the order dispatch delivered them in). ``fields`` (values
    every rank must agree on besides hidden size, dtype and top-k width) and ``error`` (what this rank found
    wrong so far) go to ``collective.start``; ``prefix`` names the handle entry the row ranges come from.
    ``domain_size`` > 1: the rows of each domain's ranks are first summed per token (float32, rank order) and
    rounded to ``x``'s dtype, as the domain's forwarder sends one row per token across domains; the source sums
    those (and the weights' per-domain float32 sums) in domain order.
    """
    me, nranks = group.rank, group.size
    if error is None:
        fields = {"hidden": tuple(x.shape[1:]), "x dtype": str(x.dtype), "topk_weights": _columns(topk_weights),
                  **(fields or {})}
    collective.start(group, "combine", fields=fields, error=error)
    payloads = []
    for s in range(nranks):
        b, e = int(starts[s]), int(ends[s])
        p = {"x": np.array(x[b:e])}
        if recv_src_idx is not None:
            p["src"] = np.asarray(recv_src_idx[b:e], dtype=np.int64).copy()
        if topk_weights is not None:
            p["w"] = np.array(topk_weights[b:e], dtype=np.float32)
        payloads.append(p)
    got = collective.alltoall(group, payloads, "combine (data)")
    error = None
    try:
        _combine_received(got, me, in_rank, prefix)
    except ValueError as exc:
        error = exc
    collective.finish(group, "combine", error)
    for r, g in enumerate(got):
        if "src" not in g:
            g["src"] = np.nonzero(in_rank[:, r])[0]

    n = in_rank.shape[0]
    acc = np.zeros((n,) + x.shape[1:], dtype=np.float32)
    if bias_0 is not None or bias_1 is not None:
        b0 = acc if bias_0 is None else np.asarray(bias_0, dtype=np.float32)
        b1 = acc if bias_1 is None else np.asarray(bias_1, dtype=np.float32)
        acc = (b0 + b1).astype(np.float32)
    acc_w = None
    if topk_weights is not None:
        acc_w = np.zeros((n, np.asarray(topk_weights).shape[1]), dtype=np.float32)
    if order is not None:
        return _sum_in_order(got, acc, acc_w, order, x.dtype)
    for d in range(0, nranks, domain_size):
        part, part_w, reached = acc, acc_w, None
        if domain_size > 1:
            part = np.zeros_like(acc)
            part_w = None if acc_w is None else np.zeros_like(acc_w)
            reached = np.zeros(n, dtype=bool)
        for g in got[d:d + domain_size]:
            part[g["src"]] += g["x"].astype(np.float32)
            if part_w is not None:
                part_w[g["src"]] += g["w"]
            if reached is not None:
                reached[g["src"]] = True
        if reached is not None:
            acc[reached] += part[reached].astype(x.dtype).astype(np.float32)
            if acc_w is not None:
                acc_w[reached] += part_w[reached]
    return acc.astype(x.dtype), acc_w


def _sum_in_order(got, acc, acc_w, order, dtype):
    """``combine_rows``'s sums in the order ``order`` names (see ``combine``); the weights as in rank order (a
    slot's weight is nonzero on one rank only, so its sum does not depend on the order)."""
    topk_idx, num_local_experts = order
    n, nranks = acc.shape[0], len(got)
    topk_idx = np.asarray(topk_idx, dtype=np.int64).reshape(n, -1)
    k = topk_idx.shape[1]
    key = np.tile(k + np.arange(nranks), (n, 1))
    for j in range(k):
        owner = np.where(topk_idx[:, j] >= 0, topk_idx[:, j] // max(int(num_local_experts), 1), -1)
        for r in range(nranks):
            key[owner == r, r] = j
    present = np.zeros((nranks, n), dtype=bool)
    rows = np.zeros((nranks,) + acc.shape, dtype=np.float32)
    for r, g in enumerate(got):
        present[r, g["src"]] = True
        rows[r, g["src"]] = g["x"].astype(np.float32)
        if acc_w is not None:
            acc_w[g["src"]] += g["w"]
    tokens = np.arange(n)
    for r_at in np.argsort(key, axis=1, kind="stable").T:  # the rank at each position, per token
        here = present[r_at, tokens]
        acc[here] += rows[r_at[here], tokens[here]]
    return acc.astype(dtype), acc_w

"""Normal-mode dispatch and combine of the reference backend when the group spans several NVLink domains.

Notation as in ``normal.py``, plus ``L`` ranks per domain (``num_nvl_ranks``), ``D = R // L`` domains
(DeepEP's "RDMA ranks"); rank ``r`` is local rank ``r % L`` of domain ``r // L``. The data moves as in
``normal.dispatch`` (one exchange, same received rows in the same order: grouped by source rank in rank
order, in source token order within a source); what changes is the handle, which takes DeepEP V1's
internode layout: 10 entries, in DeepEP's order, with DeepEP's meanings for the route a GPU kernel takes
(a token crosses RDMA once per domain it reaches, to the rank of that domain with the sender's local
index, the *forwarder*, which passes it over NVLink to its destinations in the domain):

0. ``is_token_in_rank [N, R] bool``: the routing (cached dispatch and combine read it).
1. ``rdma_channel_prefix_matrix [D, C] int32``: tokens of channels ``0..c`` that reach domain ``d``
   (a token counts once per domain), inclusive prefix over channels.
2. ``gbl_channel_prefix_matrix [R, C] int32``: tokens of channels ``0..c`` sent to rank ``r``, inclusive.
3. ``recv_rdma_channel_prefix_matrix [D, C] int32``: as a forwarder, entry 1's row for this domain of the
   rank with this local index in domain ``d`` (what arrives from it over RDMA, inclusive over channels).
4. ``recv_rdma_rank_prefix_sum [D] int32``: inclusive prefix over ``d`` of the tokens arriving over RDMA
   from domain ``d`` (its last entry counts the rows of entry 9).
5. ``recv_gbl_channel_prefix_matrix [R, C] int32``: row in ``recv_x`` where the tokens of source rank
   ``s``'s channel ``c`` start (exclusive prefix, offset by the rows of ranks before ``s``).
6. ``recv_gbl_rank_prefix_sum [R] int32``: inclusive prefix over source ranks of the rows received from
   each (``handle[-4]``; its last entry is the number of received rows).
7. ``recv_src_meta [rows, 8] uint8``: per received row DeepEP's ``SourceMeta``, two little-endian int32:
   the source's domain and a bit mask of the token's destinations in this domain (bit ``j``: local rank
   ``j``). ``num_worst_tokens`` padding rows hold ``(-1, 0)``.
8. ``send_rdma_head [N, D] int32``: for a token that reaches domain ``d``, its position among this rank's
   tokens of the same channel that reach ``d`` (the RDMA ring index DeepEP stores), else -1.
9. ``send_nvl_head [F, L] int32``: as a forwarder, one row per token arriving over RDMA (grouped by source
   domain, in its token order, ``F`` = entry 4's last value): for local rank ``j`` of this domain, the
   token's position among the tokens of the same source domain and channel forwarded to ``j``, else -1.
   With ``num_worst_tokens`` the rows are padded with -1 to ``num_worst_tokens`` when ``F`` is smaller.

Entries 8 and 9 are positions in the GPU kernels' ring buffers in DeepEP; here they are the positions that
the same channel split (``normal.channel_bounds``) gives, which is what DeepEP's counters hold as well.
``L`` may be up to 32 (the bit mask of entry 7).
"""

from __future__ import annotations

import numpy as np

from . import normal

__all__ = ["dispatch", "combine", "HANDLE_FIELDS"]

HANDLE_FIELDS = ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
                 "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix",
                 "recv_gbl_rank_prefix_sum", "recv_src_meta", "send_rdma_head", "send_nvl_head")


def _token_channels(num_tokens: int, num_channels: int) -> np.ndarray:
    return np.searchsorted(normal.channel_bounds(num_tokens, num_channels), np.arange(num_tokens), side="right")


def _channel_positions(mask: np.ndarray, channel: np.ndarray) -> np.ndarray:
    """``[k, X]`` int32: for rows sorted by ``channel``, row ``i``'s position among the rows of its channel
    with ``mask[., x]``; -1 where ``mask`` is False."""
    k = mask.shape[0]
    cum = np.zeros((k + 1, mask.shape[1]), dtype=np.int64)
    np.cumsum(mask, axis=0, out=cum[1:])
    first = np.searchsorted(channel, channel, side="left")
    return np.where(mask, cum[1:] - cum[first] - 1, -1).astype(np.int32)


def _bits(in_domain: np.ndarray) -> np.ndarray:
    """``[k, L]`` bool to ``[k]`` int32 masks (bit ``j`` for column ``j``)."""
    weights = (np.int64(1) << np.arange(in_domain.shape[1], dtype=np.int64))
    return (in_domain.astype(np.int64) @ weights).astype(np.uint32).view(np.int32)


def _extras(me: int, in_rank: np.ndarray, num_nvl_ranks: int, num_channels: int):
    """What this rank sends each rank besides the rows, and its own send-side handle entries."""
    n, nranks = in_rank.shape
    lsize, ndom = num_nvl_ranks, nranks // num_nvl_ranks
    channel = _token_channels(n, num_channels)
    by_domain = in_rank.reshape(n, ndom, lsize)
    in_dom = by_domain.any(axis=2)
    rdma_cpm = normal.channel_prefix_matrix(in_dom, num_channels)
    extra = []
    for r in range(nranks):
        d = r // lsize
        p = {"meta_bits": _bits(by_domain[in_rank[:, r], d])}
        if r % lsize == me % lsize:  # r forwards my tokens in its domain
            f = np.nonzero(in_dom[:, d])[0]
            p.update(fwd_in=by_domain[f, d].copy(), fwd_channel=channel[f].astype(np.int32),
                     rdma_cpm=rdma_cpm[d].copy())
        extra.append(p)
    return extra, rdma_cpm, _channel_positions(in_dom, channel)


def dispatch(group, x, x_scales, *, handle, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
             expert_alignment: int, num_worst_tokens: int, num_channels: int, num_nvl_ranks: int):
    """``normal.dispatch`` with the internode handle (see the module docstring); a cached dispatch takes that
    handle, returns it unchanged and, as DeepEP's, as many rows as ``handle[7]`` (a handle from a dispatch
    with ``num_worst_tokens`` gives that many rows, zero-padded)."""
    me, nranks = group.rank, group.size
    lsize, ndom = num_nvl_ranks, nranks // num_nvl_ranks
    common = dict(num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                  expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens, num_channels=num_channels)
    if handle is not None:
        if not isinstance(handle, (tuple, list)) or len(handle) != len(HANDLE_FIELDS):
            handle = (None,)  # normal.dispatch reports it on every rank
        else:  # as DeepEP: a cached dispatch returns as many rows as handle[7] has (num_worst_tokens padding)
            try:
                rows = int(np.shape(handle[7])[0])
                if rows > int(np.asarray(handle[6])[-1]):
                    common["num_worst_tokens"] = max(rows, num_worst_tokens)
            except Exception:  # noqa: BLE001 - a malformed handle: normal.dispatch reports it on every rank
                pass
        return normal.dispatch(group, x, x_scales, handle=handle, is_token_in_rank=None, handle_in_rank=0, **common)
    extra = rdma_cpm = send_rdma_head = None
    try:
        in_rank = np.asarray(is_token_in_rank, dtype=bool)
        if in_rank.shape == (x.shape[0], nranks):
            extra, rdma_cpm, send_rdma_head = _extras(me, in_rank, lsize, num_channels)
    except Exception:  # noqa: BLE001 - a bad argument: normal.dispatch reports it on every rank
        extra = None
    if extra is None:
        extra = [{} for _ in range(nranks)]
    recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, flat = normal.dispatch(
        group, x, x_scales, handle=None, is_token_in_rank=is_token_in_rank, extra=extra, **common)
    rank_prefix, gbl_cpm, recv_cpm, _, in_rank, _ = flat

    recv_gbl_prefix = rank_prefix[:, me].astype(np.int32)
    starts = np.concatenate([[0], recv_gbl_prefix[:-1]]).astype(np.int32)
    recv_gbl_cpm = (recv_cpm + starts[:, None]).astype(np.int32)
    meta = np.zeros((recv_x.shape[0], 2), dtype=np.int32)
    meta[:, 0] = -1
    num_recv = int(recv_gbl_prefix[-1])
    if num_recv:
        meta[:num_recv, 0] = np.repeat(np.arange(nranks, dtype=np.int32) // lsize, np.diff(rank_prefix[:, me],
                                                                                          prepend=0))
        meta[:num_recv, 1] = np.concatenate([g["meta_bits"] for g in extra])
    recv_src_meta = np.ascontiguousarray(meta.astype("<i4")).view(np.uint8).reshape(-1, 8)

    peers = [extra[d * lsize + me % lsize] for d in range(ndom)]
    recv_rdma_cpm = np.stack([p["rdma_cpm"] for p in peers]).astype(np.int32)
    recv_rdma_prefix = np.cumsum([p["fwd_in"].shape[0] for p in peers]).astype(np.int32)
    forwarded = int(recv_rdma_prefix[-1])
    rows = max(forwarded, num_worst_tokens)
    send_nvl_head = np.full((rows, lsize), -1, dtype=np.int32)
    if forwarded:
        send_nvl_head[:forwarded] = np.concatenate(
            [_channel_positions(p["fwd_in"], p["fwd_channel"]) for p in peers])
    new_handle = (in_rank, rdma_cpm, gbl_cpm, recv_rdma_cpm, recv_rdma_prefix, recv_gbl_cpm, recv_gbl_prefix,
                  recv_src_meta, send_rdma_head, send_nvl_head)
    return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, new_handle


def _combine_prepare(group, x, handle, topk_weights):
    nranks = group.size
    if not isinstance(handle, (tuple, list)) or len(handle) != len(HANDLE_FIELDS):
        raise ValueError(f"handle must be the {len(HANDLE_FIELDS)}-tuple an internode dispatch returned")
    in_rank = np.asarray(handle[0], dtype=bool)
    if in_rank.ndim != 2 or in_rank.shape[1] != nranks:
        raise ValueError(f"handle[0] (is_token_in_rank) must have shape [*, {nranks}], got {list(in_rank.shape)}")
    ends = np.asarray(handle[6]).astype(np.int64)
    if ends.shape != (nranks,):
        raise ValueError(f"handle[6] (recv_gbl_rank_prefix_sum) must have shape [{nranks}], got {list(ends.shape)}")
    starts = np.concatenate([[0], ends[:-1]])
    rows = min(np.shape(handle[7])[0], x.shape[0])
    if (starts > ends).any() or ends[0] < 0 or ends[-1] > rows:
        raise ValueError(f"handle[6] (recv_gbl_rank_prefix_sum) must rise from 0 to at most {rows} (the rows of x "
                         f"and of handle[7]), got {ends.tolist()}: the handle is not one dispatch returned")
    if topk_weights is not None and np.shape(topk_weights)[0] < ends[-1]:
        raise ValueError(f"topk_weights must have at least {ends[-1]} rows, got {np.shape(topk_weights)[0]}")
    return starts, ends, in_rank


def combine(group, x, handle, *, topk_weights, bias_0, bias_1, num_nvl_ranks: int = 1):
    """``normal.combine`` with the internode handle: the rows ``handle[6]`` assigns to each source rank go
    back to it, which sums them on the tokens ``handle[0]`` sent that rank (same order). With domains of
    ``num_nvl_ranks`` > 1 each domain's rows of a token are summed and rounded first (its forwarder's partial
    sum, one row per token across domains), then the domains' partials at the source."""
    error = starts = ends = in_rank = None
    try:
        starts, ends, in_rank = _combine_prepare(group, x, handle, topk_weights)
    except Exception as exc:  # noqa: BLE001 - reported to every rank by collective.start()
        error = exc
    return normal.combine_rows(group, x, starts, ends, in_rank, None, topk_weights=topk_weights, bias_0=bias_0,
                               bias_1=bias_1, fields={}, error=error, prefix="handle[6] (recv_gbl_rank_prefix_sum)",
                               domain_size=num_nvl_ranks)

"""Low-latency mode of the reference backend: dispatch into per-expert slabs, weighted combine.

Notation: ``R`` ranks, ``me`` this rank, ``T = num_max_dispatch_tokens_per_rank``, ``E`` experts,
``E_local = E // R``; expert ``e`` lives on rank ``e // E_local`` as local expert ``e % E_local``.

Dispatch sends, for every token ``t`` and every valid ``k``, row ``t`` to the rank owning
``topk_idx[t, k]``. A row of ``topk_idx`` naming the same expert twice is rejected (ValueError):
the slab of an expert holds at most one row per (source rank, token), which is what bounds it by
``R * T`` rows. On the receiving rank the rows of local expert ``i`` are stored in
``packed_recv_x[i]`` grouped by source rank, each group in source token order; the groups start with
this rank's own, then follow the other ranks cyclically (``me, me + 1, ..., R - 1, 0, ..., me - 1``), so
the sender writes its own rows from row 0 without waiting for anyone's counts. Rows past
``packed_recv_count[i]`` are 0 (and their ``src_info`` is -1).

Masking (fault tolerance): ``masked`` is this rank's own view. A rank that sees itself masked sends
nothing and receives nothing; otherwise it sends nothing to, and ignores anything from, ranks it sees
masked. Every rank still takes part in the collective exchange (with empty payloads), so different
views never hang. In the combine, the weighted sum runs over the ``k`` whose owner is unmasked in the
caller's view and actually returned the row; anything else contributes nothing.
"""

from __future__ import annotations

import numpy as np

from . import collective, quant


def check_unique_experts(topk_idx: np.ndarray) -> None:
    """Raise ValueError if a token's top-k names the same (non-negative) expert twice."""
    if topk_idx.shape[0] == 0 or topk_idx.shape[1] < 2:
        return
    s = np.sort(topk_idx, axis=1)
    dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
    if dup.any():
        t = int(np.nonzero(dup.any(axis=1))[0][0])
        raise ValueError(f"low-latency dispatch: token {t} selects expert {int(s[t][1:][dup[t]][0])} twice")


def source_order(me: int, nranks: int) -> list[int]:
    """The order of the source groups in rank ``me``'s expert slabs: itself first, then cyclically."""
    return [(me + j) % nranks for j in range(nranks)]


def _column_major(dense: np.ndarray) -> np.ndarray:
    """Same values as ``dense [A, B, C]``, stored with the last two dims column-major."""
    cm = np.ascontiguousarray(dense.transpose(0, 2, 1))
    return cm.transpose(0, 2, 1)


def dispatch(group, x, topk_idx, *, num_max_dispatch_tokens_per_rank: int, num_experts: int,
             use_fp8: bool, round_scale: bool, use_ue8m0: bool, masked: np.ndarray):
    """Exchange and pack. Returns ``(recv_x, recv_scales or None, recv_count, src_info, layout_range)``.

    * ``recv_x [E_local, R*T, H]``: bf16, or e4m3 when ``use_fp8`` (cast on the sending rank with
      ``quant.fp8_cast_per_128``, once per token, identical for every destination).
    * ``recv_scales``: ``use_fp8`` only. float32 ``[E_local, R*T, H/128]``, or with ``use_ue8m0`` int32
      ``[E_local, R*T, ceil(H/512)]`` (``quant.pack_ue8m0``); last two dims column-major in both cases.
      Rows past the count hold 0.
    * ``recv_count [E_local]`` int32, ``src_info [E_local, R*T]`` int32 (source token index, -1 unused),
      ``layout_range [E_local, R]`` int64 ``(begin << 32) | count``; ``begin`` is the first row of that
      source in the slab, or where it would start when ``count`` is 0.
    """
    me, nranks = group.rank, group.size
    t_max = num_max_dispatch_tokens_per_rank
    e_local = num_experts // nranks
    n, h = x.shape
    error = fields = None
    try:
        if n > t_max:
            raise ValueError(f"low-latency dispatch: x has {n} tokens, more than "
                             f"num_max_dispatch_tokens_per_rank={t_max}")
        if num_experts <= 0 or num_experts % nranks:
            raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of the number of ranks "
                             f"({nranks})")
        topk_idx = np.asarray(topk_idx, dtype=np.int64)
        if topk_idx.ndim != 2 or topk_idx.shape[0] != n:
            raise ValueError(f"topk_idx must have shape [{n}, *], got {list(topk_idx.shape)}")
        check_unique_experts(topk_idx)
        fields = {"num_max_dispatch_tokens_per_rank": t_max, "hidden": h, "num_experts": num_experts,
                  "use_fp8": bool(use_fp8), "round_scale": bool(round_scale), "use_ue8m0": bool(use_ue8m0),
                  "x dtype": str(x.dtype)}
    except Exception as exc:  # noqa: BLE001 - reported to every rank by start()
        error = exc
    collective.start(group, "low_latency_dispatch", fields=fields, error=error)

    if use_fp8:
        data, scale = quant.fp8_cast_per_128(x, round_scale=round_scale, use_ue8m0=use_ue8m0)
    else:
        data, scale = x, None
    tok, kk = np.nonzero((topk_idx >= 0) & (topk_idx < num_experts))  # an id out of range selects nothing
    experts = topk_idx[tok, kk]
    order = np.lexsort((tok, experts))
    tok, experts = tok[order], experts[order]
    dest = experts // e_local

    payloads = []
    for d in range(nranks):
        if masked[me] or masked[d]:
            payloads.append(None)
            continue
        sel = dest == d
        t = tok[sel]
        p = {"le": (experts[sel] - d * e_local).astype(np.int64), "src": t.astype(np.int32), "x": data[t]}
        if scale is not None:
            p["scale"] = scale[t]
        payloads.append(p)
    got = collective.alltoall(group, payloads, "low_latency_dispatch (data)")

    slab = nranks * t_max
    recv_x = np.zeros((e_local, slab, h), dtype=data.dtype)
    recv_scale = np.zeros((e_local, slab, h // quant.BLOCK), dtype=np.float32) if use_fp8 else None
    src_info = np.full((e_local, slab), -1, dtype=np.int32)
    layout_range = np.zeros((e_local, nranks), dtype=np.int64)
    count = np.zeros(e_local, dtype=np.int64)
    for s in source_order(me, nranks):
        p = got[s]
        if masked[me] or masked[s] or p is None:
            layout_range[:, s] = count << 32
            continue
        bounds = np.searchsorted(p["le"], np.arange(e_local + 1))
        for i in range(e_local):
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            b, c = int(count[i]), hi - lo
            recv_x[i, b:b + c] = p["x"][lo:hi]
            if recv_scale is not None:
                recv_scale[i, b:b + c] = p["scale"][lo:hi]
            src_info[i, b:b + c] = p["src"][lo:hi]
            layout_range[i, s] = (b << 32) | c
            count[i] += c

    scales_out = None
    if use_fp8:
        if use_ue8m0:
            packed = quant.pack_ue8m0(quant.scale_to_ue8m0(recv_scale))
            scales_out = _column_major(packed)
        else:
            scales_out = _column_major(recv_scale)
    return recv_x, scales_out, count.astype(np.int32), src_info, layout_range


def _combine_prepare(group, x, topk_idx, topk_weights, handle, use_logfmt):
    """Check this rank's handle and inputs (the bounds the exchange relies on); return ``(begins, counts,
    src_info, hidden, E_local)``."""
    nranks = group.size
    src_info, layout_range, t_max, hidden, num_experts = handle
    e_local = num_experts // nranks
    slab = nranks * t_max
    if use_logfmt and hidden % quant.BLOCK:
        raise ValueError(f"LogFMT combine needs hidden to be a multiple of {quant.BLOCK}, got {hidden}")
    src_info = np.asarray(src_info)
    layout_range = np.asarray(layout_range, dtype=np.int64)
    if src_info.shape != (e_local, slab) or layout_range.shape != (e_local, nranks):
        raise ValueError(f"handle[0] (src_info) and handle[1] (layout_range) must have shapes [{e_local}, {slab}] "
                         f"and [{e_local}, {nranks}], got {list(src_info.shape)} and {list(layout_range.shape)}")
    if np.shape(x) != (e_local, slab, hidden):
        raise ValueError(f"x must have shape [{e_local}, {slab}, {hidden}] (from the handle), got {list(np.shape(x))}")
    if np.ndim(topk_idx) != 2 or np.shape(topk_weights) != np.shape(topk_idx):
        raise ValueError(f"topk_idx and topk_weights must be 2-D of the same shape, got "
                         f"{list(np.shape(topk_idx))} and {list(np.shape(topk_weights))}")
    begins, counts = layout_range >> 32, layout_range & 0xFFFFFFFF
    if (begins < 0).any() or (begins + counts > slab).any():
        raise ValueError(f"handle[1] (layout_range) holds rows outside the {slab} rows of an expert's slab: the "
                         "handle is not one low_latency_dispatch returned")
    for i in range(e_local):
        for s in range(nranks):
            b, c = int(begins[i, s]), int(counts[i, s])
            part = src_info[i, b:b + c]
            if c and (part.min() < 0 or part.max() >= t_max):
                raise ValueError(f"handle[0] (src_info) names token {int(part.max())} outside [0, {t_max}) for "
                                 f"local expert {i}, rank {s}: the handle is not one low_latency_dispatch returned")
    return begins, counts, src_info, hidden, e_local


def combine(group, x, topk_idx, topk_weights, handle, *, use_logfmt: bool, masked: np.ndarray):
    """Return the expert outputs to their source ranks and reduce them with the top-k weights.

    ``x [E_local, R*T, H]`` bf16 holds, at the rows given by this rank's dispatch ``handle``, the expert
    outputs. Each owner returns, for every source ``s`` and local expert ``i``, the rows
    ``layout_range[i, s]`` of ``x[i]``.
    On the source, per token ``t``: ``acc = 0``; for each rank ``o`` in rank order that holds a valid expert
    of ``t`` whose row came back, ``part = 0``, then for ``k = 0 .. K-1`` with such an expert ``e`` on
    ``o``: ``part = fma(float32(row), topk_weights[t, k], part)`` (one rounding, ``quant.fma_f32``); with
    ``use_logfmt`` the part then becomes ``float32(logfmt_roundtrip_bf16(bf16(part)))`` (each 128-channel
    block of the bf16-rounded part as LogFMT-10, decoded and rounded to bf16); then ``acc = acc + part``
    (float32). ``combined_x[t] = bf16(acc)``. Returns bf16 ``[N, H]``.

    The sum is grouped by rank so that a rank may reduce its own experts' rows of a token before sending
    them (one float32 or LogFMT row per token and rank instead of one row per expert): every BF16 path of
    the kernels sums in this order, so all are bit-identical, and the LogFMT partial-sum path encodes
    exactly these parts. Where LogFMT rows travel per (token, expert) instead (puts, or few experts per
    rank), the kernels encode each expert's row and sum in top-k order: the result differs from this
    definition within LogFMT's tolerance.
    """
    me, nranks = group.rank, group.size
    error = fields = None
    try:
        begins, counts, src_info, hidden, e_local = _combine_prepare(group, x, topk_idx, topk_weights, handle,
                                                                     use_logfmt)
        fields = {"num_max_dispatch_tokens_per_rank": handle[2], "hidden": hidden, "num_experts": handle[4],
                  "use_logfmt": bool(use_logfmt)}
    except Exception as exc:  # noqa: BLE001 - reported to every rank by start()
        error = exc
    collective.start(group, "low_latency_combine", fields=fields, error=error)

    payloads = []
    for s in range(nranks):
        if masked[me] or masked[s]:
            payloads.append(None)
            continue
        le, src, rows = [], [], []
        for i in range(e_local):
            b, c = int(begins[i, s]), int(counts[i, s])
            le.append(np.full(c, i, dtype=np.int64))
            src.append(np.asarray(src_info[i, b:b + c], dtype=np.int64))
            rows.append(x[i, b:b + c])
        rows = np.concatenate(rows, axis=0) if rows else np.zeros((0, hidden), dtype=x.dtype)
        payloads.append({"le": np.concatenate(le) if le else np.zeros(0, np.int64),
                         "src": np.concatenate(src) if src else np.zeros(0, np.int64), "x": np.array(rows)})
    got = collective.alltoall(group, payloads, "low_latency_combine (data)")

    topk_idx = np.asarray(topk_idx, dtype=np.int64)
    weights = np.asarray(topk_weights, dtype=np.float32)
    n, k_top = topk_idx.shape
    error = None
    for o, p in enumerate(got):
        if p is not None and p["src"].size and not (masked[me] or masked[o]) and (
                p["src"].min() < 0 or p["src"].max() >= n):
            error = ValueError(
                f"low_latency_combine: rank {o} returns token {int(p['src'].max())} of rank {me}, whose topk_idx "
                f"has {n} rows: pass low_latency_combine the topk_idx given to low_latency_dispatch (and its "
                "handle)")
            break
    collective.finish(group, "low_latency_combine", error)
    lookup = np.full((nranks, e_local, n), -1, dtype=np.int64)
    all_rows, offset = [], 0
    for o in range(nranks):
        p = got[o]
        if masked[me] or masked[o] or p is None:
            continue
        rows = p["x"]
        lookup[o, p["le"], p["src"]] = offset + np.arange(rows.shape[0])
        all_rows.append(rows.astype(np.float32))
        offset += rows.shape[0]
    all_rows = np.concatenate(all_rows, axis=0) if all_rows else np.zeros((0, hidden), np.float32)

    tokens = np.arange(n)
    valid = (topk_idx >= 0) & (topk_idx < e_local * nranks)  # an id out of range selects nothing (as in the kernels)
    ids = np.where(valid, topk_idx, 0)
    where = np.where(valid, lookup[ids // e_local, ids % e_local, tokens[:, None]], -1)
    owner = ids // e_local
    acc = np.zeros((n, hidden), dtype=np.float32)
    for o in range(nranks):
        part = np.zeros((n, hidden), dtype=np.float32)
        held = np.zeros(n, dtype=bool)
        for k in range(k_top):
            ok = (where[:, k] >= 0) & (owner[:, k] == o)
            if ok.any():
                part[ok] = quant.fma_f32(all_rows[where[ok, k]], weights[ok, k][:, None], part[ok])
                held |= ok
        if use_logfmt and held.any():
            part[held] = quant.logfmt_roundtrip_bf16(part[held].astype(quant.BF16)).astype(np.float32)
        acc[held] = acc[held] + part[held]
    return acc.astype(quant.BF16)

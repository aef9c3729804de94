"""Where V2 puts the received rows (its non-expanded and expanded "layouts"), from what V1's dispatch returns.

V1 gives one row per received token, grouped by source rank in rank order and in source token order within
a source, with the top-k ids local to this rank (-1 elsewhere). That is V2's non-expanded layout (and its
``deterministic`` order: by ``src_token_global_idx``). The expanded layout puts one row per (token, local
expert) selection, experts in order, each expert's segment starting at a multiple of ``expert_alignment``;
within an expert the rows keep received-row order. Everything is computed with the caller's framework on
the device (``arrays.py``), without a CPU sync.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..frameworks import I32

__all__ = ["RecvRows", "recv_rows", "row_sources", "expand_gather", "expand_rows", "col_major", "dst_slots", "align"]


def align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass
class RecvRows:
    """Device arrays describing one dispatch's received rows (``N`` rows, ``K`` top-k slots, ``L`` local experts)."""

    rows: object  # [N, K] int64: expanded row of slot j, -1 where the slot is not local (or not expanded)
    counts: object  # [L] int32: received (token, expert) selections per local expert
    psum_expert: object  # [L] int32: V2's psum_num_recv_tokens_per_expert for the layout
    metadata: object  # [N, K + 2] int32: V2's recv_src_metadata
    sources: object = None  # [rows of the expanded layout] int64, see row_sources
    gather: tuple = None  # see expand_gather


def recv_rows(A, recv_topk_idx, psum_per_rank, recv_src_idx, *, num_local_experts: int, num_max_tokens: int,
                expert_alignment: int, expand: bool) -> RecvRows:
    """Work out V2's layout arrays for the rows V1 received.

    Arguments:
        A: the framework's operations.
        recv_topk_idx: `[N, K]` int64 local expert ids, -1 for another rank's expert or a padding row.
        psum_per_rank: `[R]` inclusive prefix sum of the rows received from each source rank.
        recv_src_idx: `[N]` int32 token index at the source rank (-1 for a padding row).
        num_local_experts, num_max_tokens, expert_alignment: ``L``, ``M``, ``A``.
        expand: whether the expanded layout's rows are wanted.
    """
    n, k = (int(s) for s in recv_topk_idx.shape)
    lanes = A.arange(k, recv_topk_idx)
    valid = recv_topk_idx >= 0
    master = A.amax(A.where(valid, lanes[None, :], -1), axis=1) if n else A.full((0,), -1, "int64",
                                                                                  recv_topk_idx)
    experts = A.arange(num_local_experts, recv_topk_idx)
    onehot = A.sum(recv_topk_idx[:, :, None] == experts[None, None, :], axis=1)  # [N, L], 0/1 (ids distinct)
    counts = A.sum(onehot, axis=0)
    aligned = (counts + (expert_alignment - 1)) // expert_alignment * expert_alignment
    ends = A.cumsum(aligned, axis=0)
    starts = ends - aligned
    if expand:
        before = A.cumsum(onehot, axis=0) - onehot  # selections of the same expert in earlier rows
        local = A.where(valid, recv_topk_idx, 0)
        rows = A.where(valid, A.take_along(before, local, axis=1) + starts[local], -1)
        psum_expert = starts + counts
    else:
        rows = A.full((n, k), -1, "int64", recv_topk_idx)
        psum_expert = ends
    src_rank = A.searchsorted_right(psum_per_rank, A.arange(n, recv_topk_idx))
    real = master >= 0
    global_idx = A.where(real, src_rank * num_max_tokens + A.astype(recv_src_idx, "int64"), -1)
    slot = A.where(real, src_rank * k + master, -1)
    metadata = A.astype(A.concat([global_idx[:, None], slot[:, None], rows], axis=1), I32)
    return RecvRows(rows=rows, counts=A.astype(counts, I32),
                      psum_expert=A.astype(psum_expert, I32), metadata=metadata)


def row_sources(A, placed: RecvRows, num_rows: int):
    """`[num_rows]` int64: for each row of the expanded layout, ``i * K + j`` of the received row ``i`` and
    top-k slot ``j`` placed there, -1 for a padding row; made once per handle (its cached dispatches reuse it)."""
    if placed.sources is None or int(placed.sources.shape[0]) != num_rows:
        n, k = (int(s) for s in placed.rows.shape)
        flat = placed.rows.reshape(-1)
        sources = A.full((num_rows + 1,), -1, "int64", flat)
        sources[A.where(flat >= 0, flat, num_rows)] = A.arange(n * k, flat)  # slots placed nowhere: the spare
        placed.sources = sources[:num_rows]
    return placed.sources


def expand_gather(A, placed: RecvRows, num_rows: int):
    """``(received_row, slot, padding)`` `[num_rows]` each, the gather that fills the expanded layout: the
    received row and the ``i * K + j`` placed at each expanded row (0 for a padding row), and the padding
    rows' mask; made once per handle, as :func:`row_sources` is."""
    if placed.gather is None or int(placed.gather[0].shape[0]) != num_rows:
        sources = row_sources(A, placed, num_rows)
        k = int(placed.rows.shape[1])
        padding = sources < 0
        slot = A.where(sources >= 0, sources, 0)
        placed.gather = (slot // k, slot, padding)
    return placed.gather


def expand_rows(A, values, index, padding, zero: bool):
    """``values[index[r]]`` for every row ``r`` of the expanded layout (``values``: `[N * K, ...]` per slot
    with ``index`` the slots, or `[N, ...]` per received row with ``index`` the rows, of
    :func:`expand_gather`); padding rows are zero when ``zero``, else left as they come."""
    num_rows = int(index.shape[0])
    if int(values.shape[0]) == 0:
        make = A.zeros if zero else A.empty
        return make((num_rows,) + tuple(int(s) for s in values.shape[1:]), None, values)
    out = A.take_rows(values, index)
    return A.zero_rows(out, padding) if zero else out


def col_major(A, sf, num_rows: int):
    """``sf`` `[num_rows, S]` as a column-major array with strides ``(1, align(num_rows, 4))``."""
    num_sf = int(sf.shape[1])
    buf = A.empty((num_sf, align(max(num_rows, 1), 4)), None, sf)
    buf[:, :num_rows] = sf.T
    return buf.T[:num_rows]


def dst_slots(A, topk_idx, is_token_in_rank, *, num_local_experts: int, num_max_tokens: int):
    """V2's ``dst_buffer_slot_idx`` `[T, K]` int32: for each selection, ``dest_rank * M`` plus the token's
    position among the tokens this rank sends to that rank; -1 for none."""
    sent = A.astype(is_token_in_rank, "int64")
    position = A.cumsum(sent, axis=0) - sent  # [T, R]
    valid = topk_idx >= 0
    dest = A.where(valid, topk_idx // num_local_experts, 0)
    slot = dest * num_max_tokens + A.take_along(position, dest, axis=1)
    return A.astype(A.where(valid, slot, -1), I32)

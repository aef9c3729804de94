"""The V2 layer's work before and after V1's combine: V2's reduction order, bit for bit.

V2's combine sums in float32 and rounds to BF16 once per level: first the selections of one token that one
rank holds (when the layout is expanded and ``allow_multiple_reduction``; a non-expanded ``x`` already holds
that per-rank sum), each group's BF16 sum standing at the group's highest top-k slot; then the bias
(``bias_0 + bias_1``) and every top-k slot in ascending order, rounded to BF16 at the end.

V1's combine sums what the ranks send in its own order, so the V2 layer sends each value in a column block
of its own: exactly one rank writes a block, every other rank adds zeros, so V1 returns each value unchanged,
and the final sum happens here in V2's order. Where each rank sends one sum per token (a non-expanded ``x``,
or ``allow_multiple_reduction``) and there are fewer ranks than top-k slots, a block per rank (hidden
``R * H``); else a block per top-k slot (``K * H``); in chunks of blocks as the buffer allows. The weights
travel a slot's way: V1 returns each slot's weight from the rank that owns it, and 0 for a slot with no
expert.
"""

from __future__ import annotations

from ..frameworks import F32

__all__ = ["slot_values", "rank_values", "slot_weights", "final_sum", "final_sum_by_rank"]


def slot_values(A, x, handle, reduce_per_rank: bool):
    """`[N, K, H]` BF16: the value each received row contributes at each top-k slot (zero elsewhere)."""
    placed = handle._recv_rows
    n, k = (int(s) for s in placed.rows.shape)
    hidden = int(x.shape[1])
    wide = A.zeros((n * k + 1, hidden), None, x)
    spare = n * k
    base = A.arange(n, x) * k
    master = A.where(placed.master >= 0, base + placed.master, spare)
    if reduce_per_rank or not handle.do_expand:
        if not handle.do_expand or int(x.shape[0]) > 0:
            wide[master] = _rank_sums(A, x, handle)
    elif int(x.shape[0]) > 0:
        for j in range(k):
            rows = placed.rows[:, j]
            wide[A.where(rows >= 0, base + j, spare)] = x[A.where(rows >= 0, rows, 0)]
    return wide[:spare].reshape(n, k, hidden)


def _rank_sums(A, x, handle):
    """`[N, H]` BF16: this rank's sum per received token, in V2's order (``x`` itself where not expanded)."""
    if not handle.do_expand:
        return x
    placed = handle._recv_rows
    n, k = (int(s) for s in placed.rows.shape)
    acc = A.zeros((n, int(x.shape[1])), F32, x)
    for j in range(k):
        rows = placed.rows[:, j]
        acc = acc + A.where((rows >= 0)[:, None], A.to_f32(x[A.where(rows >= 0, rows, 0)]), 0.0)
    return A.to_bf16(acc, x)


def rank_values(A, x, handle, rank: int, num_ranks: int):
    """`[N, R, H]` BF16: this rank's sum per received token in column ``rank``, zero elsewhere (and in the
    rows of padding)."""
    placed = handle._recv_rows
    n = int(placed.rows.shape[0])
    hidden = int(x.shape[1])
    wide = A.zeros((n * num_ranks + 1, hidden), None, x)
    spare = n * num_ranks
    if not handle.do_expand or int(x.shape[0]) > 0:
        wide[A.where(placed.master >= 0, A.arange(n, x) * num_ranks + rank, spare)] = _rank_sums(A, x, handle)
    return wide[:spare].reshape(n, num_ranks, hidden)


def slot_weights(A, topk_weights, handle):
    """`[N, K]` float32 for V1's combine: each slot's weight on the rank that owns the slot, 0 elsewhere."""
    placed = handle._recv_rows
    if not handle.do_expand:
        return A.where(handle._recv_topk_idx >= 0, topk_weights, 0.0)
    rows = placed.rows
    if int(topk_weights.shape[0]) == 0:
        return A.zeros(tuple(int(s) for s in rows.shape), F32, topk_weights)
    return A.where(rows >= 0, topk_weights[A.where(rows >= 0, rows, 0)], 0.0)


def _bias_sum(A, bias_0, bias_1, num_tokens: int, hidden: int, like):
    acc = None
    for bias in (bias_0, bias_1):
        if bias is not None:
            acc = A.to_f32(bias) if acc is None else acc + A.to_f32(bias)
    return A.zeros((num_tokens, hidden), F32, like) if acc is None else acc


def final_sum_by_rank(A, rank_chunks, topk_idx, num_local_experts: int, bias_0, bias_1, num_tokens: int,
                      hidden: int, like):
    """As :func:`final_sum` from per-rank values (chunks `[T, w, H]` of the ranks in order): a rank's value
    stands at its highest top-k slot of the token (where the slot order of :func:`final_sum` has it), the
    other slots add zero."""
    values = rank_chunks[0] if len(rank_chunks) == 1 else A.concat(rank_chunks, axis=1)
    acc = _bias_sum(A, bias_0, bias_1, num_tokens, hidden, like)
    ranks = A.where(topk_idx >= 0, topk_idx // num_local_experts, -1)
    k = int(topk_idx.shape[1])
    tokens = A.arange(num_tokens, like)
    for j in range(k):
        r = ranks[:, j]
        highest = r >= 0
        for later in range(j + 1, k):
            highest = highest & (ranks[:, later] != r)
        acc = acc + A.where(highest[:, None], A.to_f32(values[tokens, A.where(r >= 0, r, 0)]), 0.0)
    return A.to_bf16(acc, like)


def final_sum(A, slot_chunks, bias_0, bias_1, num_tokens: int, hidden: int, like):
    """BF16 (``like``'s dtype) `[T, H]`: ``bias_0 + bias_1`` (or zeros) then the slots in order (each chunk
    `[T, w, H]`), in float32."""
    acc = _bias_sum(A, bias_0, bias_1, num_tokens, hidden, like)
    for chunk in slot_chunks:
        for j in range(int(chunk.shape[1])):
            acc = acc + A.to_f32(chunk[:, j])
    return A.to_bf16(acc, like)

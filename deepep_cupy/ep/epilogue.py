"""The V2 layer's work before and after V1's combine: V2's reduction order, bit for bit.

V2's combine sums in float32 and rounds to BF16 once per level: first the selections of one token that one
rank holds (when the layout is expanded and ``allow_multiple_reduction``; a non-expanded ``x`` already holds
that per-rank sum), each group's BF16 sum standing at the group's highest top-k slot; then the bias
(``bias_0 + bias_1``) and every top-k slot in ascending order, rounded to BF16 at the end.

Where each rank sends one sum per token (a non-expanded ``x``, or ``allow_multiple_reduction``), V1's intranode
combine kernels sum in that order themselves, given the source tokens' top-k (``rank_sums`` makes the per-rank
sums of an expanded ``x``). Otherwise, and across NVLink domains, the V2 layer sends each slot's value (or each
rank's sum at its last slot, ``rank_values``) in a column block of its own (hidden ``K * H``, in chunks of
blocks as the buffer allows): exactly one rank writes a block and every other rank adds zeros, so V1 returns
each value unchanged, and ``final_sum`` adds them here in V2's order (per domain first in hybrid mode). The weights travel a slot's way: V1 returns each slot's weight from the rank that owns it, and
0 for a slot with no expert.
"""

from __future__ import annotations

from ..frameworks import F32

__all__ = ["slot_values", "rank_sums", "rank_values", "domain_of_slots", "slot_weights", "final_sum"]


def slot_values(A, x, handle):
    """`[N, K, H]` BF16: the value each received row contributes at each top-k slot (zero elsewhere), for an
    expanded ``x`` without multiple reduction."""
    placed = handle._recv_rows
    n, k = (int(s) for s in placed.rows.shape)
    hidden = int(x.shape[1])
    wide = A.zeros((n * k + 1, hidden), None, x)
    spare = n * k
    base = A.arange(n, x) * k
    if int(x.shape[0]) > 0:
        for j in range(k):
            rows = placed.rows[:, j]
            wide[A.where(rows >= 0, base + j, spare)] = x[A.where(rows >= 0, rows, 0)]
    return wide[:spare].reshape(n, k, hidden)


def rank_sums(A, x, handle):
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


def rank_values(A, x, handle):
    """`[N, K, H]` BF16: this rank's sum per received token (:func:`rank_sums`) at the token's last top-k slot
    held here, zero elsewhere: each rank's sum in a column block of its own, for V1's kernels to carry."""
    local = handle._recv_topk_idx
    n, k = (int(s) for s in local.shape)
    hidden = int(x.shape[1])
    sums = rank_sums(A, x, handle)
    lanes = A.arange(k, local)
    last = A.amax(A.where(local >= 0, lanes[None, :], -1), axis=1) if n else A.full((0,), -1, "int64", local)
    wide = A.zeros((n * k + 1, hidden), None, x)
    if n:
        wide[A.where(last >= 0, A.arange(n, local) * k + last, n * k)] = sums[:n]
    return wide[:n * k].reshape(n, k, hidden)


def domain_of_slots(A, topk_idx, experts_per_domain: int):
    """`[T, K]` int64: the scale-up domain of each top-k slot's expert, -1 for a slot without one."""
    return A.where(topk_idx >= 0, topk_idx // experts_per_domain, -1)


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


def final_sum(A, slot_chunks, bias_0, bias_1, num_tokens: int, hidden: int, like, slot_domains=None):
    """BF16 (``like``'s dtype) `[T, H]`: ``bias_0 + bias_1`` (or zeros) then the slots in order (each chunk
    `[T, w, H]`), in float32. With ``slot_domains`` (`[T, K]`, hybrid mode across domains) the slots of each
    domain are summed first, in slot order, rounded to BF16 and stand at the domain's last slot."""
    values = [chunk[:, j] for chunk in slot_chunks for j in range(int(chunk.shape[1]))]
    if slot_domains is not None:
        values = _domain_sums(A, values, slot_domains, like)
    acc = _bias_sum(A, bias_0, bias_1, num_tokens, hidden, like)
    for value in values:
        acc = acc + A.to_f32(value)
    return A.to_bf16(acc, like)


def _domain_sums(A, values, slot_domains, like):
    """Per slot ``j``: where ``j`` is its domain's last slot for a token, the BF16 sum of that domain's slots
    ``<= j`` in order; zero elsewhere."""
    k = len(values)
    out = []
    for j in range(k):
        mine = slot_domains[:, j]
        later = slot_domains[:, j + 1:] == mine[:, None]
        is_last = (mine >= 0) & ~A.any(later, axis=1) if j + 1 < k else mine >= 0
        acc = None
        for i in range(j + 1):
            term = A.where((slot_domains[:, i] == mine)[:, None], A.to_f32(values[i]), 0.0)
            acc = term if acc is None else acc + term
        out.append(A.where(is_last[:, None], A.to_bf16(acc, like), A.zeros((), None, like)))
    return out

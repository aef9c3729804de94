"""Inputs and plain-loop expectations of the reference backend, shared by the single-process tests
(tests/unit/test_reference_single*.py, thread-ranks) and the multi-process ones (tests/mpi, under mpiexec).

Every rank derives all ranks' inputs from the same seeds (``make_case``), so each expectation here is
computed independently of the backend by plain loops over every rank's data. ``ll_dispatch`` and
``ll_combine`` call a backend's low-latency ops with the defaults of a plain call (BF16, no statistics, no
hook), any of them overridden by keyword.
"""

import math

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
#: num_max_dispatch_tokens_per_rank of ``ll_dispatch`` unless given.
T_MAX = 12


# ------------------------------------------------------------------------------------------ inputs
def make_case(seed, rank, num_ranks, *, n, hidden=128, k=3, e_local=2, neg=0.2, only_ranks=None):
    """Tokens of one rank: int-valued bf16 x (sums are exact), unique top-k experts, dyadic weights."""
    rng = np.random.default_rng([seed, rank, num_ranks])
    e = e_local * num_ranks
    allowed = np.arange(e) if only_ranks is None else np.array([x for x in range(e) if x // e_local in only_ranks])
    k = min(k, len(allowed))
    topk = np.stack([rng.permutation(allowed)[:k] for _ in range(n)]) if n else np.zeros((0, k), np.int64)
    topk = topk.astype(np.int64)
    topk[rng.random(topk.shape) < neg] = -1
    x = rng.integers(-8, 9, (n, hidden)).astype(np.float32).astype(BF16)
    w = (rng.integers(1, 16, topk.shape) / 16).astype(np.float32)
    return x, topk, w


def brute_layout(topk, num_experts, num_ranks, nvl):
    e_local = num_experts // num_ranks
    n = topk.shape[0]
    per_rank = [0] * num_ranks
    per_node = [0] * (num_ranks // nvl)
    per_expert = [0] * num_experts
    in_rank = np.zeros((n, num_ranks), bool)
    for t in range(n):
        ranks = set()
        for e in topk[t]:
            if e >= 0:
                per_expert[e] += 1
                ranks.add(int(e) // e_local)
        for r in ranks:
            per_rank[r] += 1
            in_rank[t, r] = True
        for node in {r // nvl for r in ranks}:
            per_node[node] += 1
    return per_rank, per_node, per_expert, in_rank


# ------------------------------------------------------------------------------------------ normal mode
def expected_dispatch(me, cases, e_local, channels):
    """Independent loops: rows, source indices, local top-k, prefix matrices, send_head."""
    num_ranks = len(cases)
    rows, src, tk, tw = [], [], [], []
    rank_prefix = np.zeros((num_ranks, num_ranks), np.int64)
    per_expert = [0] * e_local
    recv_cpm = np.zeros((num_ranks, channels), np.int64)
    for s, (x, topk, w) in enumerate(cases):
        n = x.shape[0]
        chunk = math.ceil(n / channels) if n else 0
        for r in range(num_ranks):
            rank_prefix[s, r] = (rank_prefix[s - 1, r] if s else 0) + sum(
                any(e >= 0 and e // e_local == r for e in topk[t]) for t in range(n))
        seen_in_channel = [0] * channels
        for t in range(n):
            if not any(e >= 0 and e // e_local == me for e in topk[t]):
                continue
            seen_in_channel[t // chunk] += 1
            rows.append(x[t])
            src.append(t)
            tk.append([e - me * e_local if e >= 0 and e // e_local == me else -1 for e in topk[t]])
            tw.append([w[t, j] if tk[-1][j] >= 0 else 0.0 for j in range(topk.shape[1])])
        for e in topk[np.asarray(topk) >= 0]:
            if e // e_local == me:
                per_expert[e - me * e_local] += 1
        recv_cpm[s] = np.concatenate([[0], np.cumsum(seen_in_channel)[:-1]])
    return rows, src, tk, tw, rank_prefix, per_expert, recv_cpm


def expected_send_side(x, topk, e_local, num_ranks, channels):
    n = x.shape[0]
    chunk = math.ceil(n / channels) if n else 0
    cpm = np.zeros((num_ranks, channels), np.int64)
    head = np.full((n, num_ranks), -1, np.int64)
    counter = [0] * num_ranks
    for t in range(n):
        for r in range(num_ranks):
            if any(e >= 0 and e // e_local == r for e in topk[t]):
                head[t, r] = counter[r]
                counter[r] += 1
                cpm[r, t // chunk:] += 1
    return cpm, head


# ------------------------------------------------------------------------------------------ low latency
def ll_dispatch(b, x, topk, e, **kw):
    args = dict(num_max_dispatch_tokens_per_rank=T_MAX, num_experts=e, use_fp8=False, round_scale=False,
                use_ue8m0=False, cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                return_recv_hook=False)
    args.update(kw)
    return b.low_latency_dispatch(x, topk, **args)


def ll_combine(b, y, topk, w, handle, **kw):
    args = dict(use_logfmt=False, zero_copy=False, return_recv_hook=False, out=None,
                combine_wait_recv_cost_stats=None)
    args.update(kw)
    return b.low_latency_combine(y, topk, w, handle, **args)


def ll_expected(me, cases, e_local, masked=()):
    """Per local expert: list of (source rank, token), sources from ``me`` on cyclically, then token order."""
    slabs = [[] for _ in range(e_local)]
    for j in range(len(cases)):
        s = (me + j) % len(cases)
        x, topk, _ = cases[s]
        if s in masked or me in masked:
            continue
        for t in range(x.shape[0]):
            for e in topk[t]:
                if e >= 0 and e // e_local == me:
                    slabs[e - me * e_local].append((s, t))
    return slabs


def ll_expected_ranges(slab, me, num_ranks):
    """layout_range of one local expert for the rows ``slab`` (as ll_expected gives them): per source,
    ``(begin << 32) | count``, the groups laid out from ``me`` on cyclically."""
    ranges = np.zeros(num_ranks, np.int64)
    begin = 0
    for j in range(num_ranks):
        s = (me + j) % num_ranks
        c = sum(1 for (ss, _) in slab if ss == s)
        ranges[s] = (begin << 32) | c
        begin += c
    return ranges


def expert_fn(x_rows, expert):
    """The 'expert' used by the tests: multiply by (global expert id + 1)."""
    return (x_rows.astype(np.float32) * (expert + 1)).astype(BF16)


def apply_experts(me, recv_x, e_local):
    return np.stack([expert_fn(recv_x[i], me * e_local + i) for i in range(e_local)])


def expected_ll_combine(x, topk, w, e_local, masked=(), me=0):
    acc = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(topk[t]):
            if e >= 0 and e // e_local not in masked and me not in masked:
                acc[t] += float(w[t, j]) * expert_fn(x[t:t + 1], e)[0].astype(np.float64)
    return acc  # exact for int-valued x and dyadic weights

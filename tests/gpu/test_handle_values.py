"""Handle index checks on GPU tensors (validation on, the default): a corrupted intranode or low-latency
handle is refused with a ValueError naming the entry before any kernel runs, and the next call with the
handle the dispatch returned works. Every rank corrupts its handle the same way, so no rank enters a
kernel that its peers skip.

Run on every rank:  mpirun -np 2 python -m pytest tests/gpu/test_handle_values.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_common import COMM, agree, bf16, sync, to_dev, to_np, with_reference_buffer
from ll_common import E_SMALL, FRAMEWORKS, LL_MARKS, T_SMALL, routing, small_data

pytestmark = LL_MARKS
HIDDEN = 2048
MPI_MIN = __import__("mpi4py.MPI", fromlist=["MIN"]).MIN if COMM is not None else None
ENV = with_reference_buffer
LL_SHAPES = [(T_SMALL, HIDDEN, E_SMALL)]
NVL_HIDDEN = HIDDEN


def _refused(failures, what, call, named):
    try:
        call()
        sync()
        failures.append(f"{what}: accepted")
    except ValueError as exc:
        if named not in str(exc):
            failures.append(f"{what}: the error does not name {named}: {exc}")


def _with(t, index, value):
    """A copy of device tensor ``t`` whose flat element ``index`` is ``value``."""
    out = t.clone() if hasattr(t, "clone") else t.copy()
    out.reshape(-1)[index] = value
    return out


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_intranode_handle_values(env, nvl, fw):
    buf, dcfg, ccfg = nvl
    rank, size = env["rank"], env["size"]
    rng = np.random.default_rng([7, rank])
    n, experts, k = 64, 8 * size, 4
    topk, weights = routing(rng, n, experts, k)
    x = to_dev(bf16(rng, (n, HIDDEN)), fw, env)
    topk_d = to_dev(topk, fw, env)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_d, experts)
    recv, _i, recv_w, _l, handle, _e = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=per_expert, topk_idx=topk_d,
                                                      topk_weights=to_dev(weights, fw, env), config=dcfg)
    sync()
    failures = []
    rows = int(handle[3].shape[0])
    cases = [
        (0, (size - 1) * size + rank, rows + 5, "handle[0] (rank_prefix_matrix)"),  # more rows than received
        (1, 0, 10_000, "handle[1] (channel_prefix_matrix)"),
        (2, 0, 3, "handle[2] (recv_channel_prefix_matrix)"),
        (5, 0, 10_000, "handle[5] (send_head)"),
    ]
    if COMM.allreduce(rows, op=MPI_MIN) > 0:  # the same cases on every rank
        cases.append((3, 0, -5, "handle[3] (recv_src_idx)"))
    for entry, index, value, named in cases:
        bad = list(handle)
        bad[entry] = _with(handle[entry], index, value)
        _refused(failures, f"combine with corrupted {named}",
                 lambda b=tuple(bad): buf.combine(recv, b, config=ccfg), named)
        _refused(failures, f"cached dispatch with corrupted {named}",
                 lambda b=tuple(bad): buf.dispatch(x, handle=b, config=dcfg), named)
    combined, _w, _e = buf.combine(recv, handle, topk_weights=recv_w, config=ccfg)
    sync()
    if not np.isfinite(to_np(combined).astype(np.float32)).all():
        failures.append("the combine with the dispatch's own handle did not work after the refusals")
    agree(failures)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_low_latency_handle_values(env, ll, fw):
    rank, size = env["rank"], env["size"]
    x, topk, w, expert_out = small_data(rank, 60)
    x, topk, w = (to_dev(a, fw, env) for a in (x, topk, w))
    recv, _count, handle, _e, _h = ll.low_latency_dispatch(x, topk, T_SMALL, E_SMALL, use_fp8=False)
    sync()
    failures = []
    layout = to_np(handle[1])
    used = [int(b >> 32) for b in layout[0] if b & 0xFFFFFFFF]  # rows of local expert 0 that hold a token
    cases = [(1, 0, (size * T_SMALL) << 32 | 1, "handle[1] (layout_range)")]  # a range past the R*T rows
    if COMM.allreduce(len(used), op=MPI_MIN) > 0:  # the same cases on every rank
        cases.append((0, min(used), T_SMALL + 3, "handle[0] (src_info)"))  # a source token >= T
    for entry, index, value, named in cases:
        bad = list(handle)
        bad[entry] = _with(handle[entry], index, value)
        _refused(failures, f"low_latency_combine with corrupted {named}",
                 lambda b=tuple(bad): ll.low_latency_combine(to_dev(expert_out, fw, env), topk, w, b), named)
    combined, _e, _h = ll.low_latency_combine(to_dev(expert_out, fw, env), topk, w, handle)
    sync()
    if not np.isfinite(to_np(combined).astype(np.float32)).all():
        failures.append("the combine with the dispatch's own handle did not work after the refusals")
    agree(failures)

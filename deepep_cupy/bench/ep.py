"""DeepEP V2's calls (``EPBuffer``) against the V1 calls (``Buffer``) that do the same work, on the same
ranks and the same V1 buffer (the one the ``EPBuffer`` runs on), in one run: how much the V2 layer adds.

Each row is a round of dispatch and combine (the combine takes the received rows as they came, without
weights), for one V2 way and its V1 match:

- prefill (``--tokens`` x ``--hidden``, top-``--topk`` of ``--experts``):
    sizes read back: V2 ``do_cpu_sync=True`` / V1 ``get_dispatch_layout`` + ``dispatch`` (a CPU sync);
    expanded: the same with V2's ``do_expand=True`` (one row per token and local expert);
    sync-free: V2 ``do_cpu_sync=False`` / V1 ``num_worst_tokens`` (upper-bound sizes, no CPU sync);
    cached: V2 ``dispatch(handle=...)`` / V1 ``dispatch(handle=...)``;
- decode (``--ll-tokens``, top-``--topk`` of ``--ll-experts``), cached, as above.

``us`` and ``V1 us``: GPU microseconds per round, the median over ``ITERS`` rounds between CUDA events with
the GPU parked ahead of the start (the rounds with a CPU sync include the host's wait inside them, in both
ways alike); ``V2/V1``: their ratio (target <= 1.05). ``host us`` and ``V1 host us``: the wall time of the
Python calls of a round, the GPU parked so that no call waits for it except the CPU syncs (target: V2 <=
V1 + 5). Slowest rank's medians. Without a GPU (the reference backend) both columns are wall times, which
says only that the calls run.

Before timing, each way's combined output is checked: finite and not all zero on every rank.

    mpirun -np 2 python -m deepep_cupy.bench ep
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from ..device.group import comm_barrier
from .low_latency import device_kind, micro_batch
from .timing import park, row, time_op

__all__ = ["run", "ways"]

#: A combined output that is not finite or all zero is a wrong result, not a slow one: the run fails.
FAIL_RUN = True
ITERS, WARMUP = 20, 3
PARK_US = 4000.0  # longer than the host's issue time of any round here


def ways(ep, x, topk_idx, weights, num_experts: int, num_max_tokens: int, decode: bool = False) -> list:
    """``(name, V2 round, V1 round)`` for the inputs; each round returns its combined ``x``. ``ep``: an
    ``EPBuffer`` whose V1 ``Buffer`` (``ep.runtime``) runs the V1 rounds. Makes the cached handles (collective)."""
    v1 = ep.runtime

    def v1_round(worst: int = 0):
        per_rank, per_rdma, per_expert, in_rank, _ = v1.get_dispatch_layout(topk_idx, num_experts)
        recv, _, _, _, handle, _ = v1.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                                              is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                              topk_idx=topk_idx, topk_weights=weights, num_worst_tokens=worst)
        return v1.combine(recv, handle)[0], handle

    def v2_round(**flags):
        recv, _, _, handle, _ = ep.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=num_experts,
                                            **flags)
        return ep.combine(recv, handle)[0], handle

    v1_handle, v2_handle = v1_round()[1], v2_round(do_cpu_sync=True)[1]

    def v1_cached():
        return v1.combine(v1.dispatch(x, handle=v1_handle)[0], v1_handle)[0]

    def v2_cached():
        return ep.combine(ep.dispatch(x, handle=v2_handle)[0], v2_handle)[0]

    if decode:
        return [("decode, cached", v2_cached, v1_cached)]
    return [("prefill, sizes read back", lambda: v2_round(do_cpu_sync=True)[0], lambda: v1_round()[0]),
            ("prefill, expanded", lambda: v2_round(do_cpu_sync=True, do_expand=True)[0], lambda: v1_round()[0]),
            ("prefill, sync-free", lambda: v2_round(do_cpu_sync=False)[0],
             lambda: v1_round(num_max_tokens * ep.num_ranks)[0]),
            ("prefill, cached", v2_cached, v1_cached)]


def _problem(out) -> str | None:
    from ..frameworks import to_numpy

    values = np.asarray(to_numpy(out), dtype=np.float32)
    if not np.isfinite(values).all():
        return "not finite"
    return "all zero" if values.size and not values.any() else None


class _Clock:
    """GPU and host microseconds of a round: CUDA events behind a parked GPU, and the wall time of the calls
    with the GPU parked; without a GPU both are wall times."""

    def __init__(self, gpu: bool) -> None:
        self.gpu = gpu
        if gpu:
            import cupy

            self.stream = cupy.cuda.get_current_stream()

    def gpu_us(self, fn) -> float:
        if self.gpu:
            return time_op(fn, warmup=WARMUP, iters=ITERS, stream=self.stream, park_us=PARK_US)
        return self.host_us(fn)

    def host_us(self, fn) -> float:
        times = []
        for i in range(WARMUP + ITERS):
            if self.gpu:
                park(self.stream, PARK_US)
            start = time.perf_counter()
            fn()
            took = time.perf_counter() - start
            if self.gpu:
                self.stream.synchronize()
            if i >= WARMUP:
                times.append(took * 1e6)
        return statistics.median(times)


def run(comm, args) -> list[dict]:
    """The rows of the module docstring; collective."""
    from ..ep import EPBuffer
    from ..frameworks import from_numpy

    rank = comm.Get_rank()
    tokens, hidden, topk = int(args.tokens), int(args.hidden), int(args.topk)
    ll_tokens, ll_experts, experts = int(args.ll_tokens), int(args.ll_experts), int(args.experts)
    clock = _Clock(gpu=getattr(args, "on_gpu", True))
    kind = device_kind() if clock.gpu else None

    def place(arrays):
        return tuple(a if kind is None else from_numpy(a, kind) for a in arrays)

    ep = EPBuffer(comm=comm, num_max_tokens_per_rank=max(tokens, ll_tokens), hidden=hidden, num_topk=topk,
                  explicitly_destroy=True)
    rows, problems = [], []
    try:
        workloads = ((place(micro_batch((5, rank), tokens, hidden, experts, topk)), experts, False),
                     (place(micro_batch((6, rank), ll_tokens, hidden, ll_experts, topk)), ll_experts, True))
        for (x, idx, w), num_experts, decode in workloads:
            for name, v2, v1 in ways(ep, x, idx, w, num_experts, max(tokens, ll_tokens), decode):
                for which, fn in (("V2", v2), ("V1", v1)):
                    why = _problem(fn())
                    if why:
                        problems.append(f"{name}, {which}: combined x {why}")
                comm_barrier(comm, f"bench ep: before {name}")
                figures = [clock.gpu_us(v2), clock.gpu_us(v1), clock.host_us(v2), clock.host_us(v1)]
                us, v1_us, host, v1_host = (max(v) for v in zip(*comm.allgather(figures), strict=True))
                shape = f"{ll_tokens if decode else tokens} x {hidden}, top-{topk} of {num_experts}"
                rows.append(row(f"V2 {name} ({shape})", us, **{
                    "V1 us": round(v1_us, 2), "V2/V1": round(us / v1_us, 3) if v1_us else None,
                    "host us": round(host, 2), "V1 host us": round(v1_host, 2)}))
    finally:
        if clock.gpu:
            import cupy

            cupy.cuda.Device().synchronize()
        comm_barrier(comm, "bench ep: before destroy")
        ep.destroy()
    bad = [f"rank {r}: {p}" for r, ps in enumerate(comm.allgather(problems)) for p in ps]
    if bad:
        raise RuntimeError("; ".join(bad[:3]) + (f"; and {len(bad) - 3} more" if len(bad) > 3 else ""))
    return rows

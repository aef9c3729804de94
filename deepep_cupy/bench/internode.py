"""Internode high-throughput kernels (several NVLink domains) through ``Buffer``, next to the naive NCCL path.

The domain size is ``$DEEPEP_CUPY_NVL_RANKS`` (default 1: on one host every GPU is its own "node" and all
traffic crosses NVSHMEM). Bytes are counted as DeepEP's internode test counts them: RDMA bytes are one
BF16 row per (token, domain it reaches), this rank's own domain included; NVLink bytes are the rows this
rank receives; FP8 rows count BF16 bytes x (1 + 4/128) / 2. Times are CUDA-event medians of ``ITERS``
runs after warm-up, the slowest rank's median; the GPU is parked ahead of each timed call so the host's
issue time is hidden (as DeepEP's timing hides it behind its cache flush). Each row's ``vs_naive`` is the
naive PyTorch + NCCL path's time over ours, measured in the same run on the same routing.
"""

from __future__ import annotations

import os

from .. import Buffer, Config
from ..device.group import comm_barrier
from ..device.streams import current_stream
from .baselines import naive_ep
from .timing import row, sm_counts, time_op

__all__ = ["run"]

ITERS = 20
WARMUP = 5
PARK_US = 400


def slowest(comm, us: float) -> float:
    from mpi4py import MPI

    return comm.allreduce(us, op=MPI.MAX)


def run(comm, args) -> list[dict]:


    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    lsize = int(os.environ.get("DEEPEP_CUPY_NVL_RANKS", "1"))
    if num_ranks % lsize or num_ranks // lsize < 2:
        return [{"op": "internode", "note": f"skipped: {num_ranks} ranks do not make 2 or more domains of {lsize}"}]
    num_tokens, hidden, num_experts, num_topk = args.tokens, args.hidden, args.experts, args.topk
    counts = sm_counts(args)
    cfgs = [Config(n, 8, 512, 16, 128) for n in counts]
    nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden * 2, num_ranks) for c in cfgs)
    rdma_bytes = max(c.get_rdma_buffer_size_hint(hidden * 2, num_ranks, lsize) for c in cfgs)
    buf = Buffer(comm=comm, num_nvl_bytes=nvl_bytes, num_rdma_bytes=rdma_bytes, num_nvl_ranks=lsize,
                 explicitly_destroy=True)
    import torch

    # torch tensors, as the library's users pass them; timed on torch's current stream.
    stream = current_stream("torch", torch.cuda.current_device())
    rows: list[dict] = []
    try:
        gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
        scores = torch.randn(num_tokens, num_experts, device="cuda", generator=gen).abs() + 1
        topk_idx = torch.topk(scores, num_topk, dim=-1).indices.to(torch.int64).contiguous()
        topk_weights = torch.rand(num_tokens, num_topk, device="cuda", generator=gen)
        x_bf16 = torch.randn(num_tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        x_fp8 = torch.randn(num_tokens, hidden, device="cuda", generator=gen).to(torch.float8_e4m3fn)
        scales_col = torch.ones(hidden // 128, num_tokens, device="cuda").T  # column-major, as DeepEP's tests
        scales_row = scales_col.contiguous()

        def layout():
            return buf.get_dispatch_layout(topk_idx, num_experts)

        def timed(fn):
            return slowest(comm, time_op(fn, warmup=WARMUP, iters=ITERS, stream=stream, park_us=PARK_US))

        rows.append(row("internode layout", timed(layout)))
        per_rank, per_rdma, per_expert, in_rank, _ = layout()
        domains = in_rank.reshape(num_tokens, num_ranks // lsize, lsize).any(dim=2)
        rdma_bf16 = int(domains.sum().item()) * hidden * 2
        fp8_factor = (1 + 4 / 128) / 2
        naive = {r["op"]: r["us"] for r in naive_ep(comm, num_tokens, hidden, num_experts, num_topk)}
        stream.synchronize()
        for cfg in cfgs:
            at, recv_bytes = _at_sms(buf, timed, cfg, naive, x_bf16, (x_fp8, scales_col), (x_fp8, scales_row),
                                     topk_idx, topk_weights, per_rank, per_rdma, per_expert, in_rank, rdma_bf16,
                                     fp8_factor)
            rows += at
        for op, us in naive.items():
            rows.append(row(f"internode suite: {op}", us, recv_bytes, note="same routing, same run"))
        buf.runtime.internode.check_errors()
        if rank == 0:
            for r in rows:
                extra = f", {r['RDMA GB/s']:7.1f} GB/s (RDMA)" if "RDMA GB/s" in r else ""
                nvl = f"{r['GB/s']:7.1f} GB/s (NVL)" if "GB/s" in r else ""
                vs = f", {r['vs_naive']}x the naive path's speed" if "vs_naive" in r else ""
                sms = f", {r['SMs']} SMs" if r.get("SMs") else ""
                print(f"[{r['op']}{sms}] {r['us']:8.2f} us {nvl}{extra}{vs}", flush=True)
    finally:
        stream.synchronize()
        comm_barrier(comm, "bench internode: before destroy")
        buf.destroy()
    return rows


def _at_sms(buf, timed, cfg, naive, x_bf16, fp8_col, fp8_row, topk_idx, topk_weights, per_rank, per_rdma,
            per_expert, in_rank, rdma_bf16, fp8_factor) -> tuple[list[dict], int]:
    """The rows of one SM count (``cfg.num_sms``): a dispatch with the layout, on whose handle the cached
    dispatches and the combine run; and the BF16 bytes this rank receives."""
    rows: list[dict] = []

    def dispatch_full():
        return buf.dispatch(x_bf16, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                            topk_weights=topk_weights, config=cfg)

    recv_x, _, recv_w, _, handle, _ = dispatch_full()
    nvl_bf16 = int(recv_x.shape[0]) * x_bf16.shape[1] * 2

    def add(name, us, factor, naive_us=None):
        extra = {"RDMA GB/s": round(rdma_bf16 * factor / (us * 1e-6) / 1e9, 1)}
        if naive_us:
            extra["vs_naive"] = round(naive_us / us, 2)
        rows.append(row(name, us, nvl_bf16 * factor, cfg.num_sms, **extra))

    add("internode dispatch BF16 (notify + sync)", timed(dispatch_full), 1, naive.get("naive NCCL dispatch"))
    for name, data, factor in (("internode dispatch BF16 (cached)", x_bf16, 1),
                               ("internode dispatch FP8 (cached, column-major scales)", fp8_col, fp8_factor),
                               ("internode dispatch FP8 (cached, row-major scales)", fp8_row, fp8_factor)):
        us = timed(lambda data=data: buf.dispatch(data, handle=handle, config=cfg))
        add(name, us, factor, naive.get("naive NCCL dispatch") if factor == 1 else None)
    add("internode combine BF16", timed(lambda: buf.combine(recv_x, handle, topk_weights=recv_w, config=cfg)), 1,
        naive.get("naive NCCL combine"))
    return rows, nvl_bf16

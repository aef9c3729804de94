"""What a user would do without this library, measured in the same run as our kernels:

* the naive expert-parallel path in PyTorch + NCCL: gather one copy of each token per destination rank,
  ``all_to_all_single`` of the counts, then of the data; combine sends the rows back with
  ``all_to_all_single`` and sums them with ``index_add_``;
* the copy engine's NVLink bandwidth between GPU 0 and GPU 1 (one way and both ways at once).
"""

from __future__ import annotations

import os

from ..device.streams import external_stream
from ..device.torch_dist import init_torch_distributed
from .timing import row, time_op

__all__ = ["run"]


def _torch_nccl(comm):
    import torch
    import torch.distributed as dist


    init_torch_distributed(comm, "nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    return torch, dist


def routing(torch, num_tokens, num_experts, num_topk, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.randn(num_tokens, num_experts, device="cuda", generator=gen).abs() + 1
    return torch.topk(scores, num_topk, dim=-1, sorted=False).indices


def naive_ep(comm, num_tokens=4096, hidden=7168, num_experts=256, num_topk=8) -> list[dict]:
    torch, dist = _torch_nccl(comm)
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    experts_per_rank = num_experts // num_ranks
    topk_idx = routing(torch, num_tokens, num_experts, num_topk, 1000 + rank)
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    in_rank = torch.zeros(num_tokens, num_ranks, dtype=torch.bool, device="cuda")
    in_rank.scatter_(1, topk_idx // experts_per_rank, True)
    stream = torch.cuda.current_stream()

    cstream = external_stream(stream.cuda_stream, stream.device.index)
    state = {}

    def dispatch():
        dst, tok = in_rank.t().nonzero(as_tuple=True)
        send = x.index_select(0, tok)
        send_counts = torch.bincount(dst, minlength=num_ranks)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        splits_in, splits_out = recv_counts.tolist(), send_counts.tolist()
        recv = torch.empty(sum(splits_in), hidden, device="cuda", dtype=x.dtype)
        dist.all_to_all_single(recv, send, splits_in, splits_out)
        state.update(tok=tok, recv=recv, splits_in=splits_in, splits_out=splits_out)

    def combine():
        back = torch.empty(sum(state["splits_out"]), hidden, device="cuda", dtype=x.dtype)
        dist.all_to_all_single(back, state["recv"], state["splits_out"], state["splits_in"])
        out = torch.zeros(num_tokens, hidden, device="cuda", dtype=torch.float32)
        out.index_add_(0, state["tok"], back.float())
        return out.to(torch.bfloat16)

    dispatch()
    recv_bytes = state["recv"].numel() * 2
    # The dispatch syncs with the host twice (nonzero, the counts' tolist), so it is timed on an idle stream,
    # host included, like the non-cached dispatch; the combine has no sync and is timed in GPU time (the GPU
    # parked while the host issues it), like the intranode suite.
    t_dispatch = time_op(dispatch, stream=cstream)
    t_combine = time_op(combine, stream=cstream, park_us=400)
    return [row("naive NCCL dispatch", t_dispatch, recv_bytes,
                note="gather + 2x all_to_all_single, host syncs included"),
            row("naive NCCL combine", t_combine, recv_bytes, note="all_to_all_single + index_add_")]


def copy_engine(comm, nbytes=1 << 30) -> list[dict]:
    """Rank 0 drives the copy engines between GPU 0 and GPU 1 (peer copies, one way and both ways)."""
    rows = []
    if comm.Get_rank() == 0:
        try:
            rows = _copy_engine_rows(nbytes)
        except Exception as exc:  # the other ranks wait in bcast below, so never leave without it
            rows = [{"op": "copy engine", "note": f"failed: {type(exc).__name__}: {exc}"}]
    return comm.bcast(rows, root=0)


def _copy_engine_rows(nbytes):
    import cupy

    rt = cupy.cuda.runtime
    if rt.getDeviceCount() < 2:
        return []
    bufs, streams = {}, {}
    for d in (0, 1):
        with cupy.cuda.Device(d):
            try:
                rt.deviceEnablePeerAccess(1 - d)
            except cupy.cuda.runtime.CUDARuntimeError:
                pass  # already enabled
            bufs[d] = (cupy.empty(nbytes, cupy.uint8), cupy.empty(nbytes, cupy.uint8))
            streams[d] = cupy.cuda.Stream(non_blocking=True)

    def copy(dst_dev, src_dev, which, stream_dev):
        rt.memcpyPeerAsync(bufs[dst_dev][which].data.ptr, dst_dev, bufs[src_dev][which].data.ptr, src_dev, nbytes,
                           streams[stream_dev].ptr)

    def both():
        with cupy.cuda.Device(0):
            start = cupy.cuda.Event()
            start.record(streams[0])
        with cupy.cuda.Device(1):
            streams[1].wait_event(start)
            copy(0, 1, 1, 1)
            done = cupy.cuda.Event()
            done.record(streams[1])
        with cupy.cuda.Device(0):
            copy(1, 0, 0, 0)
            streams[0].wait_event(done)

    with cupy.cuda.Device(0):
        one = time_op(lambda: copy(1, 0, 0, 0), warmup=2, iters=5, stream=streams[0])
        two = time_op(both, warmup=2, iters=5, stream=streams[0])
    return [row("copy engine 0->1", one, nbytes), row("copy engine both ways", two, 2 * nbytes)]


def run(comm, args) -> list[dict]:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    rows = copy_engine(comm)
    try:
        rows += naive_ep(comm, num_tokens=args.tokens, hidden=args.hidden, num_experts=args.experts,
                         num_topk=args.topk)
    except ImportError as exc:
        rows.append({"op": "naive NCCL path", "note": f"skipped: {exc}"})
    return rows

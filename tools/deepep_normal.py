"""GPU time of the normal kernels through whatever ``import deep_ep`` loads, at several SM counts: DeepEP
itself, or this library with ``DEEPEP_CUPY_AS_DEEP_EP=1``. Run it once each way on the same GPUs:

    mpirun -np 2 -x DEEPEP_CUPY_AS_DEEP_EP=1 python tools/deepep_normal.py --num-sms 24,12,8
    mpirun -np 2 -x PYTHONPATH=<DeepEP build> python tools/deepep_normal.py --num-sms 24,12,8

DeepEP's normal workload (4096 tokens x 7168, top-8 of 256, random scores per rank), torch tensors, one GPU
per rank, NCCL process group. Per SM count, with DeepEP's recommended chunk sizes for the rank count: the
cached BF16 dispatch, the cached FP8 dispatch with column-major scales, and the combine with top-k weights
over the BF16 handle. Each op: warm-up, then the GPU parked behind a sleep kernel while the host queues
``--iters`` calls, events around the calls: GPU time per call with the host's issue time hidden (the same
timing for both libraries). Rank 0 prints the slowest rank's time per op as ``NORMAL <op> <SMs> <us>``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from deepep_compare import events_over, import_deep_ep, init_group  # noqa: E402  (after the path)

# DeepEP's recommended chunk sizes (send, recv) for the normal kernels by rank count.
DISPATCH_CHUNKS = {2: (24, 256), 4: (6, 256), 8: (6, 256)}
COMBINE_CHUNKS = {2: (10, 256), 4: (9, 256), 8: (4, 256)}


def gpu_time(fn, iters: int, park_cycles: int) -> float:
    """Microseconds a call, the calls queued behind a sleep kernel so the host's issue time is hidden."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(park_cycles)
    return events_over(fn, iters)


def _at_sms(buf, group, sms: int, dispatch_chunks, combine_chunks, inputs, args) -> list[tuple[str, float]]:
    """(op, the slowest rank's us) for each op on a handle made by a dispatch on ``sms`` SMs."""
    import deep_ep

    x, x_fp8, scales, topk_idx, topk_weights, layout = inputs
    per_rank, per_rdma, per_expert, in_rank, _ = layout
    cfg_d, cfg_c = deep_ep.Config(sms, *dispatch_chunks), deep_ep.Config(sms, *combine_chunks)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights, config=cfg_d)
    ops = (("dispatch BF16 cached", lambda: buf.dispatch(x, handle=handle, config=cfg_d)),
           ("dispatch FP8 cached col-major", lambda: buf.dispatch((x_fp8, scales), handle=handle, config=cfg_d)),
           ("combine BF16", lambda: buf.combine(recv_x, handle, topk_weights=recv_w, config=cfg_c)))
    out = []
    for name, fn in ops:
        dist.barrier(group)
        us = min(gpu_time(fn, args.iters, args.park_cycles) for _ in range(args.repeats))
        worst = torch.tensor([us], device="cuda")
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
        out.append((name, float(worst.item())))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-sms", default="24,12,8")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3, help="timings per op; the best is printed")
    p.add_argument("--park-cycles", type=int, default=40_000_000)
    args = p.parse_args()
    rank, size = init_group(29534)
    deep_ep = import_deep_ep()

    group = dist.new_group(list(range(size)))
    tokens, hidden, experts, topk = 4096, 7168, 256, 8
    counts = [int(s) for s in args.num_sms.split(",")]
    send_d, recv_d = DISPATCH_CHUNKS.get(size, (6, 256))
    send_c, recv_c = COMBINE_CHUNKS.get(size, (4, 256))
    nvl = max(deep_ep.Config(max(counts), send_d, recv_d).get_nvl_buffer_size_hint(hidden * 2, size),
              deep_ep.Config(max(counts), send_c, recv_c).get_nvl_buffer_size_hint(hidden * 2, size))
    buf = deep_ep.Buffer(group, num_nvl_bytes=nvl, explicitly_destroy=True)
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    scores = torch.randn((tokens, experts), device="cuda", generator=gen).abs() + 1
    topk_idx = torch.topk(scores, topk, dim=-1).indices.to(torch.int64)
    topk_weights = torch.rand((tokens, topk), dtype=torch.float32, device="cuda", generator=gen)
    x = torch.randn((tokens, hidden), dtype=torch.bfloat16, device="cuda", generator=gen)
    x_fp8 = torch.randn((tokens, hidden), device="cuda", generator=gen).clamp(-400, 400).to(torch.float8_e4m3fn)
    scales = torch.rand((hidden // 128, tokens), dtype=torch.float32, device="cuda", generator=gen).T  # column-major
    inputs = (x, x_fp8, scales, topk_idx, topk_weights, buf.get_dispatch_layout(topk_idx, experts))
    results = []
    try:
        for sms in counts:
            for name, us in _at_sms(buf, group, sms, (send_d, recv_d), (send_c, recv_c), inputs, args):
                results.append((name, sms, us))
    finally:
        torch.cuda.synchronize()
        dist.barrier(group)
        buf.destroy()
    if rank == 0:
        for name, sms, us in results:
            print(f"NORMAL {name:32s} {sms:3d} SMs {us:9.1f} us", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

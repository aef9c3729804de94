"""Channels per block and ring sizes of the internode kernels at a few SM counts: every setting timed and checked.

    mpirun -np 2 -x DEEPEP_CUPY_NVL_RANKS=1 python tools/internode_sweep.py --num-sms 8,12,24 \\
        --sub-channels 2,4,8,12,16 --rdma-recv 128,256 --rdma-send 8,16 --copied-own-rows

A setting is (SMs, sub_channels, RDMA ring, RDMA chunk, own rows): ``sub_channels`` is the engine's tuning attribute
(channels a block runs; a compile-time parameter), the rings are the Config the ops get
(``num_max_rdma_chunked_recv_tokens`` per SM pair, split between the block's channels, and
``num_max_rdma_chunked_send_tokens``, the publish chunk), own rows by the kernel (the engine's default; the
"own" column says "sm" where the SMs copied all) or by device-to-device copies (``use_own_row_copies = True``,
"cp" where they moved any; ``--copied-own-rows`` adds that setting at each SM count; ops/own_rows.py says why
they are off by default: the driver runs them on SMs outside the launch's count); with domains of
more than one rank the column says "pl" where every rank's outputs lay in its output pool (rows in place) and
"rg" where some went through the NVLink rings (``--ring-rows`` adds the setting with ``use_output_pool = False``),
the rest of the Config as the bench's (``Config(num_sms, 8, 512, 16, 128)``, which is also the reference
setting). For each setting, on a handle made by a dispatch with that setting, three ops:
  dispatch BF16  cached
  dispatch FP8   cached, column-major scales
  combine BF16   with top-k weights
on the bench's inputs (4096 tokens x 7168, top-8 of 256 experts). Times: CUDA-event medians of ``--iters``
calls after ``--warmup`` (``deepep_cupy.bench.timing.time_op``, the GPU parked ahead of each start event),
the slowest rank's median, on torch tensors and torch's current stream. Each setting's received rows (BF16,
FP8 and scales) and combined rows and weights are compared bit for bit with the reference setting's at the
same SM count (the handles differ: their channel count is the setting's); a difference is a failure. The
naive NCCL path of the bench (``deepep_cupy.bench.baselines.naive_ep``) is timed once, and each row gives the
ratio of our time to its time (the goal: at most 0.5 for dispatch and combine).

The buffers are sized for the largest setting. Kernel waits give up after ``--timeout-s`` (then the engine is
unusable and the sweep stops).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepep_cupy.bench.timing import parse_sm_counts  # noqa: E402  (after the path)

BENCH_CONFIG = (8, 512, 16, 128)  # nvl send, nvl recv, rdma send, rdma recv: the bench's Config


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(dict.fromkeys(int(v) for v in text.split(",") if v.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N[,N...], got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def command_line() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/internode_sweep.py", description=__doc__.splitlines()[0])
    p.add_argument("--num-sms", type=parse_sm_counts, default=(8, 12, 24), metavar="N[,N...]")
    p.add_argument("--sub-channels", type=int_list, default=None, metavar="S[,S...]",
                   help="channels per block (default: 2, 4, the default, and the most a 1024-thread block takes)")
    p.add_argument("--rdma-recv", type=int_list, default=(128,), metavar="N[,N...]",
                   help="Config.num_max_rdma_chunked_recv_tokens (RDMA ring slots per SM pair)")
    p.add_argument("--rdma-send", type=int_list, default=(16,), metavar="N[,N...]",
                   help="Config.num_max_rdma_chunked_send_tokens (slots per publish, at most half a ring)")
    p.add_argument("--copied-own-rows", action="store_true",
                   help="also time the reference setting with the own rows moved by device-to-device copies (one "
                        "rank a domain)")
    p.add_argument("--ring-rows", action="store_true",
                   help="also time the reference setting with every row through the NVLink rings (domains of more "
                        "than one rank: the engine's use_output_pool = False)")
    workload_arguments(p)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--jobs", type=int, default=None, help="compile workers (default: the precompiler's)")
    p.add_argument("--timeout-s", type=float, default=20.0, help="kernel wait budget (the engine's timeout_s)")
    return p


def rank_and_domains(comm):
    """``(rank, ranks, L, D)`` of ``comm``, this rank's GPU made current for CuPy and torch (as the bench), the
    domain size from ``DEEPEP_CUPY_NVL_RANKS`` (default 1); None, said on stderr, when the ranks do not make
    two or more domains of that size."""
    import cupy
    import torch

    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    lsize = int(os.environ.get("DEEPEP_CUPY_NVL_RANKS", "1"))
    if num_ranks % lsize or num_ranks // lsize < 2:
        print(f"{num_ranks} ranks do not make 2 or more domains of {lsize}", file=sys.stderr)
        return None
    return rank, num_ranks, lsize, num_ranks // lsize


def workload_arguments(p: argparse.ArgumentParser) -> None:
    """The bench's workload (tokens x hidden, top-k of experts), as options of ``p``."""
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)


def settings(args, lsize: int, ndom: int) -> list[tuple]:
    """``(sms, sub or None, rdma_recv, rdma_send, own_row_copies, output_pool)``, the reference setting first at
    each SM count (``own_row_copies`` None: the engine's default, the SMs copy the own rows; True: copies;
    ``output_pool`` False: outputs outside the pool, so rows go through the NVLink rings)."""
    from deepep_cupy.ops.internode import layout as IL

    top = IL.max_sub_channels(lsize, ndom)
    out = []
    for sms in args.num_sms:
        default = IL.sub_channels(lsize, ndom, sms)  # the default at this SM count
        subs = args.sub_channels or tuple(sorted({min(2, top), min(4, top), default, top}))
        out.append((sms, None, BENCH_CONFIG[3], BENCH_CONFIG[2], None, True))
        if args.copied_own_rows and lsize == 1:
            out.append((sms, default, BENCH_CONFIG[3], BENCH_CONFIG[2], True, True))
        if args.ring_rows and lsize > 1:
            out.append((sms, default, BENCH_CONFIG[3], BENCH_CONFIG[2], None, False))
        for sub, recv, send in itertools.product(subs, args.rdma_recv, args.rdma_send):
            if sub > top or send >= recv:
                continue
            if (sub, recv, send) != (default, BENCH_CONFIG[3], BENCH_CONFIG[2]):
                out.append((sms, sub, recv, send, None, True))
    return out


def precompile(lsize: int, ndom: int, subs, jobs: int | None) -> str:
    """Compile the notify kernel and the dispatch and combine of each of ``subs`` channels a block, as the engine's
    spec functions give them (the sweep's, or internode_waits' diagnostics builds), in worker processes into
    ``$DEEPEP_CUPY_CACHE_DIR``, so no rank waits in a kernel for a peer that is still compiling; one line of
    summary."""
    import io
    import time

    from deepep_cupy.jit.precompile import Job, default_arch, run
    from deepep_cupy.ops.internode.engine import combine_spec, dispatch_spec, notify_spec

    specs = [notify_spec(lsize, ndom)]
    specs += [s for sub in sorted(set(subs)) for s in (dispatch_spec(lsize, ndom, sub), combine_spec(lsize, ndom, sub))]
    arch, start = default_arch(), time.perf_counter()
    report = run([Job("internode", s, arch) for s in specs], workers=jobs, out=io.StringIO())
    line = (f"precompile: {len(specs)} kernels for {arch}: {report.compiled} compiled, {report.verified} from the "
            f"cache, {len(report.failed)} failed, {time.perf_counter() - start:.1f} s")
    return "\n".join([line, *report.failed])


def config(sms: int, recv: int, send: int):
    from deepep_cupy import Config

    return Config(sms, BENCH_CONFIG[0], BENCH_CONFIG[1], send, recv)


def same(a, b) -> bool:
    """Bit-for-bit equality of two torch tensors (NaNs and signed zeros included)."""
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    import torch

    return bool(torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))


def measure(buf, cfg, layout, inputs, timed):
    """A dispatch with ``cfg`` for the handle, then the three ops timed; returns ``(channels, times, outputs)``."""
    x_bf16, x_fp8, scales_col, topk_idx, topk_weights = inputs
    per_rank, per_rdma, per_expert, in_rank, _ = layout
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(
        x_bf16, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights, config=cfg)

    def bf16():
        return buf.dispatch(x_bf16, handle=handle, config=cfg)[0]

    def fp8():
        return buf.dispatch((x_fp8, scales_col), handle=handle, config=cfg)[0]

    def comb():
        return buf.combine(recv_x, handle, topk_weights=recv_w, config=cfg)[:2]

    times = {"bf16": timed(bf16), "fp8": timed(fp8), "combine": timed(comb)}
    return int(handle[1].shape[1]), times, {"bf16": [bf16()], "fp8": list(fp8()), "combine": list(comb())}


def main() -> int:
    args = command_line().parse_args()
    import torch
    from mpi4py import MPI

    from deepep_cupy import Buffer
    from deepep_cupy.bench.baselines import naive_ep
    from deepep_cupy.bench.timing import time_op
    from deepep_cupy.device.group import comm_barrier
    from deepep_cupy.device.streams import current_stream
    from deepep_cupy.ops.internode import layout as IL

    comm = MPI.COMM_WORLD
    shape = rank_and_domains(comm)
    if shape is None:
        return 2
    rank, num_ranks, lsize, ndom = shape
    todo = settings(args, lsize, ndom)
    if rank == 0:
        subs = [sub if sub is not None else IL.sub_channels(lsize, ndom, sms) for sms, sub, _, _, _, _ in todo]
        print(precompile(lsize, ndom, subs, args.jobs), flush=True)
    comm.Barrier()
    hidden = args.hidden
    cfgs = [config(sms, recv, send) for sms, _, recv, send, _, _ in todo]
    nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden * 2, num_ranks) for c in cfgs)
    # The hint assumes DeepEP's channel count; more channels a block split the same ring bytes, and their
    # meta records (a few KiB) get the slack.
    rdma_bytes = max(c.get_rdma_buffer_size_hint(hidden * 2, num_ranks, lsize) for c in cfgs) + (1 << 20)
    buf = Buffer(comm=comm, num_nvl_bytes=nvl_bytes, num_rdma_bytes=rdma_bytes, num_nvl_ranks=lsize,
                 explicitly_destroy=True)
    engine = buf.runtime.internode
    engine.timeout_s = args.timeout_s
    stream = current_stream("torch", torch.cuda.current_device())
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    n, e, k = args.tokens, args.experts, args.topk
    scores = torch.randn(n, e, device="cuda", generator=gen).abs() + 1
    topk_idx = torch.topk(scores, k, dim=-1).indices.to(torch.int64).contiguous()
    topk_weights = torch.rand(n, k, device="cuda", generator=gen)
    x_bf16 = torch.randn(n, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    x_fp8 = torch.randn(n, hidden, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    scales_col = (torch.rand(hidden // 128, n, device="cuda", generator=gen) + 0.5).T  # column-major

    def timed(fn) -> float:
        us = time_op(fn, warmup=args.warmup, iters=args.iters, stream=stream, park_us=400)
        return comm.allreduce(us, op=MPI.MAX)

    failures = 0
    table = []
    reference = {}
    try:
        naive = {r["op"]: r["us"] for r in naive_ep(comm, n, hidden, e, k)}
        stream.synchronize()
        layout = buf.get_dispatch_layout(topk_idx, e)
        inputs = (x_bf16, x_fp8, scales_col, topk_idx, topk_weights)
        for sms, sub, recv, send, own, pool in todo:
            engine.sub_channels, engine.use_own_row_copies, engine.use_output_pool = sub, own, pool
            cfg = config(sms, recv, send)
            used = engine.channels_per_block(sms)
            cap, chunk, _ = IL.ring_sizes(cfg, used)
            copies, placed = engine.own_copies, engine.pool_dispatches
            channels, t, flat = measure(buf, cfg, layout, inputs, timed)
            stream.synchronize()
            engine.check_errors()
            if sub is None:
                reference[sms] = flat
                match = "reference"
            else:
                ok = all(same(a, b) for op in flat for a, b in zip(flat[op], reference[sms][op], strict=True))
                ok = comm.allreduce(int(ok), op=MPI.MIN) == 1
                failures += not ok
                match = "same" if ok else "DIFFERENT"
            # Device copies moved own rows in this setting (one rank a domain), or the outputs lay in the
            # output pool, so the forwarders wrote rows in place (more).
            if lsize == 1:
                mode = "cp" if engine.own_copies > copies else "sm"
            else:
                # Every rank's outputs in its pool in some of the setting's dispatches (a full pool falls back).
                everywhere = comm.allreduce(int(engine.pool_dispatches > placed), op=MPI.MIN)
                mode = "pl" if everywhere else "rg"
            table.append((sms, used if sub is not None else f"{used}*", channels, recv, send, cap, chunk, mode, t,
                          match))
            if rank == 0:
                print(_fmt(table[-1], naive), flush=True)
    finally:
        stream.synchronize()
        comm_barrier(comm, "internode sweep: before destroy")
        buf.destroy()
    if rank == 0:
        print(f"\nnaive NCCL path (bench): dispatch {naive.get('naive NCCL dispatch', 0):.1f} us, combine "
              f"{naive.get('naive NCCL combine', 0):.1f} us; * = default sub_channels with the bench's Config")
        print(_header())
        for r in table:
            print(_fmt(r, naive))
        if failures:
            print(f"{failures} setting(s) gave outputs different from the reference setting's")
    return 1 if failures else 0


def _header() -> str:
    return (f"{'SMs':>4} {'sub':>4} {'C':>4} {'rdma_recv':>9} {'send':>5} {'cap/ch':>6} {'chunk':>5} {'own':>3} "
            f"{'BF16 us':>9} {'FP8 us':>9} {'comb us':>9} {'BF16/naive':>10} {'FP8/BF16':>8} {'comb/naive':>10}  match")


def _fmt(r, naive) -> str:
    sms, sub, channels, recv, send, cap, chunk, own, t, match = r
    nd, nc = naive.get("naive NCCL dispatch"), naive.get("naive NCCL combine")
    rd = f"{t['bf16'] / nd:10.2f}" if nd else f"{'-':>10}"
    rc = f"{t['combine'] / nc:10.2f}" if nc else f"{'-':>10}"
    return (f"{sms:>4} {sub!s:>4} {channels:>4} {recv:>9} {send:>5} {cap:>6} {chunk:>5} {own:>3} {t['bf16']:9.1f} "
            f"{t['fp8']:9.1f} {t['combine']:9.1f} {rd} {t['fp8'] / t['bf16']:8.2f} {rc}  {match}")


if __name__ == "__main__":
    sys.exit(main())

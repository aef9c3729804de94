"""Time the internode kernels' channels a block and ring sizes at a few SM counts, every setting checked.

    mpirun -np 2 -x DEEPEP_CUPY_NVL_RANKS=1 python -m deepep_cupy.tuning internode --num-sms 8,12,24 \\
        --sub-channels 2,4,8,12,16 --rdma-recv 128,256 --rdma-send 8,16

A setting is (SMs, sub_channels, RDMA ring, RDMA chunk): 'sub_channels' is the engine's tuning attribute
(channels a block runs, a compile-time parameter; its default is buffer_map.sub_channels in ops/internode),
the rings are the Config the ops get ('num_max_rdma_chunked_recv_tokens' per SM pair, split between the
block's channels, and 'num_max_rdma_chunked_send_tokens', the publish chunk), the rest of the Config as the
benchmark's ('Config(num_sms, 8, 512, 16, 128)' with the default sub_channels is the reference setting). For
each setting, on a handle made by a dispatch with that setting, three ops are timed, a cached BF16 dispatch, a
cached FP8 dispatch with column-major scales and a BF16 combine with top-k weights, on the benchmark's inputs:
CUDA-event medians of '--iters' calls after '--warmup' (the GPU parked ahead of each start event), the slowest
rank's median, on torch tensors and torch's current stream. Each setting's received rows (BF16, FP8 and
scales) and combined rows and weights are compared bit for bit with the reference setting's at the same SM
count; a difference is a failure. The benchmark's naive NCCL path is timed once, and each row gives the ratio
of our time to its time. With domains of more than one rank the 'out' column says 'pl' where every rank's
outputs lay in its output pool (rows written in place) and 'rg' where some went through the NVLink rings.
Nothing is stored: the defaults in ops/internode/buffer_map.py are edited by hand from the table.

The domain size is DEEPEP_CUPY_NVL_RANKS (default 1); the ranks must make two or more domains. The buffers
are sized for the largest setting. Kernel waits give up after '--timeout-s' (then the engine is unusable and
the sweep stops).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

from ..bench.timing import parse_sm_counts
from .common import check_positive, compile_specs, int_list, require_gpu_and_mpi, workload_arguments

__all__ = ["main", "command_line", "settings", "precompile", "config", "rank_and_domains", "BENCH_CONFIG"]

PROG = "python -m deepep_cupy.tuning internode"
BENCH_CONFIG = (8, 512, 16, 128)  # nvl send, nvl recv, rdma send, rdma recv: the benchmark's Config


def command_line() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.replace("``", "'"),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Run it under mpirun with one rank per GPU.")
    p.add_argument("--num-sms", type=parse_sm_counts, default=(8, 12, 24), metavar="N[,N...]",
                   help="SM counts (default: 8,12,24)")
    p.add_argument("--sub-channels", type=int_list, default=None, metavar="S[,S...]",
                   help="channels per block to try (default: 2, 4, the default at each SM count, and the most a "
                        "1024-thread block takes)")
    p.add_argument("--rdma-recv", type=int_list, default=(BENCH_CONFIG[3],), metavar="N[,N...]",
                   help=f"Config.num_max_rdma_chunked_recv_tokens, RDMA ring slots per SM pair (default: {BENCH_CONFIG[3]})")
    p.add_argument("--rdma-send", type=int_list, default=(BENCH_CONFIG[2],), metavar="N[,N...]",
                   help="Config.num_max_rdma_chunked_send_tokens, slots per publish, less than a ring "
                        f"(default: {BENCH_CONFIG[2]})")
    workload_arguments(p)
    p.add_argument("--iters", type=int, default=30, help="timed calls per op and setting (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before them (default: %(default)s)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: one per CPU)")
    p.add_argument("--timeout-s", type=float, default=20.0,
                   help="kernel wait budget, the engine's timeout_s (default: %(default)g)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = command_line()
    args = parser.parse_args(argv)
    check_positive(parser, args, ("tokens", "hidden", "experts", "topk", "iters"))
    if args.warmup < 0:
        parser.error("--warmup must not be negative")
    return args


def settings(args, lsize: int, ndom: int) -> list[tuple]:
    """``(sms, sub or None, rdma_recv, rdma_send)``, the reference setting (sub None: the default, with the
    benchmark's rings) first at each SM count; settings whose chunk is not below its ring, or whose channels do
    not fit a block, are left out."""
    from ..ops.internode import buffer_map as IL

    top = IL.max_sub_channels(lsize, ndom)
    out = []
    for sms in args.num_sms:
        default = IL.sub_channels(lsize, ndom, sms)  # the default at this SM count
        subs = args.sub_channels or tuple(sorted({min(2, top), min(4, top), default, top}))
        out.append((sms, None, BENCH_CONFIG[3], BENCH_CONFIG[2]))
        for sub, recv, send in itertools.product(subs, args.rdma_recv, args.rdma_send):
            if sub > top or send >= recv:
                continue
            if (sub, recv, send) != (default, BENCH_CONFIG[3], BENCH_CONFIG[2]):
                out.append((sms, sub, recv, send))
    return out


def rank_and_domains(comm):
    """``(rank, ranks, L, D)`` of ``comm``, this rank's GPU made current for CuPy and torch (as the benchmark
    does), the domain size ``L`` from ``DEEPEP_CUPY_NVL_RANKS`` (default 1); None, said on stderr, when the ranks
    do not make two or more domains of that size."""
    import cupy
    import torch

    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    lsize = int(os.environ.get("DEEPEP_CUPY_NVL_RANKS", "1"))
    if num_ranks % lsize or num_ranks // lsize < 2:
        print(f"{num_ranks} ranks do not make 2 or more domains of {lsize} (DEEPEP_CUPY_NVL_RANKS)", file=sys.stderr)
        return None
    return rank, num_ranks, lsize, num_ranks // lsize


def precompile(lsize: int, ndom: int, subs, jobs: int | None) -> str:
    """Compile the notify kernel and the dispatch and combine of each of ``subs`` channels a block
    (:func:`~.common.compile_specs`), as the engine's spec functions give them when called: a caller that
    replaced them gets its own builds."""
    from ..ops.internode.engine import combine_spec, dispatch_spec, notify_spec

    specs = [notify_spec(lsize, ndom)]
    specs += [s for sub in sorted(set(subs)) for s in (dispatch_spec(lsize, ndom, sub), combine_spec(lsize, ndom, sub))]
    return compile_specs("internode", specs, jobs)


def config(sms: int, recv: int, send: int):
    """The benchmark's Config with ``sms`` SMs and the RDMA ring ``recv`` and chunk ``send``."""
    from ..config import Config

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


def _sweep(comm, args, shape, todo, print_row) -> tuple[list, dict, int]:
    """Every setting of ``todo`` on every rank: ``(table rows, the naive path's times, failures)``."""
    import torch
    from mpi4py import MPI

    from ..bench.baselines import naive_ep
    from ..bench.timing import time_op
    from ..buffer import Buffer
    from ..device.group import comm_barrier
    from ..device.streams import current_stream
    from ..ops.internode import buffer_map as IL

    rank, num_ranks, lsize, ndom = shape
    hidden = args.hidden
    cfgs = [config(sms, recv, send) for sms, _, recv, send in todo]
    nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden * 2, num_ranks) for c in cfgs)
    # The hint assumes DeepEP's channel count; more channels a block split the same ring bytes, and their
    # meta records (a few KiB) get the slack.
    rdma_bytes = max(c.get_rdma_buffer_size_hint(hidden * 2, num_ranks, lsize) for c in cfgs) + (1 << 20)
    buf = Buffer(comm=comm, num_nvl_bytes=nvl_bytes, num_rdma_bytes=rdma_bytes, num_nvl_ranks=lsize,
                 explicitly_destroy=True)
    engine = buf.runtime.internode
    engine.tune(timeout_s=args.timeout_s)
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

    failures, table, reference, naive = 0, [], {}, {}
    try:
        naive = {r["op"]: r["us"] for r in naive_ep(comm, n, hidden, e, k)}
        stream.synchronize()
        layout = buf.get_dispatch_layout(topk_idx, e)
        inputs = (x_bf16, x_fp8, scales_col, topk_idx, topk_weights)
        for sms, sub, recv, send in todo:
            engine.tune(sub_channels=sub)
            cfg = config(sms, recv, send)
            used = engine.channels_per_block(sms)
            cap, chunk, _ = IL.ring_sizes(cfg, used)
            placed = engine.pool_dispatches
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
            if lsize == 1:
                out = "-"  # no NVLink stage: the forwarders write the outputs themselves
            else:
                # Every rank's outputs in its pool in this setting's dispatches (a full pool falls back to the rings).
                everywhere = comm.allreduce(int(engine.pool_dispatches > placed), op=MPI.MIN)
                out = "pl" if everywhere else "rg"
            table.append((sms, used if sub is not None else f"{used}*", channels, recv, send, cap, chunk, out, t,
                          match))
            print_row(table[-1], naive)
    finally:
        stream.synchronize()
        comm_barrier(comm, "internode sweep: before destroy")
        buf.destroy()
    return table, naive, failures


def main(argv=None) -> int:
    """``python -m deepep_cupy.tuning internode [options]``: 0 when every setting matched the reference, 1 when
    some did not, 2 when the ranks make no two domains."""
    args = parse_args(argv)
    require_gpu_and_mpi(PROG, "the internode sweep needs")
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit(f"{PROG}: needs torch (it times torch tensors on torch's current stream)")
    from mpi4py import MPI

    from ..ops.internode import buffer_map as IL

    comm = MPI.COMM_WORLD
    shape = rank_and_domains(comm)
    if shape is None:
        return 2
    rank, _, lsize, ndom = shape
    todo = settings(args, lsize, ndom)
    if rank == 0:
        subs = [sub if sub is not None else IL.sub_channels(lsize, ndom, sms) for sms, sub, _, _ in todo]
        print(precompile(lsize, ndom, subs, args.jobs), flush=True)
    comm.Barrier()
    say = print if rank == 0 else (lambda *a, **k: None)
    table, naive, failures = _sweep(comm, args, shape, todo, lambda row, naive: say(format_row(row, naive),
                                                                                    flush=True))
    say(f"\nnaive NCCL path (bench): dispatch {naive.get('naive NCCL dispatch', 0):.1f} us, combine "
        f"{naive.get('naive NCCL combine', 0):.1f} us; * = default sub_channels with the bench's Config")
    say(header())
    for row in table:
        say(format_row(row, naive))
    if failures:
        say(f"{failures} setting(s) gave outputs different from the reference setting's")
    return 1 if failures else 0


def header() -> str:
    return (f"{'SMs':>4} {'sub':>4} {'C':>4} {'rdma_recv':>9} {'send':>5} {'cap/ch':>6} {'chunk':>5} {'out':>3} "
            f"{'BF16 us':>9} {'FP8 us':>9} {'comb us':>9} {'BF16/naive':>10} {'FP8/BF16':>8} {'comb/naive':>10}  match")


def format_row(r, naive: dict) -> str:
    """One setting: SMs, channels a block (``*``: the default), channels, rings, out, times and ratios, match."""
    sms, sub, channels, recv, send, cap, chunk, out, t, match = r
    nd, nc = naive.get("naive NCCL dispatch"), naive.get("naive NCCL combine")
    rd = f"{t['bf16'] / nd:10.2f}" if nd else f"{'-':>10}"
    rc = f"{t['combine'] / nc:10.2f}" if nc else f"{'-':>10}"
    return (f"{sms:>4} {sub!s:>4} {channels:>4} {recv:>9} {send:>5} {cap:>6} {chunk:>5} {out:>3} {t['bf16']:9.1f} "
            f"{t['fp8']:9.1f} {t['combine']:9.1f} {rd} {t['fp8'] / t['bf16']:8.2f} {rc}  {match}")

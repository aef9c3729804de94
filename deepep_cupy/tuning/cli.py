"""Tune the intranode dispatch and combine configs for this machine and store them.

    mpirun -np <gpus> python -m deepep_cupy.tuning --hidden 7168

Sweeps the SM count and the NVLink chunk sizes of the high-throughput kernels (the send batch,
``num_max_nvl_chunked_send_tokens``, and the receive ring capacity, ``num_max_nvl_chunked_recv_tokens``)
for the rank count it runs with and ``--hidden``, timing each point as the intranode benchmark does (the
slowest rank's median of CUDA-event timings). The best configs go to ``tuned_configs.json`` in the kernel
cache directory, keyed by GPU model, rank count and hidden size, where ``Buffer.get_dispatch_config`` and
``get_combine_config`` find them.

The commands (:data:`COMMANDS`) sweep what the engines choose for themselves (block shapes, channels a block,
ring sizes): each prints a table, checked bit for bit, and stores nothing.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import math
import os
import socket
import sys
import textwrap
import time

from .. import buffer as B
from .. import tuning
from ..bench.intranode import routing, slowest
from ..bench.timing import time_op
from ..buffer import Buffer
from ..config import Config
from ..device.group import comm_barrier
from .common import require_gpu_and_mpi

__all__ = ["main", "parse_args", "plan_points", "choose", "builtin_configs", "Progress", "COMMANDS"]

PROG = "python -m deepep_cupy.tuning"
#: ``python -m deepep_cupy.tuning <command>``: each is the module of this package of that name.
COMMANDS = {
    "sms": "time the intranode kernels' block shapes (and the engine's fan-out and copy-mode choices) at a few SM "
           "counts, every shape checked bit for bit against the default's (default: 8,12,24 SMs, the shapes "
           "worth trying)",
    "internode": "time the internode kernels' channels a block and RDMA ring sizes at a few SM counts, every "
                 "setting checked bit for bit against the default's (default: 8,12,24 SMs, 2, 4, the default and "
                 "the most channels a block)",
}
DEFAULT_SMS = (16, 20, 24, 32)
DEFAULT_SEND = (1, 2, 4, 6, 8, 16, 32)
DEFAULT_RECV = (256, 512)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return tuple(sorted(set(values)))


def _csv(values) -> str:
    return ",".join(str(v) for v in values)


def _commands_help() -> str:
    width = max(len(name) for name in COMMANDS) + 2
    listing = "\n".join(textwrap.fill(text, 100, initial_indent=f"  {name:<{width}}",
                                      subsequent_indent=" " * (width + 2)) for name, text in COMMANDS.items())
    return (f"Run it under mpirun with one rank per GPU of one node, e.g. `mpirun -np 8 {PROG} --hidden 7168`."
            f"\n\ncommands:\n{listing}\n\n`{PROG} <command> --help` shows a command's options and their defaults.")


def command_line() -> argparse.ArgumentParser:
    """The config tuner's parser; its help lists the commands too (each parses its own options)."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\nThe commands")[0].replace("``", "'"),
                                     usage=f"{PROG} [-h] [options]\n       {PROG} {{{','.join(COMMANDS)}}} "
                                           "[options]",
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_commands_help())
    parser.add_argument("--hidden", type=int, default=7168,
                        help="hidden size of the tokens (BF16) (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank (default: %(default)s)")
    parser.add_argument("--experts", type=int, default=256, help="experts (default: %(default)s)")
    parser.add_argument("--topk", type=int, default=8, help="experts per token (default: %(default)s)")
    parser.add_argument("--sms", type=_int_list, default=DEFAULT_SMS,
                        help=f"SM counts to try, even (default: {_csv(DEFAULT_SMS)}); the SMs the kernels take are "
                             "not free for the compute kernels they overlap")
    parser.add_argument("--send", type=_int_list, default=DEFAULT_SEND,
                        help=f"send chunks (tokens per published batch) to try (default: {_csv(DEFAULT_SEND)})")
    parser.add_argument("--recv", type=_int_list, default=DEFAULT_RECV,
                        help=f"receive ring capacities (tokens) to try (default: {_csv(DEFAULT_RECV)}); larger ones "
                             "need a larger num_nvl_bytes")
    parser.add_argument("--sm-tolerance", type=float, default=0.02,
                        help="take the fewest SMs whose dispatch + combine time is within this fraction of the "
                             "best (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=20, help="timed runs per point (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs per point (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds before a hung sweep is killed (default: %(default)g)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the best configs without storing them (default: off)")
    parser.add_argument("--show", action="store_true",
                        help="print the stored configs and exit, no GPU needed (default: off)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = command_line()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and not argv[0].startswith("-"):
        parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}, or none to tune the configs")
    args = parser.parse_args(argv)
    odd = [s for s in args.sms if s % 2]
    if odd:
        parser.error(f"--sms: SM counts must be even (one sender and one receiver SM per channel), got {odd[0]}")
    if min(args.send) >= max(args.recv):
        parser.error("--send: every send chunk is at least the largest --recv capacity; nothing to try")
    for name in ("hidden", "tokens", "experts", "topk", "iters"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive")
    if args.hidden % 8:
        parser.error(f"--hidden must be a multiple of 8 (16-byte BF16 rows), got {args.hidden}")
    return args


def builtin_configs(num_ranks: int) -> dict:
    """The built-in recommendations for ``num_ranks`` (what ``Buffer`` returns when nothing is stored)."""

    # Same nearest-rank-count pick as Buffer's, without the tuned store in front of it.
    def pick(table):
        key = min(table, key=lambda k: (abs(k - num_ranks), k))
        return Config(B.Buffer.num_sms, *table[key])

    return {"dispatch": pick(B._DISPATCH_CONFIGS), "combine": pick(B._COMBINE_CONFIGS)}


def plan_points(sms_list, send_list, recv_list, builtin: dict) -> dict:
    """``{sms: [(op, send, recv), ...]}``: every point to time, the built-in configs' points included.

    One handle is made per SM count (cached dispatch and combine run with the channels of the handle), so
    the points are grouped by SM count. The combine takes only the built-in send chunk: it publishes every
    token whatever the config's chunk (``COMBINE_PUBLISH_BATCH`` in ``ops/intranode/engine.py``).
    """
    plan: dict = {}
    sends = {op: send_list for op in tuning.OPS}
    if "combine" in builtin:
        sends["combine"] = (builtin["combine"].num_max_nvl_chunked_send_tokens,)
    for sms in sms_list:
        plan[sms] = [(op, send, recv) for op in tuning.OPS for recv in recv_list for send in sends[op]
                     if send < recv]
    for op, cfg in builtin.items():
        point = (op, cfg.num_max_nvl_chunked_send_tokens, cfg.num_max_nvl_chunked_recv_tokens)
        points = plan.setdefault(cfg.num_sms, [])
        if point not in points:
            points.append(point)
    return plan


def choose(times: dict, candidates, tolerance: float = 0.0):
    """Pick the SM count and, at each SM count, the fastest chunk sizes per op.

    Arguments:
        times: ``{(sms, op, send, recv): us}``.
        candidates: the SM counts that may be chosen (the ones swept in full).
        tolerance: take the fewest SMs whose dispatch + combine time is within this fraction of the best.

    Returns:
        (chosen SM count, ``{sms: {op: (us, send, recv)}}`` for every candidate).
    """
    best: dict = {}
    for (sms, op, send, recv), us in times.items():
        if sms in candidates and math.isfinite(us):
            point = (us, send, recv)
            if op not in best.setdefault(sms, {}) or point < best[sms][op]:
                best[sms][op] = point
    complete = {sms: ops for sms, ops in best.items() if all(op in ops for op in tuning.OPS)}
    if not complete:
        raise ValueError("no SM count has a time for both dispatch and combine")
    totals = {sms: sum(ops[op][0] for op in tuning.OPS) for sms, ops in complete.items()}
    fastest = min(totals.values())
    chosen = min(sms for sms, total in totals.items() if total <= fastest * (1 + tolerance))
    return chosen, complete


class Progress:
    """A progress bar on one line of a terminal; in a log, one line per tenth of the way."""

    def __init__(self, total: int, stream=None, enabled: bool = True, width: int = 28) -> None:
        self.total, self.done, self.width, self.enabled = max(int(total), 1), 0, width, enabled
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.start = time.monotonic()
        self._tenths, self._last_len = 0, 0

    def line(self, note: str = "") -> str:
        frac = min(self.done / self.total, 1.0)
        filled = int(self.width * frac)
        elapsed = time.monotonic() - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        return (f"tune [{'#' * filled}{'-' * (self.width - filled)}] {self.done}/{self.total} "
                f"{elapsed:4.0f} s, ~{eta:.0f} s left  {note}").rstrip()

    def step(self, note: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        text = self.line(note)
        if self.tty:
            self.stream.write("\r" + text.ljust(self._last_len))
            self._last_len = len(text)
        else:
            tenths = int(10 * self.done / self.total)
            if tenths <= self._tenths and self.done < self.total:
                return
            self._tenths = tenths
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _sweep(comm, args, plan: dict, rdma: dict, progress: Progress) -> dict:
    """Time every point of ``plan`` on the GPUs; ``{(sms, op, send, recv): us}``, the same on every rank.

    Through the public ``Buffer``, as an application calls it (one plan per config, made on its first call).
    """
    import cupy
    import ml_dtypes
    import numpy as np


    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    hidden, recv_max = args.hidden, max(r for points in plan.values() for _, _, r in points)
    nbytes = max(Config(sms, 1, recv_max).get_nvl_buffer_size_hint(hidden * 2, num_ranks) for sms in plan)
    buffer = Buffer(comm=comm, num_nvl_bytes=nbytes, explicitly_destroy=True, backend="cuda")
    stream = cupy.cuda.get_current_stream()
    times: dict = {}
    try:
        # The benchmark's workload: random routing and tokens.
        topk_idx = routing(cupy, args.tokens, args.experts, args.topk, seed=1234 + rank)
        weights = cupy.random.RandomState(7 + rank).random_sample((args.tokens, args.topk), dtype=cupy.float32)
        x = np.random.default_rng(11 + rank).standard_normal((args.tokens, hidden), np.float32)
        x = cupy.asarray(x.astype(ml_dtypes.bfloat16))
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
        for sms, points in plan.items():
            # The handle fixes the channels (SMs) that cached dispatch and combine use.
            recv_x, _, recv_w, _, handle, _ = buffer.dispatch(
                x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk_idx, topk_weights=weights, config=Config(sms, 1, recv_max, *rdma["dispatch"]))
            for op, send, recv in points:
                cfg = Config(sms, send, recv, *rdma[op])
                if op == "dispatch":
                    def fn(cfg=cfg, handle=handle):
                        buffer.dispatch(x, handle=handle, config=cfg)
                else:
                    def fn(cfg=cfg, handle=handle, recv_x=recv_x, recv_w=recv_w):
                        buffer.combine(recv_x, handle, topk_weights=recv_w, config=cfg)
                us = slowest(comm, time_op(fn, warmup=args.warmup, iters=args.iters, stream=stream))
                times[(sms, op, send, recv)] = us
                progress.step(f"{op}: {sms} SMs, send {send}, recv {recv}: {us:.0f} us")
    finally:
        progress.close()
        stream.synchronize()
        comm_barrier(comm, "tuning: before destroy")
        buffer.destroy()
    return times


def _report(args, num_ranks, gpu, chosen, best, builtin, builtin_us) -> list[str]:
    lines = [f"{gpu}, {num_ranks} ranks, hidden {args.hidden}, {args.tokens} tokens, top-{args.topk} of "
             f"{args.experts} experts:",
             "  SMs | dispatch us (send, recv) | combine us (send, recv)"]
    for sms in sorted(best):
        d, c = best[sms]["dispatch"], best[sms]["combine"]
        mark = "  <- chosen" if sms == chosen else ""
        lines.append(f"  {sms:3d} | {d[0]:9.1f} ({d[1]}, {d[2]}) | {c[0]:9.1f} ({c[1]}, {c[2]}){mark}")
    for op in tuning.OPS:
        us, send, recv = best[chosen][op]
        cfg = builtin[op]
        was = builtin_us.get(op)
        gain = f", {was / us:.2f}x the built-in config's {was:.1f} us" if was else ""
        lines.append(f"  {op}: Config({chosen}, {send}, {recv}): {us:.1f} us{gain} (built-in: "
                     f"Config({cfg.num_sms}, {cfg.num_max_nvl_chunked_send_tokens}, "
                     f"{cfg.num_max_nvl_chunked_recv_tokens}))")
    return lines


def show(out=sys.stdout) -> int:
    path = tuning.store_path()
    entries = tuning.read_entries(path)
    if not entries:
        print(f"no tuned configs in {path}", file=out)
        return 0
    print(f"tuned configs in {path}:", file=out)
    for entry in sorted(entries.values(), key=lambda e: (str(e.get("gpu")), e.get("num_ranks", 0), e.get("hidden", 0))):
        row = entry.get("by_sms", {}).get(str(entry.get("num_sms")), {})
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.get("created", 0)))
        print(f"  {entry.get('gpu')}, {entry.get('num_ranks')} ranks, hidden {entry.get('hidden')} ({when}): "
              f"dispatch {row.get('dispatch')}, combine {row.get('combine')}", file=out)
    return 0


def main(argv=None) -> int:
    """``python -m deepep_cupy.tuning [command] [options]``: a command's own main, or the config tuner."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        return importlib.import_module(f"{__package__}.{argv[0]}").main(argv[1:])
    args = parse_args(argv)
    if args.show:
        return show()
    require_gpu_and_mpi(PROG, "tuning (all but --show) needs")
    from mpi4py import MPI

    os.environ.setdefault("DEEPEP_CUPY_VALIDATE", "0")
    for var in ("NVSHMEM_DISABLE_NVLS", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):
        os.environ.setdefault(var, "1")
    import cupy

    comm = MPI.COMM_WORLD
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    hosts = comm.allgather(socket.gethostname())
    if len(set(hosts)) > 1:
        if rank == 0:
            print(f"{PROG}: tunes the intranode (NVLink) kernels; run it with the ranks of one node", file=sys.stderr)
        return 2
    device = rank % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(device).use()
    device_sms = cupy.cuda.Device(device).attributes["MultiProcessorCount"]
    sms_list = tuple(s for s in args.sms if s <= device_sms)
    if not sms_list:
        if rank == 0:
            print(f"{PROG}: every --sms value is above the GPU's {device_sms} SMs", file=sys.stderr)
        return 2
    builtin = builtin_configs(num_ranks)
    # The RDMA fields do not matter within a node; they keep the built-in values.
    rdma = {op: (cfg.num_max_rdma_chunked_send_tokens, cfg.num_max_rdma_chunked_recv_tokens)
            for op, cfg in builtin.items()}
    plan = plan_points(sms_list, args.send, args.recv, builtin)
    gpu = tuning.gpu_model() or "unknown GPU"
    progress = Progress(sum(len(p) for p in plan.values()), enabled=rank == 0)
    if rank == 0:
        print(f"tuning {num_ranks} ranks of {gpu}, hidden {args.hidden}: {progress.total} points "
              f"(SMs {_csv(sms_list)}; send {_csv(args.send)}; recv {_csv(args.recv)})", file=sys.stderr, flush=True)
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    times = _sweep(comm, args, plan, rdma, progress)
    faulthandler.cancel_dump_traceback_later()
    chosen, best = choose(times, sms_list, args.sm_tolerance)
    builtin_us = {op: times.get((cfg.num_sms, op, cfg.num_max_nvl_chunked_send_tokens,
                                 cfg.num_max_nvl_chunked_recv_tokens)) for op, cfg in builtin.items()}
    if rank == 0:
        print("\n".join(_report(args, num_ranks, gpu, chosen, best, builtin, builtin_us)), flush=True)
        if args.dry_run:
            print("--dry-run: nothing stored", flush=True)
        else:
            by_sms = {sms: {**{op: Config(sms, ops[op][1], ops[op][2], *rdma[op]) for op in tuning.OPS},
                            **{f"{op}_us": round(ops[op][0], 2) for op in tuning.OPS}} for sms, ops in best.items()}
            entry = tuning.make_entry(
                gpu, num_ranks, args.hidden, chosen, by_sms,
                workload={"tokens": args.tokens, "experts": args.experts, "topk": args.topk},
                builtin={f"{op}_us": None if us is None else round(us, 2) for op, us in builtin_us.items()},
                swept={"sms": list(sms_list), "send": list(args.send), "recv": list(args.recv)})
            path = tuning.save_entry(entry)
            print(f"stored in {path}: Buffer.get_dispatch_config({num_ranks}) and get_combine_config({num_ranks}) "
                  f"return these configs on {gpu}", flush=True)
    comm_barrier(comm, "tuning: end")
    return 0


"""Time the intranode kernels' block shapes at a few SM counts, every shape's outputs checked bit for bit.

    mpirun -np 2 python -m deepep_cupy.tuning sms --num-sms 8,12,24 --json sweep.json

For each SM count (on a handle made by a dispatch at that count) and each block shape of a grid (the engine's
tuning attributes dispatch_warps x dispatch_unroll and combine_warps x combine_unroll), three ops, 'bf16' (a
cached BF16 dispatch), 'fp8' (a cached FP8 dispatch with column-major scales) and 'combine' (a BF16 combine, in
the copy mode where the engine can take it, else the ring mode), on the benchmark's inputs (random routing).
Times are taken as 'python -m deepep_cupy.bench intranode' takes them (CUDA-event medians after warm-up, the
GPU parked ahead of each start event, the slowest rank's median); '--rounds' passes over the shapes,
interleaved, and the median of the passes is the time. Each shape's outputs are compared bit for bit with the
default shape's at the same SM count, and the default's with the first SM count's default: a difference is a
failure. '--fan-out', '--copy-combine', '--copy-rounds' and '--copy-chunks' sweep the choices the engine makes
by rank and SM count (FAN_OUT_MAX_SMS, the combine's two shape tables, copy.ROUNDS_BY_SMS,
copy.DEFAULT_CHUNK_ROWS) as variants of every shape, the first value the reference. The table comes last (op,
SMs, shape, us, mode, check), then the best shape per op and SM count; the engine's tables in
ops/intranode/engine.py are edited by hand from it. Nothing is stored.

Kernels are compiled first, in parallel, on rank 0. Bounded: kernel waits give up after '--timeout-s' (the
engine is then unusable and the sweep stops), no step starts after '--budget' seconds, and at '--deadline'
seconds every rank prints its stacks and exits.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
from pathlib import Path

from ..bench.timing import parse_sm_counts
from .common import check_positive, compile_specs, int_list, require_gpu_and_mpi, workload_arguments
from .variants import Steps, Sweep, format_table, outcome

__all__ = ["main", "command_line", "DISPATCH_SHAPES", "COMBINE_SHAPES", "OPS", "shape_grid", "with_fan_out",
           "copy_variants", "precompile"]

PROG = "python -m deepep_cupy.tuning sms"
# The grid worth trying: 24 x 14 and 32 x 14 (dispatch) and 24 x 8 and 32 x 8 (combine) spill in their copy and
# sum loops (tools/kernel_resources.py), so they are timed too but are not expected to win.
DISPATCH_SHAPES = ((16, 14), (16, 8), (16, 6), (16, 4), (24, 8), (24, 6), (24, 4), (24, 14), (32, 8), (32, 6),
                   (32, 4), (32, 14))
COMBINE_SHAPES = ((16, 8), (16, 4), (16, 2), (24, 4), (24, 2), (24, 8), (32, 4), (32, 2), (32, 8))
OPS = {"bf16": "dispatch BF16", "fp8": "dispatch FP8", "combine": "combine BF16"}
# --fan-out: the values of the engine's use_fan_out each dispatch shape is timed with (None: the engine's choice).
FAN_OUT = {None: (None,), "off": (False,), "on": (True,), "both": (False, True)}


# ---------------------------------------------------------------------------------------------------- arguments
def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``16x14,32x8`` -> ((16, 14), (32, 8)), each once; warps 1..32."""
    out = []
    for part in text.split(","):
        try:
            warps, unroll = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected WARPSxUNROLL,... (e.g. 16x14,32x8), got {text!r}") from None
        if not (1 <= warps <= 32 and unroll >= 1):
            raise argparse.ArgumentTypeError(f"{part!r}: warps must be 1..32 and unroll at least 1")
        out.append((warps, unroll))
    return tuple(dict.fromkeys(out))


def parse_ops(text: str) -> tuple[str, ...]:
    ops = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    if not ops or any(op not in OPS for op in ops):
        raise argparse.ArgumentTypeError(f"choose from {','.join(OPS)}, got {text!r}")
    return ops


def parse_rounds(text: str) -> tuple:
    """``--copy-rounds``: ``2,1`` (counts of equal parts) or ``6:3:1,2:1`` (the parts' relative sizes, a round
    each), in the order given."""
    values = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            value = tuple(int(v) for v in part.split(":")) if ":" in part else int(part)
        except ValueError:
            value = 0
        if min(value if isinstance(value, tuple) else (value,)) < 1:
            raise argparse.ArgumentTypeError(f"expected N or N:N[:N...] (positive), comma-separated, got {text!r}")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError(f"expected N or N:N[:N...], comma-separated, got {text!r}")
    return tuple(dict.fromkeys(values))


def _shapes_text(shapes) -> str:
    return ", ".join(f"{w}x{u}" for w, u in shapes)


def command_line() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.replace("``", "'"),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Run it under mpirun with one rank per GPU of one node.")
    p.add_argument("--num-sms", type=parse_sm_counts, default=(8, 12, 24), metavar="N[,N...]",
                   help="SM counts, each on a handle of its own (default: 8,12,24)")
    p.add_argument("--ops", type=parse_ops, default=tuple(OPS),
                   help=f"some of {','.join(OPS)} (default: {','.join(OPS)})")
    p.add_argument("--dispatch-shapes", type=parse_shapes, default=DISPATCH_SHAPES, metavar="WxU[,WxU...]",
                   help=f"dispatch warps x unroll to try, beside the default (default: {_shapes_text(DISPATCH_SHAPES)})")
    p.add_argument("--combine-shapes", type=parse_shapes, default=COMBINE_SHAPES, metavar="WxU[,WxU...]",
                   help=f"combine warps x unroll to try, beside the default (default: {_shapes_text(COMBINE_SHAPES)})")
    workload_arguments(p)
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved timing passes over the shapes (default: %(default)s)")
    p.add_argument("--fan-out", choices=("on", "off", "both"), default=None,
                   help="the direct dispatch's items: each token fanned out to all its ranks, one copy a "
                        "destination, or both as variants of every shape (default: the engine's choice by SM count)")
    p.add_argument("--copy-combine", choices=("on", "off", "both"), default=None,
                   help="the combine's copy mode where it can run, the ring mode always, or both as variants (the "
                        "copy mode first); the mode column says which ran (default: the engine's choice)")
    p.add_argument("--copy-rounds", type=parse_rounds, default=None, metavar="N[,N...]",
                   help="the copy-mode combine's rounds of turns (the engine's copy_rounds: 2 equal parts, or 6:3:1, "
                        "three rounds of those relative sizes) as variants of every combine shape (default: the "
                        "engine's choice by SM count)")
    p.add_argument("--copy-chunks", type=int_list, default=None, metavar="ROWS[,ROWS...]",
                   help="the copy-mode combine's chunk rows (the engine's copy_chunk_rows) as variants, the same "
                        "way (default: the engine's)")
    p.add_argument("--timeout-s", type=float, default=20.0,
                   help="kernel wait budget, the engine's timeout_s (default: %(default)g)")
    p.add_argument("--budget", type=float, default=180.0,
                   help="seconds after which no step starts (default: %(default)g)")
    p.add_argument("--deadline", type=float, default=240.0,
                   help="seconds after which every rank prints its stacks and exits (default: %(default)g)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: one per CPU)")
    p.add_argument("--json", metavar="PATH", help="write the rows here, after every SM count (default: none written)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = command_line()
    args = parser.parse_args(argv)
    check_positive(parser, args, ("tokens", "hidden", "experts", "topk", "rounds"))
    return args


# ---------------------------------------------------------------------------------------------------- variants
def shape_grid(shapes, default: tuple) -> list[tuple]:
    """The default variant first (the reference of the checks), then the others in the order given."""
    return [default] + [s for s in shapes if s != default]


def with_fan_out(shapes, default: tuple[int, int], choice: str | None):
    """Dispatch shapes with the engine's use_fan_out as a third value (``--fan-out``): ``(shapes, default)``."""
    values = FAN_OUT[choice]
    return [(*s, f) for s in shapes for f in values], (*default, values[0])


def copy_variants(shapes, default: tuple[int, int], args) -> tuple[tuple[str, ...], list, tuple]:
    """Combine variants: every shape with every ``--copy-rounds`` and ``--copy-chunks`` value and, with
    ``--copy-combine both``, in either mode (the engine's copy_rounds, copy_chunk_rows, use_copy_combine), the
    first values the reference: ``(engine attribute names, variants, default)``."""
    names, variants, ref = ("combine_warps", "combine_unroll"), list(shapes), default
    both = (True, False) if args.copy_combine == "both" else None
    for name, values in (("copy_rounds", args.copy_rounds), ("copy_chunk_rows", args.copy_chunks),
                         ("use_copy_combine", both)):
        if values is None:
            continue
        names += (name,)
        variants = [(*v, x) for v in variants for x in values]
        ref = (*ref, values[0])
    return names, variants, ref


# ---------------------------------------------------------------------------------------------------- GPU side
def precompile(num_ranks: int, args) -> str:
    """Compile every kernel the sweep loads (:func:`~.common.compile_specs`)."""
    from ..ops.intranode.copy import combine_copy_spec
    from ..ops.intranode.engine import (
        combine_spec,
        default_combine_shape,
        default_dispatch_shape,
        dispatch_spec,
        notify_spec,
    )

    R = num_ranks
    dispatch = set(args.dispatch_shapes) | {default_dispatch_shape(R, n) for n in args.num_sms}
    combine = set(args.combine_shapes) | {default_combine_shape(R, n, c) for n in args.num_sms for c in (False, True)}
    specs = [notify_spec(R)] + [dispatch_spec(R, w, u) for w, u in sorted(dispatch)]
    specs += [s for w, u in sorted(combine) for s in (combine_spec(R, w, u), combine_copy_spec(R, w, u))]
    return compile_specs("intranode", specs, args.jobs)


def _sweep(comm, args, start: float, say) -> tuple[list[dict], str | None]:
    """Every SM count's handle and variants, on every rank: the rows of the table, and why the sweep stopped
    early (None when it did not)."""
    import dataclasses

    import cupy

    from ..bench.intranode import ITERS, PARK_US, WARMUP, routing
    from ..bench.timing import time_op
    from ..buffer import Buffer
    from ..device.group import MPIGroup
    from ..ops.intranode.engine import IntranodeEngine, default_combine_shape, default_dispatch_shape
    from ..ops.intranode.plans import direct_combine, direct_dispatch
    from ..ops.layout import get_dispatch_layout

    rank, R, hidden = comm.Get_rank(), comm.Get_size(), args.hidden
    base_d, base_c = Buffer.get_dispatch_config(R), Buffer.get_combine_config(R)
    configs = {n: (dataclasses.replace(base_d, num_sms=n), dataclasses.replace(base_c, num_sms=n)) for n in args.num_sms}
    nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden * 2, R) for pair in configs.values() for c in pair)
    engine = IntranodeEngine(MPIGroup(comm), cupy.cuda.runtime.getDevice(), nvl_bytes)
    engine.tune(timeout_s=args.timeout_s)
    if args.copy_combine in ("on", "off"):
        engine.tune(use_copy_combine=args.copy_combine == "on")
    stream = cupy.cuda.Stream(non_blocking=True)
    steps = Steps(comm, engine, args.budget, start)
    pool = engine.output_pool
    say(f"{R} ranks, {args.tokens} tokens x {hidden}, top-{args.topk} of {args.experts}; output pool "
        f"{'on' if pool else 'off (dispatch: ring mode)'}, copy-mode combine "
        f"{'possible' if pool and engine.copy_supported else 'off (ring mode)'}; {args.rounds} rounds of "
        f"{ITERS} calls", flush=True)

    def in_pool(a) -> bool:
        return pool is not None and pool.buffer.local_ptr <= a.data.ptr < pool.buffer.local_ptr + pool.buffer.size

    with stream:
        topk_idx = routing(cupy, args.tokens, args.experts, args.topk, seed=1234 + rank)
        topk_w = cupy.random.RandomState(7 + rank).random_sample((args.tokens, args.topk), dtype=cupy.float32)
        x = cupy.random.RandomState(11 + rank).standard_normal((args.tokens, hidden), dtype=cupy.float32)
        x_bf16 = (x.view(cupy.uint32) >> 16).astype(cupy.uint16)
        del x
        x_fp8 = cupy.random.RandomState(13 + rank).randint(0, 0x7f, (args.tokens, hidden), dtype=cupy.uint8)
        scales = cupy.ones((hidden // 128, args.tokens), dtype=cupy.float32).T  # column-major, as DeepEP's tests
        per_rank, _, per_expert, in_rank = get_dispatch_layout(topk_idx, args.experts, R, R, stream=stream)
    stream.synchronize()

    sweep = Sweep(engine, stream, steps, args.rounds, say, in_pool)
    timing = {"warmup": WARMUP, "iters": ITERS, "park_us": PARK_US}
    rows: list[dict] = []
    for n in args.num_sms:
        dcfg, ccfg = configs[n]
        got = steps(lambda dcfg=dcfg: direct_dispatch(
            engine, x_bf16, None, handle=None, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_w, expert_alignment=1,
            num_worst_tokens=0, config=dcfg, stream=stream), share=lambda value: None)
        errors = [e for _, e in got[1] if e] if got is not None else []
        if got is None or errors:
            say(f"{n} SMs: no handle: {steps.stopped or errors[0]}", flush=True)
            continue
        recv_x, _, _, recv_w, _, handle = got[0]

        def dispatch(data, data_scales, dcfg=dcfg, handle=handle):
            out = direct_dispatch(engine, data, data_scales, handle=handle, num_tokens_per_rank=None,
                                  is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                                  topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=dcfg,
                                  stream=stream)
            return out[0], out[1]

        dispatch_names = ("dispatch_warps", "dispatch_unroll", "use_fan_out")
        dispatch_shapes = with_fan_out(args.dispatch_shapes, default_dispatch_shape(R, n), args.fan_out)
        ops = {
            "bf16": (lambda dispatch=dispatch: dispatch(x_bf16, None), dispatch_names, *dispatch_shapes),
            "fp8": (lambda dispatch=dispatch: dispatch(x_fp8, scales), dispatch_names, *dispatch_shapes),
            "combine": (lambda ccfg=ccfg, handle=handle, recv_x=recv_x, recv_w=recv_w: direct_combine(
                engine, recv_x, handle, topk_weights=recv_w, bias_0=None, bias_1=None, config=ccfg,
                stream=stream),
                *copy_variants(args.combine_shapes, default_combine_shape(R, n, args.copy_combine != "off"),
                               args)),
        }
        for key in args.ops:
            fn, names, shapes, default = ops[key]
            rows += sweep.run(OPS[key], n, fn, names, shape_grid(shapes, default), default, time_op, timing)
        del recv_x, recv_w, handle, dispatch, ops
        if rank == 0 and args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    stream.synchronize()
    comm.Barrier()
    engine.destroy()
    return rows, steps.stopped


def _run(args) -> int:
    start = time.monotonic()
    faulthandler.dump_traceback_later(args.deadline, exit=True)
    os.environ.setdefault("DEEPEP_CUPY_VALIDATE", "0")  # as the bench runs
    import cupy
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    if rank == 0:
        say(precompile(num_ranks, args), flush=True)
    comm.Barrier()
    cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
    rows, stopped = _sweep(comm, args, start, say)
    say("\n" + format_table(rows), flush=True)
    if stopped:
        say(f"stopped early: {stopped}", flush=True)
    say(f"{time.monotonic() - start:.0f} s in all", flush=True)
    faulthandler.cancel_dump_traceback_later()
    return 1 if any(outcome(r) != "ok" for r in rows) else 0


def main(argv=None) -> int:
    """``python -m deepep_cupy.tuning sms [options]``: 0 when every variant ran and matched, else 1.

    A failure outside a step ends every rank at once (else the others would wait in a collective, and the
    failed rank in MPI's finalization, until the deadline)."""
    args = parse_args(argv)
    require_gpu_and_mpi(PROG, "the block-shape sweep needs")
    try:
        return _run(args)
    except Exception:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        if "mpi4py.MPI" in sys.modules:
            sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(1)
        raise

"""Block shapes of the intranode kernels at a few SM counts: every shape timed, every result checked.

    mpirun -np 2 python tools/sm_sweep.py --num-sms 8,12,24 --json out.json

For each SM count (on a handle made by a dispatch at that count) and each block shape of a grid (the engine's
tuning attributes dispatch_warps x dispatch_unroll, combine_warps x combine_unroll), three ops:
  dispatch BF16  cached (the direct mode where every rank's outputs fit its output pool)
  dispatch FP8   cached, column-major scales
  combine BF16   the copy mode where the engine can take it, else the ring mode
on 4096 tokens x 7168, top-8 of 256 experts, random routing (the bench's inputs). Times are taken the way
``python -m deepep_cupy.bench intranode`` takes them: CUDA-event medians of ITERS calls after warm-up, the GPU
parked ahead of each start event, the slowest rank's median; ``--rounds`` passes over the shapes, interleaved,
and the median of the passes is the time. Each shape's outputs are compared bit for bit with the default
shape's at the same SM count (same inputs), and the default's with the first SM count's default; a difference
is a failure. ``--fan-out both`` times each dispatch shape both ways of the direct mode (one copy a destination,
and each token fanned out to all its ranks: the engine's use_fan_out), the first the reference of the second. The table comes last: op, SMs, warps x unroll, us; then the best shape per (op, SMs).

Kernels are compiled first, in parallel, on rank 0 (the cache is ``$DEEPEP_CUPY_CACHE_DIR``). Bounded: kernel
waits give up after ``--timeout-s`` (the engine is then unusable and the sweep stops); no step starts after
``--budget`` seconds; at ``--deadline`` seconds every rank prints its stacks and exits (faulthandler).
"""

from __future__ import annotations

import argparse
import faulthandler
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepep_cupy.bench.timing import parse_sm_counts  # noqa: E402  (after the path)

# Worth trying (tools/kernel_resources.py): dispatch 24 x 14 and 32 x 14 and combine 24 x 8 and 32 x 8 spill
# in their copy / sum loops, so they are timed too but are not expected to win.
DISPATCH_SHAPES = ((16, 14), (16, 8), (16, 6), (16, 4), (24, 8), (24, 6), (24, 4), (24, 14), (32, 8), (32, 6),
                   (32, 4), (32, 14))
COMBINE_SHAPES = ((16, 8), (16, 4), (16, 2), (24, 4), (24, 2), (24, 8), (32, 4), (32, 2), (32, 8))
OPS = {"bf16": "dispatch BF16", "fp8": "dispatch FP8", "combine": "combine BF16"}


# ---------------------------------------------------------------------------------------------------- arguments
def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``16x14,32x8`` -> ((16, 14), (32, 8)); warps at most 32."""
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


def command_line() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/sm_sweep.py", description=__doc__.splitlines()[0])
    p.add_argument("--num-sms", type=parse_sm_counts, default=(8, 12, 24), metavar="N[,N...]")
    p.add_argument("--ops", type=parse_ops, default=tuple(OPS), help=f"some of {','.join(OPS)} (default: all)")
    p.add_argument("--dispatch-shapes", type=parse_shapes, default=DISPATCH_SHAPES, metavar="WxU[,WxU...]")
    p.add_argument("--combine-shapes", type=parse_shapes, default=COMBINE_SHAPES, metavar="WxU[,WxU...]")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing passes over the shapes")
    p.add_argument("--timeout-s", type=float, default=20.0, help="kernel wait budget (the engine's timeout_s)")
    p.add_argument("--budget", type=float, default=180.0, help="seconds after which no step starts")
    p.add_argument("--deadline", type=float, default=240.0, help="seconds after which every rank exits")
    p.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: one per CPU)")
    p.add_argument("--json", help="write the rows here (after every SM count)")
    p.add_argument("--fan-out", choices=("on", "off", "both"), default=None,
                   help="the direct dispatch's items: each token fanned out to all its ranks, one copy a destination, "
                        "or both as variants of every shape (default: the engine's choice by SM count)")
    p.add_argument("--own-rows", choices=("on", "off"), default=None,
                   help="the cached dispatches' own rows by device-to-device copies (ops/own_rows.py), or on the "
                        "SMs (default: the engine's choice, the SMs); the mode column says +own where copies moved them")
    p.add_argument("--copy-rounds", default=None, metavar="N[,N...]",
                   help="the copy-mode combine's rounds of turns (the engine's copy_rounds; 5:3:2, three rounds of "
                        "those relative sizes) as variants of every "
                        "combine shape, the first the reference (default: the engine's choice by SM count)")
    p.add_argument("--copy-chunks", default=None, metavar="ROWS[,ROWS...]",
                   help="the copy-mode combine's chunk rows (the engine's copy_chunk_rows) as variants, the same way")
    p.add_argument("--copy-turn-waits", default=None, metavar="1,0",
                   help="the copy mode's turn waits on (1) or off (0) as variants, the same way")
    p.add_argument("--copy-whole-turns", default=None, metavar="1,0",
                   help="the copy mode's turns before a round's last as one copy a part (1) or in chunks (0) as "
                        "variants, the same way")
    p.add_argument("--copy-combine", choices=("on", "off", "both"), default=None,
                   help="the combine's copy mode where it can run, or the ring mode always, or both as variants (the "
                        "copy mode first; default: the engine's choice by rank and SM count); the mode column says "
                        "which ran")
    return p


def shape_grid(shapes, default: tuple) -> list[tuple]:
    """The default shape first (the reference of the checks), then the others in the order given."""
    return [default] + [s for s in shapes if s != default]


FAN_OUT = {None: (None,), "off": (False,), "on": (True,), "both": (False, True)}


def with_fan_out(shapes, default: tuple[int, int], choice: str | None):
    """Dispatch shapes with the engine's use_fan_out as a third value (``--fan-out``): ``(shapes, default)``."""
    values = FAN_OUT[choice]
    return [(*s, f) for s in shapes for f in values], (*default, values[0])


# ---------------------------------------------------------------------------------------------------- table
def rounds_value(text: str):
    """``--copy-rounds`` values: ``3`` (equal parts) or ``5:3:2`` (the parts' relative sizes, a round each)."""
    return tuple(int(v) for v in text.split(":")) if ":" in text else int(text)


def copy_variants(shapes, default: tuple[int, int], args) -> tuple[tuple[str, ...], list, tuple]:
    """Combine variants: every shape with every ``--copy-rounds``, ``--copy-chunks``, ``--copy-turn-waits`` and
    ``--copy-whole-turns`` value and, with ``--copy-combine both``, in either mode (the engine's copy_rounds,
    copy_chunk_rows, copy_turn_waits, copy_whole_turns, use_copy_combine), the first values the reference:
    ``(engine attribute names, variants, default)``."""
    names, variants, ref = ("combine_warps", "combine_unroll"), list(shapes), default
    both = "1,0" if args.copy_combine == "both" else None
    for name, text, kind in (("copy_rounds", args.copy_rounds, rounds_value), ("copy_chunk_rows", args.copy_chunks, int),
                             ("copy_turn_waits", args.copy_turn_waits, lambda v: bool(int(v))),
                             ("copy_whole_turns", args.copy_whole_turns, lambda v: bool(int(v))),
                             ("use_copy_combine", both, lambda v: bool(int(v)))):
        if text is None:
            continue
        values = [kind(v) for v in text.split(",")]
        names += (name,)
        variants = [(*v, x) for v in variants for x in values]
        ref = (*ref, values[0])
    return names, variants, ref


def _shape(r: dict) -> str:
    items = {True: " fan-out", False: " by dest"}.get(r.get("fan_out"), "")
    labels = {"copy_rounds": lambda v: f" {':'.join(map(str, v))} parts" if isinstance(v, tuple) else f" {v} rounds",
              "copy_chunk_rows": lambda v: f" {v} rows",
              "copy_turn_waits": lambda v: " waits" if v else " no waits",
              "copy_whole_turns": lambda v: " whole" if v else " chunked",
              "use_copy_combine": lambda v: " copy" if v else " ring"}
    if any(k in r for k in labels):
        items = "".join(label(r[k]) for k, label in labels.items() if k in r)
    return f"{r['warps']} x {r['unroll']}{items}"


def _check(r: dict) -> str:
    return r.get("error") or ("MISMATCH: " + r["mismatch"] if r.get("mismatch") else "ok")


def format_table(rows: list[dict]) -> str:
    """op, SMs, shape, us (and against the default at the same count), check; then the best per (op, SMs)."""
    defaults = {(r["op"], r["num_sms"]): r.get("us") for r in rows if r["default"]}
    lines = [f"{'op':<14} {'SMs':>3}  {'warps x unroll':<16} {'us':>8}  {'vs default':>10}  mode    check"]
    best: dict = {}
    for r in rows:
        us, ref = r.get("us"), defaults.get((r["op"], r["num_sms"]))
        vs = "(default)" if r["default"] else (f"{100 * (us / ref - 1):+.1f}%" if us and ref else "")
        shown = f"{us:8.1f}" if us else f"{'-':>8}"
        lines.append(f"{r['op']:<14} {r['num_sms']:>3}  {_shape(r):<16} {shown}  {vs:>10}  "
                     f"{r.get('mode', '-'):<6}  {_check(r)}")
        key = (r["op"], r["num_sms"])
        if us and _check(r) == "ok" and (key not in best or us < best[key]["us"]):
            best[key] = r
    lines.append("\nbest shape per (op, SMs):")
    for (op, sms), r in best.items():
        ref = defaults.get((op, sms))
        against = f" (default: {ref:.1f} us, {100 * (r['us'] / ref - 1):+.1f}%)" if ref else ""
        lines.append(f"{op:<14} {sms:>3} SMs: {_shape(r):<16} {r['us']:8.1f} us{against}")
    failed = sum(_check(r) != "ok" for r in rows)
    lines.append(f"\n{len(rows)} variants, {failed} failed or differing" if failed else f"\n{len(rows)} variants, all ok")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- GPU side
def precompile(num_ranks: int, args) -> str:
    """Compile every kernel the sweep loads (on this rank, in worker processes); one line of summary."""
    from deepep_cupy.jit.precompile import Job, default_arch, run
    from deepep_cupy.ops.intranode.copy import combine_copy_spec
    from deepep_cupy.ops.intranode.engine import (
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
    arch, start = default_arch(), time.perf_counter()
    report = run([Job("intranode", s, arch) for s in specs], workers=args.jobs, out=io.StringIO())
    line = (f"precompile: {len(specs)} kernels for {arch}: {report.compiled} compiled, {report.verified} from the "
            f"cache, {len(report.failed)} failed, {time.perf_counter() - start:.1f} s")
    return "\n".join([line, *report.failed])


class Steps:
    """Runs a step on every rank and agrees on its outcome: one allgather per step, so the ranks stay in
    step whatever a step raised on one of them. Stops for good once an engine is broken or past the budget."""

    def __init__(self, comm, engine, budget: float, start: float) -> None:
        self.comm, self.engine, self.budget, self.start = comm, engine, budget, start
        self.stopped: str | None = None

    def __call__(self, fn, share=lambda value: value):
        """``(this rank's value, [(share(value), error) per rank])``; None when the sweep has stopped (nothing
        ran). ``error`` is None or one line; ``share`` picks what the other ranks need (small, picklable)."""
        if self.stopped:
            return None
        value = shared = error = None
        try:
            value = fn()
            shared = share(value)
        except Exception as exc:  # noqa: BLE001 - reported in the table; the ranks agree on it below
            text = str(exc).strip()
            error = f"FAILED: {type(exc).__name__}: {text.splitlines()[0] if text else ''}"
        got = self.comm.allgather((shared, error, self.engine.broken is not None, time.monotonic() - self.start))
        if any(g[2] for g in got):
            self.stopped = "an engine is unusable after a kernel failure"
        elif max(g[3] for g in got) > self.budget:
            self.stopped = f"past the budget of {self.budget:g} s"
        return value, [(g[0], g[1]) for g in got]


def bits(outputs) -> list:
    """Copies of the outputs' bytes (CuPy arrays: in ordinary device memory, not the output pool)."""
    out = []
    for o in outputs:
        if o is not None:
            xp = _array_module(o)
            out.append(xp.ascontiguousarray(o).reshape(-1).view(xp.uint8).copy())
    return out


def _array_module(a):
    if type(a).__module__.startswith("cupy"):
        import cupy

        return cupy
    import numpy

    return numpy


def same_bits(a, b) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and bool((x == y).all()) for x, y in zip(a, b, strict=True))


class Sweep:
    """The variants of one op at one SM count: ``fn()`` runs the op with the engine's current shape."""

    def __init__(self, engine, stream, steps: Steps, rounds: int, say, in_pool) -> None:
        self.engine, self.stream, self.steps, self.rounds, self.say = engine, stream, steps, rounds, say
        self.in_pool = in_pool
        self.first_default: dict = {}  # op -> (SM count, bits of its default shape's outputs)

    def _use(self, names, shape) -> None:
        for name, value in zip(names, shape, strict=True):
            setattr(self.engine, name, value)

    def _prepare(self, op, num_sms, fn, names, shape, is_default, ref):
        """First call (plan, kernel load): ``(mode, bits, why the bits differ or None)``."""
        engine, stream = self.engine, self.stream
        self._use(names, shape)
        seq, own = engine.copy_seq, engine.own_copies
        outs = fn()
        stream.synchronize()
        if op.startswith("combine"):
            mode = "copy" if engine.copy_seq > seq else "ring"
        else:
            mode = ("direct" if self.in_pool(outs[0]) else "ring") + ("+own" if engine.own_copies > own else "")
        snap = bits(outs)
        del outs
        engine.check_errors(stream)
        if is_default:
            first = self.first_default.setdefault(op, (num_sms, snap))
            differ = None if same_bits(snap, first[1]) else f"differs from the default at {first[0]} SMs"
        else:
            differ = None if ref is not None and same_bits(snap, ref) else "differs from the default"
            if ref is None:
                differ = "no default to compare with"
        return mode, snap, differ

    def _time(self, fn, names, shape, time_op, timing) -> float:
        self._use(names, shape)
        us = time_op(fn, stream=self.stream, **timing)
        self.engine.check_errors(self.stream)
        return us

    def run(self, op: str, num_sms: int, fn, names, shapes, default, time_op, timing) -> list[dict]:
        rows, variants, ref = [], [], None
        saved = tuple(getattr(self.engine, name) for name in names)
        for shape in shapes:
            row = {"op": op, "num_sms": num_sms, "warps": shape[0], "unroll": shape[1], "default": shape == default}
            for name, value in zip(names[2:], shape[2:], strict=True):
                row["fan_out" if name == "use_fan_out" else name] = value
            rows.append(row)
            got = self.steps(lambda shape=shape, ref=ref: self._prepare(op, num_sms, fn, names, shape,
                                                                       shape == default, ref),
                             share=lambda v: (v[0], v[2]))
            if got is None:
                row["error"] = f"skipped: {self.steps.stopped}"
                continue
            value, shared = got
            errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(shared) if e]
            if errors:
                row["error"] = errors[0]
                continue
            if shape == default:
                ref = value[1]
            row["mode"] = "/".join(dict.fromkeys(v[0] for v, _ in shared))
            differ = [f"rank {r}: {v[1]}" for r, (v, _) in enumerate(shared) if v[1]]
            if differ:
                row["mismatch"] = "; ".join(differ)
            variants.append((row, shape))
            self.say(f"  {op}, {num_sms} SMs, {_shape(row)}: {row['mode']}, {_check(row)}", flush=True)
        for _ in range(self.rounds):  # interleaved, so that a slow spell of the machine hits every shape alike
            for row, shape in variants:
                if "error" in row:
                    continue
                got = self.steps(lambda shape=shape: self._time(fn, names, shape, time_op, timing))
                if got is None:
                    row.setdefault("error", f"timing stopped: {self.steps.stopped}")
                    continue
                errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(got[1]) if e]
                if errors:
                    row["error"] = errors[0]
                else:
                    row.setdefault("rounds_us", []).append(round(max(v for v, _ in got[1]), 2))
        for row, _ in variants:
            if row.get("rounds_us") and "error" not in row:
                row["us"] = round(statistics.median(row["rounds_us"]), 2)
        self._use(names, saved)  # the engine's own values again (None for the shapes: the tables' choice)
        return rows


def main(argv=None) -> int:
    args = command_line().parse_args(argv)
    start = time.monotonic()
    faulthandler.dump_traceback_later(args.deadline, exit=True)
    os.environ.setdefault("DEEPEP_CUPY_VALIDATE", "0")  # as the bench runs
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    if rank == 0:
        say(precompile(num_ranks, args), flush=True)
    comm.Barrier()

    import dataclasses

    import cupy

    from deepep_cupy.bench.intranode import ITERS, PARK_US, WARMUP, routing
    from deepep_cupy.bench.timing import time_op
    from deepep_cupy.buffer import Buffer
    from deepep_cupy.device.group import MPIGroup
    from deepep_cupy.ops.intranode.engine import (
        IntranodeEngine,
        default_combine_shape,
        default_dispatch_shape,
    )
    from deepep_cupy.ops.intranode.plans import direct_combine, direct_dispatch
    from deepep_cupy.ops.layout import get_dispatch_layout

    cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
    R, hidden = num_ranks, args.hidden
    base_d, base_c = Buffer.get_dispatch_config(R), Buffer.get_combine_config(R)
    configs = {n: (dataclasses.replace(base_d, num_sms=n), dataclasses.replace(base_c, num_sms=n)) for n in args.num_sms}
    nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden * 2, R) for pair in configs.values() for c in pair)
    engine = IntranodeEngine(MPIGroup(comm), cupy.cuda.runtime.getDevice(), nvl_bytes)
    engine.timeout_s = args.timeout_s
    if args.own_rows is not None:  # before the handles are made: they must carry is_token_in_rank
        engine.use_own_row_copies = args.own_rows == "on"
    if args.copy_combine in ("on", "off"):
        engine.use_copy_combine = args.copy_combine == "on"
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
                                  is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                                  expert_alignment=1, num_worst_tokens=0, config=dcfg, stream=stream)
            return out[0], out[1]

        dispatch_names = ("dispatch_warps", "dispatch_unroll", "use_fan_out")
        dispatch_shapes = with_fan_out(args.dispatch_shapes, default_dispatch_shape(R, n), args.fan_out)
        ops = {
            "bf16": (lambda dispatch=dispatch: dispatch(x_bf16, None), dispatch_names, *dispatch_shapes),
            "fp8": (lambda dispatch=dispatch: dispatch(x_fp8, scales), dispatch_names, *dispatch_shapes),
            "combine": (lambda ccfg=ccfg, handle=handle, recv_x=recv_x, recv_w=recv_w: direct_combine(
                engine, recv_x, handle, topk_weights=recv_w, bias_0=None, bias_1=None, config=ccfg, stream=stream),
                *copy_variants(args.combine_shapes, default_combine_shape(R, n, args.copy_combine != "off"), args)),
        }
        for key in args.ops:
            fn, names, shapes, default = ops[key]
            rows += sweep.run(OPS[key], n, fn, names, shape_grid(shapes, default), default, time_op, timing)
        del recv_x, recv_w, handle, dispatch, ops
        if rank == 0 and args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    stream.synchronize()
    comm.Barrier()
    say("\n" + format_table(rows), flush=True)
    if steps.stopped:
        say(f"stopped early: {steps.stopped}", flush=True)
    say(f"{time.monotonic() - start:.0f} s in all", flush=True)
    engine.destroy()
    faulthandler.cancel_dump_traceback_later()
    return 1 if any(_check(r) != "ok" for r in rows) else 0


def entry(argv=None) -> int:
    """``main``, ending every rank at once when one fails outside a step (else the others would wait in a
    collective, and a failed rank in MPI's finalization, until the deadline)."""
    try:
        return main(argv)
    except Exception:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        if "mpi4py.MPI" in sys.modules:
            sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(1)
        raise


if __name__ == "__main__":
    sys.exit(entry())

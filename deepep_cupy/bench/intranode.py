"""Intranode (NVLink) high-throughput kernels: layout, dispatch BF16 / FP8 (cached handle), combine.

Bytes are counted as DeepEP counts them: every row a rank receives (its own tokens included) times the
row size; FP8 rows count as BF16 bytes x (1 + 4/128) / 2; combine counts the same bytes as BF16
dispatch. Times are CUDA-event medians of ``ITERS`` runs after warm-up, the slowest rank's median, in GPU
time: the GPU is parked ahead of each start event (``PARK_US``) so that the host's issue time falls in the
park, as DeepEP's timing of back-to-back calls keeps it off the GPU's clock (the internode suite does the
same). The non-cached dispatch (a host sync inside) and the layout's "one call" row keep the host's share.

Each op is swept in stages (coordinate descent, to keep the run short): first the compile-time block
shapes (warps per block, 16-byte loads in flight per lane) at default runtime knobs, then, at the best
shape, the runtime knobs: for dispatch the warps that start on the own rows in the sender / receiver block
times the publish batch (``num_max_nvl_chunked_send_tokens``), then the ring capacity
(``num_max_nvl_chunked_recv_tokens``), all in the ring mode (with an output pool the dispatch takes the
direct mode, which has none of these knobs: the shapes are swept in it, and rows "(cached, ring mode)" give
the ring mode at the defaults in the same run); for combine the copy mode's shapes times chunk sizes (times
rounds of turns above 2 ranks), then the ring mode's shapes and capacity times batch (row "(ring mode)": the
ring mode at the defaults). The TOP best points of every stage are printed; the row keeps the best point, the
engine defaults' time (``default_us``) and the old protocol (one release per token, 24 warps, unroll 4, half the
sender block on the own rows: ``old_protocol_us``) measured in the same run.

With several SM counts (``--num-sms 8,12,24``) the layout is timed once and everything else once per count,
on a handle made at that count; every row records its count (``SMs``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from ..buffer import Buffer
from ..config import Config
from ..device.group import MPIGroup, comm_barrier
from ..ops.intranode.copy import DEFAULT_CHUNK_ROWS
from ..ops.intranode.engine import IntranodeEngine
from ..ops.intranode.plans import direct_combine, direct_dispatch
from ..ops.layout import get_dispatch_layout
from .timing import row, sm_counts, time_op

__all__ = ["run"]

#: Runs once per --num-sms count (the suite's time budget is per count).
PER_SM_COUNT = True
ITERS = 20
WARMUP = 5
PARK_US = 400  # longer than the host's issue time of any timed call here
RECV_TOKENS = (256, 512)
# Publish batch (num_max_nvl_chunked_send_tokens): tokens per flag fence; 1 = one release per token.
SEND_TOKENS = (1, 4, 8, 16, 32)
# Compile-time shapes (warps, loads in flight per lane). Each costs one NVRTC compile (~0.5-2 s).
DISPATCH_SHAPES = ((24, 8), (24, 4), (24, 7), (16, 8), (16, 14), (32, 4), (32, 8))
COMBINE_SHAPES = ((16, 8), (24, 4), (24, 2), (16, 4), (32, 2), (32, 4))
COPY_CHUNK_ROWS = (128, 256, 512, 1024, 4096)
COPY_ROUNDS = (1, 2)
# Own-rows warps (sender block, receiver block) as fractions of W (rounded; at least 1 in total).
OWN_ROWS_SPLITS = ((0.5, 0.0), (0.25, 0.25), (0.25, 0.0), (0.125, 0.125), (0.0, 0.25), (0.0, 0.5), (0.125, 0.375))
# Points sampled in the first stage (shape sweep) and default runtime knobs there.
STAGE1_RECV, STAGE1_SEND = 512, 8
TOP = 3  # best points printed per stage
# The FP8 rows: "intranode dispatch FP8 (cached)" passes column-major scales (as DeepEP's tests do), this one
# the same values row-major, so that the cost of the scale layout shows.
FP8_ROW_MAJOR = "intranode dispatch FP8 row-major scales (cached)"


def routing(cupy, num_tokens, num_experts, num_topk, seed):
    rs = cupy.random.RandomState(seed)
    scores = cupy.abs(rs.standard_normal((num_tokens, num_experts), dtype=cupy.float32)) + 1
    return cupy.ascontiguousarray(cupy.argsort(-scores, axis=1)[:, :num_topk].astype(cupy.int64))


def _default_split(warps: int) -> tuple[int, int]:
    return None, None  # the engine's defaults


def _restore_defaults(engine) -> None:
    engine.tune(dispatch_warps=None, dispatch_unroll=None, combine_warps=None, combine_unroll=None,
                own_rows_warps=None, recv_own_rows_warps=None, publish_batch=None, use_output_pool=True,
                use_copy_combine=None, use_own_row_copies=None, copy_chunk_rows=DEFAULT_CHUNK_ROWS, copy_rounds=None)


def slowest(comm, us: float) -> float:
    from mpi4py import MPI

    return comm.allreduce(us, op=MPI.MAX)


def run(comm, args) -> list[dict]:
    import cupy

    group = MPIGroup(comm)
    rank, num_ranks = group.rank, group.size
    num_tokens, hidden, num_experts, num_topk = args.tokens, args.hidden, args.experts, args.topk
    counts = sm_counts(args)
    stream = cupy.cuda.Stream(non_blocking=True)
    rows: list[dict] = []

    biggest = Config(max(counts), 8, max(RECV_TOKENS)).get_nvl_buffer_size_hint(hidden * 2, num_ranks)
    engine = IntranodeEngine(group, cupy.cuda.runtime.getDevice(), biggest)
    try:
        with stream:
            topk_idx = routing(cupy, num_tokens, num_experts, num_topk, seed=1234 + rank)
            topk_weights = cupy.random.RandomState(7 + rank).random_sample((num_tokens, num_topk), dtype=cupy.float32)
            x = cupy.random.RandomState(11 + rank).standard_normal((num_tokens, hidden), dtype=cupy.float32)
            x_bf16 = (x.view(cupy.uint32) >> 16).astype(cupy.uint16)  # truncated bf16 bits are fine for timing
            x_fp8 = cupy.random.RandomState(13 + rank).randint(0, 0x7f, (num_tokens, hidden), dtype=cupy.uint8)
            scales = cupy.ones((hidden // 128, num_tokens), dtype=cupy.float32).T  # column-major, as DeepEP tests
            scales_rows = cupy.ones((num_tokens, hidden // 128), dtype=cupy.float32)  # row-major
        stream.synchronize()

        # Layout.
        def layout():
            return get_dispatch_layout(topk_idx, num_experts, num_ranks, num_ranks, stream=stream)

        # GPU time (the host's issue time hidden behind a parked GPU, as DeepEP's timing hides it behind
        # its cache flush), and the time of one call on an idle stream, the host's share included.
        us = slowest(comm, time_op(layout, warmup=WARMUP, iters=ITERS, stream=stream, park_us=PARK_US))
        rows.append(row("intranode layout", us))
        us = slowest(comm, time_op(layout, warmup=WARMUP, iters=ITERS, stream=stream))
        rows.append(row("intranode layout (one call, host included)", us))
        per_rank, _, per_expert, in_rank = layout()
        inputs = _Inputs(x_bf16, x_fp8, scales, scales_rows, topk_idx, topk_weights, per_rank, per_expert, in_rank)
        for num_sms in counts:
            rows += _at_sms(comm, engine, stream, args, inputs, num_sms)
        engine.check_errors(stream)
        if rank == 0:
            for r in rows:
                extra = f"  [{r['best']}]" if "best" in r else ""
                if "default_us" in r:
                    extra += f"  (defaults {r['default_us']} us, send 1 at old shape {r['old_protocol_us']} us)"
                gbs = f"{r['GB/s']:7.1f} GB/s, " if "GB/s" in r else ""
                sms = f", {r['SMs']} SMs" if len(counts) > 1 and "SMs" in r else ""
                print(f"[{r['op']}{sms}] {gbs}{r['us']:8.2f} us{extra}", flush=True)
    finally:
        stream.synchronize()
        comm_barrier(comm, "bench intranode: before destroy")
        engine.destroy()
    return rows


class _Inputs(NamedTuple):
    """One rank's inputs of the suite, the same at every SM count."""

    x_bf16: Any
    x_fp8: Any
    scales: Any  # column-major
    scales_rows: Any  # row-major
    topk_idx: Any
    topk_weights: Any
    per_rank: Any
    per_expert: Any
    in_rank: Any


def _at_sms(comm, engine, stream, args, inputs: _Inputs, num_sms: int) -> list[dict]:
    """The rows of one SM count: the handle of a dispatch on ``num_sms`` SMs, then the sweeps."""
    rank, num_ranks, hidden = engine.rank, engine.num_ranks, args.hidden
    x_bf16, x_fp8, scales, scales_rows, topk_idx, topk_weights, per_rank, per_expert, in_rank = inputs
    rows: list[dict] = []
    # One non-cached dispatch to get the handle (and its time, notify + host sync included).
    cfg0 = Config(num_sms, 8, max(RECV_TOKENS))

    def dispatch_full():
        return direct_dispatch(engine, x_bf16, None, handle=None, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                               expert_alignment=1, num_worst_tokens=0, config=cfg0, stream=stream)

    recv_x, _, _, recv_w, _, handle = dispatch_full()
    num_recv = int(recv_x.shape[0])
    bf16_bytes = num_recv * hidden * 2
    fp8_bytes = bf16_bytes * (1 + 4 / 128) / 2
    us = slowest(comm, time_op(dispatch_full, warmup=2, iters=ITERS, stream=stream))
    rows.append(row("intranode dispatch BF16 (notify + sync)", us, bf16_bytes, num_sms))

    def timed(op):
        return slowest(comm, time_op(op, warmup=WARMUP, iters=ITERS, stream=stream,
                                      park_us=PARK_US))

    def report(name, points, nbytes):
        """Keep the best point as the row; print the TOP best of each stage on rank 0."""
        points = sorted(points, key=lambda p: p[0])
        if rank == 0:
            for us, desc in points[:TOP]:
                gbs = nbytes / (us * 1e-6) / 1e9
                print(f"  {name}, {num_sms} SMs: {us:8.2f} us {gbs:7.1f} GB/s  [{desc}]", flush=True)
        return points[0]

    def splits(warps):
        out = []
        for fs, fr in OWN_ROWS_SPLITS:
            ss, rs = round(warps * fs), round(warps * fr)
            if ss + rs == 0:
                ss = 1
            ss, rs = min(ss, warps - (num_ranks - 1)), min(rs, warps - (num_ranks - 1))
            if num_ranks == 1:
                ss, rs = warps, 0
            if (ss, rs) not in out:
                out.append((ss, rs))
        return out

    # The library's defaults: the recommended configs and the engine's block shapes.

    dcfg, ccfg = Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks)
    dcfg.num_sms = ccfg.num_sms = num_sms

    def dispatch_defaults_us(data, data_scales, ring=False, own_copies=None):
        _restore_defaults(engine)
        engine.tune(use_output_pool=not ring)
        used = handle
        if own_copies is not None:
            engine.tune(use_own_row_copies=own_copies)
            if own_copies:  # a handle whose dispatch read this rank's column back, as the copies need
                used = dispatch_full()[5]
        return timed(lambda: direct_dispatch(engine,
            data, data_scales, handle=used, num_tokens_per_rank=None, is_token_in_rank=None,
            num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1,
            num_worst_tokens=0, config=dcfg, stream=stream))

    def combine_defaults_us(ring=False, launch_sms=None):
        """The combine at the defaults (the engine picks the mode), in the ring mode (``ring``), or in the copy
        mode launched on ``launch_sms`` SMs."""
        _restore_defaults(engine)
        engine.tune(use_copy_combine=False if ring else (True if launch_sms is not None else None))
        cfg = ccfg if launch_sms is None else dataclasses.replace(ccfg, num_sms=launch_sms)
        return timed(lambda: direct_combine(engine, recv_x, handle, topk_weights=recv_w, bias_0=None, bias_1=None,
                                            config=cfg, stream=stream))

    def sweep_dispatch(data, data_scales, nbytes, name):
        def point(warps, unroll, ss, rs, recv, send, ring=False):
            engine.tune(dispatch_warps=warps, dispatch_unroll=unroll, own_rows_warps=ss, recv_own_rows_warps=rs,
                        use_output_pool=not ring)
            cfg = Config(num_sms, send, recv)

            def op():
                direct_dispatch(engine, data, data_scales, handle=handle, num_tokens_per_rank=None,
                                is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                                topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=cfg,
                                stream=stream)

            return (timed(op), (warps, unroll, ss, rs, recv, send, ring))

        def desc(k):
            w, u, ss, rs, recv, send, ring = k
            if not ring and engine.output_pool is not None:
                return f"direct mode, warps {w}, unroll {u}"
            split = "default" if ss is None else f"{ss}+{rs}"
            return f"ring mode, recv {recv}, send {send}, warps {w}, unroll {u}, own-rows warps {split}"

        # Reference: the old best shape and split with one release per token (send 1).
        ref = point(24, 4, 12, 0, 512, 1, ring=True)
        # Stage 1: compile-time shapes in the default mode (direct when there is an output pool).
        s1 = [point(w, u, *_default_split(w), STAGE1_RECV, STAGE1_SEND) for w, u in DISPATCH_SHAPES]
        report(name + " shapes", [(us, desc(k)) for us, k in s1], nbytes)
        w, u = min(s1, key=lambda p: p[0])[1][:2]
        # The ring mode's knobs at that shape: own-rows split x publish batch, then the ring capacity.
        s2 = [point(w, u, ss, rs, STAGE1_RECV, send, ring=True) for ss, rs in splits(w) for send in SEND_TOKENS]
        report(name + " ring mode, split x batch", [(us, desc(k)) for us, k in s2], nbytes)
        _, _, ss, rs, _, send, _ = min(s2, key=lambda p: p[0])[1]
        s3 = [point(w, u, ss, rs, recv, send, ring=True) for recv in RECV_TOKENS]
        everything = [(us, desc(k)) for us, k in s1 + s2 + s3]
        best = report(name + " capacity", everything, nbytes)
        _restore_defaults(engine)
        rows.append(row(name, best[0], nbytes, num_sms, best=best[1], old_protocol_us=round(ref[0], 2),
                        default_us=round(dispatch_defaults_us(data, data_scales), 2)))

    def add_ring_rows():
        """The ring mode at the defaults, same run (the dispatch's mode when there is no output pool); and
        BF16 with the own rows moved by device-to-device copies (own_rows.py: the driver's copy kernel, on SMs
        beyond the launch's) instead of the kernel's SMs."""
        rows.append(row("intranode dispatch BF16 (cached, own rows by device copies)",
                        dispatch_defaults_us(x_bf16, None, own_copies=True), bf16_bytes, num_sms, best="defaults"))
        if engine.output_pool is None:
            return
        for data, data_scales, nbytes, name in ((x_bf16, None, bf16_bytes, "intranode dispatch BF16 (cached)"),
                                                (x_fp8, scales, fp8_bytes, "intranode dispatch FP8 (cached)")):
            rows.append(row(name.replace("(cached)", "(cached, ring mode)"),
                            dispatch_defaults_us(data, data_scales, ring=True), nbytes, num_sms, best="defaults"))

    def add_combine_ring_row():
        """The combine's ring mode at the defaults, same run (its mode without the copy mode's counts); and
        the copy mode launched on the most SMs of the run while the handle came from fewer (its sums have no
        channels, so a combine config may give it more SMs than the dispatch had)."""
        if engine.output_pool is not None and engine.copy_supported:
            rows.append(row("intranode combine BF16 (ring mode)", combine_defaults_us(ring=True), bf16_bytes,
                            num_sms, best="defaults"))
            most = max(sm_counts(args))
            if most > num_sms:
                rows.append(row(f"intranode combine BF16 (copy mode on {most} SMs)",
                                combine_defaults_us(launch_sms=most), bf16_bytes, num_sms, best="defaults"))

    if getattr(args, "quick", False):
        for data, data_scales, nbytes, name in ((x_bf16, None, bf16_bytes, "intranode dispatch BF16 (cached)"),
                                                (x_fp8, scales, fp8_bytes, "intranode dispatch FP8 (cached)"),
                                                (x_fp8, scales_rows, fp8_bytes, FP8_ROW_MAJOR)):
            rows.append(row(name, dispatch_defaults_us(data, data_scales), nbytes, num_sms, best="defaults"))
        add_ring_rows()
        rows.append(row("intranode combine BF16", combine_defaults_us(), bf16_bytes, num_sms, best="defaults"))
        add_combine_ring_row()
        return rows

    sweep_dispatch(x_bf16, None, bf16_bytes, "intranode dispatch BF16 (cached)")
    sweep_dispatch(x_fp8, scales, fp8_bytes, "intranode dispatch FP8 (cached)")
    # Row-major scales at the defaults only: compare with the column-major row's default_us.
    rows.append(row(FP8_ROW_MAJOR, dispatch_defaults_us(x_fp8, scales_rows), fp8_bytes, num_sms, best="defaults"))
    add_ring_rows()

    # Combine the received rows (plus their weights): the copy mode's block shapes and chunk sizes, then
    # the ring mode's knobs, swept the same way as the dispatch's.
    def combine_point(warps, unroll, recv, send, chunk=None, rounds=None):
        # publish_batch as well: the ring-mode combine's batch is not the config's send chunk (engine.py).
        engine.tune(combine_warps=warps, combine_unroll=unroll, use_copy_combine=chunk is not None,
                    copy_chunk_rows=chunk or DEFAULT_CHUNK_ROWS, copy_rounds=rounds,
                    publish_batch=None if chunk else send)
        cfg = Config(num_sms, send, recv)

        def op():
            direct_combine(engine, recv_x, handle, topk_weights=recv_w, bias_0=None, bias_1=None, config=cfg,
                           stream=stream)

        what = (f"copy mode, chunk {chunk} rows" + (f", {rounds} rounds" if rounds else "") if chunk
                else f"ring mode, recv {recv}, send {send}")
        return (timed(op), f"{what}, warps {warps}, unroll {unroll}", (warps, unroll))

    name = "intranode combine BF16"
    ref = combine_point(32, 1, 512, 1) if num_ranks <= 2 else combine_point(24, 2, 512, 1)
    c0 = []
    if engine.output_pool is not None and engine.copy_supported:
        # Rounds of turns only exist with several homes (ops/intranode/copy.py, copy_schedule).
        rounds = COPY_ROUNDS if num_ranks > 2 else (None,)
        c0 = [combine_point(w, u, STAGE1_RECV, STAGE1_SEND, chunk, r) for w, u in COMBINE_SHAPES
              for chunk in COPY_CHUNK_ROWS for r in rounds]
        report(name + " copy mode", [p[:2] for p in c0], bf16_bytes)
    c1 = [combine_point(w, u, STAGE1_RECV, STAGE1_SEND) for w, u in COMBINE_SHAPES]
    report(name + " ring mode, shapes", [p[:2] for p in c1], bf16_bytes)
    w, u = min(c1, key=lambda p: p[0])[2]
    c2 = [combine_point(w, u, recv, send) for recv in RECV_TOKENS for send in SEND_TOKENS]
    best = report(name + " capacity x batch", [p[:2] for p in c0 + c1 + c2], bf16_bytes)
    _restore_defaults(engine)
    rows.append(row(name, best[0], bf16_bytes, num_sms, best=best[1], old_protocol_us=round(ref[0], 2),
                    default_us=round(combine_defaults_us(), 2)))
    add_combine_ring_row()
    return rows

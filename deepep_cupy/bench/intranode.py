"""Intranode (NVLink) high-throughput kernels: layout, dispatch BF16 / FP8 (cached handle), combine.

Bytes are counted as DeepEP counts them: every row a rank receives (its own tokens included) times the
row size; FP8 rows count as BF16 bytes x (1 + 4/128) / 2; combine counts the same bytes as BF16
dispatch. Times are CUDA-event medians of ``ITERS`` runs after warm-up, the slowest rank's median.

Each op is swept over ring capacity (``num_max_nvl_chunked_recv_tokens``), the chunk size (accepted for
DeepEP compatibility; the kernels publish every token on its own) and the compile-time block shapes of
the kernels (warps per block, loads in flight per lane, warps that copy local tokens); the best point is
reported with its parameters.
"""

from __future__ import annotations

from .timing import row, time_op

__all__ = ["run"]

ITERS = 20
WARMUP = 5
RECV_TOKENS = (256, 512)
SEND_TOKENS = (4, 8, 16, 32)
# (warps, loads in flight per lane, warps copying local tokens or None for the default share)
DISPATCH_SHAPES = ((24, 4, None), (16, 8, None), (24, 4, 6), (16, 8, 4), (24, 2, None))
COMBINE_SHAPES = ((24, 2), (16, 4), (32, 1))


def _routing(cupy, num_tokens, num_experts, num_topk, seed):
    rs = cupy.random.RandomState(seed)
    scores = cupy.abs(rs.standard_normal((num_tokens, num_experts), dtype=cupy.float32)) + 1
    return cupy.ascontiguousarray(cupy.argsort(-scores, axis=1)[:, :num_topk].astype(cupy.int64))


def _slowest(comm, us: float) -> float:
    from mpi4py import MPI

    return comm.allreduce(us, op=MPI.MAX)


def run(comm, args) -> list[dict]:
    import cupy

    from ..config import Config
    from ..ops.intranode import IntranodeEngine
    from ..ops.layout import get_dispatch_layout
    from ..runtime.group import MPIGroup

    group = MPIGroup(comm)
    rank, num_ranks = group.rank, group.size
    num_tokens, hidden, num_experts, num_topk = args.tokens, args.hidden, args.experts, args.topk
    num_sms = int(args.num_sms)
    stream = cupy.cuda.Stream(non_blocking=True)
    rows: list[dict] = []

    biggest = Config(num_sms, 8, max(RECV_TOKENS)).get_nvl_buffer_size_hint(hidden * 2, num_ranks)
    engine = IntranodeEngine(group, cupy.cuda.runtime.getDevice(), biggest)
    try:
        with stream:
            topk_idx = _routing(cupy, num_tokens, num_experts, num_topk, seed=1234 + rank)
            topk_weights = cupy.random.RandomState(7 + rank).random_sample((num_tokens, num_topk), dtype=cupy.float32)
            x = cupy.random.RandomState(11 + rank).standard_normal((num_tokens, hidden), dtype=cupy.float32)
            x_bf16 = (x.view(cupy.uint32) >> 16).astype(cupy.uint16)  # truncated bf16 bits are fine for timing
            x_fp8 = cupy.random.RandomState(13 + rank).randint(0, 0x7f, (num_tokens, hidden), dtype=cupy.uint8)
            scales = cupy.ones((hidden // 128, num_tokens), dtype=cupy.float32).T  # column-major, as DeepEP tests
        stream.synchronize()

        # Layout.
        def layout():
            return get_dispatch_layout(topk_idx, num_experts, num_ranks, num_ranks, stream=stream)

        us = _slowest(comm, time_op(layout, warmup=WARMUP, iters=ITERS, stream=stream))
        rows.append(row("intranode layout", us))
        per_rank, _, per_expert, in_rank = layout()

        # One non-cached dispatch to get the handle (and its time, notify + host sync included).
        cfg0 = Config(num_sms, 8, max(RECV_TOKENS))

        def dispatch_full():
            return engine.dispatch(x_bf16, None, handle=None, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                   num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                                   expert_alignment=1, num_worst_tokens=0, config=cfg0, stream=stream)

        recv_x, _, _, recv_w, _, handle = dispatch_full()
        num_recv = int(recv_x.shape[0])
        bf16_bytes = num_recv * hidden * 2
        fp8_bytes = bf16_bytes * (1 + 4 / 128) / 2
        us = _slowest(comm, time_op(dispatch_full, warmup=2, iters=ITERS, stream=stream))
        rows.append(row("intranode dispatch BF16 (notify + sync)", us, bf16_bytes, num_sms))

        def sweep_dispatch(data, data_scales, nbytes, name):
            best = None
            for warps, unroll, self_warps in DISPATCH_SHAPES:
                engine.dispatch_warps, engine.dispatch_unroll, engine.self_warps = warps, unroll, self_warps
                # The chunk size does not change what the kernels do: sweep it for the default shape only.
                sends = SEND_TOKENS if (warps, unroll, self_warps) == DISPATCH_SHAPES[0] else SEND_TOKENS[:1]
                for recv in RECV_TOKENS:
                    for send in sends:
                        cfg = Config(num_sms, send, recv)

                        def op(cfg=cfg):
                            engine.dispatch(data, data_scales, handle=handle, num_tokens_per_rank=None,
                                            is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                                            topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=cfg,
                                            stream=stream)

                        us = _slowest(comm, time_op(op, warmup=WARMUP, iters=ITERS, stream=stream))
                        if best is None or us < best[0]:
                            best = (us, f"recv {recv}, send {send}, warps {warps}, unroll {unroll}, "
                                        f"self warps {self_warps or 'default'}")
            engine.dispatch_warps, engine.dispatch_unroll, engine.self_warps = 24, 4, None
            rows.append(row(name, best[0], nbytes, num_sms, best=best[1]))

        sweep_dispatch(x_bf16, None, bf16_bytes, "intranode dispatch BF16 (cached)")
        sweep_dispatch(x_fp8, scales, fp8_bytes, "intranode dispatch FP8 (cached)")

        # Combine the received rows (plus their weights), swept the same way.
        best = None
        for warps, unroll in COMBINE_SHAPES:
            engine.combine_warps, engine.combine_unroll = warps, unroll
            for recv in RECV_TOKENS:
                cfg = Config(num_sms, 8, recv)

                def op(cfg=cfg):
                    engine.combine(recv_x, handle, topk_weights=recv_w, bias_0=None, bias_1=None, config=cfg,
                                   stream=stream)

                us = _slowest(comm, time_op(op, warmup=WARMUP, iters=ITERS, stream=stream))
                if best is None or us < best[0]:
                    best = (us, f"recv {recv}, warps {warps}, unroll {unroll}")
        engine.combine_warps, engine.combine_unroll = 24, 2
        rows.append(row("intranode combine BF16", best[0], bf16_bytes, num_sms, best=best[1]))
        engine.check_errors(stream)
        if rank == 0:
            for r in rows:
                extra = f"  [{r['best']}]" if "best" in r else ""
                gbs = f"{r['GB/s']:7.1f} GB/s, " if "GB/s" in r else ""
                print(f"[{r['op']}] {gbs}{r['us']:8.2f} us{extra}", flush=True)
    finally:
        stream.synchronize()
        comm.Barrier()
        engine.destroy()
    return rows

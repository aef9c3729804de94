"""The intranode ops of the bench, a few calls each, for Nsight Compute to profile (no timing of its own).

    mpirun -np 2 bash -c 'if [ $OMPI_COMM_WORLD_RANK = 0 ]; then ncu --clock-control none \\
        --kernel-name regex:combine_copy -o combine python tools/ncu_ops.py --num-sms 8; \\
        else python tools/ncu_ops.py --num-sms 8; fi'

On the bench's inputs (4096 tokens x 7168, top-8 of 256, ``deepep_cupy.bench.intranode``): one dispatch for
the handle, then ``--calls`` cached BF16 dispatches, FP8 dispatches (column-major scales) and combines at
each ``--num-sms`` count, on the engine's defaults (the combine in its copy mode at 2 ranks). Only rank 0
should run under the profiler: a kernel that waits for a peer can be profiled only in one pass (its
replays would wait for a peer that does not replay), while the copy mode's sums wait on nothing remote.
Keep the GPU's clocks as they are (``--clock-control none``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-sms", default="8,24")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    args = p.parse_args()
    import cupy
    from mpi4py import MPI

    from deepep_cupy.bench.intranode import routing
    from deepep_cupy.bench.timing import parse_sm_counts
    from deepep_cupy.config import Config
    from deepep_cupy.device.group import MPIGroup, comm_barrier
    from deepep_cupy.ops.intranode.engine import IntranodeEngine
    from deepep_cupy.ops.intranode.plans import direct_combine, direct_dispatch
    from deepep_cupy.ops.layout import get_dispatch_layout

    comm = MPI.COMM_WORLD
    group = MPIGroup(comm)
    rank, ranks = group.rank, group.size
    n, hidden, experts, k = args.tokens, args.hidden, args.experts, args.topk
    counts = parse_sm_counts(args.num_sms)
    cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
    stream = cupy.cuda.Stream(non_blocking=True)
    engine = IntranodeEngine(group, cupy.cuda.runtime.getDevice(),
                             Config(max(counts), 8, 512).get_nvl_buffer_size_hint(hidden * 2, ranks))
    try:
        with stream:
            topk_idx = routing(cupy, n, experts, k, seed=1234 + rank)
            weights = cupy.random.RandomState(7 + rank).random_sample((n, k), dtype=cupy.float32)
            x = cupy.random.RandomState(11 + rank).standard_normal((n, hidden), dtype=cupy.float32)
            x_bf16 = (x.view(cupy.uint32) >> 16).astype(cupy.uint16)
            x_fp8 = cupy.random.RandomState(13 + rank).randint(0, 0x7f, (n, hidden), dtype=cupy.uint8)
            scales = cupy.ones((hidden // 128, n), dtype=cupy.float32).T  # column-major
        per_rank, _, per_expert, in_rank = get_dispatch_layout(topk_idx, experts, ranks, ranks, stream=stream)
        for sms in counts:
            cfg = Config(sms, 8, 512)
            recv_x, _, _, recv_w, _, handle = direct_dispatch(
                engine, x_bf16, None, handle=None, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights, expert_alignment=1,
                num_worst_tokens=0, config=cfg, stream=stream)
            for data, data_scales in ((x_bf16, None), (x_fp8, scales)):
                for _ in range(args.calls):
                    direct_dispatch(engine, data, data_scales, handle=handle, num_tokens_per_rank=None,
                                    is_token_in_rank=in_rank, num_tokens_per_expert=None, topk_idx=None,
                                    topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=cfg,
                                    stream=stream)
            for _ in range(args.calls):
                direct_combine(engine, recv_x, handle, topk_weights=recv_w, bias_0=None, bias_1=None, config=cfg,
                               stream=stream)
            stream.synchronize()
            if rank == 0:
                print(f"ncu_ops: {sms} SMs done", flush=True)
        engine.check_errors(stream)
    finally:
        stream.synchronize()
        comm_barrier(comm, "ncu_ops: before destroy")
        engine.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())

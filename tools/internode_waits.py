"""Where the internode kernels' warps wait: a diagnostics build of the dispatch and the combine, timed per wait kind.

    mpirun -np 2 -x DEEPEP_CUPY_NVL_RANKS=1 python tools/internode_waits.py --num-sms 12

The kernels are built with ``DEEPEP_CUPY_WAIT_PROFILE=1`` (``cuda_src/internode/sync.cuh``): every wait that finds
its progress word short adds the nanoseconds its warp waited to a counter of its kind (the op codes of
``ops/internode/engine.py``) and side (sending: RDMA senders, and the combine's NVLink senders or, with one rank a
domain, its forwarders; receiving: receivers and forwarders, and the combine's forwarders and reducers), and every
warp with a role adds its time in that role, cut into phases (``PHASES``: the time between two of its clock's
laps). On the bench's inputs (4096 tokens x 7168, top-8 of 256) and Config, ``--iters`` cached BF16 dispatches, as
many FP8 ones (column-major scales) and as many combines, each op's counters zeroed before it; the table gives, per
rank, op, wait kind and side, the waits that found their word short and those that did not (for a phase, its
laps), and the share of the warps' time spent there. Timings of these builds are not the library's: the counters
cost atomics. Kernel waits give up after ``--timeout-s``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepep_cupy.tuning.common import workload_arguments  # noqa: E402  (after the path)
from deepep_cupy.tuning.internode import config, precompile, rank_and_domains  # noqa: E402

SYMBOL = "deepep_cupy_internode_waits"
DEFINES = {"DEEPEP_CUPY_WAIT_PROFILE": 1}
# PhaseClock's codes (cuda_src/internode/buffer_map.cuh): a role's time cut into phases, each lap charged to one.
PHASES = {
    412: "phase: RDMA sender, token's extras loaded, ring space, slot header",
    413: "phase: RDMA sender, row copied into the slot",
    414: "phase: RDMA sender, scales and top-k stored",
    415: "phase: RDMA sender, chunk published",
    416: "phase: forwarder (one rank a domain), slot's tail waited for",
    417: "phase: forwarder (one rank a domain), slot stored into the outputs",
    418: "phase: forwarder (one rank a domain), handle entry, slots given back",
    419: "phase: combine forwarder, row's position, ring space",
    420: "phase: combine forwarder, row copied or summed into the slot",
    421: "phase: combine forwarder, slots published, NVLink slots given back",
    422: "phase: combine reducer, positions, partial sums waited for",
    423: "phase: combine reducer, rows summed",
    424: "phase: combine reducer, weights summed, slots given back",
}


def command_line() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/internode_waits.py", description=__doc__.splitlines()[0])
    p.add_argument("--num-sms", type=int, default=12, help="SMs of the ops (default: %(default)s)")
    p.add_argument("--iters", type=int, default=10, help="calls of each op counted (default: %(default)s)")
    workload_arguments(p)
    p.add_argument("--timeout-s", type=float, default=20.0,
                   help="kernel wait budget, the engine's timeout_s (default: %(default)g)")
    return p


def use_profiled_builds() -> None:
    """Every internode dispatch and combine plan made from now on loads the diagnostics build."""
    from deepep_cupy.jit import BuildSpec
    from deepep_cupy.ops import kernel_names
    from deepep_cupy.ops.internode import buffer_map as bmap_module
    from deepep_cupy.ops.internode import engine, plans

    @functools.cache
    def dispatch_spec(lsize: int, ndom: int, sub: int | None = None) -> BuildSpec:
        sub = bmap_module.channels_per_block(lsize, ndom, sub)
        return BuildSpec.make("internode/dispatch.cu", DEFINES, [kernel_names.internode_dispatch(lsize, ndom, sub)],
                              nvshmem=True)

    @functools.cache
    def combine_spec(lsize: int, ndom: int, sub: int | None = None) -> BuildSpec:
        sub = bmap_module.channels_per_block(lsize, ndom, sub)
        return BuildSpec.make("internode/combine.cu", DEFINES, [kernel_names.internode_combine(lsize, ndom, sub)],
                              nvshmem=True)

    engine.dispatch_spec = plans.dispatch_spec = dispatch_spec
    engine.combine_spec = plans.combine_spec = combine_spec


def counters(spec):
    """The counters of ``spec``'s loaded module, as a CuPy array ``[32, 2, 3]`` of uint64 over its memory."""
    import cupy

    from deepep_cupy.jit import load

    ptr = load(spec).raw.get_global(SYMBOL)
    return cupy.ndarray((32, 2, 3), dtype=cupy.uint64, memptr=ptr)


def table(rank: int, op: str, values, names: dict) -> list[str]:
    """Lines for one op's counters (a NumPy array ``[32, 2, 3]``)."""
    out = []
    for parity, role in ((0, "sending"), (1, "receiving")):
        warp_ns, warps = int(values[31, parity, 0]), int(values[31, parity, 1])
        if not warps:
            continue
        out.append(f"rank {rank} {op:<8} {role:<11} {warps:>6} warp-launches, {warp_ns / warps / 1e3:9.1f} us a warp")
        for k in range(31):
            ns, slow, fast = (int(v) for v in values[k, parity])
            if 400 + k in PHASES and slow:
                out.append(f"    {100.0 * ns / max(warp_ns, 1):5.1f}% of warp time  {slow:>8} laps, "
                           f"{ns / slow / 1e3:6.2f} us a lap  {PHASES[400 + k]}")
            elif slow or fast:
                name = names.get(400 + k, f"op {400 + k}")
                out.append(f"    {100.0 * ns / max(warp_ns, 1):5.1f}% of warp time  {slow:>8} short {fast:>8} ready  "
                           f"{name}")
    return out


def main() -> int:
    args = command_line().parse_args()
    import torch
    from mpi4py import MPI

    from deepep_cupy import Buffer
    from deepep_cupy.device.group import comm_barrier
    from deepep_cupy.ops.internode import buffer_map as bmap_module
    from deepep_cupy.ops.internode import engine as E

    comm = MPI.COMM_WORLD
    shape = rank_and_domains(comm)
    if shape is None:
        return 2
    rank, num_ranks, lsize, ndom = shape
    use_profiled_builds()
    if rank == 0:  # compile before any rank launches (a rank compiling inside a peer's wait would time out)
        print(precompile(lsize, ndom, [bmap_module.sub_channels(lsize, ndom, args.num_sms)], None), file=sys.stderr)
    comm.Barrier()
    cfg = config(args.num_sms, 128, 16)
    hidden = args.hidden
    buf = Buffer(comm=comm, num_nvl_bytes=cfg.get_nvl_buffer_size_hint(hidden * 2, num_ranks),
                 num_rdma_bytes=cfg.get_rdma_buffer_size_hint(hidden * 2, num_ranks, lsize) + (1 << 20),
                 num_nvl_ranks=lsize, explicitly_destroy=True)
    engine = buf.runtime.internode
    engine.tune(timeout_s=args.timeout_s)
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    n, e, k = args.tokens, args.experts, args.topk
    scores = torch.randn(n, e, device="cuda", generator=gen).abs() + 1
    topk_idx = torch.topk(scores, k, dim=-1).indices.to(torch.int64).contiguous()
    topk_weights = torch.rand(n, k, device="cuda", generator=gen)
    x = torch.randn(n, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    x_fp8 = x.to(torch.float8_e4m3fn)
    scales = torch.rand(hidden // 128, n, device="cuda", generator=gen).T  # column-major, as DeepGEMM takes them
    lines = []
    try:
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, e)
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights, config=cfg)
        buf.combine(recv_x, handle, topk_weights=recv_w, config=cfg)  # loads the combine's module
        torch.cuda.synchronize()
        sub = engine.channels_per_block(cfg.num_sms)
        ops = (("dispatch", E.dispatch_spec(lsize, ndom, sub), lambda: buf.dispatch(x, handle=handle, config=cfg)),
               ("fp8", E.dispatch_spec(lsize, ndom, sub),
                lambda: buf.dispatch((x_fp8, scales), handle=handle, config=cfg)),
               ("combine", E.combine_spec(lsize, ndom, sub),
                lambda: buf.combine(recv_x, handle, topk_weights=recv_w, config=cfg)))
        for name, spec, fn in ops:
            words = counters(spec)
            comm_barrier(comm, "internode waits: before zeroing")
            words.fill(0)
            torch.cuda.synchronize()
            for _ in range(args.iters):
                fn()
            torch.cuda.synchronize()
            engine.check_errors()
            lines += table(rank, name, words.get(), E.OP_NAMES)
    finally:
        torch.cuda.synchronize()
        comm_barrier(comm, "internode waits: before destroy")
        buf.destroy()
    for text in comm.gather("\n".join(lines), root=0) or ():
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the host microseconds of each Buffer op go, next to the floor of what Python must do per call.

    mpirun -np 2 python tools/host_profile.py [--calls 300] [--out FILE] [--ep] [--custom-ops]

torch tensors, DeepEP's workloads (normal: 4096 x 7168, top-8 of 256; low latency: 128 x 7168, top-8 of
288). For every op: the host time per call with the GPU kept busy (a sleep kernel ahead of each batch, so
a call returns as soon as its work is queued), then a cProfile of the same calls (the functions with the
most own time). The floors are the primitives a call cannot avoid: a dictionary lookup, the metadata of
a tensor, ``torch.empty`` on the GPU, the current stream, a kernel launch through ``cuda.bindings`` and
an event record. Rank 0 prints; every rank runs the same calls (the ops are collective).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCH = 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--ep", action="store_true", help="also DeepEP V2's cached calls (EPBuffer) beside V1's")
    parser.add_argument("--custom-ops", action="store_true",
                        help="also each torch.ops.deepep_cupy op with the arguments compiled code passes it")
    args = parser.parse_args()

    import cupy
    import torch
    from mpi4py import MPI

    import deepep_cupy as deep_ep
    from deepep_cupy.bench.host import _Suite
    from deepep_cupy.bench.timing import park
    from deepep_cupy.device.streams import current_stream
    from deepep_cupy.frameworks import TensorKind, from_numpy

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    cupy.cuda.Device(rank % torch.cuda.device_count()).use()
    os.environ.setdefault("DEEPEP_CUPY_VALIDATE", "1")
    suite = _Suite(comm, argparse.Namespace())
    like = TensorKind("torch", torch.cuda.current_device())
    d = {k: from_numpy(v, like) for k, v in suite.host.items()}
    hidden, experts = suite.hidden, suite.experts
    nvl = max(deep_ep.Buffer.get_dispatch_config(size).get_nvl_buffer_size_hint(hidden * 2, size),
              deep_ep.Buffer.get_combine_config(size).get_nvl_buffer_size_hint(hidden * 2, size))
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(suite.t_max, hidden, size, suite.ll_experts)
    buf = deep_ep.Buffer(comm=comm, num_nvl_bytes=nvl, num_rdma_bytes=rdma, low_latency_mode=True,
                         num_qps_per_rank=max(1, suite.ll_experts // size), explicitly_destroy=True)
    stream = current_stream("torch", torch.cuda.current_device())
    x, idx, w = d["x"], d["idx"], d["w"]
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                   num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    buf.clean_low_latency_buffer(suite.t_max, hidden, suite.ll_experts)
    lx, lidx, lw, lout = d["ll_x"], d["ll_idx"], d["ll_w"], d["ll_out"]
    t, le = suite.t_max, suite.ll_experts
    ll_handle = buf.low_latency_dispatch(lx, lidx, t, le, use_fp8=True)[2]
    buf.low_latency_combine(lout, lidx, lw, ll_handle)
    ops = _optional("--ep", lambda: _ep_ops(comm, suite, like)) if args.ep else []
    ops += _optional("--custom-ops", lambda: _custom_ops(comm, buf, suite)) if args.custom_ops else []
    ops += [
        ("get_dispatch_layout", lambda: buf.get_dispatch_layout(idx, experts)),
        ("dispatch (cached handle)", lambda: buf.dispatch(x, handle=handle)),
        ("combine", lambda: buf.combine(recv_x, handle, topk_weights=recv_w)),
        ("low_latency_dispatch (FP8)", lambda: buf.low_latency_dispatch(lx, lidx, t, le, use_fp8=True)),
        ("low_latency_combine", lambda: buf.low_latency_combine(lout, lidx, lw, ll_handle)),
    ]

    def host_us(fn, calls) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        total = 0.0
        for _ in range(calls // BATCH):
            comm.Barrier()
            park(stream, 4000.0)
            t0 = time.perf_counter()
            for _ in range(BATCH):
                fn()
            total += time.perf_counter() - t0
            torch.cuda.synchronize()
        return total / (calls // BATCH * BATCH) * 1e6

    def profile(fn, calls) -> str:
        prof = cProfile.Profile()
        for _ in range(calls // BATCH):
            comm.Barrier()
            park(stream, 4000.0)
            prof.enable()
            for _ in range(BATCH):
                fn()
            prof.disable()
            torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(16)
        return text.getvalue()

    lines = []
    for name, fn in ops:
        us = host_us(fn, args.calls)
        lines.append(f"HOST {name:32s} {us:8.2f} us/call")
        if not args.no_profile:
            lines.append(f"---- profile: {name}\n{profile(fn, min(args.calls, 200))}")
    lines += _floors(torch, cupy, stream, idx, host_us, args.calls)
    comm.Barrier()
    buf.destroy()
    for fn in _EP_BUFFERS:
        fn()
    if rank == 0:
        text = "\n".join(lines)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")


def _optional(flag: str, make) -> list:
    """The extra ops of ``flag``, or none (said on stderr) where making them fails: the Buffer's ops still run."""
    try:
        return make()
    except Exception as exc:  # noqa: BLE001 - a profile of the other ops is still worth having
        print(f"host_profile: {flag} left out: {type(exc).__name__}: {exc}", file=sys.stderr)
        return []


_EP_BUFFERS: list = []  # destroy() of the EPBuffer _ep_ops made, run after the timings


def _ep_ops(comm, suite, like) -> list:
    """V2's cached dispatch and combine (the ``bench ep`` decode shape) beside V1's same calls."""
    from deepep_cupy.bench.low_latency import micro_batch
    from deepep_cupy.ep import EPBuffer
    from deepep_cupy.frameworks import from_numpy

    t, hidden, experts = suite.t_max, suite.hidden, suite.ll_experts
    x, idx, w = (from_numpy(a, like) for a in micro_batch((6, comm.Get_rank()), t, hidden, experts, 8))
    ep = EPBuffer(comm=comm, num_max_tokens_per_rank=t, hidden=hidden, num_topk=8, explicitly_destroy=True)
    _EP_BUFFERS.append(ep.destroy)
    recv, _, _, handle, _ = ep.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=experts, do_cpu_sync=True)
    v1 = ep.runtime
    v1_handle = handle._v1_handle
    v1_recv = v1.dispatch(x, handle=v1_handle)[0]
    return [
        ("V2 dispatch (cached handle)", lambda: ep.dispatch(x, handle=handle)),
        ("V2 combine", lambda: ep.combine(recv, handle)),
        ("V1 dispatch (same, cached)", lambda: v1.dispatch(x, handle=v1_handle)),
        ("V1 combine (same)", lambda: v1.combine(v1_recv, v1_handle)),
    ]


def _custom_ops(comm, buf, suite) -> list:
    """The custom ops of ``bench compiled``'s part 3 (the calls compiled code makes), on this Buffer."""
    from deepep_cupy.bench.compiled import _Env, low_latency_op_pairs, normal_op_pairs

    env = _Env(comm, buf, 600.0)
    args = argparse.Namespace(tokens=suite.tokens, hidden=suite.hidden, experts=suite.experts, topk=suite.topk,
                              ll_tokens=suite.t_max, ll_experts=suite.ll_experts)
    pairs = normal_op_pairs(env, buf, args) + low_latency_op_pairs(env, buf, args)
    return [(f"custom op {op_name}", custom()) for _, op_name, _, custom in pairs]


def _floors(torch, cupy, stream, tensor, host_us, calls) -> list[str]:
    """Per-call cost of the primitives a call is made of."""
    from cuda.bindings import driver

    from deepep_cupy.device.launch import ArgStruct, LaunchPlan
    from deepep_cupy.frameworks import meta

    kernel = cupy.RawKernel("struct A { long long a; int b; };\n"
                            "extern \"C\" __global__ void nop(const __grid_constant__ A args) {}", "nop")
    kernel.compile()
    plan = LaunchPlan(kernel, 1, 32, ArgStruct("A", [("a", "i64"), ("b", "i32")]), {"a": 0, "b": 0})
    function = driver.CUfunction(int(kernel.kernel.ptr))
    key = (meta(tensor), 128, 288, None, None, True, False, False, False, False)
    cache = {key: 1}
    dev = torch.device("cuda", torch.cuda.current_device())
    raw_stream = torch._C._cuda_getCurrentRawStream
    dev_id = torch.cuda.current_device()
    event = cupy.cuda.runtime.eventCreateWithFlags(2)
    floors = [
        ("dict lookup of a 10-entry plan key", lambda: cache.get(key)),
        ("meta(torch tensor)", lambda: meta(tensor)),
        ("torch.empty((128, 7168), bf16, cuda)", lambda: torch.empty((128, 7168), dtype=torch.bfloat16, device=dev)),
        ("torch.empty((36, 256, 7168), fp8, cuda)",
         lambda: torch.empty((36, 256, 7168), dtype=torch.float8_e4m3fn, device=dev)),
        ("torch current raw stream", lambda: raw_stream(dev_id)),
        ("LaunchPlan.launch (2 args)", lambda: plan.launch(stream.ptr)),
        ("driver.cuLaunchKernel, CUfunction object",
         lambda: driver.cuLaunchKernel(function, 1, 1, 1, 32, 1, 1, 0, stream.ptr, plan._address, 0)),
        ("cudaEventRecord (CuPy runtime)", lambda: cupy.cuda.runtime.eventRecord(event, stream.ptr)),
        ("cudaStreamWaitEvent (CuPy runtime)", lambda: cupy.cuda.runtime.streamWaitEvent(stream.ptr, event, 0)),
    ]
    out = ["FLOORS (us per call)"]
    for name, fn in floors:
        out.append(f"FLOOR {name:44s} {host_us(fn, calls):8.2f}")
    return out


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()

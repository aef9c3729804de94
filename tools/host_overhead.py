"""Host-side cost per call of the Python layers, to see where the microseconds of small ops go.
Single process, one GPU (a one-rank group, so every op runs without peers):

    python tools/host_overhead.py [--profile]

Each figure is the host time of a loop of calls with no synchronisation inside; the work is small, so the
GPU keeps up and the loop measures the host. ``--profile`` adds each Buffer op's top functions (cProfile).
"""

import argparse
import cProfile
import io
import os
import pstats
import time

import numpy as np


def per_call(fn, n=1000) -> float:
    import cupy

    for _ in range(20):
        fn()
    cupy.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    cupy.cuda.Device().synchronize()
    return host


def profile(name: str, fn, n=300) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    return f"---- {name} ({n} calls)\n" + out.getvalue()


def _primitives(rows, cupy, stream):
    rows.append(("cupy.empty(4096x2 bool)", per_call(lambda: cupy.empty((4096, 2), dtype=cupy.bool_))))
    rows.append(("with stream: (enter+exit)", per_call(lambda: (stream.__enter__(), stream.__exit__(None, None, None)))))
    ev = cupy.cuda.Event(disable_timing=True)
    rows.append(("cupy.cuda.Event()", per_call(lambda: cupy.cuda.Event(disable_timing=True))))
    rows.append(("event.record + stream.wait_event", per_call(lambda: (ev.record(stream), stream.wait_event(ev)))))


def _ops(cupy, deep_ep, comm, rng):
    """(name, fn) of the Buffer ops at small sizes: normal (cached and not) and low-latency."""
    import ml_dtypes

    ops = []
    tokens, hidden, experts, topk = 128, 2048, 16, 4
    idx = cupy.asarray(np.argsort(rng.random((tokens, experts)), axis=1)[:, :topk].astype(np.int64))
    w = cupy.asarray(rng.random((tokens, topk), dtype=np.float32))
    x = cupy.asarray(rng.standard_normal((tokens, hidden)).astype(ml_dtypes.bfloat16))
    cfg = deep_ep.Buffer.get_dispatch_config(1)
    nvl = cfg.get_nvl_buffer_size_hint(hidden * 2, 1)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, 1, experts)
    buf = deep_ep.Buffer(comm=comm, num_nvl_bytes=nvl, num_rdma_bytes=rdma, low_latency_mode=True,
                         explicitly_destroy=True)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    ops.append(("Buffer.get_dispatch_layout", lambda: buf.get_dispatch_layout(idx, experts)))
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                   num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    ops.append(("Buffer.dispatch (layout given, CPU sync)", lambda: buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w)))
    ops.append(("Buffer.dispatch (cached handle)", lambda: buf.dispatch(x, handle=handle)))
    ops.append(("Buffer.combine", lambda: buf.combine(recv_x, handle, topk_weights=recv_w)))
    buf.clean_low_latency_buffer(tokens, hidden, experts)
    _, _, ll_handle, _, _ = buf.low_latency_dispatch(x, idx, tokens, experts, use_fp8=True)
    expert_out = cupy.asarray(rng.standard_normal((experts, tokens, hidden)).astype(ml_dtypes.bfloat16))
    ops.append(("Buffer.low_latency_dispatch (FP8)", lambda: buf.low_latency_dispatch(
        x, idx, tokens, experts, use_fp8=True)))
    ops.append(("Buffer.low_latency_combine", lambda: buf.low_latency_combine(expert_out, idx, w, ll_handle)))
    ops.append(("Buffer.low_latency_dispatch (hook)", lambda: buf.low_latency_dispatch(
        x, idx, tokens, experts, use_fp8=True, return_recv_hook=True)[-1]()))
    return buf, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    import cupy
    from mpi4py import MPI

    import deepep_cupy as deep_ep
    from deepep_cupy.ops.layout import get_dispatch_layout

    rows, profiles = [], []
    stream = cupy.cuda.Stream(non_blocking=True)
    _primitives(rows, cupy, stream)
    idx = cupy.asarray(np.random.default_rng(0).integers(0, 256, (4096, 8)), dtype=cupy.int64)
    get_dispatch_layout(idx, 256, 2, 2, stream=stream)
    rows.append(("ops.layout.get_dispatch_layout", per_call(lambda: get_dispatch_layout(idx, 256, 2, 2, stream=stream))))

    buf, ops = _ops(cupy, deep_ep, MPI.COMM_SELF, np.random.default_rng(1))
    for validate in ("1", "0"):
        os.environ["DEEPEP_CUPY_VALIDATE"] = validate
        for name, fn in ops:
            try:
                rows.append((f"{name}{'' if validate == '1' else ' [VALIDATE=0]'}", per_call(fn, n=300)))
                if args.profile and validate == "1":
                    profiles.append(profile(name, fn))
            except Exception as exc:  # report and go on: one broken op must not hide the others
                rows.append((f"{name}: {type(exc).__name__}: {exc}"[:160], float("nan")))
    try:
        import torch

        t_idx = torch.as_tensor(idx.get(), device="cuda")
        rows.append(("torch.from_dlpack(cupy)", per_call(lambda: torch.from_dlpack(idx))))
        rows.append(("cupy.from_dlpack(torch)", per_call(lambda: cupy.from_dlpack(t_idx))))
        rows.append(("Buffer.get_dispatch_layout (torch)", per_call(lambda: buf.get_dispatch_layout(t_idx, 256))))
    except ImportError:
        pass
    buf.destroy()
    for text in profiles:
        print(text)
    print("HOST OVERHEAD (us per call, host side only)")
    for name, us in rows:
        print(f"  {name:52s} {us:8.2f}")


if __name__ == "__main__":
    main()

"""Low-latency kernels on DeepEP's decode workload: 128 tokens per rank, hidden 7168, top-8 of 288 experts,
FP8 dispatch and BF16 combine (``--ll-tokens``, ``--hidden``, ``--ll-experts``, ``--topk`` change it).

Bytes are counted as DeepEP's tests/test_low_latency.py counts them: per sending rank, for every token and
every valid top-k entry, ``H + H/128*4 + 16`` bytes (FP8 dispatch), ``2H`` (BF16 dispatch and combine) or
``10H/8 + H/128*4`` (LogFMT combine).

Timing: each sample first parks the GPU in a short sleep kernel, so that the host can queue the timed
operations behind it; the CUDA events then measure only GPU time, with no launch gaps. A sample times
``--ll-reps`` consecutive operations (the ranks' start skew is spread over them) and reports the mean per
operation; the table shows the median sample, averaged over the ranks. With the receive hook, each send
and each receive kernel is bracketed by its own events. These times include the GPU's gaps between
launches. The ``kernel us`` column is kernel time as DeepEP's low-latency test measures it: the kernels'
own durations from CUPTI (through ``torch.profiler``), median over the calls, without those gaps.
"""

from __future__ import annotations

import statistics

import numpy as np

from ..device.group import comm_barrier
from ..frameworks import TensorKind, cupy_holds, from_numpy
from ..ops.low_latency.engine import warp_split
from .timing import kernel_durations, park, row

__all__ = ["run", "decode_shape", "device_kind", "low_latency_buffer", "micro_batch"]


def decode_shape(args) -> tuple[int, int, int, int]:
    """The decode workload from the command line: tokens per rank, hidden, experts, top-k."""
    return (int(getattr(args, "ll_tokens", 128)), int(getattr(args, "hidden", 7168)),
            int(getattr(args, "ll_experts", 288)), int(getattr(args, "topk", 8)))


def device_kind() -> TensorKind:
    """Arrays for this device: CuPy's where it holds bfloat16, else torch's."""
    import cupy
    import ml_dtypes

    fw = "cupy" if cupy_holds(np.dtype(ml_dtypes.bfloat16)) else "torch"
    return TensorKind(fw, cupy.cuda.runtime.getDevice())


def low_latency_buffer(comm, t_max: int, hidden: int, num_experts: int):
    """A low-latency Buffer sized by DeepEP's hint for the workload, destroyed explicitly by the caller."""
    import deepep_cupy

    size = comm.Get_size()
    return deepep_cupy.Buffer(comm=comm, num_rdma_bytes=deepep_cupy.Buffer.get_low_latency_rdma_size_hint(
        t_max, hidden, size, num_experts), low_latency_mode=True, num_qps_per_rank=max(1, num_experts // size),
        explicitly_destroy=True)


def micro_batch(seed, t_max: int, hidden: int, num_experts: int, topk: int):
    """One micro-batch of the decode workload on the host: ``x`` `[t_max, hidden]` bf16, ``topk_idx``
    `[t_max, topk]` int64 (distinct experts, ten slots set to -1) and ``weights`` `[t_max, topk]` float32."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((t_max, hidden), dtype=np.float32) * 0.5).astype(ml_dtypes.bfloat16)
    scores = np.abs(rng.standard_normal((t_max, num_experts), dtype=np.float32)) + 1
    topk_idx = np.argsort(-scores, axis=1, kind="stable")[:, :topk].astype(np.int64)
    for _ in range(10):  # a few empty slots, as DeepEP's test has
        topk_idx[rng.integers(t_max), rng.integers(topk)] = -1
    weights = rng.random((t_max, topk), dtype=np.float32)
    return x, topk_idx, weights


def _bytes(topk_idx: np.ndarray, hidden: int) -> dict[str, float]:
    selections = int((topk_idx != -1).sum())
    return {
        "fp8": selections * (hidden + hidden / 128 * 4 + 16),
        "bf16": selections * hidden * 2.0,
        "logfmt": selections * (hidden * 10 / 8 + hidden / 128 * 4),
    }


def run(comm, args) -> list[dict]:
    """Benchmark rows (``op``, ``us``, ``GB/s``, ``SMs``) for the low-latency kernels; collective."""
    import cupy
    import ml_dtypes

    rank, size = comm.Get_rank(), comm.Get_size()
    t_max, hidden, num_experts, topk = decode_shape(args)
    reps = int(getattr(args, "ll_reps", 10))
    samples = int(getattr(args, "ll_samples", 20))
    like = device_kind()

    x, topk_idx, weights = micro_batch(2024 + rank, t_max, hidden, num_experts, topk)
    rng = np.random.default_rng((2024, rank, 2))
    e_local = num_experts // size
    expert_out = (rng.standard_normal((e_local, size * t_max, hidden), dtype=np.float32) * 0.1).astype(
        ml_dtypes.bfloat16)
    nbytes = _bytes(topk_idx, hidden)

    buf = low_latency_buffer(comm, t_max, hidden, num_experts)
    rows: list[dict] = []
    try:
        x_d, topk_d, w_d, eo_d = (from_numpy(a, like) for a in (x, topk_idx, weights, expert_out))
        stream = cupy.cuda.get_current_stream()

        def dispatch(fp8=True, hook=False):
            return buf.low_latency_dispatch(x_d, topk_d, t_max, num_experts, use_fp8=fp8, return_recv_hook=hook)

        _, _, handle, _, _ = dispatch()

        def combine(logfmt=False, hook=False):
            return buf.low_latency_combine(eo_d, topk_d, w_d, handle, use_logfmt=logfmt, return_recv_hook=hook)

        def sample(ops, with_parts=False):
            """One sample: mean GPU microseconds per op (and per part with hooks)."""
            comm_barrier(comm, "bench low_latency: before a sample")
            park(stream, 5000)
            if not with_parts:
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                start.record(stream)
                for _ in range(reps):
                    ops()
                end.record(stream)
                end.synchronize()
                return cupy.cuda.get_elapsed_time(start, end) * 1e3 / reps, None
            events = []
            for _ in range(reps):
                e0, e1, e2 = cupy.cuda.Event(), cupy.cuda.Event(), cupy.cuda.Event()
                e0.record(stream)
                hook = ops()
                e1.record(stream)
                hook()
                e2.record(stream)
                events.append((e0, e1, e2))
            events[-1][2].synchronize()
            send = sum(cupy.cuda.get_elapsed_time(a, b) for a, b, _ in events) * 1e3 / reps
            recv = sum(cupy.cuda.get_elapsed_time(b, c) for _, b, c in events) * 1e3 / reps
            return send, recv

        def measure(ops, with_parts=False):
            for _ in range(2):  # warm-up (compiles, first-touch)
                sample(ops, with_parts)
            got = [sample(ops, with_parts) for _ in range(samples)]
            first = statistics.median(g[0] for g in got)
            second = statistics.median(g[1] for g in got) if with_parts else None
            firsts = comm.allgather(first)
            seconds = comm.allgather(second)
            return float(np.mean(firsts)), (float(np.mean(seconds)) if with_parts else None)

        def kernel_us(ops, with_parts=False):
            """Kernel time per op as DeepEP's test takes it (CUPTI records, every kernel of the op summed;
            send and receive apart with the hook), averaged over the ranks; None without torch."""
            def call():
                hook = ops()
                if with_parts:  # the peers' sends land first, as when compute runs between the parts
                    cupy.cuda.Device().synchronize()
                    comm_barrier(comm, "bench low_latency: between send and receive")
                    hook()

            def barrier():
                comm_barrier(comm, "bench low_latency: before a recorded call")

            for _ in range(3):
                call()
            comm_barrier(comm, "bench low_latency: before the kernel records")
            # Without the hook, the calls queue up behind a parked GPU on every rank, so the kernels run back
            # to back and the fused ones do not wait for a peer's host to issue its call.
            got = kernel_durations(call, reps * 2, "low_latency::", lambda: cupy.cuda.Device().synchronize(),
                                   before=None if with_parts else lambda: (barrier(), park(stream, 5000)))
            per = len(got) // (reps * 2) if got else 0
            if per == 0 or len(got) != per * reps * 2:
                value = None
            elif with_parts:
                value = (statistics.median(got[0::2]), statistics.median(got[1::2]))
            else:
                value = statistics.median(sum(got[i * per:(i + 1) * per]) for i in range(reps * 2))
            values = comm.allgather(value)
            if any(v is None for v in values):
                return (None, None) if with_parts else None
            if with_parts:
                return tuple(round(float(np.mean([v[i] for v in values])), 2) for i in (0, 1))
            return round(float(np.mean(values)), 2)

        # Every op runs one block per SM, except BF16 dispatch rows sent per (token, expert): one block per
        # expert group.
        engine = buf.runtime.low_latency
        sms = engine.num_sms
        per_rank_bf16 = engine.rank_messages(engine.make_buffer_map(t_max, hidden, num_experts), topk, False)
        sms_bf16 = sms if per_rank_bf16 else warp_split(num_experts, sms)[2]

        us, _ = measure(lambda: dispatch())
        rows.append(row("LL dispatch FP8", us, nbytes["fp8"], sms, **{"kernel us": kernel_us(lambda: dispatch())}))

        def other_paths(**paths):
            """Measure the FP8 dispatch on plans made with other engine paths (plans keep their paths)."""
            saved = {name: getattr(engine, name) for name in paths}
            buf._ll_dispatch_plans.clear()
            try:
                for name, value in paths.items():
                    setattr(engine, name, value)
                return measure(lambda: dispatch())[0], kernel_us(lambda: dispatch())
            finally:
                for name, value in saved.items():
                    setattr(engine, name, value)
                buf._ll_dispatch_plans.clear()

        if not engine.per_expert:  # the same op with one row per (token, expert), cast on the fly or pre-cast
            us, k_us = other_paths(per_expert=True, staged=False)
            rows.append(row("LL dispatch FP8 (per-expert rows)", us, nbytes["fp8"], sms, **{"kernel us": k_us}))
        if not engine.staged:
            us, _ = other_paths(per_expert=True, staged=True)
            rows.append(row("LL dispatch FP8 (per-expert, pre-cast)", us, nbytes["fp8"], sms))
        us, _ = measure(lambda: dispatch(fp8=False))
        rows.append(row("LL dispatch BF16", us, nbytes["bf16"], sms_bf16,
                        **{"kernel us": kernel_us(lambda: dispatch(fp8=False))}))
        us, _ = measure(lambda: combine())
        rows.append(row("LL combine BF16", us, nbytes["bf16"], sms, **{"kernel us": kernel_us(lambda: combine())}))
        us, _ = measure(lambda: combine(logfmt=True))
        rows.append(row("LL combine LogFMT", us, nbytes["logfmt"], sms,
                        **{"kernel us": kernel_us(lambda: combine(logfmt=True))}))

        def both():
            nonlocal handle
            _, _, handle, _, _ = dispatch()
            combine()

        us, _ = measure(both)
        rows.append(row("LL dispatch+combine", us, nbytes["fp8"] + nbytes["bf16"], sms, **{"kernel us": kernel_us(both)}))

        for name, ops in (("LL dispatch", lambda: dispatch(hook=True)[4]), ("LL combine", lambda: combine(hook=True)[2]),
                          ("LL combine LogFMT", lambda: combine(logfmt=True, hook=True)[2])):
            send, recv = measure(ops, with_parts=True)
            k_send, k_recv = kernel_us(ops, with_parts=True)
            rows.append(row(f"{name} send (hook)", send, None, sms, **{"kernel us": k_send}))
            rows.append(row(f"{name} recv (hook)", recv, None, sms, **{"kernel us": k_recv}))
    finally:
        cupy.cuda.Device().synchronize()
        comm_barrier(comm, "bench low_latency: before destroy")
        buf.destroy()
    return rows

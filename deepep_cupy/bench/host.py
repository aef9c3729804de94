"""Host cost of the Buffer API, for torch and for CuPy inputs, and a decode step eager versus CUDA graph.

Part 1, host microseconds per call: the wall time of the Python call alone, with validation on (the
library's default, whatever the other suites use). Each op is called ``CALLS`` times in batches of
``BATCH``; each batch starts behind a sleep kernel (:func:`~deepep_cupy.bench.timing.park`) so the GPU is
busy for the whole batch: a call then returns as soon as its work is queued, and a call that waited for
the GPU would show up as at least ``PARK_US``. A batch is short enough that the launch queue never fills.
Beside it, the op's GPU time: CUDA events around each batch, from the end of the sleep to the end of the
batch, over the calls of the batch (the calls run back to back on the GPU, since they were all queued
before it reached them). An op whose host time is below its GPU time cannot make an eager loop host-bound.
The dispatch that learns its sizes from the GPU (notify + CPU sync) has to wait for the GPU by design:
its batches run without the sleep kernel and its time includes that wait. Figures are means over calls
and ranks.

Part 2, torch only, DeepEP's decode step: ``low_latency_dispatch`` (FP8) then ``low_latency_combine``,
128 tokens x 7168 hidden, top-8 of 288 experts. Four figures per step: an eager loop (CUDA events around
``STEPS`` back-to-back steps, so the host's share counts where it is the slower side), the same loop with
an event pair around each step (how DeepEP's ``tests/utils.py`` ``bench`` times it: the mean of the
pairs), the step captured once with ``torch.cuda.graph`` after an eager call and replayed ``STEPS``
times, and the GPU time alone (steps queued behind a sleep kernel, as the other suites measure kernels).
A capture that raises is reported in its row, and the suite goes on.

    mpirun -np 2 python -m deepep_cupy.bench host
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from ..device.group import comm_barrier
from ..device.streams import current_stream
from ..frameworks import TensorKind, cupy_holds, from_numpy
from .timing import format_table, park, row

__all__ = ["run"]

CALLS = 200  # calls per op in part 1
BATCH = 10  # calls between synchronisations
WARMUP = 3  # calls before timing (plans, kernel compiles)
PARK_US = 3000.0  # GPU sleep ahead of each batch; longer than any batch's host time
STEPS = 200  # decode steps per eager loop and graph replays per timing
GPU_SAMPLES, GPU_REPS, GPU_PARK_US = 10, 20, 5000.0  # GPU time of the decode step: samples x steps each


def routing(rng, tokens: int, num_experts: int, topk: int) -> np.ndarray:
    scores = np.abs(rng.standard_normal((tokens, num_experts))).astype(np.float32) + 1
    return np.ascontiguousarray(np.argsort(-scores, axis=1, kind="stable")[:, :topk].astype(np.int64))


def _clock(fn):
    """One timed call of ``fn``: a tuple of the seconds it took."""
    def once():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t,)

    return once


def _clock_hook(send):
    """One send call with ``return_recv_hook=True`` then its hook: seconds of each."""
    def once():
        t0 = time.perf_counter()
        hook = send()
        t1 = time.perf_counter()
        hook()
        return (t1 - t0, time.perf_counter() - t1)

    return once


class _Suite:
    def __init__(self, comm, args):
        import ml_dtypes

        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.tokens = int(getattr(args, "tokens", 4096))
        self.hidden = int(getattr(args, "hidden", 7168))
        self.experts = int(getattr(args, "experts", 256))
        self.topk = int(getattr(args, "topk", 8))
        self.t_max = int(getattr(args, "ll_tokens", 128))
        self.ll_experts = int(getattr(args, "ll_experts", 288))
        bf16 = ml_dtypes.bfloat16
        rng = np.random.default_rng(4242 + self.rank)
        h = self.hidden
        self.host = {
            "x": (rng.standard_normal((self.tokens, h)) * 0.5).astype(np.float32).astype(bf16),
            "idx": routing(rng, self.tokens, self.experts, self.topk),
            "w": rng.random((self.tokens, self.topk), dtype=np.float32),
            "ll_x": (rng.standard_normal((self.t_max, h)) * 0.5).astype(np.float32).astype(bf16),
            "ll_idx": routing(rng, self.t_max, self.ll_experts, self.topk),
            "ll_w": rng.random((self.t_max, self.topk), dtype=np.float32),
            "ll_out": (rng.standard_normal((self.ll_experts // self.size, self.size * self.t_max, h)) * 0.1)
            .astype(np.float32).astype(bf16),
        }

    # ---- helpers -------------------------------------------------------------------------------------

    def mean_over_ranks(self, values):
        got = self.comm.allgather(values)
        return [float(np.mean([g[i] for g in got])) for i in range(len(values))]

    def host_us(self, once, stream, park_us=PARK_US) -> list[float]:
        """Mean host microseconds of each part ``once()`` times, over ``CALLS`` calls and the ranks; then,
        where the batches were parked, the GPU microseconds per call (see the module docstring)."""
        import cupy

        for _ in range(WARMUP):
            once()
        cupy.cuda.Device().synchronize()
        sums, gpu = None, 0.0
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        for _ in range(CALLS // BATCH):
            comm_barrier(self.comm, "bench host: before a batch of calls")
            if park_us:
                park(stream, park_us)
                start.record(stream)
            for _ in range(BATCH):
                got = once()
                sums = list(got) if sums is None else [a + b for a, b in zip(sums, got, strict=True)]
            if park_us:
                end.record(stream)
            cupy.cuda.Device().synchronize()
            if park_us:
                gpu += cupy.cuda.get_elapsed_time(start, end) * 1e3
        calls = CALLS // BATCH * BATCH
        means = self.mean_over_ranks([s / calls * 1e6 for s in sums] + [gpu / calls])
        return means if park_us else means[:-1]

    # ---- part 1 --------------------------------------------------------------------------------------

    def host_ops(self, buf, fw: str, stream) -> list[tuple[str, float]]:
        """(op, host µs) of every Buffer op with ``fw`` inputs."""
        import cupy


        like = TensorKind(fw, cupy.cuda.runtime.getDevice())
        d = {k: from_numpy(v, like) for k, v in self.host.items()}
        x, idx, w, e = d["x"], d["idx"], d["w"], self.experts
        out: list[tuple[str, float]] = []

        out.append(("get_dispatch_layout", *self.host_us(_clock(lambda: buf.get_dispatch_layout(idx, e)), stream)))
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, e)
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                      topk_idx=idx, topk_weights=w)
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **layout)
        out.append(("dispatch (notify + CPU sync; waits for the GPU)",
                    *self.host_us(_clock(lambda: buf.dispatch(x, **layout)), stream, park_us=0)))
        out.append(("dispatch (cached handle)", *self.host_us(_clock(lambda: buf.dispatch(x, handle=handle)), stream)))
        worst = self.tokens * self.size
        out.append((f"dispatch (num_worst_tokens={worst})", *self.host_us(
            _clock(lambda: buf.dispatch(x, num_worst_tokens=worst, **layout)), stream)))
        out.append(("combine", *self.host_us(_clock(lambda: buf.combine(recv_x, handle, topk_weights=recv_w)),
                                             stream)))

        # The normal kernels shared the buffer: the low-latency ones need their state zeroed first.
        buf.clean_low_latency_buffer(self.t_max, self.hidden, self.ll_experts)
        lx, lidx, lw, lout, t, le = d["ll_x"], d["ll_idx"], d["ll_w"], d["ll_out"], self.t_max, self.ll_experts

        def ll_dispatch(hook=False):
            return buf.low_latency_dispatch(lx, lidx, t, le, use_fp8=True, return_recv_hook=hook)

        out.append(("low_latency_dispatch (FP8)", *self.host_us(_clock(ll_dispatch), stream)))
        ll_handle = ll_dispatch()[2]
        out.append(("low_latency_combine", *self.host_us(
            _clock(lambda: buf.low_latency_combine(lout, lidx, lw, ll_handle)), stream)))
        send, recv, *_ = self.host_us(_clock_hook(lambda: ll_dispatch(hook=True)[4]), stream)
        out += [("low_latency_dispatch (FP8, hook): send", send), ("low_latency_dispatch (FP8, hook): hook()", recv)]
        send, recv, *_ = self.host_us(_clock_hook(
            lambda: buf.low_latency_combine(lout, lidx, lw, ll_handle, return_recv_hook=True)[2]), stream)
        out += [("low_latency_combine (hook): send", send), ("low_latency_combine (hook): hook()", recv)]
        cupy.cuda.Device().synchronize()
        return out

    # ---- part 2 --------------------------------------------------------------------------------------

    def decode_step(self, buf, stream) -> list[dict]:
        import cupy
        import torch


        like = TensorKind("torch", torch.cuda.current_device())
        lx, lidx, lw, lout = (from_numpy(self.host[k], like) for k in ("ll_x", "ll_idx", "ll_w", "ll_out"))
        t, le = self.t_max, self.ll_experts

        def step():
            _, _, handle, _, _ = buf.low_latency_dispatch(lx, lidx, t, le, use_fp8=True)
            buf.low_latency_combine(lout, lidx, lw, handle)

        def per_step_us(fn, n, park_us=0.0):
            comm_barrier(self.comm, "bench host: before the decode steps")
            if park_us:
                park(stream, park_us)
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            for _ in range(n):
                fn()
            end.record(stream)
            end.synchronize()
            return cupy.cuda.get_elapsed_time(start, end) * 1e3 / n

        def each_step_us(fn, n):
            """An event pair around every step, as DeepEP's ``bench`` does; the mean of the pairs, the first
            left out."""
            comm_barrier(self.comm, "bench host: before the decode steps")
            pairs = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(n)]
            for start, end in pairs:
                start.record(stream)
                fn()
                end.record(stream)
            pairs[-1][1].synchronize()
            return statistics.fmean(cupy.cuda.get_elapsed_time(s, e) * 1e3 for s, e in pairs[1:])

        name = f"decode step: LL dispatch FP8 + combine, {t} x {self.hidden}, top-{self.topk} of {le}"
        rows = []
        for _ in range(10):
            step()
        cupy.cuda.Device().synchronize()
        (eager,) = self.mean_over_ranks([per_step_us(step, STEPS)])
        rows.append(row(f"{name}: eager loop", eager, framework="torch"))
        (each,) = self.mean_over_ranks([each_step_us(step, STEPS)])
        rows.append(row(f"{name}: eager, an event pair per step", each, framework="torch"))
        samples = [per_step_us(step, GPU_REPS, GPU_PARK_US) for _ in range(GPU_SAMPLES)]
        (kernels,) = self.mean_over_ranks([statistics.median(samples)])

        # One eager call right before the capture, as DeepEP's users do: plans exist before capturing.
        step()
        cupy.cuda.Device().synchronize()
        graph, error = None, ""
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
        except Exception as exc:  # reported in the table, not hidden: the capture is what is measured
            graph, error = None, f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        errors = self.comm.allgather(error)
        if any(errors):
            first = next(r for r, e in enumerate(errors) if e)
            rows.append({"op": f"{name}: CUDA graph replay", "framework": "torch",
                         "note": f"capture failed on rank {first}: {errors[first]}"})
        else:
            for _ in range(3):
                graph.replay()
            cupy.cuda.Device().synchronize()
            (replay,) = self.mean_over_ranks([per_step_us(graph.replay, STEPS)])
            rows.append(row(f"{name}: CUDA graph replay", replay, framework="torch"))
        rows.append(row(f"{name}: kernels (GPU time)", kernels, framework="torch"))
        cupy.cuda.Device().synchronize()
        del graph
        return rows


def _frameworks() -> tuple[list[str], dict[str, str]]:
    """Frameworks to measure, and why any is left out."""
    import ml_dtypes


    use, skipped = [], {}
    try:
        import torch

        if torch.cuda.is_available():
            use.append("torch")
        else:
            skipped["torch"] = "torch has no CUDA"
    except ImportError:
        skipped["torch"] = "torch not installed"
    if cupy_holds(np.dtype(ml_dtypes.bfloat16)):
        use.append("cupy")
    else:
        skipped["cupy"] = "this CuPy cannot hold bfloat16 (CuPy >= 14 needed)"
    return use, skipped


def _torch_stream():
    import torch

    return current_stream("torch", torch.cuda.current_device())


def run(comm, args) -> list[dict]:
    """Rows (``op``, ``us``, ``framework``, ``note``): host µs per call, then the decode step; collective."""
    import cupy

    import deepep_cupy

    suite = _Suite(comm, args)
    size = suite.size
    nvl = max(deepep_cupy.Buffer.get_dispatch_config(size).get_nvl_buffer_size_hint(suite.hidden * 2, size),
              deepep_cupy.Buffer.get_combine_config(size).get_nvl_buffer_size_hint(suite.hidden * 2, size))
    rdma = deepep_cupy.Buffer.get_low_latency_rdma_size_hint(suite.t_max, suite.hidden, size, suite.ll_experts)
    buf = deepep_cupy.Buffer(comm=comm, num_nvl_bytes=nvl, num_rdma_bytes=rdma, low_latency_mode=True,
                             num_qps_per_rank=max(1, suite.ll_experts // size), explicitly_destroy=True)
    frameworks, skipped = _frameworks()
    rows: list[dict] = [{"op": "host: all ops", "framework": fw, "note": why} for fw, why in skipped.items()]
    table: dict[str, dict] = {}
    saved = os.environ.get("DEEPEP_CUPY_VALIDATE")
    os.environ["DEEPEP_CUPY_VALIDATE"] = "1"  # the library's default, which the bench's entry point turns off
    try:
        for fw in frameworks:
            stream = _torch_stream() if fw == "torch" else cupy.cuda.get_current_stream()
            try:
                got = suite.host_ops(buf, fw, stream)
            except Exception as exc:  # one framework's failure must not hide the other's numbers
                got = []
                rows.append({"op": "host: all ops", "framework": fw, "note": f"failed: {type(exc).__name__}: {exc}"})
            for op, us, *gpu in got:
                rows.append(row(f"host: {op}", us, framework=fw, **({"gpu_us": round(gpu[0], 2)} if gpu else {})))
                table.setdefault(op, {"op": op})[f"{fw} host us"] = round(us, 2)
                table[op][f"{fw} GPU us"] = round(gpu[0], 2) if gpu else "-"
        decode = []
        if "torch" in frameworks:
            try:
                decode = suite.decode_step(buf, _torch_stream())
            except Exception as exc:
                decode = [{"op": "decode step", "framework": "torch", "note": f"failed: {type(exc).__name__}: {exc}"}]
        rows += decode
    finally:
        cupy.cuda.Device().synchronize()
        comm_barrier(comm, "bench host: before destroy")
        buf.destroy()
        if saved is None:
            os.environ.pop("DEEPEP_CUPY_VALIDATE", None)
        else:
            os.environ["DEEPEP_CUPY_VALIDATE"] = saved
    if suite.rank == 0:
        print(f"\nHost time per call, us (validation on; mean of {CALLS} calls and {size} ranks; GPU kept busy)")
        if table:
            print(format_table(list(table.values())))
        for why in skipped.values():
            print(f"  ({why})")
        if decode:
            print(format_table([{k: v for k, v in r.items() if k != "framework"} for r in decode]), flush=True)
    return rows

"""Shared timing helpers: CUDA-event timing with warm-up, median of many runs, DeepEP-style lines."""

from __future__ import annotations

import argparse
import statistics

__all__ = ["time_op", "park", "row", "format_table", "kernel_durations", "parse_sm_counts", "sm_counts"]

_PARK_SRC = r"""
extern "C" __global__ void park(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(10000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"""
_park_kernels: dict = {}


def park(stream, us: float) -> None:
    """Keep ``stream``'s GPU busy for ``us`` microseconds in a one-thread sleep kernel.

    Queued ahead of a timed region, it lets the host enqueue the timed work before the GPU reaches it,
    so the CUDA events then see GPU time only, without the host's launch overhead.
    """
    import cupy
    import numpy as np

    device = cupy.cuda.runtime.getDevice()
    kernel = _park_kernels.get(device)
    if kernel is None:
        kernel = _park_kernels[device] = cupy.RawKernel(_PARK_SRC, "park")
    with stream:
        kernel((1,), (1,), (np.uint64(int(us * 1e3)),))


def time_op(fn, *, warmup: int = 5, iters: int = 30, stream=None, before=None, park_us: float = 0.0) -> float:
    """Median microseconds of ``fn()`` measured with CUDA events on ``stream`` (CuPy's current by default).

    ``before`` runs outside the timed region ahead of each call (to flush caches or reset state).
    ``park_us > 0`` parks the GPU (:func:`park`) before each start event: GPU time only. Otherwise the
    stream is idle at the start event, and the time includes the host's work of issuing ``fn``.
    """
    import cupy

    stream = stream or cupy.cuda.get_current_stream()
    for _ in range(warmup):
        if before:
            before()
        fn()
    stream.synchronize()
    times = []
    for _ in range(iters):
        if before:
            before()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        if park_us > 0:
            park(stream, park_us)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
    return statistics.median(times)


def kernel_durations(fn, reps: int, name: str, sync, before=None) -> list[float] | None:
    """GPU durations in microseconds, in launch order, of the kernels whose name contains ``name`` that
    ``reps`` calls of ``fn`` launch: CUPTI's kernel records through ``torch.profiler``, which is how
    DeepEP's low-latency test measures kernel time (no launch gaps, no host time). None without torch on
    a GPU. ``sync()`` waits for the device (it runs inside the profiled region, after the calls);
    ``before()``, if given, runs inside it ahead of the calls (e.g. :func:`park`).
    """
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        if before is not None:
            before()
        for _ in range(reps):
            fn()
        sync()
    kernels = [e for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and name in e.name]
    kernels.sort(key=lambda e: e.time_range.start)
    return [e.time_range.elapsed_us() for e in kernels]


def row(op: str, us: float, nbytes: float | None = None, sms: int | None = None, **extra) -> dict:
    """One result: op name, microseconds, GB/s (``nbytes`` over the time) and SMs."""
    out = {"op": op, "us": round(us, 2)}
    if nbytes is not None:
        out["GB/s"] = round(nbytes / (us * 1e-6) / 1e9, 1)
    if sms is not None:
        out["SMs"] = sms
    out.update(extra)
    return out


def format_table(rows: list[dict]) -> str:
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    widths = {k: max(len(k), *(len(str(r.get(k, ""))) for r in rows)) for k in keys}
    lines = [" | ".join(k.ljust(widths[k]) for k in keys), "-+-".join("-" * widths[k] for k in keys)]
    lines += [" | ".join(str(r.get(k, "")).ljust(widths[k]) for k in keys) for r in rows]
    return "\n".join(lines)


def parse_sm_counts(text: str) -> tuple[int, ...]:
    """``--num-sms`` (an argparse ``type``): one SM count (``24``) or a comma list (``8,12,24``), each a
    positive int, in the order given, each once."""
    try:
        values = tuple(int(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected a positive int or a comma list of them (8,12,24), got {text!r}")
    return tuple(dict.fromkeys(values))


def sm_counts(args) -> tuple[int, ...]:
    """The SM counts of a run's ``args.num_sms`` (a tuple from the command line, or a plain int)."""
    value = args.num_sms
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)

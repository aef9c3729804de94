"""Shared timing helpers: CUDA-event timing with warm-up, median of many runs, DeepEP-style lines."""

from __future__ import annotations

import statistics

__all__ = ["time_op", "row", "format_table"]


def time_op(fn, *, warmup: int = 5, iters: int = 30, stream=None, before=None) -> float:
    """Median microseconds of ``fn()`` measured with CUDA events on ``stream`` (CuPy's current by default).

    ``before`` runs outside the timed region ahead of each call (to flush caches or reset state).
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
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
    return statistics.median(times)


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

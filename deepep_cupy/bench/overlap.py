"""The low-latency ops in hook mode (``return_recv_hook=True``): does a send wait for a late peer, and how much
of the communication do two overlapped micro-batches hide behind compute? DeepEP's decode workload per
micro-batch: 128 tokens x 7168 per rank, top-8 of 288 experts, a few -1 slots (``--ll-tokens``, ``--hidden``,
``--ll-experts``, ``--topk`` change it); FP8 dispatch and BF16 combine in the overlapped step.

Late peer. A sample: every rank passes a barrier; in the "late" rows the last rank then sleeps ``--late-ms``
on the host; every rank parks its GPU (so that the send is queued before its start event), issues the send
between a CUDA event on its stream and one on each of its stream and the Buffer's communication stream (where
a hook-mode send runs), calls the hook (the receive) and synchronizes. A row is rank 0's median send time,
for the dispatch (BF16, FP8), the combine after a BF16 dispatch and the combine after an FP8 dispatch. A send
that does not wait for its peers stays near its on-time figure; one that waits for the late peer's call
takes about ``--late-ms`` longer (the ``over on time us`` column).

Overlap. One decode step of micro-batches A and B in the order of two-batch overlap (as SGLang runs it):

    dispatch send A; compute; dispatch send B; compute; dispatch receive A; dispatch receive B;
    combine send A; compute; combine send B; compute; combine receive A; combine receive B

where "compute" is the park kernel of :mod:`.timing` (one thread sleeping on ``%globaltimer``) for
``--compute-us``: it keeps the stream busy on one SM, leaving the others to the communication kernels. The
expert outputs are fixed BF16 arrays (the combine does not look at where its rows came from). Each time is the
median of samples between CUDA events behind a parked GPU, with a barrier per sample, averaged over the ranks:

    C = the step without compute (communication only),
    P = the four compute kernels alone (about 4 x ``--compute-us``),
    S = the step with compute (the row's ``us``),
    hidden = (C + P - S) / C, the fraction of the communication time the compute hid: 100% when the step
        costs only its compute, 0% when it costs communication plus compute.

``hidden %`` shows it clamped to [0, 100]; ``hidden raw %`` is the value itself (noise may put it outside).

Before timing, the step's combined outputs (with and without compute) are compared bit for bit with those
of the same calls made one at a time (dispatch, its hook, combine, its hook; A, then B); they must also be
finite, not all zero, and differ between A and B. A failed check on any rank raises on every rank and fails
the run (``FAIL_RUN``).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from ..device.group import comm_barrier
from ..device.streams import external_stream, stream_ptr
from ..frameworks import from_numpy, to_numpy
from .low_latency import decode_shape, device_kind, low_latency_buffer, micro_batch
from .timing import park, row

__all__ = ["run", "two_batch_step", "one_at_a_time", "check_outputs", "hidden_fraction", "micro_batch"]

#: A failed check of the overlapped step is a wrong result, not a slow one: the run fails.
FAIL_RUN = True
#: Microseconds the GPU is parked ahead of a timed region: long enough for the host to queue a whole step.
PARK_US = 5000.0
WARMUP = 2


def two_batch_step(dispatch, combine, batches, expert_outputs, compute=None):
    """One decode step of micro-batches A and B in the two-batch-overlap order (the module docstring).

    Arguments:
        dispatch: ``dispatch(x, topk_idx)`` sends and returns ``low_latency_dispatch``'s five results, the
            receive hook last.
        combine: ``combine(expert_out, topk_idx, weights, handle)`` sends and returns ``low_latency_combine``'s
            three results, the receive hook last.
        batches: ``(x, topk_idx, weights)`` of A and of B.
        expert_outputs: the expert outputs of A and of B.
        compute: called between the sends as the modules' work; None for none.

    Returns:
        ``(combined A, combined B)``, and every result of the step: the hooks write into arrays the caller
        must keep alive until the stream has passed them.
    """
    work = compute or (lambda: None)
    (xa, ia, wa), (xb, ib, wb) = batches
    eo_a, eo_b = expert_outputs
    da = dispatch(xa, ia)
    work()
    db = dispatch(xb, ib)
    work()
    da[4]()
    db[4]()
    ca = combine(eo_a, ia, wa, da[2])
    work()
    cb = combine(eo_b, ib, wb, db[2])
    work()
    ca[2]()
    cb[2]()
    return (ca[0], cb[0]), (da, db, ca, cb)


def one_at_a_time(dispatch, combine, batches, expert_outputs):
    """The calls of :func:`two_batch_step` without overlap: each hook right after its send, A before B.
    Returns the combined outputs of A and B, and every result (as there)."""
    outs, keep = [], []
    for (x, idx, w), eo in zip(batches, expert_outputs, strict=True):
        d = dispatch(x, idx)
        d[4]()
        c = combine(eo, idx, w, d[2])
        c[2]()
        outs.append(c[0])
        keep += [d, c]
    return tuple(outs), keep


def check_outputs(got, want, what: str) -> str | None:
    """Why the combined outputs ``got`` (A, B; NumPy) of ``what`` are implausible, or None: each must equal
    ``want``'s bit for bit, be finite and not all zero, and A must differ from B."""
    for name, g, w in zip("AB", got, want, strict=True):
        if g.shape != w.shape:
            return f"{what}: micro-batch {name}'s combined output has shape {g.shape}, one at a time {w.shape}"
        if not np.array_equal(g.view(np.uint16), w.view(np.uint16)):
            diff = np.abs(g.astype(np.float32) - w.astype(np.float32))
            return (f"{what}: micro-batch {name}'s combined output differs from the same calls made one at a "
                    f"time in {int((g.view(np.uint16) != w.view(np.uint16)).sum())} of {g.size} values "
                    f"(max |diff| {np.nanmax(diff):g})")
        values = g.astype(np.float32)
        if not np.isfinite(values).all() or not values.any():
            return f"{what}: micro-batch {name}'s combined output is not finite or all zero"
    if np.array_equal(got[0].view(np.uint16), got[1].view(np.uint16)):
        return f"{what}: micro-batches A and B have the same combined output, though their inputs differ"
    return None


def hidden_fraction(comm_us: float, compute_us: float, step_us: float) -> float:
    """``(C + P - S) / C``: the fraction of the communication time ``C`` that the compute ``P`` hid in a
    step of ``S``; not clamped (noise may put it below 0 or above 1)."""
    if not comm_us > 0:
        raise ValueError(f"comm_us must be positive, got {comm_us!r}")
    return (comm_us + compute_us - step_us) / comm_us


def _events_us(stream, fn) -> float:
    """GPU microseconds of ``fn()`` between two events, behind a parked GPU; what ``fn`` returns is kept
    alive until the end event has passed."""
    import cupy

    park(stream, PARK_US)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    keep = fn()
    end.record(stream)
    end.synchronize()
    del keep
    return cupy.cuda.get_elapsed_time(start, end) * 1e3


def _send_us(comm, streams, send, late_s: float) -> float:
    """One late-peer sample: this rank's send time in microseconds (the module docstring). ``streams``: the
    caller's and the Buffer's communication stream, where a hook-mode send runs; the send ends when both
    have passed it."""
    import cupy

    stream, send_stream = streams
    comm_barrier(comm, "bench overlap: before a send sample")
    if late_s > 0 and comm.Get_rank() == comm.Get_size() - 1:
        time.sleep(late_s)
    park(stream, PARK_US)
    start, ends = cupy.cuda.Event(), (cupy.cuda.Event(), cupy.cuda.Event())
    start.record(stream)
    result = send()
    for end, on in zip(ends, streams, strict=True):
        end.record(on)
    result[-1]()  # the receive
    stream.synchronize()
    return max(cupy.cuda.get_elapsed_time(start, end) for end in ends) * 1e3


def _late_peer_rows(comm, streams, sends, late_ms: float, samples: int) -> list[dict]:
    if comm.Get_size() < 2:
        return [{"op": "hook send, late peer", "note": "needs 2 ranks or more"}]

    def median_us(send, late_s):
        times = [_send_us(comm, streams, send, late_s) for _ in range(WARMUP + samples)]
        return statistics.median(times[WARMUP:])

    rows = []
    for name, send in sends:
        on_time, late = median_us(send, 0.0), median_us(send, late_ms / 1e3)
        rows.append(row(f"hook send: {name}, peer on time", on_time))
        rows.append(row(f"hook send: {name}, peer {late_ms:g} ms late", late,
                        **{"over on time us": round(late - on_time, 2)}))
    return rows


def _overlap_row(comm, stream, step, compute, compute_us: float, samples: int) -> dict:
    def timed(fn):
        comm_barrier(comm, "bench overlap: before a step sample")
        return _events_us(stream, fn)

    def kernels_alone():
        for _ in range(4):
            compute()

    ways = (lambda: step(None), lambda: step(compute), kernels_alone)
    got = [[] for _ in ways]
    for i in range(WARMUP + samples):  # interleaved, so that drift hits all three alike
        for times, fn in zip(got, ways, strict=True):
            t = timed(fn)
            if i >= WARMUP:
                times.append(t)
    medians = [statistics.median(times) for times in got]
    c, s, p = (float(np.mean(v)) for v in zip(*comm.allgather(medians), strict=True))
    raw = hidden_fraction(c, p, s)
    return row(f"overlap: 2 micro-batches, {compute_us:g} us compute each", s,
               **{"comm only us": round(c, 2), "compute only us": round(p, 2),
                  "hidden %": round(min(max(raw, 0.0), 1.0) * 100, 1), "hidden raw %": round(raw * 100, 1)})


def run(comm, args) -> list[dict]:
    """Benchmark rows for the hook-mode sends with a late peer and the two-micro-batch overlap; collective."""
    import cupy
    import ml_dtypes

    late_ms = float(getattr(args, "late_ms", 20.0))
    compute_us = float(getattr(args, "compute_us", 200.0))
    for name, value in (("late_ms", late_ms), ("compute_us", compute_us)):
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
    rank, size = comm.Get_rank(), comm.Get_size()
    t_max, hidden, num_experts, topk = decode_shape(args)
    samples = int(getattr(args, "ll_samples", 20))
    like = device_kind()

    host = [micro_batch((2024, rank, b), t_max, hidden, num_experts, topk) for b in (0, 1)]
    rng = np.random.default_rng((2024, rank, 2))
    eo = (rng.standard_normal((num_experts // size, size * t_max, hidden), dtype=np.float32) * 0.1).astype(
        ml_dtypes.bfloat16)
    buf = low_latency_buffer(comm, t_max, hidden, num_experts)
    try:
        batches = [tuple(from_numpy(a, like) for a in b) for b in host]
        # B's expert outputs are A's with the sign flipped: distinct values without a second random draw.
        expert_outputs = (from_numpy(eo, like), from_numpy((eo.view(np.uint16) ^ 0x8000).view(eo.dtype), like))
        del eo
        stream = cupy.cuda.get_current_stream()

        def dispatch(x, idx, fp8=True):
            return buf.low_latency_dispatch(x, idx, t_max, num_experts, use_fp8=fp8, return_recv_hook=True)

        def combine(eo, idx, w, handle):
            return buf.low_latency_combine(eo, idx, w, handle, return_recv_hook=True)

        def compute():
            park(stream, compute_us)

        def step(work):
            return two_batch_step(dispatch, combine, batches, expert_outputs, work)

        # The check first: timing a wrong result would be pointless.
        want, keep = one_at_a_time(dispatch, combine, batches, expert_outputs)
        problems = []
        for work, what in ((None, "the overlapped step"), (compute, "the overlapped step with compute")):
            got, keep_step = step(work)
            cupy.cuda.Device().synchronize()
            problems.append(check_outputs([to_numpy(o) for o in got], [to_numpy(o) for o in want], what))
        del keep, keep_step
        bad = [f"rank {r}: {p}" for r, ps in enumerate(comm.allgather(problems)) for p in ps if p]
        if bad:
            more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise RuntimeError("; ".join(bad[:3]) + more)

        (xa, ia, wa), _ = batches
        handles = {fp8: dispatch(xa, ia, fp8) for fp8 in (False, True)}
        for d in handles.values():
            d[4]()
        sends = (("dispatch BF16", lambda: dispatch(xa, ia, False)), ("dispatch FP8", lambda: dispatch(xa, ia, True)),
                 ("combine BF16", lambda: combine(expert_outputs[0], ia, wa, handles[False][2])),
                 ("combine BF16 after an FP8 dispatch", lambda: combine(expert_outputs[0], ia, wa, handles[True][2])))
        send_stream = external_stream(stream_ptr(buf.get_comm_stream()), cupy.cuda.Device().id)
        rows = _late_peer_rows(comm, (stream, send_stream), sends, late_ms, samples)
        rows.append(_overlap_row(comm, stream, lambda work: step(work)[1], compute, compute_us, samples))
    finally:
        cupy.cuda.Device().synchronize()
        comm_barrier(comm, "bench overlap: before destroy")
        buf.destroy()
    return rows

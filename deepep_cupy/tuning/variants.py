"""Variants of one op, run on every rank in step: each checked bit for bit against a reference variant, then
timed in interleaved rounds, and the table of the outcome (the machinery of ``python -m deepep_cupy.tuning sms``).

A variant is a tuple of values of the engine's tuning attributes (block shape first: warps, unroll; then any
other attribute swept). Every step runs on every rank and ends in one allgather, so the ranks agree on what a
step raised on any of them and never wait in different collectives.
"""

from __future__ import annotations

import statistics
import time

__all__ = ["Steps", "Sweep", "bits", "same_bits", "label", "outcome", "format_table"]


class Steps:
    """Runs a step on every rank and agrees on its outcome: one allgather per step, so the ranks stay in
    step whatever a step raised on one of them. Stops for good once an engine is broken or past the budget."""

    def __init__(self, comm, engine, budget: float, start: float) -> None:
        self.comm, self.engine, self.budget, self.start = comm, engine, budget, start
        self.stopped: str | None = None

    def __call__(self, fn, share=lambda value: value):
        """``(this rank's value, [(share(value), error) per rank])``; None when the sweep has stopped (nothing
        ran). ``error`` is None or one line; ``share`` picks what the other ranks need (small, picklable)."""
        if self.stopped:
            return None
        value = shared = error = None
        try:
            value = fn()
            shared = share(value)
        except Exception as exc:  # noqa: BLE001 - reported in the table; the ranks agree on it below
            text = str(exc).strip()
            error = f"FAILED: {type(exc).__name__}: {text.splitlines()[0] if text else ''}"
        got = self.comm.allgather((shared, error, self.engine.broken is not None, time.monotonic() - self.start))
        if any(g[2] for g in got):
            self.stopped = "an engine is unusable after a kernel failure"
        elif max(g[3] for g in got) > self.budget:
            self.stopped = f"past the budget of {self.budget:g} s"
        return value, [(g[0], g[1]) for g in got]


def _array_module(a):
    if type(a).__module__.startswith("cupy"):
        import cupy

        return cupy
    import numpy

    return numpy


def bits(outputs) -> list:
    """Copies of the outputs' bytes (for CuPy arrays in ordinary device memory, not the output pool, which the
    next call overwrites)."""
    out = []
    for o in outputs:
        if o is not None:
            xp = _array_module(o)
            out.append(xp.ascontiguousarray(o).reshape(-1).view(xp.uint8).copy())
    return out


def same_bits(a, b) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and bool((x == y).all()) for x, y in zip(a, b, strict=True))


_LABELS = {
    "fan_out": lambda v: {True: " fan-out", False: " by dest"}.get(v, ""),
    "copy_rounds": lambda v: f" {':'.join(map(str, v))} parts" if isinstance(v, tuple) else f" {v} rounds",
    "copy_chunk_rows": lambda v: f" {v} rows",
    "use_copy_combine": lambda v: " copy" if v else " ring",
}


def label(row: dict) -> str:
    """A row's variant in words: ``24 x 6 fan-out``, ``32 x 3 2 rounds 2048 rows``."""
    return f"{row['warps']} x {row['unroll']}" + "".join(text(row[k]) for k, text in _LABELS.items() if k in row)


def outcome(row: dict) -> str:
    """``ok``, ``MISMATCH: ...`` or the error of a row."""
    return row.get("error") or ("MISMATCH: " + row["mismatch"] if row.get("mismatch") else "ok")


class Sweep:
    """The variants of one op at one SM count: ``fn()`` runs the op with the engine's current attributes.

    Arguments:
        engine: the intranode engine (its tuning attributes are set with its ``tune`` for each variant, and
            restored after).
        stream: the stream the ops run on.
        steps: the :class:`Steps` every rank runs.
        rounds: timing passes over the variants, interleaved; a variant's time is the median of its passes.
        say: ``print`` on the rank that reports, a no-op on the others.
        in_pool: whether an output lies in the engine's output pool (the dispatch's direct mode).
    """

    def __init__(self, engine, stream, steps: Steps, rounds: int, say, in_pool) -> None:
        self.engine, self.stream, self.steps, self.rounds, self.say = engine, stream, steps, rounds, say
        self.in_pool = in_pool
        self.first_default: dict = {}  # op -> (SM count, bits of its default variant's outputs)

    def _use(self, names, variant) -> None:
        self.engine.tune(**dict(zip(names, variant, strict=True)))

    def _prepare(self, op, num_sms, fn, names, variant, is_default, ref):
        """First call (plan, kernel load): ``(mode, bits, why the bits differ or None)``."""
        engine, stream = self.engine, self.stream
        self._use(names, variant)
        seq, own = engine.copy_seq, engine.own_copies
        outs = fn()
        stream.synchronize()
        if op.startswith("combine"):
            mode = "copy" if engine.copy_seq > seq else "ring"
        else:
            mode = ("direct" if self.in_pool(outs[0]) else "ring") + ("+own" if engine.own_copies > own else "")
        snap = bits(outs)
        del outs
        engine.check_errors(stream)
        if is_default:
            first = self.first_default.setdefault(op, (num_sms, snap))
            differ = None if same_bits(snap, first[1]) else f"differs from the default at {first[0]} SMs"
        elif ref is None:
            differ = "no default to compare with"
        else:
            differ = None if same_bits(snap, ref) else "differs from the default"
        return mode, snap, differ

    def _time(self, fn, names, variant, time_op, timing) -> float:
        self._use(names, variant)
        us = time_op(fn, stream=self.stream, **timing)
        self.engine.check_errors(self.stream)
        return us

    def run(self, op: str, num_sms: int, fn, names, variants, default, time_op, timing) -> list[dict]:
        """Check every variant (``default`` first in ``variants``, the reference of the others), time those that
        passed in ``rounds`` interleaved passes; one row per variant."""
        rows, passed, ref = [], [], None
        saved = tuple(getattr(self.engine, name) for name in names)
        for variant in variants:
            row = {"op": op, "num_sms": num_sms, "warps": variant[0], "unroll": variant[1],
                   "default": variant == default}
            for name, value in zip(names[2:], variant[2:], strict=True):
                row["fan_out" if name == "use_fan_out" else name] = value
            rows.append(row)
            got = self.steps(lambda variant=variant, ref=ref: self._prepare(op, num_sms, fn, names, variant,
                                                                           variant == default, ref),
                             share=lambda v: (v[0], v[2]))
            if got is None:
                row["error"] = f"skipped: {self.steps.stopped}"
                continue
            value, shared = got
            errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(shared) if e]
            if errors:
                row["error"] = errors[0]
                continue
            if variant == default:
                ref = value[1]
            row["mode"] = "/".join(dict.fromkeys(v[0] for v, _ in shared))
            differ = [f"rank {r}: {v[1]}" for r, (v, _) in enumerate(shared) if v[1]]
            if differ:
                row["mismatch"] = "; ".join(differ)
            passed.append((row, variant))
            self.say(f"  {op}, {num_sms} SMs, {label(row)}: {row['mode']}, {outcome(row)}", flush=True)
        for _ in range(self.rounds):  # interleaved, so that a slow spell of the machine hits every variant alike
            for row, variant in passed:
                if "error" in row:
                    continue
                got = self.steps(lambda variant=variant: self._time(fn, names, variant, time_op, timing))
                if got is None:
                    row.setdefault("error", f"timing stopped: {self.steps.stopped}")
                    continue
                errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(got[1]) if e]
                if errors:
                    row["error"] = errors[0]
                else:
                    row.setdefault("rounds_us", []).append(round(max(v for v, _ in got[1]), 2))
        for row, _ in passed:
            if row.get("rounds_us") and "error" not in row:
                row["us"] = round(statistics.median(row["rounds_us"]), 2)
        self._use(names, saved)  # the engine's own values again (None for the shapes: the tables' choice)
        return rows


def format_table(rows: list[dict]) -> str:
    """op, SMs, variant, us (and against the default at the same count), mode, check; then the best variant per
    (op, SMs), of those whose outputs matched."""
    defaults = {(r["op"], r["num_sms"]): r.get("us") for r in rows if r["default"]}
    lines = [f"{'op':<14} {'SMs':>3}  {'warps x unroll':<16} {'us':>8}  {'vs default':>10}  mode    check"]
    best: dict = {}
    for r in rows:
        us, ref = r.get("us"), defaults.get((r["op"], r["num_sms"]))
        vs = "(default)" if r["default"] else (f"{100 * (us / ref - 1):+.1f}%" if us and ref else "")
        shown = f"{us:8.1f}" if us else f"{'-':>8}"
        lines.append(f"{r['op']:<14} {r['num_sms']:>3}  {label(r):<16} {shown}  {vs:>10}  "
                     f"{r.get('mode', '-'):<6}  {outcome(r)}")
        key = (r["op"], r["num_sms"])
        if us and outcome(r) == "ok" and (key not in best or us < best[key]["us"]):
            best[key] = r
    lines.append("\nbest shape per (op, SMs):")
    for (op, sms), r in best.items():
        ref = defaults.get((op, sms))
        against = f" (default: {ref:.1f} us, {100 * (r['us'] / ref - 1):+.1f}%)" if ref else ""
        lines.append(f"{op:<14} {sms:>3} SMs: {label(r):<16} {r['us']:8.1f} us{against}")
    failed = sum(outcome(r) != "ok" for r in rows)
    lines.append(f"\n{len(rows)} variants, {failed} failed or differing" if failed else f"\n{len(rows)} variants, all ok")
    return "\n".join(lines)

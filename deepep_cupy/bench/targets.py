"""The kernel-speed targets next to a benchmark run: per tracked op, DeepEP V1's time on two GPUs of the
kind the targets were set on (docs/benchmarks.md names it; DeepEP's workloads), the target and this run's
time, and whether the run meets it.

    python -m deepep_cupy.bench.targets bench.json

``python -m deepep_cupy.bench`` prints the same table after its own when it ran 2 ranks, a GPU each, on the
default workloads, the only ones the targets were set for (otherwise one line saying why not). Times are the low-latency ops' kernel time (as DeepEP's
low-latency test measures it) and the other ops' GPU time, as in the run's table.
"""

from __future__ import annotations

import argparse
import json
from typing import NamedTuple

from .timing import format_table, sm_counts

__all__ = ["TARGETS", "WORKLOAD", "Target", "why_not_compared", "compare", "format_targets", "main"]


class Target(NamedTuple):
    label: str
    op: str  # the run's row
    field: str  # the row's time
    deepep_us: float | None  # DeepEP V1 on the targets' machine, same workload
    target_us: float


TARGETS = (
    Target("LL dispatch FP8", "LL dispatch FP8", "kernel us", 28.9, 20.0),
    Target("LL combine BF16", "LL combine BF16", "kernel us", 39.4, 30.0),
    Target("LL combine LogFMT", "LL combine LogFMT", "kernel us", 46.4, 25.0),
    # Each hook part at 0.8 x DeepEP's.
    Target("LL hook: dispatch send", "LL dispatch send (hook)", "kernel us", 19.9, 15.9),
    Target("LL hook: dispatch recv", "LL dispatch recv (hook)", "kernel us", 8.1, 6.5),
    Target("LL hook: combine send", "LL combine send (hook)", "kernel us", 32.0, 25.6),
    Target("LL hook: combine recv", "LL combine recv (hook)", "kernel us", 9.7, 7.8),
    Target("intranode dispatch FP8, cached, column-major scales", "intranode dispatch FP8 (cached)", "us", 244.0, 130.0),
    Target("intranode dispatch BF16, cached", "intranode dispatch BF16 (cached)", "us", 344.0, 210.0),
    Target("intranode combine BF16", "intranode combine BF16", "us", 399.0, 230.0),
    Target("layout (GPU time)", "intranode layout", "us", None, 12.0),
)

#: The workload the targets were set for: 2 ranks; normal kernels 4096 tokens x 7168, top-8 of 256
#: experts on 24 SMs; low-latency 128 tokens, 288 experts.
WORKLOAD = {"ranks": 2, "tokens": 4096, "hidden": 7168, "experts": 256, "topk": 8, "num_sms": 24,
            "ll_tokens": 128, "ll_experts": 288}


def why_not_compared(ranks: int, args, gpus: int) -> str | None:
    """None when a run of ``ranks`` ranks on ``gpus`` visible GPUs with the command line ``args`` measured the
    targets' workload on a GPU per rank; else why its times are not comparable with the targets."""
    if ranks != WORKLOAD["ranks"]:
        return f"the targets are for {WORKLOAD['ranks']} ranks, this run had {ranks}"
    if gpus < ranks:
        return f"the {ranks} ranks shared {gpus} GPU{'s' if gpus != 1 else ''}"
    other = [k for k, v in WORKLOAD.items() if k != "ranks" and not _measured(args, k, v)]
    return f"not the targets' workload ({', '.join(other)} differ)" if other else None


def _measured(args, key: str, value) -> bool:
    # A run over several SM counts measures the workload's when its count is among them.
    return value in sm_counts(args) if key == "num_sms" else getattr(args, key) == value


def compare(rows) -> list[dict]:
    """One entry per target: its numbers, this run's time (None when the run has no such row) and
    ``status``: "met", "missed by X%" or "not measured"."""
    by_op = {}
    for r in rows:
        # A run over several SM counts has a row per count; the targets are for the workload's.
        if r.get("SMs", WORKLOAD["num_sms"]) == WORKLOAD["num_sms"]:
            by_op.setdefault(r.get("op"), r)
    out = []
    for t in TARGETS:
        value = by_op.get(t.op, {}).get(t.field)
        now = float(value) if isinstance(value, (int, float)) and value > 0 else None
        if now is None:
            status = "not measured"
        elif now <= t.target_us:
            status = "met"
        else:
            status = f"missed by {100 * (now / t.target_us - 1):.1f}%"
        out.append({"op": t.label, "DeepEP V1 us": t.deepep_us if t.deepep_us is not None else "-",
                    "target us": t.target_us, "now us": now if now is not None else "-", "status": status})
    return out


def format_targets(rows) -> str:
    entries = compare(rows)
    met = sum(e["status"] == "met" for e in entries)
    return f"targets (DeepEP's workloads, 2 ranks): {met} of {len(entries)} met\n" + format_table(entries)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deepep_cupy.bench.targets", description=__doc__.splitlines()[0])
    parser.add_argument("json", help="rows written by python -m deepep_cupy.bench --json (2 ranks, default workload)")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        print(format_targets(json.load(f)))


if __name__ == "__main__":
    main()

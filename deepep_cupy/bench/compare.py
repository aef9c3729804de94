"""Two trees' benchmark runs side by side: per row (op, framework, SMs), the median over each side's runs of
each time column and the ratio after / before. One run of a suite on a shared GPU swings by several percent
(more under MPS), so a before/after claim wants several runs of each side, taken alternately in one session.

    python -m deepep_cupy.bench.compare --before b1.json b2.json b3.json --after a1.json a2.json a3.json

Each file is one ``python -m deepep_cupy.bench ... --json`` run. Rows only one side has are listed apart.
"""

from __future__ import annotations

import argparse
import json
import statistics

from .timing import format_table

__all__ = ["TIME_FIELDS", "row_key", "medians", "compare", "main"]

#: The columns of a row that hold a time in microseconds.
TIME_FIELDS = ("us", "kernel us", "gpu_us", "host_us")


def row_key(r: dict) -> tuple:
    """What names a row across runs: its op, framework and SM count."""
    return (r.get("op"), r.get("framework"), r.get("SMs"))


def medians(runs: list[list[dict]]) -> dict:
    """``{row key: {field: median over the runs that have it}}`` for the time fields of ``runs``."""
    values: dict = {}
    for rows in runs:
        for r in rows:
            fields = values.setdefault(row_key(r), {})
            for f in TIME_FIELDS:
                v = r.get(f)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    fields.setdefault(f, []).append(float(v))
    return {k: {f: statistics.median(v) for f, v in fields.items()} for k, fields in values.items()}


def compare(before: list[list[dict]], after: list[list[dict]]) -> tuple[list[dict], list[str]]:
    """The comparison rows (in the order the first after-run has them) and the row names only one side has."""
    b, a = medians(before), medians(after)
    order = list(dict.fromkeys(row_key(r) for rows in after for r in rows))
    out = []
    for key in order:
        if key not in b:
            continue
        op, framework, sms = key
        entry = {"op": op}
        if framework is not None:
            entry["framework"] = framework
        if sms is not None:
            entry["SMs"] = sms
        for f in TIME_FIELDS:
            if f in a[key] and f in b[key]:
                entry[f"{f} before"] = round(b[key][f], 2)
                entry[f"{f} after"] = round(a[key][f], 2)
                entry[f"{f} ratio"] = round(a[key][f] / b[key][f], 3) if b[key][f] > 0 else None
        if len(entry) > 1 + (framework is not None) + (sms is not None):
            out.append(entry)
    alone = [f"{'/'.join(str(p) for p in k if p is not None)} (only {side})"
             for side, mine, other in (("before", b, a), ("after", a, b)) for k in mine if k not in other]
    return out, alone


def _load(paths: list[str]) -> list[list[dict]]:
    runs = []
    for path in paths:
        with open(path) as f:
            rows = json.load(f)
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"{path}: not a list of benchmark rows (python -m deepep_cupy.bench --json)")
        runs.append(rows)
    return runs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m deepep_cupy.bench.compare",
                                description="Medians of two trees' benchmark runs (--json files) side by side.")
    p.add_argument("--before", nargs="+", required=True, metavar="FILE", help="the runs of the tree before")
    p.add_argument("--after", nargs="+", required=True, metavar="FILE", help="the runs of the tree after")
    args = p.parse_args(argv)
    rows, alone = compare(_load(args.before), _load(args.after))
    print(f"medians of {len(args.before)} run(s) before and {len(args.after)} after")
    print(format_table(rows) if rows else "no row in common")
    for line in alone:
        print(line)


if __name__ == "__main__":
    main()

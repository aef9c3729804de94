"""Charts of a benchmark run: each op next to the naive NCCL path and the copy engine of the same run.

    python -m deepep_cupy.bench.plot bench.json bench.png [--title "2 GPUs"]

``bench.json`` is what ``python -m deepep_cupy.bench --json`` wrote. Top row, one group of bars per
high-throughput op (intranode and internode), in µs (lower is better) and GB/s (higher is better):
deepep_cupy's best point (one bar per SM count, darker for more, in a run over several: ``--num-sms 8,12,24``),
the naive PyTorch + NCCL path of the same run for the same op (BF16 dispatch and
combine only: the naive path has no FP8; internode ops against the naive path their suite measured), and the
copy engine's NVLink peer copy, one way, as the bound of one GPU's receive bandwidth (its time is what moving
the op's bytes at that rate takes). Bottom row: the ops with nothing to compare to
(layout, low-latency kernels), in µs.
"""

from __future__ import annotations

import argparse
import json

__all__ = ["SERIES", "compared_ops", "other_ops", "series_of", "sm_label", "plot", "plottable", "main"]

SERIES = ("deepep_cupy", "naive NCCL path", "copy engine, one way")
_COLORS = ("#1f77b4", "#ff7f0e", "#7f7f7f")
_NAIVE = (("dispatch BF16", "naive NCCL dispatch"), ("combine BF16", "naive NCCL combine"))
_COPY_ENGINE = "copy engine 0->1"
_INTERNODE_NAIVE = "internode suite: "


def _suite(r: dict) -> str:
    # Rows of runs older than the "suite" field are told apart by their names.
    if "suite" in r:
        return r["suite"]
    op = r.get("op", "")
    if op.startswith("LL "):
        return "low_latency"
    if op.startswith(("naive NCCL", "copy engine")):
        return "baselines"
    if op.startswith("internode"):
        return "internode"
    return "intranode" if op.startswith("intranode") else "other"


def _measured(rows) -> list[dict]:
    return [r for r in rows if isinstance(r.get("us"), (int, float)) and r["us"] > 0 and "failed" not in r.get("note", "")]


def sm_label(num_sms: int) -> str:
    """The series of deepep_cupy's rows at ``num_sms`` SMs in a run over several SM counts."""
    return f"{SERIES[0]}, {num_sms} SMs"


def _sm_counts(rows) -> list[int]:
    return sorted({int(r["SMs"]) for r in rows if isinstance(r.get("SMs"), int) and "GB/s" in r
                   and _suite(r) in ("intranode", "internode")})


def compared_ops(rows) -> list[dict]:
    """``[{"op": name, <series>: (us, GB/s) or None, ...}]`` for every high-throughput op with GB/s. In a run
    over several SM counts (``--num-sms 8,12,24``) deepep_cupy has one series per count (:func:`sm_label`)
    instead of :data:`SERIES`'s first, so that each op shows a bar per count."""
    rows = _measured(rows)
    by_name = {r["op"]: r for r in rows}
    engine = by_name.get(_COPY_ENGINE)
    engine_gbs = engine.get("GB/s") if engine else None
    counts = _sm_counts(rows)
    ours_keys = [sm_label(c) for c in counts] if len(counts) > 1 else [SERIES[0]]
    groups: dict[str, dict] = {}
    for r in rows:
        suite = _suite(r)
        if suite not in ("intranode", "internode") or "GB/s" not in r or r["op"].startswith(_INTERNODE_NAIVE):
            continue
        # Internode ops keep their prefix and compare with the naive path measured inside their own suite.
        name = r["op"].removeprefix("intranode ")
        prefix = _INTERNODE_NAIVE if suite == "internode" else ""
        group = groups.get(name)
        if group is None:
            group = groups[name] = {"op": name, **dict.fromkeys(ours_keys), SERIES[1]: None, SERIES[2]: None}
            for key, naive_name in _NAIVE:
                naive = by_name.get(prefix + naive_name)
                if key in name and naive is not None:
                    group[SERIES[1]] = (naive["us"], naive.get("GB/s"))
            if engine_gbs:  # the op's bytes at the copy engine's rate: the same at every SM count
                group[SERIES[2]] = (r["us"] * r["GB/s"] / engine_gbs, engine_gbs)
        ours = sm_label(r["SMs"]) if len(counts) > 1 and isinstance(r.get("SMs"), int) else SERIES[0]
        if group.get(ours) is None:  # the first row of an op at a count (a rerun's later rows are ignored)
            group[ours] = (r["us"], r["GB/s"])
    return list(groups.values())


def series_of(groups) -> list[str]:
    """The series of :func:`compared_ops`' groups in drawing order: deepep_cupy's (by SM count), then the naive
    path and the copy engine."""
    keys = list(dict.fromkeys(k for g in groups for k in g if k != "op"))
    return [k for k in keys if k not in SERIES[1:]] + list(SERIES[1:])


def other_ops(rows) -> list[tuple[str, float]]:
    """``[(name, us)]``: layout and low-latency ops, which have no baseline in the run."""
    out = []
    for r in _measured(rows):
        suite = _suite(r)
        if suite == "low_latency" or (suite in ("intranode", "internode") and "GB/s" not in r):
            out.append((r["op"].removeprefix("intranode "), r["us"]))
    return out


def _colors(series) -> list[str]:
    """deepep_cupy's series in blue (darker for more SMs), the naive path orange, the copy engine grey."""
    ours = [k for k in series if k not in SERIES[1:]]
    if len(ours) == 1:
        blues = [_COLORS[0]]
    else:
        from matplotlib import colormaps

        blues = [colormaps["Blues"](0.35 + 0.65 * i / (len(ours) - 1)) for i in range(len(ours))]
    return blues + list(_COLORS[1:])


def _grouped(ax, groups, index: int, unit: str, series) -> None:
    """Horizontal grouped bars: one group per op, one bar per series; values written at the bars' ends."""
    height = 0.8 / len(series)
    top = max((g[s][index] or 0) for g in groups for s in series if g.get(s)) or 1
    for j, (name, color) in enumerate(zip(series, _colors(series), strict=True)):
        ys, values = [], []
        for i, g in enumerate(groups):
            if g.get(name) and g[name][index]:
                ys.append(i + (j - (len(series) - 1) / 2) * height)
                values.append(g[name][index])
        bars = ax.barh(ys, values, height=height, color=color, label=name)
        for bar, v in zip(bars, values, strict=True):
            ax.text(bar.get_width() + top * 0.01, bar.get_y() + bar.get_height() / 2, f"{v:,.0f}", va="center",
                    fontsize=7)
    ax.set_yticks(range(len(groups)), [g["op"] for g in groups])
    ax.set_xlim(0, top * 1.18)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.grid(axis="x", alpha=0.3)


def plottable(rows) -> bool:
    """Whether ``rows`` hold any op the chart shows (intranode or low-latency rows)."""
    return bool(compared_ops(rows) or other_ops(rows))


def plot(rows, path: str, title: str | None = None) -> None:
    """Save the chart of ``rows`` (a benchmark run's rows, as in its JSON) to ``path``."""
    groups, others = compared_ops(rows), other_ops(rows)
    if not groups and not others:
        raise ValueError("nothing to plot: the run has no intranode or low-latency rows")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = series_of(groups)
    # Room per op grows with its bars (three when there is one SM count).
    heights = [max(len(groups), 1) * 0.3 * max(len(series), 3) + 1.2] if groups else []
    heights += [len(others) * 0.28 + 1.0] if others else []
    head = (0.7 if title else 0) + (0.4 if groups else 0)  # room for the title and the legend (inches)
    fig = plt.figure(figsize=(12, sum(heights) + head))
    grid = fig.add_gridspec(len(heights), 2, height_ratios=heights)
    row = 0
    if groups:
        ax_us, ax_gbs = fig.add_subplot(grid[row, 0]), fig.add_subplot(grid[row, 1])
        _grouped(ax_us, groups, 0, "µs per call (lower is better)", series)
        _grouped(ax_gbs, groups, 1, "GB/s, bytes received per rank (higher is better)", series)
        ax_gbs.set_yticklabels([])
        handles, labels = ax_us.get_legend_handles_labels()
        both = {r["op"]: r for r in _measured(rows)}.get("copy engine both ways")
        if both and "GB/s" in both:
            labels = [f"{label} ({both['GB/s']:,.0f} GB/s both ways)" if label == SERIES[2] else label
                      for label in labels]
        fig.legend(handles, labels, loc="upper center", ncol=len(series), fontsize=9,
                   bbox_to_anchor=(0.5, 1 - 0.65 / fig.get_figheight()) if title else (0.5, 1.0))
        row += 1
    if others:
        ax = fig.add_subplot(grid[row, :])
        bars = ax.barh(range(len(others)), [us for _, us in others], color=_COLORS[0])
        top = max(us for _, us in others)
        for bar, (_, us) in zip(bars, others, strict=True):
            ax.text(bar.get_width() + top * 0.005, bar.get_y() + bar.get_height() / 2, f"{us:,.1f}", va="center",
                    fontsize=7)
        ax.set_yticks(range(len(others)), [name for name, _ in others])
        ax.set_xlim(0, top * 1.1)
        ax.invert_yaxis()
        ax.set_xlabel("µs per call, deepep_cupy (no baseline in the run)")
        ax.grid(axis="x", alpha=0.3)
    if title:  # pinned to the top, above the legend (the default place overlaps it on a tall figure)
        fig.suptitle(title, y=1 - 0.15 / fig.get_figheight(), va="top")
    fig.tight_layout(rect=(0, 0, 1, 1 - head / fig.get_figheight()))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deepep_cupy.bench.plot", description=__doc__.splitlines()[0])
    parser.add_argument("json", help="rows written by python -m deepep_cupy.bench --json")
    parser.add_argument("png", help="where to save the chart")
    parser.add_argument("--title", help="a title, e.g. the machine and the workload")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        rows = json.load(f)
    plot(rows, args.png, args.title)


if __name__ == "__main__":
    main()

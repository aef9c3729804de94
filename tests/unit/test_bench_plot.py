"""The benchmark chart from a run's JSON rows: which bars stand next to which, and that the PNG is drawn."""

import json
import os
import subprocess
import sys

import pytest

from deepep_cupy.bench import plot

# Rows shaped as `python -m deepep_cupy.bench --json` writes them; the numbers are made up.
ROWS = [
    {"op": "copy engine 0->1", "us": 2000.0, "GB/s": 400.0, "suite": "baselines"},
    {"op": "copy engine both ways", "us": 2100.0, "GB/s": 760.0, "suite": "baselines"},
    {"op": "naive NCCL dispatch", "us": 700.0, "GB/s": 150.0, "suite": "baselines"},
    {"op": "naive NCCL combine", "us": 1000.0, "GB/s": 105.0, "suite": "baselines"},
    {"op": "intranode layout", "us": 20.0, "suite": "intranode"},
    {"op": "intranode dispatch BF16 (cached)", "us": 400.0, "GB/s": 300.0, "SMs": 24, "suite": "intranode"},
    {"op": "intranode dispatch FP8 (cached)", "us": 300.0, "GB/s": 200.0, "SMs": 24, "suite": "intranode"},
    {"op": "intranode combine BF16", "us": 500.0, "GB/s": 240.0, "SMs": 24, "suite": "intranode"},
    {"op": "LL dispatch FP8", "us": 45.0, "GB/s": 170.0, "suite": "low_latency"},
    {"op": "low_latency", "note": "failed: RuntimeError: x", "suite": "low_latency"},
    {"op": "host: dispatch", "us": 20.0, "framework": "torch", "suite": "host"},
]


def test_each_op_next_to_the_naive_path_and_the_copy_engine():
    groups = {g["op"]: g for g in plot.compared_ops(ROWS)}
    assert list(groups) == ["dispatch BF16 (cached)", "dispatch FP8 (cached)", "combine BF16"]
    ours, naive, engine = plot.SERIES
    assert groups["dispatch BF16 (cached)"][ours] == (400.0, 300.0)
    assert groups["dispatch BF16 (cached)"][naive] == (700.0, 150.0)
    assert groups["combine BF16"][naive] == (1000.0, 105.0)
    assert groups["dispatch FP8 (cached)"][naive] is None  # the naive path has no FP8
    # The copy engine's time is the op's bytes at the one-way copy rate.
    assert groups["dispatch BF16 (cached)"][engine] == pytest.approx((400.0 * 300.0 / 400.0, 400.0))
    assert plot.other_ops(ROWS) == [("layout", 20.0), ("LL dispatch FP8", 45.0)]


def test_internode_ops_compare_with_their_own_suites_naive_path():
    rows = ROWS + [
        {"op": "internode layout", "us": 25.0, "suite": "internode"},
        {"op": "internode dispatch BF16 (cached)", "us": 350.0, "GB/s": 320.0, "RDMA GB/s": 160.0, "suite": "internode"},
        {"op": "internode combine BF16", "us": 450.0, "GB/s": 250.0, "suite": "internode"},
        {"op": "internode suite: naive NCCL dispatch", "us": 900.0, "GB/s": 120.0, "suite": "internode"},
        {"op": "internode suite: naive NCCL combine", "us": 1100.0, "GB/s": 100.0, "suite": "internode"},
    ]
    groups = {g["op"]: g for g in plot.compared_ops(rows)}
    ours, naive, _ = plot.SERIES
    assert groups["internode dispatch BF16 (cached)"][ours] == (350.0, 320.0)
    assert groups["internode dispatch BF16 (cached)"][naive] == (900.0, 120.0)  # not the baselines suite's 700
    assert groups["internode combine BF16"][naive] == (1100.0, 100.0)
    assert not any(name.startswith("internode suite") for name in groups)
    assert ("internode layout", 25.0) in plot.other_ops(rows)


def test_rows_without_suite_or_baselines():
    rows = [{k: v for k, v in r.items() if k != "suite"} for r in ROWS if not r["op"].startswith(("naive", "copy"))]
    groups = plot.compared_ops(rows)
    assert [g["op"] for g in groups] == ["dispatch BF16 (cached)", "dispatch FP8 (cached)", "combine BF16"]
    assert all(g[plot.SERIES[1]] is None and g[plot.SERIES[2]] is None for g in groups)
    assert ("LL dispatch FP8", 45.0) in plot.other_ops(rows)


def test_png_from_the_json(tmp_path):
    pytest.importorskip("matplotlib")
    src, png = tmp_path / "bench.json", tmp_path / "bench.png"
    src.write_text(json.dumps(ROWS))
    env = dict(os.environ, MPLCONFIGDIR=str(tmp_path / "mpl"))  # matplotlib's font cache, not in the home directory
    got = subprocess.run([sys.executable, "-m", "deepep_cupy.bench.plot", str(src), str(png), "--title", "test"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert got.returncode == 0, got.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# A run over several SM counts (--num-sms 8,24): a row per op and count.
MULTI = [r for r in ROWS if "SMs" not in r] + [
    {**r, "SMs": sms, "us": r["us"] * factor, "GB/s": round(r["GB/s"] / factor, 1)}
    for sms, factor in ((8, 1.5), (24, 1.0)) for r in ROWS if "SMs" in r]


def test_one_bar_per_sm_count():
    groups = {g["op"]: g for g in plot.compared_ops(MULTI)}
    assert list(groups) == ["dispatch BF16 (cached)", "dispatch FP8 (cached)", "combine BF16"]
    at8, at24 = plot.sm_label(8), plot.sm_label(24)
    assert plot.series_of(groups.values()) == [at8, at24, *plot.SERIES[1:]]
    combine = groups["combine BF16"]
    assert combine[at8] == (750.0, 160.0) and combine[at24] == (500.0, 240.0)
    assert plot.SERIES[0] not in combine
    assert combine[plot.SERIES[1]] == (1000.0, 105.0)
    # The copy engine's bar is the op's bytes at its rate, whichever count's row it is computed from.
    assert combine[plot.SERIES[2]] == pytest.approx((500.0 * 240.0 / 400.0, 400.0))
    assert plot.other_ops(MULTI) == plot.other_ops(ROWS)
    # One SM count: the single deepep_cupy series, as before.
    assert plot.series_of(plot.compared_ops(ROWS)) == list(plot.SERIES)


def test_png_of_several_sm_counts(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "mpl"))
    png = tmp_path / "sms.png"
    plot.plot(MULTI, str(png), title="test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nothing_to_plot(tmp_path):
    with pytest.raises(ValueError, match="nothing to plot"):
        plot.plot([{"op": "host: dispatch", "us": 1.0, "suite": "host"}], str(tmp_path / "x.png"))

"""The targets table of a benchmark run: each tracked op's row found, met / missed decided against the
target, a missing or failed row shown as not measured, and only the targets' workload compared."""

import json
import subprocess
import sys
from types import SimpleNamespace

from deepep_cupy.bench import targets


def _rows(scale: float) -> list[dict]:
    """A run whose every tracked op took ``scale`` times its target (made-up numbers)."""
    return [{"op": t.op, "us": 99.0, "kernel us": 99.0, t.field: round(t.target_us * scale, 2), "suite": "x"}
            for t in targets.TARGETS]


def test_every_target_met_or_missed_by_its_own_row_and_field():
    assert {e["status"] for e in targets.compare(_rows(0.9))} == {"met"}
    missed = targets.compare(_rows(1.1))
    assert [e["status"] for e in missed] == ["missed by 10.0%"] * len(targets.TARGETS)
    # The low-latency rows are judged on kernel time, not on their "us" (99 here, above every LL target).
    ll = [e for e, t in zip(targets.compare(_rows(0.9)), targets.TARGETS, strict=True) if t.field == "kernel us"]
    assert ll and all(e["status"] == "met" for e in ll)


def test_exactly_at_the_target_is_met_and_one_miss_is_reported_alone():
    rows = _rows(1.0)
    combine = next(r for r in rows if r["op"] == "intranode combine BF16")
    combine["us"] = 231.0
    by_op = {e["op"]: e for e in targets.compare(rows)}
    assert by_op["intranode combine BF16"]["status"] == "missed by 0.4%"
    assert by_op["intranode combine BF16"]["now us"] == 231.0
    assert sum(e["status"] == "met" for e in by_op.values()) == len(targets.TARGETS) - 1
    assert "10 of 11 met" in targets.format_targets(rows)


def test_missing_and_failed_rows_are_not_measured():
    rows = [r for r in _rows(0.5) if r["op"] != "LL combine LogFMT"]
    rows.append({"op": "intranode layout", "note": "failed: RuntimeError", "suite": "intranode"})
    rows = [r for r in rows if not (r["op"] == "intranode layout" and "us" in r)]
    by_op = {e["op"]: e for e in targets.compare(rows)}
    assert by_op["LL combine LogFMT"]["status"] == "not measured"
    assert by_op["layout (GPU time)"]["status"] == "not measured"
    assert by_op["layout (GPU time)"]["now us"] == "-"


def test_only_the_targets_workload_is_compared():
    from deepep_cupy.bench.__main__ import command_line

    # The benchmarks' defaults are the targets' workload, on a GPU per rank; anything else says why not.
    args = command_line().parse_args(["--quick"])
    assert targets.why_not_compared(2, args, gpus=2) is None
    assert "for 2 ranks" in targets.why_not_compared(4, args, gpus=4)
    assert "shared 1 GPU" in targets.why_not_compared(2, args, gpus=1)
    for option, value, name in (("--tokens", "1024", "tokens"), ("--num-sms", "20", "num_sms"),
                                ("--ll-experts", "256", "ll_experts")):
        assert name in targets.why_not_compared(2, command_line().parse_args([option, value]), gpus=8)
    assert "topk" in targets.why_not_compared(2, SimpleNamespace(**{**vars(args), "topk": 6}), gpus=2)


def test_a_run_over_several_sm_counts_is_compared_on_the_targets_count():
    from deepep_cupy.bench.__main__ import command_line

    assert targets.why_not_compared(2, command_line().parse_args(["--num-sms", "8,12,24"]), gpus=2) is None
    assert "num_sms" in targets.why_not_compared(2, command_line().parse_args(["--num-sms", "8,12"]), gpus=2)
    # Rows at 8 SMs (missing every target) come first; the 24-SM rows (meeting them) are the ones compared.
    at8 = [{**r, "SMs": 8, t.field: 1e6} for r, t in zip(_rows(0.9), targets.TARGETS, strict=True)]
    at24 = [dict(r, SMs=24) for r in _rows(0.9)]
    assert {e["status"] for e in targets.compare(at8 + at24)} == {"met"}
    assert {e["status"] for e in targets.compare(at8)} == {"not measured"}


def test_command_line(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_rows(0.5)))
    out = subprocess.run([sys.executable, "-m", "deepep_cupy.bench.targets", str(path)], capture_output=True,
                         text=True, check=True).stdout
    assert "11 of 11 met" in out and "LL hook: dispatch recv" in out

"""The before/after comparison of benchmark runs: medians per row and field, ratios, rows one side lacks."""

import json

import pytest

from deepep_cupy.bench import compare as C


def _runs(*values, op="host: combine", framework="torch", extra=None):
    return [[{"op": op, "us": v, "framework": framework, "suite": "host"}] + (extra or []) for v in values]


def test_medians_and_ratio_per_row():
    before = _runs(10.0, 30.0, 11.0)  # median 11, whatever the outlier
    after = _runs(12.0, 12.5, 100.0)
    rows, alone = C.compare(before, after)
    assert alone == []
    (r,) = rows
    assert r["op"] == "host: combine" and r["framework"] == "torch"
    assert r["us before"] == 11.0 and r["us after"] == 12.5 and r["us ratio"] == pytest.approx(12.5 / 11.0, abs=1e-3)


def test_rows_are_told_apart_by_framework_and_sms_and_unmatched_ones_listed():
    before = [[{"op": "x", "us": 2.0, "framework": "torch"}, {"op": "x", "us": 4.0, "framework": "cupy"},
               {"op": "old", "us": 1.0}]]
    after = [[{"op": "x", "us": 3.0, "framework": "cupy"}, {"op": "x", "us": 1.0, "framework": "torch"},
              {"op": "y", "us": 5.0, "SMs": 24}]]
    rows, alone = C.compare(before, after)
    assert [(r["framework"], r["us ratio"]) for r in rows] == [("cupy", 0.75), ("torch", 0.5)]
    assert sorted(alone) == ["old (only before)", "y/24 (only after)"]


def test_non_time_fields_and_booleans_are_not_compared():
    rows, _ = C.compare([[{"op": "x", "us": 2.0, "GB/s": 10.0, "hidden %": 50.0}]],
                        [[{"op": "x", "us": 4.0, "GB/s": 5.0, "hidden %": True}]])
    assert set(rows[0]) == {"op", "us before", "us after", "us ratio"}


def test_main_reads_json_runs(tmp_path, capsys):
    paths = {}
    for side, values in (("before", (10.0, 11.0)), ("after", (5.0, 6.0))):
        paths[side] = []
        for i, run in enumerate(_runs(*values)):
            path = tmp_path / f"{side}{i}.json"
            path.write_text(json.dumps(run))
            paths[side].append(str(path))
    C.main(["--before", *paths["before"], "--after", *paths["after"]])
    out = capsys.readouterr().out
    assert "medians of 2 run(s) before and 2 after" in out and "0.524" in out  # 5.5 / 10.5


def test_main_refuses_what_is_not_a_run(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"op": "x"}))
    with pytest.raises(ValueError, match="bad.json"):
        C.main(["--before", str(bad), "--after", str(bad)])
    with pytest.raises(SystemExit):
        C.main(["--before", str(bad)])

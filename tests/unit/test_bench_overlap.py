"""The overlap benchmark suite without a GPU: it is a suite of ``all``, its options show their defaults, the
command stops with the one no-GPU line, and its host-side parts (the call order of the overlapped step, the
check of its outputs, the hidden fraction, the workload) do what the suite's docstring says."""

import os
import subprocess
import sys

import numpy as np
import pytest


def _bench(*argv):
    env = dict(os.environ, DEEPEP_CUPY_FORCE_NO_GPU="1")
    return subprocess.run([sys.executable, "-m", "deepep_cupy.bench", *argv], capture_output=True, text=True,
                          timeout=120, env=env)


def test_overlap_is_a_suite_of_all():
    from deepep_cupy.bench import __main__ as cli
    from deepep_cupy.bench import overlap

    assert "overlap" in cli.SUITES and "overlap" not in cli.OPT_IN + cli.NO_GPU_SUITES
    assert callable(overlap.run) and overlap.FAIL_RUN is True


def test_options_and_their_defaults():
    from deepep_cupy.bench import __main__ as cli

    parse = cli.command_line().parse_args
    args = parse(["overlap"])
    assert args.suites == ["overlap"] and args.late_ms == 20 and args.compute_us == 200
    args = parse(["overlap", "--late-ms", "5", "--compute-us", "0"])
    assert args.late_ms == 5.0 and args.compute_us == 0.0
    for option in ("--late-ms", "--compute-us"):
        for bad in ("-1", "x", "nan", "inf"):
            with pytest.raises(SystemExit):
                parse([option, bad])


def test_help_shows_the_suite_and_the_options_with_defaults():
    got = _bench("--help")
    assert got.returncode == 0, got.stderr
    text = " ".join(got.stdout.split())  # argparse wraps the help lines
    assert "overlap" in text.split("positional arguments:")[1]
    assert "--late-ms LATE_MS overlap suite: milliseconds the last rank sleeps" in text
    assert "late-peer rows (default: 20)" in text
    assert "--compute-us COMPUTE_US overlap suite: microseconds of GPU work" in text
    assert "two-micro-batch step (default: 200)" in text


@pytest.mark.parametrize("argv", [("overlap",), ("overlap", "--late-ms", "5", "--compute-us", "50")])
def test_without_gpus_one_clear_line(argv):
    got = _bench(*argv)
    assert got.returncode != 0
    lines = [line for line in got.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, got.stderr
    assert lines[0].startswith("python -m deepep_cupy.bench: no GPU found; ")


class _Calls:
    """Stand-ins for the Buffer calls that log what is sent and received, in order."""

    def __init__(self):
        self.log = []

    def dispatch(self, x, idx):
        self.log.append(f"dispatch send {x}")
        return f"recv {x}", None, f"handle {x}", None, lambda: self.log.append(f"dispatch recv {x}")

    def combine(self, eo, idx, w, handle):
        self.log.append(f"combine send {eo} {handle}")
        return f"out {eo}", None, lambda: self.log.append(f"combine recv {eo}")

    def compute(self):
        self.log.append("compute")


BATCHES = (("A", "ia", "wa"), ("B", "ib", "wb"))
EXPERT_OUTPUTS = ("eoA", "eoB")


def test_the_step_runs_in_the_two_batch_overlap_order():
    from deepep_cupy.bench.overlap import two_batch_step

    calls = _Calls()
    outs, keep = two_batch_step(calls.dispatch, calls.combine, BATCHES, EXPERT_OUTPUTS, calls.compute)
    assert calls.log == [
        "dispatch send A", "compute", "dispatch send B", "compute", "dispatch recv A", "dispatch recv B",
        "combine send eoA handle A", "compute", "combine send eoB handle B", "compute",
        "combine recv eoA", "combine recv eoB"]
    assert outs == ("out eoA", "out eoB")
    assert [k[0] for k in keep] == ["recv A", "recv B", "out eoA", "out eoB"]  # what the hooks write stays alive
    calls = _Calls()
    two_batch_step(calls.dispatch, calls.combine, BATCHES, EXPERT_OUTPUTS)
    assert "compute" not in calls.log and len(calls.log) == 8


def test_one_at_a_time_receives_right_after_each_send():
    from deepep_cupy.bench.overlap import one_at_a_time

    calls = _Calls()
    outs, _ = one_at_a_time(calls.dispatch, calls.combine, BATCHES, EXPERT_OUTPUTS)
    assert calls.log == ["dispatch send A", "dispatch recv A", "combine send eoA handle A", "combine recv eoA",
                         "dispatch send B", "dispatch recv B", "combine send eoB handle B", "combine recv eoB"]
    assert outs == ("out eoA", "out eoB")


def test_the_output_check_finds_what_is_wrong():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from deepep_cupy.bench.overlap import check_outputs

    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((4, 8)).astype(ml_dtypes.bfloat16) for _ in range(2))
    assert check_outputs([a, b], [a.copy(), b.copy()], "step") is None
    off = b.copy()
    off[1, 2] = off[1, 2] + ml_dtypes.bfloat16(1)
    assert "micro-batch B's combined output differs" in check_outputs([a, off], [a, b], "step")
    assert "1 of 32 values" in check_outputs([a, off], [a, b], "step")
    assert "the same combined output" in check_outputs([a, a], [a, a], "step")
    zero = np.zeros_like(a)
    assert "all zero" in check_outputs([zero, b], [zero, b], "step")
    bad = a.copy()
    bad[0, 0] = np.nan
    assert "not finite" in check_outputs([bad, b], [bad, b], "step")
    assert "shape" in check_outputs([a[:2], b], [a, b], "step")


def test_hidden_fraction():
    from deepep_cupy.bench.overlap import hidden_fraction

    assert hidden_fraction(100.0, 800.0, 800.0) == 1.0  # the step costs only its compute
    assert hidden_fraction(100.0, 800.0, 900.0) == 0.0  # nothing hidden
    assert hidden_fraction(100.0, 800.0, 825.0) == 0.75
    assert hidden_fraction(100.0, 800.0, 950.0) == -0.5  # raw: slower than the two apart
    with pytest.raises(ValueError, match="comm_us"):
        hidden_fraction(0.0, 800.0, 800.0)


def test_micro_batches_are_the_decode_workload():
    pytest.importorskip("ml_dtypes")
    from deepep_cupy.bench.overlap import micro_batch

    x, idx, w = micro_batch((2024, 0, 0), 128, 256, 288, 8)
    assert x.shape == (128, 256) and x.dtype.name == "bfloat16"
    assert idx.shape == (128, 8) and idx.dtype == np.int64 and w.shape == (128, 8) and w.dtype == np.float32
    assert 1 <= int((idx == -1).sum()) <= 10 and idx.max() < 288
    assert all(len(set(r[r >= 0].tolist())) == int((r >= 0).sum()) for r in idx)  # distinct experts per token
    x_b, idx_b, _ = micro_batch((2024, 0, 1), 128, 256, 288, 8)
    assert not np.array_equal(idx, idx_b) and not np.array_equal(x.view(np.uint16), x_b.view(np.uint16))

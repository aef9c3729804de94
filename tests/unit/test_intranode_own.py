"""Own rows of a cached BF16 dispatch through the copy engines (deepep_cupy/ops/intranode/own_rows.py): the runs
of x, where they land in recv_x, and when the SMs keep the own rows; on the CPU."""

from __future__ import annotations

import types

import numpy as np
import pytest

from deepep_cupy.ops.intranode import own_rows as own
from deepep_cupy.ops.intranode.copy import IntranodeHandle


@pytest.mark.parametrize("seed", range(6))
def test_runs_cover_exactly_the_own_tokens_in_order(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 300))
    mask = rng.random(n) < rng.choice([0.05, 0.5, 0.97, 1.0])
    runs = own.own_runs(mask)
    covered = [t for a, b in runs for t in range(a, b)]
    assert covered == list(np.flatnonzero(mask))
    assert all(b > a for a, b in runs)
    assert all(b1 < a2 for (_, b1), (a2, _) in zip(runs, runs[1:], strict=False))  # separated, not touching


def _copies(rank, min_rows=4):
    copies = object.__new__(own.OwnRowCopies)
    copies.engine = types.SimpleNamespace(rank=rank, own_copy_min_rows=min_rows)
    return copies


def _handle(mask, counts):
    return IntranodeHandle(tuple(range(6)), counts, None if mask is None else np.asarray(mask, dtype=bool))


def test_first_row_is_after_the_rows_from_earlier_ranks():
    counts = ((5, 7), (9, 16))  # rank 1 receives 7 rows from rank 0, 9 from itself
    mask = [1, 1, 0, 1, 1, 1, 0, 1, 1, 1]
    assert _copies(1).runs(_handle(mask, counts)) == (7, [(0, 2), (3, 6), (7, 10)])
    assert _copies(0).runs(_handle(mask, counts)) == (0, [(0, 2), (3, 6), (7, 10)])


def test_the_sms_keep_small_or_scattered_own_rows():
    counts = ((5, 7), (9, 16))
    assert _copies(0, min_rows=9).runs(_handle([1] * 8, counts)) is None  # too few rows
    scattered = [1, 0] * (own.MAX_RUNS + 1)
    assert _copies(0).runs(_handle(scattered, counts)) is None  # too many copies
    assert _copies(0).runs(_handle(None, counts)) is None  # the dispatch did not read the column back
    assert _copies(0).runs(_handle([1] * 8, None)) is None  # nor the counts (num_worst_tokens)
    assert _copies(0).runs(tuple(range(6))) is None  # a handle rebuilt by the caller


def test_runs_are_kept_on_the_handle():
    handle = _handle([1] * 8, ((8, 8), (16, 16)))
    first = _copies(1).runs(handle)
    handle.own_tokens = None  # a second call does not look at the column again
    assert _copies(1).runs(handle) == first == (8, [(0, 8)])
    # The threshold is the engine's at each call, not the one of the first call.
    assert _copies(1, min_rows=9).runs(handle) is None
    assert _copies(1, min_rows=8).runs(handle) == first


def test_copy_engines_take_own_rows_at_few_sms_and_two_ranks():
    from deepep_cupy.ops.intranode.engine import IntranodeEngine

    assert own.wanted(2, 8) and own.wanted(2, own.MAX_SMS) and own.wanted(1, 4)
    assert not own.wanted(2, own.MAX_SMS + 1) and not own.wanted(4, 8)
    engine = object.__new__(IntranodeEngine)
    engine.__dict__.update(num_ranks=2, use_own_row_copies=None)
    assert engine.own_row_copies(8) and not engine.own_row_copies(24)
    engine.__dict__["use_own_row_copies"] = True  # the tuning attribute decides where set
    assert engine.own_row_copies(24)
    engine.__dict__["use_own_row_copies"] = False
    assert not engine.own_row_copies(8)

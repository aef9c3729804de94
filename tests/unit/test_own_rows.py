"""Own rows of a dispatch by device-to-device copies (deepep_cupy/ops/own_rows.py): the runs of x, where they land
in recv_x, and when the SMs keep the own rows (intranode and internode policies); on the CPU."""

from __future__ import annotations

import types

import numpy as np
import pytest

from deepep_cupy.ops import own_rows as own
from deepep_cupy.ops.handles import DispatchHandle
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


def _handle(mask, first_row, entries=6):
    return DispatchHandle(tuple(range(entries)), 0, None if mask is None else np.asarray(mask, dtype=bool),
                          first_row)


def test_runs_start_at_the_handles_first_own_row():
    mask = [1, 1, 0, 1, 1, 1, 0, 1, 1, 1]
    assert _copies(1).runs(_handle(mask, 7), 100) == (7, [(0, 2), (3, 6), (7, 10)])
    assert _copies(0).runs(_handle(mask, 0, entries=10), 100) == (0, [(0, 2), (3, 6), (7, 10)])


def test_intranode_handle_keeps_counts_and_own_rows():
    counts = ((5, 7), (9, 16))  # rank 1 receives 7 rows from rank 0, 9 from itself
    handle = IntranodeHandle(tuple(range(6)), counts, np.ones(4, dtype=bool), 3, 7)
    assert (handle.counts, handle.num_topk, handle.own_first_row, handle.own_tokens.sum()) == (counts, 3, 7, 4)
    assert _copies(1).runs(handle, 100) == (7, [(0, 4)])


def test_the_sms_keep_small_or_scattered_own_rows():
    assert _copies(0, min_rows=9).runs(_handle([1] * 8, 0), 100) is None  # too few rows
    scattered = [1, 0] * (own.MAX_RUNS + 1)
    assert _copies(0).runs(_handle(scattered, 0), 100) is None  # too many copies
    assert _copies(0).runs(_handle(None, 0), 100) is None  # the dispatch did not read the column back
    assert _copies(0).runs(_handle([1] * 8, None), 100) is None  # nor the counts (num_worst_tokens)
    assert _copies(0).runs(tuple(range(6)), 100) is None  # a handle rebuilt by the caller


def test_runs_are_kept_on_the_handle():
    handle = _handle([1] * 8, 8)
    first = _copies(1).runs(handle, 100)
    handle.own_tokens = None  # a second call does not look at the column again
    assert _copies(1).runs(handle, 100) == first == (8, [(0, 8)])
    # The threshold is the engine's at each call, not the one of the first call.
    assert _copies(1, min_rows=9).runs(handle, 100) is None
    assert _copies(1, min_rows=8).runs(handle, 100) == first


def test_own_row_copies_only_when_asked():
    """The copies run on SMs outside the launch's count (own_rows.py), so neither engine makes them unless its
    ``use_own_row_copies`` asks; the internode one only with one rank a domain."""
    from deepep_cupy.ops.intranode.engine import IntranodeEngine

    engine = object.__new__(IntranodeEngine)
    engine.num_ranks = 2
    engine.tune(use_own_row_copies=None)
    assert not engine.own_row_copies()
    engine.tune(use_own_row_copies=True)
    assert engine.own_row_copies()
    engine.tune(use_own_row_copies=False)
    assert not engine.own_row_copies()


def test_internode_own_row_copies_with_one_rank_a_domain_when_asked():
    from deepep_cupy.ops.internode.engine import InternodeEngine

    engine = object.__new__(InternodeEngine)
    engine.num_nvl_ranks = 1
    engine.tune(use_own_row_copies=None)
    assert not engine.own_row_copies()
    engine.tune(use_own_row_copies=True)
    assert engine.own_row_copies()
    engine.num_nvl_ranks = 2  # own rows cross the NVLink forwarder
    assert not engine.own_row_copies()


def test_internode_plan_copies_only_rows_inside_recv_x():
    from deepep_cupy.ops.internode.plans import DispatchPlan

    plan = object.__new__(DispatchPlan)
    plan.own, plan.comm_stream, plan._capture_status = _copies(0), 0, lambda stream: 0
    assert plan._own_rows(_handle([1] * 8, 2, entries=10), 10) == (2, [(0, 8)])
    assert plan._own_rows(_handle([1] * 8, 3, entries=10), 10) is None  # would end past recv_x
    assert plan._own_rows(_handle([1] * 8, -1, entries=10), 10) is None  # would start before it
    plan._capture_status = lambda stream: 1  # a graph keeps the kernel's own copies
    assert plan._own_rows(_handle([1] * 8, 2, entries=10), 10) is None
    plan.own = None  # the engine keeps own rows on the SMs
    assert plan._own_rows(_handle([1] * 8, 2, entries=10), 10) is None

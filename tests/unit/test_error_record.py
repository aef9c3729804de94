"""The kernels' error record read on the host: its flag and kind words by name (``RecordFlag``,
``RecordKind``, values from ``cuda_src/common/timeout.cuh``); a record still being written is no error yet."""

from __future__ import annotations

import numpy as np
import pytest

from deepep_cupy.device.kernel_errors import RECORD_WORDS, KernelErrorRecord, RecordFlag, RecordKind
from deepep_cupy.errors import DeepEPTimeoutError
from deepep_cupy.ops import kernel_names as K
from deepep_cupy.ops.headers import constant


def _record(flag, kind, op=3, rank=1, peer=0, waited=2_500_000) -> KernelErrorRecord:
    """A host-side record as a kernel leaves it (no device memory: the words are a NumPy array)."""
    rec = object.__new__(KernelErrorRecord)
    rec._mapped, rec._flag = True, None
    rec._host = np.zeros(RECORD_WORDS, np.int32)
    rec._host[:6] = (flag, op, rank, peer, 42, kind)
    rec._host[6:8].view(np.int64)[0] = waited
    return rec


def test_the_words_match_the_header():
    assert RecordKind.TIMEOUT == constant("common/timeout.cuh", "kRecordTimeout")
    assert RecordKind.VALUE_ERROR == constant("common/timeout.cuh", "kRecordValueError")
    assert RecordFlag.WRITING_TIMEOUT == constant("common/timeout.cuh", "kFlagWritingTimeout")
    assert RecordFlag.WRITING_VALUE_ERROR == constant("common/timeout.cuh", "kFlagWritingValueError")
    # Four distinct flag words: a record being written is never taken for an empty or a complete one.
    assert len({int(f) for f in RecordFlag}) == 4 and RecordFlag.EMPTY == 0 and not RecordFlag.EMPTY


@pytest.mark.parametrize("flag", [RecordFlag.EMPTY, RecordFlag.WRITING_TIMEOUT, RecordFlag.WRITING_VALUE_ERROR])
def test_a_record_not_complete_is_no_error(flag):
    rec = _record(flag, RecordKind.TIMEOUT)
    assert rec.peek() is None
    rec.check({3: "dispatch"})  # nothing raised, nothing cleared
    assert rec._host[0] == flag


def test_a_complete_timeout_names_the_op_and_peer():
    rec = _record(RecordFlag.COMPLETE, RecordKind.TIMEOUT)
    assert rec.peek()["kind"] == RecordKind.TIMEOUT
    with pytest.raises(DeepEPTimeoutError, match=r"dispatch: rank 1 timed out after 2.5 ms waiting for peer 0"):
        rec.check({3: "dispatch"})
    assert not rec._host.any()  # cleared


def test_a_complete_value_error_is_a_value_error():
    rec = _record(RecordFlag.COMPLETE, RecordKind.VALUE_ERROR, op=K.VALUE_OP_LAYOUT, peer=-1, waited=300)
    with pytest.raises(ValueError, match=r"get_dispatch_layout: topk_idx held expert id 300 on rank 1"):
        rec.check()
    assert not rec._host.any()


@pytest.mark.parametrize(("started", "grid", "partial"), [(0, 0, False), (132, 132, False), (41, 59, True)])
def test_a_timeout_says_when_its_grid_had_only_partly_begun(started, grid, partial):
    """A low-latency kernel records how many of its launch's blocks had begun; fewer than the grid (a GPU
    that could not hold the whole grid, as when processes share it under MPS) is named in the message."""
    rec = _record(RecordFlag.COMPLETE, RecordKind.TIMEOUT)
    rec._host[8:10] = (started, grid)
    with pytest.raises(DeepEPTimeoutError) as info:
        rec.check({3: "low_latency_combine (receive)"})
    message = str(info.value)
    assert message.startswith("low_latency_combine (receive): rank 1 timed out after 2.5 ms waiting for peer 0")
    assert (f"only {started} of the launch's {grid} blocks had begun" in message) == partial
    assert ("MPS" in message) == partial
    assert not rec._host.any()

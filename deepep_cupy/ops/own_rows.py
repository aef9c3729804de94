"""Own rows of a dispatch by plain device-to-device copies (intranode, and internode with one rank a domain),
off unless the engine's ``use_own_row_copies`` asks for them.

The rows a rank keeps for itself (its tokens routed to its own experts) form one block of ``recv_x`` (rows
from ``own_first_row`` on: intranode ``rank_prefix_matrix[me - 1][me]``, internode entry 6 of source ``me -
1``), filled from a few runs of consecutive tokens of ``x``: with 2 ranks almost every token goes to both,
so 4096 tokens make ~13 runs. A side stream copies those runs while the kernel moves the peers' rows; the
kernel (``own_rows_copied``) then leaves the own rows' data out and still stores their scales.

Why off by default: a copy within one GPU is not a copy-engine copy. The driver runs it as a kernel of its own,
on SMs the dispatch's launch did not count: queued beside a kernel holding every SM it ended only after that
kernel, where a copy of the same bytes to a peer GPU (copy engines) ended inside it; ``cuMemcpyBatchAsync`` with
``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE`` behaved the same. So with these copies a dispatch on N SMs holds
more than N, and beside a GEMM that holds the rest it waits for them: what a few-SM config is for. Where the
other SMs are idle they pay, most at few SMs (docs/design/intranode.md). Each run is a copy command of several
microseconds of host time.

Queuing the runs as one ``cuMemcpyBatchAsync`` took as much host time as the copies one by one, so they go one
by one.

The runs need ``is_token_in_rank`` on the host: a dispatch without a handle reads this rank's column back
in its one host wait, together with the counts, and keeps it on its handle (``DispatchHandle.own_tokens``
and ``own_first_row``); the runs are computed once per handle.
"""

from __future__ import annotations

import numpy as np

from ..device.streams import create_events, destroy_events

__all__ = ["MAX_RUNS", "MIN_ROWS", "OwnRowCopies", "own_runs"]

#: Fewer own rows than this stay on the SMs (a copy costs host time and a few microseconds of GPU time).
MIN_ROWS = 1024
#: More runs than this stay on the SMs (each run is a copy to issue).
MAX_RUNS = 64
_MEMCPY_DEFAULT = 4


def own_runs(own_tokens: np.ndarray) -> list[tuple[int, int]]:
    """``[(first token, end token), ...]``: the runs of consecutive True entries of ``own_tokens``."""
    own = np.asarray(own_tokens, dtype=bool)
    edges = np.flatnonzero(np.diff(np.concatenate(([False], own, [False])).astype(np.int8)))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


class OwnRowCopies:
    """The own-row copies of one dispatch plan (rows of ``row_bytes``). ``engine`` has ``rank``,
    ``own_copy_min_rows``, ``own_copies`` (a count) and ``copy_stream(0)``."""

    def __init__(self, engine, row_bytes: int, comm_stream: int) -> None:
        import cupy

        self.engine, self.row_bytes, self.comm_stream = engine, int(row_bytes), comm_stream
        rt = cupy.cuda.runtime
        self._rt = rt
        self.events = create_events(rt, 2)

    def runs(self, handle, num_rows: int) -> tuple[int, list[tuple[int, int]]] | None:
        """``(first own row of recv_x, runs of x)`` for ``handle``, or None when the SMs keep the own rows
        (a handle without what the dispatch read back, fewer than ``own_copy_min_rows`` rows, more than
        :data:`MAX_RUNS` runs, or a block of own rows that would not lie inside the ``num_rows`` rows of
        ``recv_x``: the first row came back from the device). The runs are computed once and kept on the
        handle."""
        found = getattr(handle, "own_runs", None)
        if found is None:
            own, first_row = getattr(handle, "own_tokens", None), getattr(handle, "own_first_row", None)
            if own is None or first_row is None:
                return None
            runs = own_runs(own)
            found = handle.own_runs = (int(first_row), runs, sum(b - a for a, b in runs))
        first_row, runs, rows = found
        if rows < self.engine.own_copy_min_rows or len(runs) > MAX_RUNS or not 0 <= first_row <= num_rows - rows:
            return None
        return first_row, runs

    def start(self, prepared, x_ptr: int, recv_ptr: int) -> None:
        """Queue the copies on the side stream after the communication stream's work so far."""
        first_row, runs = prepared
        rt, side, hb = self._rt, self.engine.copy_stream(0), self.row_bytes
        rt.eventRecord(self.events[0], self.comm_stream)
        rt.streamWaitEvent(side, self.events[0], 0)
        dst = recv_ptr + first_row * hb
        copy = rt.memcpyAsync
        for a, b in runs:
            copy(dst, x_ptr + a * hb, (b - a) * hb, _MEMCPY_DEFAULT, side)
            dst += (b - a) * hb
        self.engine.own_copies += 1

    def finish(self) -> None:
        """The communication stream waits for the copies (call after the kernel's launch)."""
        rt = self._rt
        rt.eventRecord(self.events[1], self.engine.copy_stream(0))
        rt.streamWaitEvent(self.comm_stream, self.events[1], 0)

    def __del__(self) -> None:
        destroy_events(self)

"""Own rows of a dispatch through the copy engines (intranode, and internode with one rank a domain).

The rows a rank keeps for itself (its tokens routed to its own experts) form one block of ``recv_x`` (rows
from ``own_first_row`` on: intranode ``rank_prefix_matrix[me - 1][me]``, internode entry 6 of source ``me -
1``), filled from a few runs of consecutive tokens of ``x``: with 2 ranks almost every token goes to both,
so 4096 tokens make ~13 runs. A side stream copies those runs with plain device-to-device copies while the
kernel's SMs move the peers' rows; the kernel (``own_rows_copied``) then leaves the own rows' data out and
still stores their scales (the copy engines cannot transpose them).

Intranode, when: the SMs' copy rate bounds the dispatch when it has few SMs, and the copy engines then take
half its bytes off them. 2 x H200, 4096 x 7168, top-8 of 256, 2 ranks, one run, SMs copying own rows against copy
engines (each at its best block shape): BF16 337 against 214 us at 8 SMs, 238 against 209 at 12, 198 against
200 at 16, 211 against 197 at 24; FP8 with column-major scales 208 against 147 at 8 SMs, 150 against 117 at
12, 114 against 122 at 16, 121 against 125 at 24. Each run is a copy command of a few microseconds of host
time, which a saving of 30-120 us of GPU time repays; a saving of nothing at 16 SMs and more does not. So
the copy engines take own rows at up to :data:`MAX_SMS` SMs, at up to :data:`MAX_RANKS` ranks (the output
pool's default, and the only rank count measured); ``IntranodeEngine.use_own_row_copies`` decides otherwise.
The internode policy is ``InternodeEngine.own_row_copies``.

Queuing the runs as one ``cuMemcpyBatchAsync`` took as much host time as the copies one by one (about 100 us
for 14 runs on 2 x H200), so they go one by one.

The runs need ``is_token_in_rank`` on the host: a dispatch without a handle reads this rank's column back
in its one host wait, together with the counts, and keeps it on its handle (``DispatchHandle.own_tokens``
and ``own_first_row``); the runs are computed once per handle.
"""

from __future__ import annotations

import numpy as np

from ..device.streams import create_events, destroy_events

__all__ = ["MAX_RANKS", "MAX_SMS", "MAX_RUNS", "MIN_ROWS", "OwnRowCopies", "own_runs", "wanted"]

#: Intranode: cached dispatches launched on at most this many SMs, of at most this many ranks, copy own rows with
#: the copy engines.
MAX_SMS = 12
MAX_RANKS = 2
#: Fewer own rows than this stay on the SMs (a copy costs host time and a few microseconds of engine time).
MIN_ROWS = 1024
#: More runs than this stay on the SMs (each run is a copy to issue).
MAX_RUNS = 64
_MEMCPY_DEFAULT = 4


def wanted(num_ranks: int, num_sms: int) -> bool:
    """Whether a cached intranode dispatch of ``num_ranks`` ranks launched on ``num_sms`` SMs copies its own rows
    with the copy engines by default."""
    return num_ranks <= MAX_RANKS and num_sms <= MAX_SMS


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

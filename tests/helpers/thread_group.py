"""An in-process multi-rank group: R "ranks" run as threads and exchange objects through shared slots.

``ThreadGroup`` has the same methods as the library's process groups (``rank``, ``size``,
``allgather_object``, ``alltoall_object``, ``barrier``), so multi-rank semantics can be tested in plain
pytest. ``run_ranks(size, fn)`` calls ``fn(group)`` on every rank and returns the per-rank results; an
exception on any rank breaks the shared barrier (so no rank waits forever) and is re-raised.
"""

from __future__ import annotations

import threading


class _Shared:
    def __init__(self, size: int, timeout: float) -> None:
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots = [None] * size


class ThreadGroup:
    def __init__(self, shared: _Shared, rank: int, size: int) -> None:
        self._shared = shared
        self.rank = rank
        self.size = size

    def barrier(self) -> None:
        self._shared.barrier.wait()

    def allgather_object(self, obj) -> list:
        self._shared.slots[self.rank] = obj
        self._shared.barrier.wait()
        out = list(self._shared.slots)
        self._shared.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return out

    def alltoall_object(self, objs: list) -> list:
        if len(objs) != self.size:
            raise ValueError(f"alltoall_object needs {self.size} objects, got {len(objs)}")
        gathered = self.allgather_object(list(objs))
        return [gathered[src][self.rank] for src in range(self.size)]


def run_ranks(size: int, fn, timeout: float = 60.0) -> list:
    """Run ``fn(group)`` on ``size`` thread-ranks; return the results indexed by rank."""
    shared = _Shared(size, timeout)
    results = [None] * size
    errors = [None] * size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(ThreadGroup(shared, rank, size))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors[rank] = exc
            shared.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real:
        raise real[0]
    if any(e is not None for e in errors):
        raise next(e for e in errors if e is not None)
    if any(t.is_alive() for t in threads):
        raise TimeoutError("a thread-rank did not finish")
    return results

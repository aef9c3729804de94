"""NVSHMEM teardown when a rank is gone, with NVSHMEM and the process group faked (no GPU): the exit
finalize runs only after every rank arrived at a bounded barrier, a lost rank is remembered (no collective
free, finalize or allocation afterwards), and ``CudaBackend.destroy`` records the ranks its barrier missed.

The multi-process half (a real MPI job whose rank 1 vanishes) is in test_nvshmem_exit_job.py.
"""

from __future__ import annotations

import pickle
import threading
import time

import pytest

from deepep_cupy.device import nvshmem as nv
from deepep_cupy.device.group import CommGroup, timeout_error
from deepep_cupy.errors import DeepEPTimeoutError


class FakeNvshmem:
    """Stands in for nvshmem.core and nvshmem.bindings; records the collective calls."""

    def __init__(self) -> None:
        self.calls: list = []

    def finalize(self) -> None:
        self.calls.append("finalize")

    def free(self, ptr) -> None:
        self.calls.append(("free", ptr))

    def malloc(self, nbytes) -> int:
        self.calls.append(("malloc", nbytes))
        return 4096


class FakeGroup(CommGroup):
    """Rank 0 of ``size``; ``missing`` ranks never arrive (the exchange times out naming them)."""

    def __init__(self, size: int = 2, missing=(), *, usable: bool = True, error: Exception | None = None) -> None:
        self.rank, self.size = 0, size
        self.missing, self._usable, self.error = list(missing), usable, error
        self.barriers: list[str] = []

    def _exchange(self, sends, expect, op):
        self.barriers.append(op)
        if self.error is not None:
            raise self.error
        if self.missing:
            raise timeout_error(op, self.rank, self.missing, 0.01)
        return {p: pickle.dumps((op, None)) for p in expect}

    def usable(self) -> bool:
        return self._usable


@pytest.fixture
def fake(monkeypatch):
    """A fresh NVSHMEM state, initialised for rank 0 of 2, with the fake library."""
    lib = FakeNvshmem()
    monkeypatch.setattr(nv, "_modules", lambda: (lib, lib))
    monkeypatch.setattr(nv, "_state", dict(initialized=True, rank=0, size=2, device=0, heap=1 << 30, live=0,
                                           own_heap=False, lost=None, exit_group=FakeGroup()))
    return lib


def test_exit_finalizes_when_every_rank_arrives(fake, capsys):
    nv._finalize_at_exit()
    assert fake.calls == ["finalize"]
    assert nv._state["exit_group"].barriers == ["NVSHMEM finalize at exit"]
    assert not nv.is_initialized()
    assert capsys.readouterr().err == ""


def test_exit_skips_the_finalize_and_names_the_ranks_that_did_not_arrive(fake, capsys):
    nv._state["exit_group"] = FakeGroup(size=4, missing=[1, 3])
    nv._state["size"] = 4
    nv._finalize_at_exit()
    assert fake.calls == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "NVSHMEM not finalized at exit: ranks 1, 3 of 4 did not arrive" in err
    assert nv.peers_lost() == [1, 3]
    with pytest.raises(RuntimeError, match="ranks 1, 3 of 4"):
        nv.finalize()  # the explicit finalize is bounded the same way
    assert fake.calls == []


def test_a_broken_connection_counts_as_a_lost_rank(fake, capsys):
    nv._state["exit_group"] = FakeGroup(error=RuntimeError("Connection closed by peer"))
    nv._finalize_at_exit()
    assert fake.calls == []
    assert "some ranks (which ones is unknown)" in capsys.readouterr().err
    assert nv.peers_lost() == []


def test_ranks_lost_in_destroy_skip_the_exit_barrier_and_every_collective(fake, capsys):
    nv.mark_peers_lost(FakeGroup(), [1])
    alloc = object.__new__(nv.SymmetricAllocation)
    alloc.ptr, alloc.nbytes, alloc.array, alloc._freed = 1234, 64, None, False
    nv._state["live"] = 1
    alloc.free()  # collective: skipped, the memory stays with the process
    assert alloc._freed and nv._state["live"] == 0
    with pytest.raises(RuntimeError, match="NVSHMEM lost rank 1 of 2"):
        nv.acquire(FakeGroup(), 0, 1 << 20)
    nv._finalize_at_exit()
    assert fake.calls == []
    assert nv._state["exit_group"].barriers == []  # known lost: nothing waits for it again
    assert "rank 1 of 2 did not arrive" in capsys.readouterr().err


def test_a_lost_rank_of_another_group_is_left_to_the_exit_barrier(fake):
    nv.mark_peers_lost(FakeGroup(size=4), [3])  # not NVSHMEM's world (2 ranks)
    assert nv.peers_lost() is None
    nv._state["initialized"] = False
    nv.mark_peers_lost(FakeGroup(), [1])  # NVSHMEM not running: nothing to protect
    assert nv.peers_lost() is None


def test_free_after_the_exit_finalize_is_skipped(fake):
    nv._finalize_at_exit()
    alloc = object.__new__(nv.SymmetricAllocation)
    alloc.ptr, alloc.nbytes, alloc.array, alloc._freed = 1234, 64, None, False
    nv._state["live"] = 1
    alloc.free()  # a Buffer collected after the exit hook: the heap is already gone
    assert fake.calls == ["finalize"]


def test_without_a_usable_group_the_finalize_goes_ahead(fake):
    nv._state["exit_group"] = FakeGroup(usable=False)  # e.g. torch.distributed shut down by the user
    nv._finalize_at_exit()
    assert fake.calls == ["finalize"] and nv._state["exit_group"].barriers == []


def test_a_thread_holding_the_lock_does_not_keep_the_process_from_ending(fake, monkeypatch, capsys):
    monkeypatch.setenv("DEEPEP_CUPY_TIMEOUT_S", "0.2")
    held, done = threading.Event(), threading.Event()

    def hold():
        with nv._lock:
            held.set()
            done.wait(10)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    held.wait(5)
    start = time.monotonic()
    try:
        nv._finalize_at_exit()
    finally:
        done.set()
        thread.join(5)
    assert time.monotonic() - start < 5
    assert fake.calls == [] and "another thread" in capsys.readouterr().err


def test_the_exit_group_is_a_twin_made_at_initialisation():
    group = FakeGroup()
    assert nv._own_group(group) is group  # groups that make nothing of their own are used as they are

    class Twinned:
        rank, size = 0, 2

        def twin(self):
            return "twin"

    assert nv._own_group(Twinned()) == "twin"


def test_destroy_that_times_out_marks_the_missing_ranks_lost(fake):
    from deepep_cupy.backends.cuda import CudaBackend

    runtime = object.__new__(CudaBackend)
    runtime.group = FakeGroup(missing=[1])
    for name in ("intranode", "internode", "low_latency"):
        setattr(runtime, name, None)
    with pytest.raises(DeepEPTimeoutError, match="Buffer.destroy"):
        runtime.destroy()
    assert nv.peers_lost() == [1]

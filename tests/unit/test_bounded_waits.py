"""Waits of the set-up and of the tools end in a named error, on the CPU: the low-latency engine's set-up
when one rank fails after the collective allocation, NVSHMEM calls behind a stuck thread, the benchmarks'
and the tuner's barriers, and descriptor sharing when a rank cannot open its socket."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
import types
from pathlib import Path

import pytest
from thread_group import run_ranks

from deepep_cupy.device import fd_share, nvshmem
from deepep_cupy.errors import DeepEPError, DeepEPTimeoutError

PACKAGE = Path(__file__).resolve().parents[2] / "deepep_cupy"


class _Alloc:
    """A symmetric allocation that counts its frees (each must be one collective free, on every rank)."""

    def __init__(self, rank: int, fail_on: int | None = None) -> None:
        self.rank, self.frees, self.fail_on = rank, 0, fail_on
        self.ptr, self.nbytes = 4096, 1 << 20
        self.array = types.SimpleNamespace(fill=lambda value: None)

    def peer_ptr(self, pe: int, offset: int = 0) -> int:
        if self.rank == self.fail_on:
            raise RuntimeError(f"injected set-up failure on rank {self.rank}")
        return 1

    def free(self) -> None:
        self.frees += 1


def _outcomes(size, fn, timeout=20.0):
    def body(group):
        try:
            return fn(group)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            return exc
    return run_ranks(size, body, timeout=timeout)


# ---------------------------------------------------------------------------------------------------- set-up
def test_settle_setup_when_every_rank_succeeds():
    allocs = [_Alloc(r) for r in range(3)]
    assert _outcomes(3, lambda g: nvshmem.settle_setup(g, None, "set-up", [allocs[g.rank]])) == [None] * 3
    assert [a.frees for a in allocs] == [0, 0, 0]


def test_settle_setup_when_one_rank_fails_every_rank_frees_and_raises():
    allocs = [_Alloc(r) for r in range(3)]
    own = RuntimeError("no memory for the mask")

    def fn(g):
        nvshmem.settle_setup(g, own if g.rank == 1 else None, "low-latency buffer set-up", [allocs[g.rank]])

    got = _outcomes(3, fn)
    assert got[1] is own
    for r in (0, 2):
        assert type(got[r]) is DeepEPError
        assert str(got[r]) == ("low-latency buffer set-up: rank 1 failed (RuntimeError: no memory for the mask); the "
                               "symmetric memory was freed on every rank")
    assert [a.frees for a in allocs] == [1, 1, 1]


def test_settle_setup_frees_nothing_when_a_rank_does_not_answer(monkeypatch):
    lost = []
    monkeypatch.setattr(nvshmem, "mark_peers_lost", lambda group, missing: lost.append(missing))
    timeout = DeepEPTimeoutError("low-latency buffer set-up: rank 0 waited 1 s for rank 1, which did not arrive")
    timeout.missing = [1]

    class Group:
        rank, size = 0, 2

        def allgather_object(self, obj):
            raise timeout

    alloc = _Alloc(0)
    own = RuntimeError("own failure")
    with pytest.raises(DeepEPTimeoutError) as info:
        nvshmem.settle_setup(Group(), own, "low-latency buffer set-up", [alloc])
    assert info.value is timeout and info.value.__cause__ is own
    assert alloc.frees == 0 and lost == [[1]]  # the free would wait for rank 1: none, and it is remembered


class _Array:
    def __init__(self, *shape, **_dtype) -> None:
        self.data = types.SimpleNamespace(ptr=0)

    def fill(self, value) -> None:
        pass


def _fake_cupy():
    class Device:
        attributes = {"MultiProcessorCount": 132}

        def __init__(self, device_id=0) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def synchronize(self) -> None:
            pass

    return types.SimpleNamespace(cuda=types.SimpleNamespace(Device=Device), zeros=_Array, int32="int32",
                                 uint32="uint32", uint64="uint64")


def test_low_latency_engine_setup_failure_on_one_rank_ends_on_every_rank(monkeypatch):
    """Rank 1's set-up fails after the collective allocation: every rank ends with a named error within the
    bound (rank 1 its own, the others one naming rank 1), and every rank frees its allocation exactly once,
    together (no rank waits in a barrier while another frees)."""
    from deepep_cupy.ops.low_latency import engine as ll

    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(ll, "KernelErrorRecord", lambda: types.SimpleNamespace(ptr=0))
    monkeypatch.setenv("DEEPEP_CUPY_TIMEOUT_S", "5")
    allocs = {}

    def acquire(group, device_id, num_bytes, **_kw):
        allocs[group.rank] = _Alloc(group.rank, fail_on=1)
        return allocs[group.rank]

    monkeypatch.setattr(nvshmem, "acquire", acquire)

    def make(g):
        return ll.LowLatencyEngine(g, 0, 1 << 20, allow_nvlink=True, num_qps_per_rank=1, allow_mnnvl=False,
                                   enable_shrink=False)

    start = time.monotonic()
    got = _outcomes(3, make)
    assert time.monotonic() - start < 5
    assert type(got[1]) is RuntimeError and str(got[1]) == "injected set-up failure on rank 1"
    for r in (0, 2):
        assert type(got[r]) is DeepEPError and "rank 1 failed (RuntimeError: injected set-up failure on rank 1)" \
            in str(got[r]), got[r]
    assert sorted((r, a.frees) for r, a in allocs.items()) == [(0, 1), (1, 1), (2, 1)]
    # Without a failure the same exchange is the set-up's barrier, and nothing is freed.
    monkeypatch.setattr(nvshmem, "acquire", lambda group, *a, **k: allocs.setdefault(("ok", group.rank),
                                                                                     _Alloc(group.rank)))
    engines = _outcomes(3, make)
    assert all(isinstance(e, ll.LowLatencyEngine) for e in engines), engines
    assert all(allocs[("ok", r)].frees == 0 for r in range(3))


# ---------------------------------------------------------------------------------------------------- NVSHMEM lock
def _held_lock():
    """Hold NVSHMEM's process lock in another thread (as a thread stuck in a collective call would); returns
    the event that lets it go."""
    taken, release = threading.Event(), threading.Event()

    def hold():
        with nvshmem._lock:
            taken.set()
            release.wait(30)

    threading.Thread(target=hold, daemon=True).start()
    assert taken.wait(5)
    return release


@pytest.mark.parametrize("op", ["nvshmem.finalize", "nvshmem_free", "nvshmem_malloc"])
def test_nvshmem_calls_behind_a_stuck_thread_end_in_a_named_timeout(op, monkeypatch):
    monkeypatch.setenv("DEEPEP_CUPY_TIMEOUT_S", "0.3")
    monkeypatch.setattr(nvshmem, "_modules", lambda: (None, None))  # no nvshmem4py needed: the lock comes first
    alloc = object.__new__(nvshmem.SymmetricAllocation)
    alloc._freed = False
    calls = {"nvshmem.finalize": nvshmem.finalize, "nvshmem_free": alloc.free,
             "nvshmem_malloc": lambda: nvshmem.acquire(types.SimpleNamespace(rank=0, size=1), 0, 1024)}
    release = _held_lock()
    try:
        start = time.monotonic()
        with pytest.raises(DeepEPTimeoutError, match=rf"^{re.escape(op)}: waited 0.3 s for another thread's NVSHMEM "
                                                     r"call in this process"):
            calls[op]()
        assert 0.25 < time.monotonic() - start < 3
    finally:
        release.set()
    assert alloc._freed is False


# ---------------------------------------------------------------------------------------------------- tools
def test_benchmarks_and_tuner_use_the_bounded_barrier():
    """``comm.Barrier()`` waits without end for a rank that is gone; the tools use ``comm_barrier``."""
    files = sorted((PACKAGE / "bench").glob("*.py")) + [PACKAGE / "tuning" / "cli.py"]
    plain = [f"{f.name}:{i}" for f in files for i, line in enumerate(f.read_text().splitlines(), 1)
             if re.search(r"\.Barrier\(", line)]
    assert plain == []
    assert any("comm_barrier(" in f.read_text() for f in files)


# ---------------------------------------------------------------------------------------------------- fd sharing
def test_a_rank_that_cannot_open_its_socket_fails_every_rank_with_fd_share_error(monkeypatch):
    real = fd_share._socket_name
    # An abstract name over the 108-byte limit: bind fails with OSError on rank 1 only.
    monkeypatch.setattr(fd_share, "_socket_name", lambda token, rank: b"\0" + b"x" * 200 if rank == 1
                        else real(token, rank))

    def fn(group):
        r, w = os.pipe()
        try:
            return fd_share.exchange_fds(group, r, method="socket")
        finally:
            os.close(r)
            os.close(w)

    start = time.monotonic()
    got = _outcomes(3, fn)
    assert time.monotonic() - start < 10
    for exc in got:
        assert type(exc) is fd_share.FdShareError, got
        assert "a rank could not open its descriptor socket (rank 1: " in str(exc), exc


@pytest.mark.parametrize("method", ["auto", "socket"])
def test_shared_descriptors_are_close_on_exec(method):
    def fn(group):
        r, w = os.pipe()
        try:
            got = fd_share.exchange_fds(group, r, method=method)
            flags = [None if fd is None else os.get_inheritable(fd) for fd in got]
            for fd in got:
                fd_share.close_quietly(fd)
            group.barrier()
            return flags
        finally:
            os.close(r)
            os.close(w)

    for rank, flags in enumerate(run_ranks(3, fn)):
        assert flags[rank] is None and [f for p, f in enumerate(flags) if p != rank] == [False, False]


def test_received_descriptors_would_be_inherited_without_the_flag():
    """The check above can fail: a descriptor received without ``MSG_CMSG_CLOEXEC`` is inheritable."""
    import socket

    a, b = socket.socketpair()
    r, w = os.pipe()
    try:
        socket.send_fds(a, [b"F"], [r])
        _, fds, _, _ = socket.recv_fds(b, 1, 1)
        assert os.get_inheritable(fds[0]) is True
        os.close(fds[0])
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()

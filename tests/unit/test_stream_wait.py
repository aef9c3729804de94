"""The stream-wait watchdog (``deepep_cupy.device.stream_wait.WaitWatchdog``) over a fake driver: a wait
whose follow-up has not finished by its deadline is released by a write of the awaited value from the
watchdog's own stream, re-armed until its event completes, and left alone when it finishes in time."""

import threading
import time

import pytest

from deepep_cupy.device.stream_wait import WaitWatchdog

_NOT_READY = 600


class _FakeDriver:
    """Events are ints; ``done`` holds the completed ones. Every write is logged with its time."""

    def __init__(self) -> None:
        self.done: set = set()
        self.writes: list = []
        self.queries: list = []
        self.lock = threading.Lock()

    def cuCtxGetCurrent(self, ctx) -> int:
        return 0

    def cuCtxSetCurrent(self, ctx) -> int:
        return 0

    def cuEventQuery(self, event) -> int:
        with self.lock:
            self.queries.append(event)
            return 0 if event in self.done else _NOT_READY

    def cuStreamWriteValue32_v2(self, stream, address, value, flags) -> int:
        with self.lock:
            self.writes.append((stream, address, value, flags, time.monotonic()))
        return 0


def _until(predicate, limit_s: float = 5.0) -> bool:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


@pytest.fixture
def watchdog():
    created = []

    def make(timeout_s):
        drv = _FakeDriver()
        dog = WaitWatchdog(stream=77, timeout_s=timeout_s, driver=drv)
        created.append(dog)
        return dog, drv

    yield make
    for dog in created:
        dog.close()
        assert not dog._thread.is_alive()


def test_released_after_the_deadline_then_rearmed_until_done(watchdog):
    dog, drv = watchdog(0.05)
    t0 = time.monotonic()
    dog.watch(0, event=11, address=0x1000, value=4)
    assert _until(lambda: len(drv.writes) >= 2)
    first, second = drv.writes[0], drv.writes[1]
    assert first[:4] == (77, 0x1000, 4, 0) and second[:4] == (77, 0x1000, 4, 0)
    assert first[4] - t0 >= 0.05 - 1e-3  # not before the deadline
    assert second[4] - first[4] >= 0.05 - 1e-3  # re-armed: a full timeout later
    assert dog.released >= 2
    with drv.lock:
        drv.done.add(11)
    assert _until(lambda: not dog._pending)
    settled = len(drv.writes)
    time.sleep(0.15)
    assert len(drv.writes) == settled  # done: never released again


def test_a_wait_that_finishes_in_time_is_never_released(watchdog):
    dog, drv = watchdog(0.05)
    drv.done.add(5)
    dog.watch("a", event=5, address=0x2000, value=2)
    assert _until(lambda: not dog._pending)
    time.sleep(0.12)
    assert drv.writes == [] and dog.released == 0
    assert 5 in drv.queries  # the event was asked, at the deadline


def test_a_later_wait_on_the_same_key_replaces_the_entry(watchdog):
    dog, drv = watchdog(0.08)
    dog.watch(1, event=21, address=0x3000, value=2)
    dog.watch(1, event=22, address=0x3000, value=2)
    assert _until(lambda: len(drv.writes) >= 1)
    assert 21 not in drv.queries and 22 in drv.queries
    drv.done.add(22)
    assert _until(lambda: not dog._pending)


def test_keys_are_released_independently(watchdog):
    dog, drv = watchdog(0.05)
    drv.done.add(31)
    dog.watch(0, event=31, address=0x4000, value=2)
    dog.watch(1, event=32, address=0x5000, value=3)
    assert _until(lambda: len(drv.writes) >= 1)
    assert {w[1] for w in drv.writes} == {0x5000}
    drv.done.add(32)
    assert _until(lambda: not dog._pending)


def test_the_owner_is_held_while_pending_and_dropped_when_done(watchdog):
    import gc
    import weakref

    class Owner:
        pass

    dog, drv = watchdog(0.05)
    owner = Owner()
    ref = weakref.ref(owner)
    dog.watch(0, event=41, address=0x6000, value=2, owner=owner)
    del owner
    gc.collect()
    assert ref() is not None  # still pending: its event must stay valid for the query
    drv.done.add(41)
    assert _until(lambda: not dog._pending)
    gc.collect()
    assert ref() is None


def test_close_ends_the_thread_with_waits_pending(watchdog):
    dog, drv = watchdog(30.0)
    dog.watch(0, event=51, address=0x7000, value=2)
    t0 = time.monotonic()
    dog.close()
    assert time.monotonic() - t0 < 2.0
    assert not dog._thread.is_alive() and drv.writes == []

"""Stream memory waits with a deadline: a stream that waits, holding no SMs, until a 32-bit word in device
memory reaches a value (``cuStreamWaitValue32``), and the host watchdog that bounds every such wait.

A stream wait has no timeout of its own: a peer that never writes the word would block the stream, and
every stream joined to it, for ever. So each wait is registered with a :class:`WaitWatchdog` together
with an event recorded after the work that follows it. A wait whose event has not completed by its
deadline is released: the watchdog writes the value itself from a stream of its own, so the work queued
after the wait runs. That work must not trust the word (the low-latency receive still waits for every
tag itself, against its own deadline), so it is what reports the op, the rank and the peer that is
missing. A released entry is re-armed until its event completes, so waits queued behind it are bounded
too.
"""

from __future__ import annotations

import ctypes
import threading
import time

__all__ = ["WaitWatchdog", "stream_waits_supported", "wait_value_geq"]

_WAIT_VALUE_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - value) >= 0
_CUDA_SUCCESS = 0
_CUDA_ERROR_NOT_READY = 600

_lib = None


def _cuda():
    """The driver library with the prototypes used here (opened on first use)."""
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        for name, args in (("cuStreamWaitValue32_v2", (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)),
                           ("cuStreamWriteValue32_v2", (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)),
                           ("cuEventQuery", (ctypes.c_void_p,)),
                           ("cuCtxGetCurrent", (ctypes.POINTER(ctypes.c_void_p),)),
                           ("cuCtxSetCurrent", (ctypes.c_void_p,))):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        _lib = lib
    return _lib


def stream_waits_supported() -> bool:
    """Whether the driver has the v2 stream memory operations (on by default wherever they exist; the v1
    device attribute says nothing about them). False where the driver library cannot be opened."""
    try:
        _cuda()
    except (OSError, AttributeError):
        return False
    return True


def wait_value_geq(stream: int, address: int, value: int) -> None:
    """Queue on ``stream`` a wait until the uint32 at ``address`` reaches ``value`` (wrapping compare)."""
    err = _cuda().cuStreamWaitValue32_v2(stream, address, value, _WAIT_VALUE_GEQ)
    if err != _CUDA_SUCCESS:
        raise RuntimeError(f"cuStreamWaitValue32 failed (CUresult {err})")


class _Entry:
    __slots__ = ("event", "owner", "address", "value", "deadline")

    def __init__(self, event: int, owner, address: int, value: int, deadline: float) -> None:
        self.event, self.owner, self.address, self.value, self.deadline = event, owner, address, value, deadline


class WaitWatchdog:
    """Releases the stream waits of one device whose follow-up has not finished ``timeout_s`` after they
    were queued (see the module's docstring). ``watch`` is the hot-path call: a dict store, and a wake-up
    only when the thread is idle. ``stream`` is the watchdog's own (non-blocking) stream handle; ``driver``
    (tests) replaces the driver library."""

    def __init__(self, stream: int, timeout_s: float, driver=None) -> None:
        self._cu = driver if driver is not None else _cuda()
        self._stream = int(stream)
        self.timeout_s = float(timeout_s)
        ctx = ctypes.c_void_p(0)
        self._cu.cuCtxGetCurrent(ctypes.byref(ctx))
        self._ctx = ctx.value
        self._pending: dict = {}
        self._cv = threading.Condition()
        self._idle = False
        self._closed = False
        #: Waits released so far (each one ends in an error report of the work after it).
        self.released = 0
        self._thread = threading.Thread(target=self._run, name="deepep_cupy-wait-watchdog", daemon=True)
        self._thread.start()

    def watch(self, key, event: int, address: int, value: int, owner=None) -> None:
        """The wait for ``value`` at ``address`` just queued, and ``event`` recorded after the work it
        gates; replaces ``key``'s earlier entry (a later wait on the same key is queued behind it).
        ``owner``, the object that destroys ``event``, is kept alive while the entry is pending, so the
        event queried is never one already destroyed (its plan dropped meanwhile)."""
        self._pending[key] = _Entry(event, owner, address, value, time.monotonic() + self.timeout_s)
        if self._idle:
            with self._cv:
                self._cv.notify()

    def close(self) -> None:
        """Stop the thread (after releasing nothing more). Pending waits must be over or released first."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        if self._ctx:
            self._cu.cuCtxSetCurrent(self._ctx)
        while True:
            with self._cv:
                self._idle = True
                while not self._pending and not self._closed:
                    self._cv.wait()
                self._idle = False
                if self._closed:
                    return
                delay = min(e.deadline for e in list(self._pending.values())) - time.monotonic()
                if delay > 0:
                    self._cv.wait(delay)
                    continue
            self._check(time.monotonic())

    def _check(self, now: float) -> None:
        for key, entry in list(self._pending.items()):
            if entry.deadline > now:
                continue
            if self._cu.cuEventQuery(entry.event) != _CUDA_ERROR_NOT_READY:
                if self._pending.get(key) is entry:  # not replaced meanwhile
                    self._pending.pop(key, None)
                continue
            self._cu.cuStreamWriteValue32_v2(self._stream, entry.address, entry.value, 0)
            self.released += 1
            entry.deadline = now + self.timeout_s  # re-armed: waits queued behind it are bounded too

"""Streams and events as raw CUDA handles: the caller's current stream, the library's communication
stream, and the events that order them.

Everything here works on ``cudaStream_t`` / ``cudaEvent_t`` integers, so torch callers, CuPy callers and
CUDA-graph capture all see plain ``cudaEventRecord`` / ``cudaStreamWaitEvent`` calls on their own streams
(a capture follows such a fork onto the communication stream and back).
"""

from __future__ import annotations

import sys

__all__ = ["current_stream", "current_stream_ptr", "stream_is_capturing", "external_stream", "stream_ptr",
           "DeviceEvent", "ForkJoin", "OpStreams", "SideStreams", "create_events", "destroy_events"]

_DISABLE_TIMING = 0x2  # cudaEventDisableTiming


def _rt():
    import cupy

    return cupy.cuda.runtime


def stream_is_capturing(stream: int) -> bool:
    """Whether ``stream`` is being captured into a CUDA graph; the legacy default stream (0), which cannot
    be, costs no driver call."""
    return stream != 0 and _rt().streamIsCapturing(stream) != 0


def current_stream_ptr(framework: str | None, device_id: int) -> int:
    """The stream the caller is computing on: torch's current stream for torch callers (or for anyone
    while torch has initialised CUDA), else CuPy's."""
    torch = sys.modules.get("torch")
    if framework == "torch" or (framework is None and torch is not None and torch.cuda.is_initialized()):
        return torch._C._cuda_getCurrentRawStream(device_id)
    import cupy

    return cupy.cuda.get_current_stream(device_id).ptr


class _StreamHandle:
    """A raw ``cudaStream_t`` presented through the CUDA stream protocol (``__cuda_stream__``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = int(ptr)

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def external_stream(ptr: int, device_id: int):
    """A CuPy stream object over the stream handle ``ptr`` of device ``device_id``, not owned by CuPy.

    CuPy 14 deprecates ``ExternalStream`` for ``Stream.from_external``, which takes a stream-protocol
    object and leaves the device unknown (the callers here use it inside ``cupy.cuda.Device(device_id)``);
    CuPy 13 has only ``ExternalStream``."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:
        return cupy.cuda.ExternalStream(int(ptr), int(device_id))
    return from_external(_StreamHandle(ptr))


def stream_ptr(stream) -> int:
    """The raw ``cudaStream_t`` of a CuPy stream (``.ptr``) or a torch stream (``.cuda_stream``)."""
    ptr = getattr(stream, "ptr", None)
    return int(stream.cuda_stream if ptr is None else ptr)


def current_stream(framework: str | None, device_id: int):
    """The caller's current stream as a CuPy stream object (for code that wants one)."""
    return external_stream(current_stream_ptr(framework, device_id), device_id)


def create_events(rt, n: int) -> list[int]:
    """``n`` CUDA events without timing (the fork and join points between streams), made with ``rt``."""
    return [rt.eventCreateWithFlags(_DISABLE_TIMING) for _ in range(n)]


def destroy_events(owner) -> None:
    """Destroy ``owner.events`` (CUDA events made with ``owner._rt``), from a ``__del__``."""
    for event in getattr(owner, "events", ()):
        try:
            owner._rt.eventDestroy(event)
        except Exception:
            pass  # interpreter shutdown


class SideStreams:
    """``count`` non-blocking streams of one device for copy-engine work beside the communication stream,
    made on first use (an engine may live where no op ever needs them)."""

    __slots__ = ("device_id", "count", "_streams")

    def __init__(self, device_id: int, count: int) -> None:
        self.device_id, self.count, self._streams = int(device_id), int(count), None

    def ptr(self, index: int) -> int:
        if self._streams is None:
            import cupy

            with cupy.cuda.Device(self.device_id):
                self._streams = tuple(cupy.cuda.Stream(non_blocking=True) for _ in range(self.count))
        return self._streams[index].ptr

    def close(self) -> None:
        self._streams = None


class DeviceEvent:
    """A CUDA event recorded on ``stream`` (an int handle). ``framework`` decides what "the current
    stream" is when waiting on it without naming one."""

    __slots__ = ("handle", "framework", "device_id")

    def __init__(self, stream: int, framework: str | None, device_id: int) -> None:
        rt = _rt()
        self.handle = rt.eventCreateWithFlags(_DISABLE_TIMING)
        self.framework = framework
        self.device_id = device_id
        rt.eventRecord(self.handle, stream)

    def wait(self, stream: int) -> None:
        _rt().streamWaitEvent(stream, self.handle, 0)

    def wait_on_current_stream(self) -> None:
        self.wait(current_stream_ptr(self.framework, self.device_id))

    def synchronize(self) -> None:
        _rt().eventSynchronize(self.handle)

    def __del__(self) -> None:
        handle, self.handle = getattr(self, "handle", None), None
        if handle:
            try:
                _rt().eventDestroy(handle)
            except Exception:
                pass  # interpreter shutdown


class ForkJoin:
    """The two events a plan forks onto the communication stream and joins back with, made once.

    Re-recording an event is safe: a wait takes the event's state when the wait is queued, so a later call
    recording the same event changes nothing for the waits queued before it. (A creation and a destruction
    per event and call is what they save.)"""

    __slots__ = ("fork", "join")

    def __init__(self) -> None:
        self.fork = self.join = 0  # made at the first call (a plan may be made where there is no GPU)

    def fork_onto(self, comm: int, compute: int) -> None:
        """``comm`` waits for what ``compute`` has queued so far."""
        rt = _rt()
        if not self.fork:
            self.fork = rt.eventCreateWithFlags(_DISABLE_TIMING)
        rt.eventRecord(self.fork, compute)
        rt.streamWaitEvent(comm, self.fork, 0)

    def join_back(self, compute: int, comm: int) -> None:
        """``compute`` waits for what ``comm`` has queued so far."""
        rt = _rt()
        if not self.join:
            self.join = rt.eventCreateWithFlags(_DISABLE_TIMING)
        rt.eventRecord(self.join, comm)
        rt.streamWaitEvent(compute, self.join, 0)

    def mark_join(self, comm: int) -> None:
        """Record the join point: what ``comm`` has queued so far, for a :meth:`wait_join` made later (the
        record and the wait of :meth:`join_back`, apart)."""
        rt = _rt()
        if not self.join:
            self.join = rt.eventCreateWithFlags(_DISABLE_TIMING)
        rt.eventRecord(self.join, comm)

    def wait_join(self, compute: int) -> None:
        """``compute`` waits for the join point :meth:`mark_join` recorded."""
        _rt().streamWaitEvent(compute, self.join, 0)

    def __del__(self) -> None:
        for name in ("fork", "join"):
            handle = getattr(self, name, None)
            if handle:
                try:
                    _rt().eventDestroy(handle)
                except Exception:
                    pass  # interpreter shutdown


class OpStreams:
    """Stream choreography of one op, as DeepEP does it.

    The op runs on the communication stream ``comm`` after ``previous_event`` (or after the caller's
    stream ``compute``); without ``async_finish`` the caller's stream waits for it at :meth:`finish`,
    with it the returned event does (a fresh event: the caller may hold it). ``events`` (a
    :class:`ForkJoin` of the plan) serve the fork and the join that nobody outside the call sees.
    """

    __slots__ = ("comm", "compute", "framework", "device_id", "async_finish", "events")

    def __init__(self, comm: int, compute: int, framework, device_id: int, previous_event, async_finish: bool,
                 events: ForkJoin | None = None):
        self.comm = comm
        self.compute = compute
        self.framework = framework
        self.device_id = device_id
        self.async_finish = async_finish
        self.events = events
        if previous_event is not None and getattr(previous_event, "event", None) is not None:
            previous_event.event.wait(comm)
        elif events is not None:
            events.fork_onto(comm, compute)
        else:
            DeviceEvent(compute, framework, device_id).wait(comm)

    def finish(self) -> DeviceEvent | None:
        if self.async_finish:
            return DeviceEvent(self.comm, self.framework, self.device_id)
        if self.events is not None:
            self.events.join_back(self.compute, self.comm)
        else:
            DeviceEvent(self.comm, self.framework, self.device_id).wait(self.compute)
        return None

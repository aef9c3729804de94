"""Streams and events as raw CUDA handles: the caller's current stream, the library's communication
stream, and the events that order them.

Everything here works on ``cudaStream_t`` / ``cudaEvent_t`` integers, so torch callers, CuPy callers and
CUDA-graph capture all see plain ``cudaEventRecord`` / ``cudaStreamWaitEvent`` calls on their own streams
(a capture follows such a fork onto the communication stream and back).
"""

from __future__ import annotations

import sys

__all__ = ["current_stream", "current_stream_ptr", "external_stream", "DeviceEvent", "OpStreams"]

_DISABLE_TIMING = 0x2  # cudaEventDisableTiming


def _rt():
    import cupy

    return cupy.cuda.runtime


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


def current_stream(framework: str | None, device_id: int):
    """The caller's current stream as a CuPy stream object (for code that wants one)."""
    return external_stream(current_stream_ptr(framework, device_id), device_id)


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


class OpStreams:
    """Stream choreography of one op, as DeepEP does it.

    The op runs on the communication stream ``comm`` after ``previous_event`` (or after the caller's
    stream ``compute``); without ``async_finish`` the caller's stream waits for it at :meth:`finish`,
    with it the returned event does.
    """

    __slots__ = ("comm", "compute", "framework", "device_id", "async_finish")

    def __init__(self, comm: int, compute: int, framework, device_id: int, previous_event, async_finish: bool):
        self.comm = comm
        self.compute = compute
        self.framework = framework
        self.device_id = device_id
        self.async_finish = async_finish
        if previous_event is not None and getattr(previous_event, "event", None) is not None:
            previous_event.event.wait(comm)
        else:
            DeviceEvent(compute, framework, device_id).wait(comm)

    def finish(self) -> DeviceEvent | None:
        done = DeviceEvent(self.comm, self.framework, self.device_id)
        if self.async_finish:
            return done
        done.wait(self.compute)
        return None

"""Events that let callers overlap communication with computation."""

from __future__ import annotations

from .device.gpus import current_device_id, gpu_count
from .device.streams import DeviceEvent, current_stream_ptr

__all__ = ["EventHandle", "EventOverlap"]


class EventHandle:
    """An event recorded on the caller's current stream when it is made (DeepEP's ``deep_ep.utils.EventHandle``).

    The current stream is torch's when torch has initialised CUDA, else CuPy's. Without a GPU there are no
    streams: the event is complete from the start and waiting on it does nothing. Pass it on as
    ``EventOverlap(EventHandle())`` (the ``previous_event`` of an op) or wait on it with ``current_stream_wait()``.
    """

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = None
        if gpu_count() > 0:
            dev = current_device_id()
            self._event = DeviceEvent(current_stream_ptr(None, dev), None, dev)

    def current_stream_wait(self) -> None:
        """Make the caller's current stream wait for the event."""
        if self._event is not None:
            self._event.wait_on_current_stream()

    # The names the ops call on ``previous_event.event`` (shared with the events they record themselves).
    def wait(self, stream: int) -> None:
        """Make the stream with handle ``stream`` wait for the event."""
        if self._event is not None:
            self._event.wait(stream)

    def wait_on_current_stream(self) -> None:
        self.current_stream_wait()

    def synchronize(self) -> None:
        """Block the host until the event has completed."""
        if self._event is not None:
            self._event.synchronize()


class EventOverlap:
    """A captured device event plus the arrays that must stay alive until it completes.

    ``current_stream_wait()`` makes the caller's current stream wait for the event. Used as a context
    manager (``with event: ...``) the body runs and the wait is issued on exit, as DeepEP does.
    ``event`` is ``None`` when the operation finished synchronously (or on the reference backend), and
    then waiting does nothing (DeepEP asserts instead: here an op with ``async_finish`` on the reference
    backend has nothing to wait for, and code written for the GPU waits on it all the same).
    """

    def __init__(self, event=None, extra_tensors=None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            self.event.wait_on_current_stream()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.current_stream_wait()

"""Events that let callers overlap communication with computation."""

from __future__ import annotations

__all__ = ["EventOverlap"]


class EventOverlap:
    """A captured device event plus the arrays that must stay alive until it completes.

    ``current_stream_wait()`` makes the caller's current stream wait for the event. Used as a context
    manager (``with event: ...``) the body runs and the wait is issued on exit, as DeepEP does.
    ``event`` is ``None`` when the operation finished synchronously (or on the reference backend).
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

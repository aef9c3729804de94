"""V2's ``EventOverlap``: V1's event plus a hook that runs at the first wait and whose result the wait returns.

A deferred dispatch or combine (2.5's ``defer_epilogue=True``) returns one of these with the epilogue as its
hook: the results come from ``current_stream_wait()`` / ``wait()``, once (a second wait returns None).
Without a hook a wait returns None, as 2.1's does.
"""

from __future__ import annotations

from ..event import EventHandle
from ..event import EventOverlap as _V1EventOverlap

__all__ = ["EventOverlap", "EventHandle", "as_v1_event"]


class EventOverlap(_V1EventOverlap):
    """An event (``event``, None when the op finished in stream order) and an optional hook run after the wait.

    Attributes:
        event: an ``EventHandle`` or None.
        extra_tensors: arrays kept alive with the event.
        hook_after_wait: the function the first wait runs (None once it ran).
    """

    def __init__(self, event=None, extra_tensors=None) -> None:
        super().__init__(event, extra_tensors)
        self.hook_after_wait = None

    def register_hook_after_wait(self, hook) -> None:
        """Run ``hook`` (no arguments) after the next wait, which returns its result."""
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        if self.hook_after_wait is not None:
            raise ValueError("hook: this event already has a hook registered")
        self.hook_after_wait = hook

    def current_stream_wait(self, release_handle: bool = False):
        """Make the current stream wait for the event, then run the hook; returns the hook's result (or None).

        Arguments:
            release_handle: drop the event after waiting.
        """
        super().current_stream_wait()
        if release_handle:
            self.event = None
        hook, self.hook_after_wait = self.hook_after_wait, None
        return None if hook is None else hook()

    def wait(self, release_handle: bool = False):
        """The same as ``current_stream_wait``."""
        return self.current_stream_wait(release_handle)

    def __call__(self, release_handle: bool = False):
        self._release = bool(release_handle)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.current_stream_wait(getattr(self, "_release", False))


def as_v1_event(previous_event):
    """``previous_event`` as V1's ops take it: an ``EventOverlap`` (V2 passes ``EventHandle``s)."""
    if previous_event is None or isinstance(previous_event, _V1EventOverlap):
        return previous_event
    if isinstance(previous_event, EventHandle):
        return _V1EventOverlap(previous_event)
    raise TypeError(f"previous_event must be an EventHandle (from capture()) or an EventOverlap, "
                    f"got {type(previous_event).__name__}")

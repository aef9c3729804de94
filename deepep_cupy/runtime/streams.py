"""The caller's current stream in its framework, the library's communication stream, and events."""

from __future__ import annotations

import functools
import sys
import warnings

__all__ = ["current_stream", "DeviceEvent", "OpStreams"]


def current_stream(framework: str | None, device_id: int):
    """The stream the caller is computing on, as a CuPy stream object."""
    import cupy

    torch = sys.modules.get("torch")
    if framework == "torch" or (framework is None and torch is not None and torch.cuda.is_initialized()):
        return _external(torch.cuda.current_stream(device_id).cuda_stream, device_id)
    return cupy.cuda.get_current_stream(device_id)


@functools.lru_cache(maxsize=64)
def _external(ptr: int, device_id: int):
    """A CuPy view of a stream another framework owns (cached: one wrapper per stream)."""
    import cupy

    with warnings.catch_warnings():
        # Newer CuPy prefers Stream.from_external(obj), which needs the owner object; the pointer is what we have.
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(ptr, device_id)


class DeviceEvent:
    """A CUDA event recorded on a stream; ``framework`` decides what "current stream" means when waiting."""

    def __init__(self, stream, framework: str | None, device_id: int) -> None:
        import cupy

        self.framework = framework
        self.device_id = device_id
        self.event = cupy.cuda.Event(disable_timing=True)
        self.event.record(stream)

    def wait(self, stream) -> None:
        stream.wait_event(self.event)

    def wait_on_current_stream(self) -> None:
        self.wait(current_stream(self.framework, self.device_id))

    def synchronize(self) -> None:
        self.event.synchronize()


class OpStreams:
    """Stream choreography of one high-throughput op, as DeepEP does it.

    The op runs on the communication stream after ``previous_event`` (or after the caller's stream);
    without ``async_finish`` the caller's stream waits for it, with it the returned event does.
    Outputs are allocated on the caller's stream unless ``allocate_on_comm_stream``.
    """

    def __init__(self, comm_stream, framework, device_id, previous_event, async_finish, allocate_on_comm_stream):
        self.comm = comm_stream
        self.compute = current_stream(framework, device_id)
        self.framework = framework
        self.device_id = device_id
        self.async_finish = async_finish
        self.alloc = comm_stream if allocate_on_comm_stream else self.compute
        self.event = None
        if previous_event is not None and getattr(previous_event, "event", None) is not None:
            previous_event.event.wait(self.comm)
        else:
            DeviceEvent(self.compute, framework, device_id).wait(self.comm)

    def finish(self) -> DeviceEvent | None:
        done = DeviceEvent(self.comm, self.framework, self.device_id)
        if self.async_finish:
            self.event = done
            return done
        done.wait(self.compute)
        return None

"""Error state of the high-throughput engines (intranode, internode), shared by both.

Their kernels record a failure (a timeout, or more received rows than ``num_worst_tokens``) in a
host-mapped :class:`~deepep_cupy.device.kernel_errors.KernelErrorRecord`. The host looks at the record
without a sync at the start of every op and after the dispatch's one wait for counts; the first failure
marks the engine broken, because ranks that gave up on each other are out of step for good.
"""

from __future__ import annotations

from ..errors import DeepEPError

__all__ = ["EngineHealth"]


class EngineHealth:
    """Mixin: ``errors`` (a KernelErrorRecord), ``device_id``; subclasses set the class attributes."""

    #: Name in messages ("intranode", "internode").
    kind = "engine"
    #: Op codes of the kernels -> what was waiting.
    op_names: dict = {}
    #: The op code with which a receiver reports rows beyond ``num_worst_tokens`` (the record's
    #: ``waited_ns`` then holds the row count).
    overflow_op: int | None = None
    broken: str | None = None
    _destroyed = False

    def require_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError(f"this {self.kind} buffer was destroyed")

    def raise_recorded(self) -> None:
        info = self.errors.peek()
        if info is None:
            return
        if info["op"] == self.overflow_op:
            self.errors.reset()
            self.broken = "a dispatch received more tokens than num_worst_tokens"
            raise DeepEPError(f"{self.kind} dispatch: rank {info['rank']} received {info['waited_ns']} tokens, more "
                              "than the num_worst_tokens rows of the outputs; the extra rows were dropped")
        try:
            self.errors.check(self.op_names)
        except DeepEPError as exc:
            self.broken = str(exc)
            raise

    def check_usable(self) -> None:
        self.require_alive()
        self.raise_recorded()
        if self.broken is not None:
            raise DeepEPError(f"the {self.kind} buffer is unusable after an earlier failure ({self.broken}); "
                              "destroy the Buffer and create a new one on every rank")

    def check_errors(self, stream=None) -> None:
        """Synchronise ``stream`` (or the device) and raise any error a kernel recorded."""
        import cupy

        self.require_alive()
        if stream is not None:
            stream.synchronize()
        else:
            cupy.cuda.Device(self.device_id).synchronize()
        self.raise_recorded()

    def meta_buffer(self, size: int, stream):
        """A persistent int32 array of at least ``size`` elements for the notify results.

        Persistent (never returned to the memory pool) so that a dispatch captured in a CUDA graph keeps
        writing to memory nobody else uses; one per size, reused by every dispatch on the engine's stream.
        """
        import cupy

        metas = self.__dict__.setdefault("_metas", {})
        buf = metas.get(size)
        if buf is None:
            with cupy.cuda.Device(self.device_id), stream:  # cleared in the order of the launches that use it
                buf = cupy.zeros(size, dtype=cupy.int32)
            metas[size] = buf
        return buf

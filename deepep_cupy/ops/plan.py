"""Plan keys and what every family's plans share.

A plan is made once per (op, tensor metadata, flags) and then only runs: it holds the kernels, launch
shapes and packed argument blocks, so a call patches pointers and launches. The ``Buffer`` finds a plan
by a key of what the plan depends on: each tensor argument's framework, shape, dtype, contiguity and
device (:func:`deepep_cupy.frameworks.meta`) and the op's flags. A call whose key was seen before skips
every argument check and goes straight to the plan's launch.
"""

from __future__ import annotations

import numpy as np

from ..config import Config
from ..device.streams import ForkJoin, OpStreams, external_stream
from ..frameworks import F32, I32, logical_dtype

__all__ = ["lookup", "store", "config_key", "NOT_A_KEY", "kernel_pointer", "strides", "scale_strides", "scales_dtype", "NormalPlan"]

_MEMCPY_D2H = 2


def lookup(plans: dict, key):
    """The plan for ``key``, or None (also for a key that cannot be hashed: the argument checks of a new
    plan then name the argument that made it so)."""
    try:
        return plans.get(key)
    except TypeError:
        return None


def store(plans: dict, key, plan):
    try:
        plans[key] = plan
    except TypeError:
        pass
    return plan


#: Part of a key that is never stored: an unhashable marker makes the lookup miss and the store skip,
#: so the argument checks of a new plan run (and name the argument) on every such call.
NOT_A_KEY = ["unchecked"]


def config_key(config) -> tuple | list:
    return config.key() if isinstance(config, Config) else NOT_A_KEY


_NULL = np.uint64(0)


def kernel_pointer(arr) -> object:
    """A pointer field's value for a LaunchPlan: the array itself, or a null pointer for None."""
    return _NULL if arr is None else arr


def strides(t) -> tuple[int, ...]:
    """Element strides of a torch tensor or CuPy array."""
    if hasattr(t, "stride") and callable(t.stride):
        return tuple(t.stride())
    return tuple(s // t.itemsize for s in t.strides)


def scale_strides(x_scales, num_tokens: int) -> tuple[int, int, int]:
    """``(num_scales, token stride, block stride)`` in elements, from the array's real strides."""
    shape = tuple(x_scales.shape)
    if len(shape) not in (1, 2):
        raise ValueError(f"x_scales must be 1-D or 2-D, got shape {list(shape)}")
    if shape[0] != num_tokens:
        raise ValueError(f"x_scales has {shape[0]} rows, x has {num_tokens}")
    steps = strides(x_scales)
    if len(shape) == 1:
        return 1, steps[0], 0
    return shape[1], steps[0], steps[1]


def scales_dtype(x_scales):
    """The dtype of FP8 scales as the outputs keep it: float32, or int32 for UE8M0 exponents packed four to
    a word (the kernels move 4-byte scale words whatever they hold)."""
    return I32 if logical_dtype(x_scales) == I32 else F32


class NormalPlan:
    """What the high-throughput plans (intranode and internode) share: engine, frame, streams, and the
    dispatch's one host wait for the notify kernel's counts."""

    def __init__(self, engine, frame, comm_stream: int, async_finish: bool) -> None:
        import cupy

        self.engine, self.frame = engine, frame
        self.comm_stream, self.async_finish = comm_stream, bool(async_finish)
        # 0 while the stream is not being captured; bound once, as the direct and copy modes check every call.
        self._capture_status = cupy.cuda.runtime.streamIsCapturing
        self._fork_join = ForkJoin()

    def _begin(self, previous_event) -> OpStreams:
        engine = self.engine
        if engine.broken is not None or engine.errors.flag_word():
            engine.check_usable()
        frame = self.frame
        return OpStreams(self.comm_stream, frame.stream(), frame.framework, frame.device_id, previous_event,
                         self.async_finish, self._fork_join)

    #: The dispatch plans' own-row copies (ops/own_rows.py ``OwnRowCopies``), where the engine lets them.
    own = None

    def _own_rows(self, handle, num_rows: int):
        """``own.runs`` of ``handle`` when this call's own rows go through device copies: the plan takes
        them, and the stream is not being captured (a graph keeps the kernel's own copies)."""
        if self.own is None or self._capture_status(self.comm_stream):
            return None
        return self.own.runs(handle, num_rows)

    def _own_column(self) -> np.ndarray:
        """This rank's column of the ``is_token_in_rank`` the host wait read back (``_read_notify_meta``)."""
        R = self.engine.num_ranks
        return self.host_in_rank[:self.num_tokens * R].reshape(-1, R)[:, self.engine.rank].copy()

    def _make_notify_meta(self, size: int, in_rank_bytes: int = 0, prefix_shape: tuple | None = None) -> None:
        """Where a dispatch's notify kernel leaves its totals: the engine's persistent device words and a
        pinned host copy of them (and room for ``in_rank_bytes`` of ``is_token_in_rank`` and for a prefix
        array of int32 of ``prefix_shape``, by default the rank prefix matrix's ``(R, R)``)."""
        import cupy

        engine = self.engine
        with cupy.cuda.Device(engine.device_id):
            stream = external_stream(self.comm_stream, engine.device_id)
            self.meta = engine.meta_buffer(size, stream)
            self.host_meta = np.frombuffer(cupy.cuda.alloc_pinned_memory(4 * size), dtype=np.int32, count=size)
            R = engine.num_ranks
            shape = prefix_shape or (R, R)
            n = int(np.prod(shape))
            self.host_rank_prefix = np.frombuffer(cupy.cuda.alloc_pinned_memory(4 * n), dtype=np.int32,
                                                  count=n).reshape(shape)
            n = max(1, in_rank_bytes)
            self.host_in_rank = np.frombuffer(cupy.cuda.alloc_pinned_memory(n), dtype=np.bool_, count=n)

    def _read_notify_meta(self, rank_prefix_ptr: int = 0, in_rank_ptr: int = 0) -> np.ndarray:
        """The one host wait of a dispatch: the notify kernel's totals (and the prefix array at
        ``rank_prefix_ptr`` into ``host_rank_prefix``, ``is_token_in_rank`` at ``in_rank_ptr`` into
        ``host_in_rank``), read into pinned memory."""
        import cupy

        host = self.host_meta
        rt = cupy.cuda.runtime
        rt.memcpyAsync(host.ctypes.data, self.meta.data.ptr, host.nbytes, _MEMCPY_D2H, self.comm_stream)
        if rank_prefix_ptr:
            matrix = self.host_rank_prefix
            rt.memcpyAsync(matrix.ctypes.data, rank_prefix_ptr, matrix.nbytes, _MEMCPY_D2H, self.comm_stream)
        if in_rank_ptr and self.num_tokens:
            rt.memcpyAsync(self.host_in_rank.ctypes.data, in_rank_ptr, self.host_in_rank.nbytes, _MEMCPY_D2H,
                           self.comm_stream)
        rt.streamSynchronize(self.comm_stream)
        self.engine.raise_recorded()
        return host

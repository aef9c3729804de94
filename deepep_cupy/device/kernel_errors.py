"""Host side of ``cuda_src/common/timeout.cuh``: the record a kernel fills when a wait times out or it
finds a bad argument value.

The record is ``kRecordWords`` int32 words (``struct ErrorRecord``): ``flag, op, rank, peer, line, kind,
waited_ns (int64 in words 6-7), blocks_started, blocks_in_grid`` and two spare words. The block counts are
those of a timeout in a kernel that can tell (0 where it cannot): fewer blocks begun than the grid has means
the launch was not wholly resident on the GPU, which the message then says. ``kind`` (:class:`RecordKind`) is
``TIMEOUT`` or ``VALUE_ERROR``, a bad argument value a kernel found (an expert id out of range), with the
offending value in ``waited_ns`` and the op code naming the op and argument
(``deepep_cupy.ops.kernel_names.VALUE_OP_ARGS``); it is raised as ``ValueError``. ``flag``
(:class:`RecordFlag`) is ``EMPTY`` while nothing was recorded, one of the ``WRITING_*`` values while a thread
is writing the record and ``COMPLETE`` once it is. By default it lives in pinned, device-mapped host memory,
so the host reads it without a device synchronisation (kernels write it with system-scope fences).
"""

from __future__ import annotations

import ctypes
import enum
import weakref
from collections.abc import Mapping

import numpy as np

from ..errors import DeepEPError, DeepEPTimeoutError
from ..ops.headers import constant
from ..ops.kernel_names import VALUE_OP_ARGS
from ..settings import env_seconds

__all__ = ["KernelErrorRecord", "RecordFlag", "RecordKind", "RECORD_WORDS", "DEFAULT_TIMEOUT_S", "MAX_TIMEOUT_S",
           "timeout_seconds", "value_error"]

_TIMEOUT_CUH = "common/timeout.cuh"


class RecordFlag(enum.IntEnum):
    """The record's ``flag`` word (word 0): the host reads the other words only when it is ``COMPLETE``."""

    EMPTY = 0
    COMPLETE = 1
    #: A thread won the record and is writing a timeout / a value error into it.
    WRITING_TIMEOUT = constant(_TIMEOUT_CUH, "kFlagWritingTimeout")
    WRITING_VALUE_ERROR = constant(_TIMEOUT_CUH, "kFlagWritingValueError")


class RecordKind(enum.IntEnum):
    """What a complete record reports (word 5, ``reserved`` in the struct)."""

    #: A wait ran past its budget: ``peer`` is whom it waited for, ``waited_ns`` how long.
    TIMEOUT = constant(_TIMEOUT_CUH, "kRecordTimeout")
    #: A bad argument value: ``op`` names the op and argument, ``waited_ns`` holds the value, ``peer`` is -1.
    VALUE_ERROR = constant(_TIMEOUT_CUH, "kRecordValueError")


# As a plain int: NumPy compares its scalars with an IntEnum member through the slow object path (microseconds),
# and every dispatch that waits for its counts reads the flag.
_COMPLETE = int(RecordFlag.COMPLETE)


def value_error(info: dict) -> ValueError:
    """The ``ValueError`` for a bad value a kernel recorded (``info`` as :meth:`KernelErrorRecord.peek`)."""

    op, arg = VALUE_OP_ARGS.get(info["op"], (f"op {info['op']}", "an argument"))
    return ValueError(f"{op}: {arg} held expert id {info['waited_ns']} on rank {info['rank']}, outside "
                      f"[-1, num_experts); the call that passed it treated it as -1 (no expert). Found by "
                      f"the kernel, so reported at this rank's next call")


def _partial_grid(info: dict) -> str:
    """What a timeout's block counts add to its message: nothing where the whole grid had begun (or the
    kernel cannot tell), else that the grid was not wholly resident, the likely cause of the wait."""
    started, grid = info["blocks_started"], info["blocks_in_grid"]
    if not 0 < started < grid:
        return ""
    return (f"; only {started} of the launch's {grid} blocks had begun: the GPU could not hold the whole "
            f"grid at once, so its running blocks waited for work its other blocks hold (another kernel "
            f"running beside it, or another process on a GPU shared under MPS, held the SMs it needed)")


RECORD_WORDS = constant(_TIMEOUT_CUH, "kRecordWords")
DEFAULT_TIMEOUT_S = 100.0
_RECORD_BYTES = RECORD_WORDS * 4


#: Longest budget (about 31 years): the kernels count it in int64 nanoseconds, which this keeps far from overflow.
MAX_TIMEOUT_S = 1e9


def timeout_seconds() -> float:
    """Budget of every wait inside the kernels and on the host: ``$DEEPEP_CUPY_TIMEOUT_S`` seconds (default
    100 when unset or empty). Anything but a finite positive number of at most ``MAX_TIMEOUT_S`` seconds is
    refused: ``inf`` would make host waits unbounded and overflow the kernels' nanosecond counters."""
    return env_seconds("DEEPEP_CUPY_TIMEOUT_S", DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S)


def _free_host(ptr: int) -> None:
    try:
        import cupy

        cupy.cuda.runtime.freeHost(ptr)
    except Exception:
        pass  # interpreter shutdown: the driver frees it with the context


class KernelErrorRecord:
    """One error record to pass to kernels (``record.ptr`` or ``record.array``) and check afterwards.

    Arguments:
        mapped: keep the record in pinned host memory mapped into the device address space (default);
            False puts it in device memory, and :meth:`check` then copies it (synchronising the stream).
    """

    def __init__(self, mapped: bool = True) -> None:
        import cupy

        self._mapped = bool(mapped)
        if self._mapped:
            flags = cupy.cuda.runtime.hostAllocMapped | cupy.cuda.runtime.hostAllocPortable
            host_ptr = cupy.cuda.runtime.hostAlloc(_RECORD_BYTES, flags)
            self._finalizer = weakref.finalize(self, _free_host, host_ptr)
            buf = (ctypes.c_int32 * RECORD_WORDS).from_address(host_ptr)
            self._host = np.frombuffer(buf, dtype=np.int32)
            self._host[:] = 0
            # The flag word as a ctypes scalar: reading it costs a fraction of a microsecond, so every
            # call can look at it (it lives in host memory: no device synchronisation).
            self._flag = ctypes.c_int32.from_address(host_ptr)
            device_ptr = self._device_pointer(host_ptr)
            mem = cupy.cuda.UnownedMemory(device_ptr, _RECORD_BYTES, self)
            self.array = cupy.ndarray(
                (RECORD_WORDS,), dtype=cupy.int32, memptr=cupy.cuda.MemoryPointer(mem, 0)
            )
        else:
            self._host = None
            self._flag = None
            self.array = cupy.zeros(RECORD_WORDS, dtype=cupy.int32)

    def flag_word(self) -> int:
        """The record's flag (:class:`RecordFlag`) as the host sees it now (nonzero: something was, or is being,
        recorded). For a record in device memory this is always ``COMPLETE``, so callers fall through to
        :meth:`check`."""
        return self._flag.value if self._flag is not None else RecordFlag.COMPLETE

    @staticmethod
    def _device_pointer(host_ptr: int) -> int:
        from cuda.bindings import driver

        err, dptr = driver.cuMemHostGetDevicePointer(host_ptr, 0)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise DeepEPError(f"cuMemHostGetDevicePointer failed ({err}) for the kernel error record")
        return int(dptr)

    @property
    def ptr(self) -> int:
        """Device address of the record, for a kernel's ``ErrorRecord*`` argument."""
        return int(self.array.data.ptr)

    def _words(self) -> np.ndarray:
        if self._host is not None:
            return self._host.copy()
        return self.array.get()

    def peek(self) -> dict | None:
        """The recorded timeout as a dict, or None when none is (completely) recorded."""
        words = self._words()
        if words[0] != _COMPLETE:
            return None
        waited = int(words[6:8].view(np.int64)[0])
        return {
            "op": int(words[1]),
            "rank": int(words[2]),
            "peer": int(words[3]),
            "line": int(words[4]),
            "kind": int(words[5]),
            "waited_ns": waited,
            "blocks_started": int(words[8]),
            "blocks_in_grid": int(words[9]),
        }

    def reset(self) -> None:
        """Clear the record (only while no kernel that uses it is running)."""
        if self._host is not None:
            self._host[:] = 0
        else:
            self.array.fill(0)

    def check(self, op_names: Mapping[int, str] | None = None) -> None:
        """Raise DeepEPTimeoutError if a kernel recorded a timeout, and clear the record.

        Call it after the kernels that use the record have finished (e.g. after a stream sync).
        ``op_names`` maps the kernel's op codes to names for the message.
        """
        info = self.peek()
        if info is None:
            return
        self.reset()
        if info["kind"] == RecordKind.VALUE_ERROR:
            raise value_error(info)
        op = (op_names or {}).get(info["op"], f"op {info['op']}")
        ms = info["waited_ns"] / 1e6
        raise DeepEPTimeoutError(
            f"{op}: rank {info['rank']} timed out after {ms:.1f} ms waiting for peer {info['peer']} "
            f"(kernel line {info['line']}){_partial_grid(info)}"
        )

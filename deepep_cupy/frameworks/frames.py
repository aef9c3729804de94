"""The GPU hot path's view of each framework: one frame per (framework, device) pair.

A frame (:class:`TorchFrame`, :class:`CupyFrame`) serves its framework natively: raw pointers, the
caller's current stream, outputs from the framework's own allocator (``torch.empty`` from torch's caching
allocator, so a CUDA graph's memory pool owns what a captured op allocates), and arrays over memory the
library owns; nothing here goes through DLPack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .convert import cupy_holds
from .dtypes import BF16, BOOL, F32, FP8, I32, I64, U8, U16

if TYPE_CHECKING:
    from .small_outputs import SmallOutputs

#: Shapes whose strides a frame keeps (a plan's fixed outputs; the rest are computed per call).
_MAX_CACHED_SHAPES = 256


def contiguous_strides(shape: tuple) -> tuple:
    """Element strides of a C-contiguous array of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


class TorchFrame:
    """torch tensors on one CUDA device (``device``: another torch device that stands in for it, as the CPU does
    in tests without a GPU)."""

    framework = "torch"

    def __init__(self, device_id: int, device=None) -> None:
        import torch

        self.device_id = int(device_id)
        self.device = torch.device("cuda", self.device_id) if device is None else torch.device(device)
        self._empty = torch.empty
        # Outputs with more than one dimension: ``empty_strided`` with strides computed once per shape parses
        # its arguments in about 1.2 us less than ``empty`` (a 3-D shape, torch 2.x).
        self._empty_strided = torch.empty_strided
        self._strides: dict = {}
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU-only builds
        self.dtypes = {BF16: torch.bfloat16, FP8: torch.float8_e4m3fn, I32: torch.int32, I64: torch.int64,
                       F32: torch.float32, BOOL: torch.bool, U8: torch.uint8, U16: torch.bfloat16}
        self._i32 = torch.int32
        # ``ptr(t)``: the tensor's device address, one C call (the method itself, not a wrapper around it).
        self.ptr = torch.Tensor.data_ptr

    def stream(self) -> int:
        """The caller's current stream on this device (a ``cudaStream_t`` as int)."""
        return self._raw_stream(self.device_id)

    def empty(self, shape: tuple, dtype: np.dtype):
        strides = self._strides.get(shape)
        if strides is None:
            strides = contiguous_strides(shape)
            if len(self._strides) < _MAX_CACHED_SHAPES:  # received-row counts vary per call: keep it bounded
                self._strides[shape] = strides
        return self._empty_strided(shape, strides, dtype=self.dtypes[dtype], device=self.device)

    def wrap(self, ptr: int, shape, dtype: np.dtype, owner=None):
        """A tensor over device memory the library owns (``owner`` must outlive it). Built from a
        ``__cuda_array_interface__`` without a stream, so torch adds no synchronisation."""
        import torch

        storage = _STORAGE_TYPESTR[dtype]
        t = torch.as_tensor(_DeviceMemory(ptr, tuple(shape), storage, owner), device=self.device)
        return t.view(self.dtypes[dtype]) if dtype in (BF16, FP8) else t

    def empty_words(self, small: SmallOutputs):
        """The one int32 allocation that holds ``small``'s parts (cut with :meth:`part`)."""
        return self._empty(small.total_words, dtype=self._i32, device=self.device)

    def part(self, words, small: SmallOutputs, i: int):
        """Part ``i`` of ``small`` as a view of ``words`` (one ``as_strided``, and a dtype view for a part
        that is not int32: each costs about what an allocation does, so a call makes only those it hands
        out)."""
        b, shape, strides, offset = small.views[i]
        base = words if b == 0 else words.view(self.dtypes[small.bases[b]])
        return base.as_strided(shape, strides, offset)


class CupyFrame:
    """CuPy arrays on one CUDA device. BF16/FP8 outputs carry ``ml_dtypes`` dtypes when this CuPy can hold
    them, else their same-size integer storage (uint16 / uint8)."""

    framework = "cupy"

    def __init__(self, device_id: int) -> None:
        import cupy

        self.device_id = int(device_id)
        self._cupy = cupy
        self._empty = cupy.empty
        self._get_stream = cupy.cuda.get_current_stream
        self.dtypes = {d: d for d in (I32, I64, F32, BOOL, U8, U16)}
        self.dtypes[BF16] = BF16 if cupy_holds(BF16) else U16
        self.dtypes[FP8] = FP8 if cupy_holds(FP8) else U8

    def stream(self) -> int:
        return self._get_stream(self.device_id).ptr

    def empty(self, shape, dtype: np.dtype):
        return self._empty(shape, dtype=self.dtypes[dtype])

    @staticmethod
    def ptr(t) -> int:
        return t.data.ptr

    def empty_words(self, small: SmallOutputs):
        """The one int32 allocation that holds ``small``'s parts (cut with :meth:`part`)."""
        return self._empty(small.total_words, dtype=I32)

    def part(self, words, small: SmallOutputs, i: int):
        """Part ``i`` of ``small`` as an array over ``words``' memory."""
        b, shape, strides, offset = small.views[i]
        dtype = small.bases[b]
        size = dtype.itemsize
        return self._cupy.ndarray(shape, dtype=dtype, memptr=words.data + offset * size,
                                  strides=tuple(s * size for s in strides))

    def wrap(self, ptr: int, shape, dtype: np.dtype, owner=None):
        """An array over device memory the library owns (``owner`` must outlive it)."""
        cupy = self._cupy
        want = self.dtypes[dtype]
        nbytes = int(np.prod(shape)) * want.itemsize
        mem = cupy.cuda.UnownedMemory(int(ptr), nbytes, owner, self.device_id)
        return cupy.ndarray(tuple(shape), dtype=want, memptr=cupy.cuda.MemoryPointer(mem, 0))


_STORAGE_TYPESTR = {BF16: "<i2", FP8: "|u1", I32: "<i4", I64: "<i8", F32: "<f4", U8: "|u1", U16: "<i2"}


class _DeviceMemory:
    """Just a ``__cuda_array_interface__`` (version 3, no stream) over library-owned memory."""

    def __init__(self, ptr: int, shape, typestr: str, owner) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (int(ptr), False),
                                         "version": 3, "strides": None, "stream": None}


_frames: dict = {}


def frame_for(framework: str, device_id: int):
    """The frame of ``framework`` ('torch' or 'cupy') on ``device_id`` (one per pair)."""
    key = (framework, device_id)
    frame = _frames.get(key)
    if frame is None:
        cls = TorchFrame if framework == "torch" else CupyFrame
        frame = _frames[key] = cls(device_id)
    return frame

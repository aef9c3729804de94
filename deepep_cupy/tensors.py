"""Tensors on the GPU path, per framework: raw pointers, the current stream, output allocation and the
metadata that plan caches are keyed by.

A torch caller is served in torch (``data_ptr()``, torch's current stream, ``torch.empty`` from torch's
caching allocator, so a CUDA graph's memory pool owns what a captured op allocates); a CuPy caller in
CuPy. This module is the one place that knows how each framework does those things; nothing here goes
through DLPack.
"""

from __future__ import annotations

import numpy as np

from .interop import BF16, BOOL, F32, FP8, I32, I64, _cupy_holds

__all__ = ["TorchFrame", "CupyFrame", "SmallOutputs", "frame_for", "meta", "U8", "U16"]

U8, U16 = np.dtype(np.uint8), np.dtype(np.uint16)


class TorchFrame:
    """torch tensors on one CUDA device."""

    framework = "torch"

    def __init__(self, device_id: int) -> None:
        import torch

        self.device_id = int(device_id)
        self.device = torch.device("cuda", self.device_id)
        self._empty = torch.empty
        self._raw_stream = torch._C._cuda_getCurrentRawStream
        self.dtypes = {BF16: torch.bfloat16, FP8: torch.float8_e4m3fn, I32: torch.int32, I64: torch.int64,
                       F32: torch.float32, BOOL: torch.bool, U8: torch.uint8, U16: torch.bfloat16}
        self._i32, self._f32, self._i64 = torch.int32, torch.float32, torch.int64

    def stream(self) -> int:
        """The caller's current stream on this device (a ``cudaStream_t`` as int)."""
        return self._raw_stream(self.device_id)

    def empty(self, shape, dtype: np.dtype):
        return self._empty(shape, dtype=self.dtypes[dtype], device=self.device)

    @staticmethod
    def ptr(t) -> int:
        return t.data_ptr()

    def wrap(self, ptr: int, shape, dtype: np.dtype, owner=None):
        """A tensor over device memory the library owns (``owner`` must outlive it). Built from a
        ``__cuda_array_interface__`` without a stream, so torch adds no synchronisation."""
        import torch

        storage = _STORAGE_TYPESTR[dtype]
        t = torch.as_tensor(_DeviceMemory(ptr, tuple(shape), storage, owner), device=self.device)
        return t.view(self.dtypes[dtype]) if dtype in (BF16, FP8) else t

    @staticmethod
    def transpose_last(t):
        """The view with the last two dimensions swapped (column-major scales)."""
        return t.transpose(-1, -2)

    def empty_many(self, layout: SmallOutputs) -> list:
        """Several small 4- and 8-byte outputs carved from one allocation (one ``torch.empty`` and a view
        each cost less than one ``torch.empty`` each)."""
        words = self._empty((layout.total_words,), dtype=self._i32, device=self.device)
        bases = {I32: words, F32: words.view(self._f32), I64: words.view(self._i64)}
        return [bases[dtype].as_strided(shape, strides, offset) for shape, dtype, strides, offset in layout.parts]


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
        self.dtypes[BF16] = BF16 if _cupy_holds(BF16) else U16
        self.dtypes[FP8] = FP8 if _cupy_holds(FP8) else U8

    def stream(self) -> int:
        return self._get_stream(self.device_id).ptr

    def empty(self, shape, dtype: np.dtype):
        return self._empty(shape, dtype=self.dtypes[dtype])

    @staticmethod
    def ptr(t) -> int:
        return t.data.ptr

    def empty_many(self, layout: SmallOutputs) -> list:
        """Several small outputs (CuPy's slicing costs more than its allocations: one each)."""
        return [self._empty(shape, dtype=self.dtypes[dtype]) for shape, dtype, _, _ in layout.parts]

    def wrap(self, ptr: int, shape, dtype: np.dtype, owner=None):
        """An array over device memory the library owns (``owner`` must outlive it)."""
        cupy = self._cupy
        want = self.dtypes[dtype]
        nbytes = int(np.prod(shape)) * want.itemsize
        mem = cupy.cuda.UnownedMemory(int(ptr), nbytes, owner, self.device_id)
        return cupy.ndarray(tuple(shape), dtype=want, memptr=cupy.cuda.MemoryPointer(mem, 0))

    @staticmethod
    def transpose_last(t):
        axes = list(range(t.ndim))
        axes[-1], axes[-2] = axes[-2], axes[-1]
        return t.transpose(axes)


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


# ------------------------------------------------------------------------------------------ metadata
def _torch_meta(t):
    return ("torch", t.shape, t.dtype, t.is_contiguous(), t.get_device())


class SmallOutputs:
    """Where several small int32 / float32 / int64 outputs sit inside one int32 allocation: per part
    ``(shape, dtype, strides, offset)`` with strides and offset in elements of the part's dtype, every
    part starting on a 64-byte boundary."""

    _ALIGN_WORDS = 16

    def __init__(self, specs) -> None:
        self.parts = []
        words = 0
        for shape, dtype in specs:
            dtype = np.dtype(dtype)
            if dtype not in (I32, F32, I64):
                raise ValueError(f"small outputs hold int32, float32 or int64, not {dtype}")
            shape = tuple(int(d) for d in shape)
            strides, step = [], 1
            for d in reversed(shape):
                strides.append(step)
                step *= max(d, 1)
            per_word = dtype.itemsize // 4
            self.parts.append((shape, dtype, tuple(reversed(strides)), words // per_word))
            words += -(-int(np.prod(shape, dtype=np.int64)) * per_word // self._ALIGN_WORDS) * self._ALIGN_WORDS
        self.total_words = max(words, 1)


def _cupy_meta(t):
    return ("cupy", t.shape, t.dtype, t.flags.c_contiguous, t.data.device_id)


def _numpy_meta(t):
    return ("numpy", t.shape, t.dtype, t.flags.c_contiguous, -1)


_META_BY_TYPE: dict = {np.ndarray: _numpy_meta}


def _register_types() -> None:
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        _META_BY_TYPE.setdefault(torch.Tensor, _torch_meta)
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        _META_BY_TYPE.setdefault(cupy.ndarray, _cupy_meta)


def meta(t):
    """What a plan depends on about a tensor argument: framework, shape, dtype, contiguity, device.

    Cheap (a dictionary lookup on the type and a few attribute reads), hashable, and None for None. An
    object that is no tensor gets an unhashable marker: a key holding it is never cached, so the full
    argument checks run for that call and report the argument by name.
    """
    if t is None:
        return None
    fn = _META_BY_TYPE.get(type(t))
    if fn is None:
        _register_types()
        fn = _META_BY_TYPE.get(type(t))
        if fn is None:
            for cls, candidate in list(_META_BY_TYPE.items()):
                if isinstance(t, cls):
                    fn = candidate
                    break
            else:
                return ["not a tensor"]  # unhashable: such a call is never cached, its checks name it
    return fn(t)

"""Everything framework-specific: torch, CuPy and NumPy arrays.

Two halves. The GPU hot path serves each framework natively (:class:`TorchFrame`, :class:`CupyFrame`):
raw pointers, the caller's current stream, outputs from the framework's own allocator (``torch.empty``
from torch's caching allocator, so a CUDA graph's memory pool owns what a captured op allocates), and
the metadata plan keys are made of (:func:`meta`); nothing there goes through DLPack. The reference
backend computes on NumPy arrays in *logical* dtypes (``ml_dtypes.bfloat16``, ``ml_dtypes.float8_e4m3fn``)
and its results go back in the framework, device and dtype of the caller's ``x``
(:func:`to_numpy`, :func:`from_numpy`); tests use the same conversions to feed GPU runs and read them
back. Detection of an object's framework is by type (:func:`framework_of`), in this module only.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass

import ml_dtypes
import numpy as np

__all__ = [
    "BF16", "FP8", "I32", "I64", "F32", "BOOL", "U8", "U16", "TensorKind", "framework_of", "is_tensor",
    "is_torch_dtype", "is_capturing", "plain_torch", "kind_of", "logical_dtype", "to_numpy", "to_cupy", "from_numpy", "shape_of",
    "copy_into", "to_storage_dtype", "TorchFrame", "CupyFrame", "SmallOutputs", "frame_for", "meta",
]

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
I32, I64, F32, BOOL = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.float32), np.dtype(np.bool_)
# Dtypes some frameworks cannot exchange through DLPack travel as same-size integers.
_STORAGE = {BF16: np.dtype(np.uint16), FP8: np.dtype(np.uint8), np.dtype(np.bool_): np.dtype(np.uint8)}


@dataclass(frozen=True)
class TensorKind:
    """Where an array lives: ``framework`` is 'torch', 'cupy' or 'numpy'; ``device`` a GPU ordinal or None."""

    framework: str
    device: int | None

    @property
    def on_gpu(self) -> bool:
        return self.device is not None


def _torch():
    import torch

    return torch


# ------------------------------------------------------------------------------------------ detection
_FRAMEWORK_BY_TYPE: dict = {np.ndarray: "numpy"}


def _classify(cls) -> str | None:
    # Subclasses count (torch.nn.Parameter, the fake tensors of torch.compile); a framework that was
    # never imported cannot have made the object, so nothing is imported here.
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(cls, torch.Tensor):
        return "torch"
    cupy = sys.modules.get("cupy")
    if cupy is not None and issubclass(cls, cupy.ndarray):
        return "cupy"
    return "numpy" if issubclass(cls, np.ndarray) else None


def framework_of(obj) -> str | None:
    """'torch', 'cupy' or 'numpy' for an array of that framework, None for anything else."""
    cls = type(obj)
    framework = _FRAMEWORK_BY_TYPE.get(cls)
    if framework is None:
        framework = _classify(cls)
        if framework is not None:
            _FRAMEWORK_BY_TYPE[cls] = framework
    return framework


def _is_torch(obj) -> bool:
    return framework_of(obj) == "torch"


def _is_cupy(obj) -> bool:
    return framework_of(obj) == "cupy"


def is_tensor(obj) -> bool:
    return framework_of(obj) is not None


def is_torch_dtype(dtype) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(dtype, torch.dtype)


_NO_CONTEXT = contextlib.nullcontext()


def plain_torch():
    """The context every ``Buffer`` op runs in: torch calls without Python-level torch-function modes.

    A mode such as the one ``torch.set_default_device`` installs (DeepEP's own tests turn it on) sends
    every torch call, tensor attribute reads included, through a Python handler: ~10x the cost of a read
    on the host path, whose torch calls all name their device and dtype anyway. Nothing to do (a shared
    no-op context) when no mode is active.
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch._C._is_torch_function_mode_enabled():
        return torch._C.DisableTorchFunction()
    return _NO_CONTEXT


def is_capturing(obj) -> bool:
    """Whether the caller's current stream (of ``obj``'s framework) is being captured into a CUDA graph."""
    framework = framework_of(obj)
    if framework == "torch":
        import torch

        return bool(obj.is_cuda and torch.cuda.is_current_stream_capturing())
    if framework == "cupy":
        import cupy

        return bool(cupy.cuda.get_current_stream().is_capturing())
    return False


def kind_of(obj) -> TensorKind:
    if isinstance(obj, np.ndarray):
        return TensorKind("numpy", None)
    if _is_torch(obj):
        return TensorKind("torch", obj.device.index if obj.device.type == "cuda" else None)
    if _is_cupy(obj):
        return TensorKind("cupy", obj.device.id)
    raise TypeError(f"expected a torch tensor, CuPy array or NumPy array, got {type(obj).__name__}")


@functools.cache
def _torch_to_numpy_dtypes():
    torch = _torch()
    table = {
        torch.bfloat16: BF16, torch.float8_e4m3fn: FP8, torch.float32: np.dtype(np.float32),
        torch.float16: np.dtype(np.float16), torch.float64: np.dtype(np.float64),
        torch.int64: np.dtype(np.int64), torch.int32: np.dtype(np.int32), torch.int16: np.dtype(np.int16),
        torch.int8: np.dtype(np.int8), torch.uint8: np.dtype(np.uint8), torch.bool: np.dtype(np.bool_),
    }
    return table


@functools.cache
def _numpy_to_torch_dtypes():
    return {v: k for k, v in _torch_to_numpy_dtypes().items()}


def logical_dtype(obj) -> np.dtype:
    """The element type the caller means, as a NumPy dtype (bf16/fp8 through ml_dtypes)."""
    if _is_torch(obj):
        try:
            return _torch_to_numpy_dtypes()[obj.dtype]
        except KeyError:
            raise TypeError(f"unsupported torch dtype {obj.dtype}") from None
    return np.dtype(obj.dtype)


def shape_of(obj) -> tuple[int, ...]:
    return tuple(int(s) for s in obj.shape)


def to_storage_dtype(dtype) -> np.dtype:
    """The dtype a GPU kernel sees for logical ``dtype`` (bf16 -> uint16, fp8 -> uint8)."""
    return _STORAGE.get(np.dtype(dtype), np.dtype(dtype))


_storage = to_storage_dtype


def to_numpy(obj) -> np.ndarray:
    """A NumPy array in the logical dtype; copies from the GPU when needed (used by the reference backend)."""
    if obj is None:
        return None
    dtype = logical_dtype(obj)
    if isinstance(obj, np.ndarray):
        return obj
    if _is_torch(obj):
        t = obj.detach()
        if dtype in _STORAGE:
            t = t.view(_numpy_to_torch_dtypes()[_signed_twin(_storage(dtype))])
        host = t.cpu().numpy()
        return host.view(dtype) if dtype in _STORAGE else host
    return _cupy_get(obj).view(dtype) if np.dtype(obj.dtype) != dtype else _cupy_get(obj)


def _cupy_get(arr) -> np.ndarray:
    return arr.get()


def _signed_twin(dtype: np.dtype) -> np.dtype:
    # torch has no uint16, so 16-bit storage crosses DLPack as int16.
    return np.dtype(np.int16) if dtype == np.uint16 else dtype


def to_cupy(obj):
    """A CuPy view of ``obj`` in its storage dtype, zero-copy for GPU inputs (host inputs are copied)."""
    import cupy

    if obj is None:
        return None
    dtype = logical_dtype(obj)
    storage = _storage(dtype)
    if _is_torch(obj):
        t = obj.detach()
        if t.device.type != "cuda":
            t = t.cuda()
        return _torch_view(t, storage, dtype)
    if isinstance(obj, np.ndarray):
        return _device_view(cupy.asarray(obj.view(storage) if dtype in _STORAGE else obj), dtype)
    return _device_view(obj, dtype)


def _torch_view(t, storage: np.dtype, dtype: np.dtype):
    """A CuPy array over a CUDA tensor's memory (kept alive by the array), without a DLPack round trip."""
    import cupy

    if t.numel() == 0 or not t.is_contiguous():
        if dtype in _STORAGE:
            t = t.view(_numpy_to_torch_dtypes()[_signed_twin(storage)])
        return _device_view(cupy.from_dlpack(t), dtype)
    nbytes = t.numel() * t.element_size()
    mem = cupy.cuda.UnownedMemory(t.data_ptr(), nbytes, t, t.device.index)
    want = np.dtype(np.bool_) if dtype == np.bool_ else storage
    return cupy.ndarray(tuple(t.shape), want, cupy.cuda.MemoryPointer(mem, 0))


def _device_view(arr, dtype: np.dtype):
    # Masks stay bool on the device; bf16/fp8 become their integer storage.
    want = np.dtype(np.bool_) if dtype == np.bool_ else _storage(dtype)
    return arr if arr.dtype == want else arr.view(want)


def _contiguous_perm(arr):
    """A permutation under which ``arr`` is C-contiguous (identity if it already is), or None."""
    if arr.flags.c_contiguous:
        return None, arr
    if arr.ndim >= 2:
        perm = tuple(range(arr.ndim - 2)) + (arr.ndim - 1, arr.ndim - 2)
        if arr.transpose(perm).flags.c_contiguous:
            return perm, arr.transpose(perm)
    return None, np.ascontiguousarray(arr)


def from_numpy(arr: np.ndarray | None, like: TensorKind):
    """Return a NumPy result in the caller's framework and device, keeping transposed layouts."""
    if arr is None:
        return None
    dtype = np.dtype(arr.dtype)
    if like.framework == "numpy":
        return arr
    perm, base = _contiguous_perm(arr)
    if like.framework == "cupy":
        import cupy

        with cupy.cuda.Device(like.device):
            out = _cupy_logical(cupy.asarray(base.view(_storage(dtype))), dtype)
        return out if perm is None else out.transpose(perm)
    torch = _torch()
    t = torch.from_numpy(base.view(_signed_twin(_storage(dtype))))
    if dtype in _STORAGE:
        t = t.view(_numpy_to_torch_dtypes()[dtype])
    if like.device is not None:
        t = t.to(f"cuda:{like.device}")
    return t if perm is None else t.permute(perm)


def copy_into(dst, src: np.ndarray) -> None:
    """Overwrite the caller-framework array ``dst`` with the values of ``src`` (same shape)."""
    kind = kind_of(dst)
    if kind.framework == "numpy":
        if dst is not src:
            dst[...] = src
        return
    fresh = from_numpy(src, kind)
    if kind.framework == "torch":
        dst.copy_(fresh)
    else:
        dst[...] = fresh


@functools.cache
def cupy_holds(dtype: np.dtype) -> bool:
    """Whether this CuPy can allocate arrays of ``dtype`` (bf16 and fp8 through ml_dtypes; a view alone
    may pass where an allocation fails)."""
    import cupy

    try:
        cupy.empty((1,), dtype=dtype)
        return True
    except Exception:
        return False


def _cupy_logical(arr, dtype: np.dtype):
    """View a storage-dtype CuPy array in the logical dtype when this CuPy can hold it."""
    if arr.dtype == dtype:
        return arr
    if dtype == np.bool_:
        return arr.view(np.bool_)
    return arr.view(dtype) if cupy_holds(dtype) else arr


# ---------------------------------------------------------------------------------------------------- GPU hot path
U8, U16 = np.dtype(np.uint8), np.dtype(np.uint16)


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

    def empty_words(self, layout: SmallOutputs):
        """The one int32 allocation that holds ``layout``'s parts (cut with :meth:`part`)."""
        return self._empty(layout.total_words, dtype=self._i32, device=self.device)

    def part(self, words, layout: SmallOutputs, i: int):
        """Part ``i`` of ``layout`` as a view of ``words`` (one ``as_strided``, and a dtype view for a part
        that is not int32: each costs about what an allocation does, so a call makes only those it hands
        out)."""
        b, shape, strides, offset = layout.views[i]
        base = words if b == 0 else words.view(self.dtypes[layout.bases[b]])
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

    def empty_words(self, layout: SmallOutputs):
        """The one int32 allocation that holds ``layout``'s parts (cut with :meth:`part`)."""
        return self._empty(layout.total_words, dtype=I32)

    def part(self, words, layout: SmallOutputs, i: int):
        """Part ``i`` of ``layout`` as an array over ``words``' memory."""
        b, shape, strides, offset = layout.views[i]
        dtype = layout.bases[b]
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


# ------------------------------------------------------------------------------------------ metadata
def _torch_meta(t):
    return ("torch", t.shape, t.dtype, t.is_contiguous(), t.get_device())


class SmallOutputs:
    """Where several small outputs sit inside one int32 allocation: per part ``(shape, dtype, strides,
    offset)`` with strides and offset in elements of the part's dtype (int32, float32, int64 or bool), every
    part starting on a 64-byte boundary. A spec ``(shape, dtype, True)`` asks for its part back with the
    last two dimensions swapped (column-major scales), as one view rather than a view and a transpose.

    ``views``: per part ``(base, shape, strides, offset)`` of the view handed out, ``base`` indexing
    ``bases``, the dtypes the allocation is viewed as (int32 first), so a call makes only the dtype views
    it needs. ``byte_offsets``: where each part starts, for the kernels' pointers (no view needed)."""

    _ALIGN_BYTES = 64

    def __init__(self, specs) -> None:
        self.parts, self.views, self.bases, self.byte_offsets = [], [], [I32], []
        nbytes = 0
        for shape, dtype, *swap in specs:
            dtype = np.dtype(dtype)
            if dtype not in (I32, F32, I64, BOOL):
                raise ValueError(f"small outputs hold int32, float32, int64 or bool, not {dtype}")
            shape = tuple(int(d) for d in shape)
            strides, step = [], 1
            for d in reversed(shape):
                strides.append(step)
                step *= max(d, 1)
            strides = tuple(reversed(strides))
            offset = nbytes // dtype.itemsize
            self.parts.append((shape, dtype, strides, offset))
            self.byte_offsets.append(nbytes)
            if dtype not in self.bases:
                self.bases.append(dtype)
            if swap and swap[0]:
                shape = (*shape[:-2], shape[-1], shape[-2])
                strides = (*strides[:-2], strides[-1], strides[-2])
            self.views.append((self.bases.index(dtype), shape, strides, offset))
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            nbytes += -(-size // self._ALIGN_BYTES) * self._ALIGN_BYTES
        self.total_words = max(nbytes // 4, 1)


def _cupy_meta(t):
    return ("cupy", t.shape, t.dtype, t.flags.c_contiguous, t.data.device_id)


def _numpy_meta(t):
    return ("numpy", t.shape, t.dtype, t.flags.c_contiguous, -1)


_META_BY_FRAMEWORK = {"numpy": _numpy_meta, "torch": _torch_meta, "cupy": _cupy_meta}
_META_BY_TYPE: dict = {np.ndarray: _numpy_meta}


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
        framework = framework_of(t)
        if framework is None:
            return ["not a tensor"]  # unhashable: such a call is never cached, its checks name it
        fn = _META_BY_TYPE[type(t)] = _META_BY_FRAMEWORK[framework]
    return fn(t)

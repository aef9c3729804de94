"""Moving arrays between the caller's framework (torch, CuPy, NumPy) and the NumPy reference backend.

The reference backend computes on NumPy arrays in *logical* dtypes (``ml_dtypes.bfloat16``,
``ml_dtypes.float8_e4m3fn``); its results go back in the framework, device and dtype of the caller's
``x``. Tests use the same conversions to feed GPU runs and read them back. (The GPU backend's hot path
does not come through here: ``deepep_cupy.tensors`` serves each framework natively.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import ml_dtypes
import numpy as np

__all__ = [
    "BF16", "FP8", "I32", "I64", "F32", "BOOL", "TensorKind", "kind_of", "logical_dtype", "to_numpy", "to_cupy", "from_numpy",
    "shape_of", "is_tensor", "copy_into", "to_storage_dtype",
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


def _is_torch(obj) -> bool:
    mod = type(obj).__module__
    return mod.startswith("torch") and hasattr(obj, "dtype") and hasattr(obj, "device")


def _is_cupy(obj) -> bool:
    return type(obj).__module__.startswith("cupy") and hasattr(obj, "data") and hasattr(obj, "dtype")


def is_tensor(obj) -> bool:
    return isinstance(obj, np.ndarray) or _is_torch(obj) or _is_cupy(obj)


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
def _cupy_holds(dtype: np.dtype) -> bool:
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
    return arr.view(dtype) if _cupy_holds(dtype) else arr

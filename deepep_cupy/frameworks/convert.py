"""Conversions between the caller's arrays and NumPy, for the reference backend and the tests.

The reference backend computes on NumPy arrays in *logical* dtypes (``ml_dtypes.bfloat16``,
``ml_dtypes.float8_e4m3fn``) and its results go back in the framework, device and dtype of the caller's
``x`` (:func:`to_numpy`, :func:`from_numpy`); tests use the same conversions to feed GPU runs and read them
back (:func:`to_cupy`). On the GPU, bf16 and fp8 travel in their same-size integer storage.
"""

from __future__ import annotations

import functools

import numpy as np

from .dtypes import (
    _STORAGE,
    TensorKind,
    _is_torch,
    _numpy_to_torch_dtypes,
    _torch,
    kind_of,
    logical_dtype,
    to_storage_dtype,
)

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

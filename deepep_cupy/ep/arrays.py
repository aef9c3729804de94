"""The array operations the V2 layer needs, in the caller's framework (NumPy, CuPy or torch).

The V2 layer reorders and reduces what V1's ``Buffer`` returns with these operations only, on the arrays'
own device and stream: nothing here copies to the host or waits for the device, so a call stays free of
CPU syncs on the GPU. NumPy and CuPy share one implementation (CuPy mirrors NumPy's API); torch has its
own. BF16 arithmetic goes through float32 with round-to-nearest-even back, as the GPU does.
"""

from __future__ import annotations

import numpy as np

from ..frameworks import BF16, F32, I32, I64, cupy_holds, framework_of

__all__ = ["ops_for"]


class _NumpyLike:
    """NumPy and CuPy (``xp`` is the module)."""

    def __init__(self, xp, framework: str) -> None:
        self.xp = xp
        self.framework = framework

    def zeros(self, shape, dtype, like):
        return self.xp.zeros(shape, dtype=self._dtype(dtype, like))

    def empty(self, shape, dtype, like):
        return self.xp.empty(shape, dtype=self._dtype(dtype, like))

    def full(self, shape, value, dtype, like):
        return self.xp.full(shape, value, dtype=self._dtype(dtype, like))

    def arange(self, n: int, like):
        return self.xp.arange(n, dtype=np.int64)

    def _dtype(self, dtype, like):
        # None and BF16: the dtype of ``like`` (CuPy may hold bf16 only as uint16 storage).
        return like.dtype if dtype is None or dtype == BF16 else np.dtype(dtype)

    def astype(self, a, dtype):
        return a.astype(dtype)

    def cumsum(self, a, axis: int):
        return self.xp.cumsum(a, axis=axis, dtype=np.int64)

    def sum(self, a, axis: int):
        return a.sum(axis=axis, dtype=np.int64)

    def amax(self, a, axis: int):
        return a.max(axis=axis)

    def where(self, cond, a, b):
        return self.xp.where(cond, a, b)

    def take_along(self, a, idx, axis: int):
        return self.xp.take_along_axis(a, idx, axis=axis)

    def searchsorted_right(self, sorted_values, values):
        return self.xp.searchsorted(sorted_values.astype(np.int64), values, side="right")

    def concat(self, parts, axis: int):
        return self.xp.concatenate(parts, axis=axis)

    def any(self, a, axis: int):
        return self.xp.any(a, axis=axis)

    def bits_as(self, a, dtype):
        """``a``'s bytes as ``dtype`` (BF16 or int32), the last dimension rescaled; BF16 as its uint16
        storage where this CuPy holds no bf16."""
        want = np.dtype(dtype)
        if want == BF16 and self.framework == "cupy" and not cupy_holds(BF16):
            want = np.dtype(np.uint16)
        return a.view(want)

    def copy(self, a):
        return a.copy()

    def contiguous(self, a):
        return self.xp.ascontiguousarray(a)

    def take_rows(self, a, idx):
        return a[idx]

    def zero_rows(self, a, mask):
        self.xp.copyto(a, 0, casting="unsafe", where=mask.reshape((-1,) + (1,) * (a.ndim - 1)))
        return a

    def to_f32(self, a):
        if a.dtype == BF16:
            return a.astype(np.float32)
        bits = a.view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32)

    def to_bf16(self, a, like):
        if like.dtype == BF16 and self.framework == "numpy":
            return a.astype(BF16)  # ml_dtypes rounds to nearest even
        bits = a.view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
        return rounded.astype(np.uint16).view(like.dtype)


class _Torch:
    framework = "torch"

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.dtypes = {I32: torch.int32, I64: torch.int64, F32: torch.float32, np.dtype(np.bool_): torch.bool}

    def _dtype(self, dtype, like):
        return like.dtype if dtype is None or dtype == BF16 else self.dtypes[np.dtype(dtype)]

    def zeros(self, shape, dtype, like):
        return self.torch.zeros(shape, dtype=self._dtype(dtype, like), device=like.device)

    def empty(self, shape, dtype, like):
        return self.torch.empty(shape, dtype=self._dtype(dtype, like), device=like.device)

    def full(self, shape, value, dtype, like):
        return self.torch.full(shape, value, dtype=self._dtype(dtype, like), device=like.device)

    def arange(self, n: int, like):
        return self.torch.arange(n, dtype=self.torch.int64, device=like.device)

    def astype(self, a, dtype):
        return a.to(self.dtypes[np.dtype(dtype)])

    def cumsum(self, a, axis: int):
        return self.torch.cumsum(a, dim=axis, dtype=self.torch.int64)

    def sum(self, a, axis: int):
        return a.sum(dim=axis, dtype=self.torch.int64)

    def amax(self, a, axis: int):
        return self.torch.amax(a, dim=axis)

    def where(self, cond, a, b):
        return self.torch.where(cond, a, b)

    def take_along(self, a, idx, axis: int):
        return self.torch.take_along_dim(a, idx, dim=axis)

    def searchsorted_right(self, sorted_values, values):
        return self.torch.searchsorted(sorted_values.to(self.torch.int64).contiguous(), values, right=True)

    def concat(self, parts, axis: int):
        return self.torch.cat(parts, dim=axis)

    def any(self, a, axis: int):
        return a.any(dim=axis)

    def bits_as(self, a, dtype):
        return a.view(self.torch.bfloat16 if np.dtype(dtype) == BF16 else self.dtypes[np.dtype(dtype)])

    def copy(self, a):
        return a.clone()

    def contiguous(self, a):
        return a.contiguous()

    def take_rows(self, a, idx):
        if a.element_size() == 1:  # FP8 rows: gathered as bytes
            return a.view(self.torch.uint8).index_select(0, idx).view(a.dtype)
        return a.index_select(0, idx)

    def zero_rows(self, a, mask):
        if a.numel():
            a.reshape(a.shape[0], -1).view(self.torch.uint8).masked_fill_(mask[:, None], 0)  # zero bits: +0.0
        return a

    def to_f32(self, a):
        return a.float()

    def to_bf16(self, a, like):
        return a.to(like.dtype)  # round to nearest even


_OPS: dict = {}


def ops_for(obj):
    """The operations of ``obj``'s framework."""
    framework = framework_of(obj)
    ops = _OPS.get(framework)
    if ops is None:
        if framework == "torch":
            ops = _Torch()
        elif framework == "cupy":
            import cupy

            ops = _NumpyLike(cupy, "cupy")
        elif framework == "numpy":
            ops = _NumpyLike(np, "numpy")
        else:
            raise TypeError(f"expected a torch tensor, CuPy array or NumPy array, got {type(obj).__name__}")
        _OPS[framework] = ops
    return ops

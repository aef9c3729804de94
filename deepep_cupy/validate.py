"""Argument checks shared by every backend: each raises TypeError/ValueError naming the argument."""

from __future__ import annotations

import functools
import os

import numpy as np

from .interop import BF16, FP8, is_tensor, logical_dtype, shape_of

__all__ = [
    "tensor", "optional_tensor", "handle", "positive_int", "nonneg_int", "topk_values", "values_enabled",
]


def values_enabled() -> bool:
    """Whether to check index *values* (costs a device reduction and a sync on the GPU path).

    On by default; ``DEEPEP_CUPY_VALIDATE=0`` turns it off for production and benchmarks.
    """
    return os.environ.get("DEEPEP_CUPY_VALIDATE", "1") != "0"


def _dtype_name(dtype) -> str:
    d = np.dtype(dtype)
    return {BF16: "bfloat16", FP8: "float8_e4m3fn"}.get(d, d.name)


def tensor(name: str, obj, *, dtype=None, shape=None, ndim=None, contiguous=True):
    """Check one array argument. ``shape`` may hold None for any extent. Returns its shape."""
    if obj is None:
        raise ValueError(f"{name} is required")
    if not is_tensor(obj):
        raise TypeError(f"{name} must be a torch tensor, CuPy array or NumPy array, got {type(obj).__name__}")
    got = logical_dtype(obj)
    if dtype is not None:
        allowed = dtype if isinstance(dtype, (tuple, list)) else (dtype,)
        if got not in [np.dtype(d) for d in allowed]:
            want = " or ".join(_dtype_name(d) for d in allowed)
            raise TypeError(f"{name} must have dtype {want}, got {_dtype_name(got)}")
    s = shape_of(obj)
    if ndim is not None and len(s) != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {list(s)}")
    if shape is not None:
        if len(s) != len(shape) or any(w is not None and w != g for w, g in zip(shape, s, strict=True)):
            want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(s)}")
    if contiguous and not _is_contiguous(obj):
        raise ValueError(f"{name} must be contiguous")
    return s


def optional_tensor(name: str, obj, **kw):
    return None if obj is None else tensor(name, obj, **kw)


def _is_contiguous(obj) -> bool:
    if hasattr(obj, "is_contiguous"):
        return bool(obj.is_contiguous())
    return bool(obj.flags.c_contiguous)


def handle(value, length: int, source: str) -> None:
    """A handle must be the tuple an earlier call returned (``length`` elements)."""
    if not isinstance(value, (tuple, list)) or len(value) != length:
        raise ValueError(f"handle must be the {length}-tuple returned by {source}")


def positive_int(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def nonneg_int(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def topk_values(name: str, topk_idx, num_experts: int, bound: str = "num_experts") -> None:
    """Every entry must be -1 or a valid expert id; ``bound`` names where ``num_experts`` came from.

    On the GPU this costs one reduction and a wait for it; it is skipped while a CUDA graph is being
    captured (nothing may wait then) and when ``DEEPEP_CUPY_VALIDATE=0``.
    """
    if not values_enabled() or shape_of(topk_idx)[0] == 0:
        return
    if isinstance(topk_idx, np.ndarray):
        bad = int(np.count_nonzero((topk_idx < -1) | (topk_idx >= num_experts)))
    elif hasattr(topk_idx, "aminmax"):  # torch
        import torch

        if topk_idx.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        bad = int(((topk_idx < -1) | (topk_idx >= num_experts)).sum().item())
    else:
        import cupy

        if cupy.cuda.get_current_stream().is_capturing():
            return
        bad = int(_count_out_of_range()(topk_idx, np.int64(num_experts)))
    if bad:
        raise ValueError(f"{name} holds {bad} expert ids outside [-1, {num_experts}) ({num_experts} = {bound})")


@functools.cache
def _count_out_of_range():
    import cupy

    # One pass over the ids, one scalar back: the cheapest device-side range check.
    return cupy.ReductionKernel("T x, T e", "int64 y", "(x < -1 || x >= e) ? 1 : 0", "a + b", "y = a", "0",
                                "deepep_count_out_of_range")

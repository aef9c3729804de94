"""The dtypes the library names, and which framework an array belongs to.

Dtypes are NumPy dtypes, bf16 and fp8 through ``ml_dtypes``. Detection of an object's framework is by type
(:func:`framework_of`), here only: nothing is imported to do it, since a framework that was never imported
cannot have made the object.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
I32, I64, F32, BOOL = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.float32), np.dtype(np.bool_)
U8, U16 = np.dtype(np.uint8), np.dtype(np.uint16)
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

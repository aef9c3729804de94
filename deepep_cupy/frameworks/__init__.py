"""Everything framework-specific: torch, CuPy and NumPy arrays.

Two halves. The GPU hot path serves each framework natively (:class:`TorchFrame`, :class:`CupyFrame`, in
:mod:`.frames`): raw pointers, the caller's current stream, outputs from the framework's own allocator, and
the metadata plan keys are made of (:func:`meta`, in :mod:`.plan_keys`); nothing there goes through DLPack.
The reference backend computes on NumPy arrays in *logical* dtypes and its results go back in the framework,
device and dtype of the caller's ``x`` (:mod:`.convert`); tests use the same conversions to feed GPU runs and
read them back. The dtypes, and detection of an object's framework by type, are in :mod:`.dtypes`, the one
place that detection happens; :class:`SmallOutputs` (several small outputs in one allocation) in
:mod:`.small_outputs`.

This package re-exports the public names of those modules.
"""

from __future__ import annotations

from .convert import copy_into, cupy_holds, from_numpy, to_cupy, to_numpy
from .dtypes import (
    BF16,
    BOOL,
    F32,
    FP8,
    I32,
    I64,
    U8,
    U16,
    TensorKind,
    framework_of,
    is_capturing,
    is_tensor,
    is_torch_dtype,
    kind_of,
    logical_dtype,
    plain_torch,
    shape_of,
    to_storage_dtype,
)
from .frames import CupyFrame, TorchFrame, contiguous_strides, frame_for
from .plan_keys import meta
from .small_outputs import SmallOutputs

__all__ = [
    "BF16", "FP8", "I32", "I64", "F32", "BOOL", "U8", "U16", "TensorKind", "framework_of", "is_tensor",
    "is_torch_dtype", "is_capturing", "plain_torch", "kind_of", "logical_dtype", "to_numpy", "to_cupy", "from_numpy", "shape_of",
    "copy_into", "to_storage_dtype", "TorchFrame", "CupyFrame", "SmallOutputs", "frame_for", "meta",
    "cupy_holds", "contiguous_strides",
]

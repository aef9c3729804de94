"""Several small outputs of one op carved from one int32 allocation (:class:`SmallOutputs`): one allocation
per call instead of one per output; the frames (:mod:`.frames`) allocate it and cut the parts."""

from __future__ import annotations

import numpy as np

from .dtypes import BOOL, F32, I32, I64


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

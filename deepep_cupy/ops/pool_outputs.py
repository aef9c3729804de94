"""A dispatch's outputs in the output pool (``device/output_pool.py``), where peers write received rows in
place: the intranode direct mode (``cuda_src/intranode/dispatch_direct.cuh``) and the internode forwarders'
rows in place (``cuda_src/internode/dispatch_forward.cuh``).
"""

from __future__ import annotations

import numpy as np

from ..device.output_pool import ALIGN, outputs_refused

__all__ = ["PoolOutputs"]


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class PoolOutputs:
    """The outputs of one dispatch plan in ``pool``, wrapped by ``frame``. ``parts(num_rows)`` gives each
    output's ``(shape, dtype)`` (None for one the call does not make); ``groups`` says which outputs share a
    pool block (row data and scales in one, the small outputs a handle keeps in another, so that a handle
    does not hold the rows' memory)."""

    def __init__(self, pool, frame, parts, groups: tuple[tuple[int, ...], ...]) -> None:
        self.pool, self.frame, self.parts, self.groups = pool, frame, parts, groups
        self.bases_ptr = pool.bases.data.ptr  # every rank's pool as mapped here, for the kernels
        self._blocks: dict = {}

    def blocks(self, num_rows: int) -> list:
        """Per pool block: ``(bytes, [(output index, byte offset, shape, dtype), ...])``. Kept per row count (a
        cached plan has one), so a call only allocates and wraps."""
        blocks = self._blocks.get(num_rows)
        if blocks is None:
            parts = self.parts(num_rows)
            blocks = []
            for group in self.groups:
                placed, total = [], 0
                for i in group:
                    if parts[i] is not None:
                        placed.append((i, total, *parts[i]))
                        total += _align(int(np.prod(parts[i][0])) * parts[i][1].itemsize)
                if placed:
                    blocks.append((total, placed))
            if len(self._blocks) >= 64:  # a dispatch without handle sees a new row count per call
                self._blocks.clear()
            self._blocks[num_rows] = blocks
        return blocks

    def allocate(self, num_rows: int, capturing: bool) -> list | None:
        """The outputs in the pool, or None when it cannot hold them now, the caller's stream is being
        captured (a graph keeps writing its outputs on every replay: those come from the framework's
        allocator, as a graph's memory pool expects), or the call is one of torch.compile's ops
        (:func:`~deepep_cupy.device.output_pool.outputs_refused`)."""
        if capturing or outputs_refused():
            return None
        out: list = [None] * sum(len(g) for g in self.groups)
        wrap, alloc = self.frame.wrap, self.pool.alloc
        for total, placed in self.blocks(num_rows):
            block = alloc(total)
            if block is None:
                return None
            for i, offset, shape, dtype in placed:
                out[i] = wrap(block.ptr + offset, shape, dtype, owner=block)
        return out

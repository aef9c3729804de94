"""Output pool: device memory mapped into every rank, from which the intranode dispatch allocates its
outputs so that peers write received rows straight into them (direct mode, see
``cuda_src/intranode/dispatch_direct.cuh``).

Each rank allocates from its own pool only; peers learn where a call's outputs are from the kernel
itself, so allocating and freeing need no communication. A block is owned by the tensors made over it and
goes back to the pool when the last of them is freed, like memory of the framework's caching allocator:
the next op that reuses it runs on the communication stream after the caller's stream (every op waits
for it, or for the ``previous_event`` the caller gives), so work the caller queued on the block before
freeing it is done before anything writes into it again.

When the pool cannot hold a call's outputs the dispatch falls back to the ring mode with ordinary
allocations; the results are the same.
"""

from __future__ import annotations

import bisect
import os
import sys
import threading

from .vmm import PeerMappedBuffer

__all__ = ["OutputPool", "PoolBlock", "default_pool_bytes", "framework_outputs", "outputs_refused"]

ALIGN = 256
_ENV = "DEEPEP_CUPY_OUTPUT_POOL_BYTES"
DEFAULT_BYTES = 1 << 30
# On by default up to the rank count where the direct mode has been measured faster than the ring mode
# (docs/design/intranode.md has the figures); above it the ring mode stays the default until measured.
MAX_DEFAULT_RANKS = 4
#: The staging area of the combine's copy mode takes this fraction of the pool (1 GiB: 256 MiB, which holds
#: 18724 rows of 7168 bf16 from one peer).
STAGING_FRACTION = 4


_refusals = threading.local()


class framework_outputs:  # noqa: N801 - used like a function: ``with framework_outputs(): ...``
    """Within it (on this thread) ops allocate their outputs with the caller's framework, never in the
    output pool. torch.compile's ops run in it: CUDA-graph trees run a compiled function's warm-up calls
    with torch allocating into the graph's memory pool and require its outputs to live there."""

    def __enter__(self):
        _refusals.depth = getattr(_refusals, "depth", 0) + 1
        return self

    def __exit__(self, *exc) -> None:
        _refusals.depth -= 1


def outputs_refused() -> bool:
    """Whether this thread is inside :class:`framework_outputs`."""
    return getattr(_refusals, "depth", 0) > 0


def default_pool_bytes(num_ranks: int = 2) -> int:
    """``$DEEPEP_CUPY_OUTPUT_POOL_BYTES`` (0 turns the direct mode off). Unset: 1 GiB per rank up to
    ``MAX_DEFAULT_RANKS`` ranks, where the direct mode has been run on GPUs, else 0 (set the variable to
    use it with more ranks)."""
    raw = os.environ.get(_ENV, "").strip()
    if not raw:
        return DEFAULT_BYTES if num_ranks <= MAX_DEFAULT_RANKS else 0
    try:
        value = int(float(raw))
    except ValueError:
        raise ValueError(f"{_ENV} must be a number of bytes, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{_ENV} must be >= 0, got {value}")
    return value


class PoolBlock:
    """``nbytes`` at ``offset`` of a pool; freed when this object is."""

    __slots__ = ("pool", "offset", "nbytes", "ptr")

    def __init__(self, pool: Allocator, offset: int, nbytes: int, ptr: int) -> None:
        self.pool, self.offset, self.nbytes, self.ptr = pool, offset, nbytes, ptr

    def __del__(self) -> None:
        pool = self.pool
        if pool is not None:
            self.pool = None
            pool.release(self.offset, self.nbytes)


class Allocator:
    """First-fit allocation of ``ALIGN``-aligned ranges of ``[0, size)``, with coalescing frees (thread safe:
    blocks are freed by the garbage collector, in any thread)."""

    def __init__(self, size: int, base_ptr: int = 0) -> None:
        self.size, self.base_ptr = int(size), int(base_ptr)
        self._starts: list[int] = [0] if size > 0 else []
        self._ends: list[int] = [self.size] if size > 0 else []
        self._lock = threading.Lock()
        self.in_use = 0

    def alloc(self, nbytes: int) -> PoolBlock | None:
        """A block of at least ``nbytes`` (one ``ALIGN`` unit for 0), or None when no free range fits."""
        need = max(ALIGN, (int(nbytes) + ALIGN - 1) // ALIGN * ALIGN)
        with self._lock:
            for i, (start, end) in enumerate(zip(self._starts, self._ends, strict=True)):
                if end - start >= need:
                    if end - start == need:
                        del self._starts[i], self._ends[i]
                    else:
                        self._starts[i] = start + need
                    self.in_use += need
                    return PoolBlock(self, start, need, self.base_ptr + start)
        return None

    def release(self, offset: int, nbytes: int) -> None:
        with self._lock:
            end = offset + nbytes
            i = bisect.bisect_left(self._starts, offset)
            merge_prev = i > 0 and self._ends[i - 1] == offset
            merge_next = i < len(self._starts) and self._starts[i] == end
            if merge_prev and merge_next:
                self._ends[i - 1] = self._ends[i]
                del self._starts[i], self._ends[i]
            elif merge_prev:
                self._ends[i - 1] = end
            elif merge_next:
                self._starts[i] = offset
            else:
                self._starts.insert(i, offset)
                self._ends.insert(i, end)
            self.in_use -= nbytes
            last = self.in_use == 0
        if last:
            self._on_empty()

    def _on_empty(self) -> None:
        """Called (outside the lock) when the last block is freed."""

    def free_ranges(self) -> list[tuple[int, int]]:
        with self._lock:
            return list(zip(self._starts, self._ends, strict=True))


class OutputPool(Allocator):
    """The pool of one rank: ``size`` bytes per rank mapped into every rank (collective to create).

    The last ``size // STAGING_FRACTION`` bytes are not allocated from: they are the staging area of the
    combine's copy mode (``staging_ptrs[r]``: rank r's, as mapped here; deepep_cupy/ops/intranode/copy.py).
    """

    def __init__(self, group, device_id: int, size: int, *, use_fabric: bool = False, staging: bool = True) -> None:
        import cupy
        import numpy as np

        self.buffer = PeerMappedBuffer(group, device_id, size, use_fabric=use_fabric)
        self._closing = False
        # The internode pool has no copy-mode combine, so no staging area (``staging`` False).
        self.staging_bytes = self.buffer.size // STAGING_FRACTION // ALIGN * ALIGN if staging else 0
        staging_offset = self.buffer.size - self.staging_bytes
        self.staging_ptrs = [int(p) + staging_offset for p in self.buffer.peer_ptrs]
        super().__init__(staging_offset, self.buffer.local_ptr)
        try:
            with cupy.cuda.Device(device_id):
                # Every rank's pool as mapped here, for the kernels.
                self.bases = cupy.asarray(np.asarray(self.buffer.peer_ptrs, dtype=np.int64))
        except BaseException:
            self.buffer.close()
            raise

    def close(self) -> None:
        """Unmap the pool once no tensor holds a block of it any more (now, if none does): outputs stay
        valid after the Buffer is destroyed, as ordinary allocations would. The caller has synchronised the
        device, so no kernel writes into the pool any more."""
        self._closing = True
        self.bases = None
        if self.in_use == 0:
            self._unmap()

    def _on_empty(self) -> None:
        if self._closing:
            self._unmap()

    def _unmap(self) -> None:
        buffer, self.buffer = self.buffer, None
        # At interpreter exit the process's mappings go with it (and the driver bindings may be gone).
        if buffer is not None and not sys.is_finalizing():
            buffer.close()

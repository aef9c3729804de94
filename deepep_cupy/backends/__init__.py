"""The two backends of ``Buffer``: CUDA kernels (:mod:`.cuda`) and the NumPy reference (:mod:`.reference`).

Both implement :class:`.base.Backend`; ``Buffer.runtime`` is one of them (the name DeepEP gives the
object behind its ``Buffer``). Each is imported only when chosen, so a machine without CuPy never
imports the CUDA one.
"""

from __future__ import annotations

from .base import Backend

__all__ = ["Backend", "make_backend"]


def make_backend(kind: str, group, **options) -> Backend:
    """The backend ``kind`` ('cuda' or 'reference') over ``group``; collective. ``options`` are the
    Buffer's settings; each backend takes those it uses."""
    if kind == "reference":
        from .reference import ReferenceBackend

        return ReferenceBackend(group, **options)
    from .cuda import CudaBackend

    return CudaBackend(group, **options)

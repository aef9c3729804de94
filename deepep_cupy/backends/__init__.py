"""The two backends of ``Buffer``: CUDA kernels (:mod:`.cuda`) and the NumPy reference (:mod:`.reference`).

Both implement :class:`.base.Backend`; ``Buffer.runtime`` is one of them (the name DeepEP gives the
object behind its ``Buffer``). Each is imported only when chosen, so a machine without CuPy never
imports the CUDA one.
"""

from __future__ import annotations

import importlib.util
import os

from ..device.gpus import GPU_INSTALL, gpu_count
from .base import Backend

__all__ = ["Backend", "choose_backend", "make_backend"]


def make_backend(kind: str, group, **options) -> Backend:
    """The backend ``kind`` ('cuda' or 'reference') over ``group``; collective. ``options`` are the
    Buffer's settings; each backend takes those it uses."""
    if kind == "reference":
        from .reference import ReferenceBackend

        return ReferenceBackend(group, **options)
    from .cuda import CudaBackend

    return CudaBackend(group, **options)


def choose_backend(requested: str | None) -> str:
    """'cuda' or 'reference': ``requested``, else ``$DEEPEP_CUPY_BACKEND``, else the GPU when one is visible."""
    choice = (requested or os.environ.get("DEEPEP_CUPY_BACKEND", "auto")).lower()
    if choice not in ("auto", "cuda", "reference"):
        raise ValueError(f"backend must be 'auto', 'cuda' or 'reference', got {choice!r}")
    if choice == "auto":
        choice = "cuda" if gpu_count() > 0 else "reference"
    elif choice == "cuda" and gpu_count() == 0:
        raise RuntimeError("backend='cuda' was requested but no CUDA GPU is visible")
    if choice == "cuda" and importlib.util.find_spec("cupy") is None:
        # A GPU without the CUDA extra: say so here rather than fail on CuPy's import inside the backend.
        raise ImportError(f"a CUDA GPU is visible but CuPy is not installed: {GPU_INSTALL}; or run on the NumPy "
                          "reference backend with backend='reference' (or DEEPEP_CUPY_BACKEND=reference)")
    return choice

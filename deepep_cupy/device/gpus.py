"""Finding the GPU a rank uses, without creating a CUDA context at import time."""

from __future__ import annotations

import functools
import os
import sys

__all__ = ["gpu_count", "no_gpu_reason", "current_device_id", "compute_capability"]


@functools.cache
def gpu_count() -> int:
    """Number of CUDA devices visible to this process; 0 without a driver or GPU (never raises)."""
    if os.environ.get("DEEPEP_CUPY_FORCE_NO_GPU") == "1":
        return 0
    try:
        from cuda.bindings import driver
    except Exception:
        return 0
    try:
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return 0
        err, count = driver.cuDeviceGetCount()
        return int(count) if err == driver.CUresult.CUDA_SUCCESS else 0
    except Exception:
        return 0


def no_gpu_reason() -> str | None:
    """Why GPU work cannot run here (no CuPy, no driver, no device), or None when it can."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy is not installed (pip install deepep_cupy[cuda13], or [cuda12])"
    return None if gpu_count() > 0 else "no CUDA driver or device found"


def current_device_id() -> int:
    """The caller's current device: torch's when torch has initialised CUDA, else CuPy's."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    import cupy

    return int(cupy.cuda.runtime.getDevice())


def compute_capability(device_id: int) -> tuple[int, int]:
    from cuda.bindings import driver

    attr = driver.CUdevice_attribute
    major = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device_id)[1]
    minor = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device_id)[1]
    return int(major), int(minor)

"""Finding the GPU a rank uses, without creating a CUDA context at import time."""

from __future__ import annotations

import functools
import os
import sys

__all__ = ["gpu_count", "no_gpu_reason", "no_gpu_message", "GPU_INSTALL", "current_device_id",
           "compute_capability"]


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


#: What a GPU run needs installed besides the driver: CuPy and the CUDA libraries, in one extra.
GPU_INSTALL = 'pip install "deepep_cupy[cuda13]" (or "deepep_cupy[cuda12]" for a CUDA 12 driver)'


def _cupy_devices() -> tuple[int | None, str]:
    """``(devices CuPy sees, why none)``; ``(None, ...)`` without CuPy."""
    try:
        import cupy
    except ImportError:
        return None, "CuPy is not installed"
    try:
        return int(cupy.cuda.runtime.getDeviceCount()), "CuPy sees no GPU"
    except Exception as exc:  # no device, a driver older than CuPy's CUDA runtime, a runtime that does not load
        first = (str(exc).strip().splitlines() or ["no message"])[0]  # the caller prints one line
        return 0, f"CuPy cannot use the GPU ({type(exc).__name__}: {first})"


def no_gpu_reason() -> str | None:
    """Why GPU work cannot run here, or None when it can.

    The GPU is looked for first, through the driver API (no CuPy needed), so that a machine without one is
    told "no GPU found" whether CuPy is installed or not; then CuPy must be there and see the devices.
    """
    if gpu_count() == 0:  # no driver (libcuda), no device, or DEEPEP_CUPY_FORCE_NO_GPU=1
        return "no GPU found"
    devices, why = _cupy_devices()
    return None if devices else why


def no_gpu_message(needs: str) -> str | None:
    """One line for a command that needs a GPU (``needs``: "the benchmarks need"), or None when there is one."""
    reason = no_gpu_reason()
    return None if reason is None else f"{reason}; {needs} a CUDA GPU and CuPy: {GPU_INSTALL}"


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

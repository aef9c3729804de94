"""What the multi-rank GPU tests share: the MPI world, dtypes, the skip marks, array conversion and bit views.

Imported by the test files next to it (pytest puts this folder on ``sys.path``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from deepep_cupy.device.gpus import gpu_count

BF16, FP8 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)


def _comm():
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD


COMM = _comm()
#: The marks of a test that needs GPUs and at least two MPI ranks.
MULTI_RANK_GPU = [
    pytest.mark.gpu,
    pytest.mark.mpi,
    pytest.mark.skipif(gpu_count() == 0, reason="needs CUDA GPUs"),
    pytest.mark.skipif(COMM is None or COMM.Get_size() < 2, reason="needs >= 2 MPI ranks (mpirun -np 2)"),
]


def to_dev(arr, fw, env):
    """A NumPy array as a ``fw`` ("torch" or "cupy") array on the test's device; None stays None."""
    from deepep_cupy.frameworks import TensorKind, from_numpy

    return None if arr is None else from_numpy(arr, TensorKind(fw, env["dev"]))


def to_np(obj):
    from deepep_cupy.frameworks import to_numpy

    return None if obj is None else np.asarray(to_numpy(obj))


def bits(a):
    """Bit view for exact comparisons of BF16 and FP8 arrays."""
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return a.view(np.uint16)
    if a.dtype == FP8:
        return a.view(np.uint8)
    return a


def bf16(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(BF16)

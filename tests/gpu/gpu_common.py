"""What every multi-rank GPU test shares: the MPI world, dtypes, skip marks, the frameworks under test, array
conversion and bit views, the collective checks, and the pieces of the ``env`` fixture (conftest.py).

Imported by the test files and helper modules next to it (pytest puts this folder on ``sys.path``). Every
helper that runs a kernel, a Buffer or the reference is collective: all ranks call it in the same order.
"""

from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np
import pytest

from deepep_cupy.device.gpus import gpu_count

BF16, FP8 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)
#: The kernels' wait budget (``DEEPEP_CUPY_TIMEOUT_S``) in the modules whose ``env`` sets one: a protocol
#: bug shows up as an error instead of a hang.
TEST_TIMEOUT_S = "30"
#: Buffer sizes of the reference-backend oracles (checked against, never allocated).
ORACLE_BYTES = 1 << 40


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


def torch_cuda() -> bool:
    """Whether torch is installed and has CUDA."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def frameworks(*dtypes) -> list[str]:
    """The frameworks a test runs in, torch first: torch where it has CUDA, CuPy where it can hold arrays of
    every dtype in ``dtypes``. The normal-mode tests pass none (a case CuPy cannot hold skips on its own);
    the low-latency ones pass BF16, which every case of theirs needs."""
    fws = ["torch"] if torch_cuda() else []
    if dtypes:
        try:
            from deepep_cupy.frameworks import cupy_holds

            if not all(cupy_holds(np.dtype(dt)) for dt in dtypes):
                return fws
        except ImportError:  # no CuPy at all: the tests skip without GPUs, or run in torch
            return fws
    return [*fws, "cupy"]


# ------------------------------------------------------------------------------------------- arrays
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


def sync():
    """Wait for this rank's GPU work, CuPy's and (where it is in use) torch's."""
    import cupy

    cupy.cuda.Device().synchronize()
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    except ImportError:
        pass


# ------------------------------------------------------------------------------------------- collective checks
def check(failures: list[str], what: str, fn) -> None:
    """``fn()``, an AssertionError recorded in ``failures`` instead of raised (so the ranks stay in step)."""
    try:
        fn()
    except AssertionError as exc:
        failures.append(f"{what}: {str(exc)[:800]}")


def agree(failures: list[str]) -> None:
    """Collective check: every rank raises if any rank collected a failure."""
    everything = COMM.allgather(failures)
    bad = [f"rank {r}: {msg}" for r, msgs in enumerate(everything) for msg in msgs]
    if bad:
        pytest.fail("\n".join(bad[:20]))


def together(fn, what: str = ""):
    """Run ``fn()`` on every rank and return its result; if it raised on any rank, fail the test on every
    rank (an allgather, so call it where no rank can be inside another collective). ``what`` names the
    call in the failure."""
    result, errors = None, []
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - reported on every rank by agree
        errors.append(f"{what + ': ' if what else ''}{type(exc).__name__}: {str(exc)[:800]}")
    agree(errors)
    return result


# ------------------------------------------------------------------------------------------- env and Buffers
def bind_rank() -> dict:
    """This rank's GPU bound (CuPy's and, where torch has CUDA, torch's): the start of every ``env``."""
    import cupy

    import deepep_cupy

    rank, size = COMM.Get_rank(), COMM.Get_size()
    dev = rank % gpu_count()
    cupy.cuda.Device(dev).use()
    if torch_cuda():
        import torch

        torch.cuda.set_device(dev)
    return {"rank": rank, "size": size, "dev": dev, "deepep_cupy": deepep_cupy}


def ranks_share_a_gpu(dev: int) -> bool:
    """Whether some GPU serves more than one rank of the MPI world (several ranks on one device, as under
    MPS), where NCCL refuses to run ("Duplicate GPU detected"); collective. GPUs are told apart as NCCL
    tells them apart, by host and PCI bus id, all-gathered over MPI."""
    import socket

    import cupy

    seen = COMM.allgather((socket.gethostname(), cupy.cuda.runtime.deviceGetPCIBusId(dev)))
    return len(set(seen)) < len(seen)


def device_group_backend(dev: int) -> str:
    """The torch.distributed backend of a group whose collectives run on the GPUs: "nccl", or "gloo" where
    ranks share a GPU (ranks_share_a_gpu; collective)."""
    return "gloo" if ranks_share_a_gpu(dev) else "nccl"


@contextlib.contextmanager
def collective_buffer(**kwargs):
    """A ``deepep_cupy.Buffer(comm=COMM, explicitly_destroy=True, **kwargs)``, destroyed at the end once every
    rank's GPU work is done and every rank is there."""
    import deepep_cupy

    buf = deepep_cupy.Buffer(comm=COMM, explicitly_destroy=True, **kwargs)
    try:
        yield buf
    finally:
        sync()
        COMM.Barrier()
        buf.destroy()


@contextlib.contextmanager
def with_wait_budget(state):
    """``ENV`` of a module whose tests make their own Buffers: the kernels' wait budget at the suite's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPEP_CUPY_TIMEOUT_S", TEST_TIMEOUT_S)
        yield


@contextlib.contextmanager
def with_reference_buffer(state):
    """``ENV`` of a module that uses only the public API: the kernels' wait budget at the suite's, and as the
    oracle ``state["ref"]``, a Buffer with backend='reference' (NumPy in, NumPy out; collective over the same
    MPI world). The module's GPU Buffers come from the ``ll`` and ``nvl`` fixtures."""
    # The reference backend allocates nothing by these sizes: they only need to pass the refusals it makes
    # from them (the GPU path's), which the module's own GPU Buffers pass with their real sizes.
    with with_wait_budget(state), collective_buffer(low_latency_mode=True, backend="reference",
                                                    num_nvl_bytes=ORACLE_BYTES, num_rdma_bytes=ORACLE_BYTES) as ref:
        state["ref"] = ref
        yield

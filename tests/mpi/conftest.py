"""Fixtures shared by the MPI tests (run under mpiexec)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def short_timeout(request, monkeypatch):
    """A module that defines ``TIMEOUT`` runs its tests with ``DEEPEP_CUPY_TIMEOUT_S`` at that value, and its
    ranks start the next test together (a barrier on the caller's communicator, not the library's)."""
    timeout = getattr(request.module, "TIMEOUT", None)
    if timeout is None:
        yield
        return
    monkeypatch.setenv("DEEPEP_CUPY_TIMEOUT_S", str(timeout))
    yield
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()

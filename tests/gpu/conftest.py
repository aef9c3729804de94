"""Fixtures of the multi-rank GPU tests (run under mpirun: each rank is a pytest session of its own).

``env`` (one per test module) is the dict a module's tests work in: this rank's ``rank``, the world's
``size``, the bound device ``dev`` and the ``deepep_cupy`` package, plus what the module's ``ENV`` adds.
``ENV`` is a context manager factory called with that dict; it adds the module's objects (its Buffer as
``buf``, its oracle as ``ref``, ...) and tears them down when the module is done, after every rank's GPU
work is finished and every rank is there:

  * ``gpu_common.with_reference_buffer``: a reference-backend Buffer as the oracle (public API only);
  * ``ll_common.with_low_latency_buffer``: a low-latency Buffer and the NumPy reference backend;
  * ``gpu_common.with_wait_budget``: nothing, for tests that make their own Buffers;
  * a module's own (the normal-mode modules: their Buffer with its kernels' budget, and the reference).

``ll`` and ``nvl`` are the GPU Buffers of the modules that use only the public API, sized by the module's
``LL_SHAPES`` and ``NVL_HIDDEN``. Test files import what else they need from gpu_common.py (everything),
ll_common.py (low latency), normal_common.py (intranode and internode) and graph_common.py (torch graphs).
"""

from __future__ import annotations

import pytest
from gpu_common import COMM, bind_rank, collective_buffer, sync


@pytest.fixture(scope="module")
def env(request):
    """The module's state: see above."""
    setup = getattr(request.module, "ENV", None)
    if setup is None:
        pytest.fail(f"{request.module.__name__} uses the env fixture but sets no ENV", pytrace=False)
    state = bind_rank()
    with setup(state):
        try:
            yield state
        finally:
            sync()
            COMM.Barrier()


@pytest.fixture(scope="module")
def ll(env, request):
    """A low-latency Buffer sized for every ``(T, hidden, experts)`` in the module's ``LL_SHAPES``
    (Buffer.get_low_latency_rdma_size_hint)."""
    # Imported here, not when this file loads: ll_common probes CuPy on the current device as it loads, which
    # a module that does not use it (test_intranode.py, ...) must not do before env binds this rank's GPU.
    from ll_common import hint

    shapes = request.module.LL_SHAPES
    with collective_buffer(num_rdma_bytes=max(hint(*s) for s in shapes), low_latency_mode=True) as buf:
        yield buf


@pytest.fixture(scope="module")
def nvl(env, request):
    """``(buffer, dispatch config, combine config)``: an intranode Buffer sized by
    Config.get_nvl_buffer_size_hint for BF16 rows of the module's ``NVL_HIDDEN`` under the recommended
    dispatch and combine configs."""
    deepep_cupy, size = env["deepep_cupy"], env["size"]
    dcfg, ccfg = deepep_cupy.Buffer.get_dispatch_config(size), deepep_cupy.Buffer.get_combine_config(size)
    num_bytes = max(c.get_nvl_buffer_size_hint(request.module.NVL_HIDDEN * 2, size) for c in (dcfg, ccfg))
    with collective_buffer(num_nvl_bytes=num_bytes) as buf:
        yield buf, dcfg, ccfg

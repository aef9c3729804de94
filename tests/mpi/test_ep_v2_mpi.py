"""DeepEP V2's test calls (2.1's ``tests/elastic/test_ep.py``, 2.5's ``tests/ep/test_ep.py``, in their order)
across real processes: ``mpiexec -n 2|4 python -m pytest tests/mpi/test_ep_v2_mpi.py -q``.

``ElasticBuffer`` and ``EPBuffer`` on the reference backend, made with ``comm=COMM`` (NumPy arrays) and, where
torch is installed, on a torch.distributed gloo group (torch CPU tensors). Each rank has its own inputs and
token count (``T - rank``). A subset of V2's modes covers both layouts, the cached handle, FP8 inputs, biases,
events, ``do_cpu_sync=False``, ``allow_multiple_reduction=False`` and 2.5's deferred epilogues. Expectations come
from the NumPy statement of V2's semantics in ``tests/helpers/ep_v2_ref.py``; the calls and checks are those of
``tests/helpers/ep_v2_calls.py``. A rank records a failed check and goes on with its calls; the ranks agree at
the end of each test, so every rank fails when one does and none is left waiting.
"""

from types import SimpleNamespace

import pytest

MPI = pytest.importorskip("mpi4py.MPI")
COMM = MPI.COMM_WORLD
pytestmark = pytest.mark.skipif(COMM.Get_size() < 2, reason="run under mpiexec with at least 2 ranks")
#: Seconds a rank waits for the others (a rank whose call raises leaves them waiting at the next exchange).
TIMEOUT = 30

import ep_v2_calls as C  # noqa: E402

import deepep_cupy  # noqa: E402

T, H, K = 12, 256, 4
E = 4 * COMM.Get_size()
MODES_21 = list(C.modes("2.1"))
DEFERRED_25 = list(C.modes("2.5", defer=True))
PLAIN_25 = list(C.modes("2.5", defer=False))


@pytest.fixture(scope="module")
def torch_group():
    pytest.importorskip("torch")
    import torch.distributed as dist

    from deepep_cupy.device.torch_dist import init_torch_distributed

    init_torch_distributed(COMM, "gloo")
    return dist.group.WORLD


@pytest.fixture(params=["comm", "torch"])
def api(request):
    """``(buffer arguments, array conversion)``: ``comm=COMM`` with NumPy arrays, or a gloo group with torch
    CPU tensors."""
    if request.param == "comm":
        return {"comm": COMM}, C.numpy
    return {"group": request.getfixturevalue("torch_group")}, C.t


def _run(api, cls, modes, *, version, seed, defer=False, do_cpu_sync=True, **buffer_kw):
    """Every mode's calls on one buffer of ``cls``, each mode checked on this rank; then the ranks agree."""
    where, to = api
    g = SimpleNamespace(rank=COMM.Get_rank(), size=COMM.Get_size())
    buffer = cls(**where, num_max_tokens_per_rank=T, hidden=H, explicitly_destroy=True,
                 prefer_overlap_with_compute=False, backend="reference", **buffer_kw)
    assert (buffer.rank_idx, buffer.num_ranks) == (g.rank, g.size)
    failures = []
    try:
        for i, mode in enumerate(modes):
            calls = C.make_calls(buffer, g, mode, seed=seed + i, num_tokens=T, hidden=H, num_experts=E, num_topk=K,
                                 version=version, defer=defer, do_cpu_sync=do_cpu_sync, to=to)
            try:
                C.check_calls(calls)
            except AssertionError as exc:
                failures.append(f"mode {mode}: {C.describe(exc)}"[:600])
    finally:
        buffer.destroy()
    bad = [f"rank {r}: {msg}" for r, msgs in enumerate(COMM.allgather(failures)) for msg in msgs]
    assert not bad, "\n".join(bad[:10])


def test_elastic_buffer_modes(api):
    """2.1's modes: do_handle_copy both ways, alignment 128 and 1, FP8 and BF16, 0-2 biases, every event
    triple (a stride prime to the loops' sizes, so each of them varies)."""
    modes = MODES_21[::11]
    assert {m[0] for m in modes} == {0, 1} and {m[2] for m in modes} == {0, 1} and {m[3] for m in modes} == {0, 1, 2}
    _run(api, deepep_cupy.ElasticBuffer, modes, version="2.1", seed=0)


def test_elastic_buffer_without_cpu_sync(api):
    """``do_cpu_sync=False``: outputs at their bounds, the valid extent from the handle's prefix sums."""
    _run(api, deepep_cupy.ElasticBuffer, MODES_21[3::19], version="2.1", seed=100, do_cpu_sync=False)


def test_elastic_buffer_without_multiple_reduction(api):
    """The expanded combine adds each (token, expert) row on its own."""
    _run(api, deepep_cupy.ElasticBuffer, MODES_21[5::23], version="2.1", seed=200, allow_multiple_reduction=False)


@pytest.mark.parametrize("do_cpu_sync", [True, False])
def test_ep_buffer_deferred(api, do_cpu_sync):
    """2.5's default enumeration: every call asynchronous with its epilogue deferred to the wait."""
    _run(api, deepep_cupy.EPBuffer, DEFERRED_25[::5] if do_cpu_sync else DEFERRED_25[2::7], version="2.5",
         seed=300 + do_cpu_sync, defer=True, do_cpu_sync=do_cpu_sync)


def test_ep_buffer_without_deferral(api):
    _run(api, deepep_cupy.EPBuffer, PLAIN_25[1::7], version="2.5", seed=400)


# Across NVLink domains (V1's internode path): 2 ranks a domain where the ranks divide evenly into several
# domains of 2, else one rank a domain; hybrid mode (V2's default) adds the combine's per-domain level.
NVL = 2 if COMM.Get_size() >= 4 and COMM.Get_size() % 2 == 0 else 1


@pytest.mark.parametrize("hybrid", [True, False])
def test_elastic_buffer_across_domains(api, hybrid):
    _run(api, deepep_cupy.ElasticBuffer, MODES_21[7::17], version="2.1", seed=500 + hybrid, num_nvl_ranks=NVL,
         allow_hybrid_mode=hybrid)


@pytest.mark.parametrize("hybrid", [True, False])
def test_across_domains_without_cpu_sync_or_multiple_reduction(api, hybrid):
    _run(api, deepep_cupy.ElasticBuffer, MODES_21[9::29], version="2.1", seed=600 + hybrid, do_cpu_sync=False,
         num_nvl_ranks=NVL, allow_hybrid_mode=hybrid)
    _run(api, deepep_cupy.ElasticBuffer, MODES_21[4::31], version="2.1", seed=700 + hybrid, num_nvl_ranks=NVL,
         allow_hybrid_mode=hybrid, allow_multiple_reduction=False)


def test_ep_buffer_across_domains_deferred(api):
    _run(api, deepep_cupy.EPBuffer, DEFERRED_25[1::9], version="2.5", seed=800, defer=True, num_nvl_ranks=NVL)

"""Megatron-Core's calls (``fw_megatron.py``) on thread ranks with torch CPU tensors, through ``import deep_ep``.

The same scenarios run under mpiexec on gloo groups (tests/mpi/test_frameworks_mpi.py) and on GPUs
(tests/gpu/test_frameworks.py).
"""

import pytest

torch = pytest.importorskip("torch")

import fw_megatron as M  # noqa: E402
from fw_common import deep_ep_alias  # noqa: E402
from thread_group import run_ranks  # noqa: E402


@pytest.fixture
def deep_ep():
    with deep_ep_alias() as module:
        yield module


def test_megatron_imports(deep_ep):
    from deep_ep import Buffer
    from deep_ep.utils import EventHandle, EventOverlap

    assert Buffer is deep_ep.Buffer and callable(EventHandle) and callable(EventOverlap)
    with pytest.raises(ImportError):
        from deep_ep import HybridEPBuffer  # noqa: F401


@pytest.mark.parametrize("size", [2, 4])
def test_megatron_get_buffer_reuse(deep_ep, size):
    run_ranks(size, lambda g: M.get_buffer_reuse(deep_ep, g))


@pytest.mark.parametrize("size,async_finish,skip_last_rank", [(2, False, False), (4, True, True), (4, False, False)])
def test_megatron_forward_backward(deep_ep, size, async_finish, skip_last_rank):
    run_ranks(size, lambda g: M.train_step(deep_ep, g, seed=size * 10 + async_finish, async_finish=async_finish,
                                           skip_last_rank=skip_last_rank))


@pytest.mark.parametrize("size", [2, 4])
def test_megatron_interleaved_micro_batches(deep_ep, size):
    run_ranks(size, lambda g: M.interleaved_micro_batches(deep_ep, g, seed=size + 100))

"""Megatron-Core's, SGLang's and vLLM's calls across real processes, on torch gloo process groups:
``mpiexec -n 2|4 python -m pytest tests/mpi -q``.

The scenarios are those of tests/unit/test_frameworks_*.py (``fw_megatron.py``, ``fw_serving.py``), with
``deep_ep`` imported through the alias and the Buffer built on a torch.distributed group as the frameworks
build it: the default group for Megatron-Core and SGLang, a separate gloo group like vLLM's CPU group.
"""


import pytest

MPI = pytest.importorskip("mpi4py.MPI")
pytest.importorskip("torch")
COMM = MPI.COMM_WORLD
pytestmark = pytest.mark.skipif(COMM.Get_size() < 2, reason="run under mpiexec with at least 2 ranks")
#: Seconds a rank waits for the others (a rank whose check fails mid-scenario leaves them waiting).
TIMEOUT = 30

import fw_megatron as M  # noqa: E402
import fw_serving as S  # noqa: E402
from fw_common import deep_ep_alias  # noqa: E402

H_NORMAL, H_LL, K, T = 256, 512, 4, 32
E = 4 * COMM.Get_size()


@pytest.fixture(scope="module")
def groups():
    import torch.distributed as dist

    from deepep_cupy.device.torch_dist import init_torch_distributed

    init_torch_distributed(COMM, "gloo")
    return dist.group.WORLD, dist.new_group(backend="gloo")


@pytest.fixture(scope="module")
def deep_ep():
    with deep_ep_alias() as module:
        yield module


def _inputs(group, seed, hidden, **kw):
    return S.Inputs(group, seed, hidden=hidden, num_experts=E, topk=K, **kw)


@pytest.mark.parametrize("async_finish", [False, True])
def test_megatron_forward_backward(deep_ep, groups, async_finish):
    mb = M.train_step(deep_ep, groups[0], seed=7 + async_finish, num_experts=E, async_finish=async_finish,
                      skip_last_rank=async_finish)
    assert mb.cache.buffer.group is groups[0]


def test_megatron_interleaved_micro_batches(deep_ep, groups):
    M.interleaved_micro_batches(deep_ep, groups[0], seed=11, num_experts=E)


@pytest.mark.parametrize("fp8", [False, True])
def test_sglang_normal(deep_ep, groups, fp8):
    buffer = S.sglang_buffer(deep_ep, groups[0], S.NORMAL, hidden=H_NORMAL, num_experts=E, param_bytes=1 if fp8 else 2)
    for seed in (1, 2):
        S.sglang_normal_round(deep_ep, buffer, _inputs(groups[0], seed, H_NORMAL), "cpu", fp8=fp8,
                              column_major=fp8, alignment=128 if fp8 else 1)


@pytest.mark.parametrize("hook,fp8,round_scale,use_ue8m0", [(True, False, False, False), (False, True, True, True)])
def test_sglang_auto_mode(deep_ep, groups, hook, fp8, round_scale, use_ue8m0):
    buffer = S.sglang_buffer(deep_ep, groups[0], S.AUTO, hidden=H_LL, num_experts=E, num_max_dispatch_tokens_per_rank=T)
    for seed in (1, 2):
        S.sglang_normal_round(deep_ep, buffer, _inputs(groups[0], seed, H_LL), "cpu")
        buffer.clean_low_latency_buffer(T, H_LL, E)
        S.sglang_low_latency_round(deep_ep, buffer, _inputs(groups[0], seed + 5, H_LL), "cpu",
                                   num_max_dispatch_tokens_per_rank=T, hook=hook, fp8=fp8, round_scale=round_scale,
                                   use_ue8m0=use_ue8m0, zero_copy=not hook)
    S.sglang_two_batch_overlap(deep_ep, buffer, _inputs(groups[0], 3, H_LL), _inputs(groups[0], 4, H_LL), "cpu",
                               num_max_dispatch_tokens_per_rank=T)


@pytest.mark.parametrize("do_async,dbo,fp8", [(True, False, False), (False, True, True)])
def test_vllm_high_throughput(deep_ep, groups, do_async, dbo, fp8):
    buffer = S.vllm_ht_buffer(deep_ep, groups[1])
    for seed, skip in ((1, ()), (2, range(E - E // COMM.Get_size(), E))):
        S.vllm_ht_round(deep_ep, buffer, _inputs(groups[1], seed, H_NORMAL, skip_experts=skip), "cpu",
                        do_async=do_async, dbo=dbo, fp8=fp8)
    buffer.destroy()


@pytest.mark.parametrize("fp8,do_async", [(False, True), (True, False)])
def test_vllm_low_latency(deep_ep, groups, fp8, do_async):
    buffer = S.vllm_ll_buffer(deep_ep, groups[1], hidden=H_LL, num_experts=E, max_tokens=T, enable_shrink=True)
    S.vllm_fault_tolerance_calls(buffer, "cpu")
    for seed in (1, 2):
        S.vllm_ll_round(deep_ep, buffer, _inputs(groups[1], seed, H_LL), "cpu", max_tokens=T, fp8=fp8,
                        do_async=do_async, seed=seed)
    buffer.destroy()

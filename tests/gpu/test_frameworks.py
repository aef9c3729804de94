"""Megatron-Core's, SGLang's and vLLM's calls (tests/unit/fw_megatron.py, fw_serving.py) on CUDA tensors,
through ``import deep_ep``: each scenario checks itself against the dense oracle, and its results are compared
with the same scenario on the reference backend (CPU tensors, same ranks and groups). GPU-only additions:
Megatron's calls on a side stream (its overlapped-communication stream), and SGLang's / vLLM's decode step
(low-latency dispatch, receive, experts, combine, receive) captured in a ``torch.cuda.graph`` after one
eager call and replayed on new inputs, with a normal round and ``clean_low_latency_buffer`` run eagerly
between replays as SGLang's AUTO mode does. High-throughput ops are never captured (no framework does).

Run on every rank:  mpirun -np 2 python -m pytest tests/gpu/test_frameworks.py -q
Skips without a GPU, with fewer than 2 ranks, when torch has no CUDA; low-latency cases also without
nvshmem4py. Groups are built as the frameworks build them: NCCL for Megatron-Core and SGLang, gloo for vLLM;
where ranks share a GPU (several ranks on one device, as under MPS), which NCCL refuses, Megatron-Core's and
SGLang's group is a gloo group too (the library's collectives over a group are object collectives, which
both backends carry).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
from gpu_common import (
    COMM,
    MULTI_RANK_GPU,
    TEST_TIMEOUT_S,
    bind_rank,
    bits,
    device_group_backend,
    sync,
    together,
)
from ll_common import NEEDS_NVSHMEM

torch = pytest.importorskip("torch")
pytestmark = [*MULTI_RANK_GPU, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with CUDA")]

import fw_megatron as M  # noqa: E402
import fw_serving as S  # noqa: E402
from fw_common import (  # noqa: E402
    bf16, close, deep_ep_alias, num_tokens, partial_factors, tensor, to_np, weighted_sum)

H_NORMAL, H_LL, K, T = 256, 512, 4, 32
REPLAYS = 3


@pytest.fixture(scope="module")
def env():
    """This rank's GPU, ``deep_ep`` through the alias, and the groups: ``group`` Megatron-Core's and SGLang's
    (NCCL, or gloo where ranks share a GPU: ``backend`` says which), ``gloo`` vLLM's (the world)."""
    import torch.distributed as dist

    from deepep_cupy.device.torch_dist import init_torch_distributed

    state = bind_rank()
    with pytest.MonkeyPatch.context() as mp, deep_ep_alias() as deep_ep:
        mp.setenv("DEEPEP_CUPY_TIMEOUT_S", TEST_TIMEOUT_S)
        size = state["size"]
        init_torch_distributed(COMM, "gloo")
        backend = device_group_backend(state["dev"])
        group = dist.new_group(backend=backend)
        assert dist.get_backend(group) == backend, f"asked for a {backend} group, got {dist.get_backend(group)}"
        yield {"deep_ep": deep_ep, "group": group, "backend": backend, "gloo": dist.group.WORLD,
               "size": size, "experts": 4 * size}


@contextlib.contextmanager
def reference_backend():
    """Buffers made inside the block use the reference backend, as the frameworks make them (no backend argument)."""
    saved = os.environ.get("DEEPEP_CUPY_BACKEND")
    os.environ["DEEPEP_CUPY_BACKEND"] = "reference"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("DEEPEP_CUPY_BACKEND")
        else:
            os.environ["DEEPEP_CUPY_BACKEND"] = saved


#: Results whose inputs come out of the framework's own reductions (the gradient of the router probabilities
#: sums over the hidden size in torch's backward), which do not add up in the same order on the CPU and the
#: GPU: close, but not expected bit-identical.
_DEVICE_ROUNDED = ("probs.grad",)


def same_results(got: dict, want: dict) -> None:
    """GPU against reference: received tokens bit for bit; bf16 sums close and nearly all bit-identical."""
    for key, want_value in want.items():
        a, b = np.asarray(got[key]), np.asarray(want_value)
        assert a.shape == b.shape, f"{key}: shape {a.shape}, reference {b.shape}"
        if key == "recv_x":
            np.testing.assert_array_equal(bits(a), bits(b), err_msg=key)
            continue
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2, err_msg=key)
        if key in _DEVICE_ROUNDED:
            continue
        exact = float(np.mean(a == b)) if a.size else 1.0
        assert exact > 0.99, f"{key}: only {exact:.2%} of the values equal the reference's"


def on_both(scenario):
    """``scenario(device)`` on the reference backend with CPU tensors, then on the GPU; compared (collective)."""
    def body():
        with reference_backend():
            want = scenario("cpu")
        got = scenario("cuda")
        sync()
        same_results(got, want)

    together(body)


def _inputs(env, group, seed, hidden, **kw):
    return S.Inputs(group, seed, hidden=hidden, num_experts=env["experts"], topk=K, **kw)


# ------------------------------------------------------------------------------------------- Megatron-Core
@pytest.mark.parametrize("async_finish", [False, True])
@pytest.mark.parametrize("side_stream", [False, True])
def test_megatron_forward_backward(env, async_finish, side_stream):
    def scenario(device):
        stream = torch.cuda.Stream() if side_stream and device == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            mb = M.train_step(env["deep_ep"], env["group"], seed=3 + async_finish, device=device,
                              num_experts=env["experts"], async_finish=async_finish, skip_last_rank=async_finish)
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
        return mb.results()

    on_both(scenario)


def test_megatron_interleaved_micro_batches(env):
    together(lambda: M.interleaved_micro_batches(env["deep_ep"], env["group"], seed=21, device="cuda",
                                                 num_experts=env["experts"]))


# ------------------------------------------------------------------------------------------- SGLang
@pytest.mark.parametrize("fp8,alignment", [(False, 1), (True, 128)])
def test_sglang_normal(env, fp8, alignment):
    def scenario(device):
        buffer = S.sglang_buffer(env["deep_ep"], env["group"], S.NORMAL, hidden=H_NORMAL, num_experts=env["experts"],
                                 param_bytes=1 if fp8 else 2)
        try:
            return S.sglang_normal_round(env["deep_ep"], buffer, _inputs(env, env["group"], 1, H_NORMAL), device,
                                         fp8=fp8, column_major=fp8, alignment=alignment)
        finally:
            buffer.destroy()

    on_both(scenario)


@NEEDS_NVSHMEM
@pytest.mark.parametrize("hook,fp8,round_scale,use_ue8m0,zero_copy", [
    (True, False, False, False, False), (False, True, False, False, True), (True, True, True, True, False)])
def test_sglang_low_latency(env, hook, fp8, round_scale, use_ue8m0, zero_copy):
    def scenario(device):
        buffer = S.sglang_buffer(env["deep_ep"], env["group"], S.AUTO, hidden=H_LL, num_experts=env["experts"],
                                 num_max_dispatch_tokens_per_rank=T)
        try:
            out = S.sglang_normal_round(env["deep_ep"], buffer, _inputs(env, env["group"], 1, H_LL), device)
            buffer.clean_low_latency_buffer(T, H_LL, env["experts"])
            out.update(S.sglang_low_latency_round(
                env["deep_ep"], buffer, _inputs(env, env["group"], 2, H_LL), device,
                num_max_dispatch_tokens_per_rank=T, hook=hook, fp8=fp8, round_scale=round_scale,
                use_ue8m0=use_ue8m0, zero_copy=zero_copy))
            out.update(S.sglang_two_batch_overlap(env["deep_ep"], buffer, _inputs(env, env["group"], 3, H_LL),
                                                  _inputs(env, env["group"], 4, H_LL), device,
                                                  num_max_dispatch_tokens_per_rank=T))
            return out
        finally:
            buffer.destroy()

    on_both(scenario)


# ------------------------------------------------------------------------------------------- vLLM
@pytest.mark.parametrize("do_async,dbo,fp8", [(True, False, False), (False, True, True)])
def test_vllm_high_throughput(env, do_async, dbo, fp8):
    def scenario(device):
        buffer = S.vllm_ht_buffer(env["deep_ep"], env["gloo"])
        try:
            return S.vllm_ht_round(env["deep_ep"], buffer, _inputs(env, env["gloo"], 1, H_NORMAL), device,
                                   do_async=do_async, dbo=dbo, fp8=fp8)
        finally:
            buffer.destroy()

    on_both(scenario)


@NEEDS_NVSHMEM
@pytest.mark.parametrize("fp8,do_async", [(False, True), (True, False)])
def test_vllm_low_latency(env, fp8, do_async):
    def scenario(device):
        buffer = S.vllm_ll_buffer(env["deep_ep"], env["gloo"], hidden=H_LL, num_experts=env["experts"], max_tokens=T,
                                  enable_shrink=device == "cuda")
        try:
            if device == "cuda":
                S.vllm_fault_tolerance_calls(buffer, device)
            return S.vllm_ll_round(env["deep_ep"], buffer, _inputs(env, env["gloo"], 1, H_LL), device, max_tokens=T,
                                   fp8=fp8, do_async=do_async, seed=1)
        finally:
            buffer.destroy()

    on_both(scenario)


# ------------------------------------------------------------------------------------------- decode graphs
class DecodeStep:
    """One decode step of an SGLang / vLLM MoE layer on fixed input tensors, all on the device (capturable)."""

    def __init__(self, buffer, inp, *, hook: bool, out: bool):
        self.buffer, self.hook, self.num_experts = buffer, hook, inp.num_experts
        self.x, self.ids, self.w = bf16(inp.x, "cuda"), tensor(inp.idx, "cuda"), tensor(inp.w, "cuda")
        self.scales = tensor(inp.local_scales().astype(np.float32), "cuda")
        self.out = torch.empty(self.x.shape, dtype=torch.bfloat16, device="cuda") if out else None

    def load(self, inp) -> None:
        self.x.copy_(bf16(inp.x, "cuda"))
        self.ids.copy_(tensor(inp.idx, "cuda"))
        self.w.copy_(tensor(inp.w, "cuda"))
        self.scales.copy_(tensor(inp.local_scales().astype(np.float32), "cuda"))  # the experts change too

    def __call__(self):
        recv, count, handle, event, recv_hook = self.buffer.low_latency_dispatch(
            self.x, self.ids, T, self.num_experts, use_fp8=False, async_finish=not self.hook,
            return_recv_hook=self.hook)
        recv_hook() if self.hook else event.current_stream_wait()
        valid = torch.arange(recv.shape[1], device="cuda")[None, :] < count[:, None]
        expert_out = torch.where(valid[..., None], recv.float() * self.scales[:, None, None], 0.0).to(torch.bfloat16)
        combined, event, recv_hook = self.buffer.low_latency_combine(
            x=expert_out, topk_idx=self.ids, topk_weights=self.w, handle=handle, async_finish=not self.hook,
            return_recv_hook=self.hook, out=self.out)
        recv_hook() if self.hook else event.current_stream_wait()
        return combined


@NEEDS_NVSHMEM
@pytest.mark.parametrize("hook,out", [(True, False), (False, False), (True, True)])
def test_decode_step_in_cuda_graph(env, hook, out):
    """SGLang's adapter (hooks, or the event variant) and vLLM's (``out=``): capture after one eager call,
    replay on new inputs; between replays a normal round and ``clean_low_latency_buffer`` (AUTO mode)."""
    from graph_common import warm_up

    deep_ep, group, experts = env["deep_ep"], env["group"], env["experts"]
    fixed = {"n": lambda r: num_tokens(r) or 1}  # shapes never change while a graph is alive
    buffer = S.sglang_buffer(deep_ep, group, S.AUTO, hidden=H_LL, num_experts=experts,
                             num_max_dispatch_tokens_per_rank=T)
    state = {}

    def capture():
        buffer.clean_low_latency_buffer(T, H_LL, experts)
        state["step"] = step = DecodeStep(buffer, _inputs(env, group, 0, H_LL, **fixed), hook=hook, out=out)
        warm_up(step)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            state["result"] = step()
        state["graph"] = graph

    def replay(seed):
        inp = _inputs(env, group, seed, H_LL, **fixed)
        S.sglang_normal_round(deep_ep, buffer, _inputs(env, group, seed + 50, H_LL), "cuda")
        buffer.clean_low_latency_buffer(T, H_LL, experts)
        state["step"].load(inp)
        state["graph"].replay()
        torch.cuda.synchronize()
        # A kernel wait that gave up leaves the late peer's rows out of the sums without raising until the
        # next low-latency call: the error it recorded, not a wrong value, is what such a failure must show.
        buffer.runtime.low_latency.check_errors()
        replayed = to_np(state["result"])
        try:
            close(replayed, weighted_sum(inp.x, inp.idx, inp.w, inp.scales), f"replay {seed}")
        except AssertionError as exc:  # which ranks' experts the wrong tokens hold (a missing peer shows)
            parts = partial_factors(replayed, inp.x, inp.idx, inp.w, inp.scales, inp.num_local, inp.size)
            raise AssertionError(f"{exc}; {parts}") from None
        eager = to_np(state["step"]())  # an eager pair on the same inputs: the same kernels, the same bits
        sync()
        buffer.runtime.low_latency.check_errors()
        np.testing.assert_array_equal(bits(replayed), bits(eager), err_msg=f"replay {seed} against eager")

    try:
        together(capture)
        for seed in range(1, REPLAYS + 1):
            together(lambda seed=seed: replay(seed))
    finally:
        state.clear()
        sync()
        buffer.destroy()

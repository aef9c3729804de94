"""torch.compile through the public ``Buffer`` on GPUs: low-latency dispatch + combine (every flag) and
layout + ``num_worst_tokens`` dispatch + combine + cached dispatch, compiled with ``fullgraph=True`` by
inductor and by inductor with ``mode="reduce-overhead"`` (CUDA graphs), called several times on fresh
random inputs (warm-up, capture, replays); every call is compared bit for bit with the same calls made
eagerly on the same inputs. A compiled training step's gradients are compared with those of the eager
step written with autograd Functions around the same calls.

Run on every rank:  mpirun -np 2 python -m pytest tests/gpu/test_torch_compile.py -q
Skips without a GPU, with fewer than 2 ranks, or when torch has no CUDA (the low-latency tests also
without nvshmem4py). Every test is collective; failures are gathered on every rank.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_common import COMM, agree, bf16, bits, to_np, together, with_reference_buffer
from graph_common import GRAPH_MARKS, seeded, to_torch
from ll_common import NEEDS_NVSHMEM, hint, routing

pytestmark = GRAPH_MARKS
MODES = ["default", "reduce-overhead"]
CALLS = 4  # cudagraph trees: warm-up, capture, then replays
T_LL, H_LL, E_LL, K_LL = 16, 2048, 16, 4
N_NT, H_NT, E_NT, K_NT = 256, 2048, 16, 4


ENV = with_reference_buffer  # the conftest's env: this rank's GPU bound, and a reference Buffer as the oracle
NVL_HIDDEN = H_NT  # the conftest's nvl: an intranode Buffer for these rows


@pytest.fixture(autouse=True)
def fresh_dynamo():
    import torch

    torch._dynamo.reset()
    yield


def _compile(fn, mode):
    import torch

    return torch.compile(fn, fullgraph=True, backend="inductor", mode=None if mode == "default" else mode)


def _host(obj):
    """Nested results as NumPy (a CUDA-graph replay's outputs are overwritten by the next replay)."""
    if isinstance(obj, (tuple, list)):
        return type(obj)(_host(o) for o in obj)
    return to_np(obj) if hasattr(obj, "shape") else obj


def _equal(failures, what, got, want) -> None:
    if np.shape(got) != np.shape(want) or not np.array_equal(bits(np.asarray(got)), bits(np.asarray(want))):
        failures.append(f"{what}: differs from the eager call")


# ---------------------------------------------------------------------------------------------------- low latency
@pytest.fixture(scope="module")
def ll(env):
    import deepep_cupy

    buf = deepep_cupy.Buffer(comm=COMM, num_rdma_bytes=hint(T_LL, H_LL, E_LL), low_latency_mode=True,
                             num_qps_per_rank=E_LL // env["size"], explicitly_destroy=True)
    try:
        yield buf
    finally:
        COMM.Barrier()
        buf.destroy()


LL_CASES = {
    "bf16": {}, "fp8_ue8m0_logfmt": {"use_fp8": True, "round_scale": True, "use_ue8m0": True, "use_logfmt": True},
    "fp8_zero_copy": {"use_fp8": True, "zero_copy": True},
    "fp8_hooks": {"use_fp8": True, "hook": True},
    # Tensors the graph mutates (out, stats): inductor keeps such a graph out of CUDA graphs.
    "hooks_out_stats": {"hook": True, "out": True, "stats": True},
}


@NEEDS_NVSHMEM
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(LL_CASES))
def test_low_latency_compiled(env, ll, case, mode):
    import torch

    flags, rank, size = LL_CASES[case], env["rank"], env["size"]
    e_local, hook = E_LL // size, LL_CASES[case].get("hook", False)
    n = T_LL - (3 * rank) % (T_LL // 2)
    rng = seeded(f"compile-{case}-{mode}", rank)

    def step(x, topk, w, stats, wait, out):
        recv, count, handle, _, d_hook = ll.low_latency_dispatch(
            x, topk, T_LL, E_LL, cumulative_local_expert_recv_stats=stats, dispatch_wait_recv_cost_stats=wait,
            use_fp8=flags.get("use_fp8", False), round_scale=flags.get("round_scale", False),
            use_ue8m0=flags.get("use_ue8m0", False), return_recv_hook=hook)
        if hook:
            d_hook()
        data = recv[0] if isinstance(recv, tuple) else recv
        y = (data.float() * 0.5).to(torch.bfloat16)
        if flags.get("zero_copy"):
            staged = ll.get_next_low_latency_combine_buffer(handle)
            staged.copy_(y)
            y = staged
        combined, _, c_hook = ll.low_latency_combine(
            y, topk, w, handle, use_logfmt=flags.get("use_logfmt", False), zero_copy=flags.get("zero_copy", False),
            return_recv_hook=hook, out=out, combine_wait_recv_cost_stats=wait)
        if hook:
            c_hook()
        return recv, count, handle[0], handle[1], combined

    def stats_tensors():
        if not flags.get("stats"):
            return None, None
        return (torch.zeros(e_local, dtype=torch.int32, device="cuda"),
                torch.zeros(size, dtype=torch.int64, device="cuda"))

    def outcome(fn, x, topk, w, stats):
        out = torch.zeros((n, H_LL), dtype=torch.bfloat16, device="cuda") if flags.get("out") else None
        recv, count, src_info, layout_range, combined = fn(x, topk, w, *stats, out)
        torch.cuda.synchronize()
        count = to_np(count)
        recv = recv if isinstance(recv, tuple) else (recv,)
        rows = [[to_np(r[e, :c]) for e, c in enumerate(count.tolist())] for r in recv]
        return count, rows, to_np(src_info), to_np(layout_range), to_np(combined), \
            (to_np(out) if out is not None else None), [to_np(s) for s in stats if s is not None]

    ll.clean_low_latency_buffer(T_LL, H_LL, E_LL)
    compiled = _compile(step, mode)
    eager_stats, compiled_stats = stats_tensors(), stats_tensors()
    last_wait = np.zeros(size, dtype=np.int64)
    failures = []
    for call in range(CALLS):
        x = to_torch(bf16(rng, (n, H_LL)), env)
        topk, w = (to_torch(a, env) for a in routing(rng, n, E_LL, K_LL, empty_tokens=1))
        want = together(lambda: outcome(step, x, topk, w, eager_stats), f"call {call}, eager")  # noqa: B023
        got = together(lambda: outcome(compiled, x, topk, w, compiled_stats), f"call {call}, compiled")  # noqa: B023
        _equal(failures, f"call {call} count", got[0], want[0])
        for i, (g, e) in enumerate(zip(got[1], want[1], strict=True)):
            for expert, (a, b) in enumerate(zip(g, e, strict=True)):
                _equal(failures, f"call {call} recv[{i}] expert {expert}", a, b)
        for what, a, b in zip(("src_info", "layout_range", "combined", "out"), got[2:6], want[2:6], strict=True):
            if b is not None:
                _equal(failures, f"call {call} {what}", a, b)
        if got[6]:
            # Received counts add up exactly; wait times (nanoseconds of the GPU clock) only grow.
            (cum_got, wait_got), (cum_want, wait_want) = got[6], want[6]
            _equal(failures, f"call {call} cumulative_local_expert_recv_stats", cum_got, cum_want)
            if wait_got.shape != wait_want.shape or (wait_got < last_wait).any():
                failures.append(f"call {call} wait stats: {last_wait.tolist()} -> {wait_got.tolist()} (must not shrink)")
            last_wait = wait_got
    agree(failures)


# ---------------------------------------------------------------------------------------------------- normal ops
def _normal_step(buf, worst):
    import torch

    def step(x, topk, w):
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E_NT)
        recv, recv_topk, recv_w, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, num_worst_tokens=worst)
        combined, combined_w, _ = buf.combine((recv.float() * 0.5).to(torch.bfloat16), handle, topk_weights=recv_w)
        cached = buf.dispatch(x, handle=handle)[0]
        return (per_rank, per_expert, in_rank), recv, recv_topk, recv_w, handle[0], combined, combined_w, cached
    return step


@pytest.mark.parametrize("mode", MODES)
def test_normal_compiled(env, nvl, mode):
    buf = nvl[0]
    rank, size = env["rank"], env["size"]
    n = N_NT - (16 * rank) % (N_NT // 2)
    worst = N_NT * size
    rng = seeded(f"compile-normal-{mode}", rank)
    step = _normal_step(buf, worst)
    compiled = _compile(step, mode)
    failures = []
    for call in range(CALLS):
        x = to_torch(bf16(rng, (n, H_NT)), env)
        topk, w = (to_torch(a, env) for a in routing(rng, n, E_NT, K_NT, empty_tokens=2))
        want = together(lambda: _host(step(x, topk, w)))  # noqa: B023
        got = together(lambda: _host(compiled(x, topk, w)))  # noqa: B023
        for what, a, b in zip(("per_rank", "per_expert", "in_rank"), got[0], want[0], strict=True):
            _equal(failures, f"call {call} {what}", a, b)
        rows = int(want[4][-1, rank])  # received rows; the rest of the num_worst_tokens rows is padding
        for what, i in (("recv_x", 1), ("recv_topk_idx", 2), ("recv_topk_weights", 3), ("cached", 7)):
            _equal(failures, f"call {call} {what}", got[i][:rows], want[i][:rows])
        for what, i in (("rank_prefix_matrix", 4), ("combined", 5), ("combined_topk_weights", 6)):
            _equal(failures, f"call {call} {what}", got[i], want[i])
    agree(failures)


def test_training_step_compiled(env, nvl):
    """Inductor (fusions round differently from eager): gradients within BF16 tolerance of the eager step's."""
    import torch

    buf = nvl[0]
    rank, size = env["rank"], env["size"]
    n, worst = N_NT - 8 * rank, N_NT * size
    rng = seeded("compile-training", rank)
    x0 = to_torch(bf16(rng, (n, H_NT)), env)
    topk, w0 = (to_torch(a, env) for a in routing(rng, n, E_NT, K_NT))
    weight0 = to_torch((rng.standard_normal((H_NT, H_NT)) / H_NT ** 0.5).astype(np.float32), env)

    class Dispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E_NT)
            recv, recv_topk, recv_w, _, handle, _ = buf.dispatch(
                x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk, topk_weights=w, num_worst_tokens=worst)
            ctx.handle = handle
            return recv, recv_w, recv_topk, *handle

        @staticmethod
        def backward(ctx, grad_x, grad_w, *_):
            gx, gw, _ = buf.combine(grad_x.contiguous(), ctx.handle, topk_weights=grad_w.contiguous())
            return gx, gw

    class Combine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, *handle):
            ctx.handle = handle
            return buf.combine(y, handle)[0]

        @staticmethod
        def backward(ctx, grad):
            return (buf.dispatch(grad.contiguous(), handle=ctx.handle)[0], *([None] * len(ctx.handle)))

    def experts(recv, recv_w, recv_topk, weight):
        gate = (recv_w * (recv_topk >= 0)).sum(-1, keepdim=True)
        return ((recv.float() @ weight) * gate).to(torch.bfloat16)

    def eager(x, w, weight):
        recv, recv_w, recv_topk, *handle = Dispatch.apply(x, w)
        return Combine.apply(experts(recv, recv_w, recv_topk, weight), *handle).float().pow(2).sum()

    def step(x, w, weight):
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E_NT)
        recv, recv_topk, recv_w, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk, topk_weights=w, num_worst_tokens=worst)
        return buf.combine(experts(recv, recv_w, recv_topk, weight), handle)[0].float().pow(2).sum()

    def run(fn):
        x, w, weight = (t.clone().requires_grad_() for t in (x0, w0, weight0))
        loss = fn(x, w, weight)
        loss.backward()
        torch.cuda.synchronize()
        return [to_np(t.detach()) for t in (loss, x.grad, w.grad, weight.grad)]

    want = together(lambda: run(eager))
    got = together(lambda: run(_compile(step, "default")))
    failures = []
    for what, a, b in zip(("loss", "grad x", "grad topk_weights", "grad weight"), got, want, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        scale = max(float(np.abs(b).max()), 1e-6)
        if a.shape != b.shape or float(np.abs(a - b).max()) > 2e-2 * scale:
            failures.append(f"{what}: differs from the eager step by more than BF16 rounding")
    agree(failures)

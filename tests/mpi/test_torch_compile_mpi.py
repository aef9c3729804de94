"""torch.compile through ``Buffer`` on the reference backend across processes: every op traced with
``fullgraph=True`` on CPU tensors, by ``backend="aot_eager"`` and by inductor (its CPU code; where a C++
compiler is found), compared bit for bit with the same calls made eagerly on the same random data
(gradients of a training step: inductor's fused float32 sums within rounding).

    mpiexec -n 2 python -m pytest tests/mpi/test_torch_compile_mpi.py -q      (and -n 4)

Every test makes all of its collective calls (eager, then compiled) before it checks anything, so a
failed check on one rank cannot leave the others waiting.
"""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")
MPI = pytest.importorskip("mpi4py.MPI")

from deepep_cupy import Buffer  # noqa: E402
from deepep_cupy.bench.compiled_steps import combine_function  # noqa: E402
from deepep_cupy.ops.handles import LowLatencyHandle  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
pytestmark = [pytest.mark.skipif(SIZE < 2, reason="run under mpiexec with 2 or more ranks"),
              pytest.mark.timeout(600, method="thread")]

T, H_LL, E_PER_RANK, K = 8, 512, 3, 3
# The reference backend refuses calls past the buffer sizes, as the GPU does: room for every shape here.
RDMA_BYTES = 1 << 26
NVL_BYTES = 1 << 24  # likewise for the normal ops (Config.get_nvl_buffer_size_hint of the largest shape here)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test's closures share code objects with the other cases': start from empty compile caches."""
    torch._dynamo.reset()
    yield


@pytest.fixture(params=["aot_eager", "inductor"])
def backend(request):
    if request.param == "inductor" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip("inductor's CPU code needs a C++ compiler")
    return request.param


def _compile(fn, backend):
    return torch.compile(fn, fullgraph=True, backend=backend, dynamic=False)


def _bits(t):
    """Exact view: NaN poison and FP8 compare by their bits."""
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.contiguous().view(torch.int16)
    if t.dtype == torch.float8_e4m3fn:
        return t.contiguous().view(torch.uint8)
    if t.dtype == torch.float32:
        return t.contiguous().view(torch.int32)
    return t


def _same(eager, compiled, what=""):
    """Nested results (tuples, lists, low-latency handles, tensors, ints, None) equal bit for bit; returns
    failure strings."""
    if isinstance(eager, (tuple, list, LowLatencyHandle)):
        if not isinstance(compiled, (tuple, list, LowLatencyHandle)) or len(eager) != len(compiled):
            return [f"{what}: {type(compiled).__name__} of {len(compiled)} instead of {len(eager)} entries"]
        return [f for i, (a, b) in enumerate(zip(eager, compiled, strict=True)) for f in _same(a, b, f"{what}[{i}]")]
    if isinstance(eager, torch.Tensor):
        if not isinstance(compiled, torch.Tensor) or eager.shape != compiled.shape or eager.dtype != compiled.dtype:
            return [f"{what}: {getattr(compiled, 'shape', compiled)} instead of {tuple(eager.shape)} {eager.dtype}"]
        return [] if torch.equal(_bits(eager), _bits(compiled)) else [f"{what}: values differ"]
    return [] if eager == compiled else [f"{what}: {compiled!r} instead of {eager!r}"]


def _agree(failures):
    bad = [f"rank {r}: {f}" for r, fs in enumerate(COMM.allgather(failures)) for f in fs]
    assert not bad, "\n".join(bad[:20])


def _routing(seed, num_tokens, num_experts):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:K] for _ in range(num_tokens)]) \
        if num_tokens else torch.zeros((0, K), dtype=torch.int64)
    if num_tokens:
        idx[torch.rand(num_tokens, K, generator=g) < 0.15] = -1
    return idx, torch.rand(num_tokens, K, generator=g), g


# ---------------------------------------------------------------------------------------------------- low latency
@pytest.fixture(scope="module")
def ll_buffer():
    buf = Buffer(comm=COMM, low_latency_mode=True, num_rdma_bytes=RDMA_BYTES, explicitly_destroy=True, backend="reference")
    yield buf
    COMM.Barrier()
    buf.destroy()


def _expert(recv):
    """Something an expert computes from the received rows, in BF16 (FP8: from the values)."""
    data = recv[0] if isinstance(recv, tuple) else recv
    return (data.float() * 0.5 - 1).bfloat16()


LL_CASES = {
    "bf16": {}, "fp8": {"use_fp8": True}, "fp8_round": {"use_fp8": True, "round_scale": True},
    "ue8m0": {"use_fp8": True, "round_scale": True, "use_ue8m0": True}, "logfmt": {"use_logfmt": True},
    "stats": {"stats": True}, "out": {"out": True}, "zero_copy": {"zero_copy": True},
    "hooks": {"hook": True}, "hooks_fp8_stats_out": {"hook": True, "use_fp8": True, "stats": True, "out": True},
}


@pytest.mark.parametrize("case", list(LL_CASES))
def test_low_latency_dispatch_combine(ll_buffer, case, backend):
    flags = LL_CASES[case]
    num_experts = E_PER_RANK * SIZE
    n = T - RANK % 3
    idx, w, g = _routing(100 + RANK, n, num_experts)
    x = torch.randn(n, H_LL, generator=g).bfloat16()
    hook = flags.get("hook", False)

    def step(x, idx, w, stats, wait, out):
        recv, count, handle, _, d_hook = ll_buffer.low_latency_dispatch(
            x, idx, T, num_experts, cumulative_local_expert_recv_stats=stats, dispatch_wait_recv_cost_stats=wait,
            use_fp8=flags.get("use_fp8", False), round_scale=flags.get("round_scale", False),
            use_ue8m0=flags.get("use_ue8m0", False), return_recv_hook=hook)
        if hook:
            d_hook()
        y = _expert(recv)
        if flags.get("zero_copy"):
            staged = ll_buffer.get_next_low_latency_combine_buffer(handle)
            staged.copy_(y)
            y = staged
        combined, _, c_hook = ll_buffer.low_latency_combine(
            y, idx, w, handle, use_logfmt=flags.get("use_logfmt", False), zero_copy=flags.get("zero_copy", False),
            return_recv_hook=hook, out=out, combine_wait_recv_cost_stats=wait)
        if hook:
            c_hook()
        return recv, count, handle, combined

    def run(fn):
        start = torch.randint(0, 5, (E_PER_RANK,), dtype=torch.int32, generator=torch.Generator().manual_seed(RANK))
        stats = start if flags.get("stats") else None
        wait = torch.zeros(SIZE, dtype=torch.int64) if flags.get("stats") else None
        out = torch.full((n, H_LL), float("nan"), dtype=torch.bfloat16) if flags.get("out") else None
        result = fn(x, idx, w, stats, wait, out)
        return result, stats, wait, out, (result[3] is out if out is not None else None)

    eager = run(step)
    compiled = run(_compile(step, backend))
    failures = _same(eager, compiled, case)
    if flags.get("stats") and torch.equal(eager[1], torch.zeros_like(eager[1])):
        failures.append("the stats did not move")
    _agree(failures)


def test_low_latency_hook_called_after_the_compiled_region(ll_buffer, backend):
    """A receive hook returned by compiled code and called eagerly fills the outputs it returned."""
    num_experts = E_PER_RANK * SIZE
    idx, w, g = _routing(7 + RANK, T, num_experts)
    x = torch.randn(T, H_LL, generator=g).bfloat16()

    def send(x, idx):
        recv, count, handle, _, hook = ll_buffer.low_latency_dispatch(x, idx, T, num_experts, use_fp8=False,
                                                                      return_recv_hook=True)
        return recv, count, handle, hook

    results = []
    for fn in (send, _compile(send, backend)):
        recv, count, handle, hook = fn(x, idx)
        hook()
        results.append((recv, count, handle[0], handle[1]))
    _agree(_same(*results, "hook after region"))


# ---------------------------------------------------------------------------------------------------- normal ops
@pytest.fixture(scope="module", params=["one_domain", "domains"])
def nvl_buffer(request):
    # One NVLink domain: the intranode 6-tuple handle; one rank per domain (or two): the internode 10-tuple.
    local = SIZE if request.param == "one_domain" else (2 if SIZE >= 4 else 1)
    buf = Buffer(comm=COMM, num_nvl_bytes=NVL_BYTES, num_rdma_bytes=RDMA_BYTES, explicitly_destroy=True,
                 backend="reference", num_nvl_ranks=local)
    yield buf
    COMM.Barrier()
    buf.destroy()


H = 128
WORST = 16 * 4


def _normal_inputs(seed, fp8=False):
    num_experts = E_PER_RANK * SIZE
    n = 9 + 3 * RANK
    idx, w, g = _routing(seed + RANK, n, num_experts)
    x = torch.randn(n, H, generator=g).bfloat16()
    if fp8:
        scales = torch.rand(n, H // 128, generator=g) + 0.5
        x = (x.float().to(torch.float8_e4m3fn), scales)
    return x, idx, w, num_experts


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_layout_dispatch_combine_worst_tokens(nvl_buffer, fp8, backend):
    x, idx, w, num_experts = _normal_inputs(11, fp8)
    bias = torch.randn(idx.shape[0], H).bfloat16()

    def step(x, idx, w, bias):
        per_rank, per_rdma, per_expert, in_rank, _ = nvl_buffer.get_dispatch_layout(idx, num_experts)
        recv, recv_idx, recv_w, counts, handle, _ = nvl_buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, num_worst_tokens=WORST)
        combined, combined_w, _ = nvl_buffer.combine(_expert(recv), handle, topk_weights=recv_w, bias=bias)
        cached = nvl_buffer.dispatch(x, handle=handle)[0]
        return (per_rank, per_rdma, per_expert, in_rank), (recv, recv_idx, recv_w, counts, handle), \
            (combined, combined_w), cached

    eager = step(x, idx, w, bias)
    compiled = _compile(step, backend)(x, idx, w, bias)
    failures = _same(eager[:3], compiled[:3], "fp8" if fp8 else "bf16")
    # A cached dispatch with a num_worst_tokens handle returns the handle's rows (as the kernels and DeepEP
    # do), eagerly and compiled alike.
    for got, want in zip(*(c if isinstance(c, tuple) else (c,) for c in (compiled[3], eager[3])), strict=True):
        if got.shape[0] != WORST or want.shape[0] != WORST or not torch.equal(_bits(got), _bits(want)):
            failures.append(f"cached dispatch: {tuple(got.shape)} and eager {tuple(want.shape)} rows, want "
                            f"{WORST} equal ones")
    _agree(failures)


def _plain_step(buf, num_experts):
    def step(x, idx, w):
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
        recv, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, expert_alignment=2)
        combined, combined_w, _ = buf.combine(_expert(recv), handle, topk_weights=recv_w)
        return recv, recv_idx, recv_w, counts, handle, combined, combined_w
    return step


@torch._dynamo.config.patch(capture_scalar_outputs=True)
def test_dispatch_with_unbacked_rows(nvl_buffer, backend):
    """Without num_worst_tokens the row count is unbacked; the per-expert list traces as unbacked ints."""
    x, idx, w, num_experts = _normal_inputs(21)
    step = _plain_step(nvl_buffer, num_experts)
    eager = step(x, idx, w)
    compiled = _compile(step, backend)(x, idx, w)
    _agree(_same(eager, compiled, "unbacked"))


def test_dispatch_list_breaks_the_graph_without_scalar_outputs(nvl_buffer):
    """The documented graph break: the per-expert list of a dispatch without num_worst_tokens."""
    x, idx, w, num_experts = _normal_inputs(31)
    step = _plain_step(nvl_buffer, num_experts)
    eager = step(x, idx, w)
    compiled = torch.compile(step, backend="aot_eager", dynamic=False)(x, idx, w)
    _agree(_same(eager, compiled, "graph break"))


# ---------------------------------------------------------------------------------------------------- autograd
def _eager_functions(buf):
    """Dispatch and combine as MoE frameworks wrap them for eager training (each the other's backward)."""

    class Dispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, idx, num_experts, worst):
            per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
            recv, recv_idx, recv_w, _, handle, _ = buf.dispatch(
                x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, num_worst_tokens=worst)
            ctx.handle = handle
            return recv, recv_w, recv_idx, handle

        @staticmethod
        def backward(ctx, grad_x, grad_w, *_):
            gx, gw, _ = buf.combine(grad_x.contiguous(), ctx.handle, topk_weights=grad_w.contiguous())
            return gx, gw, None, None, None

    return Dispatch, combine_function(buf)


def _experts(recv, recv_w, recv_idx, weight):
    gate = (recv_w * (recv_idx >= 0)).sum(-1, keepdim=True)
    return ((recv.float() @ weight) * gate).bfloat16()


@pytest.mark.parametrize("worst", [WORST, 0], ids=["worst_tokens", "unbacked"])
@torch._dynamo.config.patch(capture_scalar_outputs=True)
def test_training_step(nvl_buffer, worst, backend):
    """Gradients of a compiled step (dispatch -> experts -> combine -> loss) equal those of the eager step
    written with autograd Functions around the same Buffer calls."""
    x0, idx, w0, num_experts = _normal_inputs(41)
    weight0 = torch.randn(H, H, generator=torch.Generator().manual_seed(3)) / H ** 0.5
    Dispatch, Combine = _eager_functions(nvl_buffer)

    def eager(x, w, weight):
        recv, recv_w, recv_idx, handle = Dispatch.apply(x, w, idx, num_experts, worst)
        return Combine.apply(_experts(recv, recv_w, recv_idx, weight), handle).float().pow(2).sum()

    def step(x, w, weight):
        per_rank, per_rdma, per_expert, in_rank, _ = nvl_buffer.get_dispatch_layout(idx, num_experts)
        recv, recv_idx, recv_w, _, handle, _ = nvl_buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, num_worst_tokens=worst)
        combined = nvl_buffer.combine(_experts(recv, recv_w, recv_idx, weight), handle)[0]
        return combined.float().pow(2).sum()

    results = []
    for fn in (eager, _compile(step, backend)):
        x, w, weight = (t.clone().requires_grad_() for t in (x0, w0, weight0))
        loss = fn(x, w, weight)
        loss.backward()
        results.append((loss.detach(), x.grad, w.grad, weight.grad))
    if backend == "aot_eager":
        failures = _same(*results, "training step")
    else:  # inductor fuses the experts' float32 sums in another order
        failures = [f"training step[{i}]: differs beyond float32 rounding"
                    for i, (a, b) in enumerate(zip(*results, strict=True))
                    if a.shape != b.shape or not torch.allclose(a.float(), b.float(), rtol=1e-4,
                                                                atol=1e-5 * float(a.float().abs().max()))]
    if results[1][1] is not None and not results[1][1].float().any():
        failures.append("the gradient of x is all zero")
    _agree(failures)


# ---------------------------------------------------------------------------------------------------- gloo group
def test_buffer_on_a_gloo_group():
    """A Buffer made on a torch.distributed (gloo) group compiles the same: both families in one graph."""
    import torch.distributed as dist

    from deepep_cupy.device.torch_dist import init_torch_distributed

    init_torch_distributed(COMM, "gloo")
    # A group of its own: its message tags start afresh on every rank, whatever other tests made before.
    group = dist.new_group(list(range(SIZE)), backend="gloo")
    buf = Buffer(group=group, low_latency_mode=True, num_nvl_bytes=NVL_BYTES, num_rdma_bytes=RDMA_BYTES,
                 explicitly_destroy=True,
                 backend="reference")
    x, idx, w, num_experts = _normal_inputs(51)
    x = x[:T]
    idx, w = idx[:T], w[:T]

    def step(x, idx, w):
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, num_experts, use_fp8=False)
        decoded = buf.low_latency_combine(_expert(recv), idx, w, handle)[0]
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
        recv, _, recv_w, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w, num_worst_tokens=WORST)
        return decoded, count, buf.combine(_expert(recv), handle, topk_weights=recv_w)[:2]

    eager = step(x, idx, w)
    compiled = _compile(step, "aot_eager")(x, idx, w)
    COMM.Barrier()
    buf.destroy()
    _agree(_same(eager, compiled, "gloo"))

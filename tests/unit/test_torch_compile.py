"""torch.compile support in one process: the custom ops' fake implementations against their real ones
(``torch.library.opcheck``), a compiled round trip of each family on one rank, the eager path that never
reaches the ops, the errors of compiled code, and the compiled MoE example (one rank and under mpiexec).
Multi-rank comparisons with eager calls are in tests/mpi/test_torch_compile_mpi.py."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from thread_group import ThreadGroup, _Shared  # noqa: E402

import deepep_cupy.buffer as buffer_module  # noqa: E402
import deepep_cupy.buffer_low_latency as ll_module  # noqa: E402
from deepep_cupy import Buffer, EventOverlap  # noqa: E402
from deepep_cupy.custom_ops import common, tracing_check  # noqa: E402
from deepep_cupy.custom_ops import low_latency as traced_ll  # noqa: E402
from deepep_cupy.custom_ops import normal as traced_normal  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
T, H, E, K = 6, 512, 4, 2
# The reference backend refuses calls past the buffer sizes, as the GPU does: room for every shape here.
RDMA_BYTES = 1 << 26
NVL_BYTES = 1 << 24  # likewise for the normal ops (Config.get_nvl_buffer_size_hint of the largest shape here)
ops = torch.ops.deepep_cupy


@pytest.fixture(scope="module")
def buf():
    b = Buffer(comm=ThreadGroup(_Shared(1, 60.0), 0, 1), backend="reference", low_latency_mode=True,
               num_nvl_bytes=NVL_BYTES, num_rdma_bytes=RDMA_BYTES, explicitly_destroy=True)
    yield b
    b.destroy()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield


def _inputs(seed, n=T):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    idx[0, 1] = -1
    return torch.randn(n, H, generator=g).bfloat16(), idx, torch.rand(n, K, generator=g)


# ---------------------------------------------------------------------------------------------------- eager path
def test_the_check_is_torchs_own_function():
    buffer_module._compiling()  # an eager call binds torch's function if torch came after deepep_cupy
    ll_module._compiling()
    assert buffer_module._compiling is torch.compiler.is_dynamo_compiling
    assert ll_module._compiling is torch.compiler.is_dynamo_compiling


def test_check_before_torch_is_imported(monkeypatch):
    namespace = {}
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not imported yet
    check = namespace["_compiling"] = tracing_check(namespace)
    assert check is not torch.compiler.is_dynamo_compiling
    assert check() is False and namespace["_compiling"] is check
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert check() is False
    assert namespace["_compiling"] is torch.compiler.is_dynamo_compiling


def test_eager_calls_never_reach_the_custom_ops(buf, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an eager call went to the custom ops")

    for module in (traced_ll, traced_normal):
        for name in module.__all__:
            monkeypatch.setattr(module, name, refuse)
    x, idx, w = _inputs(1)
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    buf.low_latency_combine(recv, idx, w, handle)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    recv, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    buf.combine(recv, handle)


# ---------------------------------------------------------------------------------------------------- fake vs real
def _opcheck(op, args, traced=True):
    # The schema, the fake implementation against the real one, and the traced graph with dynamic shapes
    # (not for a send op: its outputs are NaN until the receive).
    utils = ("test_schema", "test_faketensor") + (("test_aot_dispatch_dynamic",) if traced else ())
    torch.library.opcheck(op, args, test_utils=utils)


@pytest.mark.parametrize("fp8", [False, True])
def test_low_latency_ops_match_their_fakes(buf, fp8):
    bid = common.buffer_id(buf)
    x, idx, w = _inputs(2)
    stats = torch.zeros(E, dtype=torch.int32)
    _opcheck(ops.ll_dispatch_stats.default, (bid, x, idx, stats, None, T, E, fp8, fp8, fp8))
    _opcheck(ops.ll_dispatch.default, (bid, x, idx, T, E, fp8, fp8, fp8))
    _opcheck(ops.ll_dispatch_send.default, (bid, x, idx, None, None, T, E, fp8, False, False), traced=False)
    recv_x, small = ops.ll_dispatch(bid, x, idx, T, E, False, False, False)
    views = traced_ll.unpack(small, traced_ll.small_layout(1, T, E, H, False, False))
    handle = (views[1], views[2], T, H, E)
    _opcheck(ops.ll_combine.default, (bid, recv_x, idx, w, *handle, fp8, False))
    out = torch.empty(T, H, dtype=torch.bfloat16)
    wait = torch.zeros(1, dtype=torch.int64)
    _opcheck(ops.ll_combine_into.default, (bid, recv_x, idx, w, *handle, False, False, out, wait))
    _opcheck(ops.ll_combine_into.default, (bid, recv_x, idx, w, *handle, False, False, None, wait))
    _opcheck(ops.ll_combine_buffer.default, (bid, *handle))


def test_normal_ops_match_their_fakes(buf):
    bid = common.buffer_id(buf)
    x, idx, w = _inputs(3)
    _opcheck(ops.layout.default, (bid, idx, E))
    per_rank, per_expert, in_rank = ops.layout(bid, idx, E)
    config = list(Buffer.get_dispatch_config(1).key())
    args = (bid, x, None, per_rank, None, in_rank, per_expert, idx, w, 1, 16, config)
    _opcheck(ops.dispatch.default, args)
    _opcheck(ops.dispatch_host_wait.default, (*args[:10], 0, config))
    outs = ops.dispatch(*args)
    handle = [*outs[3:7], in_rank, outs[7]]  # the 6-tuple holds the caller's is_token_in_rank at index 4
    _opcheck(ops.cached_dispatch.default, (bid, x, None, handle, config))
    _opcheck(ops.combine.default, (bid, outs[0], handle, outs[2], x, None, config))


# ---------------------------------------------------------------------------------------------------- autograd
def _moe_step(layout, dispatch, combine):
    """Layout, dispatch with weights, a weighted stand-in for the experts, combine: the loss's gradient
    reaches x through both ops' backward formulas and the weights through the dispatch's."""
    def step(x, idx, w, probe):
        per_rank, _, per_expert, in_rank, _ = layout(idx, E)
        recv, _, recv_w, _, handle, _ = dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                                                 num_worst_tokens=T)
        y = (recv.float() * recv_w.sum(-1, keepdim=True)).bfloat16()
        return (combine(y, handle)[0].float() * probe).sum()

    return step


@pytest.mark.parametrize("compiled", [False, True])
def test_gradients_through_the_ops(buf, compiled):
    """Backward through the registered formulas (eager calls of the ops, and compiled code) equals the
    gradient of the same step written with the received rows' known values (one rank: every token comes
    back to itself)."""
    x, idx, w = _inputs(8)
    probe = torch.randn(T, H, generator=torch.Generator().manual_seed(9))
    if compiled:
        step = _compile(_moe_step(buf.get_dispatch_layout, buf.dispatch, buf.combine))
    else:
        step = _moe_step(*(functools.partial(f, buf) for f in (traced_normal.get_dispatch_layout,
                                                                 traced_normal.dispatch, traced_normal.combine)))
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    gx, gw = torch.autograd.grad(step(xg, idx, wg, probe), (xg, wg))
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    sent = (idx >= 0).any(1, keepdim=True)
    y = (xr.float() * (wr * (idx >= 0)).sum(-1, keepdim=True)).bfloat16()
    want = torch.autograd.grad(((y.float() * sent) * probe).sum(), (xr, wr))
    valid = idx >= 0  # the weights of unused slots (-1) are left out: only used ones reach the loss
    assert torch.equal(gx, want[0]) and torch.allclose(gw[valid], want[1][valid], rtol=1e-2, atol=1e-2)


def test_ops_without_a_backward_refuse_to_differentiate(buf):
    """An op with no formula keeps its outputs in the graph and raises when backward reaches it (a wrong
    gradient would be silent); without an input that needs one it costs nothing of the kind."""
    x, idx, _ = _inputs(11)
    bid = common.buffer_id(buf)
    recv_x, _ = ops.ll_dispatch(bid, x.detach().requires_grad_(), idx, T, E, False, False, False)
    assert recv_x.requires_grad
    with pytest.raises(RuntimeError, match="ll_dispatch has no backward formula"):
        recv_x.float().sum().backward()
    assert not ops.ll_dispatch(bid, x, idx, T, E, False, False, False)[0].requires_grad


def test_written_arguments_get_new_versions(buf):
    """As torch's in-place ops: autograd can tell a tensor saved for backward was overwritten."""
    x, idx, _ = _inputs(12)
    stats = torch.zeros(E, dtype=torch.int32)
    before = stats._version
    ops.ll_dispatch_stats(common.buffer_id(buf), x, idx, stats, None, T, E, False, False, False)
    assert stats._version > before and int(stats.sum()) > 0


# ---------------------------------------------------------------------------------------------------- compiled
def _compile(fn):
    return torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=False)


def test_compiled_low_latency_round_trip_equals_eager(buf):
    x, idx, w = _inputs(4)

    def step(x, idx, w):
        (recv, scales), count, handle, event, hook = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)
        y = (recv.float() * scales.repeat_interleave(128, dim=-1)).bfloat16()
        combined, event2, hook2 = buf.low_latency_combine(y, idx, w, handle, use_logfmt=True)
        return recv, scales, count, handle[0], handle[1], combined, event.event, event2.event, hook, hook2

    eager, compiled = step(x, idx, w), _compile(step)(x, idx, w)
    for a, b in zip(eager[:6], compiled[:6], strict=True):
        assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a.float(), b.float())
    assert compiled[6:] == (None, None, None, None)


def test_compiled_normal_round_trip_equals_eager(buf):
    x, idx, w = _inputs(5)

    def step(x, idx, w):
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        recv, recv_idx, recv_w, counts, handle, event = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w, num_worst_tokens=T)
        combined, combined_w, _ = buf.combine(recv, handle, topk_weights=recv_w)
        return per_rdma, recv, recv_idx, counts, handle, combined, combined_w, event.event

    eager, compiled = step(x, idx, w), _compile(step)(x, idx, w)
    assert compiled[0] is None and compiled[3] == [] and compiled[7] is None
    for a, b in zip((eager[1], eager[2], *eager[4], eager[5], eager[6]),
                    (compiled[1], compiled[2], *compiled[4], compiled[5], compiled[6]), strict=True):
        assert a.shape == b.shape and torch.equal(a, b)
    assert torch.equal(compiled[5].float(), (x.float() * (idx >= 0).any(1, keepdim=True)).bfloat16().float())


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_with_explicit_configs(buf, dynamic):
    """A Config given by the caller is traced (its values become the op's argument); None takes the
    Buffer's default, read once while tracing."""
    x, idx, w = _inputs(7)
    dispatch_config, combine_config = Buffer.get_dispatch_config(1), Buffer.get_combine_config(1)

    def step(x, idx, w, explicit: bool):
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        recv, _, recv_w, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w, num_worst_tokens=T, config=dispatch_config if explicit else None)
        return buf.combine(recv, handle, topk_weights=recv_w, config=combine_config if explicit else None)[:2]

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for explicit in (True, False):
        want, got = step(x, idx, w, explicit), compiled(x, idx, w, explicit)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


@pytest.mark.parametrize("fp8,ue8m0", [(False, False), (True, False), (True, True)])
def test_small_layout_places_parts_as_the_gpu_plan(fp8, ue8m0):
    """The places the traced code cuts its views from are those of the GPU dispatch plan's one allocation
    (``DispatchPlan.small`` in ops/low_latency/plans.py: counts, source info, layout ranges, scales, and
    the row map after them), so that on the GPU the op returns that allocation without a copy."""
    from deepep_cupy.frameworks import F32, I32, I64, SmallOutputs

    for num_ranks, t_max, num_experts, hidden in [(2, 128, 288, 7168), (8, 3, 16, 2048), (4, 1, 4, 512)]:
        e_local, slab = num_experts // num_ranks, num_ranks * t_max
        specs = [((e_local,), I32), ((e_local, slab), I32), ((e_local, num_ranks), I64)]
        if fp8:
            specs.append(((e_local, -(-hidden // 512) if ue8m0 else hidden // 128, slab), I32 if ue8m0 else F32))
        plan = SmallOutputs([*specs, ((slab, e_local), I32)])
        parts, words = traced_ll.small_layout(num_ranks, t_max, num_experts, hidden, fp8, ue8m0)
        assert list(parts) == [(shape, dtype.name, strides, offset) for shape, dtype, strides, offset in
                               plan.parts[:len(specs)]]
        assert words == SmallOutputs(specs).total_words


def test_compiled_with_dynamic_shapes(buf):
    def step(x, idx, w):
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)
        combined = buf.low_latency_combine(recv[0].float().bfloat16(), idx, w, handle)[0]
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        recv, _, recv_w, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w, num_worst_tokens=T)
        return combined, count, buf.combine(recv, handle, topk_weights=recv_w)[:2]

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    for n in (T, 3, 5):
        x, idx, w = _inputs(10 + n, n)
        want, got = step(x, idx, w), compiled(x, idx, w)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
        assert all(torch.equal(a, b) for a, b in zip(want[2], got[2], strict=True))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_layout_cut_from_one_allocation(buf, monkeypatch, dynamic):
    """The layout op as it is on the GPU (one allocation, cut by the traced code; here the reference
    backend's outputs are copied into it), compiled with static and symbolic token counts."""
    monkeypatch.setattr(buf, "backend", "cuda")

    def step(idx):
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        return per_rdma, per_rank, per_expert, in_rank

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for n in (T, 3, 5):
        idx = _inputs(20 + n, n)[1]
        want, got = buf.runtime.get_dispatch_layout(idx, E)[:4], compiled(idx)
        assert got[0] is None and [t.dtype for t in got[1:]] == [torch.int32, torch.int32, torch.bool]
        assert all(torch.equal(a, b) for a, b in zip((want[0], want[2], want[3]), got[1:], strict=True))


def test_gpu_handles_come_back_as_the_ops_made_them():
    """On the GPU a handle rebuilt from an op's tensors gets back its class and host-side attributes (no
    index checks, the row map, the read-back counts); any other tensors give a plain tuple (checked)."""
    from types import SimpleNamespace

    from deepep_cupy.ops.handles import LowLatencyHandle, OpHandle

    gpu = SimpleNamespace(backend="cuda")

    class WithCounts(OpHandle):  # like IntranodeHandle: attributes in a __dict__
        pass

    for cls, attrs in ((OpHandle, {}), (WithCounts, {"counts": ((1, 2), (3, 4)), "own_tokens": None})):
        entries = [torch.arange(4, dtype=torch.int32) for _ in range(6)]
        made = tuple.__new__(cls, entries)
        if attrs:
            made.__dict__.update(attrs)
        traced_normal._remember(gpu, made)
        again = traced_normal._handle(gpu, list(entries))
        assert type(again) is cls and tuple(again) == tuple(entries) and getattr(again, "__dict__", {}) == attrs
        copied = [t.clone() for t in entries]
        assert type(traced_normal._handle(gpu, copied)) is tuple

    words = torch.arange(64, dtype=torch.int32)
    layout = traced_ll.small_layout(2, 4, 4, 256, False, False)
    small = common.pack([words[:2], words.as_strided((2, 8), (8, 1), 16),
                         words.view(torch.int64).as_strided((2, 2), (2, 1), 16)], layout)
    assert small.data_ptr() == words.data_ptr()  # already in place: no copy
    apart = [torch.arange(2, dtype=torch.int32), torch.arange(16, dtype=torch.int32).view(2, 8),
             torch.arange(4).view(2, 2)]
    copied = common.pack(apart, layout)  # separate tensors (the reference backend's): copied into one
    assert all(torch.equal(a, b) for a, b in zip(common.unpack(copied, layout), apart, strict=True))
    # A low-latency dispatch plan's handle: its pointers place it in the allocation, no view is cut, and
    # the combine gets back its owner, plan key and pointers (the row map's among them).
    from deepep_cupy.frameworks import I32, I64, SmallOutputs

    class Engine:
        pass

    plan = SmallOutputs([((2,), I32), ((2, 8), I32), ((2, 2), I64), ((8, 2), I32)])
    words = torch.zeros(plan.total_words, dtype=torch.int32)
    base = words.data_ptr()
    ptrs = tuple(base + plan.byte_offsets[i] for i in (1, 2, 3))
    cut, owner = [], Engine()
    frame = SimpleNamespace(part=lambda w, parts, i: cut.append(i))
    handle = LowLatencyHandle.of_dispatch(frame, words, plan, (4, 256, 4), ptrs, owner, ("key",))
    small = traced_ll._plan_small(handle, words[:2], None, layout)
    assert small.data_ptr() == base and small.shape == (layout[1],) and cut == []
    assert traced_ll._plan_small(handle, words[16:18], None, layout) is None  # elsewhere: not the plan's
    traced_ll._remember_ll(handle, small, layout)
    views = common.unpack(small, layout)
    again = traced_ll._handle(gpu, views[1], views[2], 4, 256, 4)
    assert type(again) is LowLatencyHandle and again.owner is owner and again.key == ("key",) and again.ptrs == ptrs
    assert type(traced_ll._handle(gpu, views[1].clone(), views[2], 4, 256, 4)) is tuple
    del owner, handle, again
    assert type(traced_ll._handle(gpu, views[1], views[2], 4, 256, 4)) is tuple  # its Buffer's engine is gone


def test_layout_parts_place_outputs_as_the_gpu_plan():
    """The GPU layout plan's outputs come from one allocation (``LayoutPlan`` in ops/layout.py); the op
    returns it whole and the traced code cuts the views where the plan placed them."""
    from deepep_cupy.frameworks import BOOL, I32, SmallOutputs

    for num_ranks, num_nvl, num_experts, num_tokens in [(8, 8, 256, 4096), (16, 8, 288, 7), (2, 2, 4, 0)]:
        specs = [((num_ranks,), I32), ((num_experts,), I32), ((num_tokens, num_ranks), BOOL)]
        if num_nvl < num_ranks:
            specs.append(((num_ranks // num_nvl,), I32))
        plan = SmallOutputs(specs)
        parts, words = traced_normal.layout_parts(num_ranks, num_experts, num_tokens, num_ranks // num_nvl)
        assert list(parts) == [(shape, dtype.name, strides, offset) for shape, dtype, strides, offset in plan.parts]
        assert words == plan.total_words
        allocation = torch.zeros(words, dtype=torch.int32)
        cut = common.unpack(allocation, (parts, words))
        assert common.pack(cut, (parts, words)).data_ptr() == allocation.data_ptr()
        assert [t.dtype for t in cut[:3]] == [torch.int32, torch.int32, torch.bool]


def test_other_methods_break_the_graph_and_run_eagerly():
    """Cleaning, rank masks, streams: a graph break each (an error with fullgraph=True), run eagerly."""
    b = Buffer(comm=ThreadGroup(_Shared(1, 60.0), 0, 1), backend="reference", low_latency_mode=True,
               num_rdma_bytes=RDMA_BYTES, enable_shrink=True, explicitly_destroy=True)
    oracle = b.runtime.oracle

    def step(x, status):
        b.clean_low_latency_buffer(T, H, E)
        b.low_latency_update_mask_buffer(0, True)
        b.low_latency_query_mask_buffer(status)
        b.low_latency_clean_mask_buffer()
        return x + 1, b.get_comm_stream(), Buffer.capture().event

    status = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(Exception, match="disable"):
        torch.compile(step, fullgraph=True, backend="aot_eager")(torch.zeros(2), status)
    oracle.clean_low_latency_buffer(T, H, E)
    oracle._combine_buffers[0][...] = 1
    assert torch.compile(step, backend="aot_eager")(torch.zeros(2), status)[1:] == (None, None)
    assert not oracle._combine_buffers[0].astype("float32").any() and status.tolist() == [1]
    assert not oracle._mask.any()
    b.destroy()


def test_compiled_code_refuses_an_outside_event(buf):
    x, idx, w = _inputs(6)
    event = EventOverlap(object())

    def step(idx):
        return buf.get_dispatch_layout(idx, E, previous_event=event)[0]

    with pytest.raises(Exception, match="previous_event"):
        _compile(step)(idx)


def test_ops_of_a_destroyed_buffer_name_it():
    with pytest.raises(RuntimeError, match="no longer exists"):
        common.buffer_of(10 ** 9)
    with pytest.raises(TypeError, match="config"):
        common.config_list((1, 2))


# ---------------------------------------------------------------------------------------------------- example
def _env():
    # Open MPI refuses to run as root without these; MPICH ignores them.
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def test_compiled_moe_example_one_rank():
    pytest.importorskip("mpi4py")
    got = subprocess.run([sys.executable, str(EXAMPLES / "compiled_moe.py"), "--tokens", "16"], capture_output=True,
                         text=True, timeout=300, env=_env())
    assert got.returncode == 0, got.stdout + got.stderr
    assert "all ranks match the dense layer" in got.stdout


def test_compiled_moe_example_under_mpiexec():
    pytest.importorskip("mpi4py")
    mpiexec = os.environ.get("MPIEXEC") or shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("no mpiexec on PATH (pip install -e '.[mpi]')")
    got = subprocess.run([mpiexec, "-n", "2", sys.executable, str(EXAMPLES / "compiled_moe.py"), "--tokens", "16"],
                         capture_output=True, text=True, timeout=400, env=_env())
    assert got.returncode == 0, got.stdout + got.stderr
    assert got.stdout.count(": OK") == 2 and "all ranks match the dense layer" in got.stdout


def test_dispatch_ops_leave_the_output_pool_only_inside_cuda_graph_trees(monkeypatch):
    """A compiled dispatch allocates like an eager one (the output pool, so direct mode) unless torch's
    CUDA-graph trees warm it up or record it, on their manager's own stream."""
    import types

    from deepep_cupy.custom_ops import common
    from deepep_cupy.device.output_pool import outputs_refused

    x = types.SimpleNamespace(is_cuda=True, device=types.SimpleNamespace(index=0))
    current = {"stream": 11}
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: current["stream"], raising=False)
    managers = {}
    trees = types.SimpleNamespace(get_manager=lambda index, create_if_none_exists=True: managers.get(index))
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", trees)

    def refused() -> bool:
        with common.dispatch_outputs(x):
            return outputs_refused()

    assert not refused()  # no tree manager on this device
    managers[0] = types.SimpleNamespace(stream=types.SimpleNamespace(cuda_stream=22))
    assert not refused()  # a manager, but the call runs on another stream (a plain compiled call, eager code)
    current["stream"] = 22
    assert refused() and common.graph_tree_running(0)  # warm-up or recording: outputs in the graph's pool
    x.is_cuda = False
    assert not refused()  # the reference backend's CPU tensors
    monkeypatch.delitem(sys.modules, "torch._inductor.cudagraph_trees")
    x.is_cuda = True
    assert not refused()

"""The argument blocks of the low-latency and layout plans: every field of the kernel's parameter struct
(read from its header, so a plan that gives a field the header does not have, or leaves one out, fails here),
and the values the plans put there."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from deepep_cupy.device import launch
from deepep_cupy.ops.low_latency import plans as lp
from deepep_cupy.ops.low_latency.buffer_map import REGIONS, LowLatencyBufferMap

SRC = Path(__file__).resolve().parents[2] / "cuda_src"


class _Kernel:
    name = "fake"

    class raw:  # noqa: N801 - mirrors jit.module.Kernel
        class kernel:  # noqa: N801
            ptr = 1


class _RecvKernel:
    name = "fake receive part"

    class raw:  # noqa: N801
        class kernel:  # noqa: N801
            ptr = 2


def _engine(staged: bool):
    buffer_map = LowLatencyBufferMap(32, 2048, 2, 16)
    return types.SimpleNamespace(
        num_ranks=2, rank=1, errors=types.SimpleNamespace(ptr=99, flag_word=lambda: 0), buffer_map=buffer_map,
        staged=staged, force_rma=False, enable_shrink=False, num_sms=132, early_receive=False,
        state_ptrs=({"seq": 1, "base": 2, "ready": 3, "mask": 4},) * 2,
        region_addresses=lambda _: ({n: 100 + i for i, n in enumerate(REGIONS)},) * 2,
        kernels=lambda *a, **k: (4, 2, 8, (_Kernel, _RecvKernel) if k.get("hook") else (_Kernel,), _Kernel),
        use_buffer_map=lambda _: None,
        rank_messages=lambda *a: not staged, rank_partials=lambda *a: not staged), buffer_map


def _names(path: Path, kernel: str) -> list[str]:
    """Field names of ``kernel``'s parameter struct, read from the header of its family, after a check that the
    kernel in ``path`` takes that struct as its one parameter."""
    import importlib
    import re

    family = path.parent.name
    module = "deepep_cupy.ops.layout" if family == "layout" else f"deepep_cupy.ops.{family}.args"
    struct = importlib.import_module(module).KERNEL_STRUCTS[kernel]
    text = re.sub(r"//[^\n]*", "", path.read_text())
    assert re.search(r"__global__[^;{]*?\b" + kernel + r"\(\s*const __grid_constant__ " + struct.name + r" args\)",
                     text), f"{kernel} in {path} does not take {struct.name}"
    return list(struct.names)


@pytest.mark.parametrize("staged", [False, True])
def test_low_latency_dispatch_block_matches_the_kernel(staged):
    engine, buffer_map = _engine(staged)
    plan = lp.DispatchPlan(engine, None, buffer_map, num_tokens=8, topk=4, use_fp8=True, round_scale=False,
                           use_ue8m0=False, return_recv_hook=False, wait_stats_row=0, async_finish=False,
                           comm_stream=0)
    assert plan.plans[0].names == _names(SRC / "low_latency" / "dispatch.cu", "dispatch")
    assert plan.plans[0].value("rank_msgs") == int(not staged)
    assert bool(plan.stages) == staged  # per-(token, rank) messages never read the staging area
    # The row map (the last small output, after the FP8 scales) only where a combine of this shape sends
    # partial sums (the fake engine's rank_partials says so unless staged).
    assert plan.row_map == (not staged) and len(plan.small.parts) == (4 if staged else 5)
    if staged:
        assert plan.stages[0].names == _names(SRC / "low_latency" / "dispatch.cu", "stage")


@pytest.mark.parametrize("partials", [False, True])
def test_low_latency_combine_block_matches_the_kernel(partials):
    engine, buffer_map = _engine(not partials)
    asked = []
    engine.kernels = lambda *a, **k: asked.append((a, k)) or (4, 2, 8, (_Kernel, _RecvKernel), None)
    plan = lp.CombinePlan(engine, None, buffer_map, num_tokens=8, topk=4, use_logfmt=False, zero_copy=True,
                          return_recv_hook=True, wait_stats_row=1, async_finish=False, comm_stream=0)
    assert plan.plans[1].names == _names(SRC / "low_latency" / "combine.cu", "combine")
    # The partial-sum path is its own kernel, with its row table in dynamic shared memory.
    assert asked == [(("combine", 2048, 4, 16, False, partials), {"hook": True})]
    assert plan.plans[1].shared_mem == (buffer_map.partial_table_bytes(4) if partials else 0)
    assert plan.plans[1].value("x") == 100 + REGIONS.index("send")  # zero-copy sends from the send area
    assert plan.wait_offset == 8 * 2 * 1  # this rank's row of an [R, R] stats tensor


@pytest.mark.parametrize("partials", [False, True])
def test_combine_takes_the_row_map_of_a_dispatch_handle(monkeypatch, partials):
    """The partial-sum combine reads the row map a dispatch's handle carries; a handle rebuilt as a plain tuple
    (or a combine without partial sums) passes none, and the kernel then uses the handle's source info."""
    from deepep_cupy.ops.handles import LowLatencyHandle

    engine, buffer_map = _engine(not partials)
    engine.kernels = lambda *a, **k: (4, 2, 8, (_Kernel, _RecvKernel), None)
    engine.check_errors = lambda: None
    engine.next_buffer = lambda: 0
    ptrs = {}
    frame = types.SimpleNamespace(ptr=lambda t: ptrs[id(t)], stream=lambda: 0, framework="cupy", device_id=0)
    plan = lp.CombinePlan(engine, frame, buffer_map, num_tokens=8, topk=4, use_logfmt=False, zero_copy=True,
                          return_recv_hook=True, wait_stats_row=0, async_finish=False, comm_stream=0)
    monkeypatch.setattr(lp.LaunchPlan, "launch", lambda self, stream: None)
    _record_stream_order(monkeypatch, [])
    src_info, layout_range, row_map, x, topk, weights, out = (object() for _ in range(7))
    ptrs.update({id(o): 1000 * (i + 1) for i, o in enumerate((src_info, layout_range, row_map, x, topk, weights, out))})
    handle = LowLatencyHandle((src_info, layout_range, 32, 2048, 16), row_map)
    assert tuple(handle) == (src_info, layout_range, 32, 2048, 16) and len(handle) == 5
    plan.run(x, topk, weights, handle, out=out)
    assert plan.plans[0].value("row_map") == (ptrs[id(row_map)] if partials else 0)
    assert plan.plans[0].value("src_info") == ptrs[id(src_info)]
    plan.run(x, topk, weights, tuple(handle), out=out)
    assert plan.plans[0].value("row_map") == 0


@pytest.mark.parametrize("hook", [False, True])
def test_a_hook_launches_the_receive_kernel_over_the_same_block(monkeypatch, hook):
    """With a receive hook the send part launches the send-only kernel and the hook the receive-only one,
    both over the half's one argument block (the call's pointers); without, one kernel does both."""
    plan, launched = _logged_dispatch_plan(monkeypatch, hook, half=1)
    *_, recv_hook = plan.run(object(), object())
    if not hook:
        assert recv_hook is None and launched == [(_Kernel, 7, lp.PHASE_SEND | lp.PHASE_RECV)]
        return
    # The send runs on the communication stream after the caller's work; its half's join point follows it.
    assert launched == [("fork", 5, 7), (_Kernel, 5, lp.PHASE_SEND), ("mark", 5)]
    assert plan.recv_plans[1].value("out_x") == plan.plans[1].value("out_x") == 4096
    plan.plans[1].set(out_x=8192)  # one block: a patch to either plan is seen by both
    assert plan.recv_plans[1].value("out_x") == 8192
    recv_hook()
    recv_hook()  # a second call does nothing
    # The receive, on the caller's stream, after that stream has waited for the send.
    assert launched[3:] == [("wait", 7), (_RecvKernel, 7, lp.PHASE_RECV)]


def _logged_dispatch_plan(monkeypatch, hook: bool, half: int, early: bool = False):
    """An FP8 dispatch plan on the caller's stream 7 and the communication stream 5, every call on buffer half
    ``half``, whose launches and stream forks and joins go to the returned log. ``early``: with early
    receives, on the hook streams 20 and 21 (their waits and watches logged too)."""
    engine, buffer_map = _engine(False)
    engine.check_errors = lambda: None
    engine.next_buffer = engine.peek_next_buffer = lambda: half
    engine.early_receive = early
    engine.hook_streams = types.SimpleNamespace(ptr=lambda i: 20 + i)
    launched = []
    engine.watchdog = lambda: types.SimpleNamespace(watch=lambda *a: launched.append(("watch",) + a))
    monkeypatch.setattr(lp, "wait_value_geq", lambda *a: launched.append(("wait_value",) + a))
    frame = types.SimpleNamespace(ptr=lambda t: 4096, stream=lambda: 7, framework="cupy", device_id=0,
                                  empty=lambda *a: object(), empty_words=lambda parts: object(),
                                  part=lambda words, parts, i: object())
    monkeypatch.setattr(lp.LaunchPlan, "launch", lambda self, stream: launched.append(
        (self.kernel, stream, self.value("phases")) + ((self.value("count_sends"),) if early else ())))
    _record_stream_order(monkeypatch, launched)
    plan = lp.DispatchPlan(engine, frame, buffer_map, num_tokens=8, topk=4, use_fp8=True, round_scale=False,
                           use_ue8m0=False, return_recv_hook=hook, wait_stats_row=0, async_finish=False,
                           comm_stream=5)
    return plan, launched


def _record_stream_order(monkeypatch, log):
    """The plans' stream forks and joins appended to ``log`` (no GPU: nothing is recorded or waited, and no
    stream is being captured)."""
    monkeypatch.setattr(lp._Plan, "_capturing", staticmethod(lambda stream: False))
    monkeypatch.setattr(lp.ForkJoin, "fork_onto", lambda self, comm, compute: log.append(("fork", comm, compute)))
    monkeypatch.setattr(lp.ForkJoin, "mark_join", lambda self, comm: log.append(("mark", comm)))
    monkeypatch.setattr(lp.ForkJoin, "wait_join", lambda self, compute: log.append(("wait", compute)))


def test_hook_kernels_hold_only_their_phase():
    """A hook's parts are modules compiled with only their own phase (``DEEPEP_CUPY_LL_PHASES``), the receive
    part with only the per-rank message path where the host chose that format; without a hook one module
    has both. Every part's kernel has the op's one name (a profile shows one dispatch and one combine row),
    and only the sending module holds the staging kernel."""
    from deepep_cupy.ops.low_latency import engine as ll

    name = "deepep_cupy::low_latency::dispatch<7168, 8, 8, 3, true>"
    (both,) = ll.dispatch_specs(7168, 8, 8, 3, True)
    assert both.name_expressions == (name, ll.stage_kernel_name(7168, True))
    assert dict(both.defines) == {"DEEPEP_CUPY_LL_PHASES": "3", "DEEPEP_CUPY_LL_RANK_MSGS_ONLY": "0"}
    send, recv = ll.dispatch_specs(7168, 8, 8, 3, True, hook=True, rank_msgs=True)
    assert send.name_expressions[0] == recv.name_expressions[0] == name
    assert recv.name_expressions == (name,) and send.name_expressions[-1] == ll.stage_kernel_name(7168, True)
    assert dict(send.defines) == {"DEEPEP_CUPY_LL_PHASES": "1", "DEEPEP_CUPY_LL_RANK_MSGS_ONLY": "0"}
    assert dict(recv.defines) == {"DEEPEP_CUPY_LL_PHASES": "2", "DEEPEP_CUPY_LL_RANK_MSGS_ONLY": "1"}
    assert dict(ll.dispatch_specs(7168, 8, 8, 3, False, hook=True)[1].defines)["DEEPEP_CUPY_LL_RANK_MSGS_ONLY"] == "0"
    parts = ll.combine_specs(7168, 8, 8, 3, True, True, hook=True)
    assert [dict(p.defines)["DEEPEP_CUPY_LL_PHASES"] for p in parts] == ["1", "2"]
    assert parts[0].name_expressions == parts[1].name_expressions == (
        "deepep_cupy::low_latency::combine<7168, 8, 8, 3, true, true>",)


def test_layout_block_matches_the_kernel(monkeypatch):
    from deepep_cupy.ops import layout

    monkeypatch.setattr(layout, "load", lambda spec: types.SimpleNamespace(get_function=lambda name: _Kernel))
    plan = layout.LayoutPlan(None, num_tokens=8, num_topk=4, num_experts=16, num_ranks=2, num_nvl_ranks=1, rank=0,
                             errors=types.SimpleNamespace(ptr=5), comm_stream=0, async_finish=False)
    assert plan.plan.names == _names(SRC / "layout" / "count_tokens.cu", "count_tokens")
    assert plan.plan.value("num_nvl_ranks") == 1 and plan.has_rdma


def test_launch_module_is_importable_without_a_driver():
    assert launch.LAUNCHER in (None, "bindings", "ctypes")


@pytest.mark.parametrize("row_map", [False, True])
def test_a_dispatch_handle_cuts_its_tensors_where_the_kernel_writes(monkeypatch, row_map):
    """The dispatch hands the kernel pointers into one allocation and cuts only the counts and the scales
    into views; the handle cuts its source info, layout ranges and row map on first use, at exactly the
    addresses the kernel wrote, and a combine reads the pointers without cutting them."""
    torch = pytest.importorskip("torch")
    from deepep_cupy.frameworks import TorchFrame
    from deepep_cupy.ops.handles import LowLatencyHandle

    engine, buffer_map = _engine(not row_map)
    engine.check_errors = lambda: None
    engine.next_buffer = lambda: 0
    frame = TorchFrame(0, device="cpu")
    frame.stream = lambda: 0
    monkeypatch.setattr(lp.LaunchPlan, "launch", lambda self, stream: None)
    plan = lp.DispatchPlan(engine, frame, buffer_map, num_tokens=8, topk=4, use_fp8=True, round_scale=False,
                           use_ue8m0=False, return_recv_hook=False, wait_stats_row=0, async_finish=False,
                           comm_stream=0)
    x, topk = torch.zeros(8, 2048, dtype=torch.bfloat16), torch.zeros(8, 4, dtype=torch.int64)
    plan.run(x, topk)  # the first call works out the handles' key part (from the tensors)
    (recv_x, scales), count, handle, _, _ = plan.run(x, topk)
    block = plan.plans[0]
    assert type(handle) is LowLatencyHandle and handle._entries is None  # nothing cut yet
    assert count.data_ptr() == block.value("out_count") and tuple(count.shape) == (8,)
    assert scales.data_ptr() == block.value("out_scales") and tuple(scales.shape) == (8, 64, 16)
    assert scales.stride() == (16 * 64, 1, 64)  # column-major in its last two dimensions
    assert handle.ptrs == (block.value("out_src_info"), block.value("out_layout_range"), block.value("out_row_map"))
    src_info, layout_range, t, hidden, experts = handle
    assert (t, hidden, experts) == (32, 2048, 16) and len(handle) == 5
    assert src_info.data_ptr() == block.value("out_src_info") and tuple(src_info.shape) == (8, 64)
    assert src_info.dtype == torch.int32 and src_info.is_contiguous()
    assert layout_range.data_ptr() == block.value("out_layout_range") and layout_range.dtype == torch.int64
    assert tuple(layout_range.shape) == (8, 2) and handle[0] is src_info
    if row_map:
        assert handle.row_map.data_ptr() == block.value("out_row_map") and tuple(handle.row_map.shape) == (64, 8)
    else:
        assert handle.row_map is None and block.value("out_row_map") == 0
    # Every part its own bytes: filling one leaves the others as they were.
    parts = [count, src_info, layout_range, scales] + ([handle.row_map] if row_map else [])
    for i, t in enumerate(parts):
        t.view(torch.int32).fill_(i + 1) if t.dtype == torch.int64 else t.fill_(i + 1)
    for i, t in enumerate(parts):
        assert bool((t.view(torch.int32) if t.dtype == torch.int64 else t).eq(i + 1).all())

    # A combine reads the handle's pointers; its tensors stay uncut.
    engine.kernels = lambda *a, **k: (4, 2, 8, (_Kernel,), None)
    combine = lp.CombinePlan(engine, frame, buffer_map, num_tokens=8, topk=4, use_logfmt=False,
                             zero_copy=False, return_recv_hook=False, wait_stats_row=0, async_finish=False,
                             comm_stream=0)
    _, _, fresh, _, _ = plan.run(x, topk)
    out = combine.run(torch.zeros(8, 64, 2048, dtype=torch.bfloat16), topk, torch.zeros(8, 4), fresh)[0]
    assert fresh._entries is None and tuple(out.shape) == (8, 2048)
    assert combine.plans[0].value("src_info") == fresh.ptrs[0] and combine.plans[0].value("layout_range") == fresh.ptrs[1]
    assert combine.plans[0].value("row_map") == (fresh.ptrs[2] if row_map else 0)


def test_a_hook_send_under_capture_stays_on_the_callers_stream(monkeypatch):
    """While the caller's stream is being captured the send runs on it (a capture may end before the hook, and
    must not leave the communication stream forked off), and the hook receives without a join."""
    plan, launched = _logged_dispatch_plan(monkeypatch, True, half=0)
    monkeypatch.setattr(lp._Plan, "_capturing", staticmethod(lambda stream: stream == 7))
    *_, recv_hook = plan.run(object(), object())
    recv_hook()
    assert launched == [(_Kernel, 7, lp.PHASE_SEND), (_RecvKernel, 7, lp.PHASE_RECV)]


@pytest.mark.parametrize("half", [0, 1])
def test_an_early_receive_is_queued_behind_the_send_count(monkeypatch, half):
    """With early receives the send counts itself (count_sends), and the receive follows it on the half's own
    stream behind a wait for every rank's count, watched until its join point completes; the hook only joins
    the caller's stream (and a second call of it does nothing)."""
    plan, launched = _logged_dispatch_plan(monkeypatch, True, half=half, early=True)
    *_, recv_hook = plan.run(object(), object())
    stream, sent = 20 + half, plan.sent[half]
    assert sent == plan.regions[half]["receipts"] + 4 * 2
    assert launched == [("fork", stream, 7), (_Kernel, stream, lp.PHASE_SEND, 1), ("wait_value", stream, sent, 2),
                        (_RecvKernel, stream, lp.PHASE_RECV, 1), ("mark", stream),
                        ("watch", half, plan.joins[half].join, sent, 2, plan.joins[half])]
    del launched[:]
    recv_hook()
    recv_hook()
    assert launched == [("wait", 7)]


def test_an_early_receive_is_not_taken_under_capture(monkeypatch):
    """Under a capture the send stays on the caller's stream, uncounted, and the hook receives there."""
    plan, launched = _logged_dispatch_plan(monkeypatch, True, half=0, early=True)
    monkeypatch.setattr(lp._Plan, "_capturing", staticmethod(lambda stream: stream == 7))
    *_, recv_hook = plan.run(object(), object())
    recv_hook()
    assert launched == [(_Kernel, 7, lp.PHASE_SEND, 0), (_RecvKernel, 7, lp.PHASE_RECV, 0)]

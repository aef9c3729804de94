"""Launch plans of the low-latency dispatch and combine: everything that depends only on shapes, dtypes
and flags is fixed when a plan is made; a call allocates its outputs in the caller's framework, patches
the pointers that changed and launches.

A plan keeps one argument block per buffer half (the region addresses and per-half state differ), so a
call never rebuilds constant arguments, and a receive hook relaunches the block of its own half with
the pointers of its own call (at most two results are held at once, one per half, as in DeepEP).
"""

from __future__ import annotations

from ...device.launch import LaunchPlan
from ...device.stream_wait import wait_value_geq
from ...device.streams import ForkJoin, OpStreams, stream_is_capturing
from ...event import EventOverlap
from ...frameworks import BF16, F32, FP8, I32, I64, SmallOutputs
from ..handles import LowLatencyHandle, foreign_handle, ll_handle_meta
from .args import COMBINE, DISPATCH, STAGE
from .engine import PHASE_RECV, PHASE_SEND, STAGE_THREADS, timeout_ns

__all__ = ["DispatchPlan", "CombinePlan"]

_BOTH = PHASE_SEND | PHASE_RECV


class _Hook:
    """Completes the receive of one call once; later calls do nothing. ``plan``: the receive part's launch
    plan, or None where the receive was queued with the send (an early receive). Its argument block (shared
    by the half's send and receive plans) still holds the call's pointers: only the next call on the same
    half (which the two-results rule forbids before the hook ran) would change them.

    Where the send (or the early receive) ran on a stream other than the caller's, ``join`` is its half's
    join point: the caller's stream waits for it first, and ``keep`` (the arrays the send and receive read or
    write) stays referenced until then, so that the caller's allocator cannot hand their memory out while
    they may still be used."""

    __slots__ = ("_plan", "_stream", "_join", "_keep")

    def __init__(self, plan: LaunchPlan | None, stream: int, join: ForkJoin | None = None, keep=None) -> None:
        self._plan = plan
        self._stream = stream
        self._join = join
        self._keep = keep

    def __call__(self) -> None:
        stream, self._stream = self._stream, None
        if stream is None:
            return
        if self._join is not None:
            self._join.wait_join(stream)
        plan = self._plan
        if plan is not None:
            plan.slot("phases").value = PHASE_RECV
            plan.launch(stream)
        self._plan = self._keep = self._join = None


class _Plan:
    """What both low-latency plans share: engine, frame, buffer map and the stream choreography."""

    def __init__(self, engine, frame, buffer_map, async_finish: bool, comm_stream: int, hook: bool) -> None:
        self.engine = engine
        self.frame = frame
        self.buffer_map = buffer_map
        self.async_finish = bool(async_finish)
        self.comm_stream = comm_stream
        self.hook = bool(hook)
        # A hook-mode send (without async_finish) runs on the communication stream, beside whatever the
        # caller queues next, and its hook joins back before the receive: one fork per plan (recorded and
        # waited at once), one join point per buffer half (a half's next call comes only after its hook).
        self.fork = ForkJoin() if self.hook and not self.async_finish else None
        self.joins = (ForkJoin(), ForkJoin()) if self.fork is not None else None
        # An early receive (engine.early_receive): each half's send and receive on that half's own stream,
        # the receive behind a stream wait for every source's send count (receipts.cuh count_send).
        self.early = self.fork is not None and engine.early_receive
        self.regions = engine.region_addresses(buffer_map)
        self.sent = tuple(r["receipts"] + buffer_map.sent_offset for r in self.regions)

    _capturing = staticmethod(stream_is_capturing)

    def _begin(self) -> tuple[int, int, object]:
        """Check for errors recorded by earlier launches, make the buffer map current (a collective clean
        if another buffer map was used since), and choose the streams: ``(send, receive, streams)``. Both
        are the caller's stream for a plain call; with ``async_finish`` both are the communication stream,
        after the caller's, and ``streams`` ends the op; in hook mode the send runs on the communication
        stream and the receive on the caller's."""
        engine = self.engine
        engine.check_errors()  # a load of the host-mapped flag word unless something was recorded
        if engine.buffer_map is not self.buffer_map:
            engine.use_buffer_map(self.buffer_map)
        compute = self.frame.stream()
        # Not under a CUDA-graph capture: a capture may end before the hook (a graph per part), and one
        # must not end with the communication stream forked off and unjoined.
        if self.fork is not None and not self._capturing(compute):
            send = self.engine.hook_streams.ptr(self.engine.peek_next_buffer()) if self.early else self.comm_stream
            self.fork.fork_onto(send, compute)
            return send, compute, None
        if not self.async_finish:
            return compute, compute, None
        streams = OpStreams(self.comm_stream, compute, self.frame.framework, self.frame.device_id, None, True)
        return self.comm_stream, self.comm_stream, streams

    def _half_plan(self, kernels, blocks: int, threads: int, struct, args: dict, shared_mem: int = 0) -> LaunchPlan:
        """Half plan(s) from the kernels of ``kernel_phases(self.hook)``: the launch plan, and with a hook
        the receive part's plan over the same argument block (kept in ``self.recv_plans``)."""
        plan = LaunchPlan(kernels[0], blocks, threads, struct, args, shared_mem=shared_mem)
        self.recv_plans.append(plan.with_kernel(kernels[1]) if self.hook else None)
        self.count_slots.append(plan.slot("count_sends"))
        return plan

    def _launch(self, b: int, phases, stream: int, receive_stream: int, keep):
        """Launch half ``b``'s both phases on ``stream``, or with a receive hook only the send phase; return
        the hook (which receives on ``receive_stream``) or None. ``keep``: what the send reads or writes.
        (The kernels hold only their phases' code; the ``phases`` argument says the same.)"""
        plan = self.plans[b]
        if self.hook:
            forked = self.joins is not None and stream != receive_stream
            early = forked and self.early
            self.count_slots[b].value = int(early)
            phases.value = PHASE_SEND
            plan.launch(stream)
            if not forked:
                return _Hook(self.recv_plans[b], receive_stream)
            join = self.joins[b]
            if early:  # the receive now, on the send's stream, once every source has counted its send
                engine = self.engine
                wait_value_geq(stream, self.sent[b], engine.num_ranks)
                phases.value = PHASE_RECV
                self.recv_plans[b].launch(stream)
                join.mark_join(stream)
                engine.watchdog().watch(b, join.join, self.sent[b], engine.num_ranks, join)
                return _Hook(None, receive_stream, join, keep)
            join.mark_join(stream)
            return _Hook(self.recv_plans[b], receive_stream, join, keep)
        phases.value = _BOTH
        plan.launch(stream)
        return None

    @staticmethod
    def _end(streams, keep) -> EventOverlap:
        """The op's event; with ``async_finish`` it also keeps ``keep`` (what the communication stream
        still uses) alive until the caller is done with the event."""
        if streams is None:
            return EventOverlap(None)
        return EventOverlap(streams.finish(), keep)

    def _common_args(self, b: int) -> tuple[dict, dict, dict]:
        """Half ``b``'s region addresses, its state addresses, and the sizes both kernels take."""
        engine, r = self.engine, self.regions[b]
        state = engine.state_ptrs[b]
        return r, state, dict(num_experts=self.buffer_map.num_experts, num_ranks=engine.num_ranks,
                              rank=engine.rank, sym_sent=self.sent[b], count_sends=0)


class DispatchPlan(_Plan):
    """``low_latency_dispatch`` for one (framework, N, H, K, T, E, flags)."""

    def __init__(self, engine, frame, buffer_map, *, num_tokens: int, topk: int, use_fp8: bool,
                 round_scale: bool, use_ue8m0: bool, return_recv_hook: bool, wait_stats_row: int,
                 async_finish: bool, comm_stream: int) -> None:
        super().__init__(engine, frame, buffer_map, async_finish, comm_stream, return_recv_hook)
        hidden, num_experts = buffer_map.hidden, buffer_map.num_experts
        t_max = buffer_map.num_max_dispatch_tokens_per_rank
        self.num_tokens, self.hidden, self.t_max, self.num_experts = num_tokens, hidden, t_max, num_experts
        self.use_fp8, self.use_ue8m0 = bool(use_fp8), bool(use_ue8m0) and bool(use_fp8)
        round_scale = (bool(round_scale) or self.use_ue8m0) and self.use_fp8
        self.num_ranks = engine.num_ranks
        self.e_local = num_experts // engine.num_ranks
        self.slab = engine.num_ranks * t_max
        # Byte offset of this rank's row in a [R, R] wait-stats tensor (0 for a [R] one).
        self.wait_offset = 8 * engine.num_ranks * engine.rank * wait_stats_row
        # One message per (token, rank) where every rank is reached by stores and the tables fit
        # (dispatch_ranks.cuh); the same decision on every rank.
        self.rank_msgs = engine.rank_messages(buffer_map, topk, self.use_fp8)
        warps, groups, blocks, kernels, stage = engine.kernels("dispatch", hidden, topk, num_experts, self.use_fp8,
                                                               self.rank_msgs, hook=self.hook)
        # The row map is written only where a combine of this shape sends partial sums (in either format):
        # elsewhere nothing reads it.
        self.row_map = (engine.rank_partials(buffer_map, topk, False)
                        or engine.rank_partials(buffer_map, topk, True))
        # Over stores the send phase splits (token, segment) items over the whole grid, and the receive
        # phase's units loop over the groups: one block per SM (all resident, as the waits need).
        if self.use_fp8 or self.rank_msgs:  # BF16 per-expert rows keep their own grid (dispatch.cu)
            blocks = max(blocks, engine.num_sms)
        self.plans, self.recv_plans, self.count_slots, self.stages = [], [], [], []
        for b in (0, 1):
            r, state, common = self._common_args(b)
            args = dict(
                x=None, topk_idx=None, num_tokens=num_tokens, max_tokens=t_max, **common, sym_tags=r["tags"],
                sym_arrivals=r["arrivals"], sym_receipts=r["receipts"], sym_src_idx=r["src_idx"], sym_recv=r["recv"], sym_stage=r["send"],
                seq_state=state["seq"], arrival_base=state["base"], mask=state["mask"], out_x=None, out_scales=0,
                out_scales_ue8m0=0, out_count=None, out_src_info=None, out_row_map=0, out_layout_range=None,
                cumulative_recv_stats=0, wait_recv_cost_stats=0, phases=_BOTH, staged=int(engine.staged),
                force_rma=int(engine.force_rma), rank_msgs=int(self.rank_msgs), round_scale=int(round_scale),
                use_ue8m0=int(self.use_ue8m0), shrink=int(engine.enable_shrink), timeout_ns=timeout_ns(),
                err=engine.errors.ptr)
            self.plans.append(self._half_plan(kernels, blocks, warps * groups * 32, DISPATCH, args))
            if engine.staged and not self.rank_msgs and num_tokens > 0:
                stage_blocks = max(1, min(-(-num_tokens // (STAGE_THREADS // 32)), engine.num_sms))
                self.stages.append(LaunchPlan(stage, stage_blocks, STAGE_THREADS, STAGE, dict(
                    x=None, num_tokens=num_tokens, sym_stage=r["send"], round_scale=int(round_scale))))
        scales_slot = "out_scales_ue8m0" if self.use_ue8m0 else "out_scales"
        names = ("x", "topk_idx", "out_x", scales_slot, "out_count", "out_src_info", "out_row_map", "out_layout_range",
                 "cumulative_recv_stats", "wait_recv_cost_stats", "phases")
        self.slots = [tuple(p.slot(n) for n in names) for p in self.plans]
        self.num_scales = -(-hidden // 512) if self.use_ue8m0 else hidden // 128
        self.recv_shape, self.recv_dtype = (self.e_local, self.slab, hidden), FP8 if self.use_fp8 else BF16
        self.handle_key = None
        # Counts, source info, layout ranges, the scales (handed out column-major) and the row map (the
        # inverse of the source info, which the partial-sum combine reads: indexing.cuh record_row) come
        # from one allocation.
        small = [((self.e_local,), I32), ((self.e_local, self.slab), I32), ((self.e_local, self.num_ranks), I64)]
        if self.use_fp8:
            small.append(((self.e_local, self.num_scales, self.slab), I32 if self.use_ue8m0 else F32, True))
        if self.row_map:
            small.append(((self.slab, self.e_local), I32))
        self.small = SmallOutputs(small)
        offsets = self.small.byte_offsets
        self.src_offset, self.range_offset = offsets[1], offsets[2]
        self.scales_offset = offsets[3] if self.use_fp8 else 0
        self.map_offset = offsets[-1] if self.row_map else 0
        self.sizes = (t_max, hidden, num_experts)

    def run(self, x, topk_idx, cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None):
        stream, receive_stream, streams = self._begin()
        frame, small = self.frame, self.small
        ptr = frame.ptr
        recv_x = frame.empty(self.recv_shape, self.recv_dtype)
        words = frame.empty_words(small)
        b = self.engine.next_buffer()
        s_x, s_topk, s_out, s_scales, s_count, s_src, s_map, s_range, s_cum, s_wait, s_phases = self.slots[b]
        x_ptr = s_x.value = ptr(x)
        s_topk.value = ptr(topk_idx)
        s_out.value = ptr(recv_x)
        # The kernels' pointers come from the allocation's address; only what the call hands out now (the
        # counts and the scales) is cut into views: the handle cuts its own when asked.
        base = ptr(words)
        s_count.value = base
        src = s_src.value = base + self.src_offset
        rng = s_range.value = base + self.range_offset
        count = frame.part(words, small, 0)
        if self.use_fp8:
            s_scales.value = base + self.scales_offset
            recv = (recv_x, frame.part(words, small, 3))  # column-major: the kernel writes [E_local, scales, R * T]
        else:
            recv = recv_x
        row_map = s_map.value = base + self.map_offset if self.row_map else 0
        if cumulative_local_expert_recv_stats is not None or s_cum.value:
            s_cum.value = 0 if cumulative_local_expert_recv_stats is None else ptr(cumulative_local_expert_recv_stats)
        if dispatch_wait_recv_cost_stats is not None or s_wait.value:
            s_wait.value = 0 if dispatch_wait_recv_cost_stats is None else \
                ptr(dispatch_wait_recv_cost_stats) + self.wait_offset
        if self.stages:
            stage = self.stages[b]
            stage.slot("x").value = x_ptr
            stage.launch(stream)
        hook = self._launch(b, s_phases, stream, receive_stream, (x, topk_idx, recv_x, words))
        handle = LowLatencyHandle.of_dispatch(frame, words, small, self.sizes, (src, rng, row_map), self.engine,
                                              self.handle_key)
        if self.handle_key is None:  # the same for every handle this plan makes
            self.handle_key = handle.key = ll_handle_meta(handle)
        if streams is None:
            return recv, count, handle, EventOverlap(None), hook
        return recv, count, handle, self._end(streams, (x, topk_idx, recv, count, handle)), hook


class CombinePlan(_Plan):
    """``low_latency_combine`` for one (framework, N, H, K, T, E, flags)."""

    def __init__(self, engine, frame, buffer_map, *, num_tokens: int, topk: int, use_logfmt: bool,
                 zero_copy: bool, return_recv_hook: bool, wait_stats_row: int, async_finish: bool,
                 comm_stream: int) -> None:
        super().__init__(engine, frame, buffer_map, async_finish, comm_stream, return_recv_hook)
        hidden, num_experts = buffer_map.hidden, buffer_map.num_experts
        t_max = buffer_map.num_max_dispatch_tokens_per_rank
        self.num_tokens, self.hidden = num_tokens, hidden
        self.zero_copy = bool(zero_copy)
        self.wait_offset = 8 * engine.num_ranks * engine.rank * wait_stats_row
        # Per-rank partial sums (float32, or LogFMT with use_logfmt) where they pay and fit
        # (combine_partials.cuh), never in hook mode (their send waits for the peers); the same decision on
        # every rank, since an owner reads the format its sources write.
        self.partials = engine.rank_partials(buffer_map, topk, bool(use_logfmt), self.hook)
        warps, groups, blocks, kernels, _ = engine.kernels("combine", hidden, topk, num_experts, bool(use_logfmt),
                                                           self.partials, hook=self.hook)
        # Every phase loops over the grid's groups or warps, so the grid may cover all SMs (one block each,
        # all resident): the LogFMT encode is compute-bound and the reduction gains warps.
        blocks = max(blocks, engine.num_sms)
        shared = buffer_map.partial_table_bytes(topk) if self.partials else 0
        self.plans, self.recv_plans, self.count_slots = [], [], []
        for b in (0, 1):
            r, state, common = self._common_args(b)
            args = dict(
                x=r["send"] if zero_copy else None, src_info=None, layout_range=None, row_map=0, topk_idx=None,
                topk_weights=None, num_tokens=num_tokens, max_tokens=t_max, **common, sym_tags=r["tags"],
                sym_arrivals=r["arrivals"], sym_receipts=r["receipts"], sym_done=r["src_idx"], sym_recv=r["recv"], sym_send=r["send"],
                seq_state=state["seq"], arrival_base=state["base"], ready=state["ready"], mask=state["mask"],
                out=None, wait_recv_cost_stats=0, phases=_BOTH, zero_copy=int(zero_copy),
                force_rma=int(engine.force_rma), shrink=int(engine.enable_shrink), timeout_ns=timeout_ns(),
                err=engine.errors.ptr)
            self.plans.append(self._half_plan(kernels, blocks, warps * groups * 32, COMBINE, args, shared_mem=shared))
        names = ("x", "src_info", "layout_range", "row_map", "topk_idx", "topk_weights", "out",
                 "wait_recv_cost_stats", "phases")
        self.slots = [tuple(p.slot(n) for n in names) for p in self.plans]
        self.out_shape = (num_tokens, hidden)

    def run(self, x, topk_idx, topk_weights, handle, out=None, combine_wait_recv_cost_stats=None):
        owner = getattr(handle, "owner", None)  # None: a handle the caller built (its values are checked)
        if owner is not self.engine and owner is not None:
            raise foreign_handle()
        stream, receive_stream, streams = self._begin()
        frame = self.frame
        ptr = frame.ptr
        if out is None:
            out = frame.empty(self.out_shape, BF16)
        b = self.engine.next_buffer()
        s_x, s_src, s_range, s_map, s_topk, s_w, s_out, s_wait, s_phases = self.slots[b]
        if not self.zero_copy:
            s_x.value = ptr(x)
        ptrs = None if owner is None else handle.ptrs
        if ptrs is not None:  # a dispatch's handle as it was returned
            s_src.value, s_range.value, row_map = ptrs
        else:
            s_src.value = ptr(handle[0])
            s_range.value = ptr(handle[1])
            # A handle the caller built or rebuilt has no row map: the kernel then rebuilds the rows from it.
            row_map = getattr(handle, "row_map", None)
            row_map = 0 if row_map is None else ptr(row_map)
        if self.partials:
            s_map.value = row_map
        s_topk.value = ptr(topk_idx)
        s_w.value = ptr(topk_weights)
        s_out.value = ptr(out)
        if combine_wait_recv_cost_stats is not None or s_wait.value:
            s_wait.value = 0 if combine_wait_recv_cost_stats is None else \
                ptr(combine_wait_recv_cost_stats) + self.wait_offset
        hook = self._launch(b, s_phases, stream, receive_stream, (x, topk_idx, topk_weights, handle, out))
        if streams is None:
            return out, EventOverlap(None), hook
        return out, self._end(streams, (x, topk_idx, topk_weights, handle, out)), hook

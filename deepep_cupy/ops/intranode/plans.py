"""Launch plans of the intranode (NVLink) dispatch and combine.

A plan fixes, for one (framework, shapes, dtypes, config, flags), the kernels, the buffer map and the
argument blocks; a call allocates its outputs in the caller's framework, patches pointers and launches
on the communication stream. Only a dispatch without handle and without ``num_worst_tokens`` waits for
the device (for the received counts, to size its outputs), as in DeepEP.
"""

from __future__ import annotations

from ...device.launch import LaunchPlan
from ...event import EventOverlap
from ...frameworks import BF16, F32, FP8, I32, I64, frame_for, meta
from .. import limits
from ..handles import handle_meta
from ..kernel_names import intranode_combine, intranode_dispatch, intranode_notify
from ..own_rows import OwnRowCopies
from ..plan import NormalPlan, config_key, lookup, scale_strides, scales_dtype, store
from ..pool_outputs import PoolOutputs
from . import buffer_map as L
from .args import COMBINE, DISPATCH, NOTIFY, NOTIFY_THREADS
from .copy import CopyCombine, IntranodeHandle
from .engine import (
    combine_args,
    combine_spec,
    dispatch_args,
    dispatch_spec,
    notify_args,
    notify_spec,
)

__all__ = ["DispatchPlan", "CombinePlan"]



class DispatchPlan(NormalPlan):
    """Intranode ``dispatch`` (with or without a cached handle) for one set of shapes and flags."""

    def __init__(self, engine, frame, x, x_scales, *, handle, num_tokens_per_expert, topk_idx, topk_weights,
                 expert_alignment, num_worst_tokens, config, comm_stream: int, async_finish: bool) -> None:
        super().__init__(engine, frame, comm_stream, async_finish)
        engine.check_usable()
        R, me = engine.num_ranks, engine.rank
        num_tokens, hidden = (int(s) for s in x.shape)
        self.num_scales, s_tok, s_blk = 0, 0, 0
        self.scales_shape = None
        if x_scales is not None:
            self.num_scales, s_tok, s_blk = scale_strides(x_scales, num_tokens)
            self.scales_shape = tuple(x_scales.shape[1:])
            self.scales_dtype = scales_dtype(x_scales)
        self.num_worst_tokens = num_worst_tokens = int(num_worst_tokens or 0)
        if num_worst_tokens < 0:
            raise ValueError(f"num_worst_tokens must be >= 0, got {num_worst_tokens}")
        self.cached = handle is not None
        self.num_tokens, self.hidden = num_tokens, hidden
        self.x_key = FP8 if x_scales is not None else BF16
        self.num_topk = int(topk_idx.shape[1]) if topk_idx is not None and not self.cached else 0
        num_local_experts = 0 if self.cached else int(num_tokens_per_expert.shape[0]) // R
        self.num_channels, self.cap, buffer_map, notify = limits.intranode_dispatch(
            R, engine.num_nvl_bytes, config, num_tokens=num_tokens, hidden=hidden, fp8=x_scales is not None,
            num_scales=self.num_scales, num_topk=self.num_topk, num_local_experts=num_local_experts,
            handle_channels=int(handle[1].shape[1]) if self.cached else None, num_device_sms=engine.num_device_sms)
        self.hidden_bytes = hidden_bytes = hidden * (1 if x_scales is not None else 2)
        if self.cached:
            self.num_rows = int(handle[3].shape[0])
            self.has_weights = False
        else:
            self.has_topk, self.has_weights = topk_idx is not None, topk_weights is not None
            self.num_rows = num_worst_tokens
        self.num_local_experts = num_local_experts
        shared = L.direct_shared_bytes(R, num_tokens, self.num_channels)
        pool = engine.output_pool if engine.use_output_pool else None
        self.pool = PoolOutputs(pool, frame, self._output_parts, ((0, 1), (2, 3, 4))) if pool is not None else None

        warps, unroll = engine.dispatch_shape(2 * self.num_channels)
        own_rows_warps, recv_own_rows_warps = engine.own_rows_split(warps)
        kernel = engine.kernel(dispatch_spec(R, warps, unroll), intranode_dispatch(R, warps, unroll))
        named = dispatch_args(
            x=0, x_scales=0, scale_token_stride=s_tok, scale_block_stride=s_blk, num_scales=self.num_scales,
            topk_idx=0, topk_weights=0, num_topk=self.num_topk, num_local_experts=num_local_experts,
            is_token_in_rank=0, num_tokens=num_tokens, hidden_int4=hidden_bytes // 16, rank_prefix_matrix=0,
            channel_prefix_matrix=0, recv_channel_prefix_matrix=0, recv_x=0, recv_x_scales=0, recv_topk_idx=0,
            recv_topk_weights=0, recv_src_idx=0, send_head=0, num_out_rows=self.num_rows,
            num_worst_tokens=0 if self.cached else num_worst_tokens, bases=engine.bases,
            buffer_map=buffer_map, num_own_rows_warps=own_rows_warps, err_ptr=engine.errors.ptr,
            timeout_ns=engine.timeout_ns, rank=me,
            num_recv_own_rows_warps=recv_own_rows_warps, batch=engine.batch(config),
            own_rows_claims=engine.work_claims.data.ptr,
            fan_out=engine.fan_out(2 * self.num_channels))
        self.plan = LaunchPlan(kernel, 2 * self.num_channels, warps * 32, DISPATCH, named, shared_mem=shared)
        self.slots = tuple(self.plan.slot(n) for n in (
            "x", "x_scales", "topk_idx", "topk_weights", "is_token_in_rank", "rank_prefix_matrix",
            "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_x", "recv_x_scales", "recv_topk_idx",
            "recv_topk_weights", "recv_src_idx", "send_head", "num_out_rows", "pool_bases", "own_rows_copied"))
        # Whether a cached dispatch copies this rank's own rows with device-to-device copies (their
        # scales, where the call has them, stay with the SMs); a dispatch without a handle then reads its
        # column of is_token_in_rank back for the handle. Fixed per plan: the engine's tuning attributes are
        # part of the plan key.
        self.own_rows = engine.own_row_copies()
        self.own = OwnRowCopies(engine, hidden_bytes, comm_stream) if self.cached and self.own_rows else None
        self.notify = None
        if not self.cached:
            notify_offset, notify_stride, _ = notify
            self._make_notify_meta(1 + num_local_experts, num_tokens * R)
            notify = engine.kernel(notify_spec(R), intranode_notify(R))
            named = notify_args(
                is_token_in_rank=0, num_tokens=num_tokens, num_channels=self.num_channels, num_tokens_per_expert=0,
                num_local_experts=num_local_experts, expert_alignment=max(1, int(expert_alignment)),
                rank_prefix_matrix=0, channel_prefix_matrix=0, recv_channel_prefix_matrix=0, meta=self.meta,
                bases=engine.bases, notify_offset=notify_offset, notify_stride=notify_stride,
                err_ptr=engine.errors.ptr, timeout_ns=engine.timeout_ns, rank=me)
            self.notify = LaunchPlan(notify, 1, NOTIFY_THREADS, NOTIFY, named,
                                     shared_mem=(R * self.num_channels + R) * 4)
            self.notify_slots = tuple(self.notify.slot(n) for n in (
                "is_token_in_rank", "num_tokens_per_expert", "rank_prefix_matrix", "channel_prefix_matrix",
                "recv_channel_prefix_matrix"))

    def run(self, x, x_scales, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
            topk_weights, previous_event=None):
        streams = self._begin(previous_event)
        engine, frame = self.engine, self.frame
        ptr, empty, R = frame.ptr, frame.empty, engine.num_ranks
        (s_x, s_scales, s_topk, s_w, s_in_rank, s_rank_prefix, s_chan, s_recv_chan, s_recv_x, s_recv_scales,
         s_recv_topk, s_recv_w, s_src, s_head, s_rows, s_pool, s_own) = self.slots
        counts_list = None
        if self.cached:
            rank_prefix, channel_prefix, recv_channel_prefix, _, is_token_in_rank, _ = handle
            num_rows = self.num_rows
        else:
            rank_prefix = empty((R, R), I32)
            channel_prefix = empty((R, self.num_channels), I32)
            recv_channel_prefix = empty((R, self.num_channels), I32)
            n_in, n_tpe, n_rank, n_chan, n_recv_chan = self.notify_slots
            n_in.value = ptr(is_token_in_rank)
            n_tpe.value = ptr(num_tokens_per_expert)
            n_rank.value = ptr(rank_prefix)
            n_chan.value = ptr(channel_prefix)
            n_recv_chan.value = ptr(recv_channel_prefix)
            self.notify.launch(self.comm_stream)
            counts = own_tokens = None
            if self.num_worst_tokens > 0:
                num_rows, counts_list = self.num_worst_tokens, []
            else:
                # is_token_in_rank comes back too where a cached dispatch may copy own rows (own_rows.py).
                own = self.own_rows
                num_rows, counts_list = self._received_counts(ptr(rank_prefix), ptr(is_token_in_rank) if own else 0)
                counts = tuple(map(tuple, self.host_rank_prefix.tolist()))
                if own:
                    own_tokens = self._own_column()
        outs = self.pool.allocate(num_rows, self._capture_status(self.comm_stream)) if self.pool is not None else None
        s_pool.value = 0 if outs is None else self.pool.bases_ptr
        recv_x, recv_scales, recv_src_idx, recv_topk_idx, recv_topk_weights = outs or self._outputs(num_rows)
        s_x.value = ptr(x)
        s_recv_x.value = ptr(recv_x)
        s_in_rank.value = ptr(is_token_in_rank)
        s_rank_prefix.value = ptr(rank_prefix)
        s_chan.value = ptr(channel_prefix)
        s_recv_chan.value = ptr(recv_channel_prefix)
        s_rows.value = num_rows
        if x_scales is not None:
            s_scales.value = ptr(x_scales)
            s_recv_scales.value = ptr(recv_scales)
        if not self.cached:
            send_head = empty((self.num_tokens, R), I32)
            s_src.value = ptr(recv_src_idx)
            s_head.value = ptr(send_head)
            if self.num_topk:
                s_topk.value = ptr(topk_idx)
                s_recv_topk.value = ptr(recv_topk_idx)
                if self.has_weights:
                    s_w.value = ptr(topk_weights)
                    s_recv_w.value = ptr(recv_topk_weights)
        own = self._own_rows(handle, num_rows) if self.cached else None
        s_own.value = own is not None
        if own is not None:
            self.own.start(own, ptr(x), ptr(recv_x))
        self.plan.launch(self.comm_stream)
        if own is not None:
            self.own.finish()
        event = streams.finish()
        # With async_finish the communication stream still uses these after the call returns: the event
        # keeps them alive until the caller is done with it (as DeepEP's EventOverlap does).
        event = EventOverlap(event, (x, x_scales, topk_idx, topk_weights, recv_x, recv_scales, handle)
                             if event is not None else None)
        recv = recv_x if x_scales is None else (recv_x, recv_scales)
        if self.cached:
            return recv, None, None, None, None, event
        me = engine.rank
        first_own = None if counts is None else (counts[me - 1][me] if me > 0 else 0)
        new_handle = IntranodeHandle((rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx,
                                      is_token_in_rank, send_head), counts, own_tokens, self.num_topk, first_own)
        return recv, recv_topk_idx, recv_topk_weights, counts_list, new_handle, event

    def _output_parts(self, num_rows: int) -> list[tuple[tuple, object] | None]:
        """``(shape, dtype)`` of recv_x, recv_x_scales, recv_src_idx, recv_topk_idx, recv_topk_weights (None
        for an output this call does not make)."""
        scales = ((num_rows, *self.scales_shape), self.scales_dtype) if self.scales_shape is not None else None
        src = topk = weights = None
        if not self.cached:
            src = ((num_rows,), I32)
            if self.num_topk:
                topk = ((num_rows, self.num_topk), I64)
                if self.has_weights:
                    weights = ((num_rows, self.num_topk), F32)
        return [((num_rows, self.hidden), self.x_key), scales, src, topk, weights]

    def _outputs(self, num_rows: int) -> list:
        """The outputs as ordinary allocations of the caller's framework (the ring mode)."""
        empty = self.frame.empty
        return [None if p is None else empty(*p) for p in self._output_parts(num_rows)]

    def _received_counts(self, rank_prefix_ptr: int, in_rank_ptr: int) -> tuple[int, list[int]]:
        """Rows received and received tokens per local expert (waits for the notify kernel; reads the rank
        prefix matrix too, for the combine's copy mode, and ``is_token_in_rank`` for the own-row copies)."""
        host = self._read_notify_meta(rank_prefix_ptr, in_rank_ptr)
        return int(host[0]), [int(v) for v in host[1:]]


class CombinePlan(NormalPlan):
    """Intranode ``combine`` for one set of shapes and flags."""

    def __init__(self, engine, frame, x, handle, *, topk_weights, bias_0, bias_1, config, comm_stream: int,
                 async_finish: bool, order_topk_idx=None, num_local_experts: int = 1) -> None:
        super().__init__(engine, frame, comm_stream, async_finish)
        # V2's summation order (combine_sum.cuh): the source tokens' top-k, patched per call like x.
        order_num_topk = 0 if order_topk_idx is None else int(order_topk_idx.shape[1])
        engine.check_usable()
        R, me = engine.num_ranks, engine.rank
        num_x_rows, hidden = (int(s) for s in x.shape)
        hidden_bytes = hidden * 2
        self.num_channels = int(handle[1].shape[1])
        self.num_tokens, self.hidden = int(handle[4].shape[0]), hidden
        self.num_topk = int(topk_weights.shape[1]) if topk_weights is not None else 0
        self.has_weights = topk_weights is not None
        self.cap, buffer_map = limits.intranode_combine(
            R, engine.num_nvl_bytes, config, hidden=hidden, num_topk=self.num_topk,
            handle_channels=self.num_channels, num_device_sms=engine.num_device_sms)
        warps, unroll = engine.combine_shape(2 * self.num_channels)
        ordered = order_topk_idx is not None
        kernel = engine.kernel(combine_spec(R, warps, unroll, ordered), intranode_combine(R, warps, unroll, ordered))
        named = combine_args(
            x=0, topk_weights=0, num_topk=self.num_topk, bias_0=0, bias_1=0, rank_prefix_matrix=0,
            channel_prefix_matrix=0, recv_channel_prefix_matrix=0, send_head=0, num_tokens=self.num_tokens,
            hidden_int4=hidden_bytes // 16, combined_x=0, combined_topk_weights=0, bases=engine.bases,
            buffer_map=buffer_map, err_ptr=engine.errors.ptr, timeout_ns=engine.timeout_ns, rank=me,
            batch=engine.combine_batch(), run_claims=engine.work_claims.data.ptr, order_num_topk=order_num_topk,
            num_local_experts=num_local_experts)
        self.plan = LaunchPlan(kernel, 2 * self.num_channels, warps * 32, COMBINE, named)
        self.slots = tuple(self.plan.slot(n) for n in (
            "x", "topk_weights", "bias_0", "bias_1", "rank_prefix_matrix", "channel_prefix_matrix",
            "recv_channel_prefix_matrix", "send_head", "combined_x", "combined_topk_weights", "order_topk_idx"))
        self.copy = None
        if (engine.copy_combine() and engine.copy_supported and engine.output_pool is not None
                and R > 1):
            # The copy mode's sums have no channels: they may take more SMs than the dispatch that made the
            # handle (a dispatch on few SMs, a combine on the config's count).
            num_sms = max(2 * self.num_channels, int(config.num_sms))
            if engine.num_device_sms is not None:
                num_sms = min(num_sms, max(2 * self.num_channels, int(engine.num_device_sms)))
            self.copy = CopyCombine(engine, hidden=hidden, num_tokens=self.num_tokens, num_topk=self.num_topk,
                                    num_sms=num_sms, comm_stream=comm_stream, order_num_topk=order_num_topk,
                                    num_local_experts=num_local_experts)

    def _copy_mode(self, handle):
        """The copy mode's prepared schedule for this call, or None for the ring mode (see copy.py)."""
        counts = getattr(handle, "counts", None)
        if counts is None or self._capture_status(self.comm_stream):
            return None
        return self.copy.prepare(counts)

    def run(self, x, handle, topk_weights, bias_0, bias_1, previous_event=None, order_topk_idx=None):
        streams = self._begin(previous_event)
        frame = self.frame
        ptr = frame.ptr
        combined = frame.empty((self.num_tokens, self.hidden), BF16)
        combined_w = frame.empty((self.num_tokens, self.num_topk), F32) if self.has_weights else None
        prepared = self._copy_mode(handle) if self.copy is not None else None
        if prepared is not None:
            self.copy.run(prepared, x, handle, topk_weights, bias_0, bias_1, combined, combined_w, ptr,
                          order_topk_idx)
        else:
            self._run_ring(x, handle, topk_weights, bias_0, bias_1, combined, combined_w, ptr, order_topk_idx)
        event = streams.finish()
        keep = (x, handle, topk_weights, bias_0, bias_1, combined, combined_w, order_topk_idx) \
            if event is not None else None
        return combined, combined_w, EventOverlap(event, keep)

    def _run_ring(self, x, handle, topk_weights, bias_0, bias_1, combined, combined_w, ptr,
                  order_topk_idx=None) -> None:
        s_x, s_w, s_b0, s_b1, s_rank, s_chan, s_recv_chan, s_head, s_out, s_out_w, s_order = self.slots
        s_order.value = 0 if order_topk_idx is None else ptr(order_topk_idx)
        s_x.value = ptr(x)
        s_rank.value = ptr(handle[0])
        s_chan.value = ptr(handle[1])
        s_recv_chan.value = ptr(handle[2])
        s_head.value = ptr(handle[5])
        s_out.value = ptr(combined)
        s_b0.value = 0 if bias_0 is None else ptr(bias_0)
        s_b1.value = 0 if bias_1 is None else ptr(bias_1)
        if combined_w is not None:
            s_w.value = ptr(topk_weights)
            s_out_w.value = ptr(combined_w)
        self.plan.launch(self.comm_stream)


# ---------------------------------------------------------------------------------------------------- direct
def _tuning(engine) -> tuple:
    return tuple(getattr(engine, name) for name in engine.TUNING)


def direct_dispatch(engine, x, x_scales, *, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                    topk_idx, topk_weights, expert_alignment, num_worst_tokens, config, stream):
    """One dispatch on CuPy arrays on the CuPy ``stream``, without a ``Buffer`` (benchmarks sweep the
    engine's tuning between calls; plans are cached per metadata, config and tuning).

    Returns ``(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, counts_list, handle)``.
    """
    key = ("dispatch", meta(x), meta(x_scales), handle_meta(handle), meta(is_token_in_rank),
           meta(num_tokens_per_expert), meta(topk_idx), meta(topk_weights), expert_alignment, num_worst_tokens,
           config_key(config), _tuning(engine), stream.ptr)
    plans = engine.__dict__.setdefault("direct_plans", {})
    plan = lookup(plans, key)
    if plan is None:
        plan = store(plans, key, DispatchPlan(
            engine, frame_for("cupy", engine.device_id), x, x_scales, handle=handle,
            num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
            expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens, config=config,
            comm_stream=stream.ptr, async_finish=False))
    with stream:
        recv, recv_topk_idx, recv_topk_weights, counts, new_handle, _ = plan.run(
            x, x_scales, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
            topk_weights)
    recv_x, recv_scales = recv if isinstance(recv, tuple) else (recv, None)
    return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, counts, handle if handle is not None else new_handle


def direct_combine(engine, x, handle, *, topk_weights, bias_0, bias_1, config, stream):
    """One combine on CuPy arrays on ``stream``, without a ``Buffer`` (see :func:`direct_dispatch`).

    Returns ``(combined_x, combined_topk_weights or None)``.
    """
    key = ("combine", meta(x), handle_meta(handle), meta(topk_weights), meta(bias_0), meta(bias_1),
           config_key(config), _tuning(engine), stream.ptr)
    plans = engine.__dict__.setdefault("direct_plans", {})
    plan = lookup(plans, key)
    if plan is None:
        plan = store(plans, key, CombinePlan(engine, frame_for("cupy", engine.device_id), x, handle,
                                             topk_weights=topk_weights, bias_0=bias_0, bias_1=bias_1, config=config,
                                             comm_stream=stream.ptr, async_finish=False))
    with stream:
        combined, combined_w, _ = plan.run(x, handle, topk_weights, bias_0, bias_1)
    return combined, combined_w

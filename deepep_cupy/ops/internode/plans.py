"""Launch plans of the internode dispatch and combine (several NVLink domains).

As the intranode plans: a plan fixes, for one (framework, shapes, dtypes, config, flags), the kernels,
the buffer maps and the argument blocks; a call allocates its outputs in the caller's framework, patches
pointers and launches on the communication stream. A dispatch without handle and without
``num_worst_tokens`` waits for the notify counts (as DeepEP's). Returns DeepEP V1's 10-entry handle
(``reference/internode.py``). Padding rows of ``recv_x`` (``num_worst_tokens``) are left as allocated, as
DeepEP's; the index outputs are padded with -1 / 0.
"""

from __future__ import annotations

from ...device.launch import LaunchPlan
from ...event import EventOverlap
from ...frameworks import BF16, F32, FP8, I32, I64, U8
from .. import limits
from ..handles import DispatchHandle
from ..kernel_names import internode_combine, internode_dispatch, internode_notify
from ..own_rows import OwnRowCopies
from ..plan import NormalPlan, scale_strides, scales_dtype
from ..pool_outputs import PoolOutputs
from . import buffer_map as IL
from .args import COMBINE, DISPATCH, NOTIFY, NOTIFY_THREADS
from .engine import (
    block_threads,
    combine_args,
    combine_block_threads,
    combine_spec,
    dispatch_args,
    dispatch_spec,
    notify_args,
    notify_spec,
)

__all__ = ["DispatchPlan", "CombinePlan", "check_sizes", "default_channels"]


def check_sizes(engine, rdma: IL.RdmaBufferMap, nvl: IL.NvlBufferMap) -> None:
    """The buffer maps must fit the buffers the engine was created with."""
    limits.internode_sizes(engine.num_nvl_bytes, engine.num_rdma_bytes, rdma, nvl)


default_channels = limits.default_channels


class DispatchPlan(NormalPlan):
    """Internode ``dispatch`` (with or without a cached handle) for one set of shapes and flags."""

    def __init__(self, engine, frame, x, x_scales, *, handle, num_tokens_per_expert, topk_idx, topk_weights,
                 expert_alignment, num_worst_tokens, config, comm_stream: int, async_finish: bool) -> None:
        super().__init__(engine, frame, comm_stream, async_finish)
        engine.check_usable()
        L, D, me = engine.num_nvl_ranks, engine.num_domains, engine.rank
        R = L * D
        sub = engine.channels_per_block(config.num_sms)
        self.num_tokens, self.hidden = (int(s) for s in x.shape)
        self.hidden_bytes = hidden_bytes = self.hidden * (1 if x_scales is not None else 2)
        self.x_key = FP8 if x_scales is not None else BF16
        self.num_scales, s_tok, s_blk = 0, 0, 0
        self.scales_shape = None
        if x_scales is not None:
            self.num_scales, s_tok, s_blk = scale_strides(x_scales, self.num_tokens)
            self.scales_shape = tuple(x_scales.shape[1:])
            self.scales_dtype = scales_dtype(x_scales)
        self.cached = handle is not None
        self.num_topk = int(topk_idx.shape[1]) if (topk_idx is not None and not self.cached) else 0
        self.num_local_experts = 0 if self.cached else int(num_tokens_per_expert.shape[0]) // R
        self.num_channels, grid, self.rdma, self.nvl, chunk = limits.internode_dispatch(
            L, D, engine.num_nvl_bytes, engine.num_rdma_bytes, config, hidden=self.hidden, fp8=x_scales is not None,
            num_scales=self.num_scales, num_topk=self.num_topk, num_local_experts=self.num_local_experts,
            handle_channels=int(handle[1].shape[1]) if self.cached else None, num_device_sms=engine.num_device_sms,
            sub=sub)
        self.num_worst_tokens = int(num_worst_tokens or 0)
        rdma_cap = self.rdma.cap
        self.cap = self.nvl.cap
        self.geometry = (self.hidden, self.num_channels, rdma_cap, self.nvl.cap)
        self.has_weights = topk_weights is not None and not self.cached
        # A cached dispatch returns as many rows as the handle's entry 7 (num_worst_tokens padding included).
        self.num_rows = int(handle[7].shape[0]) if self.cached else self.num_worst_tokens
        kernel = engine.kernel(dispatch_spec(L, D, sub), internode_dispatch(L, D, sub))
        # Domains of more than one rank with an output pool: outputs there when they fit, so the forwarders
        # write the rows in place (dispatch_forward.cuh). The kernels get the pools' bases whenever the engine
        # has a pool (all ranks do, or none), so every receiver replies and every forwarder reads the reply,
        # whichever ranks allocate in their pool.
        pool = engine.output_pool
        self.pool = (PoolOutputs(pool, frame, self._output_parts, ((0, 1), (2, 3, 4)))
                     if pool is not None and engine.use_output_pool else None)
        named = dispatch_args(
            x=0, x_scales=0, scale_token_stride=s_tok, scale_block_stride=s_blk, num_scales=self.num_scales,
            topk_idx=0, topk_weights=0, num_topk=self.num_topk, num_local_experts=self.num_local_experts,
            is_token_in_rank=0, num_tokens=self.num_tokens, hidden_int4=hidden_bytes // 16,
            rdma_channel_prefix_matrix=0, gbl_channel_prefix_matrix=0, recv_rdma_rank_prefix_sum=0,
            recv_gbl_rank_prefix_sum=0, recv_x=0, recv_x_scales=0, recv_topk_idx=0, recv_topk_weights=0,
            recv_rdma_channel_prefix_matrix=0, recv_gbl_channel_prefix_matrix=0, recv_src_meta=0, send_rdma_head=0,
            send_nvl_head=0, num_out_rows=0, num_nvl_head_rows=0, rdma=engine.rdma_ptr, rdma_map=self.rdma,
            rdma_chunk=chunk, sig=engine.sig_ptr, nvl_bases=engine.nvl_bases, nvl=self.nvl, state=engine.state,
            err_ptr=engine.errors.ptr, timeout_ns=engine.timeout_ns, rank=me, force_rma=engine.force_rma,
            pool_bases=pool.bases.data.ptr if pool is not None else 0)
        self.plan = LaunchPlan(kernel, grid, block_threads(L, D, sub), DISPATCH, named)
        self.slots = {n: self.plan.slot(n) for n in named if n not in _DISPATCH_CONSTANTS}
        # With one rank a domain, device-to-device copies may move this rank's own rows (ops/own_rows.py); a dispatch
        # that waits for its counts then reads its column of is_token_in_rank and entry 6 back with them.
        self.own = OwnRowCopies(engine, hidden_bytes, comm_stream) if engine.own_row_copies() else None
        self.notify = None
        self.reads_own = not self.cached and self.own is not None and self.num_worst_tokens == 0
        if not self.cached:
            self._make_notify_meta(2 + self.num_local_experts, self.num_tokens * R if self.reads_own else 0, (R,))
            notify = engine.kernel(notify_spec(L, D), internode_notify(L, D))
            named = notify_args(
                is_token_in_rank=0, num_tokens=self.num_tokens, num_channels=self.num_channels,
                num_tokens_per_expert=0, num_local_experts=self.num_local_experts,
                expert_alignment=max(1, int(expert_alignment)), rdma_channel_prefix_matrix=0,
                gbl_channel_prefix_matrix=0, recv_rdma_rank_prefix_sum=0, recv_gbl_rank_prefix_sum=0, meta=self.meta,
                sig=engine.sig_ptr, signals=engine.signals, nvl_bases=engine.nvl_bases, nvl=self.nvl,
                state=engine.state, err_ptr=engine.errors.ptr, timeout_ns=engine.timeout_ns, rank=me)
            self.notify = LaunchPlan(notify, 1, NOTIFY_THREADS, NOTIFY, named)
            self.notify_slots = tuple(self.notify.slot(n) for n in (
                "is_token_in_rank", "num_tokens_per_expert", "rdma_channel_prefix_matrix",
                "gbl_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_gbl_rank_prefix_sum"))

    def run(self, x, x_scales, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
            topk_weights, previous_event=None):
        streams = self._begin(previous_event)
        engine, frame = self.engine, self.frame
        engine.use_geometry(self.geometry)
        ptr, empty = frame.ptr, frame.empty
        L, D = engine.num_nvl_ranks, engine.num_domains
        R, C = L * D, self.num_channels
        p = self.slots
        counts = None
        if self.cached:
            is_token_in_rank, rdma_cpm, gbl_cpm = handle[0], handle[1], handle[2]
            recv_rdma_prefix, recv_gbl_prefix = handle[4], handle[6]
            num_rows, nvl_rows = self.num_rows, 0
        else:
            rdma_cpm = empty((D, C), I32)
            gbl_cpm = empty((R, C), I32)
            recv_rdma_prefix = empty((D,), I32)
            recv_gbl_prefix = empty((R,), I32)
            for slot, arr in zip(self.notify_slots, (is_token_in_rank, num_tokens_per_expert, rdma_cpm, gbl_cpm,
                                                     recv_rdma_prefix, recv_gbl_prefix), strict=True):
                slot.value = ptr(arr)
            self.notify.launch(self.comm_stream)
            if self.num_worst_tokens > 0:
                num_rows = nvl_rows = self.num_worst_tokens
                counts = []
            else:
                num_rows, nvl_rows, counts = self._received_counts(recv_gbl_prefix, is_token_in_rank)
        in_pool = self.pool.allocate(num_rows, self._capture_status(self.comm_stream)) if self.pool else None
        p["outputs_in_pool"].value = in_pool is not None
        engine.pool_dispatches += in_pool is not None
        recv_x, recv_scales, src_meta, recv_topk_idx, recv_topk_weights = (
            in_pool or [None if part is None else empty(*part) for part in self._output_parts(num_rows)])
        outs = {"x": x, "x_scales": x_scales, "is_token_in_rank": is_token_in_rank,
                "rdma_cpm": rdma_cpm, "gbl_cpm": gbl_cpm, "recv_rdma_prefix": recv_rdma_prefix,
                "recv_gbl_prefix": recv_gbl_prefix,
                "recv_x": recv_x, "recv_x_scales": recv_scales}
        if not self.cached:
            outs["recv_rdma_cpm"] = recv_rdma_cpm = empty((D, C), I32)
            outs["recv_gbl_cpm"] = recv_gbl_cpm = empty((R, C), I32)
            outs["recv_src_meta"] = src_meta
            outs["send_rdma_head"] = send_rdma_head = empty((self.num_tokens, D), I32)
            outs["send_nvl_head"] = send_nvl_head = empty((nvl_rows, L), I32)
            if self.num_topk:
                outs["topk_idx"] = topk_idx
                outs["recv_topk_idx"] = recv_topk_idx
                if self.has_weights:
                    outs["topk_weights"] = topk_weights
                    outs["recv_topk_weights"] = recv_topk_weights
        for name, arr in outs.items():
            p[name].value = 0 if arr is None else ptr(arr)
        p["num_out_rows"].value = num_rows
        p["num_nvl_head_rows"].value = nvl_rows
        new_handle = None
        if not self.cached:
            own_tokens = own_first_row = None
            if self.reads_own:
                me = engine.rank
                own_tokens = self._own_column()
                own_first_row = int(self.host_rank_prefix[me - 1]) if me > 0 else 0
            new_handle = DispatchHandle((is_token_in_rank, rdma_cpm, gbl_cpm, recv_rdma_cpm, recv_rdma_prefix,
                                         recv_gbl_cpm, recv_gbl_prefix, src_meta, send_rdma_head, send_nvl_head),
                                        self.num_topk, own_tokens, own_first_row)
        own = self._own_rows(handle if self.cached else new_handle, num_rows)
        p["own_rows_copied"].value = own is not None
        if own is not None:
            self.own.start(own, ptr(x), ptr(recv_x))
        self.plan.launch(self.comm_stream)
        if own is not None:
            self.own.finish()
        event = streams.finish()
        # With async_finish the communication stream still uses these after the call returns.
        event = EventOverlap(event, (x, x_scales, topk_idx, topk_weights, recv_x, recv_scales, handle)
                             if event is not None else None)
        recv = recv_x if x_scales is None else (recv_x, recv_scales)
        if self.cached:
            return recv, None, None, None, None, event
        return recv, recv_topk_idx, recv_topk_weights, counts, new_handle, event

    def _output_parts(self, num_rows: int) -> list[tuple[tuple, object] | None]:
        """``(shape, dtype)`` of recv_x, recv_x_scales, recv_src_meta, recv_topk_idx, recv_topk_weights (None
        for an output this call does not make)."""
        scales = ((num_rows, *self.scales_shape), self.scales_dtype) if self.scales_shape is not None else None
        src = topk = weights = None
        if not self.cached:
            src = ((num_rows, 8), U8)
            if self.num_topk:
                topk = ((num_rows, self.num_topk), I64)
                if self.has_weights:
                    weights = ((num_rows, self.num_topk), F32)
        return [((num_rows, self.hidden), self.x_key), scales, src, topk, weights]

    def _received_counts(self, recv_gbl_prefix, is_token_in_rank) -> tuple[int, int, list[int]]:
        """Rows received, rows forwarded and received tokens per local expert (waits for the notify kernel;
        reads entry 6 and ``is_token_in_rank`` back too where device copies may take the own rows)."""
        ptr = self.frame.ptr
        host = self._read_notify_meta(*((ptr(recv_gbl_prefix), ptr(is_token_in_rank)) if self.reads_own else ()))
        return int(host[0]), int(host[1]), [int(v) for v in host[2:]]


# Launch arguments fixed when the plan is made (everything else is patched per call).
_DISPATCH_CONSTANTS = frozenset((
    "scale_token_stride", "scale_block_stride", "num_scales", "num_topk", "num_local_experts", "num_tokens",
    "hidden_int4", "rdma", "ring_offset", "slot_bytes", "slot_scales_offset", "slot_topk_idx_offset",
    "slot_topk_weights_offset", "rdma_cap", "rdma_chunk", "sig", "nvl_bases", "nvl_meta_offset", "nvl_ring_offset",
    "nvl_cap", "num_channels", "state", "err", "timeout_ns", "rank", "force_rma", "pool_bases", "nvl_reply_offset"))


class CombinePlan(NormalPlan):
    """Internode ``combine`` of BF16 rows for one set of shapes and flags, with an internode dispatch's handle.

    The NVLink ring of each (channel, domain rank -> forwarder) is split into one sub-ring per source
    domain (``combine.cu``), so the config's NVLink ring needs at least ``D`` slots, and its progress words
    are those of ring ``c * D + d``: ``C * D`` must not exceed ``MAX_CHANNELS``.
    """

    def __init__(self, engine, frame, x, handle, *, topk_weights, bias_0, bias_1, config, comm_stream: int,
                 async_finish: bool) -> None:
        super().__init__(engine, frame, comm_stream, async_finish)
        engine.check_usable()
        L, D = engine.num_nvl_ranks, engine.num_domains
        sub = engine.channels_per_block(config.num_sms)
        self.num_rows, self.hidden = (int(s) for s in x.shape)
        self.num_channels = int(handle[1].shape[1])
        self.num_tokens = int(handle[0].shape[0])
        self.num_topk = int(topk_weights.shape[1]) if topk_weights is not None else 0
        self.has_weights = topk_weights is not None
        grid, self.rdma, self.nvl, chunk = limits.internode_combine(
            L, D, engine.num_nvl_bytes, engine.num_rdma_bytes, config, hidden=self.hidden, num_topk=self.num_topk,
            handle_channels=self.num_channels, num_device_sms=engine.num_device_sms, sub=sub)
        rdma_cap = self.rdma.cap
        self.cap = self.nvl.cap
        self.geometry = (self.hidden, self.num_channels, rdma_cap, self.nvl.cap)
        kernel = engine.kernel(combine_spec(L, D, sub), internode_combine(L, D, sub))
        named = combine_args(
            x=0, topk_weights=0, num_topk=self.num_topk, bias_0=0, bias_1=0, recv_rdma_channel_prefix_matrix=0,
            recv_rdma_rank_prefix_sum=0, recv_gbl_channel_prefix_matrix=0, recv_gbl_rank_prefix_sum=0,
            send_rdma_head=0, send_nvl_head=0, num_tokens=self.num_tokens, hidden_int4=2 * self.hidden // 16,
            combined_x=0, combined_topk_weights=0, rdma=engine.rdma_ptr, rdma_map=self.rdma, rdma_chunk=max(1, chunk),
            sig=engine.sig_ptr, nvl_bases=engine.nvl_bases, nvl=self.nvl, state=engine.state,
            err_ptr=engine.errors.ptr, timeout_ns=engine.timeout_ns, rank=engine.rank, force_rma=engine.force_rma)
        self.plan = LaunchPlan(kernel, grid, combine_block_threads(L, D, sub), COMBINE, named)
        self.slots = tuple(self.plan.slot(n) for n in _COMBINE_PATCHED)

    def run(self, x, handle, topk_weights, bias_0, bias_1, previous_event=None):
        streams = self._begin(previous_event)
        self.engine.use_geometry(self.geometry)
        frame = self.frame
        ptr = frame.ptr
        combined = frame.empty((self.num_tokens, self.hidden), BF16)
        combined_w = frame.empty((self.num_tokens, self.num_topk), F32) if self.has_weights else None
        values = (x, topk_weights if self.has_weights else None, bias_0, bias_1, handle[3], handle[4], handle[5],
                  handle[6], handle[8], handle[9], combined, combined_w)
        for slot, arr in zip(self.slots, values, strict=True):
            slot.value = 0 if arr is None else ptr(arr)
        self.plan.launch(self.comm_stream)
        event = streams.finish()
        keep = (x, handle, topk_weights, bias_0, bias_1, combined, combined_w) if event is not None else None
        return combined, combined_w, EventOverlap(event, keep)


_COMBINE_PATCHED = ("x", "topk_weights", "bias_0", "bias_1", "recv_rdma_cpm", "recv_rdma_prefix", "recv_gbl_cpm",
                    "recv_gbl_prefix", "send_rdma_head", "send_nvl_head", "combined_x", "combined_topk_weights")

"""The reference backend of ``Buffer``: every op on the NumPy oracle (``reference/``), for callers of any
framework.

Inputs are copied to NumPy, results converted back to the framework and device of the caller's ``x``.
Handles hold caller-framework arrays like the GPU path's handles do, so user code cannot tell the
backends apart except by speed. Buffer sizes and kernel limits are checked as on a GPU (the same
functions, ``ops/limits.py``, with the same messages), except the GPU's SM count, which is unknown here:
code tested on this backend is not refused for its arguments on its first GPU run unless its config
needs more SMs than that GPU has.
"""

from __future__ import annotations

import numpy as np

from ..event import EventOverlap
from ..frameworks import copy_into, from_numpy, kind_of, to_numpy
from ..ops import limits
from ..ops.handles import DispatchHandle, LowLatencyHandle, cached_rows, foreign_handle
from ..reference import ReferenceOracle, collective

__all__ = ["ReferenceBackend"]


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    """``a`` with zero rows appended up to ``rows``, in its memory order (column-major scales stay so)."""
    if a.shape[0] >= rows:
        return a
    order = "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"
    out = np.zeros((rows, *a.shape[1:]), dtype=a.dtype, order=order)
    out[:a.shape[0]] = a
    return out


def _handle_to_numpy(handle):
    return None if handle is None else tuple(to_numpy(h) if hasattr(h, "shape") else h for h in handle)


def _handle_from_numpy(handle, like):
    return tuple(from_numpy(h, like) if isinstance(h, np.ndarray) else h for h in handle)


class _BoundOp:
    """A reference-backend "plan": the op with the flags of the plan's key bound; every call does the
    whole op (there is nothing to precompute on the host backend)."""

    __slots__ = ("run",)

    def __init__(self, run) -> None:
        self.run = run


class ReferenceBackend:
    """The ``Buffer.runtime`` used when there is no GPU or the reference backend is forced."""

    #: No agreement checks run asynchronously here (every op starts with a host exchange).
    pending_agreements: list = []
    #: Set by the Buffer; the reference backend has no tuning that would invalidate its plans.
    plans_invalidated = None

    def __init__(self, group, *, num_nvl_bytes, num_rdma_bytes, num_nvl_ranks, low_latency_mode, enable_shrink,
                 num_channels, **_gpu_only):
        limits.buffer_sizes(group.size, num_nvl_ranks, num_nvl_bytes, num_rdma_bytes, low_latency_mode)
        self.num_ranks, self.num_nvl_ranks = group.size, num_nvl_ranks
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.oracle = ReferenceOracle(group, num_nvl_ranks=num_nvl_ranks, low_latency_mode=low_latency_mode,
                                        enable_shrink=enable_shrink, num_channels=num_channels)
        self.group = group
        self._combine_buffers = {}
        self._destroyed = False

    #: Ops whose first step is an exchange every rank joins (``reference.collective.start``).
    COLLECTIVE_OPS = ("dispatch", "combine", "low_latency_dispatch", "low_latency_combine")

    def report_failure(self, op: str, exc: BaseException) -> None:
        """``exc`` was raised on this rank before it reached ``op``'s first exchange (a bad argument found
        by the Buffer's checks): join that exchange with it, so the other ranks raise it too instead of
        waiting for this one. Raises (on every rank) unless there is nothing to report."""
        if op in self.COLLECTIVE_OPS and not self._destroyed and collective.own_failure(exc):
            collective.start(self.group, op, error=exc)

    def poll_agreements(self) -> None:
        """Nothing is ever pending here."""

    # The reference backend has no streams: every op is complete when it returns.
    def get_comm_stream(self, torch_stream: bool):
        return None

    def require_internode(self, op: str) -> None:
        """Every topology is one all-to-all here, but the GPU's buffers are required all the same."""
        limits.internode_buffers(op, self.num_ranks, self.num_nvl_ranks, self.num_nvl_bytes, self.num_rdma_bytes)

    def local_buffer_tensor(self, dtype, size, offset, use_rdma_buffer):
        raise RuntimeError("get_local_buffer_tensor needs the GPU backend (the reference backend has no raw buffer)")

    # ------------------------------------------------------------------ plans (the Buffer's entry points)
    # Each first makes the GPU path's refusals (``ops/limits.py``) from the same arguments, so that a call the
    # GPU would refuse is refused here too; the GPU's SM count is unknown here (None skips that check alone).
    def plan_layout(self, topk_idx, num_experts, **_stream_args):
        n, k = topk_idx.shape
        limits.layout_args(int(n), int(k), num_experts, self.num_ranks, self.num_nvl_ranks)
        return _BoundOp(lambda topk_idx, previous_event=None: self.get_dispatch_layout(topk_idx, num_experts))

    def plan_dispatch(self, x, x_scales, *, handle, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                      num_worst_tokens, config, **_stream_args):
        self._normal_limits("dispatch", x, x_scales=x_scales, handle=handle,
                            num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, config=config)

        def run(x, x_scales, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                topk_weights, previous_event=None):
            return self.dispatch(x, x_scales, handle=handle, num_tokens_per_rank=num_tokens_per_rank,
                                 is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
                                 topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=expert_alignment,
                                 num_worst_tokens=num_worst_tokens, config=config)
        return _BoundOp(run)

    def plan_combine(self, x, handle, *, topk_weights, bias_0, bias_1, config, order_topk_idx=None,
                     num_local_experts=1, **_stream_args):
        self._normal_limits("combine", x, handle=handle, topk_weights=topk_weights, config=config)

        def run(x, handle, topk_weights, bias_0, bias_1, previous_event=None, order_topk_idx=None):
            return self.combine(x, handle, topk_weights=topk_weights, bias_0=bias_0, bias_1=bias_1, config=config,
                                order_topk_idx=order_topk_idx, num_local_experts=num_local_experts)
        return _BoundOp(run)

    def _normal_limits(self, op, x, *, handle, config, x_scales=None, num_tokens_per_expert=None, topk_idx=None,
                       topk_weights=None) -> None:
        """The refusals of the GPU's intranode or internode plan for these arguments."""
        limits.normal_buffers(op, self.num_ranks, self.num_nvl_ranks, self.num_nvl_bytes, self.num_rdma_bytes)
        num_tokens, hidden = (int(s) for s in x.shape)
        channels = None if handle is None else int(handle[1].shape[1])
        lsize, domains = self.num_nvl_ranks, self.num_ranks // self.num_nvl_ranks
        if op == "combine":
            num_topk = 0 if topk_weights is None else int(topk_weights.shape[1])
            if domains > 1:
                limits.internode_combine(lsize, domains, self.num_nvl_bytes, self.num_rdma_bytes, config, hidden=hidden,
                                         num_topk=num_topk, handle_channels=channels, num_device_sms=None)
            else:
                limits.intranode_combine(self.num_ranks, self.num_nvl_bytes, config, hidden=hidden, num_topk=num_topk,
                                         handle_channels=channels, num_device_sms=None)
            return
        shape = dict(hidden=hidden, fp8=x_scales is not None,
                     num_scales=0 if x_scales is None else int(x_scales.shape[1]),
                     num_topk=0 if topk_idx is None or handle is not None else int(topk_idx.shape[1]),
                     num_local_experts=0 if handle is not None else int(num_tokens_per_expert.shape[0]) // self.num_ranks,
                     handle_channels=channels, num_device_sms=None)
        if domains > 1:
            limits.internode_dispatch(lsize, domains, self.num_nvl_bytes, self.num_rdma_bytes, config, **shape)
        else:
            limits.intranode_dispatch(self.num_ranks, self.num_nvl_bytes, config, num_tokens=num_tokens, **shape)

    def _ll_limits(self, num_max_dispatch_tokens_per_rank, hidden, num_experts) -> None:
        limits.low_latency_buffer_map(self.num_ranks, self.num_rdma_bytes, num_max_dispatch_tokens_per_rank,
                                      hidden, num_experts)

    def plan_low_latency_dispatch(self, x, topk_idx, *, num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
                                  round_scale, use_ue8m0, async_finish, return_recv_hook, **_unused):
        self._ll_limits(num_max_dispatch_tokens_per_rank, int(x.shape[1]), num_experts)

        def run(x, topk_idx, cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None):
            return self.low_latency_dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                num_experts=num_experts, cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats=dispatch_wait_recv_cost_stats, use_fp8=use_fp8,
                round_scale=round_scale, use_ue8m0=use_ue8m0, async_finish=async_finish,
                return_recv_hook=return_recv_hook)
        return _BoundOp(run)

    def plan_low_latency_combine(self, x, topk_idx, handle, *, use_logfmt, zero_copy, async_finish, return_recv_hook,
                                 **_unused):
        self._ll_limits(int(handle[2]), int(handle[3]), int(handle[4]))

        def run(x, topk_idx, topk_weights, handle, out=None, combine_wait_recv_cost_stats=None):
            return self.low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt=use_logfmt,
                                            zero_copy=zero_copy, async_finish=async_finish,
                                            return_recv_hook=return_recv_hook, out=out,
                                            combine_wait_recv_cost_stats=combine_wait_recv_cost_stats)
        return _BoundOp(run)

    # ------------------------------------------------------------------ ops
    def get_dispatch_layout(self, topk_idx, num_experts, **_stream_args):
        like = kind_of(topk_idx)
        outs = self.oracle.get_dispatch_layout(to_numpy(topk_idx), num_experts)
        return (*(from_numpy(o, like) for o in outs), EventOverlap(None))

    def dispatch(self, x, x_scales, *, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                 topk_idx, topk_weights, expert_alignment, num_worst_tokens, config, **_stream_args):
        like = kind_of(x)
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, counts, new_handle = self.oracle.dispatch(
            to_numpy(x), to_numpy(x_scales), handle=_handle_to_numpy(handle),
            num_tokens_per_rank=to_numpy(num_tokens_per_rank), is_token_in_rank=to_numpy(is_token_in_rank),
            num_tokens_per_expert=to_numpy(num_tokens_per_expert), topk_idx=to_numpy(topk_idx),
            topk_weights=to_numpy(topk_weights), expert_alignment=expert_alignment,
            num_worst_tokens=num_worst_tokens)
        if handle is not None:  # as many rows as the handle has, as on the GPU: zeros past the received ones
            rows = cached_rows(handle)
            recv_x = _pad_rows(recv_x, rows)
            recv_scales = None if recv_scales is None else _pad_rows(recv_scales, rows)
        recv = from_numpy(recv_x, like)
        if x_scales is not None:
            recv = (recv, from_numpy(recv_scales, like))
        if handle is not None:
            return recv, None, None, None, None, EventOverlap(None)
        num_topk = 0 if topk_idx is None else int(topk_idx.shape[1])
        return (recv, from_numpy(recv_topk_idx, like), from_numpy(recv_topk_weights, like), counts,
                DispatchHandle(_handle_from_numpy(new_handle, like), num_topk), EventOverlap(None))

    def combine(self, x, handle, *, topk_weights, bias_0, bias_1, config, order_topk_idx=None, num_local_experts=1,
                **_stream_args):
        like = kind_of(x)
        order = None if order_topk_idx is None else (to_numpy(order_topk_idx), int(num_local_experts))
        combined, weights = self.oracle.combine(to_numpy(x), _handle_to_numpy(handle),
                                                 topk_weights=to_numpy(topk_weights), bias_0=to_numpy(bias_0),
                                                 bias_1=to_numpy(bias_1), order=order)
        return from_numpy(combined, like), from_numpy(weights, like), EventOverlap(None)

    def low_latency_dispatch(self, x, topk_idx, *, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                             round_scale, use_ue8m0, async_finish, return_recv_hook):
        like = kind_of(x)
        stats = to_numpy(cumulative_local_expert_recv_stats)
        stats_np = None if stats is None else stats.copy()
        wait = self._wait_row(dispatch_wait_recv_cost_stats)
        recv, count, handle, hook = self.oracle.low_latency_dispatch(
            to_numpy(x), to_numpy(topk_idx), num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
            num_experts=num_experts, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
            cumulative_local_expert_recv_stats=stats_np, dispatch_wait_recv_cost_stats=wait,
            return_recv_hook=return_recv_hook)
        arrays = list(recv) if isinstance(recv, tuple) else [recv]
        arrays.append(count)
        outs = [from_numpy(a, like) for a in arrays]

        def publish():
            # Results, and the caller's stats tensors, become visible when the receive has happened.
            for dst, src in zip(outs, arrays, strict=True):
                copy_into(dst, src)
            if stats_np is not None:
                copy_into(cumulative_local_expert_recv_stats, stats_np)

        if not return_recv_hook:
            publish()
        recv_out = tuple(outs[:-1]) if isinstance(recv, tuple) else outs[0]
        user_handle = LowLatencyHandle(_handle_from_numpy(handle, like), owner=self)
        user_hook = None
        if return_recv_hook:
            def user_hook():
                hook()
                publish()
        return recv_out, outs[-1], user_handle, EventOverlap(None), user_hook

    @staticmethod
    def _wait_row(stats):
        # Waits have no meaning on the host; the stats keep their values (the backend adds zero).
        if stats is None:
            return None
        arr = to_numpy(stats)
        return arr.reshape(-1)[: arr.shape[-1]].copy()

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, *, use_logfmt, zero_copy, async_finish,
                            return_recv_hook, out, combine_wait_recv_cost_stats):
        owner = getattr(handle, "owner", None)
        if owner is not self and owner is not None:
            raise foreign_handle()
        like = kind_of(topk_weights) if zero_copy else kind_of(x)
        np_handle = _handle_to_numpy(handle)
        if zero_copy:
            key = id(handle)
            staged = self._combine_buffers.pop(key, None)
            if staged is not None:
                self.oracle.get_next_low_latency_combine_buffer(np_handle)[...] = to_numpy(staged)
        out_np = None if out is None else to_numpy(out).copy()
        combined, hook = self.oracle.low_latency_combine(
            to_numpy(x), to_numpy(topk_idx), to_numpy(topk_weights), np_handle, use_logfmt=use_logfmt,
            zero_copy=zero_copy, return_recv_hook=return_recv_hook, out=out_np,
            combine_wait_recv_cost_stats=self._wait_row(combine_wait_recv_cost_stats))
        result = out if out is not None else from_numpy(combined, like)

        def publish():
            copy_into(result, combined)

        if not return_recv_hook:
            publish()
        user_hook = None
        if return_recv_hook:
            def user_hook():
                hook()
                publish()
        return result, EventOverlap(None), user_hook

    def get_next_low_latency_combine_buffer(self, handle):
        self._ll_limits(int(handle[2]), int(handle[3]), int(handle[4]))
        buf = self.oracle.get_next_low_latency_combine_buffer(_handle_to_numpy(handle))
        like = kind_of(handle[0])
        if like.framework == "numpy":
            return buf
        # A device copy the caller fills; the next zero-copy combine with this handle reads it back.
        staged = from_numpy(buf, like)
        self._combine_buffers[id(handle)] = staged
        return staged

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        self._ll_limits(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self.oracle.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_update_mask_buffer(self, rank, mask):
        self.oracle.low_latency_update_mask_buffer(rank, mask)

    def low_latency_query_mask_buffer(self, mask_status):
        status = np.zeros(self.group.size, dtype=np.int32)
        self.oracle.low_latency_query_mask_buffer(status)
        copy_into(mask_status, status)

    def low_latency_clean_mask_buffer(self):
        self.oracle.low_latency_clean_mask_buffer()

    def destroy(self):
        """Local: the reference backend holds no memory other ranks use, so nothing waits for them."""
        self._combine_buffers.clear()
        self._destroyed = True
        close = getattr(self.group, "close", None)
        if close is not None:
            close()

    def release_local(self):
        self._combine_buffers.clear()

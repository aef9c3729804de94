"""Launch plans of the internode dispatch and combine (CuPy arrays, on one stream; no ``Buffer`` yet).

A :class:`DispatchPlan` fixes, for one set of shapes and one config, the kernels, the layouts and the
argument blocks; :meth:`DispatchPlan.run` allocates the outputs, patches pointers and launches. A
dispatch without handle and without ``num_worst_tokens`` waits for the notify counts (as DeepEP).
Returns DeepEP V1's 10-entry handle (``reference/internode.py``).
"""

from __future__ import annotations

import numpy as np

from ..runtime.launch import LaunchPlan
from . import internode_layout as IL
from .internode import (
    NOTIFY_THREADS,
    block_threads,
    combine_args,
    combine_block_threads,
    combine_spec,
    dispatch_args,
    dispatch_spec,
    notify_args,
    notify_spec,
)
from .intranode_plans import _launch_args, _scale_strides
from .kernel_names import internode_combine, internode_dispatch, internode_notify

__all__ = ["DispatchPlan", "CombinePlan", "check_sizes"]


def check_sizes(engine, rdma: IL.RdmaLayout, nvl: IL.NvlLayout) -> None:
    """The layouts must fit the buffers the engine was created with."""
    if rdma.end > engine.num_rdma_bytes:
        raise ValueError(f"internode ops need {rdma.end} bytes of RDMA buffer for this config and hidden size, "
                         f"the engine has {engine.num_rdma_bytes} (Config.get_rdma_buffer_size_hint)")
    if nvl.end > engine.num_nvl_bytes:
        raise ValueError(f"internode ops need {nvl.end} bytes of NVLink buffer for this config and hidden size, "
                         f"the engine has {engine.num_nvl_bytes} (Config.get_nvl_buffer_size_hint)")


class DispatchPlan:
    """Internode dispatch for one (shapes, config, cached or not)."""

    def __init__(self, engine, x, x_scales, *, handle, num_tokens_per_expert, topk_idx, topk_weights,
                 expert_alignment, num_worst_tokens, config) -> None:
        L, D, me = engine.num_nvl_ranks, engine.num_domains, engine.rank
        R = L * D
        self.engine = engine
        self.num_tokens, self.hidden = (int(s) for s in x.shape)
        hidden_bytes = self.hidden * (1 if x_scales is not None else 2)
        if hidden_bytes % 16:
            raise ValueError(f"a token row must be a multiple of 16 bytes, got {hidden_bytes}")
        self.num_scales, s_tok, s_blk = 0, 0, 0
        if x_scales is not None:
            self.num_scales, s_tok, s_blk = _scale_strides(x_scales, self.num_tokens)
        self.cached = handle is not None
        self.num_channels = int(handle[1].shape[1]) if self.cached else max(int(config.num_sms) // 2, 1)
        self.num_topk = int(topk_idx.shape[1]) if (topk_idx is not None and not self.cached) else 0
        if self.num_topk > IL.MAX_TOPK or self.num_scales > IL.MAX_SCALES:
            raise ValueError(f"internode rows carry at most {IL.MAX_TOPK} top-k entries and {IL.MAX_SCALES} scales")
        self.num_local_experts = 0 if self.cached else int(num_tokens_per_expert.shape[0]) // R
        if self.num_local_experts > IL.MAX_LOCAL_EXPERTS:
            raise ValueError(f"internode notify supports up to {IL.MAX_LOCAL_EXPERTS} experts per rank")
        self.num_worst_tokens = int(num_worst_tokens or 0)
        slot = IL.slot_for(self.hidden)
        rdma_cap, chunk = int(config.num_max_rdma_chunked_recv_tokens), int(config.num_max_rdma_chunked_send_tokens)
        self.rdma = IL.rdma_layout(L, D, self.num_channels, rdma_cap, slot)
        self.nvl = IL.nvl_layout(L, D, self.num_channels, int(config.num_max_nvl_chunked_recv_tokens), slot,
                                 self.num_local_experts)
        check_sizes(engine, self.rdma, self.nvl)
        self.geometry = (self.hidden, self.num_channels, rdma_cap, self.nvl.cap)
        self.x_dtype = x.dtype
        self.has_weights = topk_weights is not None and not self.cached
        self.num_rows = int(handle[7].shape[0]) if self.cached else self.num_worst_tokens
        kernel = engine.kernel(dispatch_spec(L, D), internode_dispatch(L, D))
        named = dispatch_args(
            x=0, x_scales=0, scale_token_stride=s_tok, scale_block_stride=s_blk, num_scales=self.num_scales,
            topk_idx=0, topk_weights=0, num_topk=self.num_topk, num_local_experts=self.num_local_experts,
            is_token_in_rank=0, num_tokens=self.num_tokens, hidden_int4=hidden_bytes // 16,
            rdma_channel_prefix_matrix=0, gbl_channel_prefix_matrix=0, recv_rdma_rank_prefix_sum=0,
            recv_gbl_rank_prefix_sum=0, recv_x=0, recv_x_scales=0, recv_topk_idx=0, recv_topk_weights=0,
            recv_rdma_channel_prefix_matrix=0, recv_gbl_channel_prefix_matrix=0, recv_src_meta=0, send_rdma_head=0,
            send_nvl_head=0, num_out_rows=0, num_nvl_head_rows=0, rdma=engine.rdma_ptr, layout=self.rdma,
            rdma_chunk=chunk, sig=engine.sig_ptr, nvl_bases=engine.nvl_bases, nvl=self.nvl, state=engine.state,
            err_ptr=engine.errors.ptr, timeout_ns=engine.timeout_ns, rank=me)
        self.plan = LaunchPlan(kernel, 2 * self.num_channels, block_threads(L, D), _launch_args(named))
        self.notify = None
        if not self.cached:
            import cupy

            self.meta = cupy.zeros(2 + self.num_local_experts, dtype=cupy.int32)
            notify = engine.kernel(notify_spec(L, D), internode_notify(L, D))
            named = notify_args(
                is_token_in_rank=0, num_tokens=self.num_tokens, num_channels=self.num_channels,
                num_tokens_per_expert=0, num_local_experts=self.num_local_experts,
                expert_alignment=max(1, int(expert_alignment)), rdma_channel_prefix_matrix=0,
                gbl_channel_prefix_matrix=0, recv_rdma_rank_prefix_sum=0, recv_gbl_rank_prefix_sum=0, meta=self.meta,
                sig=engine.sig_ptr, signals=engine.signals, nvl_bases=engine.nvl_bases, nvl=self.nvl,
                state=engine.state, err_ptr=engine.errors.ptr, timeout_ns=engine.timeout_ns, rank=me)
            self.notify = LaunchPlan(notify, 1, NOTIFY_THREADS, _launch_args(named))

    def run(self, x, x_scales, handle, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, stream):
        """One dispatch on the CuPy ``stream``. Returns ``(recv_x, recv_x_scales, recv_topk_idx,
        recv_topk_weights, num_recv_tokens_per_expert_list, handle)``."""
        import cupy

        engine = self.engine
        L, D = engine.num_nvl_ranks, engine.num_domains
        R, C = L * D, self.num_channels
        engine.use_geometry(self.geometry)
        p = self.plan.slot
        counts = None
        with cupy.cuda.Device(engine.device_id), stream:
            if self.cached:
                is_token_in_rank, rdma_cpm, gbl_cpm = handle[0], handle[1], handle[2]
                recv_rdma_prefix, recv_gbl_prefix = handle[4], handle[6]
                num_rows, nvl_rows = self.num_rows, 0
            else:
                rdma_cpm = cupy.empty((D, C), cupy.int32)
                gbl_cpm = cupy.empty((R, C), cupy.int32)
                recv_rdma_prefix = cupy.empty((D,), cupy.int32)
                recv_gbl_prefix = cupy.empty((R,), cupy.int32)
                n = self.notify.slot
                for name, arr in (("is_token_in_rank", is_token_in_rank), ("num_tokens_per_expert", num_tokens_per_expert),
                                  ("rdma_channel_prefix_matrix", rdma_cpm), ("gbl_channel_prefix_matrix", gbl_cpm),
                                  ("recv_rdma_rank_prefix_sum", recv_rdma_prefix),
                                  ("recv_gbl_rank_prefix_sum", recv_gbl_prefix)):
                    n(name).value = arr.data.ptr
                self.notify.launch(stream.ptr)
                if self.num_worst_tokens > 0:
                    num_rows = nvl_rows = self.num_worst_tokens
                    counts = []
                else:
                    host = cupy.asnumpy(self.meta, stream=stream)  # the one host wait, as DeepEP's
                    stream.synchronize()
                    engine.check_errors()
                    num_rows, nvl_rows = int(host[0]), int(host[1])
                    counts = [int(v) for v in host[2:]]
            recv_x = cupy.empty((num_rows, self.hidden), self.x_dtype)
            recv_scales = cupy.empty((num_rows, self.num_scales), cupy.float32) if x_scales is not None else None
            outs = {"x": x, "x_scales": x_scales, "is_token_in_rank": is_token_in_rank,
                    "rdma_channel_prefix_matrix": rdma_cpm, "gbl_channel_prefix_matrix": gbl_cpm,
                    "recv_rdma_rank_prefix_sum": recv_rdma_prefix, "recv_gbl_rank_prefix_sum": recv_gbl_prefix,
                    "recv_x": recv_x, "recv_x_scales": recv_scales}
            recv_topk_idx = recv_topk_weights = None
            if not self.cached:
                outs["recv_rdma_channel_prefix_matrix"] = recv_rdma_cpm = cupy.empty((D, C), cupy.int32)
                outs["recv_gbl_channel_prefix_matrix"] = recv_gbl_cpm = cupy.empty((R, C), cupy.int32)
                outs["recv_src_meta"] = src_meta = cupy.empty((num_rows, 2), cupy.int32)
                outs["send_rdma_head"] = send_rdma_head = cupy.empty((self.num_tokens, D), cupy.int32)
                outs["send_nvl_head"] = send_nvl_head = cupy.empty((nvl_rows, L), cupy.int32)
                if self.num_topk:
                    outs["topk_idx"] = topk_idx
                    outs["recv_topk_idx"] = recv_topk_idx = cupy.empty((num_rows, self.num_topk), cupy.int64)
                    if self.has_weights:
                        outs["topk_weights"] = topk_weights
                        outs["recv_topk_weights"] = recv_topk_weights = cupy.empty((num_rows, self.num_topk),
                                                                                   cupy.float32)
            for name, arr in outs.items():
                p(name).value = 0 if arr is None else arr.data.ptr
            p("num_out_rows").value = num_rows
            p("num_nvl_head_rows").value = nvl_rows
            self.plan.launch(stream.ptr)
        if self.cached:
            return recv_x, recv_scales, None, None, None, handle
        new_handle = (is_token_in_rank, rdma_cpm, gbl_cpm, recv_rdma_cpm, recv_rdma_prefix, recv_gbl_cpm,
                      recv_gbl_prefix, src_meta.view(np.uint8).reshape(-1, 8), send_rdma_head, send_nvl_head)
        return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, counts, new_handle


class CombinePlan:
    """Internode combine of BF16 rows for one (shapes, config), with the handle of an internode dispatch.

    The NVLink ring of each (channel, domain rank -> forwarder) is split into one sub-ring per source
    domain (``combine.cu``), so the config's NVLink ring needs at least ``D`` slots, and its progress words
    are those of ring ``c * D + d``: ``C * D`` must not exceed ``MAX_CHANNELS``.
    """

    def __init__(self, engine, x, handle, *, topk_weights, config) -> None:
        L, D = engine.num_nvl_ranks, engine.num_domains
        self.engine = engine
        self.num_rows, self.hidden = (int(s) for s in x.shape)
        if (2 * self.hidden) % 16:
            raise ValueError(f"a BF16 row must be a multiple of 16 bytes, got {2 * self.hidden}")
        self.num_channels = int(handle[1].shape[1])
        self.num_tokens = int(handle[0].shape[0])
        self.num_topk = int(topk_weights.shape[1]) if topk_weights is not None else 0
        if self.num_topk > IL.MAX_TOPK:
            raise ValueError(f"internode rows carry at most {IL.MAX_TOPK} top-k weights")
        if self.num_channels * D > IL.MAX_CHANNELS:
            raise ValueError(f"the internode combine needs channels x domains <= {IL.MAX_CHANNELS}, got "
                             f"{self.num_channels} x {D}")
        slot = IL.slot_for(self.hidden)
        rdma_cap, chunk = int(config.num_max_rdma_chunked_recv_tokens), int(config.num_max_rdma_chunked_send_tokens)
        self.rdma = IL.rdma_layout(L, D, self.num_channels, rdma_cap, slot)
        self.nvl = IL.nvl_layout(L, D, self.num_channels, int(config.num_max_nvl_chunked_recv_tokens), slot, 0)
        if self.nvl.cap < D:
            raise ValueError(f"the internode combine needs at least {D} NVLink ring slots (one per domain), "
                             f"got {self.nvl.cap}")
        check_sizes(engine, self.rdma, self.nvl)
        self.geometry = (self.hidden, self.num_channels, rdma_cap, self.nvl.cap)
        kernel = engine.kernel(combine_spec(L, D), internode_combine(L, D))
        named = combine_args(
            x=0, topk_weights=0, num_topk=self.num_topk, bias_0=0, bias_1=0, recv_rdma_channel_prefix_matrix=0,
            recv_rdma_rank_prefix_sum=0, recv_gbl_channel_prefix_matrix=0, recv_gbl_rank_prefix_sum=0,
            send_rdma_head=0, send_nvl_head=0, num_tokens=self.num_tokens, hidden_int4=2 * self.hidden // 16,
            combined_x=0, combined_topk_weights=0, rdma=engine.rdma_ptr, layout=self.rdma, rdma_chunk=max(1, chunk),
            sig=engine.sig_ptr, nvl_bases=engine.nvl_bases, nvl=self.nvl, state=engine.state,
            err_ptr=engine.errors.ptr, timeout_ns=engine.timeout_ns, rank=engine.rank)
        self.plan = LaunchPlan(kernel, 2 * self.num_channels, combine_block_threads(L, D), _launch_args(named))

    def run(self, x, handle, topk_weights, bias_0, bias_1, stream):
        """One combine on the CuPy ``stream``: ``(combined_x [N, hidden], combined_topk_weights [N, K] or
        None)``; ``x`` holds the rows the dispatch returned (``handle[6][-1]`` of them are read)."""
        import cupy

        engine = self.engine
        engine.use_geometry(self.geometry)
        p = self.plan.slot
        with cupy.cuda.Device(engine.device_id), stream:
            combined = cupy.empty((self.num_tokens, self.hidden), x.dtype)
            weights = (cupy.empty((self.num_tokens, self.num_topk), cupy.float32) if topk_weights is not None
                       else None)
            ptrs = {"x": x, "topk_weights": topk_weights, "bias_0": bias_0, "bias_1": bias_1,
                    "recv_rdma_channel_prefix_matrix": handle[3], "recv_rdma_rank_prefix_sum": handle[4],
                    "recv_gbl_channel_prefix_matrix": handle[5], "recv_gbl_rank_prefix_sum": handle[6],
                    "send_rdma_head": handle[8], "send_nvl_head": handle[9], "combined_x": combined,
                    "combined_topk_weights": weights}
            for name, arr in ptrs.items():
                p(name).value = 0 if arr is None else arr.data.ptr
            self.plan.launch(stream.ptr)
        return combined, weights

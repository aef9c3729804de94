"""Argument lists of the intranode kernels (notify, dispatch, combine), in the kernels' parameter order, with
their parameter names: what a launch plan packs once (:mod:`deepep_cupy.ops.intranode.plans`), and what the
CPU tests check against the kernels' signatures."""

from __future__ import annotations

import numpy as np

from ..plan import kernel_pointer
from . import layout as L

__all__ = ["notify_args", "dispatch_args", "combine_args", "publish_batch", "kernel_pointer"]


def publish_batch(send_tokens: int, cap: int) -> int:
    """Tokens published per fence (the kernels' ``clamp_batch``): ``send_tokens`` clamped to
    ``[1, min(32, ceil(cap / 2))]``, so that no sender waits for a free slot held by its own unpublished run."""
    return max(1, min(int(send_tokens), 32, (int(cap) + 1) // 2))


def notify_args(*, is_token_in_rank, num_tokens, num_channels, num_tokens_per_expert, num_local_experts,
                expert_alignment, rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, meta,
                bases, notify_offset, notify_stride, err_ptr, timeout_ns, rank) -> list[tuple[str, object]]:
    """Arguments of notify_dispatch_kernel, in order, with their parameter names (checked by the CPU tests)."""
    return [
        ("is_token_in_rank", is_token_in_rank),
        ("num_tokens", np.int32(num_tokens)),
        ("num_channels", np.int32(num_channels)),
        ("num_tokens_per_expert", num_tokens_per_expert),
        ("num_local_experts", np.int32(num_local_experts)),
        ("expert_alignment", np.int32(expert_alignment)),
        ("rank_prefix_matrix", rank_prefix_matrix),
        ("channel_prefix_matrix", channel_prefix_matrix),
        ("recv_channel_prefix_matrix", recv_channel_prefix_matrix),
        ("meta", meta),
        ("bases", bases),
        ("notify_offset", np.int64(notify_offset)),
        ("notify_stride", np.int32(notify_stride)),
        ("err", np.uint64(err_ptr)),
        ("timeout_ns", np.int64(timeout_ns)),
        ("rank", np.int32(rank)),
    ]


def dispatch_args(*, x, x_scales, scale_token_stride, scale_block_stride, num_scales, topk_idx, topk_weights,
                  num_topk, num_local_experts, is_token_in_rank, num_tokens, hidden_int4, rank_prefix_matrix,
                  channel_prefix_matrix, recv_channel_prefix_matrix, recv_x, recv_x_scales, recv_topk_idx,
                  recv_topk_weights, recv_src_idx, send_head, num_out_rows, num_worst_tokens, bases,
                  layout: L.BufferLayout, num_self_warps, err_ptr, timeout_ns, rank, num_recv_self_warps=0,
                  batch=1, self_claims=0, pool_bases=None, fan_out=False) -> list[tuple[str, object]]:
    """Arguments of dispatch_kernel, in order, with their parameter names. ``pool_bases``: every rank's output
    pool when this call's outputs are in this rank's (patched per call); the done words of the direct mode
    follow the rings (``layout.end``)."""
    slot = layout.slot
    return [
        ("x", x),
        ("x_scales", kernel_pointer(x_scales)),
        ("scale_token_stride", np.int64(scale_token_stride)),
        ("scale_block_stride", np.int64(scale_block_stride)),
        ("num_scales", np.int32(num_scales)),
        ("topk_idx", kernel_pointer(topk_idx)),
        ("topk_weights", kernel_pointer(topk_weights)),
        ("num_topk", np.int32(num_topk)),
        ("num_local_experts", np.int32(num_local_experts)),
        ("is_token_in_rank", is_token_in_rank),
        ("num_tokens", np.int32(num_tokens)),
        ("hidden_int4", np.int32(hidden_int4)),
        ("rank_prefix_matrix", rank_prefix_matrix),
        ("channel_prefix_matrix", channel_prefix_matrix),
        ("recv_channel_prefix_matrix", recv_channel_prefix_matrix),
        ("recv_x", recv_x),
        ("recv_x_scales", kernel_pointer(recv_x_scales)),
        ("recv_topk_idx", kernel_pointer(recv_topk_idx)),
        ("recv_topk_weights", kernel_pointer(recv_topk_weights)),
        ("recv_src_idx", kernel_pointer(recv_src_idx)),
        ("send_head", kernel_pointer(send_head)),
        ("num_out_rows", np.int32(num_out_rows)),
        ("num_worst_tokens", np.int32(num_worst_tokens)),
        ("own_rows_copied", np.int32(0)),
        ("fan_out", np.int32(fan_out)),
        ("bases", bases),
        ("pool_bases", kernel_pointer(pool_bases)),
        ("done_offset", np.int64(layout.end)),
        ("ring_offset", np.int64(layout.ring_offset)),
        ("free_offset", np.int64(layout.free_offset)),
        ("slot_bytes", np.int32(slot.slot_bytes)),
        ("cap", np.int32(layout.cap)),
        ("slot_scales_offset", np.int32(slot.scales_offset)),
        ("slot_topk_idx_offset", np.int32(slot.topk_idx_offset)),
        ("slot_topk_weights_offset", np.int32(slot.topk_weights_offset)),
        ("num_channels", np.int32(layout.num_channels)),
        ("num_self_warps", np.int32(num_self_warps)),
        ("num_recv_self_warps", np.int32(num_recv_self_warps)),
        ("publish_batch", np.int32(publish_batch(batch, layout.cap))),
        ("self_claims", np.uint64(self_claims)),
        ("err", np.uint64(err_ptr)),
        ("timeout_ns", np.int64(timeout_ns)),
        ("rank", np.int32(rank)),
    ]


def combine_args(*, x, topk_weights, num_topk, bias_0, bias_1, rank_prefix_matrix, channel_prefix_matrix,
                 recv_channel_prefix_matrix, send_head, num_tokens, hidden_int4, combined_x, combined_topk_weights,
                 bases, layout: L.BufferLayout, err_ptr, timeout_ns, rank, batch=1, run_claims=0) -> list[tuple[str, object]]:
    """Arguments of combine_kernel, in order, with their parameter names."""
    return [
        ("x", x),
        ("topk_weights", kernel_pointer(topk_weights)),
        ("num_topk", np.int32(num_topk)),
        ("bias_0", kernel_pointer(bias_0)),
        ("bias_1", kernel_pointer(bias_1)),
        ("rank_prefix_matrix", rank_prefix_matrix),
        ("channel_prefix_matrix", channel_prefix_matrix),
        ("recv_channel_prefix_matrix", recv_channel_prefix_matrix),
        ("send_head", send_head),
        ("num_tokens", np.int32(num_tokens)),
        ("hidden_int4", np.int32(hidden_int4)),
        ("combined_x", combined_x),
        ("combined_topk_weights", kernel_pointer(combined_topk_weights)),
        ("bases", bases),
        ("ring_offset", np.int64(layout.ring_offset)),
        ("free_offset", np.int64(layout.free_offset)),
        ("slot_bytes", np.int32(layout.slot.slot_bytes)),
        ("cap", np.int32(layout.cap)),
        ("slot_topk_weights_offset", np.int32(layout.slot.topk_weights_offset)),
        ("num_channels", np.int32(layout.num_channels)),
        ("publish_batch", np.int32(publish_batch(batch, layout.cap))),
        ("run_claims", np.uint64(run_claims)),
        ("err", np.uint64(err_ptr)),
        ("timeout_ns", np.int64(timeout_ns)),
        ("rank", np.int32(rank)),
    ]

"""The intranode kernels' parameter structs (``cuda_src/intranode/args.cuh``, read once at import) and the
values a plan packs into them (:mod:`deepep_cupy.ops.intranode.plans`): each builder returns a value for every
field by name, and a :class:`~deepep_cupy.device.launch.LaunchPlan` refuses a missing or unknown one."""

from __future__ import annotations

from ..headers import constant, kernel_struct
from ..plan import kernel_pointer
from . import buffer_map as L

__all__ = ["NOTIFY", "DISPATCH", "COMBINE", "COMBINE_COPY", "KERNEL_STRUCTS", "NOTIFY_THREADS", "notify_args",
           "dispatch_args", "combine_args", "publish_batch", "kernel_pointer"]

_HEADER = "intranode/args.cuh"
NOTIFY = kernel_struct(_HEADER, "NotifyArgs")
DISPATCH = kernel_struct(_HEADER, "DispatchArgs")
COMBINE = kernel_struct(_HEADER, "CombineArgs")
COMBINE_COPY = kernel_struct(_HEADER, "CombineCopyArgs")
#: Every kernel of the family -> its parameter struct.
KERNEL_STRUCTS = {"notify": NOTIFY, "dispatch": DISPATCH, "combine": COMBINE, "combine_copy": COMBINE_COPY}
#: Threads of the notify kernel's one block (its launch bounds).
NOTIFY_THREADS = constant("intranode/notify.cu", "kNotifyThreads")


def publish_batch(send_tokens: int, cap: int) -> int:
    """Tokens published per fence (the kernels' ``clamp_batch``): ``send_tokens`` clamped to
    ``[1, min(32, ceil(cap / 2))]``, so that no sender waits for a free slot held by its own unpublished run."""
    return max(1, min(int(send_tokens), 32, (int(cap) + 1) // 2))


def notify_args(*, is_token_in_rank, num_tokens, num_channels, num_tokens_per_expert, num_local_experts,
                expert_alignment, rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, meta,
                bases, notify_offset, notify_stride, err_ptr, timeout_ns, rank) -> dict:
    """Values of ``NotifyArgs``."""
    return dict(is_token_in_rank=is_token_in_rank, num_tokens=num_tokens, num_channels=num_channels,
                num_tokens_per_expert=num_tokens_per_expert, num_local_experts=num_local_experts,
                expert_alignment=expert_alignment, rank_prefix_matrix=rank_prefix_matrix,
                channel_prefix_matrix=channel_prefix_matrix, recv_channel_prefix_matrix=recv_channel_prefix_matrix,
                meta=meta, bases=bases, notify_offset=notify_offset, notify_stride=notify_stride, err=err_ptr,
                timeout_ns=timeout_ns, rank=rank)


def dispatch_args(*, x, x_scales, scale_token_stride, scale_block_stride, num_scales, topk_idx, topk_weights,
                  num_topk, num_local_experts, is_token_in_rank, num_tokens, hidden_int4, rank_prefix_matrix,
                  channel_prefix_matrix, recv_channel_prefix_matrix, recv_x, recv_x_scales, recv_topk_idx,
                  recv_topk_weights, recv_src_idx, send_head, num_out_rows, num_worst_tokens, bases,
                  buffer_map: L.IntranodeBufferMap, num_own_rows_warps, err_ptr, timeout_ns, rank,
                  num_recv_own_rows_warps=0, batch=1, own_rows_claims=0, pool_bases=None, fan_out=False) -> dict:
    """Values of ``DispatchArgs``. ``pool_bases``: every rank's output pool when this call's outputs are in this
    rank's (patched per call); the done words of the direct mode follow the rings (``buffer_map.end``)."""
    slot = buffer_map.slot
    return dict(
        x=x, x_scales=kernel_pointer(x_scales), scale_token_stride=scale_token_stride,
        scale_block_stride=scale_block_stride, num_scales=num_scales, topk_idx=kernel_pointer(topk_idx),
        topk_weights=kernel_pointer(topk_weights), num_topk=num_topk, num_local_experts=num_local_experts,
        is_token_in_rank=is_token_in_rank, num_tokens=num_tokens, hidden_int4=hidden_int4,
        rank_prefix_matrix=rank_prefix_matrix, channel_prefix_matrix=channel_prefix_matrix,
        recv_channel_prefix_matrix=recv_channel_prefix_matrix, recv_x=recv_x,
        recv_x_scales=kernel_pointer(recv_x_scales), recv_topk_idx=kernel_pointer(recv_topk_idx),
        recv_topk_weights=kernel_pointer(recv_topk_weights), recv_src_idx=kernel_pointer(recv_src_idx),
        send_head=kernel_pointer(send_head), num_out_rows=num_out_rows, num_worst_tokens=num_worst_tokens,
        own_rows_copied=0, fan_out=int(bool(fan_out)), bases=bases, pool_bases=kernel_pointer(pool_bases),
        done_offset=buffer_map.end, ring_offset=buffer_map.ring_offset, free_offset=buffer_map.free_offset,
        slot_bytes=slot.slot_bytes, cap=buffer_map.cap, slot_scales_offset=slot.scales_offset,
        slot_topk_idx_offset=slot.topk_idx_offset, slot_topk_weights_offset=slot.topk_weights_offset,
        num_channels=buffer_map.num_channels, num_own_rows_warps=num_own_rows_warps,
        num_recv_own_rows_warps=num_recv_own_rows_warps, publish_batch=publish_batch(batch, buffer_map.cap),
        own_rows_claims=own_rows_claims, err=err_ptr,
        timeout_ns=timeout_ns, rank=rank)


def combine_args(*, x, topk_weights, num_topk, bias_0, bias_1, rank_prefix_matrix, channel_prefix_matrix,
                 recv_channel_prefix_matrix, send_head, num_tokens, hidden_int4, combined_x, combined_topk_weights,
                 bases, buffer_map: L.IntranodeBufferMap, err_ptr, timeout_ns, rank, batch=1,
                 run_claims=0, order_topk_idx=0, order_num_topk=0, num_local_experts=1) -> dict:
    """Values of ``CombineArgs``; ``order_topk_idx`` (with its width and the experts per rank): the source
    tokens' top-k, for V2's summation order (``combine_sum.cuh``), 0 for rank order."""
    return dict(
        x=x, topk_weights=kernel_pointer(topk_weights), num_topk=num_topk, bias_0=kernel_pointer(bias_0),
        bias_1=kernel_pointer(bias_1), rank_prefix_matrix=rank_prefix_matrix,
        channel_prefix_matrix=channel_prefix_matrix, recv_channel_prefix_matrix=recv_channel_prefix_matrix,
        send_head=send_head, num_tokens=num_tokens, hidden_int4=hidden_int4, combined_x=combined_x,
        combined_topk_weights=kernel_pointer(combined_topk_weights), order_topk_idx=order_topk_idx,
        order_num_topk=order_num_topk, num_local_experts=num_local_experts, bases=bases,
        ring_offset=buffer_map.ring_offset, free_offset=buffer_map.free_offset,
        slot_bytes=buffer_map.slot.slot_bytes, cap=buffer_map.cap,
        slot_topk_weights_offset=buffer_map.slot.topk_weights_offset, num_channels=buffer_map.num_channels,
        publish_batch=publish_batch(batch, buffer_map.cap), run_claims=run_claims, err=err_ptr,
        timeout_ns=timeout_ns, rank=rank)

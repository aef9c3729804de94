"""The internode kernels' parameter structs (``cuda_src/internode/args.cuh``, read once at import) and the
values a plan packs into them (:mod:`deepep_cupy.ops.internode.plans`): each builder returns a value for every
field by name, and a :class:`~deepep_cupy.device.launch.LaunchPlan` refuses a missing or unknown one. The
builders take the handle entries by their DeepEP names; the fields are the kernels' shorter ones."""

from __future__ import annotations

from ..headers import constant, kernel_struct
from ..plan import kernel_pointer as _ptr
from . import buffer_map as IL

__all__ = ["NOTIFY", "DISPATCH", "COMBINE", "KERNEL_STRUCTS", "NOTIFY_THREADS", "notify_args", "dispatch_args",
           "combine_args"]

_HEADER = "internode/args.cuh"
NOTIFY = kernel_struct(_HEADER, "NotifyArgs")
DISPATCH = kernel_struct(_HEADER, "DispatchArgs")
COMBINE = kernel_struct(_HEADER, "CombineArgs")
#: Every kernel of the family -> its parameter struct.
KERNEL_STRUCTS = {"notify": NOTIFY, "dispatch": DISPATCH, "combine": COMBINE}
#: Threads of the notify kernel's one block (its launch bounds).
NOTIFY_THREADS = constant("internode/notify.cu", "kNotifyThreads")


def notify_args(*, is_token_in_rank, num_tokens, num_channels, num_tokens_per_expert, num_local_experts,
                expert_alignment, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix, recv_rdma_rank_prefix_sum,
                recv_gbl_rank_prefix_sum, meta, sig, signals: IL.SignalMap, nvl_bases, nvl: IL.NvlBufferMap,
                state, err_ptr, timeout_ns, rank) -> dict:
    """Values of ``NotifyArgs``."""
    return dict(
        is_token_in_rank=is_token_in_rank, num_tokens=num_tokens, num_channels=num_channels,
        num_tokens_per_expert=num_tokens_per_expert, num_local_experts=num_local_experts,
        expert_alignment=expert_alignment, rdma_channel_prefix_matrix=rdma_channel_prefix_matrix,
        gbl_channel_prefix_matrix=gbl_channel_prefix_matrix, recv_rdma_rank_prefix_sum=recv_rdma_rank_prefix_sum,
        recv_gbl_rank_prefix_sum=recv_gbl_rank_prefix_sum, meta=meta, sig=sig, record_offset=signals.record_offset,
        record_stride=signals.record_stride, nvl_bases=nvl_bases, nvl_notify_offset=nvl.notify_offset,
        nvl_record_stride=nvl.record_stride, state_words=state, err=err_ptr, timeout_ns=timeout_ns, rank=rank)


def dispatch_args(*, x, x_scales, scale_token_stride, scale_block_stride, num_scales, topk_idx, topk_weights,
                  num_topk, num_local_experts, is_token_in_rank, num_tokens, hidden_int4, rdma_channel_prefix_matrix,
                  gbl_channel_prefix_matrix, recv_rdma_rank_prefix_sum, recv_gbl_rank_prefix_sum, recv_x,
                  recv_x_scales, recv_topk_idx, recv_topk_weights, recv_rdma_channel_prefix_matrix,
                  recv_gbl_channel_prefix_matrix, recv_src_meta, send_rdma_head, send_nvl_head, num_out_rows,
                  num_nvl_head_rows, rdma, rdma_map: IL.RdmaBufferMap, rdma_chunk, sig, nvl_bases,
                  nvl: IL.NvlBufferMap, state, err_ptr, timeout_ns, rank, force_rma=False,
                  own_rows_copied=False, pool_bases=0, outputs_in_pool=False) -> dict:
    """Values of ``DispatchArgs``. ``pool_bases``: the domain's output pools as mapped here (0: none;
    dispatch_forward.cuh)."""
    slot = rdma_map.slot
    return dict(
        x=x, x_scales=_ptr(x_scales), scale_token_stride=scale_token_stride, scale_block_stride=scale_block_stride,
        num_scales=num_scales, topk_idx=_ptr(topk_idx), topk_weights=_ptr(topk_weights), num_topk=num_topk,
        num_local_experts=num_local_experts, is_token_in_rank=is_token_in_rank, num_tokens=num_tokens,
        hidden_int4=hidden_int4, rdma_cpm=rdma_channel_prefix_matrix, gbl_cpm=gbl_channel_prefix_matrix,
        recv_rdma_prefix=recv_rdma_rank_prefix_sum, recv_gbl_prefix=recv_gbl_rank_prefix_sum, recv_x=recv_x,
        recv_x_scales=_ptr(recv_x_scales), recv_topk_idx=_ptr(recv_topk_idx),
        recv_topk_weights=_ptr(recv_topk_weights), recv_rdma_cpm=_ptr(recv_rdma_channel_prefix_matrix),
        recv_gbl_cpm=_ptr(recv_gbl_channel_prefix_matrix), recv_src_meta=_ptr(recv_src_meta),
        send_rdma_head=_ptr(send_rdma_head), send_nvl_head=_ptr(send_nvl_head), num_out_rows=num_out_rows,
        num_nvl_head_rows=num_nvl_head_rows, rdma=rdma,
        ring_offset=rdma_map.ring_offset, slot_bytes=slot.slot_bytes,
        slot_scales_offset=slot.scales_offset, slot_topk_idx_offset=slot.topk_idx_offset,
        slot_topk_weights_offset=slot.topk_weights_offset, rdma_cap=rdma_map.cap, rdma_chunk=rdma_chunk, sig=sig,
        nvl_bases=nvl_bases, nvl_meta_offset=nvl.meta_offset, nvl_ring_offset=nvl.ring_offset, nvl_cap=nvl.cap,
        num_channels=rdma_map.num_channels, state=state, err=err_ptr, timeout_ns=timeout_ns, rank=rank,
        force_rma=int(bool(force_rma)), own_rows_copied=int(bool(own_rows_copied)), pool_bases=pool_bases,
        outputs_in_pool=int(bool(outputs_in_pool)), nvl_reply_offset=nvl.reply_offset)


def combine_args(*, x, topk_weights, num_topk, bias_0, bias_1, recv_rdma_channel_prefix_matrix,
                 recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, send_rdma_head,
                 send_nvl_head, num_tokens, hidden_int4, combined_x, combined_topk_weights, rdma,
                 rdma_map: IL.RdmaBufferMap, rdma_chunk, sig, nvl_bases, nvl: IL.NvlBufferMap, state, err_ptr,
                 timeout_ns, rank, force_rma=False) -> dict:
    """Values of ``CombineArgs``."""
    return dict(
        x=x, topk_weights=_ptr(topk_weights), num_topk=num_topk, bias_0=_ptr(bias_0), bias_1=_ptr(bias_1),
        recv_rdma_cpm=recv_rdma_channel_prefix_matrix, recv_rdma_prefix=recv_rdma_rank_prefix_sum,
        recv_gbl_cpm=recv_gbl_channel_prefix_matrix, recv_gbl_prefix=recv_gbl_rank_prefix_sum,
        send_rdma_head=send_rdma_head, send_nvl_head=send_nvl_head, num_tokens=num_tokens, hidden_int4=hidden_int4,
        combined_x=combined_x, combined_topk_weights=_ptr(combined_topk_weights), rdma=rdma,
        ring_offset=rdma_map.ring_offset, slot_bytes=rdma_map.slot.slot_bytes,
        slot_topk_weights_offset=rdma_map.slot.topk_weights_offset, rdma_cap=rdma_map.cap,
        rdma_chunk=rdma_chunk, sig=sig, nvl_bases=nvl_bases, nvl_ring_offset=nvl.ring_offset, nvl_cap=nvl.cap,
        num_channels=rdma_map.num_channels, state=state, err=err_ptr, timeout_ns=timeout_ns, rank=rank,
        force_rma=int(bool(force_rma)))

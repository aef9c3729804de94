"""``ReferenceOracle``: the NumPy implementation behind ``Buffer`` when no GPU kernel is used.

The backend holds only host state: the rank mask of the fault-tolerance APIs (this rank's own
view) and the two low-latency combine buffers. All communication goes through the ``group``
object (``rank``, ``size``, ``allgather_object``, ``alltoall_object``, ``barrier``); every operation is
a collective that all ranks of the group must call in the same order, as with the GPU kernels.
Results are deterministic: they depend only on the inputs, never on timing.

Differences from the GPU buffers, all of them on the lenient side:

* Results are fresh arrays; they do not live in (and are not overwritten through) a shared buffer.
  Only ``get_next_low_latency_combine_buffer`` returns persistent storage: two arrays that alternate
  like DeepEP's two low-latency buffers (every low-latency dispatch and combine switches to the
  other one).
* The wait-time statistics (``dispatch_wait_recv_cost_stats``, ``combine_wait_recv_cost_stats``)
  are accepted and left unchanged (0 is added): a host exchange has no per-peer wait time.
* The normal-mode handle is the 6-tuple of the NVLink-domain kernels within one domain and DeepEP's
  10-entry internode handle across several (``internode.py``); received rows are grouped by source
  rank in both cases, the same rows in the same order.
* With ``return_recv_hook=True`` the exchange happens at call time; the returned arrays are
  poisoned (NaN data and scales, -1 counts and packed UE8M0 words) until the hook is called, which
  writes the results in place; the receive statistics are accumulated by the hook.
"""

from __future__ import annotations

import numpy as np

from . import internode, low_latency, normal
from .quant import BF16


class ReferenceOracle:
    """NumPy reference of every ``Buffer`` operation; see the module docstrings for exact semantics.

    ``num_nvl_ranks`` is the NVLink-domain size (ranks per node); ``num_rdma_ranks = size //
    num_nvl_ranks``. ``num_channels`` is the channel count the normal-mode handle is expressed in.
    """

    def __init__(self, group, *, num_nvl_ranks: int, low_latency_mode: bool, enable_shrink: bool,
                 num_channels: int = 10):
        if num_nvl_ranks <= 0 or group.size % num_nvl_ranks:
            raise ValueError(f"group size {group.size} is not a multiple of num_nvl_ranks={num_nvl_ranks}")
        if num_channels <= 0:
            raise ValueError(f"num_channels must be positive, got {num_channels}")
        self.group = group
        self.rank = group.rank
        self.num_ranks = group.size
        self.num_nvl_ranks = num_nvl_ranks
        self.num_rdma_ranks = group.size // num_nvl_ranks
        self.low_latency_mode = low_latency_mode
        self.enable_shrink = enable_shrink
        self.num_channels = num_channels
        self._mask = np.zeros(self.num_ranks, dtype=bool)
        self._combine_buffers = [None, None]
        self._ll_idx = 0

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(self, topk_idx, num_experts):
        """See ``normal.dispatch_layout``; purely local, no communication."""
        return normal.dispatch_layout(topk_idx, num_experts, self.num_ranks, self.num_nvl_ranks)

    def dispatch(self, x, x_scales, *, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                 topk_idx, topk_weights, expert_alignment, num_worst_tokens):
        """See ``normal.dispatch``. ``num_tokens_per_rank`` is implied by ``is_token_in_rank`` and unused.

        The handle is ``(rank_prefix_matrix [R, R] int32, channel_prefix_matrix [R, C] int32,
        recv_channel_prefix_matrix [R, C] int32, recv_src_idx [rows] int32, is_token_in_rank [N, R] bool,
        send_head [N, R] int32)`` within one NVLink domain, the 10-tuple of ``internode.py`` across several.
        """
        del num_tokens_per_rank
        if self.num_rdma_ranks > 1:
            return internode.dispatch(
                self.group, x, x_scales, handle=handle, is_token_in_rank=is_token_in_rank,
                num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                expert_alignment=int(expert_alignment), num_worst_tokens=int(num_worst_tokens or 0),
                num_channels=self.num_channels, num_nvl_ranks=self.num_nvl_ranks)
        return normal.dispatch(self.group, x, x_scales, handle=handle, is_token_in_rank=is_token_in_rank,
                               num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
                               topk_weights=topk_weights, expert_alignment=int(expert_alignment),
                               num_worst_tokens=int(num_worst_tokens or 0), num_channels=self.num_channels)

    def combine(self, x, handle, *, topk_weights, bias_0, bias_1, order=None):
        """See ``normal.combine``. Returns ``(combined_x, combined_topk_weights or None)``."""
        if self.num_rdma_ranks > 1:
            if order is not None:
                raise NotImplementedError("V2's summation order across NVLink domains")
            return internode.combine(self.group, x, handle, topk_weights=topk_weights, bias_0=bias_0, bias_1=bias_1,
                                     num_nvl_ranks=self.num_nvl_ranks)
        return normal.combine(self.group, x, handle, topk_weights=topk_weights, bias_0=bias_0, bias_1=bias_1,
                              order=order)

    # ------------------------------------------------------------------ low-latency mode
    def _switch_buffer(self) -> None:
        self._ll_idx ^= 1

    def low_latency_dispatch(self, x, topk_idx, *, num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
                             round_scale, use_ue8m0, cumulative_local_expert_recv_stats,
                             dispatch_wait_recv_cost_stats, return_recv_hook):
        """See ``low_latency.dispatch``.

        Returns ``(recv_x or (recv_x, recv_scales), recv_count, handle, hook or None)`` with handle
        ``(src_info, layout_range, T, H, E)``. ``cumulative_local_expert_recv_stats [E_local] int32`` gets
        ``recv_count`` added in place (when the hook runs, if one is returned).
        """
        t_max, hidden = int(num_max_dispatch_tokens_per_rank), int(x.shape[1])
        recv_x, scales, count, src_info, layout_range = low_latency.dispatch(
            self.group, x, topk_idx, num_max_dispatch_tokens_per_rank=t_max, num_experts=int(num_experts),
            use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, masked=self._mask.copy())
        self._switch_buffer()
        if dispatch_wait_recv_cost_stats is not None:
            dispatch_wait_recv_cost_stats += 0
        handle = (src_info, layout_range, t_max, hidden, int(num_experts))

        def account():
            if cumulative_local_expert_recv_stats is not None:
                stats = cumulative_local_expert_recv_stats
                np.add(stats, count.astype(stats.dtype), out=stats)

        if not return_recv_hook:
            account()
            return ((recv_x, scales) if use_fp8 else recv_x), count, handle, None

        out_x = np.full(recv_x.shape, np.nan, dtype=recv_x.dtype)
        out_count = np.full(count.shape, -1, dtype=np.int32)
        out_scales = None
        if scales is not None:
            poison = np.nan if scales.dtype == np.float32 else -1
            out_scales = np.full((scales.shape[0], scales.shape[2], scales.shape[1]), poison,
                                 dtype=scales.dtype).transpose(0, 2, 1)
        done = []

        def hook():
            if done:
                return
            out_x[...] = recv_x
            out_count[...] = count
            if out_scales is not None:
                out_scales[...] = scales
            account()
            done.append(True)

        return ((out_x, out_scales) if use_fp8 else out_x), out_count, handle, hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, *, use_logfmt, zero_copy, return_recv_hook,
                            out, combine_wait_recv_cost_stats):
        """See ``low_latency.combine``. Returns ``(combined_x [N, H] bf16, hook or None)``.

        ``zero_copy=True`` reads the expert outputs from ``get_next_low_latency_combine_buffer(handle)``
        instead of ``x``. ``out`` (bf16 ``[N, H]``) receives the result and is returned.
        """
        if zero_copy:
            x = self.get_next_low_latency_combine_buffer(handle)
        result = low_latency.combine(self.group, x, topk_idx, topk_weights, handle, use_logfmt=use_logfmt,
                                     masked=self._mask.copy())
        self._switch_buffer()
        if combine_wait_recv_cost_stats is not None:
            combine_wait_recv_cost_stats += 0
        if not return_recv_hook:
            if out is None:
                return result, None
            out[...] = result
            return out, None

        target = np.empty(result.shape, dtype=BF16) if out is None else out
        target[...] = np.nan

        def hook():
            target[...] = result

        return target, hook

    def get_next_low_latency_combine_buffer(self, handle):
        """Persistent bf16 ``[E_local, R*T, H]`` array the next low-latency combine reads with ``zero_copy``."""
        _, _, t_max, hidden, num_experts = handle
        shape = (num_experts // self.num_ranks, self.num_ranks * t_max, hidden)
        buf = self._combine_buffers[self._ll_idx]
        if buf is None or buf.shape != shape:
            buf = np.zeros(shape, dtype=BF16)
            self._combine_buffers[self._ll_idx] = buf
        return buf

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts) -> None:
        """Zero both combine buffers (allocating them for the given shape if needed)."""
        shape = (num_experts // self.num_ranks, self.num_ranks * int(num_max_dispatch_tokens_per_rank), int(hidden))
        for i, buf in enumerate(self._combine_buffers):
            if buf is None or buf.shape != shape:
                self._combine_buffers[i] = np.zeros(shape, dtype=BF16)
            else:
                buf[...] = 0

    # ------------------------------------------------------------------ masking
    def _require_shrink(self, what: str) -> None:
        if not self.enable_shrink:
            raise RuntimeError(f"{what} needs a Buffer created with enable_shrink=True")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Set (``mask=True``) or clear this rank's view of ``rank_to_mask``; local, no communication."""
        self._require_shrink("low_latency_update_mask_buffer")
        if not 0 <= rank_to_mask < self.num_ranks:
            raise ValueError(f"rank_to_mask={rank_to_mask} out of range [0, {self.num_ranks})")
        self._mask[rank_to_mask] = bool(mask)

    def low_latency_query_mask_buffer(self, mask_status) -> None:
        """Overwrite ``mask_status [R] int32`` with 1 for masked ranks and 0 for the others."""
        self._require_shrink("low_latency_query_mask_buffer")
        mask_status[...] = self._mask.astype(mask_status.dtype)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank (this rank's view)."""
        self._require_shrink("low_latency_clean_mask_buffer")
        self._mask[...] = False

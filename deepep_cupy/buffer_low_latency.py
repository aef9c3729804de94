"""The low-latency half of the public ``Buffer`` (decoding): dispatch, combine, their buffers and the
peer mask, on the state and the op frame of :class:`~deepep_cupy.buffer_core.BufferCore`."""

from __future__ import annotations

from . import checks
from .buffer_core import BufferCore
from .custom_ops import outside, tracing_check
from .frameworks import I32, meta
from .ops.handles import device_handle_values, ll_handle_meta
from .ops.plan import lookup, store

__all__ = ["LowLatencyOps"]

# torch.compile: True only while dynamo traces a call (then the call goes to deepep_cupy.custom_ops's custom ops).
_compiling = tracing_check(globals())


class LowLatencyOps(BufferCore):
    """The ``low_latency_*`` methods of ``Buffer``."""

    def _ll_required(self, op: str) -> None:
        if not self.low_latency_mode:
            raise RuntimeError(f"{op} needs a Buffer created with low_latency_mode=True")

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Re-zero what the low-latency kernels expect zeroed (needed after normal kernels used the buffer).

        Arguments:
            num_max_dispatch_tokens_per_rank: as for ``low_latency_dispatch``.
            hidden: hidden size.
            num_experts: total experts.
        """
        if _compiling():  # torch.compile: a graph break
            return outside(self.clean_low_latency_buffer, num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self._alive()
        self._ll_required("clean_low_latency_buffer")
        checks.positive_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
        checks.positive_int("hidden", hidden)
        self._num_experts_ok(num_experts)
        self.runtime.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """Low-latency dispatch for decoding: every (token, expert) pair goes straight to the expert's rank.

        Two result buffers alternate, so at most two dispatch/combine results may be held at once.

        Arguments:
            x: `[num_tokens, hidden]` bf16, ``num_tokens <= num_max_dispatch_tokens_per_rank``.
            topk_idx: `[num_tokens, num_topk]` int64, -1 for none.
            num_max_dispatch_tokens_per_rank: T, same on every rank.
            num_experts: total experts.
            cumulative_local_expert_recv_stats: optional `[num_local_experts]` int32, received counts are added.
            dispatch_wait_recv_cost_stats: optional `[num_ranks]` (or `[num_ranks, num_ranks]`, this rank's row)
                int64, wait time per source rank is added (nanoseconds).
            use_fp8: cast to FP8 e4m3 with one float32 scale per 128 channels (amax / 448).
            round_scale: round scales up to powers of two.
            use_ue8m0: pack power-of-two scales as 8-bit exponents, 4 per int32 (needs ``round_scale``).
            async_finish: do not make the current stream wait; wait on the returned event instead.
            return_recv_hook: only issue the sends; calling the returned hook receives. The sends run on
                the communication stream beside the caller's next work; the hook makes the current stream
                wait for them and receives there. Call every hook (also in a CUDA graph capture).

        Returns:
            recv_x: `[num_local_experts, num_ranks * T, hidden]` bf16, or with FP8 a tuple of the e4m3 data
                and scales `[num_local_experts, num_ranks * T, hidden // 128]` float32 (UE8M0: int32,
                `hidden // 512`), scales column-major in their last two dimensions. Rows of each expert are
                grouped by source rank, this rank's own group first and then the other ranks cyclically
                (``rank + 1, ..., rank - 1``), in source token order within a source; ``handle[1]`` gives
                each source's rows.
            recv_count: `[num_local_experts]` int32 valid rows per expert.
            handle: `(src_info, layout_range, T, hidden, num_experts)` for ``low_latency_combine``.
            event: an ``EventOverlap``.
            hook: receive function with ``return_recv_hook``, else None.
        """
        if _compiling():  # torch.compile
            from .custom_ops import low_latency as traced
            return traced.low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                               cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                                               use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)
        with self._frames.low_latency_dispatch:
            # The sizes' types too (8.0 == 8): a float must not find the plan an int made.
            key = (meta(x), meta(topk_idx), num_max_dispatch_tokens_per_rank, num_experts,
                   type(num_max_dispatch_tokens_per_rank), type(num_experts),
                   meta(cumulative_local_expert_recv_stats), meta(dispatch_wait_recv_cost_stats), use_fp8,
                   round_scale, use_ue8m0, async_finish, return_recv_hook)
            plan = lookup(self._ll_dispatch_plans, key)
            if plan is None:
                self._ll_required("low_latency_dispatch")
                checks.ll_dispatch_args(self.group_size, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                        cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                        round_scale, use_ue8m0)
                plan = store(self._ll_dispatch_plans, key, self.runtime.plan_low_latency_dispatch(
                    x, topk_idx, num_max_dispatch_tokens_per_rank=int(num_max_dispatch_tokens_per_rank),
                    num_experts=int(num_experts), dispatch_wait_recv_cost_stats=dispatch_wait_recv_cost_stats,
                    use_fp8=bool(use_fp8), round_scale=bool(round_scale), use_ue8m0=bool(use_ue8m0),
                    async_finish=bool(async_finish), return_recv_hook=bool(return_recv_hook)))
            if self._host_values:
                checks.topk_values("topk_idx", topk_idx, num_experts)
            return plan.run(x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out=None, combine_wait_recv_cost_stats=None):
        """Low-latency combine: bring expert outputs back and reduce them **with** the top-k weights.

        Arguments:
            x: `[num_local_experts, num_ranks * T, hidden]` bf16 expert outputs in the dispatch layout.
            topk_idx: `[num_tokens, num_topk]` int64, the routing given to ``low_latency_dispatch``.
            topk_weights: `[num_tokens, num_topk]` float32.
            handle: from ``low_latency_dispatch``.
            use_logfmt: send a 10-bit logarithmic format per 128 channels (less traffic, ~1% error).
                Where ranks pre-sum (below), the encoded values are each rank's part of the sum,
                rounded to BF16, rather than each expert's row.
            zero_copy: ``x`` was already written into ``get_next_low_latency_combine_buffer(handle)``.
            async_finish, return_recv_hook: as for ``low_latency_dispatch``. Where a token picks several
                experts per rank (every rank on NVLink; e.g. top-8 of 288 on 2 ranks, and with LogFMT
                also on 4 and 8) each rank first sums its own experts' rows per token in float32 and
                sends one row per (token, rank); that send needs the weights, so it waits until every
                peer's combine has started (every rank calls the combine, as with any collective).
            out: optional `[num_tokens, hidden]` bf16 output written in place and returned.
            combine_wait_recv_cost_stats: like ``dispatch_wait_recv_cost_stats``.

        Returns:
            combined_x: `[num_tokens, hidden]` bf16, the weighted sum over each token's valid experts.
            event: an ``EventOverlap``.
            hook: receive function with ``return_recv_hook``, else None.
        """
        if _compiling():  # torch.compile
            from .custom_ops import low_latency as traced
            return traced.low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy,
                                              async_finish, return_recv_hook, out, combine_wait_recv_cost_stats)
        with self._frames.low_latency_combine:
            key = (meta(x), meta(topk_idx), meta(topk_weights), ll_handle_meta(handle), use_logfmt, zero_copy,
                   async_finish, return_recv_hook, meta(out), meta(combine_wait_recv_cost_stats))
            plan = lookup(self._ll_combine_plans, key)
            if plan is None:
                self._ll_required("low_latency_combine")
                checks.ll_combine_args(self.group_size, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, out,
                                       combine_wait_recv_cost_stats)
                plan = store(self._ll_combine_plans, key, self.runtime.plan_low_latency_combine(
                    x, topk_idx, handle, use_logfmt=bool(use_logfmt), zero_copy=bool(zero_copy),
                    combine_wait_recv_cost_stats=combine_wait_recv_cost_stats, async_finish=bool(async_finish),
                    return_recv_hook=bool(return_recv_hook)))
            if self._host_values:
                checks.topk_values("topk_idx", topk_idx, int(handle[4]), bound="handle[4] (num_experts)")
            if self.backend == "cuda":
                device_handle_values(self, handle)
            return plan.run(x, topk_idx, topk_weights, handle, out, combine_wait_recv_cost_stats)

    def get_next_low_latency_combine_buffer(self, handle):
        """The buffer the next ``low_latency_combine(..., zero_copy=True)`` sends from:
        `[num_local_experts, num_ranks * T, hidden]` bf16, for the caller to fill."""
        if _compiling():  # torch.compile
            from .custom_ops import low_latency as traced
            return traced.get_next_low_latency_combine_buffer(self, handle)
        self._alive()
        self._ll_required("get_next_low_latency_combine_buffer")
        checks.ll_handle_sizes(handle, self.group_size)
        return self.runtime.get_next_low_latency_combine_buffer(handle)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask a rank: masked ranks neither send nor receive in low-latency ops."""
        if _compiling():  # torch.compile: a graph break
            return outside(self.low_latency_update_mask_buffer, rank_to_mask, mask)
        self._alive()
        self._shrink_required("low_latency_update_mask_buffer")
        rank_to_mask = checks.nonneg_int("rank_to_mask", rank_to_mask)
        if rank_to_mask >= self.group_size:
            raise ValueError(f"rank_to_mask must be below {self.group_size}, got {rank_to_mask}")
        self.runtime.low_latency_update_mask_buffer(rank_to_mask, bool(mask))

    def low_latency_query_mask_buffer(self, mask_status) -> None:
        """Write 1 for masked ranks and 0 for the others into ``mask_status`` (`[num_ranks]` int32)."""
        if _compiling():  # torch.compile: a graph break
            return outside(self.low_latency_query_mask_buffer, mask_status)
        self._alive()
        self._shrink_required("low_latency_query_mask_buffer")
        checks.tensor("mask_status", mask_status, dtype=I32, shape=(self.group_size,))
        self.runtime.low_latency_query_mask_buffer(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank."""
        if _compiling():  # torch.compile: a graph break
            return outside(self.low_latency_clean_mask_buffer)
        self._alive()
        self._shrink_required("low_latency_clean_mask_buffer")
        self.runtime.low_latency_clean_mask_buffer()

    def _shrink_required(self, op: str) -> None:
        if not self.enable_shrink:
            raise RuntimeError(f"{op} needs a Buffer created with enable_shrink=True")

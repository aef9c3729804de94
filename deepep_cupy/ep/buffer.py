"""DeepEP V2's buffer API (``ElasticBuffer`` of 2.1, ``EPBuffer`` of 2.5) over V1's ``Buffer``.

One implementation, :class:`_EPBufferCore`; the two public classes differ only in their signatures. A dispatch
is V1's ``get_dispatch_layout`` and ``dispatch`` (``num_worst_tokens`` for the sync-free sizes, V1's cached
mode for a cached handle), reordered into V2's layouts: by two kernels on the GPU (``ops/recv_rows.py``), by
the caller's array operations on the reference backend (``recv_rows.py``). Within one NVLink domain a
combine is one V1 combine summing in V2's order in its kernel where each rank sends one sum per token; else (and
across domains) V1's combine carries each top-k slot's value (or each rank's sum) apart, summed here in V2's
order, per domain first in hybrid mode (``epilogue.py``).
"""

from __future__ import annotations

import dataclasses

from .. import checks
from ..buffer import Buffer
from ..device.group import group_size
from ..frameworks import BF16, I32, shape_of
from ..ops.recv_rows import RecvRowsPlan
from . import args as A_
from .arrays import ops_for
from .epilogue import domain_of_slots, final_sum, rank_sums, rank_values, slot_values, slot_weights
from .events import EventHandle, EventOverlap, as_v1_event
from .handle import EPHandle
from .recv_rows import RecvRows, align, col_major, dst_slots, expand_gather, expand_rows, recv_rows

__all__ = ["_EPBufferCore", "group_size"]

#: The most top-k slots one V1 combine carries (a wider combine takes several); the buffer is sized for it.
SLOTS_PER_COMBINE = 8


def _hint(config, row_bytes: int, num_ranks: int, num_nvl_ranks: int | None = None) -> int:
    """Bytes of V1's NVLink buffer for rows of ``row_bytes``; with ``num_nvl_ranks``, of its RDMA buffer across
    NVLink domains of that size."""
    if num_nvl_ranks is None:
        return config.get_nvl_buffer_size_hint(row_bytes, num_ranks)
    return config.get_rdma_buffer_size_hint(row_bytes, num_ranks, num_nvl_ranks)


def _v1_bytes(num_ranks: int, hidden: int, num_topk: int, num_nvl_ranks: int | None = None) -> int:
    """NVLink bytes (with ``num_nvl_ranks``: RDMA bytes across NVLink domains) V1's buffer needs for V2's
    dispatch (rows of ``hidden`` BF16) and combine (rows of up to ``SLOTS_PER_COMBINE`` slots), in 2 MiB steps."""
    slots = min(num_topk or A_.MAX_TOPK, SLOTS_PER_COMBINE)
    need = max(_hint(Buffer.get_dispatch_config(num_ranks), hidden * 2, num_ranks, num_nvl_ranks),
               _hint(Buffer.get_combine_config(num_ranks), slots * hidden * 2, num_ranks, num_nvl_ranks))
    return align(need, A_.ALIGNMENT)


class _EPBufferCore:
    """The state and operations both V2 classes share; see ``ElasticBuffer`` / ``EPBuffer``."""

    _guard_topk_idx = False  # 2.5: the handle keeps the caller's topk_idx and checks it was not modified

    def _setup(self, group, comm, num_bytes, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
               deterministic, allow_hybrid_mode, allow_multiple_reduction, prefer_overlap_with_compute, sl_idx,
               num_allocated_qps, num_cpu_timeout_secs, num_gpu_timeout_secs, explicitly_destroy, backend,
               num_nvl_ranks) -> None:
        self.num_max_tokens_per_rank = checks.nonneg_int("num_max_tokens_per_rank", num_max_tokens_per_rank)
        self.hidden = checks.nonneg_int("hidden", hidden)
        self.num_topk = checks.nonneg_int("num_topk", num_topk)
        if self.num_topk > A_.MAX_TOPK:
            raise ValueError(f"num_topk must be at most {A_.MAX_TOPK}, got {num_topk}")
        self.use_fp8_dispatch = A_.flag("use_fp8_dispatch", use_fp8_dispatch)
        self.deterministic = A_.flag("deterministic", deterministic)
        self.allow_hybrid_mode = A_.flag("allow_hybrid_mode", allow_hybrid_mode)
        self.allow_multiple_reduction = A_.flag("allow_multiple_reduction", allow_multiple_reduction)
        self.prefer_overlap_with_compute = A_.flag("prefer_overlap_with_compute", prefer_overlap_with_compute)
        self.sl_idx = None if sl_idx is None else checks.nonneg_int("sl_idx", sl_idx)
        self.num_cpu_timeout_secs = checks.positive_int("num_cpu_timeout_secs", num_cpu_timeout_secs)
        self.num_gpu_timeout_secs = checks.positive_int("num_gpu_timeout_secs", num_gpu_timeout_secs)
        self.explicitly_destroy = A_.flag("explicitly_destroy", explicitly_destroy)
        qps = checks.nonneg_int("num_allocated_qps", num_allocated_qps)
        self.num_allocated_qps = qps or (129 if self.allow_hybrid_mode else 17)
        ranks = group_size(group if group is not None else comm)
        if num_bytes is None:
            if self.hidden == 0 or self.num_max_tokens_per_rank == 0:
                raise ValueError("num_bytes is None: give hidden and num_max_tokens_per_rank to size the buffer")
            num_bytes = _v1_bytes(ranks, self.hidden, self.num_topk)
        elif checks.positive_int("num_bytes", num_bytes) % A_.ALIGNMENT:
            raise ValueError(f"num_bytes must be a multiple of 2 MiB ({A_.ALIGNMENT}), got {num_bytes}")
        self.num_bytes = int(num_bytes)
        self._v1 = Buffer(group, num_nvl_bytes=self.num_bytes, num_rdma_bytes=0,
                          explicitly_destroy=self.explicitly_destroy, comm=comm, backend=backend,
                          num_nvl_ranks=num_nvl_ranks)
        self.group = self._v1.group
        self.rank_idx, self.num_ranks = self._v1.rank, self._v1.group_size
        self.num_nvlink_ranks = self._v1.num_nvl_ranks
        self.num_rdma_ranks = self.num_ranks // self.num_nvlink_ranks
        if self.num_rdma_ranks > 1:  # V1's internode path: the same Buffer with its RDMA half too
            self._v1.destroy()
            rdma = (_v1_bytes(self.num_ranks, self.hidden, self.num_topk, self.num_nvlink_ranks)
                    if self.hidden else self.num_bytes)
            self._v1 = Buffer(group, num_nvl_bytes=self.num_bytes, num_rdma_bytes=rdma,
                              explicitly_destroy=self.explicitly_destroy, comm=comm, backend=backend,
                              num_nvl_ranks=self.num_nvlink_ranks)
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.runtime = self._v1
        self._slots: dict = {}  # top-k slots per V1 combine, per hidden size
        self._recv_rows_plans: dict = {}  # (framework, local experts) -> RecvRowsPlan, on the GPU
        self._v1._group.barrier()

    # ------------------------------------------------------------------ sizes and domains
    def get_physical_domain_size(self) -> tuple:
        """``(num_rdma_ranks, num_nvlink_ranks)``: NVLink domains, and ranks per domain."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> tuple:
        """``(num_scaleout_ranks, num_scaleup_ranks)``: the physical sizes in hybrid mode, else ``(1, num_ranks)``."""
        return (self.num_rdma_ranks, self.num_nvlink_ranks) if self.allow_hybrid_mode else (1, self.num_ranks)

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 0,
                                sm_write_gbs: float = 0) -> int:
        """The SMs a dispatch or combine uses: those of V1's kernels (``Buffer.num_sms``), which do the work.

        The bandwidth arguments are accepted for V2's signature; a model of our own kernels comes with them.
        """
        checks.num_experts_ok(num_experts, self.num_ranks)
        checks.positive_int("num_topk", num_topk)
        if num_scaleout_topk != 0:
            raise ValueError(f"num_scaleout_topk must be 0, got {num_scaleout_topk!r}")
        for name, value in (("rdma_gbs", rdma_gbs), ("nvlink_gbs", nvlink_gbs), ("sm_read_gbs", sm_read_gbs),
                            ("sm_write_gbs", sm_write_gbs)):
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")
        return int(Buffer.num_sms)

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """Queue pairs for ``num_sms`` SMs, as V2 counts them, capped by ``num_allocated_qps``."""
        num_sms = checks.nonneg_int("num_sms", num_sms)
        qps = num_sms * 16 + 1 if self.allow_hybrid_mode else min(num_sms, 9)
        return min(qps, self.num_allocated_qps)

    # ------------------------------------------------------------------ streams, events, lifetime
    @staticmethod
    def capture() -> EventHandle:
        """An event recorded on the current stream (complete at once without a GPU)."""
        return EventHandle()

    def get_comm_stream(self):
        """V1's communication stream (None on the reference backend)."""
        return self._v1.get_comm_stream()

    def _barrier(self, with_cpu_sync: bool) -> None:
        self._alive()
        if self._v1.backend == "cuda":
            import cupy

            cupy.cuda.runtime.deviceSynchronize()  # the work issued so far is part of what the barrier orders
        self._v1._group.barrier()
        if with_cpu_sync and self._v1.backend == "cuda":
            import cupy

            cupy.cuda.runtime.deviceSynchronize()

    def destroy(self) -> None:
        """Release the buffer (collective); needs ``explicitly_destroy=True``."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() needs a buffer made with explicitly_destroy=True")
        if self.runtime is not None:
            self._v1.destroy()
            self.runtime = None

    def _alive(self) -> None:
        if self.runtime is None:
            raise RuntimeError("this buffer was destroyed")

    def _slots_per_combine(self, hidden: int, num_topk: int) -> int:
        key = (hidden, num_topk)
        width = self._slots.get(key)
        if width is None:
            config = Buffer.get_combine_config(self.num_ranks)
            width = 1
            across = self.num_nvlink_ranks if self.num_rdma_ranks > 1 else None
            for w in range(num_topk, 0, -1):
                row = w * hidden * 2
                if _hint(config, row, self.num_ranks) <= self.num_bytes and (
                        across is None or _hint(config, row, self.num_ranks, across) <= self._v1.num_rdma_bytes):
                    width = w
                    break
            self._slots[key] = width
        return width

    # ------------------------------------------------------------------ dispatch
    def _dispatch(self, x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts,
                  num_max_tokens_per_rank, expert_alignment, num_sms, num_qps, previous_event,
                  async_with_compute_stream, allocate_on_comm_stream, handle, do_handle_copy, do_cpu_sync,
                  do_expand, do_zero_padding, use_tma_aligned_col_major_sf, defer_epilogue):
        self._alive()
        stats = cumulative_local_expert_recv_stats
        data, scales, num_experts, m, alignment, sync = A_.dispatch_args(
            self, x=x, topk_idx=topk_idx, topk_weights=topk_weights, stats=stats, num_experts=num_experts,
            num_max_tokens=num_max_tokens_per_rank, expert_alignment=expert_alignment, num_sms=num_sms,
            num_qps=num_qps, previous_event=previous_event, allocate_on_comm_stream=allocate_on_comm_stream,
            handle=handle, do_cpu_sync=do_cpu_sync, do_expand=do_expand, do_zero_padding=do_zero_padding,
            defer_epilogue=defer_epilogue, async_with_compute_stream=async_with_compute_stream)
        prev = as_v1_event(previous_event)
        v1, ops = self._v1, ops_for(data)
        config = self._v1_config(num_sms, shape_of(data)[1])  # a cached V1 call keeps its handle's channels
        if handle is None:
            recv = self._v1_dispatch(x, topk_idx, topk_weights, num_experts, alignment, 0 if sync else m * self.num_ranks,
                                     prev, config)
        elif topk_weights is None:
            recv = v1.dispatch(x, handle=handle._v1_handle, previous_event=prev)
        else:  # V1's cached mode carries no weights: the same routing again, sized as the handle's rows
            recv = self._v1_dispatch(x, handle.topk_idx, topk_weights, num_experts, alignment,
                                     handle.num_recv_tokens, prev, config)
        recv_x, recv_topk_idx, recv_weights, aligned_list, v1_handle = recv[:5]
        src_idx = recv[6] if len(recv) > 6 else None  # across domains: the received rows' source tokens
        recv_data, recv_scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        e_local = num_experts // self.num_ranks

        def epilogue():
            nonlocal handle
            if handle is None:
                handle = self._new_handle(ops, topk_idx, recv_topk_idx, v1_handle, aligned_list, num_experts, m,
                                          alignment, num_sms, do_expand, do_handle_copy, sync, e_local, src_idx)
                if stats is not None:
                    stats[...] = stats + handle.num_unaligned_recv_tokens_per_expert
            out_topk_idx, out_weights = None, recv_weights
            if handle.do_expand:
                n = handle.num_expanded_tokens
                rows, slots, padding = expand_gather(ops, handle._recv_rows, n)
                out_data = expand_rows(ops, recv_data, rows, padding, do_zero_padding)
                out_scales = None if recv_scales is None else expand_rows(ops, recv_scales, rows, padding,
                                                                          do_zero_padding)
                if recv_weights is not None:
                    out_weights = expand_rows(ops, recv_weights.reshape(-1), slots, padding, do_zero_padding)
            else:
                n, out_data, out_scales = handle.num_recv_tokens, recv_data, recv_scales
                out_topk_idx = handle._recv_topk_idx if recv_topk_idx is None else recv_topk_idx
                if recv_topk_idx is None:
                    out_topk_idx = ops.copy(out_topk_idx)
            if out_scales is not None and use_tma_aligned_col_major_sf:
                out_scales = col_major(ops, out_scales, n)
            out_x = out_data if out_scales is None else (out_data, out_scales)
            return out_x, out_topk_idx, out_weights, handle

        if defer_epilogue:
            event = EventOverlap(EventHandle())
            event.register_hook_after_wait(epilogue)
            return event
        return (*epilogue(), EventOverlap(EventHandle() if async_with_compute_stream else None))

    def _v1_config(self, num_sms: int, hidden: int, combine: bool = False):
        """V1's config for a V2 call's ``num_sms``: None (V1's own choice) for 0, else the tuned or built-in
        config with that many SMs, rounded down to the even count V1's channels take (a sender and a receiver
        SM each). A combine follows its dispatch's channels whatever its own count."""
        if not num_sms:
            return None
        pick = Buffer.get_combine_config if combine else Buffer.get_dispatch_config
        return dataclasses.replace(pick(self.num_ranks, hidden), num_sms=max(2, num_sms - num_sms % 2))

    def _v1_dispatch(self, x, topk_idx, topk_weights, num_experts, alignment, num_worst_tokens, prev, config):
        """V1's layout and dispatch; across NVLink domains also the received rows' source token indices, as a
        7th entry (see :meth:`_source_tokens`)."""
        per_rank, per_rdma, per_expert, in_rank, _ = self._v1.get_dispatch_layout(topk_idx, num_experts,
                                                                                  previous_event=prev)
        weights = topk_weights
        if weights is None:  # V1 takes the top-k ids only with weights: zeros, and no weights returned
            weights = ops_for(topk_idx).zeros(tuple(shape_of(topk_idx)), "float32", topk_idx)
        recv = self._v1.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                                 is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                 topk_weights=weights, expert_alignment=alignment,
                                 num_worst_tokens=num_worst_tokens, config=config)
        recv = recv if topk_weights is not None else (recv[0], recv[1], None, *recv[3:])
        return recv if self.num_rdma_ranks == 1 else (*recv, self._source_tokens(topk_idx, recv[4]))

    def _source_tokens(self, topk_idx, v1_handle):
        """`[rows]` int32: each received row's token index at its source. V1's internode handle does not hold
        it, so each token's index travels once more, as the bytes of a 16-byte row, in a cached dispatch with
        the handle (rows past the received ones: whatever they hold, no metadata reads them)."""
        ops = ops_for(topk_idx)
        t = shape_of(topk_idx)[0]
        rows = ops.zeros((t, 4), "int32", topk_idx)
        rows[:, 0] = ops.astype(ops.arange(t, topk_idx), "int32")
        recv = self._v1.dispatch(ops.bits_as(rows, BF16), handle=v1_handle)[0]
        return ops.contiguous(ops.bits_as(recv, I32)[:, 0])

    def _new_handle(self, ops, topk_idx, recv_topk_idx, v1_handle, aligned_list, num_experts, m, alignment,
                    num_sms, do_expand, do_handle_copy, sync, e_local, src_idx=None) -> EPHandle:
        rows = shape_of(recv_topk_idx)[0]
        k = shape_of(topk_idx)[1]
        if sync:
            expanded = sum(aligned_list)
        else:
            expanded = align(self.num_ranks * m * min(k, e_local) + (alignment - 1) * e_local, alignment)
        across = src_idx is not None  # V1's internode handle: per-rank prefix [6], routing [0]
        prefix, sources_idx, in_rank = ((v1_handle[6], src_idx, v1_handle[0]) if across else
                                        (v1_handle[0], v1_handle[3], v1_handle[4]))
        if self._v1.backend == "cuda":  # two kernels (ops/recv_rows.py) in place of the array operations
            plan = self._recv_rows_plans.get((ops.framework, e_local))
            if plan is None:
                plan = self._recv_rows_plans[(ops.framework, e_local)] = RecvRowsPlan(
                    self._v1.runtime.frame(recv_topk_idx), num_local_experts=e_local, num_ranks=self.num_ranks,
                    rank=self.rank_idx, per_rank=across)
            out_rows, sources, counts, psum_expert, metadata, psum, dst = plan.run(
                recv_topk_idx, sources_idx, prefix, ops.contiguous(topk_idx), in_rank, num_max_tokens=m,
                expert_alignment=alignment, expand=do_expand, num_expanded_rows=expanded)
            placed = RecvRows(rows=out_rows, counts=counts, psum_expert=psum_expert, metadata=metadata,
                              sources=sources)
        else:
            psum = ops.contiguous(prefix if across else prefix[:, self.rank_idx])
            placed = recv_rows(ops, recv_topk_idx, psum, sources_idx, num_local_experts=e_local, num_max_tokens=m,
                               expert_alignment=alignment, expand=do_expand)
            dst = dst_slots(ops, topk_idx, in_rank, num_local_experts=e_local, num_max_tokens=m)
        if self.num_scaleup_ranks < self.num_ranks:  # hybrid: rows per source scale-up index, over domains
            per_source = psum - ops.concat([ops.zeros((1,), None, psum), psum[:-1]], axis=0)
            psum = ops.astype(ops.cumsum(ops.sum(per_source.reshape(self.num_scaleout_ranks,
                                                                    self.num_scaleup_ranks), axis=0), axis=0), I32)
        return EPHandle(
            do_expand=do_expand, num_experts=num_experts, expert_alignment=alignment, num_max_tokens_per_rank=m,
            num_sms=num_sms or self.get_theoretical_num_sms(num_experts, k),
            topk_idx=ops.copy(topk_idx) if do_handle_copy else topk_idx, num_recv_tokens=rows,
            num_expanded_tokens=expanded, num_recv_tokens_per_expert_list=aligned_list if sync else [],
            psum_num_recv_tokens_per_scaleup_rank=psum, psum_num_recv_tokens_per_expert=placed.psum_expert,
            num_unaligned_recv_tokens_per_expert=placed.counts, recv_src_metadata=placed.metadata,
            dst_buffer_slot_idx=dst,
            guard_topk_idx=self._guard_topk_idx and not do_handle_copy, v1_handle=v1_handle, recv_rows=placed,
            recv_topk_idx=recv_topk_idx)

    # ------------------------------------------------------------------ combine
    def _combine_per_rank(self, ops, x, handle, topk_weights, bias_0, bias_1, num_sms, previous_event,
                          async_with_compute_stream, defer_epilogue):
        """A combine where each rank sends one sum per token (a non-expanded ``x``, or
        ``allow_multiple_reduction``): one V1 combine that sums each token's rows in V2's order (its ranks by
        their last top-k slot, after the bias), with the weights each slot's owner holds."""
        values = rank_sums(ops, x, handle)
        weights = None if topk_weights is None else slot_weights(ops, topk_weights, handle)
        prev = as_v1_event(previous_event)
        if prev is not None:  # the inputs above are made on the current stream: V1 waits for it, after the event
            prev.current_stream_wait()
        bias = bias_0 if bias_1 is None else (bias_1 if bias_0 is None else (bias_0, bias_1))
        v1, config = self._v1, self._v1_config(num_sms, shape_of(x)[1], combine=True)

        def run():
            with v1._frames.combine:
                return v1._combine(values, handle._v1_handle, weights, bias, config, None, False, False,
                                   order_topk_idx=handle.topk_idx,
                                   num_local_experts=handle.num_experts // self.num_ranks)[:2]

        if defer_epilogue:
            # The bias is the epilogue's: read when the caller waits. The kernel adds it before the ranks'
            # rows (V2's order), so with a bias the whole combine runs at the wait.
            results = None if bias is not None else run()
            event = EventOverlap(EventHandle())
            event.register_hook_after_wait(run if results is None else lambda: results)
            return event
        return (*run(), EventOverlap(EventHandle() if async_with_compute_stream else None))

    def _combine(self, x, handle, topk_weights, bias, num_sms, num_qps, previous_event, async_with_compute_stream,
                 allocate_on_comm_stream, defer_epilogue):
        self._alive()
        bias_0, bias_1 = A_.split_bias(bias)
        A_.combine_args(self, x=x, handle=handle, topk_weights=topk_weights, bias_0=bias_0, bias_1=bias_1,
                        num_sms=num_sms, num_qps=num_qps, previous_event=previous_event,
                        allocate_on_comm_stream=allocate_on_comm_stream, defer_epilogue=defer_epilogue,
                        async_with_compute_stream=async_with_compute_stream)
        ops = ops_for(x)
        k, hidden, n = handle.num_topk, shape_of(x)[1], handle.num_recv_tokens
        per_rank = self.allow_multiple_reduction or not handle.do_expand
        slot_domains = None
        if per_rank and self.num_rdma_ranks == 1:
            return self._combine_per_rank(ops, x, handle, topk_weights, bias_0, bias_1, num_sms, previous_event,
                                          async_with_compute_stream, defer_epilogue)
        if per_rank:
            # Across NVLink domains V1's kernels sum in their own order: each rank's sum travels apart, at
            # its last top-k slot, and the source adds them in V2's order (per domain first in hybrid mode).
            wide = rank_values(ops, x, handle)
            if self.allow_multiple_reduction and self.num_scaleup_ranks < self.num_ranks:
                slot_domains = domain_of_slots(ops, handle.topk_idx, handle.num_experts // self.num_scaleout_ranks)
        else:
            # Expanded without multiple reduction: every selection is summed at its source on its own, in
            # slot order, so each slot's value travels in a column block of its own (epilogue.py).
            wide = slot_values(ops, x, handle)
        weights = None if topk_weights is None else slot_weights(ops, topk_weights, handle)
        width = self._slots_per_combine(hidden, k)
        prev = as_v1_event(previous_event)
        if prev is not None:
            # The blocks above were built on the current stream, which V1's combine would not wait for
            # behind an event of its own: the current stream waits for the event, and V1 for it.
            prev.current_stream_wait()
            prev = None
        config = self._v1_config(num_sms, hidden, combine=True)
        chunks, combined_weights = [], None
        for first in range(0, k, width):
            w = min(width, k - first)
            part = ops.contiguous(wide[:, first:first + w]).reshape(n, w * hidden)
            out, out_weights, _ = self._v1.combine(part, handle._v1_handle,
                                                   topk_weights=weights if first == 0 else None, config=config)
            chunks.append(out.reshape(handle.num_tokens, w, hidden))
            if first == 0:
                combined_weights = out_weights

        def epilogue():
            return (final_sum(ops, chunks, bias_0, bias_1, handle.num_tokens, hidden, x, slot_domains),
                    combined_weights)

        if defer_epilogue:
            event = EventOverlap(EventHandle())
            event.register_hook_after_wait(epilogue)
            return event
        return (*epilogue(), EventOverlap(EventHandle() if async_with_compute_stream else None))

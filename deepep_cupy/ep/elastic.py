"""The public V2 classes: ``ElasticBuffer`` (DeepEP 2.1's signatures) and ``EPBuffer`` (2.5's), one
implementation (``buffer.py``).

What V2 offers beside expert parallelism (2.1's Engram, pipeline and all-gather methods, 2.5's separate
buffers and redundant-expert load balancing) raises NotImplementedError naming it.
"""

from __future__ import annotations

from .. import checks
from ..device.group import group_size
from .args import flag
from .buffer import _EPBufferCore, _v1_bytes

__all__ = ["ElasticBuffer", "EPBuffer"]

_DISPATCH_DOC = """Send each token to the ranks holding its experts.

        Arguments:
            x: `[T, H]` bf16, or FP8 ``(x_e4m3 [T, H], scales [T, H // 128] float32 or [T, ceil(H / 512)]
                int32 packed UE8M0)``.
            topk_idx: `[T, K]` int64 (``topk_idx_t``) expert ids, -1 for none; None with ``handle``.
            topk_weights: optional `[T, K]` float32 (also with a cached handle).
            cumulative_local_expert_recv_stats: optional `[L]` int32; the received count per local expert is
                added to it.
            num_experts: total experts (from the handle when cached).
            num_max_tokens_per_rank: ``M``, the same on every rank (default: the constructor's).
            expert_alignment: each local expert's received count is rounded up to a multiple of it (default 1).
            num_sms: SMs of the kernels (0: ``get_theoretical_num_sms``), rounded down to an even count
                (V1's channels, a sender and a receiver SM each); kept in the handle.
            num_qps: 0 for ``get_theoretical_num_qps``; checked and kept in the handle (queue pairs are
                NVSHMEM's choice here).
            previous_event: an ``EventHandle`` the work waits for (needs ``allocate_on_comm_stream=True``).
            async_with_compute_stream: return an event to wait on.
            allocate_on_comm_stream: accepted; outputs come from the current stream's allocator.
            handle: an ``EPHandle`` from an earlier dispatch: repeat its routing, no CPU sync.
            do_cpu_sync: None means True without ``handle``; False sizes outputs at their bounds (``M * R``
                rows, expanded ``align(R * M * min(K, L) + (A - 1) * L, A)``) with the valid extent in the handle.
            do_expand: one row per (token, local expert), experts in order, segments aligned to ``expert_alignment``.
            do_zero_padding: zero the expanded layout's alignment rows (needs ``do_expand``).
            use_tma_aligned_col_major_sf: FP8 scales column-major with strides ``(1, align(rows, 4))``.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``: ``recv_topk_idx`` `[N, K]` local
            expert ids (-1 elsewhere), None when expanded; ``recv_topk_weights`` `[N, K]` (expanded: `[N]`, the
            row's own weight) or None; ``handle`` an ``EPHandle`` (the one given when cached)."""

_COMBINE_DOC = """Send expert outputs back to their tokens' ranks and sum them (weights are not applied).

        Arguments:
            x: bf16, one row per received row of ``handle``'s layout. Non-expanded: each row holds the sum over
                the token's local experts; expanded: each row one (token, expert) output.
            handle: the ``EPHandle`` of the dispatch.
            topk_weights: optional float32, `[N, K]` (expanded: `[N]`, needs ``allow_multiple_reduction``):
                returned to each token's slot from the rank owning the slot's expert.
            bias: None, a `[T, H]` bf16 tensor or a tuple of two, added first.
            num_sms, num_qps, previous_event, async_with_compute_stream, allocate_on_comm_stream: as in dispatch.

        Returns:
            ``(combined_x [T, H] bf16, combined_topk_weights [T, K] float32 or None, event)``. The sum is V2's:
            float32, per-rank (and, expanded without ``allow_multiple_reduction``, per-expert) terms in
            ascending top-k slot order after the bias, rounded to bf16 once."""


def _unsupported(name: str, what: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}.{name}: {what} is not offered by deepep_cupy")

    method.__name__ = name
    method.__doc__ = f"Not offered: raises NotImplementedError ({what})."
    return method


def buffer_size_hint(group, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                     use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                     allow_multiple_reduction: bool = True) -> int:
    """Bytes for ``num_bytes`` (a multiple of 2 MiB) for tokens of ``hidden`` and ``num_topk`` (0: 32): V2's
    ``get_buffer_size_hint``, the same in 2.1 and 2.5."""
    checks.positive_int("num_max_tokens_per_rank", num_max_tokens_per_rank)
    checks.positive_int("hidden", hidden)
    checks.nonneg_int("num_topk", num_topk)
    for name, value in (("use_fp8_dispatch", use_fp8_dispatch), ("allow_hybrid_mode", allow_hybrid_mode),
                        ("allow_multiple_reduction", allow_multiple_reduction)):
        flag(name, value)
    return _v1_bytes(group_size(group), hidden, num_topk)


class ElasticBuffer(_EPBufferCore):
    """DeepEP 2.1's ``ElasticBuffer`` for expert parallelism, over V1's kernels (intranode within one NVLink
    domain, internode across several).

    Arguments as V2's (``comm=``: an mpi4py communicator instead of ``group``; ``backend``, ``num_nvl_ranks``
    as for ``Buffer``). ``num_bytes`` defaults to ``get_buffer_size_hint``; ``num_cpu_bytes`` must be 0 (no
    Engram storage). ``deterministic`` holds always (rows come in source rank, then token order).
    """

    def __init__(self, group=None, num_bytes=None, num_cpu_bytes: int = 0, num_max_tokens_per_rank: int = 0,
                 hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False, deterministic: bool = False,
                 allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int = 3, num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False,
                 *, comm=None, backend: str | None = None, num_nvl_ranks: int | None = None) -> None:
        if checks.nonneg_int("num_cpu_bytes", num_cpu_bytes) != 0:
            raise ValueError("num_cpu_bytes must be 0: Engram storage is not offered by deepep_cupy")
        self._setup(group, comm, num_bytes, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                    deterministic, allow_hybrid_mode, allow_multiple_reduction, prefer_overlap_with_compute, sl_idx,
                    num_allocated_qps, num_cpu_timeout_secs, num_gpu_timeout_secs, explicitly_destroy, backend,
                    num_nvl_ranks)

    get_buffer_size_hint = staticmethod(buffer_size_hint)

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Wait until every rank got here, with the work issued before (collective)."""
        self._barrier(flag("with_cpu_sync", with_cpu_sync))

    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None,
                 num_experts=None, num_max_tokens_per_rank=None, expert_alignment=None, num_sms: int = 0,
                 num_qps: int = 0, previous_event=None, previous_event_before_epilogue=None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False, handle=None,
                 do_handle_copy: bool = True, do_cpu_sync=None, do_expand: bool = False,
                 do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False):
        if previous_event_before_epilogue is not None and previous_event is None:
            raise ValueError("previous_event_before_epilogue needs previous_event")
        return self._dispatch(x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts,
                              num_max_tokens_per_rank, expert_alignment, num_sms, num_qps, previous_event,
                              flag("async_with_compute_stream", async_with_compute_stream),
                              flag("allocate_on_comm_stream", allocate_on_comm_stream), handle,
                              flag("do_handle_copy", do_handle_copy), do_cpu_sync, flag("do_expand", do_expand),
                              flag("do_zero_padding", do_zero_padding),
                              flag("use_tma_aligned_col_major_sf", use_tma_aligned_col_major_sf), False)

    def combine(self, x, handle, topk_weights=None, bias=None, num_sms: int = 0, num_qps: int = 0,
                previous_event=None, previous_event_before_epilogue=None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False):
        if previous_event_before_epilogue is not None and previous_event is None:
            raise ValueError("previous_event_before_epilogue needs previous_event")
        return self._combine(x, handle, topk_weights, bias, num_sms, num_qps, previous_event,
                             flag("async_with_compute_stream", async_with_compute_stream),
                             flag("allocate_on_comm_stream", allocate_on_comm_stream), False)

    dispatch.__doc__ = _DISPATCH_DOC
    combine.__doc__ = _COMBINE_DOC

    for _name, _what in (("get_engram_storage_size_hint", "Engram storage"), ("engram_write", "Engram storage"),
                         ("engram_fetch", "Engram storage"), ("get_pp_buffer_size_hint", "pipeline send/receive"),
                         ("pp_set_config", "pipeline send/receive"), ("pp_send", "pipeline send/receive"),
                         ("pp_recv", "pipeline send/receive"), ("get_agrs_num_max_session_bytes", "all-gather"),
                         ("get_agrs_buffer_size_hint", "all-gather"), ("create_agrs_session", "all-gather"),
                         ("destroy_agrs_session", "all-gather"), ("agrs_new_session", "all-gather"),
                         ("agrs_set_config", "all-gather"), ("agrs_get_inplace_tensor", "all-gather"),
                         ("all_gather", "all-gather")):
        locals()[_name] = _unsupported(_name, _what)
    del _name, _what


class EPBuffer(_EPBufferCore):
    """DeepEP 2.5's ``EPBuffer``: ``ElasticBuffer`` with 2.5's signatures, ``defer_epilogue``, and handles that
    keep the caller's ``topk_idx`` (reading ``handle.topk_idx`` checks a torch tensor was not modified since).

    ``lb_allocation_plan_or_num_bytes`` must be 0 (no redundant-expert load balancing).
    """

    _guard_topk_idx = True

    def __init__(self, group=None, num_bytes=None, num_max_tokens_per_rank: int = 0, hidden: int = 0,
                 num_topk: int = 0, use_fp8_dispatch: bool = False, lb_allocation_plan_or_num_bytes=0,
                 deterministic: bool = False, allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx=None, num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False,
                 *, comm=None, backend: str | None = None, num_nvl_ranks: int | None = None) -> None:
        if not (isinstance(lb_allocation_plan_or_num_bytes, int) and lb_allocation_plan_or_num_bytes == 0):
            raise ValueError("lb_allocation_plan_or_num_bytes must be 0: redundant-expert load balancing is not "
                             "offered by deepep_cupy")
        self._setup(group, comm, num_bytes, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                    deterministic, allow_hybrid_mode, allow_multiple_reduction, prefer_overlap_with_compute, sl_idx,
                    num_allocated_qps, num_cpu_timeout_secs, num_gpu_timeout_secs, explicitly_destroy, backend,
                    num_nvl_ranks)
        self.num_lb_bytes = 0
        self.context = None

    get_buffer_size_hint = staticmethod(buffer_size_hint)

    def barrier(self, wait_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True,
                context_idx=None) -> None:
        """Wait until every rank got here, with the work issued before (collective)."""
        self._barrier(flag("with_cpu_sync", with_cpu_sync))

    def print_memory_usage(self) -> None:
        print(f"EPBuffer: {self.num_bytes} bytes of V1 NVLink buffer per rank")

    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None,
                 num_experts=None, num_max_tokens_per_rank=None, expert_alignment=None, num_sms: int = 0,
                 num_qps: int = 0, previous_event=None, async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False, handle=None, do_handle_copy: bool = False,
                 do_cpu_sync=None, do_expand: bool = False, do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False, defer_epilogue: bool = False):
        if flag("do_handle_copy", do_handle_copy):
            raise ValueError("do_handle_copy must be False on EPBuffer (the handle keeps the caller's topk_idx)")
        return self._dispatch(x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts,
                              num_max_tokens_per_rank, expert_alignment, num_sms, num_qps, previous_event,
                              flag("async_with_compute_stream", async_with_compute_stream),
                              flag("allocate_on_comm_stream", allocate_on_comm_stream), handle, False, do_cpu_sync,
                              flag("do_expand", do_expand), flag("do_zero_padding", do_zero_padding),
                              flag("use_tma_aligned_col_major_sf", use_tma_aligned_col_major_sf),
                              flag("defer_epilogue", defer_epilogue))

    def combine(self, x, handle, topk_weights=None, bias=None, num_sms: int = 0, num_qps: int = 0,
                previous_event=None, async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                defer_epilogue: bool = False):
        return self._combine(x, handle, topk_weights, bias, num_sms, num_qps, previous_event,
                             flag("async_with_compute_stream", async_with_compute_stream),
                             flag("allocate_on_comm_stream", allocate_on_comm_stream),
                             flag("defer_epilogue", defer_epilogue))

    dispatch.__doc__ = _DISPATCH_DOC + """
            With ``defer_epilogue`` (needs ``async_with_compute_stream``): an ``EventOverlap`` whose first wait
            returns ``(recv_x, recv_topk_idx, recv_topk_weights, handle)``."""
    combine.__doc__ = _COMBINE_DOC + """
            With ``defer_epilogue``: an ``EventOverlap`` whose first wait returns ``(combined_x,
            combined_topk_weights)``; the bias is read then."""

    for _name in ("lb_get_theoretical_num_sms", "lb_prefetch_weights", "lb_reduce_grads"):
        locals()[_name] = _unsupported(_name, "redundant-expert load balancing")
    del _name

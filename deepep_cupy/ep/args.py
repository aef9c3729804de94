"""Argument checks of the V2 API: a bad argument raises TypeError or ValueError naming it, before any work."""

from __future__ import annotations

from .. import checks
from ..frameworks import BF16, F32, I32, I64, shape_of
from .handle import EPHandle

__all__ = ["flag", "optional_nonneg", "split_bias", "dispatch_args", "combine_args", "MAX_TOPK", "ALIGNMENT"]

#: V2's buffer sizes are multiples of 2 MiB.
ALIGNMENT = 2 * 1024 * 1024
MAX_TOPK = 32


def flag(name: str, value) -> bool:
    if not isinstance(value, (bool, int)) or value not in (0, 1):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def optional_nonneg(name: str, value, default: int) -> int:
    return default if value is None else checks.nonneg_int(name, value)


def split_bias(bias):
    """``bias``: None, one tensor, or a tuple of two; returns ``(bias_0, bias_1)``."""
    if bias is None:
        return None, None
    if isinstance(bias, (tuple, list)):
        if len(bias) != 2:
            raise ValueError(f"bias must be one tensor or a tuple of two, got a tuple of {len(bias)}")
        return bias[0], bias[1]
    return bias, None


def dispatch_args(buffer, *, x, topk_idx, topk_weights, stats, num_experts, num_max_tokens, expert_alignment,
                  num_sms, num_qps, previous_event, allocate_on_comm_stream, handle, do_cpu_sync, do_expand,
                  do_zero_padding, defer_epilogue, async_with_compute_stream):
    """Check a dispatch call; returns ``(data, scales, num_experts, M, alignment, do_cpu_sync)``."""
    data, scales, num_tokens, _hidden = checks.split_x(x)
    checks.tensor("x[0]" if scales is not None else "x", data, ndim=2)
    checks.nonneg_int("num_sms", num_sms)
    checks.nonneg_int("num_qps", num_qps)
    if num_qps > buffer.num_allocated_qps:
        raise ValueError(f"num_qps ({num_qps}) must not exceed num_allocated_qps ({buffer.num_allocated_qps})")
    if previous_event is not None and not allocate_on_comm_stream:
        raise ValueError("previous_event needs allocate_on_comm_stream=True")
    if defer_epilogue and not async_with_compute_stream:
        raise ValueError("defer_epilogue needs async_with_compute_stream=True")
    if do_zero_padding and not do_expand:
        raise ValueError("do_zero_padding needs do_expand=True")
    if handle is not None:
        if not isinstance(handle, EPHandle):
            raise TypeError(f"handle must be an EPHandle from an earlier dispatch, got {type(handle).__name__}")
        if topk_idx is not None:
            raise ValueError("topk_idx must be None when a cached handle is given (the handle holds the routing)")
        if do_cpu_sync:
            raise ValueError("do_cpu_sync must not be True with a cached handle (a cached dispatch never syncs)")
        if stats is not None:
            raise ValueError("cumulative_local_expert_recv_stats must be None with a cached handle")
        for name, value, want in (("num_experts", num_experts, handle.num_experts),
                                  ("expert_alignment", expert_alignment, handle.expert_alignment),
                                  ("num_max_tokens_per_rank", num_max_tokens, handle.num_max_tokens_per_rank)):
            if value is not None and value != want:
                raise ValueError(f"{name} ({value!r}) differs from the handle's ({want})")
        if bool(do_expand) != handle.do_expand:
            raise ValueError(f"do_expand ({bool(do_expand)}) differs from the handle's layout ({handle.do_expand})")
        if num_tokens != handle.num_tokens:
            raise ValueError(f"x has {num_tokens} tokens, the handle's dispatch had {handle.num_tokens}")
        num_experts, num_max_tokens, alignment = (handle.num_experts, handle.num_max_tokens_per_rank,
                                                  handle.expert_alignment)
        k = handle.num_topk
        sync = False
    else:
        if topk_idx is None:
            raise ValueError("topk_idx is required without a cached handle")
        if num_experts is None:
            raise ValueError("num_experts is required without a cached handle")
        num_experts = checks.num_experts_ok(num_experts, buffer.num_ranks)
        num_max_tokens = optional_nonneg("num_max_tokens_per_rank", num_max_tokens, buffer.num_max_tokens_per_rank)
        if num_max_tokens <= 0:
            raise ValueError("num_max_tokens_per_rank must be positive (here or at construction)")
        alignment = 1 if expert_alignment is None else checks.positive_int("expert_alignment", expert_alignment)
        _, k = checks.tensor("topk_idx", topk_idx, dtype=I64, shape=(num_tokens, None))
        if k > MAX_TOPK:
            raise ValueError(f"topk_idx has {k} columns; at most {MAX_TOPK} are supported")
        sync = True if do_cpu_sync is None else flag("do_cpu_sync", do_cpu_sync)
        if stats is not None:
            checks.tensor("cumulative_local_expert_recv_stats", stats, dtype=I32,
                          shape=(num_experts // buffer.num_ranks,))
    if num_tokens > num_max_tokens:
        raise ValueError(f"x has {num_tokens} tokens, more than num_max_tokens_per_rank ({num_max_tokens})")
    if topk_weights is not None:
        checks.tensor("topk_weights", topk_weights, dtype=F32, shape=(num_tokens, k))
    return data, scales, num_experts, num_max_tokens, alignment, sync


def combine_args(buffer, *, x, handle, topk_weights, bias_0, bias_1, num_sms, num_qps, previous_event,
                 allocate_on_comm_stream, defer_epilogue, async_with_compute_stream) -> None:
    if not isinstance(handle, EPHandle):
        raise TypeError(f"handle must be the EPHandle dispatch returned, got {type(handle).__name__}")
    checks.nonneg_int("num_sms", num_sms)
    checks.nonneg_int("num_qps", num_qps)
    if previous_event is not None and not allocate_on_comm_stream:
        raise ValueError("previous_event needs allocate_on_comm_stream=True")
    if defer_epilogue and not async_with_compute_stream:
        raise ValueError("defer_epilogue needs async_with_compute_stream=True")
    rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
    _, hidden = checks.tensor("x", x, dtype=BF16, ndim=2)
    checks.tensor("x", x, shape=(rows, hidden))
    if topk_weights is not None:
        if handle.do_expand:
            if not buffer.allow_multiple_reduction:
                raise ValueError("topk_weights: an expanded combine carries weights only with "
                                 "allow_multiple_reduction=True")
            checks.tensor("topk_weights", topk_weights, dtype=F32, shape=(rows,))
        else:
            checks.tensor("topk_weights", topk_weights, dtype=F32, shape=(rows, handle.num_topk))
    for name, bias in (("bias[0]", bias_0), ("bias[1]", bias_1)):
        checks.optional_tensor(name, bias, dtype=BF16, shape=(handle.num_tokens, hidden))
    if shape_of(handle.recv_src_metadata)[0] != handle.num_recv_tokens:
        raise ValueError("handle: its recv_src_metadata does not match its num_recv_tokens")

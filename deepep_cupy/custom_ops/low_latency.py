"""The low-latency ops as torch custom ops: dispatch and combine with every flag, their receive hooks and
the zero-copy combine buffer.

A dispatch returns two tensors: ``recv_x`` and ``small``, one int32 allocation that holds the counts,
the handle's source info and layout ranges, and with FP8 the scales, each at the place
:class:`~deepep_cupy.frameworks.SmallOutputs` gives it (the GPU path allocates them that way, so
``small`` is a view of what it returned; the reference backend's separate arrays are copied in). The
traced code cuts the views back out, so the outputs of one op never share storage (torch requires it)
and nothing is copied on the GPU. The handle is rebuilt as ``(src_info, layout_range, T, hidden,
num_experts)`` from those views.

With ``return_recv_hook`` the dispatch (or combine) op only sends and returns a ticket, an empty tensor
that keeps the library's hook; the hook handed to the caller calls the ``*_recv`` op, which runs it and
declares the outputs it fills as mutated. Where functionalization gave the receive op copies of those
outputs instead of the outputs themselves, it copies the results into them, so the traced program
reads what eager code would.
"""

from __future__ import annotations

import functools
import weakref

import torch

from ..ops.handles import LowLatencyHandle
from .common import (
    NO_EVENT,
    buffer_id,
    buffer_of,
    define,
    handle_entry,
    pack,
    remember_handle,
    unpack,
    word_layout,
)

__all__ = ["low_latency_dispatch", "low_latency_combine", "get_next_low_latency_combine_buffer"]

_TICKET = "_deepep_cupy_recv"


def small_layout(num_ranks, t_max, num_experts, hidden, fp8: bool, ue8m0: bool) -> tuple:
    """``(parts, total_words)``: where the dispatch's small outputs sit in ``small``, as
    :class:`~deepep_cupy.frameworks.SmallOutputs` places the GPU plan's (:func:`common.word_layout`)."""
    e_local, slab = num_experts // num_ranks, num_ranks * t_max
    specs = [((e_local,), "int32"), ((e_local, slab), "int32"), ((e_local, num_ranks), "int64")]
    if fp8:
        num_scales = -(-hidden // 512) if ue8m0 else hidden // 128
        specs.append(((e_local, num_scales, slab), "int32" if ue8m0 else "float32"))
    return word_layout(specs)


_small = functools.cache(small_layout)  # the real ops' sizes are ints


# ---------------------------------------------------------------------------------------------------- dispatch
def _dispatch(bid, x, topk_idx, cumulative_stats, wait_stats, t_max, num_experts, use_fp8, round_scale, use_ue8m0,
              hook: bool):
    buffer = buffer_of(bid)
    recv, count, handle, _, hook_fn = buffer.low_latency_dispatch(
        x, topk_idx, t_max, num_experts, cumulative_stats, wait_stats, use_fp8=use_fp8, round_scale=round_scale,
        use_ue8m0=use_ue8m0, async_finish=False, return_recv_hook=hook)
    recv_x, scales = recv if use_fp8 else (recv, None)
    layout = _small(buffer.group_size, t_max, num_experts, x.shape[1], use_fp8, use_ue8m0 and use_fp8)
    small = _plan_small(handle, count, scales, layout)
    if small is not None:  # the GPU plan's allocation, found from the handle's pointers: no view cut
        _remember_ll(handle, small, layout)
        return recv_x, small, (hook_fn, recv_x, None, layout, small, cumulative_stats, wait_stats)
    parts = [count, handle[0], handle[1]] + ([scales.transpose(1, 2)] if use_fp8 else [])
    small = pack(parts, layout)
    return recv_x, small, (hook_fn, recv_x, parts, layout, small, cumulative_stats, wait_stats)


def _plan_small(handle, count, scales, layout):
    """The one allocation a GPU dispatch plan cut ``count``, the handle's tensors and ``scales`` from, when
    the pointers of the handle (``LowLatencyHandle.ptrs``, kept by the plan) and the outputs sit where
    ``layout`` places them (else None: the reference backend's arrays). Reads addresses only: the handle's
    own views are cut when something asks for them, and nothing here asks."""
    ptrs = getattr(handle, "ptrs", None)
    if ptrs is None or count.storage_offset() != 0:
        return None
    base, parts = count.data_ptr(), layout[0]
    if ptrs[0] != base + 4 * parts[1][3] or ptrs[1] != base + 8 * parts[2][3]:
        return None
    if scales is not None:  # handed out column-major: the transposed view of the stored part
        _, _, strides, offset = parts[3]
        if scales.data_ptr() != base + 4 * offset or scales.stride() != (strides[0], strides[2], strides[1]):
            return None
    return count.as_strided((layout[1],), (1,), 0)


def _remember_ll(handle, small, layout) -> None:
    """What the combine rebuilds the GPU handle from: its owner (weakly: the engine of its Buffer), plan key
    and pointers, the row map's among them when it sits right after the parts of ``small`` (where the plan
    places it: ``[R*T, E_local]`` int32)."""
    ptrs, owner = handle.ptrs, getattr(handle, "owner", None)
    row_map = ptrs[2] if ptrs[2] == small.data_ptr() + 4 * layout[1] else 0  # else memory small may not hold
    remember_handle(small, ("low_latency", None if owner is None else weakref.ref(owner), handle.key,
                            (ptrs[0], ptrs[1], row_map)))


def _dispatch_fake(bid, x, topk_idx, cumulative_stats, wait_stats, t_max, num_experts, use_fp8, round_scale,
                   use_ue8m0):
    num_ranks = buffer_of(bid).group_size
    _, words = small_layout(num_ranks, t_max, num_experts, x.shape[1], use_fp8, use_ue8m0 and use_fp8)
    recv_x = x.new_empty((num_experts // num_ranks, num_ranks * t_max, x.shape[1]),
                         dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
    return recv_x, x.new_empty((words,), dtype=torch.int32)


_STATS = ("cumulative_stats", "wait_stats")


@define("ll_dispatch")
def ll_dispatch(bid: int, x: torch.Tensor, topk_idx: torch.Tensor, t_max: int, num_experts: int, use_fp8: bool,
                round_scale: bool, use_ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    recv_x, small, _ = _dispatch(bid, x, topk_idx, None, None, t_max, num_experts, use_fp8, round_scale, use_ue8m0,
                                 False)
    return recv_x, small


@ll_dispatch.register_fake
def _(bid, x, topk_idx, t_max, num_experts, use_fp8, round_scale, use_ue8m0):
    return _dispatch_fake(bid, x, topk_idx, None, None, t_max, num_experts, use_fp8, round_scale, use_ue8m0)


# With statistics: an op that declares them mutated. (A separate op, as for the combine: torch's eager path
# of an op with mutated arguments costs tens of microseconds more per call.)
@define("ll_dispatch_stats", mutates_args=_STATS)
def ll_dispatch_stats(bid: int, x: torch.Tensor, topk_idx: torch.Tensor, cumulative_stats: torch.Tensor | None,
                      wait_stats: torch.Tensor | None, t_max: int, num_experts: int, use_fp8: bool,
                      round_scale: bool, use_ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    recv_x, small, _ = _dispatch(bid, x, topk_idx, cumulative_stats, wait_stats, t_max, num_experts, use_fp8,
                                 round_scale, use_ue8m0, False)
    return recv_x, small


ll_dispatch_stats.register_fake(_dispatch_fake)


@define("ll_dispatch_send", mutates_args=_STATS)
def ll_dispatch_send(bid: int, x: torch.Tensor, topk_idx: torch.Tensor, cumulative_stats: torch.Tensor | None,
                     wait_stats: torch.Tensor | None, t_max: int, num_experts: int, use_fp8: bool, round_scale: bool,
                     use_ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    recv_x, small, state = _dispatch(bid, x, topk_idx, cumulative_stats, wait_stats, t_max, num_experts, use_fp8,
                                     round_scale, use_ue8m0, True)
    ticket = x.new_empty((0,), dtype=torch.uint8)
    setattr(ticket, _TICKET, state)
    return recv_x, small, ticket


@ll_dispatch_send.register_fake
def _(bid, x, topk_idx, cumulative_stats, wait_stats, t_max, num_experts, use_fp8, round_scale, use_ue8m0):
    recv_x, small = _dispatch_fake(bid, x, topk_idx, cumulative_stats, wait_stats, t_max, num_experts, use_fp8,
                                   round_scale, use_ue8m0)
    return recv_x, small, x.new_empty((0,), dtype=torch.uint8)


def _state(ticket):
    state = getattr(ticket, _TICKET, None)
    if state is None:
        raise RuntimeError("a low-latency receive hook got a ticket no send op made (was the ticket tensor "
                           "copied on its way?)")
    return state


def _copy_back(given, original) -> None:
    if given is not None and original is not None and given.data_ptr() != original.data_ptr():
        given.copy_(original)


@define("ll_dispatch_recv", mutates_args=("recv_x", "small", "cumulative_stats", "wait_stats"))
def ll_dispatch_recv(ticket: torch.Tensor, recv_x: torch.Tensor, small: torch.Tensor,
                     cumulative_stats: torch.Tensor | None, wait_stats: torch.Tensor | None) -> None:
    hook_fn, recv_x0, parts, layout, small0, stats0, wait0 = _state(ticket)
    hook_fn()
    _copy_back(recv_x, recv_x0)
    if parts is not None and small.data_ptr() != parts[0].data_ptr():  # the reference backend's arrays
        for view, t in zip(unpack(small, layout), parts, strict=True):
            view.copy_(t)
    elif parts is None:  # the GPU plan's allocation: into small where that is a copy of it
        _copy_back(small, small0)
    _copy_back(cumulative_stats, stats0)
    _copy_back(wait_stats, wait0)


@ll_dispatch_recv.register_fake
def _(ticket, recv_x, small, cumulative_stats, wait_stats):
    return None


def low_latency_dispatch(buffer, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                         cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                         use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                         async_finish: bool = False, return_recv_hook: bool = False):
    """``Buffer.low_latency_dispatch`` while dynamo traces (same arguments and results; the event is empty)."""
    bid = buffer_id(buffer)
    t_max, num_experts, hidden = _int(num_max_dispatch_tokens_per_rank), _int(num_experts), x.shape[1]
    fp8 = bool(use_fp8)
    ue8m0 = bool(use_ue8m0) and fp8
    stats, wait = cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats
    args = (bid, x, topk_idx, stats, wait, t_max, num_experts, fp8, bool(round_scale), bool(use_ue8m0))
    hook = None
    if return_recv_hook:
        recv_x, small, ticket = torch.ops.deepep_cupy.ll_dispatch_send(*args)

        def hook():
            torch.ops.deepep_cupy.ll_dispatch_recv(ticket, recv_x, small, stats, wait)
    elif stats is None and wait is None:
        recv_x, small = torch.ops.deepep_cupy.ll_dispatch(bid, x, topk_idx, *args[5:])
    else:
        recv_x, small = torch.ops.deepep_cupy.ll_dispatch_stats(*args)
    views = unpack(small, small_layout(buffer.group_size, t_max, num_experts, x.shape[1], fp8, ue8m0))
    recv = (recv_x, views[3].transpose(1, 2)) if fp8 else recv_x
    return recv, views[0], (views[1], views[2], t_max, hidden, num_experts), NO_EVENT, hook


# ---------------------------------------------------------------------------------------------------- combine
def _handle(buffer, src_info, layout_range, t_max, hidden, num_experts):
    """The handle tuple; on the GPU the class a dispatch returns (its owner, plan key and pointers: no index
    checks, the row map) when the tensors are the views of a dispatch op's output, else a plain tuple
    (checked like a caller's)."""
    entries = (src_info, layout_range, t_max, hidden, num_experts)
    if buffer.backend != "cuda":
        return entries
    found = handle_entry(src_info)
    if found is None or found[0] != "low_latency":
        return entries
    _, owner_ref, key, ptrs = found
    owner = None if owner_ref is None else owner_ref()
    if (owner_ref is not None and owner is None) or ptrs[0] != src_info.data_ptr() or \
            ptrs[1] != layout_range.data_ptr():
        return entries  # the Buffer is gone, or other views of that allocation
    handle = LowLatencyHandle(entries, None, owner, key)
    handle.ptrs = ptrs
    return handle


def _combine(bid, x, topk_idx, topk_weights, src_info, layout_range, t_max, hidden, num_experts, use_logfmt,
             zero_copy, out, wait_stats, hook: bool):
    buffer = buffer_of(bid)
    handle = _handle(buffer, src_info, layout_range, t_max, hidden, num_experts)
    if zero_copy:
        # Zero copy only where x is the buffer itself (the traced code wrote into it in place); else the
        # same combine reads x (the reference backend's buffer is a staged copy: always x).
        zero_copy = buffer.backend == "cuda" and \
            buffer.get_next_low_latency_combine_buffer(handle).data_ptr() == x.data_ptr()
    result, _, hook_fn = buffer.low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt=use_logfmt,
                                                    zero_copy=zero_copy, async_finish=False,
                                                    return_recv_hook=hook, out=out,
                                                    combine_wait_recv_cost_stats=wait_stats)
    # With out the op returns an empty tensor (an op may not return its input) and the caller gets out.
    fresh = topk_weights.new_empty((0,), dtype=torch.bfloat16) if out is not None else result
    return fresh, (hook_fn, result, wait_stats)


def _combine_fake(bid, x, topk_idx, topk_weights, src_info, layout_range, t_max, hidden, num_experts, use_logfmt,
                  zero_copy, out, wait_stats):
    shape = (0,) if out is not None else (topk_idx.shape[0], hidden)
    return topk_weights.new_empty(shape, dtype=torch.bfloat16)


@define("ll_combine")
def ll_combine(bid: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
               src_info: torch.Tensor, layout_range: torch.Tensor, t_max: int, hidden: int, num_experts: int,
               use_logfmt: bool, zero_copy: bool) -> torch.Tensor:
    return _combine(bid, x, topk_idx, topk_weights, src_info, layout_range, t_max, hidden, num_experts, use_logfmt,
                    zero_copy, None, None, False)[0]


@ll_combine.register_fake
def _(bid, x, topk_idx, topk_weights, src_info, layout_range, t_max, hidden, num_experts, use_logfmt, zero_copy):
    return _combine_fake(bid, x, topk_idx, topk_weights, src_info, layout_range, t_max, hidden, num_experts,
                         use_logfmt, zero_copy, None, None)


# With out or the wait stats: an op that declares them mutated. (A separate op: inductor mishandles the
# result of an op whose optional mutated arguments are all None.)
@define("ll_combine_into", mutates_args=("out", "wait_stats"))
def ll_combine_into(bid: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    src_info: torch.Tensor, layout_range: torch.Tensor, t_max: int, hidden: int, num_experts: int,
                    use_logfmt: bool, zero_copy: bool, out: torch.Tensor | None,
                    wait_stats: torch.Tensor | None) -> torch.Tensor:
    return _combine(bid, x, topk_idx, topk_weights, src_info, layout_range, t_max, hidden, num_experts, use_logfmt,
                    zero_copy, out, wait_stats, False)[0]


ll_combine_into.register_fake(_combine_fake)


@define("ll_combine_send", mutates_args=("out", "wait_stats"))
def ll_combine_send(bid: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    src_info: torch.Tensor, layout_range: torch.Tensor, t_max: int, hidden: int, num_experts: int,
                    use_logfmt: bool, zero_copy: bool, out: torch.Tensor | None,
                    wait_stats: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    result, state = _combine(bid, x, topk_idx, topk_weights, src_info, layout_range, t_max, hidden, num_experts,
                             use_logfmt, zero_copy, out, wait_stats, True)
    ticket = topk_weights.new_empty((0,), dtype=torch.uint8)
    setattr(ticket, _TICKET, state)
    return result, ticket


@ll_combine_send.register_fake
def _(bid, x, topk_idx, topk_weights, src_info, layout_range, t_max, hidden, num_experts, use_logfmt, zero_copy,
      out, wait_stats):
    result = _combine_fake(bid, x, topk_idx, topk_weights, src_info, layout_range, t_max, hidden, num_experts,
                           use_logfmt, zero_copy, out, wait_stats)
    return result, topk_weights.new_empty((0,), dtype=torch.uint8)


@define("ll_combine_recv", mutates_args=("target", "wait_stats"))
def ll_combine_recv(ticket: torch.Tensor, target: torch.Tensor, wait_stats: torch.Tensor | None) -> None:
    hook_fn, result0, wait0 = _state(ticket)
    hook_fn()
    _copy_back(target, result0)
    _copy_back(wait_stats, wait0)


@ll_combine_recv.register_fake
def _(ticket, target, wait_stats):
    return None


def low_latency_combine(buffer, x, topk_idx, topk_weights, handle, use_logfmt: bool = False, zero_copy: bool = False,
                        async_finish: bool = False, return_recv_hook: bool = False, out=None,
                        combine_wait_recv_cost_stats=None):
    """``Buffer.low_latency_combine`` while dynamo traces (same arguments and results; the event is empty)."""
    bid = buffer_id(buffer)
    src_info, layout_range, t_max, hidden, num_experts = handle
    wait = combine_wait_recv_cost_stats
    args = (bid, x, topk_idx, topk_weights, src_info, layout_range, _int(t_max), _int(hidden), _int(num_experts),
            bool(use_logfmt), bool(zero_copy), out, wait)
    hook = None
    if return_recv_hook:
        result, ticket = torch.ops.deepep_cupy.ll_combine_send(*args)
        target = out if out is not None else result

        def hook():
            torch.ops.deepep_cupy.ll_combine_recv(ticket, target, wait)
    elif out is None and wait is None:
        result = torch.ops.deepep_cupy.ll_combine(*args[:-2])
    else:
        result = torch.ops.deepep_cupy.ll_combine_into(*args)
    return (out if out is not None else result), NO_EVENT, hook


# ---------------------------------------------------------------------------------------------------- zero copy
@define("ll_combine_buffer", integer_inputs=True)  # src_info, layout_range
def ll_combine_buffer(bid: int, src_info: torch.Tensor, layout_range: torch.Tensor, t_max: int, hidden: int,
                      num_experts: int) -> torch.Tensor:
    buffer = buffer_of(bid)
    if buffer.backend == "cuda":
        handle = _handle(buffer, src_info, layout_range, t_max, hidden, num_experts)
        return buffer.get_next_low_latency_combine_buffer(handle)
    # The reference backend stages its buffer per handle object; the combine op reads x there instead.
    num_ranks = buffer.group_size
    return src_info.new_zeros((num_experts // num_ranks, num_ranks * t_max, hidden), dtype=torch.bfloat16)


@ll_combine_buffer.register_fake
def _(bid, src_info, layout_range, t_max, hidden, num_experts):
    num_ranks = buffer_of(bid).group_size
    return src_info.new_empty((num_experts // num_ranks, num_ranks * t_max, hidden), dtype=torch.bfloat16)


def get_next_low_latency_combine_buffer(buffer, handle):
    """``Buffer.get_next_low_latency_combine_buffer`` while dynamo traces. On the GPU the tensor is the
    buffer itself; where the compiled code writes into it in place, the zero-copy combine sends from it,
    otherwise the combine reads the written tensor (the same results)."""
    src_info, layout_range, t_max, hidden, num_experts = handle
    return torch.ops.deepep_cupy.ll_combine_buffer(buffer_id(buffer), src_info, layout_range, _int(t_max),
                                                   _int(hidden), _int(num_experts))


def _int(v):
    """A handle's size as an op argument: symbolic while dynamo traces with dynamic shapes."""
    return v if isinstance(v, torch.SymInt) else int(v)

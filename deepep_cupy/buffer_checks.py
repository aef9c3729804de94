"""The argument checks of every ``Buffer`` op, run once per new plan (a call whose tensors have the
metadata of an earlier call skips them). Each raises ``TypeError``/``ValueError`` naming the argument.

Values only the device sees (expert ids) are checked inside the kernels on the GPU backend and raised
at the next call; the reference backend checks them on the host. The index values of a handle the GPU
kernels are given (intranode 6-tuple, low-latency handle) are checked on the host once per handle, when
validation is on (``DEEPEP_CUPY_VALIDATE``, default on): see :func:`device_handle_values`.
"""

from __future__ import annotations

import functools
import weakref

import numpy as np

from . import validate as check
from .config import Config, low_latency_rdma_size_hint
from .interop import BF16, BOOL, F32, FP8, I32, I64, is_tensor, shape_of, to_numpy
from .plan_cache import OpHandle

__all__ = ["num_experts_ok", "split_x", "internode_handle", "dispatch_args", "combine_args", "ll_dispatch_args", "ll_combine_args",
           "config_key", "report_failures", "device_handle_values", "intranode_handle_values", "ll_handle_values"]


def num_experts_ok(num_experts, num_ranks: int) -> int:
    num_experts = check.positive_int("num_experts", num_experts)
    if num_experts % num_ranks != 0:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the number of ranks ({num_ranks})")
    return num_experts


def config_key(config) -> tuple:
    if not isinstance(config, Config):
        raise TypeError(f"config must be a deepep_cupy.Config, got {type(config).__name__}")
    return (int(config.num_sms), int(config.num_max_nvl_chunked_send_tokens),
            int(config.num_max_nvl_chunked_recv_tokens), int(config.num_max_rdma_chunked_send_tokens),
            int(config.num_max_rdma_chunked_recv_tokens))


def split_x(x):
    """Split BF16 ``x`` or the FP8 tuple ``(x_e4m3, scales)``; return (x, scales, num_tokens, hidden)."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError("an FP8 x must be a tuple (x_e4m3 [N, H], scales [N, H/128])")
        data, scales = x
        n, h = check.tensor("x[0]", data, dtype=FP8, ndim=2)
        if h % 128 != 0:
            raise ValueError(f"FP8 hidden size must be a multiple of 128, got {h}")
        check.tensor("x[1]", scales, dtype=F32, shape=(n, h // 128), contiguous=False)
        return data, scales, n, h
    n, h = check.tensor("x", x, dtype=BF16, ndim=2)
    if h % 8 != 0:
        raise ValueError(f"BF16 hidden size must be a multiple of 8, got {h}")
    return x, None, n, h


def _tensor_handle(handle, length: int, source: str, dtypes) -> None:
    check.handle(handle, length, source)
    for i, want in enumerate(dtypes):
        if want is not None:
            check.tensor(f"handle[{i}]", handle[i], dtype=want, contiguous=False)


_U8 = np.dtype(np.uint8)


def internode_handle(handle, num_ranks: int, num_rdma_ranks: int, num_tokens=None) -> int:
    """Check DeepEP's 10-entry internode handle (see ``reference/internode.py``); return its received rows."""
    r, d = num_ranks, num_rdma_ranks
    _tensor_handle(handle, 10, "an internode dispatch (a group of several NVLink domains)",
                   (BOOL, I32, I32, I32, I32, I32, I32, _U8, I32, I32))
    n, _ = check.tensor("handle[0] (is_token_in_rank)", handle[0], dtype=BOOL, shape=(num_tokens, r))
    _, c = check.tensor("handle[1] (rdma_channel_prefix_matrix)", handle[1], dtype=I32, shape=(d, None))
    check.tensor("handle[2] (gbl_channel_prefix_matrix)", handle[2], dtype=I32, shape=(r, c))
    check.tensor("handle[3] (recv_rdma_channel_prefix_matrix)", handle[3], dtype=I32, shape=(d, c))
    check.tensor("handle[4] (recv_rdma_rank_prefix_sum)", handle[4], dtype=I32, shape=(d,))
    check.tensor("handle[5] (recv_gbl_channel_prefix_matrix)", handle[5], dtype=I32, shape=(r, c))
    check.tensor("handle[6] (recv_gbl_rank_prefix_sum)", handle[6], dtype=I32, shape=(r,))
    rows, _ = check.tensor("handle[7] (recv_src_meta)", handle[7], dtype=_U8, shape=(None, 8))
    check.tensor("handle[8] (send_rdma_head)", handle[8], dtype=I32, shape=(n, d))
    check.tensor("handle[9] (send_nvl_head)", handle[9], dtype=I32, shape=(None, r // d))
    return rows


def dispatch_args(num_ranks: int, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                  topk_idx, topk_weights, expert_alignment, num_worst_tokens, config, num_rdma_ranks: int = 1) -> None:
    _, _, n, _ = split_x(x)
    check.positive_int("expert_alignment", expert_alignment)
    check.nonneg_int("num_worst_tokens", num_worst_tokens)
    config_key(config)
    r = num_ranks
    if handle is not None:
        if topk_idx is not None or topk_weights is not None:
            raise ValueError("a cached dispatch (handle given) takes no topk_idx/topk_weights")
        if num_rdma_ranks > 1:
            internode_handle(handle, r, num_rdma_ranks, n)
            return
        _tensor_handle(handle, 6, "dispatch", (I32, I32, I32, I32, BOOL, I32))
        check.tensor("handle[0] (rank_prefix_matrix)", handle[0], dtype=I32, shape=(r, r))
        check.tensor("handle[1] (channel_prefix_matrix)", handle[1], dtype=I32, ndim=2)
        c = shape_of(handle[1])[1]
        check.tensor("handle[2] (recv_channel_prefix_matrix)", handle[2], dtype=I32, shape=(r, c))
        check.tensor("handle[3] (recv_src_idx)", handle[3], dtype=I32, ndim=1)
        check.tensor("handle[4] (is_token_in_rank)", handle[4], dtype=BOOL, shape=(n, r))
        return
    check.tensor("num_tokens_per_rank", num_tokens_per_rank, dtype=I32, shape=(r,))
    check.tensor("is_token_in_rank", is_token_in_rank, dtype=BOOL, shape=(n, r))
    if num_tokens_per_expert is None:
        raise ValueError("num_tokens_per_expert is required (from get_dispatch_layout)")
    (e,) = check.tensor("num_tokens_per_expert", num_tokens_per_expert, dtype=I32, ndim=1)
    if e == 0 or e % r != 0:
        raise ValueError(f"num_tokens_per_expert must have one entry per expert, a positive multiple of the "
                         f"number of ranks ({r}); got {e} entries")
    if (topk_idx is None) != (topk_weights is None):
        raise ValueError("topk_idx and topk_weights must be given together")
    if topk_idx is not None:
        _, k = check.tensor("topk_idx", topk_idx, dtype=I64, ndim=2)
        if shape_of(topk_idx)[0] != n:
            raise ValueError(f"topk_idx must have {n} rows like x, got {shape_of(topk_idx)[0]}")
        check.tensor("topk_weights", topk_weights, dtype=F32, shape=(n, k))


def split_bias(bias):
    if isinstance(bias, (tuple, list)):
        if len(bias) != 2:
            raise ValueError("bias must be one tensor or a tuple of two")
        return bias[0], bias[1]
    return bias, None


def combine_args(num_ranks: int, x, handle, topk_weights, bias, config, num_rdma_ranks: int = 1) -> None:
    if num_rdma_ranks > 1:
        internode_handle(handle, num_ranks, num_rdma_ranks)
    else:
        _tensor_handle(handle, 6, "dispatch", (I32, I32, I32, I32, BOOL, I32))
    r = num_ranks
    m, hidden = check.tensor("x", x, dtype=BF16, ndim=2)
    if hidden % 8 != 0:
        raise ValueError(f"BF16 hidden size must be a multiple of 8, got {hidden}")
    config_key(config)
    if num_rdma_ranks > 1:
        n, _ = shape_of(handle[0])
        _combine_rest(m, hidden, shape_of(handle[7])[0], n, topk_weights, bias)
        return
    check.tensor("handle[0] (rank_prefix_matrix)", handle[0], dtype=I32, shape=(r, r))
    check.tensor("handle[1] (channel_prefix_matrix)", handle[1], dtype=I32, ndim=2)
    c = shape_of(handle[1])[1]
    check.tensor("handle[2] (recv_channel_prefix_matrix)", handle[2], dtype=I32, shape=(r, c))
    (num_recv,) = check.tensor("handle[3] (recv_src_idx)", handle[3], dtype=I32, ndim=1)
    n, _ = check.tensor("handle[4] (is_token_in_rank)", handle[4], dtype=BOOL, shape=(None, r))
    check.tensor("handle[5] (send_head)", handle[5], dtype=I32, shape=(n, r))
    _combine_rest(m, hidden, num_recv, n, topk_weights, bias)


def _combine_rest(m, hidden, num_recv, n, topk_weights, bias) -> None:
    if m < num_recv:
        raise ValueError(f"x has {m} rows but the handle describes {num_recv} received tokens")
    if topk_weights is not None:
        check.tensor("topk_weights", topk_weights, dtype=F32, ndim=2)
        if shape_of(topk_weights)[0] != m:
            raise ValueError(f"topk_weights must have {m} rows like x, got {shape_of(topk_weights)[0]}")
    bias_0, bias_1 = split_bias(bias)
    check.optional_tensor("bias[0]", bias_0, dtype=BF16, shape=(n, hidden))
    check.optional_tensor("bias[1]", bias_1, dtype=BF16, shape=(n, hidden))


def _wait_stats(name, stats, r: int) -> None:
    if stats is None:
        return
    s = check.tensor(name, stats, dtype=I64)
    if s not in ((r,), (r, r)):
        raise ValueError(f"{name} must have shape [{r}] or [{r}, {r}], got {list(s)}")


def ll_dispatch_args(num_ranks: int, num_rdma_bytes: int | None, x, topk_idx, t, num_experts,
                     cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8, round_scale,
                     use_ue8m0) -> None:
    t = check.positive_int("num_max_dispatch_tokens_per_rank", t)
    num_experts = num_experts_ok(num_experts, num_ranks)
    n, hidden = check.tensor("x", x, dtype=BF16, ndim=2)
    if n > t:
        raise ValueError(f"x has {n} tokens, more than num_max_dispatch_tokens_per_rank={t}")
    if hidden % (128 if use_fp8 else 8) != 0:
        raise ValueError(f"hidden must be a multiple of {128 if use_fp8 else 8}, got {hidden}")
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0 requires round_scale=True")
    if use_ue8m0 and hidden % 512 != 0:
        raise ValueError(f"use_ue8m0 needs hidden to be a multiple of 512, got {hidden}")
    _, k = check.tensor("topk_idx", topk_idx, dtype=I64, shape=(n, None))
    if not 1 <= k <= 32:
        raise ValueError(f"topk_idx must have 1 to 32 columns (top-k) for the low-latency kernels, got {k}")
    check.optional_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, dtype=I32,
                          shape=(num_experts // num_ranks,))
    _wait_stats("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, num_ranks)
    if num_rdma_bytes is not None:
        need = low_latency_rdma_size_hint(t, hidden, num_ranks, num_experts)
        if num_rdma_bytes < need:
            raise ValueError(f"num_rdma_bytes={num_rdma_bytes} is too small for T={t}, hidden={hidden}, "
                             f"{num_experts} experts: need {need} (Buffer.get_low_latency_rdma_size_hint)")


def ll_handle_sizes(handle, num_ranks: int) -> tuple[int, int, int]:
    """Check a low-latency handle's structure and sizes (not its tensors); return ``(T, hidden, num_experts)``."""
    check.handle(handle, 5, "low_latency_dispatch")
    try:
        t = check.positive_int("handle[2] (num_max_dispatch_tokens_per_rank)", handle[2])
        hidden = check.positive_int("handle[3] (hidden)", handle[3])
        num_experts = num_experts_ok(handle[4], num_ranks)
    except ValueError as exc:
        raise ValueError(f"handle is not one returned by low_latency_dispatch: {exc}") from None
    if not is_tensor(handle[0]):
        raise TypeError(f"handle[0] (src_info) must be a tensor, got {type(handle[0]).__name__}: the handle is not "
                        "one returned by low_latency_dispatch")
    return t, hidden, num_experts


def ll_handle(handle, num_ranks: int) -> tuple[int, int, int]:
    """Check a low-latency handle's structure; return its ``(T, hidden, num_experts)``."""
    t, hidden, num_experts = ll_handle_sizes(handle, num_ranks)
    e_local, slab = num_experts // num_ranks, num_ranks * t
    check.tensor("handle[0] (src_info)", handle[0], dtype=I32, shape=(e_local, slab))
    check.tensor("handle[1] (layout_range)", handle[1], dtype=I64, shape=(e_local, num_ranks))
    return t, hidden, num_experts


def ll_combine_args(num_ranks: int, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, out,
                    combine_wait_recv_cost_stats) -> None:
    t, hidden, num_experts = ll_handle(handle, num_ranks)
    e_local = num_experts // num_ranks
    check.tensor("x", x, dtype=BF16, shape=(e_local, num_ranks * t, hidden))
    n, k = check.tensor("topk_idx", topk_idx, dtype=I64, ndim=2)
    if n > t:
        raise ValueError(f"topk_idx has {n} tokens, more than the handle's num_max_dispatch_tokens_per_rank={t}")
    if not 1 <= k <= 32:
        raise ValueError(f"topk_idx must have 1 to 32 columns (top-k) for the low-latency kernels, got {k}")
    check.tensor("topk_weights", topk_weights, dtype=F32, shape=(n, k))
    if use_logfmt and hidden % 128 != 0:
        raise ValueError(f"use_logfmt needs hidden to be a multiple of 128, got {hidden}")
    check.optional_tensor("out", out, dtype=BF16, shape=(n, hidden))
    _wait_stats("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, num_ranks)


# ------------------------------------------------------------------------------------ handle index values
# Handles recently checked, by id, with a reference that keeps the id from being reused; a handle is
# normally used by one combine and a few cached dispatches right after the dispatch that made it.
_CHECKED: dict = {}
_CHECKED_MAX = 4


def _bad(name: str, what: str) -> ValueError:
    return ValueError(f"{name} {what}: the handle is not one dispatch returned (or was modified)")


def intranode_handle_values(h, rank: int, num_ranks: int) -> None:
    """Index checks of the intranode 6-tuple, as NumPy arrays ``h``, for this ``rank``; each entry must be
    what the dispatch derived (the GPU kernels index memory with them)."""
    from .reference.normal import channel_prefix_matrix, send_head_matrix

    rp, cp, rcp, src, in_rank, head = (np.asarray(a) for a in h)
    in_rank = in_rank.astype(bool)
    rows = src.shape[0]
    if (rp < 0).any() or (np.diff(rp.astype(np.int64), axis=0) < 0).any():
        raise _bad("handle[0] (rank_prefix_matrix)", "must be non-negative and non-decreasing down each column")
    ends = rp[:, rank].astype(np.int64)
    if ends[-1] > rows:
        raise _bad("handle[0] (rank_prefix_matrix)", f"says rank {rank} received {int(ends[-1])} rows, more than "
                   f"the {rows} rows of handle[3] (recv_src_idx)")
    c = cp.shape[1]
    if not np.array_equal(cp, channel_prefix_matrix(in_rank, c)):
        raise _bad("handle[1] (channel_prefix_matrix)", "does not count the tokens of handle[4] (is_token_in_rank) "
                   "per channel")
    if not np.array_equal(head, send_head_matrix(in_rank)):
        bad = int(np.count_nonzero(head != send_head_matrix(in_rank)))
        raise _bad("handle[5] (send_head)", f"has {bad} entries that are not -1 where handle[4] is False and the "
                   "token's position among those sent to the rank where it is True")
    got = np.diff(np.concatenate([[0], ends]))  # rows received from each source
    rcp = rcp.astype(np.int64)
    if (rcp[:, 0] != 0).any() or (np.diff(rcp, axis=1) < 0).any() or (rcp[:, -1] > got).any():
        raise _bad("handle[2] (recv_channel_prefix_matrix)", "must start at 0 and rise along each row to at most the "
                   "rows received from that rank (handle[0])")
    received = src[:ends[-1]].astype(np.int64)
    if received.size and received.min() < 0:
        raise _bad("handle[3] (recv_src_idx)", "holds negative token indices among the received rows")
    # Rows of one source come in its token order: indices rise strictly within each source's block.
    rising = np.diff(received) > 0
    starts = ends[:-1][(ends[:-1] > 0) & (ends[:-1] < ends[-1])] - 1  # the steps from one block to the next
    rising[starts] = True
    if not rising.all():
        raise _bad("handle[3] (recv_src_idx)", "must rise strictly within the rows of each source rank")


def ll_handle_values(h, num_ranks: int) -> None:
    """Index checks of a low-latency handle ``(src_info, layout_range, T, hidden, num_experts)`` with its
    tensors as NumPy arrays: row ranges inside the ``R * T`` rows of each local expert, not overlapping, and
    every row's source token in ``[0, T)``."""
    src_info, layout_range = np.asarray(h[0]), np.asarray(h[1]).astype(np.int64)
    t = int(h[2])
    slab = num_ranks * t
    begin, count = layout_range >> 32, layout_range & 0xFFFFFFFF
    if (begin < 0).any() or (count > t).any() or (begin + count > slab).any():
        raise _bad("handle[1] (layout_range)", f"has row ranges outside [0, {slab}) or longer than T={t}")
    # By begin, then count: an empty range may share its begin with the range that follows it.
    order = np.argsort(begin * (slab + 1) + count, axis=1, kind="stable")
    b, n = np.take_along_axis(begin, order, 1), np.take_along_axis(count, order, 1)
    if (b[:, 1:] < b[:, :-1] + n[:, :-1]).any():
        raise _bad("handle[1] (layout_range)", "has overlapping row ranges within a local expert")
    # Rows inside some range: +1 where a range starts, -1 where it ends, running sum > 0.
    edges = np.zeros((begin.shape[0], slab + 1), np.int64)
    experts = np.repeat(np.arange(begin.shape[0]), begin.shape[1])
    np.add.at(edges, (experts, begin.ravel()), 1)
    np.add.at(edges, (experts, (begin + count).ravel()), -1)
    tokens = src_info[np.cumsum(edges, axis=1)[:, :slab] > 0]
    if tokens.size and (tokens.min() < 0 or tokens.max() >= t):
        raise _bad("handle[0] (src_info)", f"names source tokens outside [0, {t}) (T) in received rows")


def _capturing(obj) -> bool:
    if isinstance(obj, np.ndarray):
        return False
    if type(obj).__module__.startswith("torch"):
        import torch

        return bool(obj.is_cuda and torch.cuda.is_current_stream_capturing())
    import cupy

    return bool(cupy.cuda.get_current_stream().is_capturing())


def device_handle_values(buffer, handle) -> None:
    """The index checks of a GPU ``handle`` given to ``buffer``'s op, once per handle, when validation is on,
    no CUDA graph is being captured (the host copy waits for the device) and the handle is not one an op
    returned as it was (:class:`~deepep_cupy.plan_cache.OpHandle`: eager steps pay no wait for their own). Internode handles are left
    to their own checks. Raises ``ValueError`` naming the entry."""
    if isinstance(handle, OpHandle) or not check.values_enabled() or not is_tensor(handle[0]) or len(handle) not in (5, 6):
        return  # an op's own handle, unchanged: the kernels wrote it
    key = (id(handle), buffer.rank, buffer.group_size)
    if key in _CHECKED or _capturing(handle[0]):
        return
    # The dispatch that made the handle may still run on the communication stream (async_finish).
    stream = getattr(buffer.runtime, "comm_stream", None)
    if stream is not None:
        stream.synchronize()
    if len(handle) == 6:
        intranode_handle_values([to_numpy(a) for a in handle], buffer.rank, buffer.group_size)
    else:
        ll_handle_values((to_numpy(handle[0]), to_numpy(handle[1]), handle[2]), buffer.group_size)
    if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.pop(next(iter(_CHECKED)))
    _CHECKED[key] = handle


# The collective methods of ``Buffer`` and the op of the runtime each one runs.
_COLLECTIVE_METHODS = {"dispatch": "dispatch", "internode_dispatch": "dispatch", "combine": "combine",
                       "internode_combine": "combine", "low_latency_dispatch": "low_latency_dispatch",
                       "low_latency_combine": "low_latency_combine"}


def report_failures(buffer) -> None:
    """Make an error that one of ``buffer``'s collective methods raises on this rank before the op's first
    exchange (a bad argument, found by the checks above) reach ``buffer.runtime.report_failure``, which
    raises it on every rank where the op starts with a host exchange (the reference backend).

    Installed on the instance, and only for a runtime that has ``report_failure``: the methods of a GPU
    ``Buffer`` stay as they are (no wrapper on the hot path; there the peers' kernels time out instead).
    """
    report = getattr(buffer.runtime, "report_failure", None)
    if report is None:
        return
    ref = weakref.ref(buffer)  # no cycle through the instance's own attributes
    for name, op in _COLLECTIVE_METHODS.items():
        setattr(buffer, name, _reporting(getattr(type(buffer), name), op, ref))


def _reporting(method, op: str, ref):
    @functools.wraps(method)
    def call(*args, **kwargs):
        buffer = ref()
        try:
            return method(buffer, *args, **kwargs)
        except Exception as exc:
            buffer.runtime.report_failure(op, exc)
            raise
    return call

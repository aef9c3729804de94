"""Every argument check of the ``Buffer`` ops, shared by both backends. Each raises ``TypeError`` or
``ValueError`` naming the argument.

The op checks run once per new plan (a call whose tensors have the metadata of an earlier call skips
them). Values only the device sees (expert ids) are checked inside the kernels on the GPU backend and
raised at the next call; the reference backend checks them on the host (:func:`topk_values`). The index
values of handles are checked in :mod:`deepep_cupy.ops.handles`.
"""

from __future__ import annotations

import functools

import numpy as np

from .config import Config
from .frameworks import (
    BF16,
    BOOL,
    F32,
    FP8,
    I32,
    I64,
    framework_of,
    is_capturing,
    is_tensor,
    logical_dtype,
    shape_of,
)
from .ops.handles import HANDLE_TYPES, LowLatencyHandle, OpHandle
from .settings import values_enabled

__all__ = [
    "tensor", "optional_tensor", "handle_tuple", "positive_int", "nonneg_int", "topk_values", "values_enabled",
    "num_experts_ok", "config_values", "split_x", "split_bias", "internode_handle", "dispatch_args", "combine_args",
    "ll_dispatch_args", "ll_handle_sizes", "ll_handle", "ll_combine_args",
]


def _dtype_name(dtype) -> str:
    d = np.dtype(dtype)
    return {BF16: "bfloat16", FP8: "float8_e4m3fn"}.get(d, d.name)


def tensor(name: str, obj, *, dtype=None, shape=None, ndim=None, contiguous=True):
    """Check one array argument. ``shape`` may hold None for any extent. Returns its shape."""
    if obj is None:
        raise ValueError(f"{name} is required")
    if not is_tensor(obj):
        raise TypeError(f"{name} must be a torch tensor, CuPy array or NumPy array, got {type(obj).__name__}")
    got = logical_dtype(obj)
    if dtype is not None:
        allowed = dtype if isinstance(dtype, (tuple, list)) else (dtype,)
        if got not in [np.dtype(d) for d in allowed]:
            want = " or ".join(_dtype_name(d) for d in allowed)
            raise TypeError(f"{name} must have dtype {want}, got {_dtype_name(got)}")
    s = shape_of(obj)
    if ndim is not None and len(s) != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {list(s)}")
    if shape is not None:
        if len(s) != len(shape) or any(w is not None and w != g for w, g in zip(shape, s, strict=True)):
            want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(s)}")
    if contiguous and not _is_contiguous(obj):
        fix = f"{name}.contiguous()" if framework_of(obj) == "torch" else f"ascontiguousarray({name})"
        raise ValueError(f"{name} must be contiguous, got a strided view of shape {list(s)}: pass {fix}")
    return s


def optional_tensor(name: str, obj, **kw):
    return None if obj is None else tensor(name, obj, **kw)


def _is_contiguous(obj) -> bool:
    if hasattr(obj, "is_contiguous"):
        return bool(obj.is_contiguous())
    return bool(obj.flags.c_contiguous)


def handle_tuple(value, length: int, source: str) -> None:
    """A handle must be the tuple an earlier call returned (``length`` elements)."""
    if isinstance(value, (tuple, list)):
        # The whole result tuple of an op passed where only its handle goes (``handle=buffer.dispatch(...)``):
        # name the element to pass instead of failing later on a dtype of the wrong element.
        inner = [i for i, v in enumerate(value) if isinstance(v, (OpHandle, LowLatencyHandle))]
        if inner:
            i = inner[0]
            raise ValueError(f"handle got a whole result tuple of {len(value)} values: pass its handle, the "
                             f"{_ORDINALS.get(i, f'#{i + 1}')} result (result[{i}]), not the tuple")
    if not isinstance(value, HANDLE_TYPES) or len(value) != length:
        raise ValueError(f"handle must be the {length}-tuple returned by {source}")


_ORDINALS = {0: "first", 1: "second", 2: "third", 3: "fourth", 4: "fifth", 5: "sixth"}


def positive_int(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def nonneg_int(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def topk_values(name: str, topk_idx, num_experts: int, bound: str = "num_experts") -> None:
    """Every entry must be -1 or a valid expert id; ``bound`` names where ``num_experts`` came from.

    On the GPU this costs one reduction and a wait for it; it is skipped while a CUDA graph is being
    captured (nothing may wait then) and when ``DEEPEP_CUPY_VALIDATE=0``.
    """
    if not values_enabled() or shape_of(topk_idx)[0] == 0:
        return
    if isinstance(topk_idx, np.ndarray):
        bad = int(np.count_nonzero((topk_idx < -1) | (topk_idx >= num_experts)))
    elif is_capturing(topk_idx):
        return
    elif framework_of(topk_idx) == "torch":
        bad = int(((topk_idx < -1) | (topk_idx >= num_experts)).sum().item())
    else:
        bad = int(_count_out_of_range()(topk_idx, np.int64(num_experts)))
    if bad:
        raise ValueError(f"{name} holds {bad} expert ids outside [-1, {num_experts}) ({num_experts} = {bound})")


@functools.cache
def _count_out_of_range():
    import cupy

    # One pass over the ids, one scalar back: the cheapest device-side range check.
    return cupy.ReductionKernel("T x, T e", "int64 y", "(x < -1 || x >= e) ? 1 : 0", "a + b", "y = a", "0",
                                "deepep_count_out_of_range")


# ---------------------------------------------------------------------------------------------------- op arguments
def num_experts_ok(num_experts, num_ranks: int) -> int:
    num_experts = positive_int("num_experts", num_experts)
    if num_experts % num_ranks != 0:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the number of ranks ({num_ranks})")
    return num_experts


def config_values(config) -> tuple:
    if not isinstance(config, Config):
        raise TypeError(f"config must be a deepep_cupy.Config, got {type(config).__name__}")
    return (int(config.num_sms), int(config.num_max_nvl_chunked_send_tokens),
            int(config.num_max_nvl_chunked_recv_tokens), int(config.num_max_rdma_chunked_send_tokens),
            int(config.num_max_rdma_chunked_recv_tokens))


def split_x(x):
    """Split BF16 ``x`` or the FP8 tuple ``(x_e4m3, scales)``; return (x, scales, num_tokens, hidden)."""
    if isinstance(x, (tuple, list)):
        if type(x) is not tuple or len(x) != 2 or not any(is_tensor(v) for v in x):
            # A list of rows, or any sequence that is not the FP8 pair.
            kinds = ", ".join(type(v).__name__ for v in x[:2]) + (", ..." if len(x) > 2 else "")
            raise TypeError(f"x must be a bf16 tensor [num_tokens, hidden], or for FP8 a tuple (x_e4m3 [num_tokens, "
                            f"hidden], scales [num_tokens, hidden // 128]) of two tensors; got a {type(x).__name__} of "
                            f"{len(x)} ({kinds})")
        data, scales = x
        n, h = tensor("x[0]", data, dtype=FP8, ndim=2)
        if h % 128 != 0:
            raise ValueError(f"FP8 hidden size must be a multiple of 128, got {h}")
        # float32 scales, one per 128 channels; or UE8M0 exponents packed four to an int32, one word per 512.
        tensor("x[1]", scales, dtype=(F32, I32), contiguous=False)
        packed = logical_dtype(scales) == I32
        tensor("x[1]", scales, shape=(n, -(-h // 512) if packed else h // 128), contiguous=False)
        return data, scales, n, h
    n, h = tensor("x", x, dtype=BF16, ndim=2)
    if h % 8 != 0:
        raise ValueError(f"BF16 hidden size must be a multiple of 8, got {h}")
    return x, None, n, h


def _tensor_handle(handle, length: int, source: str, dtypes) -> None:
    handle_tuple(handle, length, source)
    for i, want in enumerate(dtypes):
        if want is not None:
            tensor(f"handle[{i}]", handle[i], dtype=want, contiguous=False)


_U8 = np.dtype(np.uint8)


def internode_handle(handle, num_ranks: int, num_rdma_ranks: int, num_tokens=None) -> int:
    """Check DeepEP's 10-entry internode handle (see ``reference/internode.py``); return its received rows."""
    r, d = num_ranks, num_rdma_ranks
    _tensor_handle(handle, 10, "an internode dispatch (a group of several NVLink domains)",
                   (BOOL, I32, I32, I32, I32, I32, I32, _U8, I32, I32))
    n, _ = tensor("handle[0] (is_token_in_rank)", handle[0], dtype=BOOL, shape=(None, r))
    if num_tokens is not None:
        _same_rows("handle[0] (is_token_in_rank)", (n, r), num_tokens)
    _, c = tensor("handle[1] (rdma_channel_prefix_matrix)", handle[1], dtype=I32, shape=(d, None))
    tensor("handle[2] (gbl_channel_prefix_matrix)", handle[2], dtype=I32, shape=(r, c))
    tensor("handle[3] (recv_rdma_channel_prefix_matrix)", handle[3], dtype=I32, shape=(d, c))
    tensor("handle[4] (recv_rdma_rank_prefix_sum)", handle[4], dtype=I32, shape=(d,))
    tensor("handle[5] (recv_gbl_channel_prefix_matrix)", handle[5], dtype=I32, shape=(r, c))
    tensor("handle[6] (recv_gbl_rank_prefix_sum)", handle[6], dtype=I32, shape=(r,))
    rows, _ = tensor("handle[7] (recv_src_meta)", handle[7], dtype=_U8, shape=(None, 8))
    tensor("handle[8] (send_rdma_head)", handle[8], dtype=I32, shape=(n, d))
    tensor("handle[9] (send_nvl_head)", handle[9], dtype=I32, shape=(None, r // d))
    return rows


def dispatch_args(num_ranks: int, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                  topk_idx, topk_weights, expert_alignment, num_worst_tokens, config, num_rdma_ranks: int = 1) -> None:
    _, _, n, _ = split_x(x)
    positive_int("expert_alignment", expert_alignment)
    nonneg_int("num_worst_tokens", num_worst_tokens)
    config_values(config)
    r = num_ranks
    if handle is not None:
        if topk_idx is not None or topk_weights is not None:
            raise ValueError("a cached dispatch (handle given) takes no topk_idx/topk_weights")
        if num_rdma_ranks > 1:
            internode_handle(handle, r, num_rdma_ranks, n)
            return
        _tensor_handle(handle, 6, "dispatch", (I32, I32, I32, I32, BOOL, I32))
        tensor("handle[0] (rank_prefix_matrix)", handle[0], dtype=I32, shape=(r, r))
        tensor("handle[1] (channel_prefix_matrix)", handle[1], dtype=I32, ndim=2)
        c = shape_of(handle[1])[1]
        tensor("handle[2] (recv_channel_prefix_matrix)", handle[2], dtype=I32, shape=(r, c))
        tensor("handle[3] (recv_src_idx)", handle[3], dtype=I32, ndim=1)
        _same_rows("handle[4] (is_token_in_rank)",
                   tensor("handle[4] (is_token_in_rank)", handle[4], dtype=BOOL, shape=(None, r)), n)
        return
    tensor("num_tokens_per_rank", num_tokens_per_rank, dtype=I32, shape=(r,))
    _same_rows("is_token_in_rank", tensor("is_token_in_rank", is_token_in_rank, dtype=BOOL, shape=(None, r)), n)
    if num_tokens_per_expert is None:
        raise ValueError("num_tokens_per_expert is required (from get_dispatch_layout)")
    (e,) = tensor("num_tokens_per_expert", num_tokens_per_expert, dtype=I32, ndim=1)
    if e == 0 or e % r != 0:
        raise ValueError(f"num_tokens_per_expert must have one entry per expert, a positive multiple of the "
                         f"number of ranks ({r}); got {e} entries")
    if (topk_idx is None) != (topk_weights is None):
        raise ValueError("topk_idx and topk_weights must be given together")
    if topk_idx is not None:
        _same_rows("topk_idx", tensor("topk_idx", topk_idx, dtype=I64, ndim=2), n)
        k = shape_of(topk_idx)[1]
        _same_rows("topk_weights", tensor("topk_weights", topk_weights, dtype=F32, ndim=2), n)
        if shape_of(topk_weights)[1] != k:
            raise ValueError(f"topk_weights must have one column per column of topk_idx ({k}), got "
                             f"{shape_of(topk_weights)[1]}")


def _same_rows(name: str, shape, n: int) -> None:
    """``name`` has one row per token of ``x`` (``n`` of them); which of the two is off is unknown, so the
    message names both."""
    if shape[0] != n:
        raise ValueError(f"{name} has {shape[0]} rows but x has {n} tokens: they must match (one row per token)")


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
    m, hidden = tensor("x", x, dtype=BF16, ndim=2)
    if hidden % 8 != 0:
        raise ValueError(f"BF16 hidden size must be a multiple of 8, got {hidden}")
    config_values(config)
    if num_rdma_ranks > 1:
        n, _ = shape_of(handle[0])
        _combine_rest(m, hidden, shape_of(handle[7])[0], n, topk_weights, bias, getattr(handle, "num_topk", 0))
        return
    tensor("handle[0] (rank_prefix_matrix)", handle[0], dtype=I32, shape=(r, r))
    tensor("handle[1] (channel_prefix_matrix)", handle[1], dtype=I32, ndim=2)
    c = shape_of(handle[1])[1]
    tensor("handle[2] (recv_channel_prefix_matrix)", handle[2], dtype=I32, shape=(r, c))
    (num_recv,) = tensor("handle[3] (recv_src_idx)", handle[3], dtype=I32, ndim=1)
    n, _ = tensor("handle[4] (is_token_in_rank)", handle[4], dtype=BOOL, shape=(None, r))
    tensor("handle[5] (send_head)", handle[5], dtype=I32, shape=(n, r))
    _combine_rest(m, hidden, num_recv, n, topk_weights, bias, getattr(handle, "num_topk", 0))


def _combine_rest(m, hidden, num_recv, n, topk_weights, bias, num_topk) -> None:
    if m < num_recv:
        raise ValueError(f"x has {m} rows but the handle describes {num_recv} received tokens")
    if topk_weights is not None:
        rows, k = tensor("topk_weights", topk_weights, dtype=F32, ndim=2)
        if rows != m:
            raise ValueError(f"topk_weights must have {m} rows like x, got {rows}")
        if num_topk and k != num_topk:
            raise ValueError(f"topk_weights has {k} columns, but the dispatch that returned the handle had "
                             f"top-{num_topk} (recv_topk_weights has {num_topk} columns)")
    bias_0, bias_1 = split_bias(bias)
    optional_tensor("bias[0]", bias_0, dtype=BF16, shape=(n, hidden))
    optional_tensor("bias[1]", bias_1, dtype=BF16, shape=(n, hidden))


def _wait_stats(name, stats, r: int) -> None:
    if stats is None:
        return
    s = tensor(name, stats, dtype=I64)
    if s not in ((r,), (r, r)):
        raise ValueError(f"{name} must have shape [{r}] or [{r}, {r}], got {list(s)}")


def ll_dispatch_args(num_ranks: int, x, topk_idx, t, num_experts,
                     cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8, round_scale,
                     use_ue8m0) -> None:
    t = positive_int("num_max_dispatch_tokens_per_rank", t)
    num_experts = num_experts_ok(num_experts, num_ranks)
    n, hidden = tensor("x", x, dtype=BF16, ndim=2)
    if n > t:
        raise ValueError(f"x has {n} tokens, more than num_max_dispatch_tokens_per_rank={t}")
    if hidden % (128 if use_fp8 else 8) != 0:
        raise ValueError(f"hidden must be a multiple of {128 if use_fp8 else 8}, got {hidden}")
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0 requires round_scale=True")
    if use_ue8m0 and hidden % 512 != 0:
        raise ValueError(f"use_ue8m0 needs hidden to be a multiple of 512, got {hidden}")
    _, k = tensor("topk_idx", topk_idx, dtype=I64, shape=(n, None))
    if not 1 <= k <= 32:
        raise ValueError(f"topk_idx must have 1 to 32 columns (top-k) for the low-latency kernels, got {k}")
    optional_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, dtype=I32,
                          shape=(num_experts // num_ranks,))
    _wait_stats("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, num_ranks)


def ll_handle_sizes(handle, num_ranks: int) -> tuple[int, int, int]:
    """Check a low-latency handle's structure and sizes (not its tensors); return ``(T, hidden, num_experts)``."""
    handle_tuple(handle, 5, "low_latency_dispatch")
    try:
        t = positive_int("handle[2] (num_max_dispatch_tokens_per_rank)", handle[2])
        hidden = positive_int("handle[3] (hidden)", handle[3])
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
    tensor("handle[0] (src_info)", handle[0], dtype=I32, shape=(e_local, slab))
    tensor("handle[1] (layout_range)", handle[1], dtype=I64, shape=(e_local, num_ranks))
    return t, hidden, num_experts


def ll_combine_args(num_ranks: int, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, out,
                    combine_wait_recv_cost_stats) -> None:
    t, hidden, num_experts = ll_handle(handle, num_ranks)
    e_local = num_experts // num_ranks
    tensor("x", x, dtype=BF16, shape=(e_local, num_ranks * t, hidden))
    n, k = tensor("topk_idx", topk_idx, dtype=I64, ndim=2)
    if n > t:
        raise ValueError(f"topk_idx has {n} tokens, more than the handle's num_max_dispatch_tokens_per_rank={t}")
    if not 1 <= k <= 32:
        raise ValueError(f"topk_idx must have 1 to 32 columns (top-k) for the low-latency kernels, got {k}")
    tensor("topk_weights", topk_weights, dtype=F32, shape=(n, k))
    if use_logfmt and hidden % 128 != 0:
        raise ValueError(f"use_logfmt needs hidden to be a multiple of 128, got {hidden}")
    optional_tensor("out", out, dtype=BF16, shape=(n, hidden))
    _wait_stats("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, num_ranks)

"""Dispatch layout: per-rank, per-RDMA-rank and per-expert token counts and the token -> rank map."""

from __future__ import annotations

import functools

import numpy as np

from ..jit import BuildSpec, load

__all__ = ["MAX_TOPK", "get_dispatch_layout", "layout_spec", "representative_builds"]

MAX_TOPK = 128
_SOURCE = "layout.cu"
_THREADS = 1024  # kThreads in layout.cu
_EXPERTS_PER_BLOCK = 32  # kExpertsPerBlock in layout.cu
_RANKS_PER_BLOCK = 32  # kRanksPerBlock in layout.cu


def _kernel_name(num_topk: int) -> str:
    return f"dispatch_layout_kernel<{num_topk}>"


@functools.cache
def layout_spec(num_topk: int) -> BuildSpec:
    """The build of the layout kernel for one top-k (the only compile-time parameter)."""
    return BuildSpec.make(_SOURCE, name_expressions=[_kernel_name(num_topk)])


def representative_builds() -> list[BuildSpec]:
    """Instantiations compiled by the CPU test suite: odd/even top-k, scalar and vector load paths."""
    return [layout_spec(k) for k in (1, 4, 8, 32)]


def get_dispatch_layout(topk_idx, num_experts: int, num_ranks: int, num_nvl_ranks: int, stream=None):
    """Count where each token goes.

    Arguments:
        topk_idx: CuPy ``int64`` array ``[N, K]``, C-contiguous, on the current device; ``-1`` selects no
            expert. Ids must be below ``num_experts`` (larger ids are ignored by the kernel).
        num_experts: total expert count ``E``, divisible by ``num_ranks``; experts live on ranks contiguously
            (rank ``e // (E // R)``).
        num_ranks: ``R``.
        num_nvl_ranks: ranks per NVLink domain (node); ``R`` must be a multiple of it when smaller than ``R``.
        stream: CuPy stream to launch on (None: the current stream). The outputs are allocated from the
            current stream's memory pool, so callers choose the allocation stream with ``with stream:``.

    Returns:
        ``(num_tokens_per_rank int32[R], num_tokens_per_rdma_rank int32[R // num_nvl_ranks] or None when
        num_nvl_ranks >= num_ranks, num_tokens_per_expert int32[E], is_token_in_rank bool[N, R])``. A token
        counts once per rank and once per RDMA rank however many of its experts live there.
    """
    import cupy

    if not isinstance(topk_idx, cupy.ndarray):
        raise TypeError(f"topk_idx must be a cupy.ndarray, got {type(topk_idx).__name__}")
    if topk_idx.dtype != np.int64:
        raise TypeError(f"topk_idx must be int64, got {topk_idx.dtype}")
    if topk_idx.ndim != 2:
        raise ValueError(f"topk_idx must be 2-D [num_tokens, num_topk], got shape {topk_idx.shape}")
    if not topk_idx.flags.c_contiguous:
        raise ValueError("topk_idx must be C-contiguous")
    num_tokens, num_topk = (int(s) for s in topk_idx.shape)
    if not 1 <= num_topk <= MAX_TOPK:
        raise ValueError(f"top-k must be between 1 and {MAX_TOPK}, got {num_topk}")
    num_experts, num_ranks, num_nvl_ranks = int(num_experts), int(num_ranks), int(num_nvl_ranks)
    if num_ranks <= 0 or num_experts <= 0 or num_nvl_ranks <= 0:
        raise ValueError(
            f"num_experts ({num_experts}), num_ranks ({num_ranks}) and num_nvl_ranks ({num_nvl_ranks}) must be positive"
        )
    if num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by num_ranks ({num_ranks})")
    has_rdma = num_nvl_ranks < num_ranks
    if has_rdma and num_ranks % num_nvl_ranks:
        raise ValueError(f"num_ranks ({num_ranks}) must be a multiple of num_nvl_ranks ({num_nvl_ranks})")
    if num_tokens * num_topk >= 2**31:
        raise ValueError(f"too many tokens for the layout kernel: {num_tokens} x top-{num_topk}")
    device_id = cupy.cuda.runtime.getDevice()
    if topk_idx.device.id != device_id:
        raise ValueError(f"topk_idx is on device {topk_idx.device.id}, but the current device is {device_id}")

    kernel = load(layout_spec(num_topk)).get_function(_kernel_name(num_topk))
    num_expert_blocks = -(-num_experts // _EXPERTS_PER_BLOCK)
    num_rank_blocks = -(-num_ranks // _RANKS_PER_BLOCK)
    # Outputs come from the memory pool of the current stream (the caller chooses it, e.g. the compute
    # stream); only the kernel runs on `stream`.
    per_rank = cupy.empty(num_ranks, dtype=cupy.int32)
    per_rdma = cupy.empty(num_ranks // num_nvl_ranks, dtype=cupy.int32) if has_rdma else None
    per_expert = cupy.empty(num_experts, dtype=cupy.int32)
    in_rank = cupy.empty((num_tokens, num_ranks), dtype=cupy.bool_)
    # The grid does not depend on num_tokens: with N = 0 the kernel still writes zero counts.
    kernel(
        (num_expert_blocks + num_rank_blocks,),
        (_THREADS,),
        (
            topk_idx,
            np.int32(num_tokens),
            np.int32(num_experts),
            np.int32(num_ranks),
            np.int32(num_nvl_ranks if has_rdma else num_ranks),
            np.int32(num_expert_blocks),
            per_expert,
            per_rank,
            per_rdma if per_rdma is not None else np.uint64(0),  # null pointer
            in_rank,
        ),
        stream=stream,
    )
    return per_rank, per_rdma, per_expert, in_rank

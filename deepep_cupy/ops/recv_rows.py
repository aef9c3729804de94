"""DeepEP V2's layout arrays of a new dispatch handle in two launches (``cuda_src/layout/recv_rows.cu``).

The arrays and their meaning are those of :mod:`deepep_cupy.ep.recv_rows`, whose array operations serve the
reference backend and are the oracle of these kernels; on the GPU they took a few dozen small launches per
new handle, these take two. All outputs are cut from one allocation in the caller's framework.
"""

from __future__ import annotations

import functools

from ..device.launch import LaunchPlan
from ..frameworks import I32, I64, SmallOutputs
from ..jit import BuildSpec, load
from . import kernel_names
from .headers import constant, kernel_struct

__all__ = ["COUNT_RECV_ROWS", "PLACE_RECV_ROWS", "RecvRowsPlan", "recv_rows_spec"]

_SOURCE = "layout/recv_rows.cu"
COUNT_RECV_ROWS = kernel_struct("layout/args.cuh", "CountRecvRowsArgs")
PLACE_RECV_ROWS = kernel_struct("layout/args.cuh", "PlaceRecvRowsArgs")
_COUNT_THREADS = constant(_SOURCE, "kRecvRowsThreads")
_PLACE_THREADS = constant(_SOURCE, "kPlaceThreads")
_PLACE_BLOCKS = constant(_SOURCE, "kPlaceBlocks")
_MAX_SHAPES = 64  # output layouts kept per plan (received-row counts vary per call)


@functools.cache
def recv_rows_spec() -> BuildSpec:
    """The one build of both kernels (no compile-time parameters)."""
    return BuildSpec.make(_SOURCE, name_expressions=[kernel_names.layout_count_recv_rows(),
                                                     kernel_names.layout_place_recv_rows()])


class RecvRowsPlan:
    """The two launches for one (framework, device, ``L`` local experts, ``R`` ranks, rank). The rows received
    from each rank come from V1's intranode rank prefix matrix (its column ``rank``) or, with ``per_rank``
    (across NVLink domains), from V1's internode per-rank prefix sum."""

    def __init__(self, frame, *, num_local_experts: int, num_ranks: int, rank: int, per_rank: bool = False) -> None:
        module = load(recv_rows_spec())
        self.frame = frame
        self.num_local_experts, self.num_ranks = int(num_local_experts), int(num_ranks)
        self.count = LaunchPlan(module.get_function(kernel_names.layout_count_recv_rows()),
                                self.num_local_experts + self.num_ranks, _COUNT_THREADS, COUNT_RECV_ROWS,
                                {n: 0 for n in COUNT_RECV_ROWS.names} | dict(
                                    num_local_experts=num_local_experts, num_ranks=num_ranks))
        self.place = LaunchPlan(module.get_function(kernel_names.layout_place_recv_rows()), _PLACE_BLOCKS,
                                _PLACE_THREADS, PLACE_RECV_ROWS, {n: 0 for n in PLACE_RECV_ROWS.names} | dict(
                                    num_local_experts=num_local_experts, num_ranks=num_ranks,
                                    prefix_stride=1 if per_rank else num_ranks, prefix_column=0 if per_rank else rank),
                                shared_mem=4 * (self.num_local_experts + self.num_ranks))
        self._outputs: dict = {}

    def _layout(self, rows: int, topk: int, tokens: int, expanded: int) -> SmallOutputs:
        key = (rows, topk, tokens, expanded)
        small = self._outputs.get(key)
        if small is None:
            if len(self._outputs) >= _MAX_SHAPES:
                self._outputs.clear()
            small = self._outputs[key] = SmallOutputs([
                ((rows, topk), I64), ((expanded,), I64), ((self.num_local_experts,), I32),
                ((self.num_local_experts,), I32), ((rows, topk + 2), I32), ((self.num_ranks,), I32),
                ((tokens, topk), I32)])
        return small

    def run(self, recv_topk_idx, recv_src_idx, rank_prefix, topk_idx, is_token_in_rank, *,
            num_max_tokens: int, expert_alignment: int, expand: bool, num_expanded_rows: int):
        """On the caller's current stream; every input C-contiguous on this plan's device (``rank_prefix``:
        the matrix or the per-rank sum, as the plan was made for). Returns
        ``(rows, sources or None, counts, psum_expert, metadata, psum_rank, dst_slots)``."""
        frame = self.frame
        rows, topk = (int(s) for s in recv_topk_idx.shape)
        tokens = int(topk_idx.shape[0])
        expanded = int(num_expanded_rows) if expand else 0
        small = self._layout(rows, topk, tokens, expanded)
        words = frame.empty_words(small)
        base, offsets, ptr = frame.ptr(words), small.byte_offsets, frame.ptr
        count, place = self.count, self.place
        count.set(recv_topk_idx=ptr(recv_topk_idx), num_rows=rows, num_topk=topk, expand=int(expand),
                  rows=base + offsets[0], counts=base + offsets[2], sources=base + offsets[1],
                  num_expanded_rows=expanded, topk_idx=ptr(topk_idx), is_token_in_rank=ptr(is_token_in_rank),
                  num_tokens=tokens, num_max_tokens=num_max_tokens, dst_slots=base + offsets[6])
        place.set(recv_topk_idx=ptr(recv_topk_idx), recv_src_idx=ptr(recv_src_idx),
                  rank_prefix=ptr(rank_prefix), num_rows=rows, num_topk=topk,
                  expert_alignment=expert_alignment, expand=int(expand), num_max_tokens=num_max_tokens,
                  counts=base + offsets[2], rows=base + offsets[0], sources=base + offsets[1],
                  num_expanded_rows=expanded, psum_expert=base + offsets[3], psum_rank=base + offsets[5],
                  metadata=base + offsets[4])
        stream = frame.stream()
        count.launch(stream)
        place.launch(stream)
        parts = [frame.part(words, small, i) for i in range(7)]
        if not expand:
            parts[1] = None
        return tuple(parts)

"""``EPHandle``: what one V2 dispatch leaves for its combine and for cached dispatches.

Fields keep V2's names and meanings. The handle also holds
V1's handle and where the V2 layer put the received rows (``_recv_rows``, from recv_rows.py).
"""

from __future__ import annotations

__all__ = ["EPHandle"]


class EPHandle:
    """The routing of one V2 dispatch.

    Attributes:
        do_expand: whether the expanded layout (one row per token and local expert) was produced.
        num_experts, expert_alignment, num_max_tokens_per_rank: the dispatch's settings; a cached dispatch
            must match them.
        num_sms: SMs the dispatch was given (``combine(num_sms=0)`` reuses it).
        topk_idx: `[T, K]` the top-k ids dispatched: a copy (2.1's ``do_handle_copy=True``) or the caller's
            tensor; on ``EPBuffer`` reading it checks that a torch tensor was not modified in place since.
        num_recv_tokens: received rows; without CPU sync the bound ``M * num_ranks``.
        num_expanded_tokens: rows of the expanded layout (sum of aligned per-expert counts), or its bound.
        num_recv_tokens_per_expert_list: aligned received count per local expert; ``[]`` without CPU sync.
        psum_num_recv_tokens_per_scaleup_rank: `[num_scaleup_ranks]` int32, inclusive prefix sum of the rows
            received from each source rank (in hybrid mode across domains: from the source ranks of each
            scale-up index, over all domains); ``[-1]`` is the number of valid rows.
        psum_num_recv_tokens_per_expert: `[L]` int32. Non-expanded: inclusive prefix sum of the aligned counts;
            expanded: each expert's aligned start plus its count.
        num_unaligned_recv_tokens_per_expert: `[L]` int32, received selections per local expert.
        recv_src_metadata: `[num_recv_tokens, K + 2]` int32: column 0 ``src_rank * M + src_token_idx``,
            column 1 ``src_rank * K + highest local top-k slot``, columns 2.. the expanded row of each top-k
            slot (-1 where none, and everywhere in the non-expanded layout); -1 rows past the valid ones.
        dst_buffer_slot_idx: `[T, K]` int32, where each selection of this rank's tokens went
            (``dest_rank * M + position``), -1 for none.
        token_metadata_at_forward, channel_linked_list, cached_recv_src_metadata_before_sort: None (used by
            V2's hybrid and deterministic kernels only).
    """

    def __init__(self, *, do_expand: bool, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int,
                 num_sms: int, topk_idx, num_recv_tokens: int, num_expanded_tokens: int,
                 num_recv_tokens_per_expert_list: list, psum_num_recv_tokens_per_scaleup_rank,
                 psum_num_recv_tokens_per_expert, num_unaligned_recv_tokens_per_expert, recv_src_metadata,
                 dst_buffer_slot_idx, guard_topk_idx: bool = False, v1_handle=None, recv_rows=None,
                 recv_topk_idx=None) -> None:
        self.do_expand = bool(do_expand)
        self.num_experts = int(num_experts)
        self.expert_alignment = int(expert_alignment)
        self.num_max_tokens_per_rank = int(num_max_tokens_per_rank)
        self.num_sms = int(num_sms)
        self._topk_idx = topk_idx
        self._topk_idx_version = _version(topk_idx) if guard_topk_idx else None
        self.num_recv_tokens = int(num_recv_tokens)
        self.num_expanded_tokens = int(num_expanded_tokens)
        self.num_recv_tokens_per_expert_list = list(num_recv_tokens_per_expert_list)
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = None
        self.channel_linked_list = None
        self.cached_recv_src_metadata_before_sort = None
        self._v1_handle = v1_handle
        self._recv_rows = recv_rows
        self._recv_topk_idx = recv_topk_idx  # [num_recv_tokens, K] local ids, -1 elsewhere

    @property
    def topk_idx(self):
        if self._topk_idx_version is not None and _version(self._topk_idx) != self._topk_idx_version:
            raise RuntimeError("handle.topk_idx: the topk_idx tensor given to dispatch was modified in place "
                               "since; the handle's routing no longer matches it")
        return self._topk_idx

    @property
    def num_topk(self) -> int:
        return int(self._topk_idx.shape[1])

    @property
    def num_tokens(self) -> int:
        return int(self._topk_idx.shape[0])

    def __repr__(self) -> str:
        return (f"EPHandle(do_expand={self.do_expand}, num_experts={self.num_experts}, "
                f"num_recv_tokens={self.num_recv_tokens}, num_expanded_tokens={self.num_expanded_tokens})")


def _version(tensor):
    """torch's in-place version counter of ``tensor``; None where there is none (NumPy, CuPy, inference
    tensors)."""
    try:
        return tensor._version
    except (AttributeError, RuntimeError):
        return None

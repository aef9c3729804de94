"""Inputs of the NumPy models of the intranode kernels and the reference dispatch they are checked against,
shared by tests/unit/test_intranode_model.py (ring and direct modes) and test_intranode_copy.py (the
combine's copy mode)."""

import numpy as np
from thread_group import run_ranks

from deepep_cupy.reference import normal


def model_inputs(rng, R, n_tokens, skew=False, E_per_rank=8, K=3, H=4):
    """Per rank: rows, is_token_in_rank, top-k ids and per-expert counts (rank 1 has 5 tokens fewer; with
    ``skew`` and more than 2 ranks, a third of the tokens go to rank 0 only)."""
    E = E_per_rank * R
    xs, in_ranks, topks, per_experts = [], [], [], []
    for me in range(R):
        n = n_tokens if me != 1 else max(0, n_tokens - 5)  # unequal token counts
        topk = rng.integers(-1, E, size=(n, K)).astype(np.int64)
        if skew and n and R > 2:
            topk[: n // 3] = rng.integers(0, E // R, size=(n // 3, K))  # many tokens only for rank 0
        _, _, per_expert, in_rank = normal.dispatch_layout(topk, E, R, R)
        xs.append(rng.standard_normal((n, H)).astype(np.float32))
        in_ranks.append(in_rank)
        topks.append(topk)
        per_experts.append(per_expert)
    return xs, in_ranks, topks, per_experts


def reference_dispatch(xs, in_ranks, topks, per_experts, C):
    def body(group):
        me = group.rank
        return normal.dispatch(group, xs[me], None, handle=None, is_token_in_rank=in_ranks[me],
                               num_tokens_per_expert=per_experts[me], topk_idx=topks[me], topk_weights=None,
                               expert_alignment=4, num_worst_tokens=0, num_channels=C)

    return run_ranks(len(xs), body)

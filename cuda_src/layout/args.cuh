// The parameter struct of the layout kernel, its only parameter. The host reads this declaration
// (deepep_cupy/ops/headers.py) to pack the same bytes: one field per declaration, a pointer or int /
// long long / unsigned long long / float.
#pragma once

#include "common/nvrtc_compat.cuh"
#include "common/timeout.cuh"

namespace deepep_cupy::layout {

// count_tokens.cu: tokens per expert, rank and RDMA rank; is_token_in_rank.
struct CountTokensArgs {
    const int64_t* __restrict__ topk_idx;
    int num_tokens;
    int num_experts;
    int num_ranks;
    int num_nvl_ranks;
    int* __restrict__ num_tokens_per_expert;
    int* __restrict__ num_tokens_per_rank;
    int* __restrict__ num_tokens_per_rdma_rank;
    bool* __restrict__ is_token_in_rank;
    ErrorRecord* err;
    int rank;
};

}  // namespace deepep_cupy::layout

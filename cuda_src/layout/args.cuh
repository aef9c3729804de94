// The parameter structs of the layout kernels, each kernel's only parameter. The host reads this declaration
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

// recv_rows.cu, first kernel: each local expert's received selections (and their places in its
// segment), and each sent selection's slot in its destination rank's buffer (V2's dst_buffer_slot_idx).
struct CountRecvRowsArgs {
    const int64_t* __restrict__ recv_topk_idx;  // [num_rows, num_topk] local expert ids, -1 for none
    int num_rows;
    int num_topk;
    int num_local_experts;
    int expand;                                  // 1: rows[i, j] gets the place in its expert's segment
    long long* __restrict__ rows;                // [num_rows, num_topk]
    int* __restrict__ counts;                    // [num_local_experts]
    long long* __restrict__ sources;             // [num_expanded_rows], all set to -1 here (expand only)
    int num_expanded_rows;
    const int64_t* __restrict__ topk_idx;        // [num_tokens, num_topk] this rank's global expert ids
    const bool* __restrict__ is_token_in_rank;   // [num_tokens, num_ranks]
    int num_tokens;
    int num_ranks;
    int num_max_tokens;
    int* __restrict__ dst_slots;                 // [num_tokens, num_topk]
};

// recv_rows.cu, second kernel: the expanded rows, where each came from, and V2's metadata per row.
struct PlaceRecvRowsArgs {
    const int64_t* __restrict__ recv_topk_idx;  // as above
    const int* __restrict__ recv_src_idx;        // [num_rows] token index at its source, -1 for padding
    const int* __restrict__ rank_prefix;         // rows received from ranks 0..r at [r * prefix_stride + prefix_column]
    int num_rows;
    int num_topk;
    int num_local_experts;
    int expert_alignment;
    int expand;
    int num_ranks;
    int prefix_stride;                           // V1's intranode rank prefix matrix: (num_ranks, rank);
    int prefix_column;                           // its internode per-rank prefix: (1, 0)
    int num_max_tokens;
    const int* __restrict__ counts;              // the first kernel's
    long long* __restrict__ rows;                // in: places within the segments; out: expanded rows or -1
    long long* __restrict__ sources;             // [num_expanded_rows] i * num_topk + j of the row placed there
    int num_expanded_rows;
    int* __restrict__ psum_expert;               // [num_local_experts]
    int* __restrict__ psum_rank;                 // [num_ranks]
    int* __restrict__ metadata;                  // [num_rows, num_topk + 2]
};

}  // namespace deepep_cupy::layout

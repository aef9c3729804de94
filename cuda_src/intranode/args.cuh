// The parameter structs of the intranode kernels: each kernel takes its struct by value as its only
// parameter. The host reads these declarations (deepep_cupy/ops/headers.py) to pack the same bytes, so
// each field is declared here only: one field per declaration, a pointer or int / long long /
// unsigned long long / float. Offsets of the NVL buffer are bytes from the start of a rank's buffer
// (buffer_map.cuh, deepep_cupy/ops/intranode/buffer_map.py).
#pragma once

#include "common/nvrtc_compat.cuh"
#include "common/timeout.cuh"

namespace deepep_cupy::intranode {

// notify.cu: exchange the token counts, build the handle's prefix matrices.
struct NotifyArgs {
    const bool* __restrict__ is_token_in_rank;  // [N, R]
    int num_tokens;
    int num_channels;
    const int* __restrict__ num_tokens_per_expert;  // [R * E_local]
    int num_local_experts;
    int expert_alignment;
    int* __restrict__ rank_prefix_matrix;          // out [R, R]
    int* __restrict__ channel_prefix_matrix;       // out [R, C]
    int* __restrict__ recv_channel_prefix_matrix;  // out [R, C]
    int* __restrict__ meta;                        // out [1 + E_local]: rows received, aligned count per local expert
    const long long* __restrict__ bases;           // [R] every rank's NVL buffer as mapped here
    long long notify_offset;                       // the notify records (R records of notify_stride ints)
    int notify_stride;
    ErrorRecord* err;
    long long timeout_ns;
    int rank;
};

// dispatch.cu: move the tokens (ring mode or direct mode).
struct DispatchArgs {
    const int4* __restrict__ x;  // [N, hidden_int4]
    const unsigned int* __restrict__ x_scales;
    long long scale_token_stride;
    long long scale_block_stride;
    int num_scales;
    const long long* __restrict__ topk_idx;  // [N, num_topk] or null
    const float* __restrict__ topk_weights;  // [N, num_topk] or null
    int num_topk;
    int num_local_experts;
    const bool* __restrict__ is_token_in_rank;  // [N, R]
    int num_tokens;
    int hidden_int4;
    const int* __restrict__ rank_prefix_matrix;
    const int* __restrict__ channel_prefix_matrix;
    const int* __restrict__ recv_channel_prefix_matrix;
    int4* __restrict__ recv_x;  // [num_out_rows, hidden_int4]
    unsigned int* __restrict__ recv_x_scales;
    long long* __restrict__ recv_topk_idx;
    float* __restrict__ recv_topk_weights;
    int* __restrict__ recv_src_idx;
    int* __restrict__ send_head;  // [N, R] (non-cached mode) or null
    int num_out_rows;
    int num_worst_tokens;
    int own_rows_copied;  // this rank's own rows reach recv_x through the copy engines (ops/own_rows.py)
    int fan_out;          // direct mode: each token loaded once for all its ranks (dispatch_direct.cuh)
    const long long* __restrict__ bases;
    const long long* __restrict__ pool_bases;  // every rank's output pool when this rank's outputs are in its own, else null
    long long done_offset;                     // direct mode: done words [source rank][block] in every NVL buffer
    long long ring_offset;
    long long free_offset;
    int slot_bytes;
    int cap;
    int slot_scales_offset;
    int slot_topk_idx_offset;
    int slot_topk_weights_offset;
    int num_channels;
    int num_own_rows_warps;       // sender-block warps that start on the own-rows copy
    int num_recv_own_rows_warps;  // receiver-block warps that start on the own-rows copy
    int publish_batch;            // tokens per publish before clamp_batch
    int* __restrict__ own_rows_claims;  // [C] run counters of the own-rows copy (direct mode: items), 0 between kernels
    ErrorRecord* err;
    long long timeout_ns;
    int rank;
};

// combine.cu: the ring-mode combine.
struct CombineArgs {
    const int4* __restrict__ x;  // [rows, hidden_int4]
    const float* __restrict__ topk_weights;
    int num_topk;
    const int4* __restrict__ bias_0;
    const int4* __restrict__ bias_1;
    const int* __restrict__ rank_prefix_matrix;
    const int* __restrict__ channel_prefix_matrix;
    const int* __restrict__ recv_channel_prefix_matrix;
    const int* __restrict__ send_head;
    int num_tokens;
    int hidden_int4;
    int4* __restrict__ combined_x;
    float* __restrict__ combined_topk_weights;
    // The kOrdered kernels' (V2's summation order, combine_sum.cuh): the source tokens' top-k experts
    // [num_tokens, order_num_topk]; unread by the others (nullptr).
    const long long* __restrict__ order_topk_idx;
    int order_num_topk;
    int num_local_experts;
    const long long* __restrict__ bases;
    long long ring_offset;
    long long free_offset;
    int slot_bytes;
    int cap;
    int slot_topk_weights_offset;
    int num_channels;
    int publish_batch;
    int* __restrict__ run_claims;  // [C] reduction run counters, 0 between kernels
    ErrorRecord* err;
    long long timeout_ns;
    int rank;
};

// combine_copy.cu: the copy-mode combine's sums.
struct CombineCopyArgs {
    const int4* __restrict__ x;
    const float* __restrict__ topk_weights;
    int num_topk;
    const int4* __restrict__ bias_0;
    const int4* __restrict__ bias_1;
    const int* __restrict__ rank_prefix_matrix;
    const int* __restrict__ send_head;
    int num_tokens;
    int hidden_int4;
    int4* __restrict__ combined_x;
    float* __restrict__ combined_topk_weights;
    // The kOrdered kernels' (V2's summation order, combine_sum.cuh): the source tokens' top-k experts
    // [num_tokens, order_num_topk]; unread by the others (nullptr).
    const long long* __restrict__ order_topk_idx;
    int order_num_topk;
    int num_local_experts;
    const long long* __restrict__ bases;
    const uint8_t* __restrict__ staging;  // this rank's staging area
    long long weights_offset;             // where the weights slots start in it
    unsigned long long copy_seq;
    ErrorRecord* err;
    long long timeout_ns;
    int rank;
};

}  // namespace deepep_cupy::intranode

// The parameter structs of the low-latency kernels: each kernel takes its struct by value as its only
// parameter. The host reads these declarations (deepep_cupy/ops/headers.py) to pack the same bytes, so
// each field is declared here only: one field per declaration, a pointer or int / long long /
// unsigned long long / float. Symmetric pointers (sym_*) are this rank's addresses of the buffer half the
// call uses (buffer_map.cuh).
#pragma once

#include "common/nvrtc_compat.cuh"
#include "common/timeout.cuh"

namespace deepep_cupy::low_latency {

// dispatch.cu: send the tokens to their experts' ranks, receive and pack them.
struct DispatchArgs {
    const uint16_t* __restrict__ x;  // [N, H] bf16 bits
    const int64_t* __restrict__ topk_idx;  // [N, K]
    int num_tokens;
    int max_tokens;
    int num_experts;
    int num_ranks;
    int rank;
    uint32_t* sym_tags;  // [E]
    uint64_t* sym_arrivals;  // [E]
    uint32_t* sym_receipts;  // [R] (receipts.cuh)
    uint32_t* sym_sent;  // [1] sources done sending the call (receipts.cuh: count_send)
    int* sym_src_idx;  // [E][T]
    uint8_t* sym_recv;  // [E][T] slots of 2H bytes
    const uint8_t* sym_stage;  // [T] staged messages (RMA path)
    uint32_t* seq_state;  // [8] sequences, readers, -, send / receive blocks done, [7] count_send
    uint64_t* arrival_base;  // [E] local
    int* mask;  // [R]
    uint8_t* out_x;  // [E_local, R*T, H or 2H bytes]
    float* out_scales;  // [E_local, H/128, R*T]
    int* out_scales_ue8m0;  // [E_local, ceil(H/512), R*T]
    int* out_count;  // [E_local]
    int* out_src_info;  // [E_local, R*T]
    int* out_row_map;  // [R*T, E_local] or null (indexing.cuh: record_row)
    int64_t* out_layout_range;  // [E_local, R]
    int* cumulative_recv_stats;  // [E_local] or null
    int64_t* wait_recv_cost_stats;  // [R] or null
    int phases;
    int staged;
    int force_rma;
    int rank_msgs;
    int round_scale;
    int use_ue8m0;
    int shrink;
    int count_sends;  // 1: the send counts itself in each destination's sym_sent, the receive clears its own
    long long timeout_ns;
    ErrorRecord* err;
};

// dispatch.cu, RMA path only: cast (or copy) every token once into the staging area.
struct StageArgs {
    const uint16_t* __restrict__ x;
    int num_tokens;
    uint8_t* sym_stage;
    int round_scale;
};

// combine.cu: send the expert outputs back, reduce them per token.
struct CombineArgs {
    const uint16_t* x;  // [E_local, R*T, H] bf16 (the send area with zero-copy)
    const int* __restrict__ src_info;  // [E_local, R*T]
    const int64_t* __restrict__ layout_range;  // [E_local, R]
    const int* __restrict__ row_map;  // [R*T, E_local] from the dispatch, or null (kPartials)
    const int64_t* __restrict__ topk_idx;  // [N, K]
    const float* __restrict__ topk_weights;  // [N, K]
    int num_tokens;
    int max_tokens;
    int num_experts;
    int num_ranks;
    int rank;
    uint32_t* sym_tags;  // [E]
    uint64_t* sym_arrivals;  // [E]
    uint32_t* sym_receipts;  // [R] (receipts.cuh)
    uint32_t* sym_sent;  // [1] sources done sending the call (receipts.cuh: count_send)
    uint32_t* sym_done;  // kPartials: [R][grid] block completion words (src_idx region)
    uint8_t* sym_recv;  // [E][T] slots of 2H bytes
    uint8_t* sym_send;  // [E_local][R*T] rows of 2H bytes
    uint32_t* seq_state;  // [8]: [0..3] sequences, [4] send blocks done, [6] receive blocks done, [7] count_send
    uint64_t* arrival_base;  // [E] local
    uint32_t* ready;  // [E] local
    int* mask;  // [R]
    uint16_t* out;  // [N, H] bf16 bits
    int64_t* wait_recv_cost_stats;  // [R] or null
    int phases;
    int zero_copy;
    int force_rma;
    int shrink;
    int count_sends;  // as in DispatchArgs
    long long timeout_ns;
    ErrorRecord* err;
};

}  // namespace deepep_cupy::low_latency

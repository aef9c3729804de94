// The parameter structs of the internode kernels: each kernel takes its struct by value as its only
// parameter. The host reads these declarations (deepep_cupy/ops/headers.py) to pack the same bytes, so
// each field is declared here only: one field per declaration, a pointer or int / long long /
// unsigned long long / float. "Entry k" is entry k of the 10-entry handle (deepep_cupy/reference/internode.py).
#pragma once

#include "common/nvrtc_compat.cuh"
#include "common/timeout.cuh"

namespace deepep_cupy::internode {

// notify.cu: token counts across domains.
struct NotifyArgs {
    const bool* __restrict__ is_token_in_rank;  // [N, R]
    int num_tokens;
    int num_channels;
    const int* __restrict__ num_tokens_per_expert;
    int num_local_experts;
    int expert_alignment;
    int* __restrict__ rdma_channel_prefix_matrix;  // out: entry 1 [D, C]
    int* __restrict__ gbl_channel_prefix_matrix;   // out: entry 2 [R, C]
    int* __restrict__ recv_rdma_rank_prefix_sum;   // out: entry 4 [D]
    int* __restrict__ recv_gbl_rank_prefix_sum;    // out: entry 6 [R]
    int* __restrict__ meta;  // out: rows received, rows arriving over RDMA, aligned count per local expert
    uint8_t* sig;            // this rank's signal words (symmetric)
    long long record_offset;
    int record_stride;
    const long long* __restrict__ nvl_bases;  // [L] the domain's NVLink buffers as mapped here
    long long nvl_notify_offset;
    int nvl_record_stride;
    long long* state_words;  // persistent per-rank counters (State in buffer_map.cuh)
    ErrorRecord* err;
    long long timeout_ns;
    int rank;
};

// dispatch.cu: move the rows.
struct DispatchArgs {
    const int4* __restrict__ x;
    const unsigned int* __restrict__ x_scales;
    long long scale_token_stride;
    long long scale_block_stride;
    int num_scales;
    const long long* __restrict__ topk_idx;
    const float* __restrict__ topk_weights;
    int num_topk;
    int num_local_experts;
    const bool* __restrict__ is_token_in_rank;
    int num_tokens;
    int hidden_int4;
    const int* __restrict__ rdma_cpm;          // entry 1 [D, C]
    const int* __restrict__ gbl_cpm;           // entry 2 [R, C]
    const int* __restrict__ recv_rdma_prefix;  // entry 4 [D]
    const int* __restrict__ recv_gbl_prefix;   // entry 6 [R]
    int4* __restrict__ recv_x;
    unsigned int* __restrict__ recv_x_scales;
    long long* __restrict__ recv_topk_idx;
    float* __restrict__ recv_topk_weights;
    int* __restrict__ recv_rdma_cpm;   // entry 3 out
    int* __restrict__ recv_gbl_cpm;    // entry 5 out
    int* __restrict__ recv_src_meta;   // entry 7 out [rows][2]
    int* __restrict__ send_rdma_head;  // entry 8 out [N, D]
    int* __restrict__ send_nvl_head;   // entry 9 out [F, L]
    int num_out_rows;       // rows of recv_x (and the row outputs)
    int num_nvl_head_rows;  // rows of send_nvl_head
    uint8_t* rdma;          // this rank's RDMA buffer (symmetric)
    long long ring_offset;
    int slot_bytes;
    int slot_scales_offset;
    int slot_topk_idx_offset;
    int slot_topk_weights_offset;
    int rdma_cap;
    int rdma_chunk;
    uint8_t* sig;
    const long long* __restrict__ nvl_bases;
    long long nvl_meta_offset;
    long long nvl_ring_offset;
    int nvl_cap;
    int num_channels;
    long long* state;
    ErrorRecord* err;
    long long timeout_ns;
    int rank;
    int force_rma;        // 1: NVSHMEM puts and signals even to peers reachable by stores (tests the network path)
    int own_rows_copied;  // L == 1: the copy engines copy the own domain's rows (ops/own_rows.py); send_own skips them
    // L > 1 with an output pool (ops/internode/engine.py): the domain ranks' pools as mapped here, indexed by
    // local rank (null: no pool, so receivers send no reply and every row goes through the NVLink rings).
    const long long* __restrict__ pool_bases;
    int outputs_in_pool;  // this rank's outputs of this call lie in its pool: forwarders write them in place
    long long nvl_reply_offset;
};

// combine.cu: the reverse path.
struct CombineArgs {
    const int4* __restrict__ x;
    const float* __restrict__ topk_weights;
    int num_topk;
    const int4* __restrict__ bias_0;
    const int4* __restrict__ bias_1;
    const int* __restrict__ recv_rdma_cpm;     // entry 3 [D, C], inclusive
    const int* __restrict__ recv_rdma_prefix;  // entry 4 [D]
    const int* __restrict__ recv_gbl_cpm;      // entry 5 [R, C], row where (source, channel) starts
    const int* __restrict__ recv_gbl_prefix;   // entry 6 [R]
    const int* __restrict__ send_rdma_head;    // entry 8 [N, D]
    const int* __restrict__ send_nvl_head;     // entry 9 [F, L]
    int num_tokens;
    int hidden_int4;
    int4* __restrict__ combined_x;
    float* __restrict__ combined_topk_weights;
    uint8_t* rdma;
    long long ring_offset;
    int slot_bytes;
    int slot_topk_weights_offset;
    int rdma_cap;
    int rdma_chunk;
    uint8_t* sig;
    const long long* __restrict__ nvl_bases;
    long long nvl_ring_offset;
    int nvl_cap;
    int num_channels;
    long long* state;
    ErrorRecord* err;
    long long timeout_ns;
    int rank;
    int force_rma;  // 1: NVSHMEM puts and signals even to peers reachable by stores
};

}  // namespace deepep_cupy::internode

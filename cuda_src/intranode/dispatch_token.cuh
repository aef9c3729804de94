// One token of the intranode dispatch: the kernel arguments both dispatch modes read, a token's scales and
// top-k entries, and the warp that copies a token into one rank's outputs (cuda_src/intranode/dispatch.cu).
#pragma once

#include "common/nvrtc_compat.cuh"
#include "common/value_errors.cuh"
#include "intranode/args.cuh"
#include "intranode/copies.cuh"

namespace deepep_cupy::intranode {

// What both dispatch modes read: the kernel's arguments (args.cuh) and what the kernel works out at its start.
// The arguments are read where the launch put them (the kernel's __grid_constant__ parameter): a copy of the
// whole struct would live in local memory and crowd out the registers the copies need.
struct DispatchCtx {
    const DispatchArgs& args;
    int batch;      // tokens per publish: clamp_batch(publish_batch, cap)
    uint64_t seq;   // this kernel's sequence number (begin_kernel)
    int num_recv;   // rows this rank receives (the last row of rank_prefix_matrix)
};

// ---- a token's scales and top-k entries ------------------------------------------------------------
//
// Everything a token carries besides its row is loaded into registers *before* the row is copied, so that
// these loads are in flight together with the row's instead of following it one dependent round trip at a
// time. That matters most for column-major FP8 scales (token stride 1): the scales of one token then lie
// in num_scales different 128-byte lines. Lane l holds scale blocks l + 32 j (j < kScaleRegs, i.e. hidden
// up to 8192 for FP8) and top-k entry l; anything beyond that (larger hidden, top-k above 32) is still
// loaded where it is stored.
constexpr int kScaleRegs = 2;

struct TokenAux {
    uint32_t scale[kScaleRegs];
    long long expert;  // lane l < num_topk: expert id l of the token (-1 otherwise)
    float weight;      // its weight (0 without weights)
};

__device__ __forceinline__ const unsigned int* token_scales(const DispatchCtx& a, int token) {
    return a.args.x_scales + token * a.args.scale_token_stride;
}

// Sender side: from the user's inputs (read-only for the whole kernel). `with_topk`: load the top-k pair.
__device__ __forceinline__ TokenAux load_aux(const DispatchCtx& a, int token, bool with_topk, int lane) {
    TokenAux t;
    const unsigned int* sc = token_scales(a, token);
#pragma unroll
    for (int j = 0; j < kScaleRegs; ++j) {
        const int s = lane + 32 * j;
        t.scale[j] = s < a.args.num_scales ? __ldg(sc + s * a.args.scale_block_stride) : 0u;
    }
    t.expert = -1;
    t.weight = 0.0f;
    if (with_topk && lane < a.args.num_topk) {
        const long long k = static_cast<long long>(token) * a.args.num_topk + lane;
        t.expert = __ldg(a.args.topk_idx + k);
        if (a.args.topk_weights != nullptr) t.weight = __ldg(a.args.topk_weights + k);
    }
    return t;
}

__device__ __forceinline__ void store_scales(unsigned int* dst, const DispatchCtx& a, int token, const TokenAux& t,
                                             int lane) {
#pragma unroll
    for (int j = 0; j < kScaleRegs; ++j)
        if (lane + 32 * j < a.args.num_scales) dst[lane + 32 * j] = t.scale[j];
    const unsigned int* sc = token_scales(a, token);
    for (int s = lane + 32 * kScaleRegs; s < a.args.num_scales; s += 32) dst[s] = __ldg(sc + s * a.args.scale_block_stride);
}

// Calls put(j, expert id, weight) for every top-k entry of the token, lane j % 32 doing entry j.
template <typename Put>
__device__ __forceinline__ void for_each_topk(const DispatchCtx& a, int token, const TokenAux& t, int lane, Put put) {
    if (lane < a.args.num_topk) put(lane, t.expert, t.weight);
    for (int j = lane + 32; j < a.args.num_topk; j += 32) {
        const long long k = static_cast<long long>(token) * a.args.num_topk + j;
        put(j, __ldg(a.args.topk_idx + k), a.args.topk_weights != nullptr ? __ldg(a.args.topk_weights + k) : 0.0f);
    }
}

// Asks L2 for the scales of tokens [t0, t1) (at most 32), a chunk ahead of their loads, so that the
// first warp to load them does not wait for DRAM. Column-major: one run of 4 * (t1 - t0) bytes per scale
// block (its first and last element cover it); row-major: one contiguous run. Other layouts: nothing.
__device__ __forceinline__ void prefetch_scales(const DispatchCtx& a, int t0, int t1, int lane) {
    if (a.args.num_scales == 0 || t0 >= t1) return;
    const unsigned int* first = token_scales(a, t0);
    if (a.args.scale_token_stride == 1) {
        for (int s = lane; s < a.args.num_scales; s += 32) {
            prefetch_l2(first + s * a.args.scale_block_stride);
            prefetch_l2(first + s * a.args.scale_block_stride + (t1 - t0 - 1));
        }
    } else if (a.args.scale_block_stride == 1) {
        // From the 128-byte line of the first element to that of the last one.
        const uintptr_t begin = reinterpret_cast<uintptr_t>(first);
        const uintptr_t end = reinterpret_cast<uintptr_t>(first + (t1 - t0 - 1) * a.args.scale_token_stride + a.args.num_scales);
        for (uintptr_t p = (begin & ~uintptr_t{127}) + 128u * lane; p < end; p += 32u * 128u)
            prefetch_l2(reinterpret_cast<const void*>(p));
    }
}

// One rank's outputs of a dispatch (a peer's, in direct mode, as mapped here).
struct DestRows {
    int4* x;
    unsigned int* scales;
    long long* topk_idx;  // nullptr: no top-k outputs (cached mode)
    float* topk_weights;
    int* src_idx;
    int num_rows;
};

// What `token` carries besides its row, into row `row` of rank dst's outputs: scales, top-k ids made local to dst
// (-1 for another rank's experts, weight 0) and the source index. Bad ids are noted in `bad`.
template <int kNumRanks>
__device__ __forceinline__ void store_extras(const DispatchCtx& a, int token, const TokenAux& aux, const DestRows& d,
                                             int dst, int row, BadValue& bad, int lane) {
    store_scales(d.scales + static_cast<long long>(row) * a.args.num_scales, a, token, aux, lane);
    if (d.topk_idx != nullptr) {
        const long long num_experts = static_cast<long long>(kNumRanks) * a.args.num_local_experts;
        for_each_topk(a, token, aux, lane, [&](int j, long long e, float w) {
            bad.check_expert_id(e, num_experts);
            const long long local = e - static_cast<long long>(dst) * a.args.num_local_experts;
            const bool mine = e >= 0 && local >= 0 && local < a.args.num_local_experts;
            d.topk_idx[static_cast<long long>(row) * a.args.num_topk + j] = mine ? local : -1;
            if (d.topk_weights != nullptr) d.topk_weights[static_cast<long long>(row) * a.args.num_topk + j] = mine ? w : 0.0f;
        });
    }
    if (lane == 0 && d.src_idx != nullptr) d.src_idx[row] = token;
}

// Copies `token` into row `row` of rank dst's outputs: its row and store_extras. An own token's row is left out
// when the host copies the own rows with the copy engines (a.args.own_rows_copied), in either mode.
template <int kNumRanks, int kUnroll>
__device__ __forceinline__ void copy_token(const DispatchCtx& a, int token, const DestRows& d, int dst, int row,
                                           BadValue& bad, int lane) {
    const TokenAux aux = load_aux(a, token, d.topk_idx != nullptr, lane);
    if (dst != a.args.rank || !a.args.own_rows_copied)
        warp_copy_nc<kUnroll>(d.x + static_cast<long long>(row) * a.args.hidden_int4,
                              a.args.x + static_cast<long long>(token) * a.args.hidden_int4, a.args.hidden_int4, lane);
    store_extras<kNumRanks>(a, token, aux, d, dst, row, bad, lane);
}

// Bits of the tokens of [chunk, chunk + 32) (clipped at end) that go to rank dst.
template <int kNumRanks>
__device__ __forceinline__ unsigned int chunk_mask(const DispatchCtx& a, int chunk, int end, int dst, int lane) {
    const int t = chunk + lane;
    return __ballot_sync(kFullMask, t < end && a.args.is_token_in_rank[static_cast<long long>(t) * kNumRanks + dst]);
}

// Position of the n-th (from 0) set bit of mask.
__device__ __forceinline__ int nth_set_bit(unsigned int mask, int n) {
    for (int i = 0; i < n; ++i) mask &= mask - 1u;
    return __ffs(mask) - 1;
}

}  // namespace deepep_cupy::intranode

// The summation of the intranode combine, shared by its ring mode (combine.cu) and its copy mode
// (combine_copy.cu): one token's rows, one per rank that received the token, summed in float32 in rank
// order (or V2's, order_by_last_slot) after the biases (acc = bias_0 + bias_1, a missing bias being +0:
// the reference's exact order)
// and rounded to bf16 (nearest even) once. The same for the top-k weights, without bias.
#pragma once

#include "common/bf16.cuh"
#include "common/nvrtc_compat.cuh"
#include "common/ptx.cuh"

namespace deepep_cupy::intranode {

__device__ __forceinline__ void load_bf16x8(float (&out)[8], const int4& v) {
    const unsigned int w[4] = {static_cast<unsigned int>(v.x), static_cast<unsigned int>(v.y),
                               static_cast<unsigned int>(v.z), static_cast<unsigned int>(v.w)};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        out[2 * k] = bf16_lo(w[k]);
        out[2 * k + 1] = bf16_hi(w[k]);
    }
}

template <bool kStaged>
__device__ __forceinline__ int4 row_load(const int4* p) {
    if constexpr (kStaged) return ld_na_v4(p);
    return ld_cg_v4(p);
}

// acc = bias_0 + bias_1 at word j of the output row, a missing bias being +0 (the reference's exact float32
// order); zeros without biases.
__device__ __forceinline__ void bias_acc(float (&acc)[8], const int4* __restrict__ bias_0, const int4* __restrict__ bias_1,
                                         long long j) {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
    if (bias_0 == nullptr && bias_1 == nullptr) return;
    float b[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) b[e] = 0.0f;
    if (bias_0 != nullptr) load_bf16x8(acc, ld_nc_v4(bias_0 + j));
    if (bias_1 != nullptr) load_bf16x8(b, ld_nc_v4(bias_1 + j));
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = acc[e] + b[e];
}

// One step of sum_token: words j, j + 32, ..., j + 32 * (kUnroll - 1) of the row. kChecked: the row's last,
// partial step (words past hidden_int4 are neither loaded nor stored); the full steps test nothing, as the
// few-SM combine is bound by instruction issue.
template <int R, int kUnroll, bool kStaged, bool kChecked, bool kLoadsFirst>
__device__ __forceinline__ void sum_step(const int4* const (&rows)[R], const int4* __restrict__ bias_0,
                                         const int4* __restrict__ bias_1, long long out_row, int j, int hidden_int4,
                                         int4* __restrict__ combined_x) {
    if constexpr (kLoadsFirst) {
        // Every rank's loads of the step are issued before any is summed (more bytes in flight), and one
        // accumulator of 8 floats is live at a time.
        int4 v[R][kUnroll];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (rows[r] == nullptr) continue;
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (!kChecked || j + u * 32 < hidden_int4) v[r][u] = row_load<kStaged>(rows[r] + j + u * 32);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int k = j + u * 32;
            if (kChecked && k >= hidden_int4) continue;
            float acc[8];
            bias_acc(acc, bias_0, bias_1, out_row + k);
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (rows[r] != nullptr) add_bf16x8(acc, v[r][u]);
            st_na_v4(combined_x + out_row + k, pack_bf16x8(acc));
        }
    } else {
        // One rank's loads at a time, an accumulator per load (fewer registers with many ranks).
        float acc[kUnroll][8];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (!kChecked || j + u * 32 < hidden_int4) bias_acc(acc[u], bias_0, bias_1, out_row + j + u * 32);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (rows[r] == nullptr) continue;
            int4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (!kChecked || j + u * 32 < hidden_int4) v[u] = row_load<kStaged>(rows[r] + j + u * 32);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (!kChecked || j + u * 32 < hidden_int4) add_bf16x8(acc[u], v[u]);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (!kChecked || j + u * 32 < hidden_int4) st_na_v4(combined_x + out_row + j + u * 32, pack_bf16x8(acc[u]));
    }
}

// Row of token t: rows[r] is rank r's row (nullptr: rank r did not get the token). Every row is read from L2
// (peers or copies wrote the peers' rows; this rank's own row, in x, is read once as well), kStaged: rows the
// copy engines wrote before a flag the caller acquired, read with 256-byte L2 requests. Lane-strided 16-byte
// words, kUnroll a lane a step; kLoadsFirst: a step loads every rank's words before adding any (R * kUnroll
// words a lane live at once), else one rank's at a time.
template <int R, int kUnroll, bool kStaged = false, bool kLoadsFirst = (R <= 2)>
__device__ __forceinline__ void sum_token(const int4* const (&rows)[R], const int4* __restrict__ bias_0,
                                          const int4* __restrict__ bias_1, long long out_row, int hidden_int4,
                                          int4* __restrict__ combined_x, int lane) {
    const int full = hidden_int4 - hidden_int4 % (32 * kUnroll);
    for (int base = 0; base < full; base += 32 * kUnroll)
        sum_step<R, kUnroll, kStaged, false, kLoadsFirst>(rows, bias_0, bias_1, out_row, base + lane, hidden_int4,
                                                           combined_x);
    if (full < hidden_int4)
        sum_step<R, kUnroll, kStaged, true, kLoadsFirst>(rows, bias_0, bias_1, out_row, full + lane, hidden_int4,
                                                          combined_x);
}

// V2's order for one token (EPBuffer.combine): each rank's row stands at the last top-k slot of the token
// that names one of the rank's experts, and the rows are summed in slot order (after the biases, as in rank
// order). ordered[] gets rows[] so arranged; a rank with no slot of the token (its row nullptr, unless the
// caller's top-k disagrees with the handle) goes after every slot, in rank order. Each slot names one rank,
// so the keys differ and the order is a permutation; all of it stays in registers (R is a constant).
template <int R>
__device__ __forceinline__ void order_by_last_slot(const int4* const (&rows)[R], const int4* (&ordered)[R],
                                                   const long long* __restrict__ topk_idx_row, int num_topk,
                                                   int num_local_experts) {
    int key[R];
#pragma unroll
    for (int r = 0; r < R; ++r) key[r] = num_topk + r;
    for (int j = 0; j < num_topk; ++j) {
        const long long e = __ldg(topk_idx_row + j);
        if (e < 0) continue;
        const int owner = static_cast<int>(e / num_local_experts);
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (owner == r) key[r] = j;
    }
#pragma unroll
    for (int p = 0; p < R; ++p) ordered[p] = nullptr;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        int pos = 0;
#pragma unroll
        for (int q = 0; q < R; ++q) pos += key[q] < key[r] ? 1 : 0;
#pragma unroll
        for (int p = 0; p < R; ++p)
            if (pos == p) ordered[p] = rows[r];
    }
}

// Top-k weights of one token: w[r] is rank r's weights row (nullptr: none).
template <int R>
__device__ __forceinline__ void sum_weights(const float* const (&w)[R], int self_rank, int num_topk,
                                            float* __restrict__ out, int lane) {
    for (int j = lane; j < num_topk; j += 32) {
        float acc = 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (w[r] == nullptr) continue;
            acc += r == self_rank ? w[r][j] : ld_cg_f32(w[r] + j);
        }
        out[j] = acc;
    }
}

}  // namespace deepep_cupy::intranode

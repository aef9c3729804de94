// The sums of the internode combine (combine.cu): a token's partial rows, summed in float32 in order after
// the biases and rounded to bf16 once, by one warp; used by the reducer and by the forwarders of domains of
// more than one rank.
#pragma once

#include "common/bf16.cuh"
#include "common/nvrtc_compat.cuh"
#include "common/ptx.cuh"

namespace deepep_cupy::internode {

// dst = one rounding of (the N rows of src that are not null), in order, over `n` int4 of bf16. A warp sums a
// token's rows alone, so the time of a token is its round trips: each lane issues its U loads of every row
// (fewer in the last step) before adding any (N * U * 4 registers) instead of loading and adding a row at a
// time. U by rows and by the registers a thread has (kRegisters, combine_registers): up to 2 rows 7 with 128
// registers, 4 with 64 or 80 (7 spills at 80 and was no faster), else 2; up to 4 rows 2 (1 below 80); else 1.
template <int N, int kRegisters>
__device__ __forceinline__ void warp_sum_rows_no_bias(int4* dst, const int4* const (&src)[N], int n, int lane) {
    constexpr int U = N <= 2   ? (kRegisters >= 128 ? 7 : kRegisters >= 64 ? 4 : 2)
                     : N <= 4 ? (kRegisters >= 80 ? 2 : 1)
                              : 1;
    // A missing row is loaded again from a present one (from dst where none is: valid memory, written below) and
    // not added: no branch among the loads, and no load from a peer's memory for nothing.
    const int4* any = dst;
#pragma unroll
    for (int j = N - 1; j >= 0; --j) any = src[j] != nullptr ? src[j] : any;
    const int4* from[N];
    bool has[N];
#pragma unroll
    for (int j = 0; j < N; ++j) has[j] = src[j] != nullptr, from[j] = has[j] ? src[j] : any;
    // The last step loads only what is left, but all of it at once: a row takes ceil(n / (32 U)) round trips.
    for (int e = lane; e < n; e += U * 32) {
        int4 v[N][U];
#pragma unroll
        for (int j = 0; j < N; ++j)
#pragma unroll
            for (int u = 0; u < U; ++u) v[j][u] = ld_cg_v4(from[j] + min(e + u * 32, n - 1));  // past n: unused
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (e + u * 32 >= n) break;
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int j = 0; j < N; ++j)
                if (has[j]) add_bf16x8(acc, v[j][u]);
            dst[e + u * 32] = pack_bf16x8(acc);
        }
    }
}

// The same with the biases first: bias_0 + bias_1 + the rows, one rounding. Biases are rare, so this keeps
// fewer loads in flight (U per row, sums as they arrive) and its registers to itself.
template <int N, int kRegisters>
__device__ __forceinline__ void warp_sum_rows(int4* dst, const int4* const (&src)[N], const int4* bias_0,
                                              const int4* bias_1, int n, int lane) {
    if (bias_0 == nullptr && bias_1 == nullptr) return warp_sum_rows_no_bias<N, kRegisters>(dst, src, n, lane);
    constexpr int U = N >= 4 ? 2 : 4;
    int e = lane;
    for (; e + (U - 1) * 32 < n; e += U * 32) {
        float acc[U][8];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[u][q] = 0.f;
        if (bias_0 != nullptr) {
#pragma unroll
            for (int u = 0; u < U; ++u) add_bf16x8(acc[u], ld_nc_v4(bias_0 + e + u * 32));
        }
        if (bias_1 != nullptr) {
#pragma unroll
            for (int u = 0; u < U; ++u) add_bf16x8(acc[u], ld_nc_v4(bias_1 + e + u * 32));
        }
#pragma unroll
        for (int j = 0; j < N; ++j) {
            if (src[j] == nullptr) continue;
            int4 v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) v[u] = ld_cg_v4(src[j] + e + u * 32);
#pragma unroll
            for (int u = 0; u < U; ++u) add_bf16x8(acc[u], v[u]);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) dst[e + u * 32] = pack_bf16x8(acc[u]);
    }
    for (; e < n; e += 32) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (bias_0 != nullptr) add_bf16x8(acc, ld_nc_v4(bias_0 + e));
        if (bias_1 != nullptr) add_bf16x8(acc, ld_nc_v4(bias_1 + e));
#pragma unroll
        for (int j = 0; j < N; ++j)
            if (src[j] != nullptr) add_bf16x8(acc, ld_cg_v4(src[j] + e));
        dst[e] = pack_bf16x8(acc);
    }
}

}  // namespace deepep_cupy::internode

// Shared helpers of the intranode kernels for moving rows: warp copy loops that keep several int4 loads a
// lane in flight, and the split of the work (a channel's tokens, a channel's start in a prefix matrix,
// warps into groups).
#pragma once

#include "common/nvrtc_compat.cuh"
#include "common/ptx.cuh"

namespace deepep_cupy::intranode {

// ---- copies and work split ---------------------------------------------------------------------

// A warp copy of n int4 in rounds: kUnroll loads per lane (load(j) for int4 j) issued before the round's stores
// (store(base, v), v[u] being int4 base + 32 u + lane when below n), so a warp keeps 32 * kUnroll * 16 bytes in
// flight. The stores go to one place (store_round) or to several (a token fanned out to its ranks).
template <int kUnroll, class Load, class Store>
__device__ __forceinline__ void warp_copy_rounds(int n, int lane, Load&& load, Store&& store) {
    for (int base = 0; base < n; base += 32 * kUnroll) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int j = base + u * 32 + lane;
            if (j < n) v[u] = load(j);
        }
        store(base, v);
    }
}

// The stores of one round of warp_copy_rounds into dst.
template <int kUnroll>
__device__ __forceinline__ void store_round(int4* __restrict__ dst, int base, int n, const int4 (&v)[kUnroll],
                                            int lane) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int j = base + u * 32 + lane;
        if (j < n) st_na_v4(dst + j, v[u]);
    }
}

// Warp copy of n int4 from memory that does not change during the kernel (user inputs) to dst.
template <int kUnroll>
__device__ __forceinline__ void warp_copy_nc(int4* __restrict__ dst, const int4* __restrict__ src, int n, int lane) {
    warp_copy_rounds<kUnroll>(n, lane, [&](int j) { return ld_nc_v4(src + j); },
                              [&](int base, const int4 (&v)[kUnroll]) { store_round<kUnroll>(dst, base, n, v, lane); });
}

// Same, reading a ring slot (coherent L2 loads).
template <int kUnroll>
__device__ __forceinline__ void warp_copy_ring(int4* __restrict__ dst, const int4* __restrict__ src, int n, int lane) {
    warp_copy_rounds<kUnroll>(n, lane, [&](int j) { return ld_cg_v4(src + j); },
                              [&](int base, const int4 (&v)[kUnroll]) { store_round<kUnroll>(dst, base, n, v, lane); });
}

// Token range [begin, end) of channel c: contiguous ranges of ceil(N / C) tokens.
__device__ __forceinline__ void channel_range(int num_tokens, int num_channels, int c, int& begin, int& end) {
    const int per = (num_tokens + num_channels - 1) / num_channels;
    begin = min(per * c, num_tokens);
    end = min(begin + per, num_tokens);
}

// Where channel c of row `row` starts in an inclusive channel prefix matrix [rows, C]: the entry before it, 0
// for the first channel.
__device__ __forceinline__ int channel_start(const int* matrix, int row, int C, int c) {
    return c > 0 ? matrix[row * C + c - 1] : 0;
}

// Split `num_warps` warps into `groups` groups as evenly as possible; returns the group of `warp` and its
// index/size within the group.
__device__ __forceinline__ void split_warps(int warp, int num_warps, int groups, int& group, int& index, int& size) {
    const int base = num_warps / groups, extra = num_warps % groups;
    // The first `extra` groups get base + 1 warps.
    const int big = extra * (base + 1);
    if (warp < big) {
        group = warp / (base + 1);
        index = warp % (base + 1);
        size = base + 1;
    } else {
        group = extra + (warp - big) / base;
        index = (warp - big) % base;
        size = base;
    }
}

}  // namespace deepep_cupy::intranode

// Shared helpers of the internode normal kernels for moving rows: warp copies of int4 with many loads a lane
// in flight, and the split of the work (which block of an SM pair runs which side, where a channel's or a
// rank's rows start; a channel's tokens as in the intranode kernels, intranode/copies.cuh).
#pragma once

#include "common/nvrtc_compat.cuh"
#include "common/ptx.cuh"
#include "intranode/copies.cuh"

namespace deepep_cupy::internode {

using intranode::channel_range;
using intranode::channel_start;  // of entries 1, 2 and 3

// Which block of an SM pair runs the sending side of channel `sub` of the pair's S (dispatch: the RDMA
// senders; combine: with L == 1 the forwarders, with more the NVLink senders and the reducers), the other
// block its receiving side: alternating by channel, so that each SM carries both sides' bytes instead of one
// SM of the pair waiting for the other (docs/design/internode_measurements.md, "Sides alternating by channel").
__device__ __forceinline__ bool sends_here(int sub) { return ((blockIdx.x ^ static_cast<unsigned>(sub)) & 1) == 0; }

// Warp copies of `n` int4. Each lane keeps kCopyUnroll loads in flight before it stores: one load at a time
// leaves a warp latency-bound at about 1 GB/s, far below what one warp can move. A short last batch loads its
// missing words from the last one (clamped addresses, stored nowhere) instead of looping one word at a time or
// predicating loads (which spills at 80 registers): a BF16 row of 7168 is then two batches a lane, not 13
// round trips, and an FP8 row one.
constexpr int kCopyUnroll = 16;

// The dispatch's loads a lane in flight by its block's warps: in 1024-thread blocks a thread has 64 registers,
// which sixteen int4 would fill alone, so 14 there (a row of 7168 is still two batches in BF16 and one in FP8,
// and the copies spill less); 8 measured slower, and the combine's one-row copy keeps 16
// (docs/design/internode_measurements.md).
constexpr int dispatch_copy_unroll(int warps) { return warps >= 32 ? 14 : kCopyUnroll; }

template <bool kL2Only, int U>
__device__ __forceinline__ void warp_copy(int4* __restrict__ dst, const int4* __restrict__ src, int n, int lane) {
    for (int j = lane; j < n; j += U * 32) {
        int4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = min(j + u * 32, n - 1);  // past the end: reload the last word (not stored)
            v[u] = kL2Only ? ld_cg_v4(src + k) : ld_nc_v4(src + k);
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (j + u * 32 < n) st_na_v4(dst + j + u * 32, v[u]);
    }
}

// `src` may be rewritten by peers later (a ring slot), so loads go to L2 only.
template <int U = kCopyUnroll>
__device__ __forceinline__ void warp_copy_cg(int4* __restrict__ dst, const int4* __restrict__ src, int n, int lane) {
    warp_copy<true, U>(dst, src, n, lane);
}

// `src` is read-only for the whole kernel (the caller's tokens).
template <int U = kCopyUnroll>
__device__ __forceinline__ void warp_copy_nc(int4* __restrict__ dst, const int4* __restrict__ src, int n, int lane) {
    warp_copy<false, U>(dst, src, n, lane);
}

// The sum of an inclusive prefix's entries before entry k: where k's rows start among those it counts (a rank's
// or domain's first row in entry 4 or 6).
__device__ __forceinline__ int prefix_before(const int* inclusive, int k) { return k > 0 ? inclusive[k - 1] : 0; }

}  // namespace deepep_cupy::internode

// Shared helpers of the low-latency kernels for placing work and rows: where a thread sits in a launch, which
// items a warp takes, the segment of a prefix that holds an item, the order of the source groups in a
// receiver's slabs, the record of a received row, and warp and block prefix sums.
#pragma once

#include "common/nvrtc_compat.cuh"
#include "common/ptx.cuh"

namespace deepep_cupy::low_latency {

// Where a thread sits in a dispatch or combine launch: each block holds kGroups groups of kWarps warps,
// and a group (not a block) is the unit of work, with its own named barrier.
template <int kWarps, int kGroups>
struct GroupCoords {
    static constexpr int kGroupThreads = kWarps * 32;
    int warp_in_block, lane, group, warp, gthread, barrier_id, total_groups, gid;

    __device__ __forceinline__ GroupCoords()
        : warp_in_block(static_cast<int>(threadIdx.x) / 32),
          lane(lane_id()),
          group(warp_in_block / kWarps),
          warp(warp_in_block % kWarps),
          gthread(static_cast<int>(threadIdx.x) - group * kGroupThreads),
          barrier_id(1 + group),
          total_groups(static_cast<int>(gridDim.x) * kGroups),
          gid(static_cast<int>(blockIdx.x) * kGroups + group) {}
};

// The first item of this warp when the grid's warps take items warp_in_block * gridDim.x + block, + all
// warps: consecutive items go to different blocks, so a short list (fewer items than warps) still keeps
// the load/store units of every SM busy instead of filling the first few SMs.
__device__ __forceinline__ int first_grid_item() {
    return static_cast<int>(threadIdx.x / 32 * gridDim.x + blockIdx.x);
}

// The segment of a non-decreasing prefix (s_prefix[0] <= g) that holds item g: the last u in [0, n] with
// s_prefix[u] <= g (empty segments share their prefix with the next one, so this skips them).
__device__ __forceinline__ int prefix_segment(const int* s_prefix, int n, int g) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (s_prefix[mid] <= g) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// The order of the source groups in a receiver's expert slabs: the receiver's own group first, then the
// other ranks cyclically, so a sender knows where its rows start in its own slabs (row 0) before any
// count arrives. source_position: the group's place; source_at: the source at a place.
__device__ __forceinline__ int source_position(int src, int rank, int num_ranks) {
    return src >= rank ? src - rank : src - rank + num_ranks;
}
__device__ __forceinline__ int source_at(int position, int rank, int num_ranks) {
    return rank + position < num_ranks ? rank + position : rank + position - num_ranks;
}

// The dispatch's record of a received row: its source token, in the handle's source info, and where
// row_map is given, the inverse, row_map[(source * T + token) * E_local + local expert] = row, which the
// partial-sum combine reads instead of rebuilding it from the source info (combine_partials_send.cuh).
__device__ __forceinline__ void record_row(int* out_src_info, int* out_row_map, int le, int row, int src, int t,
                                           int max_tokens, int num_ranks, int num_local) {
    out_src_info[static_cast<size_t>(le) * num_ranks * max_tokens + row] = t;
    if (out_row_map != nullptr && t >= 0 && t < max_tokens)
        out_row_map[(static_cast<size_t>(src) * max_tokens + t) * num_local + le] = row;
}

// The sum of the lanes' values (the same in every lane).
__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
    return v;
}

// Exclusive prefix, in thread order, of every thread's `value` over the block (s_warp_sum: one word per
// warp). Every thread of the block calls it (it holds a block barrier).
__device__ __forceinline__ int block_exclusive_prefix(int value, int* s_warp_sum) {
    const int lane = lane_id(), warp = static_cast<int>(threadIdx.x) / 32;
    int incl = value;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(kFullMask, incl, o);
        if (lane >= o) incl += n;
    }
    if (lane == 31) s_warp_sum[warp] = incl;
    __syncthreads();
    int run = incl - value;
    for (int w = 0; w < warp; ++w) run += s_warp_sum[w];
    return run;
}

// In-place exclusive prefix sum of s_vals[0 .. n) with the total in s_vals[n] (s_vals holds n + 1 ints):
// each thread sums a contiguous run, then one block scan of the runs. Every thread of the block calls
// it; it starts and ends with a block barrier (callers have just written s_vals).
__device__ __forceinline__ void block_exclusive_scan(int* s_vals, int n, int* s_warp_sum) {
    __syncthreads();
    const int per = (n + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
    const int i0 = min(n, static_cast<int>(threadIdx.x) * per), i1 = min(n, i0 + per);
    int sum = 0;
    for (int i = i0; i < i1; ++i) sum += s_vals[i];
    int run = block_exclusive_prefix(sum, s_warp_sum);
    for (int i = i0; i < i1; ++i) {
        const int c = s_vals[i];
        s_vals[i] = run;
        run += c;
    }
    if (threadIdx.x == blockDim.x - 1) s_vals[n] = run;
    __syncthreads();
}

}  // namespace deepep_cupy::low_latency

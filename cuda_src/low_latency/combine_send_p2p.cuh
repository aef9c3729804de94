// Low-latency combine, the send phase over stores to every live destination (combine.cu describes the
// protocol): the grid's warps share the (row, 256-channel segment) items of all units evenly over the
// prefix sum of the unit row counts, and the last block to finish publishes every unit's tag.
#pragma once

#include "low_latency/buffer_map.cuh"
#include "low_latency/indexing.cuh"
#include "low_latency/sync.cuh"
#include "low_latency/logfmt.cuh"
#include "low_latency/rows.cuh"

namespace deepep_cupy::low_latency {

// Rows of unit u = le * R + dst that this launch returns: the handle's count, clipped to the slab (a
// corrupt handle must not make us read or write out of bounds), 0 for a masked side.
__device__ __forceinline__ int unit_rows_of(int64_t range, int u, int num_ranks, int max_tokens, bool self_masked,
                                            const int* s_mask) {
    if (self_masked || s_mask[u % num_ranks] != 0) return 0;
    const int slab = num_ranks * max_tokens;
    const int begin = static_cast<int>(range >> 32);
    const int count = static_cast<int>(range & 0xffffffffll);
    return (begin < 0 || begin > slab) ? 0 : max(0, min(count, min(max_tokens, slab - begin)));
}

// s_prefix[u] = rows of the units before u, s_prefix[E] = all rows (E = num_units <= kMaxExperts). Each
// thread sums a contiguous run of units, then one block-wide exclusive scan of the runs. Ends synced.
// range_ahead: layout_range[threadIdx.x], loaded before the prologue (the thread's unit when E <= threads).
template <int kThreads>
__device__ __forceinline__ void unit_prefix(const int64_t* layout_range, int64_t range_ahead, int num_units,
                                            int num_ranks, int max_tokens, bool self_masked, const int* s_mask,
                                            int* s_prefix, int* s_warp_sum) {
    const int per = (num_units + kThreads - 1) / kThreads;
    const int u0 = static_cast<int>(threadIdx.x) * per, u1 = min(num_units, u0 + per);
    int sum = 0;
    for (int u = u0; u < u1; ++u) {
        const int64_t range = u == static_cast<int>(threadIdx.x) ? range_ahead : __ldg(layout_range + u);
        const int c = unit_rows_of(range, u, num_ranks, max_tokens, self_masked, s_mask);
        s_prefix[u] = c;  // the count for now, this thread's own entry
        sum += c;
    }
    int run = block_exclusive_prefix(sum, s_warp_sum);
    for (int u = u0; u < u1; ++u) {
        const int c = s_prefix[u];
        s_prefix[u] = run;
        run += c;
    }
    if (threadIdx.x == kThreads - 1) s_prefix[num_units] = run;
    __syncthreads();
}

// Send over stores to every live destination, the items (row, 256-channel segment) of all units shared
// evenly by the grid's warps; the last block to finish publishes every unit's tag (see the top).
template <int kHidden, bool kLogfmt, int kThreads>
__device__ __forceinline__ void send_p2p(const uint16_t* x, const int* src_info, const int64_t* layout_range,
                                         int64_t range_ahead, int max_tokens, int num_experts, int num_ranks, int rank, bool self_masked,
                                         const int* s_mask, int* s_prefix, int* s_warp_sum, int* s_last,
                                         uint32_t* sym_tags, uint8_t* sym_recv, uint32_t* done_counter,
                                         uint32_t tag) {
    constexpr int kBlockWarps = kThreads / 32;
    constexpr int kSlotBytes = 2 * kHidden;
    constexpr int kSeg = 256;  // channels per item: 16 bytes of BF16 per lane, or two LogFMT blocks
    constexpr int kSegs = (kHidden + kSeg - 1) / kSeg;
    constexpr int kBlocks = kHidden / kChannelsPerBlock;
    // Items one warp has in flight: for copies as many 16-byte loads per lane as fit in the 80 registers
    // of a 768-thread block without spilling (7); the encode is compute-bound and needs registers of
    // its own, so fewer.
    constexpr int kBatch = kLogfmt ? 4 : 7;
    const int lane = lane_id();
    const int num_local = num_experts / num_ranks;
    const int slab = num_ranks * max_tokens;

    unit_prefix<kThreads>(layout_range, range_ahead, num_experts, num_ranks, max_tokens, self_masked, s_mask, s_prefix,
                          s_warp_sum);
    // 64-bit item numbers: rows x segments may pass 2^31 at the largest shapes the buffer map allows.
    const long long total_items = static_cast<long long>(s_prefix[num_experts]) * kSegs;
    const long long total_warps = static_cast<long long>(gridDim.x) * kBlockWarps;
    const long long per_warp = (total_items + total_warps - 1) / total_warps;
    const long long first = (static_cast<long long>(blockIdx.x) * kBlockWarps + threadIdx.x / 32) * per_warp;
    const long long last = min(total_items, first + per_warp);

    if (first < last) {
        // The unit holding the warp's first row. Warp-uniform from here on.
        int u = prefix_segment(s_prefix, num_experts, static_cast<int>(first / kSegs));
        for (long long it = first; it < last; it += kBatch) {
            int4 raw[kBatch];
            uint8_t* slot[kBatch];
#pragma unroll
            for (int j = 0; j < kBatch; ++j) {
                const long long item = it + j;
                slot[j] = nullptr;
                if (item >= last) continue;  // uniform over the warp
                const int g = static_cast<int>(item / kSegs);
                const int col = static_cast<int>(item % kSegs) * kSeg + lane * 8;
                while (s_prefix[u + 1] <= g) ++u;
                const int le = u / num_ranks, dst = u % num_ranks;
                const int row = static_cast<int>(__ldg(layout_range + u) >> 32) + (g - s_prefix[u]);
                const size_t src_row = static_cast<size_t>(le) * slab + row;
                const int t = __ldg(src_info + src_row);
                if (col < kHidden) raw[j] = ld_nc_v4_no_prefetch(x + src_row * kHidden + col);
                else raw[j] = make_int4(0, 0, 0, 0);
                if (t < 0 || t >= max_tokens) continue;  // corrupt handle: skip rather than write out of bounds
                const int e = rank * num_local + le;
                slot[j] = static_cast<uint8_t*>(nvshmem_ptr(sym_recv, dst)) +
                          (static_cast<size_t>(e) * max_tokens + t) * kSlotBytes;
            }
#pragma unroll
            for (int j = 0; j < kBatch; ++j) {
                if (slot[j] == nullptr) continue;  // uniform over the warp
                const int seg = static_cast<int>((it + j) % kSegs);
                if constexpr (kLogfmt) {
                    logfmt_encode_segment(raw[j], min(2, kBlocks - 2 * seg), slot[j] + seg * kLogfmtSegBytes, lane);
                } else {
                    const int col = seg * kSeg + lane * 8;
                    if (col < kHidden) st_na_v4(reinterpret_cast<int4*>(slot[j] + col * 2), raw[j]);
                }
            }
        }
    }

    // Completion: warp 0 of the last block publishes every tag. grid_completion acquired the other
    // blocks' stores (thread 0, then a block barrier); one acquire-release fence of the warp makes its
    // relaxed tag stores releases, instead of a release store (a fence each) from every thread.
    grid_completion(done_counter, s_last);
    if (*s_last && threadIdx.x < 32) {
        fence_acq_rel_sys();
        for (int u = static_cast<int>(threadIdx.x); u < num_experts; u += 32) {
            const int dst = u % num_ranks;
            if (self_masked || s_mask[dst] != 0) continue;
            const int e = rank * num_local + u / num_ranks;
            const uint32_t word = tag_word(tag, static_cast<uint32_t>(s_prefix[u + 1] - s_prefix[u]));
            st_relaxed_sys(static_cast<uint32_t*>(nvshmem_ptr(sym_tags + e, dst)), word);
        }
    }
}

}  // namespace deepep_cupy::low_latency

// Low-latency dispatch, send phase over stores (every rank reachable through NVLink): the whole grid
// shares the (token, 512-channel segment) items evenly. A warp loads its segment once, casts it to FP8
// once (or keeps the BF16), and stores it into the slot of every destination expert of the token, so a
// token costs one read and one cast however many experts it picks, and no warp walks a whole row.
//
// Slot positions: row i of (expert e, this rank) at the receiver is the i-th token (in token order)
// that picks e. Every block builds the same bitmap hits[e][chunk of 32 tokens] in shared memory (one
// shared atomicOr per top-k id; a token listing an expert twice sets one bit, so it sends one row, as
// the reference does), and the position of (t, e) is the number of bits of e before t.
//
// Completion is counted per launch, like the combine's send: every block fences its stores and bumps a
// counter, and the last block publishes the tags (counts) of all experts. A receiver needs the count of
// every source before it knows where its rows go, so publishing them together costs nothing.
#pragma once

#include "low_latency/buffer_map.cuh"
#include "low_latency/indexing.cuh"
#include "low_latency/sync.cuh"
#include "low_latency/rows.cuh"

namespace deepep_cupy::low_latency {

// Bitmap words in shared memory: the P2P send is used when experts x token chunks fit.
constexpr int kMaxHitWords = 6144;

// Channels per send item: 16 per lane.
constexpr int kSendSeg = 512;

// A send item's inputs: its 512-channel row segment and the top-k ids of its token (lane k < K: id k).
struct SendItem {
    int4 r0, r1;
    int64_t id;
};

// Item = token * segments + segment. Lanes past the row load zeros (hidden % 8 == 0: halves are whole).
template <int kHidden, int kTopk>
__device__ __forceinline__ SendItem load_send_item(const uint16_t* __restrict__ x,
                                                   const int64_t* __restrict__ topk_idx, int item, int lane) {
    constexpr int kSegs = (kHidden + kSendSeg - 1) / kSendSeg;
    const int t = item / kSegs, col = (item % kSegs) * kSendSeg + lane * 16;
    const uint16_t* src = x + static_cast<size_t>(t) * kHidden + col;
    SendItem it;
    it.r0 = col < kHidden ? ld_nc_v4_no_prefetch(src) : make_int4(0, 0, 0, 0);
    it.r1 = col + 8 < kHidden ? ld_nc_v4_no_prefetch(src + 8) : make_int4(0, 0, 0, 0);
    it.id = lane < kTopk ? __ldg(topk_idx + static_cast<size_t>(t) * kTopk + lane) : int64_t{-1};
    return it;
}

// What the send loads before the launch's prologue (begin_launch and the transport check: two dependent
// global round trips), so that the latency of these loads overlaps it: the routing ids of the bitmap
// (kIdsAhead per thread) and the warp's first item.
template <int kIdsAhead>
struct SendAhead {
    int64_t ids[kIdsAhead];
    SendItem first;
};

template <int kHidden, int kTopk, int kThreads, int kIdsAhead>
__device__ __forceinline__ void dispatch_send_ahead(const uint16_t* __restrict__ x, const int64_t* __restrict__ topk_idx,
                                                    int num_tokens, int num_maps, uint32_t* s_hits,
                                                    SendAhead<kIdsAhead>& ahead) {
    constexpr int kSegs = (kHidden + kSendSeg - 1) / kSendSeg;
    const int words = num_maps * ((num_tokens + 31) / 32);  // num_maps bitmaps of one bit per token
    for (int i = static_cast<int>(threadIdx.x); i < words; i += kThreads) s_hits[i] = 0u;
#pragma unroll
    for (int j = 0; j < kIdsAhead; ++j) {
        const int i = static_cast<int>(threadIdx.x) + j * kThreads;
        ahead.ids[j] = i < num_tokens * kTopk ? __ldg(topk_idx + i) : int64_t{-1};
    }
    const int item = first_grid_item();
    if (item < num_tokens * kSegs) ahead.first = load_send_item<kHidden, kTopk>(x, topk_idx, item, lane_id());
}

// Number of set bits of words[0 .. t / 32) plus those of word t / 32 below bit t % 32: the position of
// token t among the tokens a routing bitmap selects.
__device__ __forceinline__ int bits_before(const uint32_t* words, int t) {
    int pos = __popc(words[t / 32] & ((1u << (t % 32)) - 1u));
    for (int c = 0; c < t / 32; ++c) pos += __popc(words[c]);
    return pos;
}

// Number of set bits of words[0 .. n): the tokens a routing bitmap of n chunks selects.
__device__ __forceinline__ int bits_set(const uint32_t* words, int n) {
    int count = 0;
    for (int c = 0; c < n; ++c) count += __popc(words[c]);
    return count;
}

// Routing bitmaps of the send, in shared memory (zeroed by dispatch_send_ahead): bit t of
// s_hits[e * chunks + t / 32] when token t picks expert e and, when s_reach is given, of
// s_reach[(e / num_local) * chunks + t / 32] (token t reaches that rank). One shared atomicOr per top-k id
// and map; ids outside [0, E) select nothing and block 0 reports one of them (unless `quiet`). Ends with
// a block barrier. Every thread calls it.
template <int kTopk, int kThreads, int kIdsAhead>
__device__ __forceinline__ void mark_routing(const int64_t* __restrict__ topk_idx, int num_tokens, int num_experts,
                                             int num_local, uint32_t* s_hits, uint32_t* s_reach,
                                             const SendAhead<kIdsAhead>& ahead, bool quiet, int rank, ErrorRecord* err) {
    const int chunks = (num_tokens + 31) / 32;
    BadValue bad;
    auto mark = [&](int i, int64_t id) {
        bad.check_expert_id(id, num_experts);
        if (id >= 0 && id < num_experts) {
            const int t = i / kTopk, e = static_cast<int>(id);
            atomicOr(s_hits + e * chunks + t / 32, 1u << (t % 32));
            if (s_reach != nullptr) atomicOr(s_reach + (e / num_local) * chunks + t / 32, 1u << (t % 32));
        }
    };
#pragma unroll
    for (int j = 0; j < kIdsAhead; ++j) {
        const int i = static_cast<int>(threadIdx.x) + j * kThreads;
        if (i < num_tokens * kTopk) mark(i, ahead.ids[j]);
    }
    for (int i = static_cast<int>(threadIdx.x) + kIdsAhead * kThreads; i < num_tokens * kTopk; i += kThreads)
        mark(i, __ldg(topk_idx + i));
    if (blockIdx.x == 0 && !quiet) bad.report_from_warp(err, kValueOpLowLatencyDispatch, rank, __LINE__);
    __syncthreads();
}

// A send item's 512-channel segment as it goes out (FP8: cast once, the segment's four scales gathered by
// lane 0 so they leave as one 16-byte store rather than four 4-byte stores, each a link transaction of
// its own); store() writes it into one destination row. Whole warp.
template <int kHidden, bool kFP8>
struct SendSegment {
    static constexpr bool kWholeSegs = kHidden % kSendSeg == 0;
    int4 q0, q1;
    float scale;
    float4 seg_scales;
    int seg, col;
    bool lo, hi;

    __device__ __forceinline__ SendSegment(const SendItem& in, int seg_, bool round_scale, int lane)
        : q0(in.r0), q1(in.r1), scale(0.0f), seg_scales(make_float4(0.0f, 0.0f, 0.0f, 0.0f)), seg(seg_),
          col(seg_ * kSendSeg + lane * 16), lo(col < kHidden), hi(col + 8 < kHidden) {
        if constexpr (kFP8) {
            q0 = cast16_fp8(in.r0, in.r1, lo, round_scale, scale);
            if constexpr (kWholeSegs) {
                seg_scales.x = scale;
                seg_scales.y = __shfl_sync(kFullMask, scale, 8);
                seg_scales.z = __shfl_sync(kFullMask, scale, 16);
                seg_scales.w = __shfl_sync(kFullMask, scale, 24);
            }
        }
    }

    // msg: the destination row (BF16 data, or FP8 data then float32 scales at kHidden).
    __device__ __forceinline__ void store(uint8_t* msg, int lane) const {
        store_data(msg);
        if constexpr (kFP8) {
            if constexpr (kWholeSegs) {
                if (lane == 0) st_na_v4(reinterpret_cast<int4*>(msg + kHidden) + seg, *reinterpret_cast<const int4*>(&seg_scales));
            } else {
                if (lo && (lane & 7) == 0) reinterpret_cast<float*>(msg + kHidden)[col / kChannelsPerBlock] = scale;
            }
        }
    }

    // The segment's data into a row of packed_recv_x.
    __device__ __forceinline__ void store_data(uint8_t* row) const {
        if constexpr (kFP8) {
            if (lo) st_na_v4(reinterpret_cast<int4*>(row + col), q0);
        } else {
            if (lo) st_na_v4(reinterpret_cast<int4*>(row + 2 * col), q0);
            if (hi) st_na_v4(reinterpret_cast<int4*>(row + 2 * col + 16), q1);
        }
    }

    // FP8: the segment's scales into row `row` of local expert `le`'s column-major scales, as the receive
    // stores a message's (RecvScales): float32 per 128 channels, or with UE8M0 the exponent bytes of the
    // segment's four blocks, which make exactly one packed word (512 channels). Whole warp.
    __device__ __forceinline__ void store_scales(bool use_ue8m0, float* out_scales, int* out_scales_ue8m0, int le,
                                                 int slab, int row, int lane) const {
        if constexpr (kFP8) {
            constexpr int kNumScales = kHidden / kChannelsPerBlock;
            constexpr int kWords = (kNumScales + 3) / 4;
            static_assert(kSendSeg == 4 * kChannelsPerBlock, "a packed UE8M0 word per segment");
            if (use_ue8m0) {
                uint32_t word = 0;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const float v = __shfl_sync(kFullMask, scale, 8 * j);  // lane 8j: block 4 * seg + j
                    if (seg * 4 + j < kNumScales) word |= ((__float_as_uint(v) >> 23) & 0xffu) << (8 * j);
                }
                if (lane == 0) out_scales_ue8m0[(static_cast<size_t>(le) * kWords + seg) * slab + row] = static_cast<int>(word);
            } else if (lo && (lane & 7) == 0) {
                out_scales[(static_cast<size_t>(le) * kNumScales + col / kChannelsPerBlock) * slab + row] = scale;
            }
        }
    }
};

// Called by every thread of every block (the completion count needs all blocks), after
// dispatch_send_ahead and a block barrier. s_hits holds num_experts * ceil(num_tokens / 32) <=
// kMaxHitWords words, zeroed by dispatch_send_ahead.
template <int kHidden, int kTopk, bool kFP8, int kThreads, int kIdsAhead>
__device__ __forceinline__ void dispatch_send_p2p(
    const uint16_t* __restrict__ x, const int64_t* __restrict__ topk_idx, int num_tokens, int max_tokens,
    int num_experts, int num_ranks, int rank, bool self_masked, const int* s_mask, uint32_t* s_hits, int* s_last,
    uint32_t* sym_tags, int* sym_src_idx, uint8_t* sym_recv, uint32_t* done_counter, uint32_t tag, bool round_scale,
    const SendAhead<kIdsAhead>& ahead, ErrorRecord* err) {
    static_assert(kTopk >= 1 && kTopk <= 32, "one lane per top-k entry");
    constexpr int kBlockWarps = kThreads / 32;
    constexpr int kSegs = (kHidden + kSendSeg - 1) / kSendSeg;
    constexpr int kSlotBytes = 2 * kHidden;
    const int lane = lane_id();
    const int num_local = num_experts / num_ranks;
    const int chunks = (num_tokens + 31) / 32;

    mark_routing<kTopk, kThreads>(topk_idx, num_tokens, num_experts, num_local, s_hits, nullptr, ahead, self_masked,
                                  rank, err);

    if (!self_masked) {
        const int total_items = num_tokens * kSegs;
        const int total_warps = static_cast<int>(gridDim.x) * kBlockWarps;
        const int first_item = first_grid_item();
        for (int item = first_item; item < total_items; item += total_warps) {
            const int t = item / kSegs;
            // The row segment is loaded first: its loads are independent of the routing below.
            const SendItem in = item == first_item ? ahead.first : load_send_item<kHidden, kTopk>(x, topk_idx, item, lane);
            const int64_t id = in.id;

            // Lane k: the slot of the token's k-th expert, if it gets a row (valid, first of its value in
            // the token, live destination).
            uint8_t* slot = nullptr;
            int* src_slot = nullptr;
            {
                const unsigned same = __match_any_sync(kFullMask, static_cast<unsigned long long>(id));
                const bool first = (same & ((1u << lane) - 1u)) == 0u;
                if (lane < kTopk && first && id >= 0 && id < num_experts) {
                    const int e = static_cast<int>(id);
                    const int dst = e / num_local, le = e % num_local;
                    if (s_mask[dst] == 0) {
                        const int pos = bits_before(s_hits + e * chunks, t);
                        const size_t s = static_cast<size_t>(le * num_ranks + rank) * max_tokens + pos;
                        slot = static_cast<uint8_t*>(nvshmem_ptr(sym_recv, dst)) + s * kSlotBytes;
                        src_slot = static_cast<int*>(nvshmem_ptr(sym_src_idx, dst)) + s;
                    }
                }
            }

            const int seg = item % kSegs;
            const SendSegment<kHidden, kFP8> out(in, seg, round_scale, lane);
            uint32_t pending = __ballot_sync(kFullMask, slot != nullptr);
            while (pending != 0u) {  // uniform over the warp
                const int k = __ffs(pending) - 1;
                pending &= pending - 1u;
                out.store(reinterpret_cast<uint8_t*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(slot), k)),
                          lane);
                if (seg == 0 && lane == k) *src_slot = t;
            }
        }
    }

    // Completion: warp 0 of the last block publishes the tags (grid_completion acquired the other blocks'
    // stores; the warp's fence makes its relaxed tag stores releases).
    grid_completion(done_counter, s_last);
    if (*s_last && !self_masked && threadIdx.x < 32) {
        fence_acq_rel_sys();  // with the relaxed stores below: releases (see combine.cu's send)
        for (int e = static_cast<int>(threadIdx.x); e < num_experts; e += 32) {
            const int dst = e / num_local, le = e % num_local;
            if (s_mask[dst] != 0) continue;
            const uint32_t word = tag_word(tag, static_cast<uint32_t>(bits_set(s_hits + e * chunks, chunks)));
            st_relaxed_sys(static_cast<uint32_t*>(nvshmem_ptr(sym_tags + le * num_ranks + rank, dst)), word);
        }
    }
}

}  // namespace deepep_cupy::low_latency

namespace deepep_cupy::low_latency {

// Receive phase when every source is reached by stores: the block's warps wait for the counts of all
// units u = local_expert * R + source together (one lane per unit, each word polled by one thread),
// every block takes their prefix sum in shared memory (s_pre, num_experts + 1 words), and the grid
// shares the (row, 4 KiB part) items evenly, each warp with all its part's loads in flight. A unit per
// warp group instead left most warps idle (about 3.6 rows per unit here), walked a row's loads in four
// dependent rounds and waited for its sources one warp at a time. Called by every thread.
template <int kHidden, bool kFP8, int kThreads>
__device__ __forceinline__ void dispatch_recv_p2p(
    int max_tokens, int num_experts, int num_ranks, int rank, bool self_masked, int* s_mask, int* s_pre,
    int* s_warp_sum, const uint32_t* sym_tags, const int* sym_src_idx, const uint8_t* sym_recv, int* mask,
    uint8_t* out_x, float* out_scales, int* out_scales_ue8m0, int* out_count, int* out_src_info,
    int* out_row_map, int64_t* out_layout_range, int* cumulative_recv_stats, int64_t* wait_recv_cost_stats, bool use_ue8m0,
    bool shrink, uint32_t tag, uint32_t tag_ahead, const Deadline& deadline, ErrorRecord* err) {
    constexpr int kBlockWarps = kThreads / 32;
    constexpr int kNumScales = kHidden / kChannelsPerBlock;
    constexpr int kSlotBytes = 2 * kHidden;
    constexpr int kDataBytes = kFP8 ? kHidden : 2 * kHidden;
    constexpr int kInt4 = kDataBytes / 16;
    constexpr int kPerLane = 8;  // 16-byte loads in flight per lane
    constexpr int kPartInt4 = 32 * kPerLane;
    constexpr int kParts = (kInt4 + kPartInt4 - 1) / kPartInt4;
    const int lane = lane_id();
    const int slab = num_ranks * max_tokens;
    const int num_local = num_experts / num_ranks;
    const uint64_t t_start = globaltimer();

    // Counts of every unit u = le * R + src, kept at index q = le * R + (src's place in the slab's order),
    // so that the prefix over q gives each group's first row.
    for (int u = static_cast<int>(threadIdx.x); u < num_experts; u += kThreads) {
        const int src = u % num_ranks;
        int cnt = 0;
        if (!self_masked && s_mask[src] == 0) {
            cnt = wait_tag_seen(u == static_cast<int>(threadIdx.x) ? tag_ahead : 0u, sym_tags + u, tag, deadline, err,
                                !shrink);
            if (cnt < 0) {
                peer_timed_out(mask, src, shrink, err, kOpDispatchRecv, rank, __LINE__, deadline);
                cnt = 0;
            } else if (blockIdx.x == 0 && wait_recv_cost_stats != nullptr) {
                atomicAdd(reinterpret_cast<unsigned long long*>(wait_recv_cost_stats + src),
                          static_cast<unsigned long long>(globaltimer() - t_start));
            }
            cnt = min(cnt, max_tokens);
        }
        s_pre[u - src + source_position(src, rank, num_ranks)] = cnt;
    }

    block_exclusive_scan(s_pre, num_experts, s_warp_sum);  // exclusive prefix over q

    // Per-unit and per-expert outputs, and -1 for the source info of the slab's unused rows.
    if (blockIdx.x == 0) {
        for (int q = static_cast<int>(threadIdx.x); q < num_experts; q += kThreads) {
            const int le = q / num_ranks;
            const int begin = s_pre[q] - s_pre[le * num_ranks];
            const int count = s_pre[q + 1] - s_pre[q];
            out_layout_range[le * num_ranks + source_at(q % num_ranks, rank, num_ranks)] =
                (static_cast<int64_t>(begin) << 32) | static_cast<int64_t>(count);
            if (q % num_ranks == num_ranks - 1) {
                const int total = begin + count;
                out_count[le] = total;
                if (cumulative_recv_stats != nullptr) atomicAdd(cumulative_recv_stats + le, total);
            }
        }
    }
    {
        const long long all = static_cast<long long>(num_local) * slab;
        for (long long i = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x; i < all;
             i += static_cast<long long>(gridDim.x) * kThreads) {
            const int le = static_cast<int>(i / slab), r = static_cast<int>(i % slab);
            if (r >= s_pre[(le + 1) * num_ranks] - s_pre[le * num_ranks]) out_src_info[i] = -1;
        }
    }

    // Rows.
    const int total_items = s_pre[num_experts] * kParts;
    const int total_warps = static_cast<int>(gridDim.x) * kBlockWarps;
    for (int item = first_grid_item(); item < total_items; item += total_warps) {
        const int g = item / kParts, part = item % kParts;
        const int q = prefix_segment(s_pre, num_experts, g), i = g - s_pre[q], le = q / num_ranks;
        const int src = source_at(q % num_ranks, rank, num_ranks), u = le * num_ranks + src;
        const int row = s_pre[q] - s_pre[le * num_ranks] + i;
        const uint8_t* msg = sym_recv + (static_cast<size_t>(u) * max_tokens + i) * kSlotBytes;
        const size_t out_row = static_cast<size_t>(le) * slab + row;
        const int4* s = reinterpret_cast<const int4*>(msg) + part * kPartInt4;
        int4* d = reinterpret_cast<int4*>(out_x + out_row * kDataBytes) + part * kPartInt4;
        const int n = min(kPartInt4, kInt4 - part * kPartInt4);
        int4 r[kPerLane];
#pragma unroll
        for (int j = 0; j < kPerLane; ++j)
            if (j * 32 + lane < n) r[j] = ld_cg_v4(s + j * 32 + lane);
        if (part == 0) {
            if constexpr (kFP8) {
                store_recv_scales<kNumScales>(msg + kHidden, use_ue8m0, out_scales, out_scales_ue8m0, le, slab, row,
                                              lane);
            }
            if (lane == 0)
                record_row(out_src_info, out_row_map, le, row, src,
                           static_cast<int>(ld_cg_u32(sym_src_idx + static_cast<size_t>(u) * max_tokens + i)), max_tokens,
                           num_ranks, num_local);
        }
#pragma unroll
        for (int j = 0; j < kPerLane; ++j)
            if (j * 32 + lane < n) st_na_v4(d + j * 32 + lane, r[j]);
    }
}

}  // namespace deepep_cupy::low_latency

// Low-latency dispatch over stores with one message per (token, destination rank): a token that picks
// several experts of one rank crosses the link once, and the receiver copies it into each of those
// experts' rows. With top-8 of 288 experts on 2 ranks a token picks ~4 experts per rank, so the send
// moves ~4x fewer bytes than one row per (token, expert); on 8 ranks ~1.5x fewer.
//
// Used when the host says so (every rank reached by stores, top-k <= 32, the tables below fit shared
// memory and the messages fit the receive region; LowLatencyBufferMap.rank_messages_fit). Every rank takes
// the same decision, since a receiver must read the format its sources write.
//
// Message j from source s sits at recv + (s * T + j) * Msg::kBytes: the data (BF16 row, or FP8 row and
// its float32 scales), then a header: the token index, then per top-k entry (expert << 16) | position,
// the position being the token's row among the rows of (expert, s), in token order, or kNoEntry when
// the entry sends no row (id out of range, repeated in the token, destination masked). Messages are
// numbered per destination in token order (j = number of earlier tokens that reach it).
//
// A rank's own tokens are not messages: each slab starts with this rank's own group (the reference's
// order), so the send writes them straight into their rows of the packed outputs (OwnRows; row =
// position) and the receive copies only the peers' messages. At 2 ranks that halves the receive's bytes,
// which is what a hook's receive part waits on. The rank word still counts them, so the receive of a
// fused launch knows the own counts are there. A fused BF16 launch writes them after its signal (below).
//
// Completion: block 0 writes, into every live destination, its row count per local expert (tags region,
// word s * E_local + le: (sequence tag << 16) | count, plain stores) as soon as the routing is known;
// after the grid's completion count, thread 0 of the last block writes the rank word of every
// destination (arrivals region, word s): (sequence tag << 16) | message count, released by the
// completion's fence, so no other fence or barrier sits in the tail. A receiver waits for R rank words;
// the counts are data ordered before them. Both regions are otherwise used only by the RMA path, which
// an engine using this format never takes.
#pragma once

#include "low_latency/dispatch_p2p.cuh"

namespace deepep_cupy::low_latency {

constexpr uint32_t kNoEntry = 0xffffffffu;

template <int kHidden, int kTopk, bool kFP8>
struct RankMsg {
    static constexpr int kNumScales = kHidden / kChannelsPerBlock;
    // Data the receiver copies into a row of packed_recv_x, and what the message carries before the header.
    static constexpr int kRowBytes = kFP8 ? kHidden : 2 * kHidden;
    static constexpr int kDataBytes = kFP8 ? align16(kHidden + 4 * kNumScales) : 2 * kHidden;
    static constexpr int kHeaderInt4 = (1 + kTopk + 3) / 4;
    static constexpr int kBytes = kDataBytes + 16 * kHeaderInt4;
};

// The packed outputs, where the send writes this rank's own rows (its group starts each expert's slab, so
// a row's place is its position, known before any count arrives); the receive copies the peers' only.
struct OwnRows {
    uint8_t* x;
    float* scales;
    int* scales_ue8m0;
    int* src_info;
    int* row_map;
    int slab;
    bool use_ue8m0;
};

// Called by every thread of every block after dispatch_send_ahead (which zeroed s_hits: E * chunks
// words of per-expert bitmaps, then R * chunks words of per-rank bitmaps) and a block barrier.
template <int kHidden, int kTopk, bool kFP8, int kThreads, int kIdsAhead>
__device__ __forceinline__ void dispatch_send_ranks(
    const uint16_t* __restrict__ x, const int64_t* __restrict__ topk_idx, int num_tokens, int max_tokens,
    int num_experts, int num_ranks, int rank, bool self_masked, const int* s_mask, uint32_t* s_hits, int* s_last,
    uint8_t* const* s_peer_recv, uint32_t* sym_counts, uint32_t* sym_rank_tags, uint8_t* sym_recv,
    uint32_t* done_counter, uint32_t tag, bool round_scale, const SendAhead<kIdsAhead>& ahead, const OwnRows& own,
    bool own_after_signal, ErrorRecord* err) {
    static_assert(kTopk >= 1 && kTopk <= 32, "one lane per top-k entry");
    using Msg = RankMsg<kHidden, kTopk, kFP8>;
    constexpr int kBlockWarps = kThreads / 32;
    constexpr int kSegs = (kHidden + kSendSeg - 1) / kSendSeg;
    const int lane = lane_id();
    const int num_local = num_experts / num_ranks;
    const int chunks = (num_tokens + 31) / 32;
    uint32_t* s_reach = s_hits + num_experts * chunks;  // [R][chunks]: tokens with an expert on rank r
    // Rank r's address of a symmetric word: its receive area's address plus the same offset (one heap).
    const auto at_peer = [&](const void* sym, int r) {
        return s_peer_recv[r] + (static_cast<const uint8_t*>(sym) - sym_recv);
    };

    mark_routing<kTopk, kThreads>(topk_idx, num_tokens, num_experts, num_local, s_hits, s_reach, ahead, self_masked,
                                  rank, err);

    // Row counts per (destination, local expert), ordered before the rank words by the completion.
    for (int e = static_cast<int>(blockIdx.x * kThreads + threadIdx.x); !self_masked && e < num_experts;
         e += static_cast<int>(gridDim.x) * kThreads) {
        const int dst = e / num_local;
        if (s_mask[dst] != 0) continue;
        reinterpret_cast<uint32_t*>(at_peer(sym_counts, dst))[rank * num_local + e % num_local] =
            tag_word(tag, static_cast<uint32_t>(bits_set(s_hits + e * chunks, chunks)));
    }

    // Lane k of token t's warp: the destination of entry k and its header word, (expert << 16) | position
    // (dst -1 and kNoEntry when the entry sends no row: out of range, masked, or a repeat of a lower lane).
    const uint32_t below = (1u << lane) - 1u;
    const auto route = [&](int64_t id, int t, int& dst, uint32_t& word) {
        const unsigned same = __match_any_sync(kFullMask, static_cast<unsigned long long>(id));
        dst = -1;
        word = kNoEntry;
        if (lane < kTopk && (same & below) == 0u && id >= 0 && id < num_experts) {
            const int e = static_cast<int>(id);
            if (s_mask[e / num_local] == 0) {
                dst = e / num_local;
                word = (static_cast<uint32_t>(e) << 16) | static_cast<uint32_t>(bits_before(s_hits + e * chunks, t));
            }
        }
    };
    // This rank's own entries of the segment: straight into their rows, which start each slab (row = position).
    const auto store_own = [&](const SendSegment<kHidden, kFP8>& out, int dst, uint32_t word, int t, int seg) {
        uint32_t own_rows = __ballot_sync(kFullMask, dst == rank);
        while (own_rows != 0u) {  // uniform over the warp
            const int k = __ffs(own_rows) - 1;
            own_rows &= own_rows - 1u;
            const uint32_t w = __shfl_sync(kFullMask, word, k);
            const int le = static_cast<int>(w >> 16) - rank * num_local, row = static_cast<int>(w & 0xffffu);
            out.store_data(own.x + (static_cast<size_t>(le) * own.slab + row) * Msg::kRowBytes);
            out.store_scales(own.use_ue8m0, own.scales, own.scales_ue8m0, le, own.slab, row, lane);  // this segment's
            if (seg == 0 && lane == 0)
                record_row(own.src_info, own.row_map, le, row, rank, t, max_tokens, num_ranks, num_local);
        }
    };
    const int total_items = num_tokens * kSegs;
    const int total_warps = static_cast<int>(gridDim.x) * kBlockWarps;

    if (!self_masked) {
        const int first_item = first_grid_item();
        for (int item = first_item; item < total_items; item += total_warps) {
            const int t = item / kSegs;
            const int seg = item % kSegs;
            const SendItem in = item == first_item ? ahead.first : load_send_item<kHidden, kTopk>(x, topk_idx, item, lane);
            int dst;
            uint32_t word;
            route(in.id, t, dst, word);
            const unsigned same_dst = __match_any_sync(kFullMask, dst);
            uint8_t* msg = nullptr;
            if (dst >= 0 && dst != rank && (same_dst & below) == 0u) {
                const size_t j = static_cast<size_t>(rank) * max_tokens + bits_before(s_reach + dst * chunks, t);
                msg = s_peer_recv[dst] + j * Msg::kBytes;
            }

            const SendSegment<kHidden, kFP8> out(in, seg, round_scale, lane);
            // Header (with the first segment): lane q packs words 4q .. 4q + 3 (token, then the entries).
            int4 header = make_int4(0, 0, 0, 0);
            if (seg == 0) {
                uint32_t h[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int w = 4 * lane + i;  // word w is entry w - 1, held by lane w - 1
                    const uint32_t v = __shfl_sync(kFullMask, word, (w + 31) % 32);
                    h[i] = w == 0 ? static_cast<uint32_t>(t) : (w - 1 < kTopk ? v : kNoEntry);
                }
                header = make_int4(static_cast<int>(h[0]), static_cast<int>(h[1]), static_cast<int>(h[2]),
                                   static_cast<int>(h[3]));
            }

            uint32_t pending = __ballot_sync(kFullMask, msg != nullptr);
            while (pending != 0u) {  // uniform over the warp
                const int k = __ffs(pending) - 1;
                pending &= pending - 1u;
                uint8_t* m = reinterpret_cast<uint8_t*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(msg), k));
                out.store(m, lane);
                if (seg == 0 && lane < Msg::kHeaderInt4) st_na_v4(reinterpret_cast<int4*>(m + Msg::kDataBytes) + lane, header);
            }
            if (!own_after_signal) store_own(out, dst, word, t, seg);
        }
    }

    grid_completion(done_counter, s_last);
    if (*s_last && !self_masked && threadIdx.x == 0) {
        for (int dst = 0; dst < num_ranks; ++dst) {
            if (s_mask[dst] != 0) continue;
            st_relaxed_sys(reinterpret_cast<uint32_t*>(at_peer(sym_rank_tags, dst)) + rank,
                           tag_word(tag, static_cast<uint32_t>(bits_set(s_reach + dst * chunks, chunks))));
        }
    }

    // own_after_signal (a fused BF16 launch): the own rows are written once the messages are out (the
    // receive never reads them, and the kernel's end publishes them), so the peers' rank words do not wait
    // for them and the writes overlap the wait for the peers' messages. A send part alone writes them
    // above: its receive part reads them. FP8 keeps them above too: its own rows are half as many bytes,
    // and the second pass's casts and spills cost more than they save (same-GPU A/B, docs).
    if (own_after_signal && !self_masked) {
        for (int item = first_grid_item(); item < total_items; item += total_warps) {
            const int t = item / kSegs, seg = item % kSegs;
            if (((s_reach[rank * chunks + t / 32] >> (t % 32)) & 1u) == 0u) continue;  // uniform over the warp
            const SendItem in = load_send_item<kHidden, kTopk>(x, topk_idx, item, lane);
            int dst;
            uint32_t word;
            route(in.id, t, dst, word);
            store_own(SendSegment<kHidden, kFP8>(in, seg, round_scale, lane), dst, word, t, seg);
        }
    }
}

// Receive phase of the per-rank format. Shared memory (s_tab, kMaxHitWords ints): message-count prefix
// [R + 1], source alive [R], first row of (local expert, source) in the expert's slab [E], rows per
// local expert [E_local]. The grid shares (message, part) items; a warp loads its part once and stores
// it into the row of every local expert the token picked. Called by every thread.
template <int kHidden, int kTopk, bool kFP8, int kThreads>
__device__ __forceinline__ void dispatch_recv_ranks(
    int max_tokens, int num_experts, int num_ranks, int rank, bool self_masked, const int* s_mask, int* s_tab,
    const uint32_t* sym_counts, const uint32_t* sym_rank_tags, const uint8_t* sym_recv, int* mask,
    uint8_t* out_x, float* out_scales, int* out_scales_ue8m0, int* out_count, int* out_src_info,
    int* out_row_map, int64_t* out_layout_range, int* cumulative_recv_stats, int64_t* wait_recv_cost_stats, bool use_ue8m0,
    bool shrink, uint32_t tag, uint32_t tag_ahead, uint32_t count_ahead, const Deadline& deadline, ErrorRecord* err) {
    using Msg = RankMsg<kHidden, kTopk, kFP8>;
    constexpr int kBlockWarps = kThreads / 32;
    constexpr int kRowInt4 = Msg::kRowBytes / 16;
    constexpr int kPerLane = 4;  // 16-byte loads in flight per lane; a part feeds up to top-k rows
    constexpr int kPartInt4 = 32 * kPerLane;
    constexpr int kParts = (kRowInt4 + kPartInt4 - 1) / kPartInt4;
    const int lane = lane_id(), warp = static_cast<int>(threadIdx.x) / 32;
    const int slab = num_ranks * max_tokens;
    const int num_local = num_experts / num_ranks;
    int* s_msgs = s_tab;                    // [R + 1]
    int* s_alive = s_msgs + num_ranks + 1;  // [R]
    int* s_base = s_alive + num_ranks;      // [E_local * R], index le * R + src
    int* s_rows = s_base + num_experts;     // [E_local]
    const uint64_t t_start = globaltimer();

    // Warp 0 waits for the sources (lane s for source s, 32 at a time) and scans their message counts;
    // one block barrier then publishes the prefix.
    if (warp == 0) {
        int carry = 0;
        for (int s0 = 0; s0 < num_ranks; s0 += 32) {
            const int src = s0 + lane;
            int n = -1;
            if (src < num_ranks && !self_masked && s_mask[src] == 0) {
                n = wait_tag_seen(src == static_cast<int>(threadIdx.x) ? tag_ahead : 0u, sym_rank_tags + src, tag,
                                  deadline, err, !shrink);
                if (n < 0) {
                    peer_timed_out(mask, src, shrink, err, kOpDispatchRecv, rank, __LINE__, deadline);
                } else if (blockIdx.x == 0 && wait_recv_cost_stats != nullptr) {
                    atomicAdd(reinterpret_cast<unsigned long long*>(wait_recv_cost_stats + src),
                              static_cast<unsigned long long>(globaltimer() - t_start));
                }
            }
            const int c = n >= 0 && src != rank ? min(n, max_tokens) : 0;  // own rows: written by the send
            int incl = c;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int v = __shfl_up_sync(kFullMask, incl, o);
                if (lane >= o) incl += v;
            }
            if (src < num_ranks) {
                s_alive[src] = n >= 0;
                s_msgs[src] = carry + incl - c;
            }
            carry += __shfl_sync(kFullMask, incl, 31);
        }
        if (lane == 0) s_msgs[num_ranks] = carry;
    }
    __syncthreads();

    // Rows of (local expert, source), in source order within each expert's slab: the count words (one
    // thread each; the word read ahead unless it missed this launch's tag, which the rank word's acquire
    // now guarantees), then summed per expert.
    for (int i = static_cast<int>(threadIdx.x); i < num_experts; i += kThreads) {
        const int src = i / num_local, le = i % num_local;
        uint32_t w = i == static_cast<int>(threadIdx.x) ? count_ahead : 0u;
        if (s_alive[src] && (w >> 16) != tag) w = ld_cg_u32(sym_counts + i);
        s_base[le * num_ranks + src] =
            s_alive[src] && (w >> 16) == tag ? min(static_cast<int>(w & 0xffffu), max_tokens) : 0;
    }
    __syncthreads();
    for (int le = static_cast<int>(threadIdx.x); le < num_local; le += kThreads) {
        int run = 0;
        for (int j = 0; j < num_ranks; ++j) {  // in the slab's order
            const int src = source_at(j, rank, num_ranks);
            const int c = s_base[le * num_ranks + src];
            s_base[le * num_ranks + src] = run;
            if (blockIdx.x == 0)
                out_layout_range[le * num_ranks + src] = (static_cast<int64_t>(run) << 32) | static_cast<int64_t>(c);
            run += c;
        }
        s_rows[le] = run;
        if (blockIdx.x == 0) {
            out_count[le] = run;
            if (cumulative_recv_stats != nullptr) atomicAdd(cumulative_recv_stats + le, run);
        }
    }
    __syncthreads();
    {
        const long long all = static_cast<long long>(num_local) * slab;
        for (long long i = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x; i < all;
             i += static_cast<long long>(gridDim.x) * kThreads) {
            if (static_cast<int>(i % slab) >= s_rows[i / slab]) out_src_info[i] = -1;
        }
    }

    // Item = part * messages + message: a message's first part (with the scales, source indices and more
    // stores) lands on blocks spread like the others, not on every kParts-th block.
    const int num_msgs = s_msgs[num_ranks];
    const int total_items = num_msgs * kParts;
    const int total_warps = static_cast<int>(gridDim.x) * kBlockWarps;
    const int first_expert = rank * num_local;
    for (int item = first_grid_item(); item < total_items; item += total_warps) {
        const int g = item % num_msgs, part = item / num_msgs;
        const int src = prefix_segment(s_msgs, num_ranks - 1, g);  // the last source with s_msgs[src] <= g
        const uint8_t* msg = sym_recv + (static_cast<size_t>(src) * max_tokens + (g - s_msgs[src])) * Msg::kBytes;
        const int4* s = reinterpret_cast<const int4*>(msg) + part * kPartInt4;
        const int n = min(kPartInt4, kRowInt4 - part * kPartInt4);
        int4 r[kPerLane];
#pragma unroll
        for (int j = 0; j < kPerLane; ++j)
            if (j * 32 + lane < n) r[j] = ld_cg_v4(s + j * 32 + lane);
        RecvScales<Msg::kNumScales> scales;  // loaded once, stored for every row the message feeds
        if (kFP8 && part == 0) scales.load(msg + kHidden, use_ue8m0, lane);
        const uint32_t* header = reinterpret_cast<const uint32_t*>(msg + Msg::kDataBytes);
        const uint32_t word = lane < kTopk ? ld_cg_u32(header + 1 + lane) : kNoEntry;
        // Lane k: the output row of entry k, if its expert is local (-1 otherwise).
        int le = -1, row = -1;
        if (word != kNoEntry) {
            const int e = static_cast<int>(word >> 16) - first_expert;
            const int pos = static_cast<int>(word & 0xffffu);
            if (e >= 0 && e < num_local && s_base[e * num_ranks + src] + pos < s_rows[e]) {
                le = e;
                row = s_base[e * num_ranks + src] + pos;
            }
        }
        const int t = part == 0 ? static_cast<int>(ld_cg_u32(header)) : 0;
        uint32_t pending = __ballot_sync(kFullMask, le >= 0);
        while (pending != 0u) {  // uniform over the warp
            const int k = __ffs(pending) - 1;
            pending &= pending - 1u;
            const int e = __shfl_sync(kFullMask, le, k), out_row = __shfl_sync(kFullMask, row, k);
            int4* d = reinterpret_cast<int4*>(out_x + (static_cast<size_t>(e) * slab + out_row) * Msg::kRowBytes) +
                      part * kPartInt4;
#pragma unroll
            for (int j = 0; j < kPerLane; ++j)
                if (j * 32 + lane < n) st_na_v4(d + j * 32 + lane, r[j]);
            if (part == 0) {
                if constexpr (kFP8) scales.store(use_ue8m0, out_scales, out_scales_ue8m0, e, slab, out_row, lane);
                if (lane == 0) record_row(out_src_info, out_row_map, e, out_row, src, t, max_tokens, num_ranks, num_local);
            }
        }
    }
}

}  // namespace deepep_cupy::low_latency

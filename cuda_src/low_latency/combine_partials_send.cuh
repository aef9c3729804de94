// Low-latency combine with per-rank partial sums, the expert side's send phase (the wire format, the
// routes and the split of the items: combine_partials.cuh).
//
// The row of each (source, token, local expert) comes from the row map the dispatch wrote
// next to its handle (indexing.cuh record_row), checked against the handle's source info and range; for a
// handle the caller rebuilt (no row map) every block first builds, in dynamic shared memory, the rows
// the handle gives each (source, token): s_count[s * T + t] and up to K entries (local expert << 16) |
// row. The grid's warps take contiguous ranges of (token, source, 256-channel segment) items; for a new
// token, lane k waits for route k, finds the row of its expert, and the warp loads every row of the
// token (all in flight) and writes the fma chain in top-k order (float32 or LogFMT) to the owner, at row
// (rank * T + t) of the owner's receive region. A token is written iff some route names an expert here,
// which is exactly when the owner's own top-k names this rank, so both sides agree without a count.
//
// Completion per block: once its warps are done, every block fences and writes one word per live
// destination, (tag << 16) | grid size, at the destination's sym_done[rank][block] (the start of the
// source-index region, where the dispatch writes only token indices, never a tagged word).
#pragma once

#include "low_latency/combine_partials.cuh"
#include "low_latency/buffer_map.cuh"
#include "low_latency/indexing.cuh"
#include "low_latency/sync.cuh"
#include "low_latency/logfmt.cuh"
#include "low_latency/rows.cuh"

namespace deepep_cupy::low_latency {

// Every live destination gets the routes of all T token slots of this rank (grid-wide, one store each).
// The ids are checked here, each once (those of destination 0), and a bad one is reported: the owner's
// reduction only drops them, and a receive hook then needs no round trip of its own for the check.
template <int kTopk, int kThreads>
__device__ __forceinline__ void publish_routes(const int64_t* __restrict__ topk_idx, const float* __restrict__ topk_weights,
                                               int num_tokens, int max_tokens, int num_experts, int num_ranks,
                                               int rank, size_t row_bytes, bool self_masked, const int* s_mask,
                                               uint8_t* sym_recv, uint32_t seq, ErrorRecord* err) {
    BadValue bad;
    const int num_local = num_experts / num_ranks;
    const long long per_rank = static_cast<long long>(max_tokens) * kTopk;
    const long long total = per_rank * (self_masked ? 1 : num_ranks);  // masked: the check only
    for (long long i = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x; i < total;
         i += static_cast<long long>(gridDim.x) * kThreads) {
        const int d = static_cast<int>(i / per_rank);
        const long long tk = i % per_rank;  // t * K + k
        const int64_t id = tk < static_cast<long long>(num_tokens) * kTopk ? __ldg(topk_idx + tk) : -1;
        if (d == 0) bad.check_expert_id(id, num_experts);
        if (self_masked || s_mask[d] != 0) continue;
        const bool here = id >= 0 && id < num_experts && static_cast<int>(id / num_local) == d;
        const uint32_t le1 = here ? static_cast<uint32_t>(id % num_local) + 1u : 0u;
        const float w = here ? __ldg(topk_weights + tk) : 0.0f;
        uint8_t* peer = static_cast<uint8_t*>(nvshmem_ptr(sym_recv, d));
        uint64_t* slot =
            partial_routes(peer, num_ranks, max_tokens, row_bytes) + 2 * (static_cast<size_t>(rank) * per_rank + tk);
        st_relaxed_sys(slot, route_word(seq, le1));
        st_relaxed_sys(slot + 1, route_word(seq, __float_as_uint(w)));
    }
    bad.report_from_warp(err, kValueOpLowLatencyCombine, rank, __LINE__);
}

// The handle's rows of every (source, token): s_count[R * T] and s_rows[R * T][K]. s_prefix holds the
// unit prefix sums (unit_prefix); every thread calls it; ends synced.
template <int kTopk, int kThreads>
__device__ __forceinline__ void build_row_table(const int* __restrict__ src_info, const int64_t* __restrict__ layout_range,
                                                int max_tokens, int num_experts, int num_ranks, const int* s_prefix,
                                                int* s_count, uint32_t* s_rows) {
    const int slots = num_ranks * max_tokens;
    for (int i = static_cast<int>(threadIdx.x); i < slots; i += kThreads) s_count[i] = 0;
    __syncthreads();
    const int total = s_prefix[num_experts];
    for (int g = static_cast<int>(threadIdx.x); g < total; g += kThreads) {
        const int u = prefix_segment(s_prefix, num_experts, g);
        const int le = u / num_ranks, s = u % num_ranks;
        const int row = static_cast<int>(__ldg(layout_range + u) >> 32) + (g - s_prefix[u]);
        const int t = __ldg(src_info + static_cast<size_t>(le) * slots + row);
        if (t < 0 || t >= max_tokens) continue;  // corrupt handle: the row answers nobody
        const int at = s * max_tokens + t;
        const int pos = atomicAdd(s_count + at, 1);
        if (pos < kTopk) s_rows[at * kTopk + pos] = (static_cast<uint32_t>(le) << 16) | static_cast<uint32_t>(row);
    }
    __syncthreads();
}

// Both words of the route at `words` (relaxed: each 8-byte word is single-copy atomic and carries its own
// sequence number).
__device__ __forceinline__ ulonglong2 load_route(const uint64_t* words) {
    return make_ulonglong2(ld_relaxed_sys(words), ld_relaxed_sys(words + 1));
}

// Spin until both words of a route carry `seq` (`seen`: the words read ahead, used when they already do);
// le1 and w get its expert + 1 and weight; false on timeout (or a reported one, when bail_on_report).
__device__ __forceinline__ bool wait_route(const uint64_t* words, ulonglong2 seen, uint32_t seq, uint32_t& le1,
                                           float& w, const Deadline& deadline, const ErrorRecord* err,
                                           bool bail_on_report) {
    for (uint32_t spin = 0;; ++spin) {
        if (static_cast<uint32_t>(seen.x) == seq && static_cast<uint32_t>(seen.y) == seq) {
            le1 = static_cast<uint32_t>(seen.x >> 32);
            w = __uint_as_float(static_cast<uint32_t>(seen.y >> 32));
            return true;
        }
        if (spin > 0 && !poll_pause(spin, deadline, err, bail_on_report)) return false;
        seen = load_route(words);
    }
}

// Send phase of the partial-sum combine (see the top; after unit_prefix when there is no row map). Every
// thread calls it.
template <int kHidden, int kTopk, int kThreads, bool kLogfmt>
__device__ __forceinline__ void send_partials(const uint16_t* x, const int* src_info, const int64_t* layout_range,
                                              const int* row_map, int max_tokens, int num_experts, int num_ranks, int rank,
                                              bool self_masked, const int* s_mask, int* mask, const int* s_prefix,
                                              int* s_table, uint32_t* sym_done, uint8_t* sym_recv, uint32_t seq,
                                              uint32_t tag, bool shrink, const Deadline& deadline, ErrorRecord* err) {
    constexpr int kBlockWarps = kThreads / 32;
    using Items = PartialItems<kHidden, kThreads>;
    constexpr int kSeg = Items::kSeg;
    constexpr int kSegs = Items::kSegs;
    constexpr size_t kRowBytes = kPartialRowBytes<kHidden, kLogfmt>;
    const int lane = lane_id();
    const int slots = num_ranks * max_tokens;
    int* s_count = s_table;
    uint32_t* s_rows = reinterpret_cast<uint32_t*>(s_table + slots);
    const uint64_t* routes = partial_routes(sym_recv, num_ranks, max_tokens, kRowBytes);

    const Items items(num_ranks, max_tokens);
    const long long first = (static_cast<long long>(blockIdx.x) * kBlockWarps + threadIdx.x / 32) * items.per_warp;
    const long long last = self_masked ? 0 : min(static_cast<long long>(items.total), first + items.per_warp);
    // Lane k's route of the next (token, source) pair is read one pair ahead (the first one before the
    // table is built), so its round trip overlaps other work; wait_route only polls when it was early.
    const auto route_of = [&](int pair) {
        return routes + 2 * ((static_cast<size_t>(pair % num_ranks) * max_tokens + pair / num_ranks) * kTopk + lane);
    };
    int ahead_pair = first < last && lane < kTopk ? static_cast<int>(first / kSegs) : -1;
    ulonglong2 ahead = ahead_pair >= 0 ? load_route(route_of(ahead_pair)) : make_ulonglong2(0, 0);
    if (row_map == nullptr)
        build_row_table<kTopk, kThreads>(src_info, layout_range, max_tokens, num_experts, num_ranks, s_prefix, s_count,
                                         s_rows);
    const int num_local = num_experts / num_ranks;

    int cur = -1;                  // the (token, source) pair whose routes the lanes hold
    int my_row = -1;               // lane k: its expert's row of x ([E_local * R * T] rows), -1 for none
    float my_w = 0.0f;
    // With the row map, lane k's row is checked against the handle (inside the (expert, source) range, and
    // the source info names the token) after the row's loads are issued; these hold what the check reads.
    int my_src_token = 0;
    int64_t my_range = 0;
    uint8_t* dst = nullptr;        // the owner's row, null when nothing goes there
    for (long long item = first; item < last; ++item) {
        // Items run token-major (t, s, segment), so every SM stores to every destination (source-major
        // items left the peer's rows to half of the grid).
        const int pair = static_cast<int>(item / kSegs);
        const int t = pair / num_ranks, s = pair % num_ranks;
        const int st = s * max_tokens + t;
        if (pair != cur) {
            cur = pair;
            my_row = -1;
            my_w = 0.0f;
            bool named = false;
            // Sequence numbers start at 1, so a zero pair never matches.
            const ulonglong2 seen = ahead_pair == pair ? ahead : make_ulonglong2(0, 0);
            const int next = pair + 1;
            if (lane < kTopk && static_cast<long long>(next) * kSegs < last) {
                ahead_pair = next;
                ahead = load_route(route_of(next));
            }
            if (s_mask[s] == 0 && lane < kTopk) {
                uint32_t le1 = 0;
                float w = 0.0f;
                if (wait_route(route_of(pair), seen, seq, le1, w, deadline, err, !shrink)) {
                    if (le1 != 0) {
                        named = true;
                        my_w = w;
                        const int le = static_cast<int>(le1) - 1;
                        if (row_map != nullptr) {
                            const int row = le < num_local ? __ldg(row_map + static_cast<size_t>(st) * num_local + le) : -1;
                            if (row >= 0 && row < slots) {
                                my_row = le * slots + row;
                                my_src_token = __ldg(src_info + my_row);
                                my_range = __ldg(layout_range + le * num_ranks + s);
                            }
                        }
                        const int n = row_map != nullptr ? 0 : min(s_count[st], kTopk);
                        for (int i = 0; i < n; ++i) {
                            const uint32_t r = s_rows[st * kTopk + i];
                            if ((r >> 16) == le1 - 1u) {
                                my_row = static_cast<int>(le1 - 1u) * slots + static_cast<int>(r & 0xffffu);
                                break;
                            }
                        }
                    }
                } else {
                    peer_timed_out(mask, s, shrink, err, kOpCombineSend, rank, __LINE__, deadline);
                }
            }
            dst = nullptr;
            if (__ballot_sync(kFullMask, named) != 0)
                dst = static_cast<uint8_t*>(nvshmem_ptr(sym_recv, s)) +
                      (static_cast<size_t>(rank) * max_tokens + t) * kRowBytes;
        }
        if (dst == nullptr) continue;  // uniform over the warp
        // Each lane's 8 channels of the segment, per top-k entry. LogFMT: channels 8 i .. 8 i + 7 (the
        // encoder's mapping; lanes 16..31 idle in a one-block last segment). Float32: c0 .. c0 + 3 and
        // c1 .. c1 + 3, so that each of the warp's two 16-byte stores covers 512 contiguous bytes (with 32
        // bytes per lane in one place every store instruction wrote half of each 32-byte sector, and the
        // items ended ~12 us later; docs/design/low_latency.md).
        const int seg = static_cast<int>(item % kSegs);
        constexpr int kBlocks = kHidden / kChannelsPerBlock;
        const int nb = kLogfmt ? min(2, kBlocks - 2 * seg) : 0;
        const int c0 = seg * kSeg + lane * (kLogfmt ? 8 : 4), c1 = c0 + kSeg / 2;
        const bool a0 = kLogfmt ? lane / 16 < nb : c0 < kHidden, a1 = !kLogfmt && c1 < kHidden;
        int4 raw[kTopk];
        uint32_t have = 0;  // bit j: entry j's row is here
#pragma unroll
        for (int j = 0; j < kTopk; ++j) {
            const int row = __shfl_sync(kFullMask, my_row, j);
            raw[j] = make_int4(0, 0, 0, 0);
            if (row < 0 || !(a0 || a1)) continue;
            const uint16_t* src = x + static_cast<size_t>(row) * kHidden;
            if constexpr (kLogfmt) {
                raw[j] = ld_nc_v4_no_prefetch(src + c0);
            } else {
                const uint2 lo = a0 ? ld_nc_v2(src + c0) : make_uint2(0u, 0u);
                const uint2 hi = a1 ? ld_nc_v2(src + c1) : make_uint2(0u, 0u);
                raw[j] = make_int4(static_cast<int>(lo.x), static_cast<int>(lo.y), static_cast<int>(hi.x),
                                   static_cast<int>(hi.y));
            }
            have |= 1u << j;
        }
        if (row_map != nullptr) {
            // A row the handle does not give this (source, token) adds nothing, as a row missing from the table.
            const int row = my_row - (my_row / slots) * slots, begin = static_cast<int>(my_range >> 32);
            const bool wrong = my_row >= 0 && (my_src_token != t || row < begin ||
                                               row - begin >= static_cast<int>(my_range & 0xffffffffll));
            have &= ~__ballot_sync(kFullMask, wrong);
        }
        float part[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) part[i] = 0.0f;
#pragma unroll
        for (int j = 0; j < kTopk; ++j) {
            const float w = __shfl_sync(kFullMask, my_w, j);
            if (((have >> j) & 1u) == 0) continue;
            float v[8];
            unpack_bf16x8(raw[j], v);
#pragma unroll
            for (int i = 0; i < 8; ++i) part[i] = __fmaf_rn(v[i], w, part[i]);
        }
        if constexpr (kLogfmt) {
            // The fma chain, rounded to BF16, leaves as one wire segment.
            logfmt_encode_segment(pack_bf16x8(part), nb, dst + seg * kLogfmtSegBytes, lane);
        } else {
            float* dst_f = reinterpret_cast<float*>(dst);
            if (a0)
                st_na_v4(reinterpret_cast<int4*>(dst_f + c0), make_int4(__float_as_int(part[0]), __float_as_int(part[1]),
                                                                       __float_as_int(part[2]), __float_as_int(part[3])));
            if (a1)
                st_na_v4(reinterpret_cast<int4*>(dst_f + c1), make_int4(__float_as_int(part[4]), __float_as_int(part[5]),
                                                                       __float_as_int(part[6]), __float_as_int(part[7])));
        }
    }

    // Completion per block: the block barrier orders every thread's stores before thread 0's fence, which
    // releases them (cumulativity, as in grid_completion), then the block's word, (tag << 16) | grid size,
    // goes to every live destination at sym_done[rank * grid + block]. An owner waits for the blocks that
    // wrote its token's rows only, so its reduction need not wait for the whole grid of every source.
    __syncthreads();
    if (threadIdx.x == 0 && !self_masked) fence_acq_rel_sys();
    __syncthreads();
    if (threadIdx.x < 32 && !self_masked) {
        const uint32_t word = tag_word(tag, gridDim.x);
        uint32_t* mine = sym_done + static_cast<size_t>(rank) * gridDim.x + blockIdx.x;
        for (int d = static_cast<int>(threadIdx.x); d < num_ranks; d += 32)
            if (s_mask[d] == 0) st_relaxed_sys(static_cast<uint32_t*>(nvshmem_ptr(mine, d)), word);
    }
}

}  // namespace deepep_cupy::low_latency

// Low-latency combine with per-rank partial sums, the owner's receive phase: it adds the rows the expert
// side sent (combine_partials_send.cuh; the wire format and the split of the items: combine_partials.cuh).
//
// A warp per (token, 512-channel chunk); the first lane per rank its top-k entries name
// waits for the words of that rank's blocks that wrote (token, owner) (PartialItems gives them), and the
// warp adds, in rank order, the rows of the ranks that arrived and are not masked. So the reduction of a
// token starts once its own rows are in, not once every block of every source is done.
#pragma once

#include "low_latency/combine_partials.cuh"
#include "low_latency/buffer_map.cuh"
#include "low_latency/sync.cuh"
#include "low_latency/logfmt.cuh"
#include "low_latency/rows.cuh"

namespace deepep_cupy::low_latency {

// Waits for one completion word of `source` (send_partials; `seen`: the word read with acquire
// semantics, as wait_tag_seen takes it); false when it timed out (the source is then marked) or carries
// another grid size (reported).
__device__ __forceinline__ bool wait_block_word(const uint32_t* word, uint32_t seen, int source, uint32_t tag,
                                                int* mask, bool shrink, int rank, const Deadline& deadline,
                                                ErrorRecord* err) {
    const int grid = wait_tag_seen(seen, word, tag, deadline, err, !shrink);
    if (grid == static_cast<int>(gridDim.x & 0xffffu)) return true;
    if (grid < 0) peer_timed_out(mask, source, shrink, err, kOpCombineRecv, rank, __LINE__, deadline);
    else report_timeout(err, kOpCombineRecv, rank, source, __LINE__, deadline.elapsed_ns());
    return false;
}

// Waits for the completion words of blocks [b0, b1] of `source`'s grid.
__device__ __forceinline__ bool wait_source_blocks(const uint32_t* sym_done, int source, int b0, int b1,
                                                   uint32_t tag, int* mask, bool shrink, int rank,
                                                   const Deadline& deadline, ErrorRecord* err) {
    const uint32_t* words = sym_done + static_cast<size_t>(source) * gridDim.x;
    for (int b = b0; b <= b1; ++b) {
        // An acquire load first: a word already set (the common case by the time a warp gets here) then
        // needs no system fence.
        if (!wait_block_word(words + b, ld_acquire_sys(words + b), source, tag, mask, shrink, rank, deadline,
                             err))
            return false;
    }
    return true;
}

// Channels of one owner-side warp item (recv_partials): lane i takes channels 8 i .. 8 i + 7 of each half.
constexpr int kRecvHalves = 2;
constexpr int kRecvChunk = 256 * kRecvHalves;

// Lane k's top-k id of the token of this warp's first owner-side item (-1 past the items or top-k), read
// ahead of the prologue by a launch that only receives.
template <int kHidden, int kTopk, int kThreads>
__device__ __forceinline__ int64_t first_item_id(const int64_t* __restrict__ topk_idx, int num_tokens) {
    constexpr int kNumChunks = (kHidden + kRecvChunk - 1) / kRecvChunk;
    const int lane = lane_id();
    const long long item = static_cast<long long>(blockIdx.x) * (kThreads / 32) + static_cast<int>(threadIdx.x) / 32;
    if (lane >= kTopk || item >= static_cast<long long>(num_tokens) * kNumChunks) return -1;
    return __ldg(topk_idx + static_cast<size_t>(item / kNumChunks) * kTopk + lane);
}

// Receive phase of the partial-sum combine (see the top). Every thread of every block calls it; the
// top-k ids were checked by the caller. upfront: a launch that only receives (a receive hook), whose
// sources are long done: every block first reads all the completion words (word threadIdx.x was read
// ahead of the prologue: done_ahead) and keeps a bit per dead source in s_dead, so its warps need no
// waits of their own (a wait per warp item cost the hook ~0.7-1 us), and each warp's first item has its
// top-k ids from before the prologue (id_ahead). Otherwise every warp waits for the blocks its token needs.
template <int kHidden, int kTopk, int kThreads, bool kLogfmt>
__device__ __forceinline__ void recv_partials(const int64_t* __restrict__ topk_idx, int num_tokens, int max_tokens,
                                              int num_experts, int num_ranks, int rank, bool self_masked,
                                              const int* s_mask, int* mask, const uint32_t* sym_done,
                                              const uint8_t* sym_recv, uint16_t* out, int64_t* wait_recv_cost_stats,
                                              bool upfront, uint32_t done_ahead, int id_ahead, uint32_t* s_dead,
                                              uint32_t tag, bool shrink, const Deadline& deadline, ErrorRecord* err) {
    // A warp item is (token, 512 channels): lane i takes channels 8 i .. 8 i + 7 of each 256-channel half.
    // With 256-channel items the benchmark's 3584 items left 13% of the grid's 3168 warps two items in a
    // row, and the last block ended ~3 us after the median one.
    constexpr int kHalves = kRecvHalves;
    constexpr int kChunk = kRecvChunk;
    constexpr int kNumChunks = (kHidden + kChunk - 1) / kChunk;
    constexpr int kBatch = 2;  // ranks per round: kBatch * kHalves rows' pieces in flight per lane
    constexpr size_t kRowBytes = kPartialRowBytes<kHidden, kLogfmt>;
    const int lane = lane_id(), warp_in_block = static_cast<int>(threadIdx.x) / 32;
    const int num_local = num_experts / num_ranks;
    const PartialItems<kHidden, kThreads> items(num_ranks, max_tokens);
    if (upfront) {
        for (int i = static_cast<int>(threadIdx.x); i < (num_ranks + 31) / 32; i += kThreads) s_dead[i] = 0;
        __syncthreads();
        const int words = num_ranks * static_cast<int>(gridDim.x);
        const uint64_t t0 = globaltimer();
        for (int i = static_cast<int>(threadIdx.x); i < words; i += kThreads) {
            const int source = i / static_cast<int>(gridDim.x), b = i % static_cast<int>(gridDim.x);
            if (self_masked || s_mask[source] != 0) continue;  // not an owner in this launch's snapshot
            // Masked since the snapshot, or its word never came right: the source adds nothing.
            const bool dead = ld_volatile(mask + source) != 0 ||
                              !wait_block_word(sym_done + i, i == static_cast<int>(threadIdx.x) ? done_ahead : 0u,
                                               source, tag, mask, shrink, rank, deadline, err);
            if (dead) atomicOr(s_dead + source / 32, 1u << (source % 32));
            else if (wait_recv_cost_stats != nullptr && blockIdx.x == 0 && b == static_cast<int>(gridDim.x) - 1)
                atomicAdd(reinterpret_cast<unsigned long long*>(wait_recv_cost_stats + source),
                          static_cast<unsigned long long>(globaltimer() - t0));
        }
        __syncthreads();
    }

    const long long total_warps = static_cast<long long>(gridDim.x) * (kThreads / 32);
    const long long gwarp = static_cast<long long>(blockIdx.x) * (kThreads / 32) + warp_in_block;
    // The item loop is compiled twice: without the per-item waits, an upfront launch keeps its registers
    // (with them, its reduction spilled and the receive hook took ~1 us longer).
    const auto reduce_items = [&](auto waits) {
        constexpr bool kWaits = decltype(waits)::value;
        for (long long item = gwarp; item < static_cast<long long>(num_tokens) * kNumChunks; item += total_warps) {
            const int t = static_cast<int>(item / kNumChunks);
            const int col0 = static_cast<int>(item % kNumChunks) * kChunk + lane * 8;  // half h: col0 + 256 h
            // Lane k: the rank of its expert, -1 for none (or a masked rank). The ranks named, each once, in
            // rank order; the first lane of each waits for the blocks of that rank that wrote (t, this rank),
            // and a rank whose wait fails adds nothing.
            int owner = -1;
            if (lane < kTopk && !self_masked) {
                const int64_t id = !kWaits && item == gwarp ? id_ahead
                                                             : __ldg(topk_idx + static_cast<size_t>(t) * kTopk + lane);
                if (id >= 0 && id < num_experts) {
                    const int o = static_cast<int>(id / num_local);
                    if (s_mask[o] == 0) owner = o;
                }
            }
            const uint32_t same = __match_any_sync(kFullMask, owner);
            bool first_of_rank = owner >= 0 && __ffs(same) - 1 == lane;
            if (!kWaits && first_of_rank) {
                first_of_rank = ((s_dead[owner / 32] >> (owner % 32)) & 1u) == 0;
            } else if (kWaits && first_of_rank) {
                const int pair = t * num_ranks + rank;  // in the source's item order
                const uint64_t t0 = globaltimer();
                first_of_rank = ld_volatile(mask + owner) == 0 &&
                                wait_source_blocks(sym_done, owner, items.block_of(pair * items.kSegs),
                                                   items.block_of((pair + 1) * items.kSegs - 1), tag, mask, shrink, rank,
                                                   deadline, err);
                if (first_of_rank && wait_recv_cost_stats != nullptr)
                    atomicAdd(reinterpret_cast<unsigned long long*>(wait_recv_cost_stats + owner),
                              static_cast<unsigned long long>(globaltimer() - t0));
            }
            __syncwarp();  // the rows of a rank are read by every lane, after its first lane's acquire
            const uint32_t firsts = __ballot_sync(kFullMask, first_of_rank);
            int pos = 0;  // ranks named before this lane's, in rank order
            for (uint32_t m = firsts; m != 0; m &= m - 1) {
                const int o = __shfl_sync(kFullMask, owner, __ffs(m) - 1);
                if (o < owner) ++pos;
            }
            const int named = __popc(firsts);

            float acc[kHalves][8];
    #pragma unroll
            for (int h = 0; h < kHalves; ++h)
    #pragma unroll
                for (int i = 0; i < 8; ++i) acc[h][i] = 0.0f;
            for (int j0 = 0; j0 < named; j0 += kBatch) {
                int4 lo[kBatch][kHalves], hi[kBatch][kHalves];
                LogfmtPiece piece[kLogfmt ? kBatch : 1][kHalves];
                uint32_t have = 0;  // bit j * kHalves + h: rank j0 + j's half h is loaded
    #pragma unroll
                for (int j = 0; j < kBatch; ++j) {
                    const uint32_t at = __ballot_sync(kFullMask, first_of_rank && pos == j0 + j);
                    const int o = __shfl_sync(kFullMask, owner, at != 0 ? __ffs(at) - 1 : 0);
                    const uint8_t* row = sym_recv + (static_cast<size_t>(o) * max_tokens + t) * kRowBytes;
    #pragma unroll
                    for (int h = 0; h < kHalves; ++h) {
                        const int col = col0 + 256 * h;
                        if (at == 0 || col >= kHidden) continue;
                        have |= 1u << (j * kHalves + h);
                        if constexpr (kLogfmt) {
                            piece[j][h] = logfmt_load8<kHidden / kChannelsPerBlock>(row, col);
                        } else {
                            lo[j][h] = ld_cg_v4(reinterpret_cast<const float*>(row) + col);
                            hi[j][h] = ld_cg_v4(reinterpret_cast<const float*>(row) + col + 4);
                        }
                    }
                }
    #pragma unroll
                for (int j = 0; j < kBatch; ++j) {
    #pragma unroll
                    for (int h = 0; h < kHalves; ++h) {
                        if (((have >> (j * kHalves + h)) & 1u) == 0) continue;
                        float v[8];
                        if constexpr (kLogfmt) {
                            logfmt_decode8(piece[j][h], v);
                        } else {
                            v[0] = __int_as_float(lo[j][h].x), v[1] = __int_as_float(lo[j][h].y);
                            v[2] = __int_as_float(lo[j][h].z), v[3] = __int_as_float(lo[j][h].w);
                            v[4] = __int_as_float(hi[j][h].x), v[5] = __int_as_float(hi[j][h].y);
                            v[6] = __int_as_float(hi[j][h].z), v[7] = __int_as_float(hi[j][h].w);
                        }
    #pragma unroll
                        for (int i = 0; i < 8; ++i) acc[h][i] = __fadd_rn(acc[h][i], v[i]);
                    }
                }
            }
    #pragma unroll
            for (int h = 0; h < kHalves; ++h) {
                const int col = col0 + 256 * h;
                if (col < kHidden)
                    st_na_v4(reinterpret_cast<int4*>(out + static_cast<size_t>(t) * kHidden + col), pack_bf16x8(acc[h]));
            }
        }
    };
    if (upfront) reduce_items(std::integral_constant<bool, false>{});
    else reduce_items(std::integral_constant<bool, true>{});
}

}  // namespace deepep_cupy::low_latency

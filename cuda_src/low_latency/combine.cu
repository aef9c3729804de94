// Low-latency combine: each rank returns the expert outputs of the rows it received in the dispatch to
// their source ranks, which reduce them with the top-k weights:
//   out[t] = bf16( sum over ranks r in rank order of part_r ), float32, where part_r is the fma chain
//   over the k = 0..K-1 whose expert is on r of (row(t, k), weight[t, k]), one rounding per fma.
//
// Send phase. A unit is (local expert, destination rank), described by the dispatch handle (layout_range
// gives the rows, src_info the token each row answers); a row lands in the slot [global expert][token]
// of the destination's receive area, as BF16 or LogFMT-10. It first waits for the destinations'
// receipts of the call before it on the half (receipts.cuh).
//   * Every live destination reached by stores (NVLink): units hold very different row counts, so the
//     grid shares (row, 256-channel segment) items out evenly over the prefix sum of the unit row counts
//     (a unit per warp group left most of the grid idle behind the largest units). Every block fences
//     its stores and bumps a counter; the last block publishes the tags of all units.
//   * Otherwise (puts): one unit per warp group, a row per warp: stage, put, signal, then the unit's tag.
// Receive phase: the block's warps wait for the experts' tags together (one lane per expert, each
// polled by a single thread, backing off) and publish an "arrived" bitmap in shared memory; then every
// warp reduces (token, 256-channel chunk) items: it loads the K rows (all in flight) and accumulates
// them per rank in rank order, each rank's part in k order (the order of the reference). On the RMA
// path, units of the receive phase first turn put-with-signal counters into local ready flags. Once the
// grid is done reading, it leaves its receipt with every rank. See buffer_map.cuh for the protocol.
// kPartials (the host's choice, the same on every rank; never with hooks): both phases send and add
// per-rank partial sums instead (combine_partials.cuh), float32 or LogFMT-10 rows of the BF16 sums.
//
// Top-k ids outside [-1, E) contribute nothing, like -1; the warps check every id once over the grid and
// report a bad one as a value error (op kValueOpLowLatencyCombine; the first report wins).
#include "common/nvshmem_includes.cuh"
#include "common/value_errors.cuh"
#include "low_latency/args.cuh"
#include "low_latency/rows.cuh"
#include "low_latency/logfmt.cuh"
#include "low_latency/combine_send_p2p.cuh"
#include "low_latency/combine_partials_send.cuh"
#include "low_latency/combine_partials_recv.cuh"
#include "low_latency/receipts.cuh"

namespace deepep_cupy::low_latency {

// The phases compiled into this module (kernel_names.LL_*): a define, not a template argument, so that a
// hook's send and receive parts are two modules whose kernels have one name (see dispatch.cu).
#ifndef DEEPEP_CUPY_LL_PHASES
#define DEEPEP_CUPY_LL_PHASES 3
#endif
constexpr int kPhases = DEEPEP_CUPY_LL_PHASES;

template <int kHidden, int kTopk, int kWarps, int kGroups, bool kLogfmt, bool kPartials>
__global__ void __launch_bounds__(kWarps* kGroups * 32, 1)
    combine(const __grid_constant__ CombineArgs args) {
    constexpr int kGroupThreads = GroupCoords<kWarps, kGroups>::kGroupThreads;
    constexpr int kBlockWarps = kWarps * kGroups;
    constexpr int kThreads = kBlockWarps * 32;
    constexpr int kSlotBytes = 2 * kHidden;
    constexpr int kRowBytes = kLogfmt ? (kHidden / kChannelsPerBlock) * kLogfmtBlockBytes : 2 * kHidden;
    constexpr int kChunk = 32 * 8;  // channels per warp item in the reduction
    constexpr int kNumChunks = (kHidden + kChunk - 1) / kChunk;
    constexpr int kBatchMax = kLogfmt ? 4 : 8;  // top-k rows in flight; 8 LogFMT pieces would spill
    constexpr int kBatch = kTopk < kBatchMax ? kTopk : kBatchMax;
    static_assert(!kLogfmt || kHidden % kChannelsPerBlock == 0, "LogFMT combine needs hidden % 128 == 0");
    static_assert(kHidden % 8 == 0, "hidden must be a multiple of 8");
    static_assert(kTopk >= 1 && kTopk <= 32, "the combine waits for one expert per lane: top-k <= 32");
    static_assert(kGroups >= 1 && kGroups <= 15 && kWarps >= 1 && kWarps * kGroups <= 32, "bad warp split");
    static_assert(kRowBytes <= kSlotBytes, "row must fit a slot");
    static_assert(kPhases >= 1 && kPhases <= (kPhaseSend | kPhaseRecv), "kPhases: a mask of phases");
    // Phases outside kPhases are compiled out: a hook's parts run kernels that hold only their own
    // phase's code (kernel_names.LL_SEND, LL_RECV).
    const int phases = args.phases & kPhases;

    __shared__ int s_mask[kMaxRanks];
    __shared__ int s_sent[kGroups];
    __shared__ uint32_t s_arrived[kMaxExperts / 32];
    __shared__ int s_prefix[kMaxExperts + 1];
    __shared__ int s_warp_sum[kBlockWarps];
    __shared__ int s_last;
    __shared__ uint32_t s_seq[2];
    extern __shared__ int s_table[];  // kPartials: the send's row table (combine_partials_send.cuh), R * T * (K + 1) ints
    const GroupCoords<kWarps, kGroups> at;
    const int warp_in_block = at.warp_in_block, lane = at.lane, group = at.group, warp = at.warp;
    const int gthread = at.gthread, barrier_id = at.barrier_id, total_groups = at.total_groups, gid = at.gid;
    const int num_local_experts = args.num_experts / args.num_ranks;
    const int slab = args.num_ranks * args.max_tokens;
    const bool bail = !args.shrink;
    // A partial-sum launch that only receives reads its warp's first item's top-k ids ahead (issued first:
    // the acquire below holds back later loads); in a receive hook they were a round trip after the prologue.
    const int64_t item_id_raw = kPartials && (phases & kPhaseRecv) && !(phases & kPhaseSend)
                                    ? first_item_id<kHidden, kTopk, kThreads>(args.topk_idx, args.num_tokens)
                                    : -1;
    // Stage B's first tag words, read ahead of the prologue (thread i waits for expert i there), and the
    // send's unit ranges. The partial-sum path reads its sources' block words instead, and only in a launch
    // that only receives (recv_partials' upfront case).
    const uint32_t tag_ahead = kPartials ? read_tag_ahead((phases & kPhaseSend) ? 0 : phases, args.sym_done,
                                                          args.num_ranks * static_cast<int>(gridDim.x))
                                         : read_tag_ahead(phases, args.sym_tags, args.num_experts);
    // (Narrowed after the acquire is issued: an id outside [0, E) selects nothing, like -1.)
    const int item_id_ahead = item_id_raw >= 0 && item_id_raw < args.num_experts ? static_cast<int>(item_id_raw) : -1;
    const int64_t range_ahead =
        (phases & kPhaseSend) && static_cast<int>(threadIdx.x) < args.num_experts ? __ldg(args.layout_range + threadIdx.x) : 0;
    begin_launch(phases, args.seq_state, args.mask, args.num_ranks, s_seq, s_mask);
    const Deadline deadline(args.timeout_ns);
    const bool self_masked = s_mask[args.rank] != 0;

    // ------------------------------------------------------------------ send
    if (phases & kPhaseSend)
        wait_receipts(args.sym_receipts, s_seq[0], s_mask, args.num_ranks, self_masked, args.mask, args.shrink != 0,
                      args.err, kOpCombineSend, args.rank, deadline);
    if (kPartials && (phases & kPhaseSend)) {
        const uint32_t tag = seq_tag(s_seq[0]);
        publish_routes<kTopk, kThreads>(args.topk_idx, args.topk_weights, args.num_tokens, args.max_tokens, args.num_experts, args.num_ranks, args.rank,
                                        kPartialRowBytes<kHidden, kLogfmt>, self_masked, s_mask, args.sym_recv, s_seq[0],
                                        args.err);
        if (args.row_map == nullptr)  // the send builds its row table from the prefix
            unit_prefix<kThreads>(args.layout_range, range_ahead, args.num_experts, args.num_ranks, args.max_tokens, self_masked, s_mask,
                                  s_prefix, s_warp_sum);
        send_partials<kHidden, kTopk, kThreads, kLogfmt>(args.x, args.src_info, args.layout_range, args.row_map, args.max_tokens, args.num_experts, args.num_ranks,
                                                         args.rank, self_masked, s_mask, args.mask, s_prefix, s_table, args.sym_done,
                                                         args.sym_recv, s_seq[0], tag, args.shrink != 0, deadline, args.err);
    } else if (phases & kPhaseSend) {
        const uint32_t tag = seq_tag(s_seq[0]);
        // Stores when every rank is reachable by them. Masked ranks count too: all blocks must take the
        // same path for the completion count, whatever their mask snapshot.
        bool all_p2p = !args.force_rma;
        for (int r = static_cast<int>(threadIdx.x); all_p2p && r < args.num_ranks; r += kThreads)
            if (nvshmem_ptr(args.sym_recv, r) == nullptr) all_p2p = false;
        all_p2p = __syncthreads_and(all_p2p) != 0;
        if (all_p2p) {
            send_p2p<kHidden, kLogfmt, kThreads>(args.x, args.src_info, args.layout_range, range_ahead, args.max_tokens, args.num_experts,
                                                 args.num_ranks, args.rank, self_masked, s_mask, s_prefix, s_warp_sum, &s_last,
                                                 args.sym_tags, args.sym_recv, args.seq_state + 4, tag);
        } else {
            for (int u = gid; u < args.num_experts; u += total_groups) {
                const int le = u / args.num_ranks;
                const int dst = u % args.num_ranks;
                if (self_masked || s_mask[dst] != 0) continue;  // uniform over the group
                const int e = args.rank * num_local_experts + le;
                const int begin = static_cast<int>(args.layout_range[u] >> 32);
                const int count = unit_rows_of(__ldg(args.layout_range + u), u, args.num_ranks, args.max_tokens, self_masked, s_mask);
                uint8_t* peer_recv = args.force_rma ? nullptr : static_cast<uint8_t*>(nvshmem_ptr(args.sym_recv, dst));
                const bool p2p = peer_recv != nullptr;
                if (gthread == 0) s_sent[group] = 0;
                named_barrier_sync(barrier_id, kGroupThreads);

                int sent = 0;  // rows this warp returned (lane 0's count is the one that matters)
                for (int i = warp; i < count; i += kWarps) {
                    const int row = begin + i;
                    const int t = __ldg(args.src_info + static_cast<size_t>(le) * slab + row);
                    if (t < 0 || t >= args.max_tokens) continue;  // corrupt handle: skip rather than write out of bounds
                    const uint16_t* src_row = args.x + (static_cast<size_t>(le) * slab + row) * kHidden;
                    const size_t slot = static_cast<size_t>(e) * args.max_tokens + t;
                    if (p2p) {
                        uint8_t* dst_row = peer_recv + slot * kSlotBytes;
                        if constexpr (kLogfmt) logfmt_encode_row<kHidden, Load::kNonCoherent>(src_row, dst_row, lane);
                        else warp_copy<kHidden * 2 / 16, Load::kNonCoherent>(dst_row, src_row, lane);
                    } else {
                        uint8_t* stage_row = args.sym_send + (static_cast<size_t>(le) * slab + row) * kSlotBytes;
                        if constexpr (kLogfmt) {
                            // In place when zero-copy (src_row is stage_row): coherent loads.
                            logfmt_encode_row<kHidden, Load::kPlain>(src_row, stage_row, lane);
                        } else if (!args.zero_copy) {
                            warp_copy<kHidden * 2 / 16, Load::kNonCoherent>(stage_row, src_row, lane);
                        }
                        __threadfence_system();  // the transport may read the staged row with a copy engine or NIC
                        __syncwarp();
                        nvshmemx_putmem_nbi_warp(args.sym_recv + slot * kSlotBytes, stage_row, kRowBytes, dst);
                        __threadfence_system();  // whatever lanes stored for the put is ordered before the signal
                        __syncwarp();
                        if (lane == 0) {
                            nvshmem_fence();
                            nvshmemx_signal_op(args.sym_arrivals + e, 1, NVSHMEM_SIGNAL_ADD, dst);
                        }
                        __syncwarp();
                    }
                    ++sent;
                }
                if (lane == 0 && sent > 0) atomicAdd(&s_sent[group], sent);
                if (p2p) __threadfence_system();
                named_barrier_sync(barrier_id, kGroupThreads);
                if (gthread == 0) {
                    const uint32_t word = tag_word(tag, static_cast<uint32_t>(s_sent[group]));
                    if (p2p) {
                        st_release_sys(static_cast<uint32_t*>(nvshmem_ptr(args.sym_tags + e, dst)), word);
                    } else {
                        nvshmem_int_atomic_set(reinterpret_cast<int*>(args.sym_tags + e), static_cast<int>(word), dst);
                    }
                }
                named_barrier_sync(barrier_id, kGroupThreads);  // s_sent is reused by the next unit
            }
        }
    }
    if ((phases & kPhaseSend) && args.count_sends)  // an early receive follows (receipts.cuh)
        count_send(args.sym_sent, args.num_ranks, args.rank, s_mask, self_masked, args.force_rma != 0, args.seq_state + 7, &s_last);

    // ------------------------------------------------------------------ receive
    if (phases & kPhaseRecv) {
        const uint32_t tag = seq_tag(s_seq[1]);
        const uint64_t t_start = globaltimer();

        // Stage A (thread 0 of each group, one global expert at a time): RMA owners -> local ready flag;
        // wait-time statistics for every owner when requested.
        if (!kPartials && gthread == 0 && !self_masked) {
            for (int e = gid; e < args.num_experts; e += total_groups) {
                const int owner = e / num_local_experts;
                if (s_mask[owner] != 0) continue;
                const bool p2p = !args.force_rma && nvshmem_ptr(args.sym_tags, owner) != nullptr;
                if (p2p && args.wait_recv_cost_stats == nullptr) continue;
                int cnt = wait_tag(args.sym_tags + e, tag, deadline, args.err, bail);
                if (cnt >= 0 && !p2p) {
                    const uint64_t base = args.arrival_base[e];
                    if (cnt == 0 || wait_arrivals(args.sym_arrivals + e, base, static_cast<uint64_t>(cnt), deadline, args.err, bail))
                        args.arrival_base[e] = base + static_cast<uint64_t>(cnt);
                    else
                        cnt = -1;
                }
                if (cnt < 0) {
                    peer_timed_out(args.mask, owner, args.shrink != 0, args.err, kOpCombineRecv, args.rank, __LINE__, deadline);
                } else if (args.wait_recv_cost_stats != nullptr) {
                    atomicAdd(reinterpret_cast<unsigned long long*>(args.wait_recv_cost_stats + owner),
                              static_cast<unsigned long long>(globaltimer() - t_start));
                }
                // Always release the reducers; they re-check the mask (and give up on their own after a
                // reported timeout).
                if (!p2p) st_release_gpu(args.ready + e, tag);
            }
        }

        // The top-k ids stage C will read, each checked once over the grid; a bad one is reported (stage C
        // itself only drops bad ids, so its loop carries nothing more). The partial-sum path checks them in
        // its send phase (publish_routes).
        if constexpr (!kPartials) {
            const long long stride = static_cast<long long>(gridDim.x) * kThreads;
            BadValue bad;
            for (long long i = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
                 i < static_cast<long long>(args.num_tokens) * kTopk; i += stride)
                bad.check_expert_id(__ldg(args.topk_idx + i), args.num_experts);
            bad.report_from_warp(args.err, kValueOpLowLatencyCombine, args.rank, __LINE__);
        }
        if constexpr (kPartials) {
            recv_partials<kHidden, kTopk, kThreads, kLogfmt>(args.topk_idx, args.num_tokens, args.max_tokens, args.num_experts, args.num_ranks,
                                                             args.rank, self_masked, s_mask, args.mask, args.sym_done, args.sym_recv, args.out,
                                                             args.wait_recv_cost_stats, (phases & kPhaseSend) == 0,
                                                             tag_ahead, item_id_ahead, s_arrived, tag, args.shrink != 0,
                                                             deadline, args.err);
            publish_receipts(args.sym_receipts, s_seq[1], args.num_ranks, args.rank, s_mask, args.force_rma != 0,
                             args.seq_state + 6, &s_last, args.count_sends ? args.sym_sent : nullptr);
            return;
        }

        // Stage B: the block learns which experts have arrived, one lane per expert spread over all its
        // warps (each word polled by a single thread with backoff, and one acquire fence per word), so the
        // reducing warps never poll. Waiting for 32 experts per warp in parallel rather than one warp
        // walking all of them in turn keeps the check short once the data is there (the receive hook's
        // case). A block waits for every expert, not only its tokens' ones: all senders publish every
        // expert at once, so this costs nothing in the end-to-end time.
        __syncthreads();  // stage A's ready flags are set by this block's threads too
        for (int e0 = warp_in_block * 32; e0 < args.num_experts; e0 += kThreads) {
            const int e = e0 + lane;
            bool ok = false;
            if (e < args.num_experts && !self_masked) {
                const int owner = e / num_local_experts;
                if (s_mask[owner] == 0 && ld_volatile(args.mask + owner) == 0) {
                    const bool p2p = !args.force_rma && nvshmem_ptr(args.sym_tags, owner) != nullptr;
                    const uint32_t seen = e == static_cast<int>(threadIdx.x) ? tag_ahead : 0u;
                    ok = p2p ? wait_tag_seen(seen, args.sym_tags + e, tag, deadline, args.err, bail) >= 0
                             : wait_ready(args.ready + e, tag, deadline, args.err, bail);
                    if (!ok) {
                        peer_timed_out(args.mask, owner, args.shrink != 0, args.err, kOpCombineRecv, args.rank, __LINE__, deadline);
                    } else if (!p2p && ld_volatile(args.mask + owner) != 0) {
                        ok = false;  // stage A gave up on the owner
                    }
                }
            }
            const uint32_t bits = __ballot_sync(kFullMask, ok);
            if (lane == 0) s_arrived[e0 / 32] = bits;
        }
        __syncthreads();

        // Stage C: reduction, one (token, chunk) item per warp; the rows of a batch of top-k entries are all
        // loaded before the first is used.
        const int total_warps = total_groups * kWarps;
        const int gwarp = gid * kWarps + warp;
        for (int item = gwarp; item < args.num_tokens * kNumChunks; item += total_warps) {
            const int t = item / kNumChunks;
            const int col = (item % kNumChunks) * kChunk + lane * 8;
            const bool active = col < kHidden;

            // Lane k holds expert topk_idx[t, k]; -1 means "contributes nothing". The range check is done
            // on the 64-bit id: narrowing first could turn a huge id into a valid one.
            int expert = -1;
            if (lane < kTopk) {
                const int64_t id = __ldg(args.topk_idx + static_cast<size_t>(t) * kTopk + lane);
                if (id >= 0 && id < args.num_experts) {
                    expert = static_cast<int>(id);
                    if (((s_arrived[expert / 32] >> (expert % 32)) & 1u) == 0) expert = -1;
                }
            }
            const float weight = expert >= 0 ? __ldg(args.topk_weights + static_cast<size_t>(t) * kTopk + lane) : 0.0f;
            // BF16: the sum is grouped by rank, in rank order, each rank's part an fma chain in top-k order
            // (the order of the partial-sum path and of the reference, so every BF16 path gives the same
            // bits): entry j of the loop below is the lane `order` names at place j in (rank, k) order among
            // the valid ones. Shuffles of unrolled loops, no ballots per entry: this runs once per (token,
            // chunk) item, so its instructions count. LogFMT values are approximate (the tests compare
            // within a tolerance), and its decode is issue-bound: one fma chain in top-k order.
            constexpr bool kRankOrder = !kLogfmt;
            const int owner = expert >= 0 ? expert / num_local_experts : -1;
            int order = lane;  // lane p: the lane at place p (p < num_valid)
            int num_valid = kTopk;
            if constexpr (kRankOrder) {
                const uint32_t key =
                    expert >= 0 ? (static_cast<uint32_t>(owner) << 5) | static_cast<uint32_t>(lane) : ~0u;
                int place = 0;
#pragma unroll
                for (int x = 0; x < kTopk; ++x) place += __shfl_sync(kFullMask, key, x) < key ? 1 : 0;
                order = 0;
#pragma unroll
                for (int x = 0; x < kTopk; ++x) {
                    const int place_x = __shfl_sync(kFullMask, place, x);  // both shuffles on every lane
                    const uint32_t key_x = __shfl_sync(kFullMask, key, x);
                    if (place_x == lane && key_x != ~0u) order = x;
                }
                num_valid = __popc(__ballot_sync(kFullMask, expert >= 0));
            }

            float acc[8], part[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] = part[i] = 0.0f;
            int part_owner = -1;
#pragma unroll
            for (int k0 = 0; k0 < kTopk; k0 += kBatch) {
                int4 raw[kBatch];
                LogfmtPiece piece[kLogfmt ? kBatch : 1];
                // The lane of entry k0 + j (warp-uniform), shuffled again after the loads rather than kept:
                // registers go to the rows in flight.
#pragma unroll
                for (int j = 0; j < kBatch; ++j) {
                    const int src = __shfl_sync(kFullMask, order, (k0 + j) & 31);
                    const int e = __shfl_sync(kFullMask, expert, src);
                    if ((kRankOrder ? k0 + j < num_valid : e >= 0) && active) {
                        const uint8_t* row = args.sym_recv + (static_cast<size_t>(e) * args.max_tokens + t) * kSlotBytes;
                        if constexpr (kLogfmt) piece[j] = logfmt_load8<kHidden / kChannelsPerBlock>(row, col);
                        else raw[j] = ld_cg_v4(row + static_cast<size_t>(col) * 2);
                    }
                }
#pragma unroll
                for (int j = 0; j < kBatch; ++j) {
                    // Shuffles before the (lane-dependent) skip: every lane takes part.
                    const int src = __shfl_sync(kFullMask, order, (k0 + j) & 31);
                    const float w = __shfl_sync(kFullMask, weight, src);
                    const int o = __shfl_sync(kFullMask, kRankOrder ? owner : expert, src);  // LogFMT: the expert
                    if (!(kRankOrder ? k0 + j < num_valid : o >= 0) || !active) continue;
                    float v[8];
                    if constexpr (kLogfmt) logfmt_decode8(piece[j], v);
                    else unpack_bf16x8(raw[j], v);
                    if constexpr (!kRankOrder) {
#pragma unroll
                        for (int i = 0; i < 8; ++i) acc[i] = __fmaf_rn(v[i], w, acc[i]);
                        continue;
                    }
                    if (o != part_owner) {
                        if (part_owner >= 0) {
#pragma unroll
                            for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], part[i]);
                        }
#pragma unroll
                        for (int i = 0; i < 8; ++i) part[i] = 0.0f;
                        part_owner = o;
                    }
#pragma unroll
                    for (int i = 0; i < 8; ++i) part[i] = __fmaf_rn(v[i], w, part[i]);
                }
            }
            if (part_owner >= 0) {
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], part[i]);
            }
            if (active) st_na_v4(reinterpret_cast<int4*>(args.out + static_cast<size_t>(t) * kHidden + col), pack_bf16x8(acc));
        }
        publish_receipts(args.sym_receipts, s_seq[1], args.num_ranks, args.rank, s_mask, args.force_rma != 0,
                         args.seq_state + 6, &s_last, args.count_sends ? args.sym_sent : nullptr);
    }
}

}  // namespace deepep_cupy::low_latency

// Low-latency dispatch: every rank sends each token to the ranks of its top-k experts, packed per local
// expert on the receiver, grouped by source rank, each group in source token order (deterministic). The
// receiver's own group comes first, then the other sources cyclically (rank + 1, ..., rank - 1): see
// source_position in indexing.cuh.
//
// One message per (token, destination rank) where the host chose that format (every rank reachable by
// stores and the tables fit; dispatch_ranks.cuh): the token crosses the link once per rank and the
// receiver copies it into the rows of each local expert it picked. Otherwise one row per (token, expert):
// Send over stores (every rank reachable through NVLink, routing bitmap small enough): the grid shares
// (token, segment) items evenly, each segment read and cast once and stored to all of the token's
// experts; see dispatch_p2p.cuh.
// Otherwise, and for the receive phase: kGroups warp groups of kWarps warps per block, one unit per
// group (looping when there are more units than groups). The send phase has one unit per global expert
// e: the group scans the routing for the tokens that pick e, in token order, so the i-th of them is
// row i of this rank's block in the receiver's slab; warps take rows round-robin and write them
// straight into the receiver's slot (NVLink), casting to FP8 on the way, or put staged messages (any
// transport). The receive phase has one unit per (local expert, source rank): it waits for the counts of the sources
// before it in the slab's order (its rows start after theirs), then copies its rows into the packed outputs.
// See buffer_map.cuh for the buffer map and the completion protocol.
//
// Top-k ids outside [-1, E) never equal the expert a group scans for, so they select nothing, like -1.
// The group that scans for this rank's first local expert (never skipped unless this rank is masked)
// also reports one of them as a value error (op kValueOpLowLatencyDispatch); every group pays the same
// compare per id, which keeps the scan loop free of branches.
#include "common/nvshmem_includes.cuh"
#include "common/value_errors.cuh"
#include "low_latency/args.cuh"
#include "low_latency/buffer_map.cuh"
#include "low_latency/indexing.cuh"
#include "low_latency/sync.cuh"
#include "low_latency/rows.cuh"
#include "low_latency/dispatch_ranks.cuh"
#include "low_latency/receipts.cuh"

namespace deepep_cupy::low_latency {

// The phases compiled into this module (kernel_names.LL_*), and whether only the per-rank message format is
// (a hook's receive part, where the host chose that format: less code to fetch per launch). Defines, not
// template arguments: a hook's send and receive parts are then two modules whose kernels have one name, as
// profilers (and DeepEP's tests, which count a profile's rows by name) expect of one op.
#ifndef DEEPEP_CUPY_LL_PHASES
#define DEEPEP_CUPY_LL_PHASES 3
#endif
#ifndef DEEPEP_CUPY_LL_RANK_MSGS_ONLY
#define DEEPEP_CUPY_LL_RANK_MSGS_ONLY 0
#endif
constexpr int kPhases = DEEPEP_CUPY_LL_PHASES;
constexpr bool kRankMsgsOnly = DEEPEP_CUPY_LL_RANK_MSGS_ONLY != 0;

// Symmetric pointers (sym_*) are this rank's addresses of the buffer half the call uses.
template <int kHidden, int kTopk, int kWarps, int kGroups, bool kFP8>
__global__ void __launch_bounds__(kWarps* kGroups * 32, 1)
    dispatch(const __grid_constant__ DispatchArgs args) {
    constexpr int kGroupThreads = GroupCoords<kWarps, kGroups>::kGroupThreads;
    constexpr int kNumScales = kHidden / kChannelsPerBlock;
    constexpr int kSlotBytes = 2 * kHidden;
    constexpr int kDataBytes = kFP8 ? kHidden : 2 * kHidden;
    constexpr int kMsgBytes = kFP8 ? align16(kHidden + 4 * kNumScales) : 2 * kHidden;
    static_assert(!kFP8 || kHidden % kChannelsPerBlock == 0, "FP8 dispatch needs hidden % 128 == 0");
    static_assert(kHidden % 8 == 0, "hidden must be a multiple of 8");
    static_assert(kGroups >= 1 && kGroups <= 15 && kWarps >= 1 && kWarps * kGroups <= 32, "bad warp split");
    static_assert(kMsgBytes <= kSlotBytes, "message must fit a slot");
    static_assert(kPhases >= 1 && kPhases <= (kPhaseSend | kPhaseRecv), "kPhases: a mask of phases");
    const int phases = args.phases & kPhases;  // as in combine.cu: the other phase's code is compiled out

    __shared__ uint32_t s_chunks[kGroups][kMaxTokenChunks];
    __shared__ int s_mask[kMaxRanks];
    __shared__ int s_unit[kGroups][3];
    __shared__ uint32_t s_seq[2];
    __shared__ uint32_t s_hits[kTopk <= 32 ? kMaxHitWords : 1];
    __shared__ int s_last;
    __shared__ int s_warp_sum[kWarps * kGroups];
    __shared__ uint8_t* s_peer_recv[kMaxRanks];  // per-rank messages: every rank's address of sym_recv

    const GroupCoords<kWarps, kGroups> at;
    const int lane = at.lane, group = at.group, warp = at.warp;
    const int gthread = at.gthread, barrier_id = at.barrier_id, total_groups = at.total_groups, gid = at.gid;
    const int num_local_experts = args.num_experts / args.num_ranks;
    const int slab = args.num_ranks * args.max_tokens;
    const bool bail = !args.shrink;

    // Stores to every rank (masked ones too: all blocks must agree, whatever their mask snapshot): the
    // grid-wide splits of dispatch_p2p.cuh, where the routing bitmap (send) or the unit prefix sums
    // (receive) fit shared memory. BF16 rows stay on the per-expert path: measured faster there (43
    // against 74 us at 128 x 7168).
    // One message per (token, destination rank) when the host chose that format (rank_msgs: the same
    // decision on every rank; see dispatch_ranks.cuh).
    static_assert(!kRankMsgsOnly || kTopk <= 32, "per-rank messages need top-k <= 32");
    const bool ranks = kTopk <= 32 && (kRankMsgsOnly || args.rank_msgs != 0);
    uint32_t* rank_tags = reinterpret_cast<uint32_t*>(args.sym_arrivals);
    const bool fits = kFP8 && kTopk <= 32 && !args.force_rma && args.num_experts * ((args.num_tokens + 31) / 32) <= kMaxHitWords;
    constexpr int kIdsAhead = 2;
    SendAhead<kIdsAhead> ahead;
    if constexpr (kTopk <= 32) {
        if ((ranks || fits) && (phases & kPhaseSend))
            dispatch_send_ahead<kHidden, kTopk, kWarps * kGroups * 32>(
                args.x, args.topk_idx, args.num_tokens, ranks ? args.num_experts + args.num_ranks : args.num_experts, s_hits, ahead);
    }
    // The peers' receive areas, looked up once per block while thread 0 runs the prologue's round trips
    // (rank r goes to thread kThreads - 1 - r, wrapping past kThreads ranks), not once per send item.
    constexpr int kThreads = kWarps * kGroups * 32;
    for (int r = kThreads - 1 - static_cast<int>(threadIdx.x); ranks && (phases & kPhaseSend) && r < args.num_ranks;
         r += kThreads)
        s_peer_recv[r] = static_cast<uint8_t*>(nvshmem_ptr(args.sym_recv, r));
    // The receive phase's first count, read ahead too.
    const uint32_t tag_ahead =
        ranks ? read_tag_ahead(phases, rank_tags, args.num_ranks) : read_tag_ahead(phases, args.sym_tags, args.num_experts);
    // Per-rank messages: the (source, expert) count words too (tagged, so a word read early is usable
    // when it carries this launch's tag).
    const uint32_t count_ahead = ranks ? read_word_ahead(phases, args.sym_tags, args.num_experts) : 0u;
    bool all_p2p = kTopk <= 32 && !args.force_rma && !ranks;  // (the per-expert format's paths only)
    for (int r = static_cast<int>(threadIdx.x); all_p2p && r < args.num_ranks; r += kWarps * kGroups * 32)
        if (nvshmem_ptr(args.sym_recv, r) == nullptr) all_p2p = false;
    all_p2p = __syncthreads_and(all_p2p) != 0;
    const bool p2p_send = fits && all_p2p;
    const bool p2p_recv = kFP8 && all_p2p && args.num_experts + 1 <= kMaxHitWords;

    begin_launch(phases, args.seq_state, args.mask, args.num_ranks, s_seq, s_mask);
    const Deadline deadline(args.timeout_ns);
    const bool self_masked = s_mask[args.rank] != 0;

    // ------------------------------------------------------------------ send
    if (phases & kPhaseSend)
        wait_receipts(args.sym_receipts, s_seq[0], s_mask, args.num_ranks, self_masked, args.mask, args.shrink != 0,
                      args.err, kOpDispatchSend, args.rank, deadline);
    if constexpr (kTopk <= 32) {
        if (ranks && (phases & kPhaseSend)) {
            dispatch_send_ranks<kHidden, kTopk, kFP8, kWarps * kGroups * 32>(
                args.x, args.topk_idx, args.num_tokens, args.max_tokens, args.num_experts, args.num_ranks, args.rank, self_masked, s_mask, s_hits, &s_last,
                s_peer_recv, args.sym_tags, rank_tags, args.sym_recv, args.seq_state + 5, seq_tag(s_seq[0]), args.round_scale != 0, ahead,
                OwnRows{args.out_x, args.out_scales, args.out_scales_ue8m0, args.out_src_info, args.out_row_map, slab, args.use_ue8m0 != 0},
                !kFP8 && (phases & kPhaseRecv) != 0, args.err);
        } else if (p2p_send && (phases & kPhaseSend)) {
            dispatch_send_p2p<kHidden, kTopk, kFP8, kWarps * kGroups * 32>(
                args.x, args.topk_idx, args.num_tokens, args.max_tokens, args.num_experts, args.num_ranks, args.rank, self_masked, s_mask, s_hits,
                &s_last, args.sym_tags, args.sym_src_idx, args.sym_recv, args.seq_state + 5, seq_tag(s_seq[0]), args.round_scale != 0, ahead,
                args.err);
        }
    }
    if ((phases & kPhaseSend) && !p2p_send && !ranks) {
        const uint32_t tag = seq_tag(s_seq[0]);
        const int num_chunks = (args.num_tokens + 31) / 32;
        for (int e = gid; e < args.num_experts; e += total_groups) {
            const int dst = e / num_local_experts;
            const int le = e % num_local_experts;
            if (self_masked || s_mask[dst] != 0) continue;  // uniform over the group (shared snapshot)

            // Which tokens pick e, 32 at a time.
            BadValue bad;
            for (int c = warp; c < num_chunks; c += kWarps) {
                const int t = c * 32 + lane;
                bool hit = false;
                if (t < args.num_tokens) {
                    const int64_t* row = args.topk_idx + static_cast<int64_t>(t) * kTopk;
#pragma unroll
                    for (int k = 0; k < kTopk; ++k) {
                        const int64_t id = __ldg(row + k);
                        hit |= (id == static_cast<int64_t>(e));
                        bad.check_expert_id(id, args.num_experts);
                    }
                }
                const uint32_t bits = __ballot_sync(kFullMask, hit);
                if (lane == 0) s_chunks[group][c] = bits;
            }
            if (e == args.rank * num_local_experts) bad.report_from_warp(args.err, kValueOpLowLatencyDispatch, args.rank, __LINE__);
            named_barrier_sync(barrier_id, kGroupThreads);

            uint8_t* peer_recv = args.force_rma ? nullptr : static_cast<uint8_t*>(nvshmem_ptr(args.sym_recv, dst));
            const bool p2p = peer_recv != nullptr;
            int* peer_src_idx = p2p ? static_cast<int*>(nvshmem_ptr(args.sym_src_idx, dst)) : nullptr;
            const int u = le * args.num_ranks + args.rank;  // our slot block at the receiver
            const int slot_base = u * args.max_tokens;

            int running = 0;
            for (int c = 0; c < num_chunks; ++c) {
                const uint32_t bits = s_chunks[group][c];
                const int in_chunk = __popc(bits);
                // Rows running .. running + in_chunk - 1; this warp takes those equal to warp mod kWarps.
                const int first = running + (warp - running % kWarps + kWarps) % kWarps;
                for (int s = first; s < running + in_chunk; s += kWarps) {
                    const int j = s - running;  // the j-th set bit of `bits` is the token
                    const bool is_jth = ((bits >> lane) & 1u) && __popc(bits & ((1u << lane) - 1u)) == j;
                    const int t = c * 32 + __ffs(__ballot_sync(kFullMask, is_jth)) - 1;
                    const int slot = slot_base + s;
                    if (p2p) {
                        uint8_t* msg = peer_recv + static_cast<size_t>(slot) * kSlotBytes;
                        if (args.staged) {
                            warp_copy<kMsgBytes / 16, Load::kNonCoherent>(
                                msg, args.sym_stage + static_cast<size_t>(t) * kSlotBytes, lane);
                        } else if constexpr (kFP8) {
                            cast_row_fp8<kHidden>(args.x + static_cast<size_t>(t) * kHidden, msg,
                                                  reinterpret_cast<float*>(msg + kHidden), args.round_scale != 0, lane);
                        } else {
                            warp_copy<kDataBytes / 16, Load::kNonCoherent>(msg, args.x + static_cast<size_t>(t) * kHidden,
                                                                           lane);
                        }
                        if (lane == 0) peer_src_idx[slot] = t;
                    } else {
                        // Row and token id, then (ordered behind them by the fence) one count increment.
                        nvshmemx_putmem_nbi_warp(args.sym_recv + static_cast<size_t>(slot) * kSlotBytes,
                                                 args.sym_stage + static_cast<size_t>(t) * kSlotBytes, kMsgBytes, dst);
                        __threadfence_system();  // whatever lanes stored for the put is ordered before the signal
                        __syncwarp();
                        if (lane == 0) {
                            nvshmem_int_p(args.sym_src_idx + slot, t, dst);
                            nvshmem_fence();
                            nvshmemx_signal_op(args.sym_arrivals + u, 1, NVSHMEM_SIGNAL_ADD, dst);
                        }
                        __syncwarp();
                    }
                }
                running += in_chunk;
            }

            // All rows of this unit are out: publish the count.
            if (p2p) __threadfence_system();
            named_barrier_sync(barrier_id, kGroupThreads);
            if (gthread == 0) {
                const uint32_t word = tag_word(tag, static_cast<uint32_t>(running));
                if (p2p) {
                    st_release_sys(static_cast<uint32_t*>(nvshmem_ptr(args.sym_tags + u, dst)), word);
                } else {
                    nvshmem_int_atomic_set(reinterpret_cast<int*>(args.sym_tags + u), static_cast<int>(word), dst);
                }
            }
        }
    }
    if ((phases & kPhaseSend) && args.count_sends)  // an early receive follows (receipts.cuh)
        count_send(args.sym_sent, args.num_ranks, args.rank, s_mask, self_masked, args.force_rma != 0, args.seq_state + 7, &s_last);

    // ------------------------------------------------------------------ receive
    if constexpr (kTopk <= 32) {
        if (ranks && (phases & kPhaseRecv)) {
            __syncthreads();  // the send phase's last readers of s_hits, which becomes the receive tables
            dispatch_recv_ranks<kHidden, kTopk, kFP8, kWarps * kGroups * 32>(
                args.max_tokens, args.num_experts, args.num_ranks, args.rank, self_masked, s_mask, reinterpret_cast<int*>(s_hits),
                args.sym_tags, rank_tags, args.sym_recv, args.mask, args.out_x, args.out_scales, args.out_scales_ue8m0, args.out_count,
                args.out_src_info, args.out_row_map, args.out_layout_range, args.cumulative_recv_stats, args.wait_recv_cost_stats, args.use_ue8m0 != 0,
                args.shrink != 0, seq_tag(s_seq[1]), tag_ahead, count_ahead, deadline, args.err);
        } else if (p2p_recv && (phases & kPhaseRecv)) {
            __syncthreads();  // the send phase's last readers of s_hits, which becomes the prefix array
            dispatch_recv_p2p<kHidden, kFP8, kWarps * kGroups * 32>(
                args.max_tokens, args.num_experts, args.num_ranks, args.rank, self_masked, s_mask, reinterpret_cast<int*>(s_hits),
                s_warp_sum, args.sym_tags, args.sym_src_idx, args.sym_recv, args.mask, args.out_x, args.out_scales, args.out_scales_ue8m0, args.out_count,
                args.out_src_info, args.out_row_map, args.out_layout_range, args.cumulative_recv_stats, args.wait_recv_cost_stats, args.use_ue8m0 != 0,
                args.shrink != 0, seq_tag(s_seq[1]), tag_ahead, deadline, args.err);
        }
    }
    if ((phases & kPhaseRecv) && !p2p_recv && !ranks) {
        const uint32_t tag = seq_tag(s_seq[1]);
        const uint64_t t_start = globaltimer();
        for (int u = gid; u < args.num_experts; u += total_groups) {
            const int le = u / args.num_ranks;
            const int src = u % args.num_ranks;

            // Warp 0: counts of the sources up to src in the slab's order (one lane per source).
            if (warp == 0) {
                int before = 0, mine = 0, abort = 0;
                const int last = source_position(src, args.rank, args.num_ranks);
                for (int j = lane; j <= last; j += 32) {
                    const int s = source_at(j, args.rank, args.num_ranks);
                    int cnt = 0;
                    if (!self_masked && s_mask[s] == 0) {
                        cnt = wait_tag(args.sym_tags + le * args.num_ranks + s, tag, deadline, args.err, bail);
                        if (cnt >= 0 && s == src) {
                            const bool p2p = !args.force_rma && nvshmem_ptr(args.sym_tags, s) != nullptr;
                            if (!p2p && cnt > 0) {
                                const uint64_t base = args.arrival_base[u];
                                const uint64_t need = static_cast<uint64_t>(cnt);
                                if (wait_arrivals(args.sym_arrivals + u, base, need, deadline, args.err, bail)) {
                                    args.arrival_base[u] = base + need;
                                } else {
                                    cnt = -1;
                                }
                            }
                            if (cnt >= 0 && args.wait_recv_cost_stats != nullptr) {
                                atomicAdd(reinterpret_cast<unsigned long long*>(args.wait_recv_cost_stats + s),
                                          static_cast<unsigned long long>(globaltimer() - t_start));
                            }
                        }
                        if (cnt < 0) {
                            peer_timed_out(args.mask, s, args.shrink != 0, args.err, kOpDispatchRecv, args.rank, __LINE__, deadline);
                            abort |= !args.shrink;
                            cnt = 0;
                        }
                        cnt = min(cnt, args.max_tokens);
                    }
                    if (j < last) before += cnt;
                    else mine = cnt;
                }
                before = warp_sum(before);
                mine = warp_sum(mine);
                abort = __any_sync(kFullMask, abort != 0) ? 1 : 0;
                if (lane == 0) {
                    s_unit[group][0] = before;
                    s_unit[group][1] = abort ? 0 : mine;
                    s_unit[group][2] = abort;
                }
            }
            named_barrier_sync(barrier_id, kGroupThreads);
            const int begin = s_unit[group][0];
            const int count = s_unit[group][1];

            for (int i = warp; i < count; i += kWarps) {
                const int row = begin + i;
                const uint8_t* msg = args.sym_recv + static_cast<size_t>(u * args.max_tokens + i) * kSlotBytes;
                uint8_t* dst_row = args.out_x + (static_cast<size_t>(le) * slab + row) * kDataBytes;
                warp_copy<kDataBytes / 16, Load::kL2>(dst_row, msg, lane);
                if constexpr (kFP8) {
                    store_recv_scales<kNumScales>(msg + kHidden, args.use_ue8m0, args.out_scales, args.out_scales_ue8m0, le, slab,
                                                  row, lane);
                }
                if (lane == 0) {
                    record_row(args.out_src_info, args.out_row_map, le, row, src,
                               static_cast<int>(ld_cg_u32(args.sym_src_idx + u * args.max_tokens + i)), args.max_tokens, args.num_ranks,
                               num_local_experts);
                }
            }
            if (gthread == 0) {
                args.out_layout_range[le * args.num_ranks + src] =
                    (static_cast<int64_t>(begin) << 32) | static_cast<int64_t>(count);
            }
            if (source_position(src, args.rank, args.num_ranks) == args.num_ranks - 1) {  // the slab's last group
                const int total = begin + count;
                if (gthread == 0) {
                    args.out_count[le] = total;
                    if (args.cumulative_recv_stats != nullptr) atomicAdd(args.cumulative_recv_stats + le, total);
                }
                for (int r = total + gthread; r < slab; r += kGroupThreads)
                    args.out_src_info[static_cast<size_t>(le) * slab + r] = -1;
            }
            named_barrier_sync(barrier_id, kGroupThreads);  // s_unit is reused by the next unit
        }
    }
    if (phases & kPhaseRecv)
        publish_receipts(args.sym_receipts, s_seq[1], args.num_ranks, args.rank, s_mask, args.force_rma != 0,
                         args.seq_state + 6, &s_last, args.count_sends ? args.sym_sent : nullptr);
}

// RMA path only: cast (or copy) every token once into the symmetric staging area, which the puts of
// the dispatch kernel read. One warp per token.
constexpr int kStageThreads = 256;

template <int kHidden, bool kFP8>
__global__ void __launch_bounds__(kStageThreads, 1)
    stage(const __grid_constant__ StageArgs args) {
    constexpr int kSlotBytes = 2 * kHidden;
    const int lane = lane_id();
    const int warps = static_cast<int>(gridDim.x * blockDim.x) / 32;
    for (int t = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / 32); t < args.num_tokens; t += warps) {
        uint8_t* msg = args.sym_stage + static_cast<size_t>(t) * kSlotBytes;
        if constexpr (kFP8) {
            cast_row_fp8<kHidden>(args.x + static_cast<size_t>(t) * kHidden, msg, reinterpret_cast<float*>(msg + kHidden),
                                  args.round_scale != 0, lane);
        } else {
            warp_copy<kHidden * 2 / 16, Load::kNonCoherent>(msg, args.x + static_cast<size_t>(t) * kHidden, lane);
        }
    }
}

}  // namespace deepep_cupy::low_latency

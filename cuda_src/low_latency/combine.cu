// Low-latency combine: each rank returns the expert outputs of the rows it received in the dispatch to
// their source ranks, which reduce them with the top-k weights:
//   out[t] = bf16( fma chain over k = 0..K-1 of (row(t, k), weight[t, k]) ), float32, one rounding per fma.
//
// Send phase: one unit per (local expert, destination rank), described by the dispatch handle
// (layout_range gives the rows, src_info the token each row answers); a row lands in the slot
// [global expert][token] of the destination's receive area, as BF16 or LogFMT-10. Receive phase: one
// warp per block waits (one lane per expert, backing off) until every expert's owner has finished
// sending to this rank, then every warp reduces (token, 256-channel chunk) items: it loads the K rows
// and accumulates in k order. Only that one warp per block ever polls a flag.
// On the RMA path, units of the receive phase first turn put-with-signal counters into local ready
// flags (one unit per global expert). See layout.cuh for the buffer layout and the protocol.
//
// Top-k ids outside [-1, E) contribute nothing, like -1. While one warp per block waits for the experts,
// the block's other warps check every id once and report a bad one as a value error (op
// kValueOpLowLatencyCombine; the first report wins).
#include "common/nvshmem_includes.cuh"
#include "common/value_errors.cuh"
#include "low_latency/layout.cuh"

using namespace deepep;
using namespace deepep::ll;

namespace deepep_cupy::low_latency {

template <int kHidden, int kTopk, int kWarps, int kGroups, bool kLogfmt>
__global__ void __launch_bounds__(kWarps* kGroups * 32, 1)
    combine(const uint16_t* x,                        // [E_local, R*T, H] bf16 (the send area with zero-copy)
            const int* __restrict__ src_info,         // [E_local, R*T]
            const int64_t* __restrict__ layout_range, // [E_local, R]
            const int64_t* __restrict__ topk_idx,     // [N, K]
            const float* __restrict__ topk_weights,   // [N, K]
            int num_tokens, int max_tokens, int num_experts, int num_ranks, int rank,
            uint32_t* sym_tags,                       // [E]
            uint64_t* sym_arrivals,                   // [E]
            uint8_t* sym_recv,                        // [E][T] slots of 2H bytes
            uint8_t* sym_send,                        // [E_local][R*T] rows of 2H bytes
            uint32_t* seq_state,                      // [4]
            uint64_t* arrival_base,                   // [E] local
            uint32_t* ready,                          // [E] local
            int* mask,                                // [R]
            uint16_t* out,                            // [N, H] bf16 bits
            int64_t* wait_recv_cost_stats,            // [R] or null
            int phases, int zero_copy, int force_rma, int shrink, long long timeout_ns,
            ErrorRecord* err) {
    constexpr int kGroupThreads = GroupCoords<kWarps, kGroups>::kGroupThreads;
    constexpr int kBlockWarps = kWarps * kGroups;
    constexpr int kSlotBytes = 2 * kHidden;
    constexpr int kRowBytes = kLogfmt ? (kHidden / kChannelsPerBlock) * kLogfmtBlockBytes : 2 * kHidden;
    constexpr int kChunk = 32 * 8;  // channels per warp item in the reduction
    constexpr int kNumChunks = (kHidden + kChunk - 1) / kChunk;
    constexpr int kBatch = kTopk < 8 ? kTopk : 8;
    static_assert(!kLogfmt || kHidden % kChannelsPerBlock == 0, "LogFMT combine needs hidden % 128 == 0");
    static_assert(kHidden % 8 == 0, "hidden must be a multiple of 8");
    static_assert(kTopk >= 1 && kTopk <= 32, "the combine waits for one expert per lane: top-k <= 32");
    static_assert(kGroups >= 1 && kGroups <= 15 && kWarps >= 1 && kWarps * kGroups <= 32, "bad warp split");
    static_assert(kRowBytes <= kSlotBytes, "row must fit a slot");

    __shared__ int s_mask[kMaxRanks];
    __shared__ int s_sent[kGroups];
    __shared__ uint32_t s_arrived[kMaxExperts / 32];
    __shared__ uint32_t s_seq[2];

    const GroupCoords<kWarps, kGroups> at;
    const int warp_in_block = at.warp_in_block, lane = at.lane, group = at.group, warp = at.warp;
    const int gthread = at.gthread, barrier_id = at.barrier_id, total_groups = at.total_groups, gid = at.gid;
    const int num_local_experts = num_experts / num_ranks;
    const int slab = num_ranks * max_tokens;
    const bool bail = !shrink;

    begin_launch(phases, seq_state, mask, num_ranks, s_seq, s_mask);
    const Deadline deadline(timeout_ns);
    const bool self_masked = s_mask[rank] != 0;

    // ------------------------------------------------------------------ send
    if (phases & kPhaseSend) {
        const uint32_t tag = seq_tag(s_seq[0]);
        for (int u = gid; u < num_experts; u += total_groups) {
            const int le = u / num_ranks;
            const int dst = u % num_ranks;
            if (self_masked || s_mask[dst] != 0) continue;  // uniform over the group
            const int e = rank * num_local_experts + le;
            const int64_t range = layout_range[le * num_ranks + dst];
            const int begin = static_cast<int>(range >> 32);
            int count = static_cast<int>(range & 0xffffffffll);
            count = (begin < 0 || begin > slab) ? 0 : max(0, min(count, min(max_tokens, slab - begin)));

            uint8_t* peer_recv = force_rma ? nullptr : static_cast<uint8_t*>(nvshmem_ptr(sym_recv, dst));
            const bool p2p = peer_recv != nullptr;
            if (gthread == 0) s_sent[group] = 0;
            group_sync(barrier_id, kGroupThreads);

            int sent = 0;  // rows this warp returned (lane 0's count is the one that matters)
            for (int i = warp; i < count; i += kWarps) {
                const int row = begin + i;
                const int t = __ldg(src_info + static_cast<size_t>(le) * slab + row);
                if (t < 0 || t >= max_tokens) continue;  // corrupt handle: skip rather than write out of bounds
                const uint16_t* src_row = x + (static_cast<size_t>(le) * slab + row) * kHidden;
                const size_t slot = static_cast<size_t>(e) * max_tokens + t;
                if (p2p) {
                    uint8_t* dst_row = peer_recv + slot * kSlotBytes;
                    if constexpr (kLogfmt) logfmt_encode_row<kHidden, Load::kNonCoherent>(src_row, dst_row, lane);
                    else warp_copy<kHidden * 2 / 16, Load::kNonCoherent>(dst_row, src_row, lane);
                } else {
                    uint8_t* stage_row = sym_send + (static_cast<size_t>(le) * slab + row) * kSlotBytes;
                    if constexpr (kLogfmt) {
                        // In place when zero-copy (src_row is stage_row): coherent loads.
                        logfmt_encode_row<kHidden, Load::kPlain>(src_row, stage_row, lane);
                    } else if (!zero_copy) {
                        warp_copy<kHidden * 2 / 16, Load::kNonCoherent>(stage_row, src_row, lane);
                    }
                    __threadfence_system();  // the transport may read the staged row with a copy engine or NIC
                    __syncwarp();
                    nvshmemx_putmem_nbi_warp(sym_recv + slot * kSlotBytes, stage_row, kRowBytes, dst);
                    __threadfence_system();  // whatever lanes stored for the put is ordered before the signal
                    __syncwarp();
                    if (lane == 0) {
                        nvshmem_fence();
                        nvshmemx_signal_op(sym_arrivals + e, 1, NVSHMEM_SIGNAL_ADD, dst);
                    }
                    __syncwarp();
                }
                ++sent;
            }
            if (lane == 0 && sent > 0) atomicAdd(&s_sent[group], sent);
            if (p2p) __threadfence_system();
            group_sync(barrier_id, kGroupThreads);
            if (gthread == 0) {
                const uint32_t word = tag_word(tag, static_cast<uint32_t>(s_sent[group]));
                if (p2p) {
                    st_release_sys_u32(static_cast<uint32_t*>(nvshmem_ptr(sym_tags + e, dst)), word);
                } else {
                    nvshmem_int_atomic_set(reinterpret_cast<int*>(sym_tags + e), static_cast<int>(word), dst);
                }
            }
            group_sync(barrier_id, kGroupThreads);  // s_sent is reused by the next unit
        }
    }

    // ------------------------------------------------------------------ receive
    if (phases & kPhaseRecv) {
        const uint32_t tag = seq_tag(s_seq[1]);
        const uint64_t t_start = globaltimer();

        // Stage A (thread 0 of each group, one global expert at a time): RMA owners -> local ready flag;
        // wait-time statistics for every owner when requested.
        if (gthread == 0 && !self_masked) {
            for (int e = gid; e < num_experts; e += total_groups) {
                const int owner = e / num_local_experts;
                if (s_mask[owner] != 0) continue;
                const bool p2p = !force_rma && nvshmem_ptr(sym_tags, owner) != nullptr;
                if (p2p && wait_recv_cost_stats == nullptr) continue;
                int cnt = wait_tag(sym_tags + e, tag, deadline, err, bail);
                if (cnt >= 0 && !p2p) {
                    const uint64_t base = arrival_base[e];
                    if (cnt == 0 || wait_arrivals(sym_arrivals + e, base, static_cast<uint64_t>(cnt), deadline, err, bail))
                        arrival_base[e] = base + static_cast<uint64_t>(cnt);
                    else
                        cnt = -1;
                }
                if (cnt < 0) {
                    peer_timed_out(mask, owner, shrink != 0, err, kOpCombineRecv, rank, __LINE__, deadline);
                } else if (wait_recv_cost_stats != nullptr) {
                    atomicAdd(reinterpret_cast<unsigned long long*>(wait_recv_cost_stats + owner),
                              static_cast<unsigned long long>(globaltimer() - t_start));
                }
                // Always release the reducers; they re-check the mask (and give up on their own after a
                // reported timeout).
                if (!p2p) st_release_gpu_u32(ready + e, tag);
            }
        }

        // Stage B: one warp per block learns which experts have arrived (one lane per expert word, each
        // polled by a single thread with backoff), so the reducing warps never poll. A block waits for
        // every expert, not only its tokens' ones: all senders publish every expert, so this costs nothing
        // in the end-to-end time, and it keeps the number of spinning threads at one warp per block.
        __syncthreads();  // stage A's ready flags are set by this block's threads too
        if (warp_in_block == 0) {
            for (int e0 = 0; e0 < num_experts; e0 += 32) {
                const int e = e0 + lane;
                bool ok = false;
                if (e < num_experts && !self_masked) {
                    const int owner = e / num_local_experts;
                    if (s_mask[owner] == 0 && ld_volatile(mask + owner) == 0) {
                        const bool p2p = !force_rma && nvshmem_ptr(sym_tags, owner) != nullptr;
                        ok = p2p ? wait_tag(sym_tags + e, tag, deadline, err, bail) >= 0
                                 : wait_ready(ready + e, tag, deadline, err, bail);
                        if (!ok) {
                            peer_timed_out(mask, owner, shrink != 0, err, kOpCombineRecv, rank, __LINE__, deadline);
                        } else if (!p2p && ld_volatile(mask + owner) != 0) {
                            ok = false;  // stage A gave up on the owner
                        }
                    }
                }
                const uint32_t bits = __ballot_sync(kFullMask, ok);
                if (lane == 0) s_arrived[e0 / 32] = bits;
            }
        }
        // Meanwhile the other warps of the block have nothing to do: they check the top-k ids stage C will
        // read (each id once over the grid) and report a bad one. Stage C itself only drops bad ids, so its
        // loop carries nothing more. A block of one warp checks after its wait.
        if (kBlockWarps == 1 || warp_in_block != 0) {
            constexpr int kCheckers = kBlockWarps > 1 ? kBlockWarps - 1 : 1;
            const int checker = static_cast<int>(blockIdx.x) * kCheckers + (kBlockWarps > 1 ? warp_in_block - 1 : 0);
            const long long stride = static_cast<long long>(gridDim.x) * kCheckers * 32;
            BadValue bad;
            for (long long i = checker * 32ll + lane; i < static_cast<long long>(num_tokens) * kTopk; i += stride)
                bad.check_expert_id(__ldg(topk_idx + i), num_experts);
            bad.report_from_warp(err, kValueOpLowLatencyCombine, rank, __LINE__);
        }
        __syncthreads();

        // Stage C: reduction, one (token, chunk) item per warp.
        const int total_warps = total_groups * kWarps;
        const int gwarp = gid * kWarps + warp;
        for (int item = gwarp; item < num_tokens * kNumChunks; item += total_warps) {
            const int t = item / kNumChunks;
            const int col = (item % kNumChunks) * kChunk + lane * 8;
            const bool active = col < kHidden;

            // Lane k holds expert topk_idx[t, k]; -1 means "contributes nothing". The range check is done
            // on the 64-bit id: narrowing first could turn a huge id into a valid one.
            int expert = -1;
            if (lane < kTopk) {
                const int64_t id = __ldg(topk_idx + static_cast<size_t>(t) * kTopk + lane);
                if (id >= 0 && id < num_experts) {
                    expert = static_cast<int>(id);
                    if (((s_arrived[expert / 32] >> (expert % 32)) & 1u) == 0) expert = -1;
                }
            }
            __syncwarp();

            float acc[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
#pragma unroll
            for (int k0 = 0; k0 < kTopk; k0 += kBatch) {
                int4 raw[kBatch];
                float w[kBatch];
                int ex[kBatch];
#pragma unroll
                for (int j = 0; j < kBatch; ++j) {
                    ex[j] = (k0 + j < kTopk) ? __shfl_sync(kFullMask, expert, k0 + j) : -1;
                    w[j] = 0.0f;
                    if (ex[j] >= 0) {
                        w[j] = __ldg(topk_weights + static_cast<size_t>(t) * kTopk + k0 + j);
                        if constexpr (!kLogfmt) {
                            if (active) {
                                raw[j] = ld_cg_v4(sym_recv + (static_cast<size_t>(ex[j]) * max_tokens + t) * kSlotBytes +
                                                  static_cast<size_t>(col) * 2);
                            }
                        }
                    }
                }
#pragma unroll
                for (int j = 0; j < kBatch; ++j) {
                    if (ex[j] < 0 || !active) continue;
                    float v[8];
                    if constexpr (kLogfmt) {
                        logfmt_decode8(sym_recv + (static_cast<size_t>(ex[j]) * max_tokens + t) * kSlotBytes, col, v);
                    } else {
                        unpack_bf16x8(raw[j], v);
                    }
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[i] = __fmaf_rn(v[i], w[j], acc[i]);
                }
            }
            if (active) st_na_v4(reinterpret_cast<int4*>(out + static_cast<size_t>(t) * kHidden + col), pack_bf16x8(acc));
        }
    }
}

}  // namespace deepep_cupy::low_latency

// Internode combine: the reverse path of the dispatch (docs/design/internode.md, "Combine").
//
// Grid 2 * ceil(C / S) blocks of S channels each (a template parameter), channels as in the dispatch that
// produced the handle. Channel c's two sides run in the two blocks of its SM pair, which block takes which
// alternating by channel (sends_here in copies.cuh).
// Sending side, warp w = ds * L + l with l != l_me: NVLink sender of the rows this rank received in channel c
//   from source s = (ds, l), in arrival order, to forwarder l of this domain (the rank that forwarded them).
//   Warp ds * L + l_me (its rows' forwarder is this rank, which reads them from x): reducer ds of NR = D, the
//   source-side sum of channel c: per token, the partials of every domain it reached, the biases, one
//   rounding; the D reducers take the channel's tokens in turn (ReduceShared).
// Receiving side, warps ds and D + ds (ds < D): forwarder for source domain ds, two warps each summing half of
//   every row (PairShared): for each row it received over RDMA from (ds, l_me) in channel c, sums the copies its
//   domain ranks send back (its own from x) and puts the partial sum (bf16 row, float32 top-k weights) into
//   the RDMA ring of the source.
// L == 1: no NVLink stage (the domain is this rank): the sending side holds the D forwarders, which read the
//   rows of x the NVLink senders would have sent (entry 5 + send_nvl_head), the receiving side D reducer warps that
//   take the channel's tokens in turn. The own domain's partial would be one row of x copied through ring
//   (c, d_me), so the reducers read that row of x instead and its forwarder warp has no work.
//
// Deadlock freedom: the source reduces token t only when every domain's partial for t is there, so each
// (forwarder, source domain) pipeline must advance on its own. The NVLink ring (c, j -> l) is therefore
// split into D sub-rings of cap / D slots, one per source domain, each with its own sender warp and its own
// forwarder warp; a pipeline only ever waits on itself and on the source's reducers, which free slots of
// every domain in token order. Sub-ring (c, ds) uses the progress words of ring index x = c * D + ds (so
// C * D <= kMaxChannels, checked on the host); the words keep the dispatch's writer/reader convention.
// Sub-rings (c, l_me -> l_me) are not used (their words and counts stay as they are on both sides).
//
// The sub-rings share memory with the dispatch's ring (c, j -> l): a sender first waits until l has
// released everything of that ring, and before returning until l has drained its sub-rings, so neither
// op overwrites slots the other has not read yet. RDMA rings are those of the dispatch with the same
// writer and reader pairs; units are slots only (no meta record).

#include "common/bf16.cuh"
#include "common/nvshmem_includes.cuh"
#include "internode/combine_sum.cuh"
#include "internode/args.cuh"
#include "internode/buffer_map.cuh"
#include "internode/copies.cuh"
#include "internode/sync.cuh"

namespace deepep_cupy::internode {

template <int L, int D>
struct CombineGeometry {
    const CombineArgs& a;
    __device__ __forceinline__ int sub_cap() const { return a.nvl_cap / D; }
    // Slot n of sub-ring ds of ring (c, writer -> reader), in the reader's NVLink buffer.
    __device__ __forceinline__ uint8_t* nvl_slot(int reader, int c, int writer, int ds, int n) const {
        const int sub = sub_cap();
        return nvl_base(a.nvl_bases, reader) + a.nvl_ring_offset +
               ((static_cast<long long>(c) * L + writer) * a.nvl_cap + ds * sub + n % sub) * a.slot_bytes;
    }
    __device__ __forceinline__ uint8_t* rdma_slot(int half, int i, int k) const {
        const long long ring = static_cast<long long>(half) * a.num_channels * D + i;
        return a.rdma + a.ring_offset + (ring * a.rdma_cap + k % a.rdma_cap) * a.slot_bytes;
    }
};

// Sending side, one warp: rows received from source (ds, l) in channel c go back to forwarder l.
template <int L, int D>
__device__ void send_nvl(const CombineArgs& a, const WaitCtx& w, int c, int ds, int l, int lane) {
    const CombineGeometry<L, D> g{a};
    const State st{a.state};
    const int C = a.num_channels, me = a.rank % L, d_me = a.rank / L, s = ds * L + l;
    const int x_ring = c * D + ds;
    const NvlCtrl mine{nvl_base(a.nvl_bases, me), L};
    const NvlCtrl dest{nvl_base(a.nvl_bases, l), L};
    const uint64_t base = static_cast<uint64_t>(*st.nvl_sent(x_ring * L + l, D));
    const uint64_t mem_owner = static_cast<uint64_t>(*st.nvl_sent(c * L + l, D));
    bool ok = true;
    // The dispatch's ring (c, me -> l) shares this memory: l must have read all of it.
    wait_at_least(mine.head(c * L + l), mem_owner, w, kOpCombineNvlHead, d_me * L + l, __LINE__, &ok);
    wait_at_least(mine.head(x_ring * L + l), base, w, kOpCombineNvlHead, d_me * L + l, __LINE__, &ok);
    const int row0 = a.recv_gbl_cpm[s * C + c];
    const int row1 = c + 1 < C ? a.recv_gbl_cpm[s * C + c + 1] : a.recv_gbl_prefix[s];
    const int n = row1 - row0, sub = g.sub_cap();
    int published = 0;  // rows made visible to l: one system-scope fence per batch, and all before a wait
    auto flush = [&](int upto) {
        if (upto > published) {
            publish_p2p(dest.tail(x_ring * L + me), base + upto, lane);
            published = upto;
        }
    };
    uint64_t head = base;  // the last value of l's head seen (acquired); read again only when short
    for (int k = 0; k < n && ok; ++k) {
        if (k >= sub)  // slot k - sub must be released (unit k - sub + 1)
            head = wait_reaching(mine.head(x_ring * L + l), base + 1 + k - sub, head, [&] { flush(k); }, w,
                                 kOpCombineNvlHead, d_me * L + l, __LINE__, &ok);
        if (!ok) break;
        uint8_t* dst = g.nvl_slot(l, c, me, ds, k);
        const long long row = row0 + k;
        warp_copy_nc(reinterpret_cast<int4*>(dst + kSlotHeaderBytes), a.x + row * a.hidden_int4, a.hidden_int4, lane);
        if (a.topk_weights != nullptr) {
            float* ws = reinterpret_cast<float*>(dst + a.slot_topk_weights_offset);
            for (int q = lane; q < a.num_topk; q += 32) ws[q] = a.topk_weights[row * a.num_topk + q];
        }
        if (k + 1 - published >= kPublishBatch) flush(k + 1);
    }
    if (ok) flush(n);
    // Hold the kernel until l has read every slot: the next op may reuse this memory as a whole ring.
    wait_at_least(mine.head(x_ring * L + l), base + n, w, kOpCombineNvlHead, d_me * L + l, __LINE__, &ok);
    if (lane == 0 && ok) *st.nvl_sent(x_ring * L + l, D) = static_cast<long long>(base + n);
}

// L == 1: the partial sum of a domain of one rank is that rank's row of x, so the slot gets the row copied (a
// bf16 value goes to float32 and back unchanged, and the source's reducer adds from +0 either way) with the
// copy's sixteen loads a lane in flight instead of the sum's four; the first 32 weights are loaded before it.
template <int kRegisters>
__device__ __forceinline__ void forward_row(const CombineArgs& a, uint8_t* out, const int4* row, const float* weights,
                                            bool has_row, int lane) {
    const bool weighted = a.topk_weights != nullptr && has_row;
    const float w0 = weighted && lane < a.num_topk ? ld_cg_f32(weights + lane) : 0.f;
    if (row != nullptr) {
        warp_copy_nc(reinterpret_cast<int4*>(out + kSlotHeaderBytes), row, a.hidden_int4, lane);
    } else {
        const int4* const none[1] = {nullptr};
        warp_sum_rows<1, kRegisters>(reinterpret_cast<int4*>(out + kSlotHeaderBytes), none, nullptr, nullptr, a.hidden_int4, lane);
    }
    if (a.topk_weights != nullptr) {
        float* ws = reinterpret_cast<float*>(out + a.slot_topk_weights_offset);
        for (int q = lane; q < a.num_topk; q += 32) {
            float sum = 0.f;
            if (weighted) sum += q == lane ? w0 : ld_cg_f32(weights + q);
            ws[q] = sum;
        }
    }
}

// With L > 1 a forwarder is two warps, each summing half of every row (one warp's round trips bounded it):
// the leader (half 0) waits, sums its half and the weights, publishes and hands slots back; the partner (half
// 1) waits for the same words and sums the other half. The partner counts its rows here after each; at the
// leader's publish points (every rdma_chunk rows, the last row) and before any wait of its own it fences its
// stores (system scope) first and says so in `fenced`, and the leader publishes only rows both have fenced.
// Zeroed by the block before any use.
struct PairShared {
    volatile int done;    // rows the partner has summed (kPartnerFailed: it stopped early, a wait ran out)
    volatile int fenced;  // of those, rows whose stores the partner has fenced
};
constexpr int kPartnerFailed = 0x7fffffff;  // more rows than a channel ever has

// Receiving side, warp ds (and with a partner, warp D + ds): partial sums within this domain of the rows that
// came from (ds, l_me). `pair` is null with L == 1 (one warp a forwarder).
template <int L, int D, int kRegisters>
__device__ void forward_reduce(const CombineArgs& a, const WaitCtx& w, int c, int ds, int half, PairShared* pair,
                               int lane) {
    const CombineGeometry<L, D> g{a};
    const Signals sig{a.sig, D};
    const State st{a.state};
    const int C = a.num_channels, l_me = a.rank % L, d_me = a.rank / L, pe = ds * L + l_me;
    // Ring i = (c, ds): the RDMA ring back to source ds, and the index of the NVLink sub-rings that carry the
    // domain ranks' rows of (c, ds) here (x_ring of the senders above).
    const int i = c * D + ds, i_peer = c * D + d_me;
    const bool leader = half == 0;
    const NvlCtrl mine{nvl_base(a.nvl_bases, l_me), L};
    // Lane j < L, j != l_me: units of sub-ring (c, ds) from domain rank j before this op, and how many it read.
    // The rows of this rank (j == l_me, and with L == 1 every row) are read from x itself, where the NVLink
    // sender would have read them: slot p would hold row entry 5 [(ds, l_me), c] + p.
    long long nbase = 0;
    if (L > 1 && lane < L && lane != l_me) nbase = *st.nvl_recvd(i * L + lane, D, L);
    int taken = 0, returned = 0;  // lane j: slots of j's sub-ring read, and handed back (the leader's count)
    // NVLink slots go back in batches (a store over NVLink each), and all before a wait.
    auto hand_back = [&]() {
        if constexpr (L == 1) return;
        __syncwarp();
        if (leader && lane < L && taken > returned) {
            give_back_store(NvlCtrl{nvl_base(a.nvl_bases, lane), L}.head(i * L + l_me),
                            static_cast<uint64_t>(nbase) + taken);
            returned = taken;
        }
        __syncwarp();
    };
    const uint64_t base = static_cast<uint64_t>(*st.rdma_sent(i));
    bool ok = true;
    wait_at_least(sig.head(i), base, w, kOpCombineHead, pe, __LINE__, &ok);
    const int start = channel_start(a.recv_rdma_cpm, ds, C, c);
    const int n = a.recv_rdma_cpm[ds * C + c] - start;
    const long long row0 = prefix_before(a.recv_rdma_prefix, ds) + start;
    const long long x_row0 = a.recv_gbl_cpm[(ds * L + l_me) * C + c];
    // This warp's int4 of each row: all of it, or with a partner one half each.
    const int h_begin = pair != nullptr && !leader ? (a.hidden_int4 + 1) / 2 : 0;
    const int h_count = pair == nullptr ? a.hidden_int4 : leader ? (a.hidden_int4 + 1) / 2 : a.hidden_int4 / 2;
    // As the dispatch's sender: straight into the ring of a source reachable by stores, else staged and put.
    uint8_t* const peer_ring = a.force_rma ? nullptr : static_cast<uint8_t*>(nvshmem_ptr(g.rdma_slot(1, i_peer, 0), pe));
    uint64_t* const peer_tail = peer_ring ? static_cast<uint64_t*>(nvshmem_ptr(sig.tail(i_peer), pe)) : nullptr;
    const bool p2p = peer_tail != nullptr;
    int first = 0;  // first slot not yet published
    auto publish = [&](int end) {
        if (end <= first) return;
        if (p2p)
            publish_p2p(peer_tail, base + end, lane);
        else
            put_signal_warp(g.rdma_slot(1, i_peer, first), g.rdma_slot(0, i, first),
                            static_cast<size_t>(end - first) * a.slot_bytes, sig.tail(i_peer), base + end,
                            NVSHMEM_SIGNAL_SET, pe, lane);
        first = end;
    };
    // Leader: of the `rows` it has summed, those the partner has fenced too (read by lane 0 for the warp).
    auto publishable = [&](int rows) {
        if (pair == nullptr) return rows;
        const int f = __shfl_sync(kFullMask, lane == 0 ? pair->fenced : 0, 0);
        __threadfence_block();
        return min(rows, f);
    };
    // Partner: `rows` summed; with `fence`, their stores made visible at system scope before they count as fenced.
    auto report = [&](int rows, bool fence) {
        __syncwarp();
        if (fence) {
            fence_acq_rel_sys();
            __syncwarp();
        }
        if (lane == 0) {
            if (fence) pair->fenced = rows;
            __threadfence_block();
            pair->done = rows;
        }
        __syncwarp();
    };
    // Everything due before a wait: the leader publishes and hands back what it may, the partner reports.
    auto before_wait = [&](int rows) {
        if (leader) {
            publish(publishable(rows));
            hand_back();
        } else {
            report(rows, true);
        }
    };
    // Leader: wait until the partner has summed `rows` rows, publishing what it fences meanwhile.
    auto wait_partner = [&](int rows) {
        if (pair == nullptr) return;
        const int v = shared_wait(&pair->done, [&](int done) { return done >= rows; }, [&](unsigned int spin) {
            if (spin == 1) hand_back();
            publish(publishable(rows));
        }, w, kOpCombinePartner, __LINE__, lane);
        if (v == kWaitExpired || v == kPartnerFailed) ok = false;
    };
    PhaseClock phase;  // diagnostics builds only (sync.cuh); the leader's laps only
    uint64_t head = base;  // the last value of head seen (acquired): slots below it are free
    constexpr int kRowsAhead = 32 / L;
    int positions = -1;  // lane q * L + j: the position of row k - k % kRowsAhead + q in j's stream
    uint64_t tail = 0;   // lane j: the last value of j's tail seen (acquired)
    for (int k = 0; k < n && ok; ++k) {
        // Slot k - Rt must be free (unit k - Rt + 1); before waiting for it, the pending slots are published (the
        // source cannot free slots it has not seen).
        if (k >= a.rdma_cap) {
            head = wait_reaching(sig.head(i), base + 1 + k - a.rdma_cap, head, [&] { before_wait(k); }, w,
                                 kOpCombineHead, pe, __LINE__, &ok);
            if (!ok) break;
        }
        // Lane j: position of this row in j's stream, then wait for it. The positions of kRowsAhead rows come in
        // one load step: that load and the tails' acquires, one after the other every row, took a third of it.
        if (k % kRowsAhead == 0) {
            const long long ahead = row0 + k + lane / L;
            positions = lane < kRowsAhead * L && k + lane / L < n ? a.send_nvl_head[ahead * L + lane % L] : -1;
        }
        const int pos = __shfl_sync(kFullMask, positions, (k % kRowsAhead) * L + lane % L);
        if constexpr (L > 1) {
            // Each lane's tail is read again only when the last value seen falls short.
            const uint64_t want = static_cast<uint64_t>(nbase) + 1 + pos;
            bool ready = lane >= L || pos < 0 || lane == l_me || tail >= want;
            if (!__all_sync(kFullMask, ready)) {
                if (!ready) tail = ld_acquire_sys(mine.tail(i * L + lane));
                ready = ready || tail >= want;
                if (!__all_sync(kFullMask, ready)) before_wait(k);
                for (int j = 0; j < L && ok; ++j) {
                    if (__shfl_sync(kFullMask, ready, j)) continue;
                    const uint64_t v = wait_at_least(mine.tail(i * L + j), __shfl_sync(kFullMask, want, j), w,
                                                     kOpCombineNvlTail, d_me * L + j, __LINE__, &ok);
                    if (lane == j) tail = v;
                }
            }
            if (!ok) break;
        }
        uint8_t* out = p2p ? peer_ring + static_cast<long long>(k % a.rdma_cap) * a.slot_bytes : g.rdma_slot(0, i, k);
        // Every lane learns every position here: the loops below leave lanes idle, so no shuffle inside.
        int ps[L];
        const int4* rows[L];
        const float* weights[L];
#pragma unroll
        for (int j = 0; j < L; ++j) {
            ps[j] = __shfl_sync(kFullMask, pos, j);
            if (j == l_me) {
                rows[j] = ps[j] >= 0 ? a.x + (x_row0 + ps[j]) * a.hidden_int4 + h_begin : nullptr;
                weights[j] = a.topk_weights != nullptr ? a.topk_weights + (x_row0 + ps[j]) * a.num_topk : nullptr;
            } else {
                const uint8_t* slot = g.nvl_slot(l_me, c, j, ds, ps[j] >= 0 ? ps[j] : 0);
                rows[j] = ps[j] >= 0 ? reinterpret_cast<const int4*>(slot + kSlotHeaderBytes) + h_begin : nullptr;
                weights[j] = reinterpret_cast<const float*>(slot + a.slot_topk_weights_offset);
            }
        }
        if (leader) phase.lap(kPhaseFwdPosition);
        if constexpr (L == 1) {
            forward_row<kRegisters>(a, out, rows[0], weights[0], ps[0] >= 0, lane);
        } else {
            warp_sum_rows<L, kRegisters>(reinterpret_cast<int4*>(out + kSlotHeaderBytes) + h_begin, rows, nullptr, nullptr, h_count,
                                         lane);
            if (leader && a.topk_weights != nullptr) {
                float* ws = reinterpret_cast<float*>(out + a.slot_topk_weights_offset);
                for (int q = lane; q < a.num_topk; q += 32) {
                    float sum = 0.f;
#pragma unroll
                    for (int j = 0; j < L; ++j)
                        if (ps[j] >= 0) sum += ld_cg_f32(weights[j] + q);
                    ws[q] = sum;
                }
            }
        }
        if (leader) phase.lap(kPhaseFwdCopy);
        // With a partner the leader publishes at fixed points (where the partner fences), else every chunk.
        const bool publish_here = pair != nullptr ? (k + 1) % a.rdma_chunk == 0 || k + 1 == n
                                                  : k + 1 - first >= a.rdma_chunk || k + 1 == n;
        if (!leader) {
            report(k + 1, publish_here);
            continue;
        }
        wait_partner(k + 1);
        if (!ok) break;
        // The read NVLink slots may go back (their values are stored above, by both warps).
        if (lane < L && lane != l_me && pos >= 0) taken = pos + 1;
        if (__any_sync(kFullMask, taken - returned >= kPublishBatch)) hand_back();
        if (publish_here) publish(publishable(k + 1));
        phase.lap(kPhaseFwdPublish);
    }
    if (!leader) {
        if (!ok && lane == 0) {
            __threadfence_block();
            pair->done = kPartnerFailed;
        }
        return;
    }
    if (ok) hand_back();
    if (lane == 0) nvshmem_quiet();
    if (ok) {
        if (L > 1 && lane < L && lane != l_me) *st.nvl_recvd(i * L + lane, D, L) = nbase + taken;
        if (lane == 0) *st.rdma_sent(i) = static_cast<long long>(base + n);
    }
}

}  // namespace deepep_cupy::internode

#include "internode/combine_reduce.cuh"

namespace deepep_cupy::internode {

template <int kNumNvlRanks, int kNumDomains, int kSubChannels>
__global__ void __launch_bounds__(32 * combine_channel_warps(kNumNvlRanks, kNumDomains) * kSubChannels, 1)
combine(const __grid_constant__ CombineArgs args) {
    constexpr int L = kNumNvlRanks, D = kNumDomains;
    constexpr int W = combine_channel_warps(L, D), S = kSubChannels;
    constexpr int NR = D;  // reducer warps of a channel
    constexpr int kRegs = combine_registers(L, D, S);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, role = warp % W;
    const int sub = warp / W, c = (blockIdx.x / 2) * S + sub;
    // The two sides alternate by channel, so every SM carries both sides' bytes
    // (docs/design/internode_measurements.md, "Sides alternating by channel").
    const bool sending = sends_here(sub);
    // L > 1: the sending block's warps whose rows this rank forwards itself reduce instead.
    const bool reducer = L == 1 ? !sending : sending && role < L * D && role % L == args.rank % L;
    __shared__ ReduceShared<D, NR> reduce_shared[S];
    __shared__ PairShared pair_shared[L > 1 ? S * D : 1];
    for (int k = threadIdx.x; k < static_cast<int>(sizeof(reduce_shared) / sizeof(int)); k += blockDim.x)
        (&reduce_shared[0].claim[0][0])[k] = 0;
    for (int k = threadIdx.x; k < static_cast<int>(sizeof(pair_shared) / sizeof(int)); k += blockDim.x)
        (&pair_shared[0].done)[k] = 0;
    __syncthreads();
    if (c >= args.num_channels) return;  // the last block's spare channels (no block-wide barrier below)
    const CombineArgs& a = args;
    const WaitCtx w{args.err, args.timeout_ns, args.rank};
    const WarpClock clock(sending && !reducer);  // diagnostics builds only (sync.cuh)
    if (reducer) {
        reduce_domains<L, D, NR, kRegs>(a, w, c, L == 1 ? role : role / L, &reduce_shared[sub], lane);
        clock.stop();
    } else if (L == 1 ? role < D && role != args.rank : sending && role < L * D) {
        if constexpr (L == 1)  // no NVLink stage: the forwarders read x; the own domain's reducer reads x too
            forward_reduce<L, D, kRegs>(a, w, c, role, 0, nullptr, lane);
        else
            send_nvl<L, D>(a, w, c, role / L, role % L, lane);
        clock.stop();
    } else if (L > 1 && !sending && role < 2 * D) {  // W = L * D >= 2 * D: a leader and a partner a domain
        const int ds = role % D;
        forward_reduce<L, D, kRegs>(a, w, c, ds, role / D, &pair_shared[sub * D + ds], lane);
        clock.stop();
    }
}

}  // namespace deepep_cupy::internode

// Internode combine, the source's side: its reducer warps' sum across domains, token by token
// (docs/design/internode.md, "Combine", step 3).
// Included by combine.cu only (needs CombineArgs and CombineGeometry from there).
#pragma once

namespace deepep_cupy::internode {

// Reducer warps of one channel that take its tokens in turn (NR of them; one would be slower than the
// forwarders feeding it: it reads D partials and writes a row for every token). A slot may go back to its forwarder only
// once every token before it is summed, whichever warp owns it: warp r's claim[r][d] says how many slots
// of domain d the tokens before its next one hold (its own are done, so only the others' may not be), and
// the minimum over the warps is what may go back; released[d] (atomicMax) hands each increment to exactly
// one warp. Zeroed by the block before any use.
template <int D, int NR>
struct ReduceShared {
    int claim[NR][D];
    int released[D];
};

// Reducer r of NR: the source's sum across domains, token by token. Warp r sums tokens t_begin + r,
// t_begin + r + NR, ... and reads the positions of the others only to keep its claim.
template <int L, int D, int NR, int kRegisters>
__device__ void reduce_domains(const CombineArgs& a, const WaitCtx& w, int c, int r, ReduceShared<D, NR>* sh,
                               int lane) {
    const CombineGeometry<L, D> g{a};
    const Signals sig{a.sig, D};
    const State st{a.state};
    const int C = a.num_channels, l_me = a.rank % L, d_me = a.rank / L;
    // L == 1: the own domain's partial is one row of this rank's x, read from x itself (forward_reduce does
    // not run for it, ring (c, d_me) is not used, its words and counts stay as they are on both sides). Slot p
    // of that ring would have held RDMA receive row own_rdma0 + p, i.e. x row own_x0 + send_nvl_head of it.
    const int own = L == 1 ? d_me : -1;
    const int own_rdma0 =
        L == 1 ? prefix_before(a.recv_rdma_prefix, d_me) + channel_start(a.recv_rdma_cpm, d_me, C, c) : 0;
    const int own_x0 = L == 1 ? a.recv_gbl_cpm[d_me * C + c] : 0;
    // Lane d: units of ring (c, d) before this op, and the last value of its tail seen.
    long long base = 0;
    uint64_t tail = 0;
    if (lane < D) base = *st.rdma_recvd(c * D + lane, D);
    bool ok = true;
    int t_begin, t_end;
    channel_range(a.num_tokens, a.num_channels, c, t_begin, t_end);
    // Lane d: slots of domain d read but not yet handed back. They go back in batches, and at once whenever
    // this warp is about to wait: the forwarder may be waiting for exactly those slots.
    int pending = 0;
    int seen = 0;  // lane d: slots of domain d in the tokens this warp has passed (summed if its own)
    // Slots go back about every half ring, the NR warps' shares together (what one warp holds counts its own
    // tokens only): a fixed batch as large as the ring would leave them until a wait, and a forwarder that
    // runs out of ring space publishes, stops and waits a round trip for them.
    const int release_every = max(1, min(8, a.rdma_cap / 2) / NR);
    PhaseClock phase;  // diagnostics builds only (sync.cuh)
    auto hand_back = [&]() {
        if (lane < D && lane != own) {
            volatile int* claim = &sh->claim[0][0];
            claim[r * D + lane] = seen;
            __threadfence_block();  // store, then load the others' claims: one of two racing warps sees both
            int m = seen;
#pragma unroll
            for (int q = 0; q < NR; ++q) m = min(m, claim[q * D + lane]);
            const int old = atomicMax(&sh->released[lane], m);
            if (m > old) {
                nvshmemx_signal_op(sig.head(c * D + d_me), static_cast<uint64_t>(m - old), NVSHMEM_SIGNAL_ADD,
                                   lane * L + l_me);
            }
            pending = 0;
        }
        __syncwarp();
    };
    // The positions of kTokensAhead tokens come in one load step (every warp needs every token's, the others'
    // included, and loaded them one round trip a token): lane q * D + d holds token t - u + q's position in
    // ring (c, d), u = (t - t_begin) % kTokensAhead; with L == 1, for this warp's tokens, lane q * D + own
    // holds the row of x in its stead (send_nvl_head of it, -1 where the token did not reach this domain).
    constexpr int kTokensAhead = 32 / D;
    int positions = -1;
    for (int t = t_begin; t < t_end && ok; ++t) {
        const int u = (t - t_begin) % kTokensAhead;
        if (u == 0) {
            const int q = lane / D, d = lane % D, tq = t + q;
            const bool valid = q < kTokensAhead && tq < t_end;
            positions = valid ? a.send_rdma_head[static_cast<long long>(tq) * D + d] : -1;
            if (L == 1 && valid && d == own && positions >= 0 && (tq - t_begin) % NR == r)
                positions = a.send_nvl_head[own_rdma0 + positions];
        }
        const int at = __shfl_sync(kFullMask, positions, u * D + lane % D);
        const int pos = lane < D ? at : -1;
        if ((t - t_begin) % NR != r) {  // another warp's token: only its slots count
            if (pos >= 0) seen = pos + 1;
            continue;
        }
        // Lane own: the x row of its partial (-1: none, as a partial of no rows adds nothing).
        const int own_row = lane == own && pos >= 0 ? own_x0 + pos : -1;
        // Lane d's tail of domain d, read again only when the last value seen falls short.
        bool ready = pos < 0 || lane == own || tail >= static_cast<uint64_t>(base) + 1 + pos;
        if (!__all_sync(kFullMask, ready)) {
            if (!ready) tail = ld_acquire_sys(sig.tail(c * D + lane));
            ready = ready || tail >= static_cast<uint64_t>(base) + 1 + pos;
            if (!__all_sync(kFullMask, ready)) hand_back();
            for (int d = 0; d < D && ok; ++d) {
                const int p = __shfl_sync(kFullMask, pos, d);
                const long long b = __shfl_sync(kFullMask, base, d);
                if (p >= 0 && d != own && !__shfl_sync(kFullMask, ready, d)) {
                    const uint64_t v = wait_at_least(sig.tail(c * D + d), static_cast<uint64_t>(b) + 1 + p, w,
                                                     kOpCombineTail, d * L + l_me, __LINE__, &ok);
                    if (lane == d) tail = v;
                }
            }
        }
        if (!ok) break;
        int ps[D];  // as in the forwarder: no shuffle inside the lane-strided loops
        const int4* rows[D];
        const int own_x = L == 1 ? __shfl_sync(kFullMask, own_row, own) : -1;
#pragma unroll
        for (int d = 0; d < D; ++d) {
            ps[d] = __shfl_sync(kFullMask, pos, d);
            if (d == own) {
                ps[d] = own_x;
                rows[d] = own_x >= 0 ? a.x + static_cast<long long>(own_x) * a.hidden_int4 : nullptr;
            } else {
                rows[d] = ps[d] >= 0 ? reinterpret_cast<const int4*>(g.rdma_slot(1, c * D + d, ps[d]) + kSlotHeaderBytes) : nullptr;
            }
        }
        const long long off = static_cast<long long>(t) * a.hidden_int4;
        // Weight q of the token's partial of domain d (the partial of one row carries that row's weights).
        auto weight = [&](int d, int q) {
            const int p = ps[d];
            if (d == own)
                return a.topk_weights != nullptr ? a.topk_weights[static_cast<long long>(p) * a.num_topk + q] : 0.f;
            return ld_cg_f32(reinterpret_cast<const float*>(g.rdma_slot(1, c * D + d, p) + a.slot_topk_weights_offset) + q);
        };
        // The first 32 weights of every partial are loaded before the sum and added after it, so their round trip
        // is not one more after the rows'.
        const bool weighted = a.combined_topk_weights != nullptr;
        float first[D];
#pragma unroll
        for (int d = 0; d < D; ++d) first[d] = weighted && lane < a.num_topk && ps[d] >= 0 ? weight(d, lane) : 0.f;
        phase.lap(kPhaseRedWait);
        warp_sum_rows<D, kRegisters>(a.combined_x + off, rows, a.bias_0 != nullptr ? a.bias_0 + off : nullptr,
                                     a.bias_1 != nullptr ? a.bias_1 + off : nullptr, a.hidden_int4, lane);
        phase.lap(kPhaseRedSum);
        if (weighted) {
            for (int q = lane; q < a.num_topk; q += 32) {
                float sum = 0.f;
#pragma unroll
                for (int d = 0; d < D; ++d)
                    if (ps[d] >= 0) sum += q == lane ? first[d] : weight(d, q);
                a.combined_topk_weights[static_cast<long long>(t) * a.num_topk + q] = sum;
            }
        }
        __syncwarp();
        if (lane < D && lane != own && pos >= 0) ++pending, seen = pos + 1;
        if (__any_sync(kFullMask, pending >= release_every)) hand_back();
        phase.lap(kPhaseRedRelease);
    }
    hand_back();
    if (lane == 0) nvshmem_quiet();
    // Every reducer warp of the channel has scanned all its tokens: `seen` is the channel's slot count.
    if (ok && lane < D && lane != own) *st.rdma_recvd(c * D + lane, D) = base + seen;
}

}  // namespace deepep_cupy::internode

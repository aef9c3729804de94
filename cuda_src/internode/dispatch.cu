// Internode dispatch, step 2: move the rows (docs/design/internode.md, "Dispatch").
//
// Grid 2 * ceil(C / S) blocks, S channels per block (a template parameter; by default sub_channels of
// ops/internode/buffer_map.py); channel c = tokens [c * ceil(N/C), ...). Channel c's sending side runs in one
// block of its SM pair and its receiving side in the other, alternating by channel (sends_here in copies.cuh).
// On the sending side, warp d < D of the channel's group is the RDMA sender to forwarder (d, l_me); on the
// receiving side, warp j < L forwards what arrives over RDMA to local rank j, warp L + l receives over NVLink
// what forwarder l passes on (with L == 1, warp d < D writes what arrives from domain d straight into the
// outputs: no NVLink hop, and the rank's own rows go there from its sender warp: send_own). The rank's own
// tokens bound for its own domain skip its own RDMA ring: with L > 1 the forwarders read them from x
// (OwnTokens), and the sender warp of d_me only writes their handle entries (send_own_domain). Every ring is
// FIFO, so the rows of one (source, channel) arrive in token order and land at entry 5 + their index: the
// intranode row order.
//
// Cached mode (handle given): entries 1, 2, 4, 6 come from the handle; entry 3, 5, 7, 8, 9 pointers are
// null and not written. The protocol is the same.

#include "common/nvshmem_includes.cuh"
#include "common/value_errors.cuh"
#include "internode/args.cuh"
#include "internode/buffer_map.cuh"
#include "internode/copies.cuh"
#include "internode/sync.cuh"

namespace deepep_cupy::internode {

// Words of a receiver's reply before its row bases (buffer_map.py's nvl_buffer_map sizes the replies).
constexpr int kReplyWords = 8;

template <int L, int D>
struct Geometry {
    const DispatchArgs& a;
    __device__ __forceinline__ int* rdma_meta(int half, int i) const {
        return reinterpret_cast<int*>(a.rdma) + (static_cast<long long>(half) * a.num_channels * D + i) * (2 * L + 2);
    }
    __device__ __forceinline__ uint8_t* rdma_slot(int half, int i, int k) const {
        const long long ring = static_cast<long long>(half) * a.num_channels * D + i;
        return a.rdma + a.ring_offset + (ring * a.rdma_cap + k % a.rdma_cap) * a.slot_bytes;
    }
    __device__ __forceinline__ int* nvl_meta(int j, int c, int l) const {
        return reinterpret_cast<int*>(nvl_base(a.nvl_bases, j) + a.nvl_meta_offset) +
               (static_cast<long long>(c) * L + l) * D * 2;
    }
    // In forwarder `owner`'s buffer: what domain rank j replied to the meta of ring (c, owner -> j), kReplyWords
    // words then the D row bases (dispatch_forward.cuh).
    __device__ __forceinline__ long long* nvl_reply(int owner, int c, int j) const {
        return reinterpret_cast<long long*>(nvl_base(a.nvl_bases, owner) + a.nvl_reply_offset) +
               (static_cast<long long>(c) * L + j) * (kReplyWords + D);
    }
    __device__ __forceinline__ uint8_t* nvl_slot(int j, int c, int l, int n) const {
        return nvl_base(a.nvl_bases, j) + a.nvl_ring_offset +
               ((static_cast<long long>(c) * L + l) * a.nvl_cap + n % a.nvl_cap) * a.slot_bytes;
    }
};

// A token's (or a slot's) first 64 scales and first 32 top-k entries, loaded before its row is copied so that
// their latency hides behind the copy's instead of following it; entries past those (hidden > 8192, top-k > 32)
// are read where they are used.
struct Extras {
    unsigned int scale[2];
    long long expert;
    float weight;
};

// From the caller's tensors (the senders).
__device__ __forceinline__ Extras token_extras(const DispatchArgs& a, int token, int lane) {
    Extras ex;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int q = lane + 32 * u;
        ex.scale[u] = q < a.num_scales ? a.x_scales[token * a.scale_token_stride + q * a.scale_block_stride] : 0u;
    }
    const long long src = static_cast<long long>(token) * a.num_topk + lane;
    ex.expert = lane < a.num_topk ? a.topk_idx[src] : -1;
    ex.weight = lane < a.num_topk && a.topk_weights != nullptr ? a.topk_weights[src] : 0.0f;
    return ex;
}

__device__ __forceinline__ unsigned int token_scale(const DispatchArgs& a, const Extras& ex, int token, int q, int lane) {
    return q == lane        ? ex.scale[0]
           : q == lane + 32 ? ex.scale[1]
                            : a.x_scales[token * a.scale_token_stride + q * a.scale_block_stride];
}

// From a ring slot (the forwarders and receivers); the top-k entries only where `topk` (an op that writes them).
__device__ __forceinline__ Extras slot_extras(const DispatchArgs& a, const uint8_t* s, bool topk, int lane) {
    Extras ex;
    const unsigned int* sc = reinterpret_cast<const unsigned int*>(s + a.slot_scales_offset);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int q = lane + 32 * u;
        ex.scale[u] = q < a.num_scales ? ld_cg_u32(sc + q) : 0u;
    }
    const bool here = topk && lane < a.num_topk;
    ex.expert = here ? ld_cg_s32(reinterpret_cast<const int*>(s + a.slot_topk_idx_offset) + lane) : -1;
    ex.weight = here ? ld_cg_f32(reinterpret_cast<const float*>(s + a.slot_topk_weights_offset) + lane) : 0.0f;
    return ex;
}

__device__ __forceinline__ unsigned int slot_scale(const unsigned int* sc, const Extras& ex, int q, int lane) {
    return q == lane ? ex.scale[0] : q == lane + 32 ? ex.scale[1] : ld_cg_u32(sc + q);
}

// L > 1: this rank's own tokens bound for its own domain do not go through its own RDMA ring: its sender would
// copy each row there and its forwarders copy it out again, a local copy that does nothing (the SMs' stores
// bound the dispatch: docs/design/internode_measurements_four_ranks.md). The forwarders read those rows from the
// caller's tensors instead (TokenRow), in the order the ring would have held them: the channel's tokens with
// a destination in the domain. Ring (c, d_me), its words and its `state` counts are not touched, as with L == 1.
template <int L, int D>
struct OwnTokens {
    int chunk, end;
    unsigned int mask = 0u;  // the current 32 tokens' not yet taken
    int bits = 0;            // this lane's token's destinations in the domain
    __device__ OwnTokens(const DispatchArgs& a, int c) {
        channel_range(a.num_tokens, a.num_channels, c, chunk, end);
        chunk -= 32;
    }
    // Destination bits of token t in this rank's domain (0 past the channel).
    __device__ __forceinline__ static int domain_bits(const DispatchArgs& a, int t, int end) {
        int b = 0;
        if (t < end) {
            const bool* row = a.is_token_in_rank + static_cast<long long>(t) * L * D + (a.rank / L) * L;
#pragma unroll
            for (int j = 0; j < L; ++j) b |= row[j] ? (1 << j) : 0;
        }
        return b;
    }
    // The next token and its destination bits; false past the channel's end.
    __device__ __forceinline__ bool next(const DispatchArgs& a, int lane, int& token, int& token_bits) {
        while (mask == 0u) {
            chunk += 32;
            if (chunk >= end) return false;
            bits = domain_bits(a, chunk + lane, end);
            mask = __ballot_sync(kFullMask, bits != 0);
        }
        const int k = __ffs(mask) - 1;
        mask &= mask - 1u;
        token = chunk + k;
        token_bits = __shfl_sync(kFullMask, bits, k);
        return true;
    }
};

// L > 1, the sender warp of the rank's own domain: no rows to send (OwnTokens), only handle entry 8 of its
// tokens and the check of their expert ids (the forwarders pass a bad id on as -1, as a sender does).
template <int L, int D>
__device__ void send_own_domain(const DispatchArgs& a, int c, int lane) {
    const int d_me = a.rank / L;
    const long long num_experts = static_cast<long long>(L) * D * a.num_local_experts;
    int t_begin, t_end;
    channel_range(a.num_tokens, a.num_channels, c, t_begin, t_end);
    BadValue bad;
    int count = 0;
    for (int chunk = t_begin; chunk < t_end; chunk += 32) {
        const int t = chunk + lane;
        const int bits = OwnTokens<L, D>::domain_bits(a, t, t_end);
        const unsigned int mask = __ballot_sync(kFullMask, bits != 0);
        if (a.send_rdma_head != nullptr && t < t_end)
            a.send_rdma_head[static_cast<long long>(t) * D + d_me] =
                bits ? count + __popc(mask & ((1u << lane) - 1u)) : -1;
        count += __popc(mask);
        for (int q = 0; bits != 0 && q < a.num_topk; ++q)
            bad.check_expert_id(a.topk_idx[static_cast<long long>(t) * a.num_topk + q], num_experts);
    }
    bad.report_from_warp(a.err, kValueOpInternodeDispatch, a.rank, __LINE__);
}

// RDMA sender of channel c to domain d (one warp).
template <int L, int D, int U>
__device__ void send_rdma(const DispatchArgs& a, const WaitCtx& w, int c, int d, int lane) {
    const Geometry<L, D> g{a};
    const int C = a.num_channels, l_me = a.rank % L, d_me = a.rank / L, pe = d * L + l_me;
    const int i = c * D + d, i_peer = c * D + d_me;
    const Signals sig{a.sig, D};
    const State st{a.state};
    const uint64_t base = static_cast<uint64_t>(*st.rdma_sent(i));
    bool ok = true;
    int t_begin, t_end;
    channel_range(a.num_tokens, C, c, t_begin, t_end);

    // The forwarder finished reading everything of the previous op (meta included).
    wait_at_least(sig.head(i), base, w, kOpDispatchHead, pe, __LINE__, &ok);
    if (ok) {
        int* m = g.rdma_meta(0, i);
        if (lane < L) {
            const int r = d * L + lane;
            m[lane] = channel_start(a.gbl_cpm, r, C, c);
            m[L + lane] = a.gbl_cpm[r * C + c];
        } else if (lane == L) {
            m[2 * L] = channel_start(a.rdma_cpm, d, C, c);
        } else if (lane == L + 1) {
            m[2 * L + 1] = a.rdma_cpm[d * C + c];
        }
        put_signal_warp(g.rdma_meta(1, i_peer), m, (2 * L + 2) * sizeof(int), sig.tail(i_peer), base + 1,
                        NVSHMEM_SIGNAL_SET, pe, lane);
    }
    // A peer reachable by loads and stores (NVLink, P2P) gets the rows written straight into its ring and the
    // tail by a release store after a system fence; any other peer gets staged slots, a put and a signal
    // ordered behind nvshmem_fence (put_signal_warp). Either way the data is visible before the tail.
    uint8_t* const peer_ring = a.force_rma ? nullptr : static_cast<uint8_t*>(nvshmem_ptr(g.rdma_slot(1, i_peer, 0), pe));
    uint64_t* const peer_tail = peer_ring ? static_cast<uint64_t*>(nvshmem_ptr(sig.tail(i_peer), pe)) : nullptr;
    const bool p2p = peer_tail != nullptr;
    const long long num_experts = static_cast<long long>(L) * D * a.num_local_experts;
    BadValue bad;
    PhaseClock phase;  // diagnostics builds only (sync.cuh)
    uint64_t head = base;  // the last value of head seen (acquired); read again only when short
    int count = 0, first = 0;
    for (int chunk = t_begin; chunk < t_end; chunk += 32) {
        const int t = chunk + lane;
        int bits = 0;
        if (t < t_end) {
            const bool* row = a.is_token_in_rank + static_cast<long long>(t) * L * D + d * L;
#pragma unroll
            for (int j = 0; j < L; ++j) bits |= row[j] ? (1 << j) : 0;
        }
        unsigned int mask = __ballot_sync(kFullMask, bits != 0);
        if (a.send_rdma_head != nullptr && t < t_end)
            a.send_rdma_head[static_cast<long long>(t) * D + d] = bits ? count + __popc(mask & ((1u << lane) - 1u)) : -1;
        while (ok && mask != 0u) {
            const int k = __ffs(mask) - 1;
            mask &= mask - 1u;
            const int idx = count++;
            const int token = chunk + k;
            const int tok_bits = __shfl_sync(kFullMask, bits, k);
            const Extras ex = token_extras(a, token, lane);
            if (idx >= a.rdma_cap)  // slot idx - Rt must be released (unit 1 + idx - Rt)
                head = wait_reaching(sig.head(i), base + 2 + idx - a.rdma_cap, head, [] {}, w, kOpDispatchHead, pe,
                                     __LINE__, &ok);
            if (!ok) break;
            uint8_t* s = p2p ? peer_ring + static_cast<long long>(idx % a.rdma_cap) * a.slot_bytes
                                : g.rdma_slot(0, i, idx);
            if (lane == 0) *reinterpret_cast<int4*>(s) = make_int4(d_me, tok_bits, token, 0);
            phase.lap(kPhaseSendExtras);
            warp_copy_nc<U>(reinterpret_cast<int4*>(s + kSlotHeaderBytes), a.x + static_cast<long long>(token) * a.hidden_int4,
                         a.hidden_int4, lane);
            phase.lap(kPhaseSendCopy);
            unsigned int* sc = reinterpret_cast<unsigned int*>(s + a.slot_scales_offset);
            for (int q = lane; q < a.num_scales; q += 32) sc[q] = token_scale(a, ex, token, q, lane);
            int* ids = reinterpret_cast<int*>(s + a.slot_topk_idx_offset);
            float* ws = reinterpret_cast<float*>(s + a.slot_topk_weights_offset);
            for (int q = lane; q < a.num_topk; q += 32) {
                const long long src = static_cast<long long>(token) * a.num_topk + q;
                const long long e = q == lane ? ex.expert : a.topk_idx[src];
                bad.check_expert_id(e, num_experts);
                const bool valid = e >= 0 && e < num_experts;
                ids[q] = valid ? static_cast<int>(e) : -1;
                ws[q] = (valid && a.topk_weights != nullptr) ? (q == lane ? ex.weight : a.topk_weights[src]) : 0.0f;
            }
            phase.lap(kPhaseSendMeta);
            // Publish a chunk (Rt is a multiple of the chunk, so a chunk never wraps around the ring).
            if (count - first == a.rdma_chunk) {
                if (p2p)
                    publish_p2p(peer_tail, base + 1 + count, lane);
                else
                    put_signal_warp(g.rdma_slot(1, i_peer, first), g.rdma_slot(0, i, first),
                                    static_cast<size_t>(count - first) * a.slot_bytes, sig.tail(i_peer),
                                    base + 1 + count, NVSHMEM_SIGNAL_SET, pe, lane);
                first = count;
            }
            phase.lap(kPhaseSendPublish);
        }
        if (!ok) break;
    }
    if (ok && count > first) {
        if (p2p)
            publish_p2p(peer_tail, base + 1 + count, lane);
        else
            put_signal_warp(g.rdma_slot(1, i_peer, first), g.rdma_slot(0, i, first),
                            static_cast<size_t>(count - first) * a.slot_bytes, sig.tail(i_peer), base + 1 + count,
                            NVSHMEM_SIGNAL_SET, pe, lane);
    }
    bad.report_from_warp(a.err, kValueOpInternodeDispatch, a.rank, __LINE__);
    if (lane == 0) {
        nvshmem_quiet();
        if (ok) *st.rdma_sent(i) = static_cast<long long>(base + 1 + count);
    }
}

// L == 1: the output row of this rank's first own-domain token in channel c, entry 6 of source d_me - 1 plus
// the channel's start in entry 2 (send_own writes the rows from there, forward_own records it as entry 5).
__device__ __forceinline__ int own_first_row(const DispatchArgs& a, int c) {
    const int C = a.num_channels, d_me = a.rank;
    return prefix_before(a.recv_gbl_prefix, d_me) + channel_start(a.gbl_cpm, d_me, C, c);
}

// L == 1, the rank's own domain (d == d_me): the forwarder of these tokens is this rank, and it would only copy
// each slot into the outputs, so the sender writes the rows there itself and ring (c, d_me) is not used (its
// head, tail and `state` counts stay as they are on both sides, so they still agree). Token k of the (channel,
// own domain) stream lands where forward_direct would put slot k: entry 6 of source d_me - 1 plus this
// channel's start in entry 2 (what the meta record would carry), plus k; every token reaching the domain
// reaches its one rank, so k counts them all. Entries 2 and 6 exist before the kernel starts (from the
// notify kernel, or from the handle). The forwarder writes the bookkeeping entries (forward_own). Where the
// copy engines move the rows (own_rows_copied), the warp writes everything else: scales, top-k, entries 7, 8.
template <int D, int U>
__device__ void send_own(const DispatchArgs& a, int c, int lane) {
    const int C = a.num_channels, d_me = a.rank, El = a.num_local_experts;
    int t_begin, t_end;
    channel_range(a.num_tokens, C, c, t_begin, t_end);
    const int first_row = own_first_row(a, c);
    const long long num_experts = static_cast<long long>(D) * El;
    BadValue bad;
    int count = 0;
    for (int chunk = t_begin; chunk < t_end; chunk += 32) {
        const int t = chunk + lane;
        const bool in = t < t_end && a.is_token_in_rank[static_cast<long long>(t) * D + d_me];
        unsigned int mask = __ballot_sync(kFullMask, in);
        if (a.send_rdma_head != nullptr && t < t_end)
            a.send_rdma_head[static_cast<long long>(t) * D + d_me] = in ? count + __popc(mask & ((1u << lane) - 1u)) : -1;
        while (mask != 0u) {
            const int token = chunk + __ffs(mask) - 1;
            mask &= mask - 1u;
            const Extras ex = token_extras(a, token, lane);
            const long long row = first_row + count++;
            const bool fits = row < a.num_out_rows;  // more rows than num_worst_tokens: reported below
            if (fits) {
                if (!a.own_rows_copied)
                    warp_copy_nc<U>(a.recv_x + row * a.hidden_int4, a.x + static_cast<long long>(token) * a.hidden_int4,
                                 a.hidden_int4, lane);
                for (int q = lane; q < a.num_scales; q += 32)
                    a.recv_x_scales[row * a.num_scales + q] = token_scale(a, ex, token, q, lane);
                if (lane == 0 && a.recv_src_meta != nullptr) {
                    a.recv_src_meta[2 * row] = d_me;
                    a.recv_src_meta[2 * row + 1] = 1;  // bit 0: the domain's one rank
                }
            } else if (lane == 0) {
                report_timeout(a.err, kOpDispatchOverflow, a.rank, d_me, __LINE__, row);
            }
            // Ids are checked for every token, as the ring path does; out-of-range ones select nothing.
            for (int q = lane; q < a.num_topk; q += 32) {
                const long long src = static_cast<long long>(token) * a.num_topk + q;
                const long long e = q == lane ? ex.expert : a.topk_idx[src];
                bad.check_expert_id(e, num_experts);
                const long long local = e - static_cast<long long>(a.rank) * El;
                const bool is_mine = e >= 0 && local >= 0 && local < El;
                if (fits && a.recv_topk_idx != nullptr) {
                    a.recv_topk_idx[row * a.num_topk + q] = is_mine ? local : -1;
                    if (a.recv_topk_weights != nullptr)
                        a.recv_topk_weights[row * a.num_topk + q] =
                            (is_mine && a.topk_weights != nullptr) ? (q == lane ? ex.weight : a.topk_weights[src]) : 0.0f;
                }
            }
        }
    }
    bad.report_from_warp(a.err, kValueOpInternodeDispatch, a.rank, __LINE__);
}

}  // namespace deepep_cupy::internode

#include "internode/dispatch_forward.cuh"

namespace deepep_cupy::internode {

// kSubChannels channels a block (buffer_map.py's sub_channels by default; the engine's sub_channels tuning picks others).
template <int kNumNvlRanks, int kNumDomains, int kSubChannels>
__global__ void __launch_bounds__(32 * dispatch_channel_warps(kNumNvlRanks, kNumDomains) * kSubChannels, 1)
dispatch(const __grid_constant__ DispatchArgs args) {
    constexpr int L = kNumNvlRanks, D = kNumDomains;
    constexpr int W = dispatch_channel_warps(L, D), S = kSubChannels, U = dispatch_copy_unroll(W * S);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, sub = warp / W, role = warp % W;
    const int cb = blockIdx.x / 2, c = cb * S + sub;
    const DispatchArgs& a = args;
    const WaitCtx w{args.err, args.timeout_ns, args.rank};
    // Channel c's senders run in one block of the pair and its receivers in the other, alternating by c.
    __shared__ ForwardShared<L, D> shared[S];
    receive_begin<L, D, S>(a, shared, cb);
    __syncthreads();
    WarpClock clock(sends_here(sub));  // diagnostics builds only (sync.cuh)
    if (c < args.num_channels && !sends_here(sub)) {
        receive_role<L, D, U>(a, w, shared[sub], c, role, lane);
        if (role < (L == 1 ? D : 2 * L)) clock.stop();
    } else if (c < args.num_channels && role < D) {
        if (L == 1 && role == args.rank)
            send_own<D, U>(a, c, lane);
        else if (L > 1 && role == args.rank / L)
            send_own_domain<L, D>(a, c, lane);
        else
            send_rdma<L, D, U>(a, w, c, role, lane);
        clock.stop();
    }
    __syncthreads();
    receive_end<L, D, S>(a, shared, cb);
}

}  // namespace deepep_cupy::internode

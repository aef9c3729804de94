// Internode dispatch, what the forwarder and NVLink receiver warps of a block share (dispatch_forward.cuh):
// where a forwarded row comes from (a ring slot or, for this rank's own tokens, x) and how it is copied into
// a slot, where a received row's outputs are and how it is stored there, the forwarders' shared state and their
// bookkeeping of each RDMA slot, and the rows-in-place loops (a forwarder storing rows straight into a domain
// rank's outputs, the receiver warp that helps it, and the count they publish; the protocol is in
// dispatch_forward.cuh's header).
// Included by dispatch_forward.cuh only (needs DispatchArgs, Geometry, Extras and OwnTokens from dispatch.cu).
#pragma once

namespace deepep_cupy::internode {

// Where a forwarded row comes from: a ring slot (what its source sent), or, for this rank's own tokens bound for
// its own domain (L > 1), the caller's tensors: those skip the rank's own RDMA ring (OwnTokens, dispatch.cu). Both
// give the same values: a token's expert ids as a slot carries them (-1 for an id out of range, its weight 0).
struct SlotRow {
    static constexpr bool kIsSlot = true;
    const uint8_t* s;
    __device__ __forceinline__ Extras extras(const DispatchArgs& a, bool topk, int lane) const {
        return slot_extras(a, s, topk, lane);
    }
    __device__ __forceinline__ const int4* row() const { return reinterpret_cast<const int4*>(s + kSlotHeaderBytes); }
    __device__ __forceinline__ unsigned int scale(const DispatchArgs& a, const Extras& ex, int q, int lane) const {
        return slot_scale(reinterpret_cast<const unsigned int*>(s + a.slot_scales_offset), ex, q, lane);
    }
    __device__ __forceinline__ int expert(const DispatchArgs& a, const Extras& ex, int q, int lane) const {
        const int* ids = reinterpret_cast<const int*>(s + a.slot_topk_idx_offset);
        return q == lane ? static_cast<int>(ex.expert) : ld_cg_s32(ids + q);
    }
    __device__ __forceinline__ float weight(const DispatchArgs& a, const Extras& ex, int q, int lane) const {
        return q == lane ? ex.weight : ld_cg_f32(reinterpret_cast<const float*>(s + a.slot_topk_weights_offset) + q);
    }
};

struct TokenRow {
    static constexpr bool kIsSlot = false;
    const DispatchArgs& a;
    int token, domain;      // the token, and this rank's domain (the source domain its slot would carry)
    long long num_experts;  // ids outside [0, num_experts) go as -1, as the sender would send them
    __device__ __forceinline__ Extras extras(const DispatchArgs&, bool, int lane) const {
        return token_extras(a, token, lane);
    }
    __device__ __forceinline__ const int4* row() const { return a.x + static_cast<long long>(token) * a.hidden_int4; }
    __device__ __forceinline__ unsigned int scale(const DispatchArgs&, const Extras& ex, int q, int lane) const {
        return token_scale(a, ex, token, q, lane);
    }
    __device__ __forceinline__ int expert(const DispatchArgs&, const Extras& ex, int q, int lane) const {
        const long long e = q == lane ? ex.expert : a.topk_idx[static_cast<long long>(token) * a.num_topk + q];
        return e >= 0 && e < num_experts ? static_cast<int>(e) : -1;
    }
    __device__ __forceinline__ float weight(const DispatchArgs& args, const Extras& ex, int q, int lane) const {
        if (a.topk_weights == nullptr || expert(args, ex, q, lane) < 0) return 0.0f;
        return q == lane ? ex.weight : a.topk_weights[static_cast<long long>(token) * a.num_topk + q];
    }
};

// Copy a row's slot (header, row, scales, top-k ids and weights: the parts this op fills) into `dst`
// with the warp; a slot's header and row go in one copy, a token's header is (d_me, bits, token).
template <int U, class Src>
__device__ __forceinline__ void copy_slot(uint8_t* dst, const Src& src, const DispatchArgs& a, int bits, int lane) {
    const Extras ex = src.extras(a, true, lane);
    if constexpr (Src::kIsSlot) {
        warp_copy_cg<U>(reinterpret_cast<int4*>(dst), reinterpret_cast<const int4*>(src.s), 1 + a.hidden_int4, lane);
    } else {
        if (lane == 0) *reinterpret_cast<int4*>(dst) = make_int4(src.domain, bits, src.token, 0);
        warp_copy_nc<U>(reinterpret_cast<int4*>(dst + kSlotHeaderBytes), src.row(), a.hidden_int4, lane);
    }
    unsigned int* to = reinterpret_cast<unsigned int*>(dst);
    const int sc = a.slot_scales_offset / 4, ids = a.slot_topk_idx_offset / 4, ws = a.slot_topk_weights_offset / 4;
    for (int q = lane; q < a.num_scales; q += 32) to[sc + q] = src.scale(a, ex, q, lane);
    for (int q = lane; q < a.num_topk; q += 32) {
        to[ids + q] = static_cast<unsigned int>(src.expert(a, ex, q, lane));
        to[ws + q] = __float_as_uint(src.weight(a, ex, q, lane));
    }
}

// Where one destination's outputs of a row are: this rank's own (the NVLink receivers, L == 1), or, with rows
// in place, a domain rank's, through its output pool. `rank` turns global expert ids into its local ones.
struct RowOutputs {
    int4* x;
    unsigned int* scales;
    long long* topk_idx;
    float* topk_weights;
    int* src_meta;
    int num_rows, rank;
};

__device__ __forceinline__ RowOutputs own_outputs(const DispatchArgs& a) {
    return {a.recv_x, a.recv_x_scales, a.recv_topk_idx, a.recv_topk_weights, a.recv_src_meta, a.num_out_rows, a.rank};
}

// Outputs of one received row (from `src`: a ring slot or, for this rank's own tokens, the caller's tensors;
// source domain `sd`, destination bits `bits`) at `row` of `o` (row < o.num_rows): recv_x, scales (row-major,
// as the plan allocates them), local top-k ids (-1 for other ranks' experts) and weights, recv_src_meta.
template <int U, class Src>
__device__ __forceinline__ void store_row(const DispatchArgs& a, const RowOutputs& o, const Src& src, int row, int sd,
                                          int bits, int lane) {
    const int hidden_int4 = a.hidden_int4, El = a.num_local_experts;
    const Extras ex = src.extras(a, o.topk_idx != nullptr, lane);
    int4* out = o.x + static_cast<long long>(row) * hidden_int4;
    if constexpr (Src::kIsSlot)
        warp_copy_cg<U>(out, src.row(), hidden_int4, lane);
    else
        warp_copy_nc<U>(out, src.row(), hidden_int4, lane);
    for (int q = lane; q < a.num_scales; q += 32)
        o.scales[static_cast<long long>(row) * a.num_scales + q] = src.scale(a, ex, q, lane);
    if (o.topk_idx != nullptr) {
        for (int q = lane; q < a.num_topk; q += 32) {
            const int e = src.expert(a, ex, q, lane);
            const int local = e - o.rank * El;
            const bool is_mine = e >= 0 && local >= 0 && local < El;
            o.topk_idx[static_cast<long long>(row) * a.num_topk + q] = is_mine ? local : -1;
            if (o.topk_weights != nullptr)
                o.topk_weights[static_cast<long long>(row) * a.num_topk + q] =
                    is_mine ? src.weight(a, ex, q, lane) : 0.0f;
        }
    }
    if (lane == 0 && o.src_meta != nullptr) {
        o.src_meta[2 * static_cast<long long>(row)] = sd;
        o.src_meta[2 * static_cast<long long>(row) + 1] = bits;
    }
}

// A received row into this rank's outputs; a row past them (more than num_worst_tokens) is reported, naming
// `peer`.
template <int U>
__device__ __forceinline__ void store_own_row(const DispatchArgs& a, const uint8_t* s, int row, int sd, int bits,
                                              int peer, int lane) {
    if (row < a.num_out_rows)
        store_row<U>(a, own_outputs(a), SlotRow{s}, row, sd, bits, lane);
    else if (lane == 0)
        report_timeout(a.err, kOpDispatchOverflow, a.rank, peer, __LINE__, row);
}

// Shared state of the forwarder warps of one block: RDMA units each warp has finished per source domain
// (the slowest decides what goes back to the source), and what was already returned.
template <int L, int D>
struct ForwardShared {
    int progress[D][L];
    int released[D];
    int count[D];          // slots arriving from each domain in this channel
    long long base[D];     // rdma_recvd before this op
    RowOutputs out[L];     // rows in place: domain rank j's outputs (read per row: registers are short here)
    int row_at[L][D];      // rows in place: j's first row of source (d, l_me) in this channel
    int ready[L];          // forwarder j's outputs set: 1 with rows in place and a helper, 2 without a helper
    int finished[L];       // rows in place with a helper: 2 * rows + 1 for each of the two warps done
};

// Return to source domain d the RDMA units every forwarder warp is done with. Lane 0 only. Several warps
// may return at once: atomicMax hands each increment to exactly one of them, and ADD makes the order in
// which the increments land irrelevant (and needs no fence: give_back_store in sync.cuh).
template <int L, int D>
__device__ __forceinline__ void release_rdma(ForwardShared<L, D>& sh, const Signals& sig, int c, int d, int d_me,
                                             int l_me) {
    if (d == d_me) return;  // this rank's own tokens: read from its tensors, no ring (OwnTokens)
    int m = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < L; ++j) m = min(m, static_cast<volatile int*>(&sh.progress[d][0])[j]);
    const int old = atomicMax(&sh.released[d], m);
    if (m > old) {
        nvshmemx_signal_op(sig.head(c * D + d_me), static_cast<uint64_t>(m - old), NVSHMEM_SIGNAL_ADD, d * L + l_me);
    }
}

// Lane 0 of forwarder warp j, slot k (of n) of source domain d handled (pos: its index among j's rows, -1 when
// not for j): handle entry 9 for RDMA receive row row0 + k, the warp's progress, and every release_every slots
// (and at the last) the slots every forwarder warp is done with back to the source.
template <int L, int D>
__device__ __forceinline__ void slot_done(const DispatchArgs& a, ForwardShared<L, D>& sh, const Signals& sig, int c,
                                          int d, int j, int k, int n, int row0, int pos, int release_every) {
    const int l_me = a.rank % L, d_me = a.rank / L;
    if (a.send_nvl_head != nullptr) {
        // With num_worst_tokens the rows are fixed: a forwarder may pass on more tokens than that.
        if (row0 + k < a.num_nvl_head_rows)
            a.send_nvl_head[static_cast<long long>(row0 + k) * L + j] = pos;
        else
            report_timeout(a.err, kOpDispatchOverflow, a.rank, d * L + l_me, __LINE__, row0 + k + 1);
    }
    static_cast<volatile int*>(&sh.progress[d][0])[j] = 2 + k;
    if ((k + 1) % release_every == 0 || k + 1 == n) release_rdma<L, D>(sh, sig, c, d, d_me, l_me);
}

// The slots of source domain d in channel c in order, as a forwarder warp takes them: this rank's own tokens
// (d == d_me, OwnTokens) from its tensors, any other domain's from ring (c, d) once its tail covers them.
template <int L, int D>
struct SourceSlots {
    OwnTokens<L, D> tokens;
    bool own;
    int c, d;
    uint64_t base;  // units of ring (c, d) before this op
    int avail = 0;  // slots the last tail read covers
    __device__ SourceSlots(const DispatchArgs& a, const ForwardShared<L, D>& sh, int c_, int d_)
        : tokens(a, c_), own(d_ == a.rank / L), c(c_), d(d_), base(static_cast<uint64_t>(sh.base[d_])) {}
    // Slot k (every k in turn): its destination bits, and its token (own) or its address. Before waiting for the
    // source it calls before_wait(): what the source may be waiting for goes first. False when the wait ran out.
    template <class BeforeWait>
    __device__ __forceinline__ bool next(const DispatchArgs& a, const WaitCtx& w, int k, int lane, BeforeWait before_wait,
                                         int& bits, int& token, const uint8_t*& s) {
        if (own) {
            tokens.next(a, lane, token, bits);  // the channel's count of tokens with bits (notify, or the handle)
            return true;
        }
        if (k >= avail) {
            bool ok = true;
            const uint64_t v = wait_reaching(Signals{a.sig, D}.tail(c * D + d), base + 2 + k, 0, before_wait, w,
                                             kOpDispatchTail, d * L + a.rank % L, __LINE__, &ok);
            if (!ok) return false;
            avail = static_cast<int>(v - base - 1);
        }
        s = Geometry<L, D>{a}.rdma_slot(1, c * D + d, k);
        bits = ld_cg_s32(s + 4);
        return true;
    }
};

// Rows in place: the slots of source domain d in channel c that carry bit j go into j's outputs (sh.out[j],
// from row sh.row_at[j][d] on), as receive() would store them from j's NVLink ring; the handle entry and the
// RDMA slots go as in forward() (for d == d_me the slots are this rank's own tokens, read from x: OwnTokens).
// Nothing is published to j per row: j waits for the final count of rows (finish_in_place, or forward()'s last
// publish). Returns the rows written.
template <int L, int D, int U>
__device__ int forward_in_place(const DispatchArgs& a, const WaitCtx& w, ForwardShared<L, D>& sh, int c, int j, int d,
                                int lane, bool* ok) {
    const Geometry<L, D> g{a};
    const Signals sig{a.sig, D};
    const int C = a.num_channels, l_me = a.rank % L, d_me = a.rank / L;
    const bool own = d == d_me;  // this rank's own tokens: from its tensors (OwnTokens), no ring
    int r0, n;
    if (own) {
        r0 = channel_start(a.rdma_cpm, d, C, c);
        n = a.rdma_cpm[d * C + c] - r0;
    } else {
        const int* m = g.rdma_meta(1, c * D + d);  // forward() waited for it
        r0 = ld_cg_s32(m + 2 * L);
        n = ld_cg_s32(m + 2 * L + 1) - r0;
    }
    const int row0 = prefix_before(a.recv_rdma_prefix, d) + r0, first = sh.row_at[j][d];
    const int release_every = max(1, min(8, a.rdma_cap / 2));  // RDMA slots given back per signal
    const long long num_experts = static_cast<long long>(L) * D * a.num_local_experts;
    SourceSlots<L, D> slots(a, sh, c, d);
    int k_j = 0;
    for (int k = 0; k < n; ++k) {
        int bits = 0, token = 0;
        const uint8_t* s = nullptr;
        // Before waiting for the source, give back what is done (it may be waiting for ring space).
        if (!slots.next(a, w, k, lane, [&] {
                if (lane == 0) release_rdma<L, D>(sh, sig, c, d, d_me, l_me);
                __syncwarp();
            }, bits, token, s)) {
            *ok = false;
            break;
        }
        int pos = -1;
        if (bits & (1 << j)) {
            // Rows past j's outputs (num_worst_tokens) are left out here and reported by j.
            if (first + k_j < sh.out[j].num_rows) {
                if (own)
                    store_row<U>(a, sh.out[j], TokenRow{a, token, d_me, num_experts}, first + k_j, d, bits, lane);
                else
                    store_row<U>(a, sh.out[j], SlotRow{s}, first + k_j, d, bits, lane);
            }
            pos = k_j++;
        }
        if (lane == 0) slot_done<L, D>(a, sh, sig, c, d, j, k, n, row0, pos, release_every);
        __syncwarp();
    }
    return k_j;
}

// Rows in place with a helper: the second of the two warps to be done publishes the rows both wrote (j's tail
// and this rank's count for the ring). Each warp fences its stores before it counts itself in; the second
// fences again after seeing the first, so j sees every row of both before the tail.
template <int L, int D>
__device__ void finish_in_place(const DispatchArgs& a, ForwardShared<L, D>& sh, int c, int j, int rows, uint64_t base_n,
                                int lane) {
    const NvlCtrl dest{nvl_base(a.nvl_bases, j), L};
    const State st{a.state};
    __syncwarp();
    fence_acq_rel_sys();
    if (lane == 0) {
        const int old = atomicAdd(&sh.finished[j], 2 * rows + 1);
        if (old & 1) {
            const uint64_t total = base_n + 1 + static_cast<uint64_t>(old / 2 + rows);
            fence_acq_rel_sys();
            st_relaxed_sys(dest.tail(c * L + a.rank % L), total);
            *st.nvl_sent(c * L + j, D) = static_cast<long long>(total);
        }
    }
}

// The receiver warp for l when this rank's rows arrive in place (it has nothing to copy): the odd source
// domains of forwarder warp j = l, once that warp has j's outputs (sh.ready).
template <int L, int D, int U>
__device__ void help_forward(const DispatchArgs& a, const WaitCtx& w, ForwardShared<L, D>& sh, int c, int j, int lane) {
    const State st{a.state};
    const int ready = shared_wait(static_cast<volatile int*>(sh.ready) + j, [](int v) { return v != 0; },
                                  [](unsigned int) {}, w, kOpDispatchHelper, __LINE__, lane);
    if (ready != 1) return;  // no rows to help with, or the wait ran out (reported)
    const uint64_t base_n = static_cast<uint64_t>(*st.nvl_sent(c * L + j, D));
    bool ok = true;
    int rows = 0;
    for (int d = 1; d < D && ok; d += 2) rows += forward_in_place<L, D, U>(a, w, sh, c, j, d, lane, &ok);
    if (ok) finish_in_place<L, D>(a, sh, c, j, rows, base_n, lane);
    if (lane == 0) nvshmem_quiet();
}

}  // namespace deepep_cupy::internode

// Internode dispatch, what the forwarder and NVLink receiver warps of a block share (dispatch_forward.cuh):
// where a received row's outputs are and how it is stored there, the forwarders' shared state and their
// bookkeeping of each RDMA slot, and the rows-in-place loops (a forwarder storing rows straight into a domain
// rank's outputs, the receiver warp that helps it, and the count they publish; the protocol is in
// dispatch_forward.cuh's header).
// Included by dispatch_forward.cuh only (needs DispatchArgs, Geometry and Extras from dispatch.cu).
#pragma once

namespace deepep_cupy::internode {

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

// Outputs of one received row (slot `s`, from source domain `sd`, destination bits `bits`) at `row` of `o`
// (row < o.num_rows): recv_x, scales (row-major, as the plan allocates them), local top-k ids (-1 for other
// ranks' experts) and weights, recv_src_meta.
template <int U>
__device__ __forceinline__ void store_row(const DispatchArgs& a, const RowOutputs& o, const uint8_t* s, int row, int sd,
                                          int bits, int lane) {
    const int hidden_int4 = a.hidden_int4, El = a.num_local_experts;
    const Extras ex = slot_extras(a, s, o.topk_idx != nullptr, lane);
    warp_copy_cg<U>(o.x + static_cast<long long>(row) * hidden_int4, reinterpret_cast<const int4*>(s + 16), hidden_int4,
                    lane);
    const unsigned int* sc = reinterpret_cast<const unsigned int*>(s + a.slot.scales_offset);
    for (int q = lane; q < a.num_scales; q += 32)
        o.scales[static_cast<long long>(row) * a.num_scales + q] = slot_scale(sc, ex, q, lane);
    if (o.topk_idx != nullptr) {
        const int* ids = reinterpret_cast<const int*>(s + a.slot.topk_idx_offset);
        const float* ws = reinterpret_cast<const float*>(s + a.slot.topk_weights_offset);
        for (int q = lane; q < a.num_topk; q += 32) {
            const int e = q == lane ? static_cast<int>(ex.expert) : ld_cg_s32(ids + q);
            const int local = e - o.rank * El;
            const bool is_mine = e >= 0 && local >= 0 && local < El;
            o.topk_idx[static_cast<long long>(row) * a.num_topk + q] = is_mine ? local : -1;
            if (o.topk_weights != nullptr)
                o.topk_weights[static_cast<long long>(row) * a.num_topk + q] =
                    is_mine ? (q == lane ? ex.weight : ld_cg_f32(ws + q)) : 0.0f;
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
        store_row<U>(a, own_outputs(a), s, row, sd, bits, lane);
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
// which the increments land irrelevant (and needs no fence: give_back_store in layout.cuh).
template <int L, int D>
__device__ __forceinline__ void release_rdma(ForwardShared<L, D>& sh, const Signals& sig, int c, int d, int d_me,
                                             int l_me) {
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

// Rows in place: the slots of source domain d in channel c that carry bit j go into j's outputs (sh.out[j],
// from row sh.row_at[j][d] on), as receive() would store them from j's NVLink ring; the handle entry and the
// RDMA slots go as in forward(). Nothing is published to j per row: j waits for the final count of rows
// (finish_in_place, or forward()'s last publish). Returns the rows written.
template <int L, int D, int U>
__device__ int forward_in_place(const DispatchArgs& a, const WaitCtx& w, ForwardShared<L, D>& sh, int c, int j, int d,
                                int lane, bool* ok) {
    const Geometry<L, D> g{a};
    const Signals sig{a.sig, D};
    const int l_me = a.rank % L, d_me = a.rank / L;
    const uint64_t base_r = static_cast<uint64_t>(sh.base[d]);
    const int* m = g.rdma_meta(1, c * D + d);  // forward() waited for it
    const int r0 = ld_cg_s32(m + 2 * L), n = ld_cg_s32(m + 2 * L + 1) - r0;
    const int row0 = (d > 0 ? a.recv_rdma_prefix[d - 1] : 0) + r0, first = sh.row_at[j][d];
    const int release_every = max(1, min(8, a.rdma_cap / 2));  // RDMA slots given back per signal
    int avail = 0, k_j = 0;
    for (int k = 0; k < n; ++k) {
        if (k >= avail) {
            // Before waiting for the source, give back what is done (it may be waiting for ring space).
            const uint64_t v = wait_reaching(sig.tail(c * D + d), base_r + 2 + k, 0, [&] {
                if (lane == 0) release_rdma<L, D>(sh, sig, c, d, d_me, l_me);
                __syncwarp();
            }, w, kOpDispatchTail, d * L + l_me, __LINE__, ok);
            if (!*ok) break;
            avail = static_cast<int>(v - base_r - 1);
        }
        const uint8_t* s = g.rdma_slot(1, c * D + d, k);
        const int bits = ld_cg_s32(s + 4);
        int pos = -1;
        if (bits & (1 << j)) {
            // Rows past j's outputs (num_worst_tokens) are left out here and reported by j.
            if (first + k_j < sh.out[j].num_rows) store_row<U>(a, sh.out[j], s, first + k_j, d, bits, lane);
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

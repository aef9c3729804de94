// Internode dispatch, receiver block of a channel: the forwarders (warp j < L: RDMA ring -> NVLink ring
// of local rank j, and this rank's own tokens of its domain from x) and the NVLink receivers (warp L + l:
// NVLink ring of forwarder l -> outputs); with
// L == 1, warp d < D: RDMA ring of source domain d -> outputs (forward_direct), or, for d == d_me, only the
// handle entries of the rows the sender wrote itself (forward_own).
//
// Rows in place (L > 1, an output pool): a receiver whose outputs of the call lie in its output pool
// (device/output_pool.py, mapped into every rank of the domain) answers its forwarder's meta record with a
// reply: where those outputs are in its pool, their rows, and where the rows of each source domain start in
// this channel. The forwarder then stores each row and its scales, top-k and source meta straight into those
// outputs, as the receiver would have from the NVLink ring, and its tail counts the rows written; the
// receiver only waits for the count. A row then crosses the domain once and is copied by one warp instead of
// two (the NVLink ring and the copy out of it are gone). A receiver whose outputs are ordinary allocations
// (the pool is full, a CUDA-graph capture) replies so and keeps the ring, so each receiver picks its own
// mode. The reply is tagged with the ring's unit count, and a forwarder that finds another tag keeps the ring.
// Included by dispatch.cu only (needs DispatchArgs and Geometry).
#pragma once

#include "internode/dispatch_rows.cuh"

namespace deepep_cupy::internode {

template <int L, int D, int U>
__device__ void forward(const DispatchArgs& a, const WaitCtx& w, ForwardShared<L, D>& sh, int c, int j, int lane) {
    const Geometry<L, D> g{a};
    const Signals sig{a.sig, D};
    const State st{a.state};
    const int C = a.num_channels, l_me = a.rank % L, d_me = a.rank / L;
    const NvlCtrl mine{nvl_base(a.nvl_bases, l_me), L};
    const NvlCtrl dest{nvl_base(a.nvl_bases, j), L};
    const uint64_t base_n = static_cast<uint64_t>(*st.nvl_sent(c * L + j, D));
    bool ok = true;
    // Meta of every source domain: lane d keeps (NVLink start, end for j, RDMA start, end).
    int ns = 0, ne = 0, r0 = 0, r1 = 0;
    for (int d = 0; d < D && ok; ++d) {
        int v0, v1, v2, v3;
        if (d == d_me) {
            // This rank's own tokens (OwnTokens): the record its sender would have sent, from entries 1 and 2.
            const int r = d_me * L + j;
            v0 = channel_start(a.gbl_cpm, r, C, c);
            v1 = a.gbl_cpm[r * C + c];
            v2 = channel_start(a.rdma_cpm, d, C, c);
            v3 = a.rdma_cpm[d * C + c];
        } else {
            wait_at_least(sig.tail(c * D + d), static_cast<uint64_t>(sh.base[d]) + 1, w, kOpDispatchTail, d * L + l_me,
                          __LINE__, &ok);
            if (!ok) break;
            const int* m = g.rdma_meta(1, c * D + d);
            v0 = ld_cg_s32(m + j), v1 = ld_cg_s32(m + L + j);
            v2 = ld_cg_s32(m + 2 * L), v3 = ld_cg_s32(m + 2 * L + 1);
        }
        if (lane == d) ns = v0, ne = v1, r0 = v2, r1 = v3;
        if (j == 0 && lane == 0) {
            sh.count[d] = v3 - v2;
            if (a.recv_rdma_cpm != nullptr) a.recv_rdma_cpm[d * C + c] = v3;
        }
        __syncwarp();
        if (lane == 0) {
            static_cast<volatile int*>(&sh.progress[d][0])[j] = 1;
            release_rdma<L, D>(sh, sig, c, d, d_me, l_me);
        }
    }
    // NVLink meta for j, once j has drained this ring in the previous op.
    wait_at_least(mine.head(c * L + j), base_n, w, kOpDispatchNvlHead, d_me * L + j, __LINE__, &ok);
    if (ok) {
        if (lane < D) {
            int* m = g.nvl_meta(j, c, l_me);
            m[2 * lane] = ns;
            m[2 * lane + 1] = ne;
        }
        publish_p2p(dest.tail(c * L + l_me), base_n + 1, lane);
    }
    // Rows in place: j's reply comes with its hand-back of the meta. When this rank's own rows arrive in place
    // too, its receiver warp for l = j has nothing to copy and helps: it takes the odd source domains, this warp
    // the even ones (each domain's slots are a ring of their own), so one domain's rows no longer wait behind
    // another's.
    bool in_place = false;
    if (a.pool_bases != nullptr && ok) {
        wait_at_least(mine.head(c * L + j), base_n + 1, w, kOpDispatchNvlHead, d_me * L + j, __LINE__, &ok);
        const long long* rep = g.nvl_reply(l_me, c, j);
        const long long h = ok && lane < kReplyWords ? ld_cg_s64(rep + lane) : 0;
        if (ok && lane < D) sh.row_at[j][lane] = static_cast<int>(ld_cg_s64(rep + kReplyWords + lane));
        in_place = __shfl_sync(kFullMask, h, 7) == static_cast<long long>(base_n + 1) &&
                   __shfl_sync(kFullMask, h, 6) == 1;
        if (in_place) {
            const uintptr_t pool = static_cast<uintptr_t>(a.pool_bases[j]);
            auto at = [&](int q) {
                const long long o = __shfl_sync(kFullMask, h, q);
                return o < 0 ? uintptr_t{0} : pool + static_cast<uintptr_t>(o);
            };
            const RowOutputs o{reinterpret_cast<int4*>(at(0)), reinterpret_cast<unsigned int*>(at(1)),
                               reinterpret_cast<long long*>(at(2)), reinterpret_cast<float*>(at(3)),
                               reinterpret_cast<int*>(at(4)), static_cast<int>(__shfl_sync(kFullMask, h, 5)),
                               d_me * L + j};
            if (lane == 0) sh.out[j] = o;
        }
        __syncwarp();
    }
    const bool split = in_place && a.outputs_in_pool;
    if (a.pool_bases != nullptr && a.outputs_in_pool) {
        // The helper waits for this word, whatever happened above.
        if (lane == 0) {
            __threadfence_block();
            static_cast<volatile int*>(sh.ready)[j] = split ? 1 : 2;
        }
    }
    int sent = 0, published = 0;  // slots written into j's ring (or rows into its outputs), and made visible to j
    if (in_place) {
        for (int d = 0; d < D && ok; d += split ? 2 : 1)
            sent += forward_in_place<L, D, U>(a, w, sh, c, j, d, lane, &ok);
        if (split) {
            if (ok) finish_in_place<L, D>(a, sh, c, j, sent, base_n, lane);
            if (lane == 0) nvshmem_quiet();
            return;
        }
    }
    const int release_every = max(1, min(8, a.rdma_cap / 2));  // RDMA slots given back per signal
    uint64_t nvl_head = base_n;   // the last value of j's head seen (acquired); read again only when short
    // One system-scope fence per kPublishBatch slots instead of one per slot, and never a wait with slots
    // written but not published (j may be waiting for them).
    auto flush = [&]() {
        if (sent > published) {
            publish_p2p(dest.tail(c * L + l_me), base_n + 1 + sent, lane);
            published = sent;
        }
    };
    const long long num_experts = static_cast<long long>(L) * D * a.num_local_experts;
    for (int d = 0; d < D && ok && !in_place; ++d) {
        const int n = __shfl_sync(kFullMask, r1 - r0, d);
        const int row0 = prefix_before(a.recv_rdma_prefix, d) + __shfl_sync(kFullMask, r0, d);
        const bool own = d == d_me;  // this rank's own tokens: from its tensors (OwnTokens), no ring
        SourceSlots<L, D> slots(a, sh, c, d);
        int k_j = 0;
        for (int k = 0; k < n; ++k) {
            int bits = 0, token = 0;
            const uint8_t* s = nullptr;
            // Before waiting for the source, hand over and give back everything done so far (the source may be
            // waiting for ring space).
            if (!slots.next(a, w, k, lane, [&] {
                    flush();
                    if (lane == 0) release_rdma<L, D>(sh, sig, c, d, d_me, l_me);
                    __syncwarp();
                }, bits, token, s)) {
                ok = false;
                break;
            }
            int pos = -1;
            if (bits & (1 << j)) {
                if (sent >= a.nvl_cap)  // slot sent - Rn must be free
                    nvl_head = wait_reaching(mine.head(c * L + j), base_n + 2 + sent - a.nvl_cap, nvl_head, flush, w,
                                             kOpDispatchNvlHead, d_me * L + j, __LINE__, &ok);
                if (!ok) break;
                uint8_t* slot = g.nvl_slot(j, c, l_me, sent);
                if (own)
                    copy_slot<U>(slot, TokenRow{a, token, d_me, num_experts}, a, bits, lane);
                else
                    copy_slot<U>(slot, SlotRow{s}, a, bits, lane);
                ++sent;
                if (sent - published >= kPublishBatch) flush();
                pos = k_j++;
            }
            if (lane == 0) slot_done<L, D>(a, sh, sig, c, d, j, k, n, row0, pos, release_every);
            __syncwarp();
        }
    }
    if (ok) flush();
    if (lane == 0) {
        nvshmem_quiet();
        if (ok) *st.nvl_sent(c * L + j, D) = static_cast<long long>(base_n + 1 + sent);
    }
}

template <int L, int D, int U>
__device__ void receive(const DispatchArgs& a, const WaitCtx& w, ForwardShared<L, D>& sh, int c, int l, int lane) {
    const Geometry<L, D> g{a};
    const State st{a.state};
    const int C = a.num_channels, l_me = a.rank % L, d_me = a.rank / L;
    const NvlCtrl mine{nvl_base(a.nvl_bases, l_me), L};
    const NvlCtrl writer{nvl_base(a.nvl_bases, l), L};
    const int k_ring = c * L + l;
    const uint64_t base = static_cast<uint64_t>(*st.nvl_recvd(k_ring, D, L));
    bool ok = true;
    wait_at_least(mine.tail(k_ring), base + 1, w, kOpDispatchNvlTail, d_me * L + l, __LINE__, &ok);
    if (!ok) return;
    // Lane d: where the rows of source (d, l) in this channel start, and how many there are.
    int row_base = 0, cnt = 0;
    if (lane < D) {
        const int* m = g.nvl_meta(l_me, c, l);
        const int ns = ld_cg_s32(m + 2 * lane), ne = ld_cg_s32(m + 2 * lane + 1);
        const int s = lane * L + l;
        row_base = prefix_before(a.recv_gbl_prefix, s) + ns;
        cnt = ne - ns;
        if (a.recv_gbl_cpm != nullptr) a.recv_gbl_cpm[s * C + c] = row_base;
    }
    int total = cnt;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(kFullMask, total, off);
    const bool in_place = a.pool_bases != nullptr && a.outputs_in_pool;
    if (a.pool_bases != nullptr) {
        // The reply (dispatch_forward.cuh's header), released with the meta's hand-back: the outputs' offsets
        // in this rank's pool (-1: none), its rows, whether they are in the pool, the tag, the row bases.
        const uintptr_t pool = static_cast<uintptr_t>(a.pool_bases[l_me]);
        auto offset = [&](const void* p) {
            return p == nullptr ? -1LL : static_cast<long long>(reinterpret_cast<uintptr_t>(p) - pool);
        };
        long long* rep = g.nvl_reply(l, c, l_me);
        if (lane < kReplyWords)
            rep[lane] = lane == 0   ? offset(a.recv_x)
                        : lane == 1 ? offset(a.recv_x_scales)
                        : lane == 2 ? offset(a.recv_topk_idx)
                        : lane == 3 ? offset(a.recv_topk_weights)
                        : lane == 4 ? offset(a.recv_src_meta)
                        : lane == 5 ? static_cast<long long>(a.num_out_rows)
                        : lane == 6 ? static_cast<long long>(in_place)
                                    : static_cast<long long>(base + 1);
        if (lane < D) rep[kReplyWords + lane] = row_base;
        publish_p2p(writer.head(c * L + l_me), base + 1, lane);
    } else {
        __syncwarp();
        if (lane == 0) give_back_store(writer.head(c * L + l_me), base + 1);
    }
    if (in_place) {
        help_forward<L, D, U>(a, w, sh, c, l, lane);
        // The forwarder writes the rows into the outputs; its tail counts them once they have landed.
        wait_at_least(mine.tail(k_ring), base + 1 + total, w, kOpDispatchNvlTail, d_me * L + l, __LINE__, &ok);
        if (lane < D && cnt > 0 && row_base + cnt > a.num_out_rows)
            report_timeout(a.err, kOpDispatchOverflow, a.rank, d_me * L + l, __LINE__, row_base + cnt - 1);
        __syncwarp();
        if (lane == 0 && ok) {
            give_back_store(writer.head(c * L + l_me), base + 1 + total);
            *st.nvl_recvd(k_ring, D, L) = static_cast<long long>(base + 1 + total);
        }
        return;
    }
    int avail = 0, released = 0;
    // Slots go back in batches (a store over NVLink each), and all of them before a wait.
    auto give_back = [&](int upto) {
        __syncwarp();
        if (upto > released) {
            if (lane == 0) give_back_store(writer.head(c * L + l_me), base + 1 + upto);
            released = upto;
        }
        __syncwarp();
    };
    for (int n = 0; n < total; ++n) {
        if (n >= avail) {
            const uint64_t v = wait_reaching(mine.tail(k_ring), base + 2 + n, 0, [&] { give_back(n); }, w,
                                             kOpDispatchNvlTail, d_me * L + l, __LINE__, &ok);
            if (!ok) break;
            avail = static_cast<int>(v - base - 1);
        }
        const uint8_t* s = g.nvl_slot(l_me, c, l, n);
        const int sd = ld_cg_s32(s) & 31, bits = ld_cg_s32(s + 4);
        const int row = __shfl_sync(kFullMask, row_base, sd);
        if (lane == sd) ++row_base;
        store_own_row<U>(a, s, row, sd, bits, d_me * L + l, lane);
        // The slot's loads are done (their values were stored): it may go back to the forwarder.
        if (n + 1 - released >= kPublishBatch) give_back(n + 1);
    }
    if (ok) give_back(total);
    if (lane == 0 && ok) *st.nvl_recvd(k_ring, D, L) = static_cast<long long>(base + 1 + total);
}

// L == 1: the forwarder is the destination, so the rows of source domain d in channel c go from the RDMA
// ring straight into the outputs (what receive() does with an NVLink slot): no NVLink ring, no receiver, no
// NVLink meta. One warp per source domain (the D warps a sender block has per channel anyway), so each ring
// has its own reader and the domains do not queue behind each other. The rows of d in this channel start at
// entry 5 = entry 6 of d - 1 plus the channel's start in the source's gbl_channel_prefix_matrix (the meta's
// start for this rank); slots arrive in token order, so slot k lands at that start + k. Every slot carries
// bit 0 (a token reaching a domain of one rank reaches that rank: the sender only sends tokens with bits),
// and send_nvl_head[i, 0] = k, as the NVLink path records it.
template <int D, int U>
__device__ void forward_direct(const DispatchArgs& a, const WaitCtx& w, ForwardShared<1, D>& sh, int c, int d,
                               int lane) {
    const Geometry<1, D> g{a};
    const Signals sig{a.sig, D};
    const int C = a.num_channels, d_me = a.rank, i = c * D + d;
    const uint64_t base_r = static_cast<uint64_t>(sh.base[d]);
    bool ok = true;
    wait_at_least(sig.tail(i), base_r + 1, w, kOpDispatchTail, d, __LINE__, &ok);
    if (!ok) return;
    const int* m = g.rdma_meta(1, i);
    const int ns = ld_cg_s32(m), r0 = ld_cg_s32(m + 2), r1 = ld_cg_s32(m + 3);
    const int first_row = prefix_before(a.recv_gbl_prefix, d) + ns;
    const int row0 = prefix_before(a.recv_rdma_prefix, d) + r0, n = r1 - r0;
    if (lane == 0) {
        sh.count[d] = n;
        if (a.recv_rdma_cpm != nullptr) a.recv_rdma_cpm[d * C + c] = r1;
        if (a.recv_gbl_cpm != nullptr) a.recv_gbl_cpm[d * C + c] = first_row;
    }
    // This warp is the ring's one reader, so it gives the units it read back as their count (a SET, not the
    // ADDs of several forwarders): a store into the source's word where the source is reachable by stores
    // (give_back_store), else nvshmem_fence and a signal. Lane 0, after the lanes met (their loads of those
    // slots returned).
    uint64_t* const peer_head =
        a.force_rma ? nullptr : static_cast<uint64_t*>(nvshmem_ptr(sig.head(c * D + d_me), d));
    int done = 1, returned = 0;  // units read (the meta record, then slots), and given back
    auto give_back = [&]() {
        if (lane == 0 && done > returned) {
            if (peer_head != nullptr) {
                give_back_store(peer_head, base_r + done);
            } else {
                nvshmem_fence();
                nvshmemx_signal_op(sig.head(c * D + d_me), base_r + done, NVSHMEM_SIGNAL_SET, d);
            }
        }
        returned = done;
        __syncwarp();
    };
    __syncwarp();
    give_back();
    const int release_every = max(1, min(8, a.rdma_cap / 2));  // RDMA slots given back per signal
    PhaseClock phase;  // diagnostics builds only (sync.cuh)
    int avail = 0;
    for (int k = 0; k < n; ++k) {
        if (k >= avail) {
            // Before waiting for the source, give back everything read (it may be waiting for ring space).
            const uint64_t v = wait_reaching(sig.tail(i), base_r + 2 + k, 0, give_back, w, kOpDispatchTail, d,
                                             __LINE__, &ok);
            if (!ok) break;
            avail = static_cast<int>(v - base_r - 1);
        }
        const uint8_t* s = g.rdma_slot(1, i, k);
        phase.lap(kPhaseRecvWait);
        store_own_row<U>(a, s, first_row + k, d, ld_cg_s32(s + 4), d, lane);
        phase.lap(kPhaseRecvStore);
        // Every lane's loads of the slot returned (their values were stored): the slot may go back.
        __syncwarp();
        if (lane == 0) {
            if (a.send_nvl_head != nullptr) {
                if (row0 + k < a.num_nvl_head_rows)
                    a.send_nvl_head[row0 + k] = k;
                else
                    report_timeout(a.err, kOpDispatchOverflow, a.rank, d, __LINE__, row0 + k + 1);
            }
        }
        done = 2 + k;
        if (done - returned >= release_every || k + 1 == n) give_back();
        __syncwarp();
        phase.lap(kPhaseRecvRelease);
    }
    if (lane == 0) nvshmem_quiet();
}

// L == 1, source domain d_me: send_own already wrote the rows, so only the handle entries forward_direct
// would record for them are left, from what its meta record would have carried (this rank's own entries 1 and
// 2 for channel c): entry 3 = the channel's end in entry 1, entry 5 = the first row (as in send_own), and
// send_nvl_head[i, 0] = k for RDMA receive row i = entry 4 of d_me - 1 + the channel's start + k. No wait and
// no copy; ring (c, d_me) is not read.
template <int D>
__device__ void forward_own(const DispatchArgs& a, int c, int lane) {
    const int C = a.num_channels, d = a.rank;
    const int r0 = channel_start(a.rdma_cpm, d, C, c), r1 = a.rdma_cpm[d * C + c];
    const int first_row = own_first_row(a, c);
    const int row0 = prefix_before(a.recv_rdma_prefix, d) + r0, n = r1 - r0;
    if (lane == 0) {
        if (a.recv_rdma_cpm != nullptr) a.recv_rdma_cpm[d * C + c] = r1;
        if (a.recv_gbl_cpm != nullptr) a.recv_gbl_cpm[d * C + c] = first_row;
    }
    if (a.send_nvl_head == nullptr) return;
    for (int k = lane; k < n; k += 32) {
        if (row0 + k < a.num_nvl_head_rows)
            a.send_nvl_head[row0 + k] = k;
        else
            report_timeout(a.err, kOpDispatchOverflow, a.rank, d, __LINE__, row0 + k + 1);
    }
}

// Before the block's barrier, every thread: the shared state of the channels cb * S + sub whose receiving side
// this block runs (not sends_here), then this block's share of the padding rows. Then each warp runs its role,
// and after a second barrier receive_end.
template <int L, int D, int S>
__device__ void receive_begin(const DispatchArgs& a, ForwardShared<L, D>* shared, int cb) {
    const State st{a.state};
    for (int t = threadIdx.x; t < S * D; t += blockDim.x) {
        const int cc = cb * S + t / D, d = t % D;
        ForwardShared<L, D>& sh = shared[t / D];
        sh.base[d] = cc < a.num_channels && !sends_here(t / D) ? *st.rdma_recvd(cc * D + d, D) : 0;
        sh.released[d] = 0;
        sh.count[d] = 0;
        for (int j = 0; j < L; ++j) sh.progress[d][j] = 0;
        if (d == 0)
            for (int j = 0; j < L; ++j) sh.ready[j] = 0, sh.finished[j] = 0;
    }
    // num_worst_tokens padding: rows past the received ones, and send_nvl_head rows past the forwarded ones.
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int num_recv = a.recv_gbl_prefix[L * D - 1];
    for (long long row = num_recv + first; row < a.num_out_rows; row += stride) {
        if (a.recv_src_meta != nullptr) a.recv_src_meta[2 * row] = -1, a.recv_src_meta[2 * row + 1] = 0;
        for (int q = 0; a.recv_topk_idx != nullptr && q < a.num_topk; ++q) {
            a.recv_topk_idx[row * a.num_topk + q] = -1;
            if (a.recv_topk_weights != nullptr) a.recv_topk_weights[row * a.num_topk + q] = 0.0f;
        }
    }
    if (a.send_nvl_head != nullptr) {
        const long long forwarded = a.recv_rdma_prefix[D - 1];
        for (long long k = forwarded * L + first; k < static_cast<long long>(a.num_nvl_head_rows) * L; k += stride)
            a.send_nvl_head[k] = -1;
    }
}

// One warp's receiving role in channel c (sub of the block's channels).
template <int L, int D, int U>
__device__ void receive_role(const DispatchArgs& a, const WaitCtx& w, ForwardShared<L, D>& sh, int c, int role,
                             int lane) {
    if constexpr (L == 1) {
        if (role == a.rank)
            forward_own<D>(a, c, lane);
        else if (role < D)
            forward_direct<D, U>(a, w, sh, c, role, lane);
    } else {
        if (role < L)
            forward<L, D, U>(a, w, sh, c, role, lane);
        else if (role < 2 * L)
            receive<L, D, U>(a, w, sh, c, role - L, lane);
    }
}

// After the block's barrier: the RDMA units each received ring passed, for the next op.
template <int L, int D, int S>
__device__ void receive_end(const DispatchArgs& a, const ForwardShared<L, D>* shared, int cb) {
    const State st{a.state};
    for (int t = threadIdx.x; t < S * D; t += blockDim.x) {
        const int cc = cb * S + t / D, d = t % D;
        // Ring (c, d_me) is not used (send_own with L == 1, OwnTokens with more), so its count stays, as the
        // sender's does.
        if (cc < a.num_channels && !sends_here(t / D) && d != a.rank / L && !timeout_reported(a.err))
            *st.rdma_recvd(cc * D + d, D) = shared[t / D].base[d] + 1 + shared[t / D].count[d];
    }
}

}  // namespace deepep_cupy::internode

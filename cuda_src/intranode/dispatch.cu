// Intranode dispatch, step 2: move the tokens.
//
// Two modes, picked per call on the GPUs (every rank sees every rank's dest entry): the direct mode of
// dispatch_direct.cuh when every rank's outputs are in its output pool (each token written straight into
// its row at every destination), else the ring mode described here.
//
// Grid: 2 * C blocks; block 2c sends channel c, block 2c + 1 receives channel c. Channel c is the token
// range [c * ceil(N/C), ...) of every rank.
//
// Own rows: this rank's own tokens of channel c go straight from x into the outputs (no ring). Warps
// [0, num_own_rows_warps) of the sender block and [0, num_recv_own_rows_warps) of the receiver block start
// on this copy; every other warp joins it once its pushes or receives are done. The work is shared
// dynamically: runs of kOwnRowsRun consecutive own-token indices are claimed from a per-channel counter
// (own_rows_claims[c], back to 0 when the kernel ends). With fixed shares the warps that started on it
// finished last, well after the pushes and the ring receivers.
//
// Sender block, other warps: split evenly over the R - 1 peers. Every warp of a peer's group scans the
// channel's is_token_in_rank column with ballots, so it knows the index i of each token going to that
// peer. Tokens go in runs of B = clamp_batch(publish_batch, cap) consecutive indices;
// run k belongs to warp k % (group size). For every token of its run the warp (waiting first for the
// peer's "slot free" word for token i in its own buffer when i >= cap) moves the token into slot i % cap
// of ring (c, me) in the peer's buffer with 16-byte stores; at the end of the run one system fence
// publishes all its slot flags (flag of token i = seq << 32 | i).
//
// Receiver block, other warps: split evenly over the R - 1 peers, the same runs of B tokens per warp.
// A warp waits for all flags of its run at once (one lane per slot), copies each slot into output row
// (rows before source s) + recv_channel_prefix_matrix[s][c] + i, and, when the sender will need those
// slots again (i + cap < count), stores their "slot free" words into the sender's buffer after one fence.
// Different warps work on different runs independently: no block-wide synchronisation on the data path.
//
// No deadlock: let m be the first unpublished token of a ring; it starts a sender run, and that run can
// only wait for the free word of some i < m + B, i.e. for the receiver run holding i - cap. Receiver runs
// are aligned to B as well, and B <= cap, so that run ends before m: all its tokens are published and it
// completes.
//
// send_head[t][d] (non-cached mode) = position of token t among all rows rank d receives from this rank,
// or -1. Top-k ids become local ids of the destination (e - d * E_local, or -1 when e is elsewhere) with
// weight 0 for -1. When num_worst_tokens > 0 the receiver blocks also fill the padding rows of the index
// outputs (-1 / 0); rows beyond num_out_rows are dropped and reported.
//
// Bad top-k ids (below -1 or >= R * E_local) are elsewhere for every destination, so they become -1
// like any other id of another rank. The sending warps also note them as they load them, and every warp
// that saw one reports it at its end as a value error (op kValueOpIntranodeDispatch; the first report
// wins). Only ids of tokens that go to some rank are read, so only those are checked here (the layout
// kernel checks them all).

#include "intranode/dispatch_direct.cuh"
#include "intranode/dispatch_token.cuh"

namespace deepep_cupy::intranode {

// Copies own token `token` into output row `row` (the own-rows copy).
template <int kNumRanks, int kUnroll>
__device__ __forceinline__ void copy_own_token(const DispatchCtx& a, int token, int row, BadValue& bad,
                                               int lane) {
    if (row >= a.args.num_out_rows) {
        if (lane == 0) report_timeout(a.args.err, kOpDispatchOverflow, a.args.rank, a.args.rank, __LINE__, a.num_recv);
        return;
    }
    const DestRows own{a.args.recv_x, a.args.recv_x_scales, a.args.recv_topk_idx, a.args.recv_topk_weights, a.args.recv_src_idx, a.args.num_out_rows};
    copy_token<kNumRanks, kUnroll>(a, token, own, a.args.rank, row, bad, lane);
}

constexpr int kOwnRowsRun = 2;  // own tokens per claim

// Writes the send_head column of this rank for channel c (non-cached mode; one warp per channel).
template <int kNumRanks>
__device__ __forceinline__ void write_own_send_head(const DispatchCtx& a, int c, int lane) {
    constexpr int R = kNumRanks;
    const int send_base = channel_start(a.args.channel_prefix_matrix, a.args.rank, a.args.num_channels, c);
    int t_begin, t_end;
    channel_range(a.args.num_tokens, a.args.num_channels, c, t_begin, t_end);
    int count = 0;
    for (int chunk = t_begin; chunk < t_end; chunk += 32) {
        const unsigned int mask = chunk_mask<R>(a, chunk, t_end, a.args.rank, lane);
        const int t = chunk + lane;
        if (t < t_end)
            a.args.send_head[static_cast<long long>(t) * R + a.args.rank] =
                (mask >> lane) & 1u ? send_base + count + __popc(mask & ((1u << lane) - 1u)) : -1;
        count += __popc(mask);
    }
}

// The own-rows copy of channel c by one warp (see the header), in claimed runs until the channel's own
// tokens are all claimed. Each warp walks the is_token_in_rank column forward from its own cursor, since
// the runs it claims only grow. The warp that gets run 0 also writes the channel's send_head column for
// this rank. (Letting the ring receivers take runs while their slots were still empty was tried: they then
// finished last, and FP8 got slower.)
template <int kNumRanks, int kUnroll>
__device__ __forceinline__ void dispatch_own_rows(const DispatchCtx& a, int c, int lane) {
    constexpr int R = kNumRanks;
    const int rank = a.args.rank;
    int chunk, t_end;
    channel_range(a.args.num_tokens, a.args.num_channels, c, chunk, t_end);
    const int out_base = (rank > 0 ? a.args.rank_prefix_matrix[(rank - 1) * R + rank] : 0) +
                         a.args.recv_channel_prefix_matrix[rank * a.args.num_channels + c];
    int* claim = a.args.own_rows_claims + c;
    int run = 0;
    if (lane == 0) run = atomicAdd(claim, 1);
    run = __shfl_sync(kFullMask, run, 0);
    if (run == 0 && a.args.send_head != nullptr) write_own_send_head<R>(a, c, lane);
    BadValue bad;
    int before = 0;  // own tokens before `chunk`
    bool more = chunk < t_end;
    unsigned int mask = more ? chunk_mask<R>(a, chunk, t_end, rank, lane) : 0u;
    while (more) {
        // The next claim is issued now and read after this run's copies, so its latency is hidden.
        int next = 0;
        if (lane == 0) next = atomicAdd(claim, 1);
        for (int idx = run * kOwnRowsRun; more && idx < (run + 1) * kOwnRowsRun; ++idx) {
            while (idx >= before + __popc(mask)) {
                before += __popc(mask);
                chunk += 32;
                if (chunk >= t_end) {
                    more = false;
                    break;
                }
                mask = chunk_mask<R>(a, chunk, t_end, rank, lane);
            }
            if (!more) break;
            // The first claimer in a chunk asks L2 for the next chunk's scales.
            if (idx == before) prefetch_scales(a, chunk + 32, min(chunk + 64, t_end), lane);
            copy_own_token<R, kUnroll>(a, chunk + nth_set_bit(mask, idx - before), out_base + idx, bad, lane);
        }
        run = __shfl_sync(kFullMask, next, 0);
    }
    bad.report_from_warp(a.args.err, kValueOpIntranodeDispatch, rank, __LINE__);
}

// One warp of the group pushing channel c's tokens to peer dst. gi / gs: index of the warp in its group and
// the group size. Returns false when a wait ended without success (timeout, reported).
template <int kNumRanks, int kUnroll>
__device__ __forceinline__ bool dispatch_send(const DispatchCtx& a, const WaitCtx& wctx, int c, int dst, int gi,
                                              int gs, int lane) {
    constexpr int R = kNumRanks;
    const int rank = a.args.rank;
    const int B = a.batch;
    int t_begin, t_end;
    channel_range(a.args.num_tokens, a.args.num_channels, c, t_begin, t_end);
    const int send_base = channel_start(a.args.channel_prefix_matrix, dst, a.args.num_channels, c);
    const long long ring_bytes = static_cast<long long>(a.args.cap) * a.args.slot_bytes;
    uint8_t* my_base = rank_base(a.args.bases, rank);

    uint8_t* ring = rank_base(a.args.bases, dst) + a.args.ring_offset + static_cast<long long>(c * R + rank) * ring_bytes;
    // The peer must have finished its earlier kernels before anything lands in its buffer.
    bool ok = warp_wait(ctrl_of(my_base, R).arrive(dst), [seq = a.seq](uint64_t v) { return v >= seq; }, wctx,
                        kOpDispatchArrive, dst, __LINE__);
    const uint64_t* free_words =
        reinterpret_cast<const uint64_t*>(my_base + a.args.free_offset) + static_cast<long long>(c * R + dst) * a.args.cap;

    const long long num_experts = static_cast<long long>(R) * a.args.num_local_experts;
    BadValue bad;  // bad top-k ids this lane loaded

    int count = 0;      // tokens of this channel for dst seen so far
    int run_first = 0;  // first index of this warp's unpublished run
    int run_len = 0;    // tokens of it written so far
    // The column of the next 32 tokens is loaded one step ahead.
    bool in_next = t_begin + lane < t_end && a.args.is_token_in_rank[static_cast<long long>(t_begin + lane) * R + dst];
    for (int chunk = t_begin; ok && chunk < t_end; chunk += 32) {
        const int t = chunk + lane;
        const bool in = in_next;
        if (chunk + 32 < t_end) {
            const int tn = t + 32;
            in_next = tn < t_end && a.args.is_token_in_rank[static_cast<long long>(tn) * R + dst];
        }
        // One warp of the group (in turn) asks L2 for the next chunk's scales.
        if (((chunk - t_begin) / 32) % gs == gi) prefetch_scales(a, chunk + 32, min(chunk + 64, t_end), lane);
        unsigned int mask = __ballot_sync(kFullMask, in);
        if (gi == 0 && a.args.send_head != nullptr && t < t_end) {
            const int before = __popc(mask & ((1u << lane) - 1u));
            a.args.send_head[static_cast<long long>(t) * R + dst] = in ? send_base + count + before : -1;
        }
        while (mask != 0u) {
            const int k = __ffs(mask) - 1;
            mask &= mask - 1u;
            const int idx = count++;
            if ((idx / B) % gs != gi) continue;
            const int token = chunk + k;
            const int4* src_row = a.args.x + static_cast<long long>(token) * a.args.hidden_int4;
            const int slot = idx % a.args.cap;
            if (idx >= a.args.cap) {
                const uint64_t want = tag(a.seq, idx);
                ok = warp_wait(free_words + slot, [want](uint64_t v) { return v == want; }, wctx, kOpDispatchSlot, dst,
                               __LINE__);
                if (!ok) break;
            }
            const TokenAux aux = load_aux(a, token, a.args.topk_idx != nullptr, lane);
            uint8_t* slot_ptr = ring + static_cast<long long>(slot) * a.args.slot_bytes;
            warp_copy_nc<kUnroll>(reinterpret_cast<int4*>(slot_ptr + kSlotHeaderBytes), src_row, a.args.hidden_int4, lane);
            store_scales(reinterpret_cast<unsigned int*>(slot_ptr + a.args.slot_scales_offset), a, token, aux, lane);
            if (a.args.topk_idx != nullptr) {
                int* slot_idx = reinterpret_cast<int*>(slot_ptr + a.args.slot_topk_idx_offset);
                float* slot_w = reinterpret_cast<float*>(slot_ptr + a.args.slot_topk_weights_offset);
                for_each_topk(a, token, aux, lane, [&](int j, long long e, float w) {
                    bad.check_expert_id(e, num_experts);
                    const long long local = e - static_cast<long long>(dst) * a.args.num_local_experts;
                    const bool mine = e >= 0 && local >= 0 && local < a.args.num_local_experts;
                    slot_idx[j] = mine ? static_cast<int>(local) : -1;
                    slot_w[j] = mine ? w : 0.0f;
                });
            }
            if (lane == 0) reinterpret_cast<int*>(slot_ptr)[2] = token;
            if (run_len == 0) run_first = idx;
            ++run_len;
            if (idx % B == B - 1) {
                publish_run(ring, a.args.slot_bytes, a.args.cap, a.seq, run_first, run_len, lane);
                run_len = 0;
            }
        }
    }
    // The last run of the channel may be short.
    if (ok && run_len > 0) publish_run(ring, a.args.slot_bytes, a.args.cap, a.seq, run_first, run_len, lane);
    // Every lane is here (all branches above are uniform over the warp).
    bad.report_from_warp(a.args.err, kValueOpIntranodeDispatch, rank, __LINE__);
    return ok;
}

// One warp of the group receiving channel c from src. Returns false when a wait timed out (reported).
template <int kNumRanks, int kUnroll>
__device__ __forceinline__ bool dispatch_recv(const DispatchCtx& a, const WaitCtx& wctx, int c, int src, int gi,
                                              int gs, int lane) {
    constexpr int R = kNumRanks;
    const int rank = a.args.rank;
    const int B = a.batch;
    const int src_begin = src > 0 ? a.args.rank_prefix_matrix[(src - 1) * R + rank] : 0;
    const int src_end = a.args.rank_prefix_matrix[src * R + rank];
    const int ch_begin = a.args.recv_channel_prefix_matrix[src * a.args.num_channels + c];
    const int ch_end =
        c + 1 < a.args.num_channels ? a.args.recv_channel_prefix_matrix[src * a.args.num_channels + c + 1] : src_end - src_begin;
    const int n = ch_end - ch_begin;
    const int out_base = src_begin + ch_begin;
    const long long ring_bytes = static_cast<long long>(a.args.cap) * a.args.slot_bytes;
    const uint8_t* ring = rank_base(a.args.bases, rank) + a.args.ring_offset + static_cast<long long>(c * R + src) * ring_bytes;
    uint64_t* peer_free = reinterpret_cast<uint64_t*>(rank_base(a.args.bases, src) + a.args.free_offset) +
                          static_cast<long long>(c * R + rank) * a.args.cap;

    for (int first = gi * B; first < n; first += gs * B) {
        const int len = min(B, n - first);
        {
            const uint64_t* flag = nullptr;
            uint64_t want = 0;
            if (lane < len) {
                flag = reinterpret_cast<const uint64_t*>(ring + static_cast<long long>((first + lane) % a.args.cap) * a.args.slot_bytes);
                want = tag(a.seq, first + lane);
            }
            if (!warp_wait_lanes(flag, want, src, wctx, kOpDispatchRecv, __LINE__)) return false;
        }
        for (int idx = first; idx < first + len; ++idx) {
            const uint8_t* slot_ptr = ring + static_cast<long long>(idx % a.args.cap) * a.args.slot_bytes;
            const int row = out_base + idx;
            if (row < a.args.num_out_rows) {
                // The slot's scales, top-k pair and source index are loaded before its row, as on the
                // sending side, so that their L2 round trips overlap the row's.
                const unsigned int* slot_scales = reinterpret_cast<const unsigned int*>(slot_ptr + a.args.slot_scales_offset);
                const int* slot_idx = reinterpret_cast<const int*>(slot_ptr + a.args.slot_topk_idx_offset);
                const float* slot_w = reinterpret_cast<const float*>(slot_ptr + a.args.slot_topk_weights_offset);
                uint32_t sc[kScaleRegs];
#pragma unroll
                for (int j = 0; j < kScaleRegs; ++j)
                    if (lane + 32 * j < a.args.num_scales) sc[j] = ld_cg_u32(slot_scales + lane + 32 * j);
                int e = -1;
                float w = 0.0f;
                if (a.args.recv_topk_idx != nullptr && lane < a.args.num_topk) {
                    e = ld_cg_s32(slot_idx + lane);
                    if (a.args.recv_topk_weights != nullptr) w = ld_cg_f32(slot_w + lane);
                }
                const int src_token =
                    lane == 0 && a.args.recv_src_idx != nullptr ? ld_cg_s32(reinterpret_cast<const int*>(slot_ptr) + 2) : 0;

                warp_copy_ring<kUnroll>(a.args.recv_x + static_cast<long long>(row) * a.args.hidden_int4,
                                        reinterpret_cast<const int4*>(slot_ptr + kSlotHeaderBytes), a.args.hidden_int4, lane);
                unsigned int* out_scales = a.args.recv_x_scales + static_cast<long long>(row) * a.args.num_scales;
#pragma unroll
                for (int j = 0; j < kScaleRegs; ++j)
                    if (lane + 32 * j < a.args.num_scales) out_scales[lane + 32 * j] = sc[j];
                for (int s = lane + 32 * kScaleRegs; s < a.args.num_scales; s += 32)
                    out_scales[s] = ld_cg_u32(slot_scales + s);
                if (a.args.recv_topk_idx != nullptr) {
                    long long* out_idx = a.args.recv_topk_idx + static_cast<long long>(row) * a.args.num_topk;
                    float* out_w = a.args.recv_topk_weights;
                    if (out_w != nullptr) out_w += static_cast<long long>(row) * a.args.num_topk;
                    if (lane < a.args.num_topk) {
                        out_idx[lane] = e;
                        if (out_w != nullptr) out_w[lane] = w;
                    }
                    for (int j = lane + 32; j < a.args.num_topk; j += 32) {
                        out_idx[j] = ld_cg_s32(slot_idx + j);
                        if (out_w != nullptr) out_w[j] = ld_cg_f32(slot_w + j);
                    }
                }
                if (lane == 0 && a.args.recv_src_idx != nullptr) a.args.recv_src_idx[row] = src_token;
            } else if (lane == 0) {
                report_timeout(a.args.err, kOpDispatchOverflow, rank, src, __LINE__, a.num_recv);
            }
        }
        // Every load of the run is done (their values were stored above): hand back the slots the sender
        // will reuse, after one fence for the whole run.
        if (first + a.args.cap < n) {
            __syncwarp();
            fence_acq_rel_sys();
            const int idx = first + lane;
            if (lane < len && idx + a.args.cap < n) st_relaxed_sys(peer_free + idx % a.args.cap, tag(a.seq, idx + a.args.cap));
            __syncwarp();
        }
    }
    return true;
}

// pool_bases: set when this rank's outputs are in its output pool; the call then takes the direct mode of
// dispatch_direct.cuh if every rank's are, else the ring mode above.
template <int kNumRanks, int kNumWarps, int kUnroll>
__global__ void __launch_bounds__(kNumWarps * 32, 1)
dispatch(const __grid_constant__ DispatchArgs args) {
    constexpr int R = kNumRanks;
    const int c = blockIdx.x / 2;
    const bool is_sender = (blockIdx.x % 2) == 0;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    uint8_t* my_base = rank_base(args.bases, args.rank);
    const Ctrl ctrl = ctrl_of(my_base, R);
    const uint64_t seq = begin_kernel(ctrl);
    const WaitCtx wctx{args.err, args.timeout_ns, args.rank};

    const int num_recv = args.rank_prefix_matrix[(R - 1) * R + args.rank];
    const DispatchCtx a{args, clamp_batch(args.publish_batch, args.cap), seq, num_recv};
    if (blockIdx.x == 0) {
        publish_dest<R>(a);
        announce_arrival(args.bases, R, args.rank, seq);
    }

    // Padding rows of the index outputs (num_worst_tokens mode), by every block.
    if (args.num_worst_tokens > 0) {
        const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
        const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
        const long long pad_begin = num_recv < args.num_out_rows ? num_recv : args.num_out_rows;
        for (long long row = pad_begin + first; row < args.num_out_rows; row += stride) {
            if (args.recv_src_idx != nullptr) args.recv_src_idx[row] = -1;
        }
        if (args.recv_topk_idx != nullptr) {
            for (long long k = pad_begin * args.num_topk + first; k < static_cast<long long>(args.num_out_rows) * args.num_topk;
                 k += stride) {
                args.recv_topk_idx[k] = -1;
                if (args.recv_topk_weights != nullptr) args.recv_topk_weights[k] = 0.0f;
            }
        }
    }
    __shared__ DirectShared<R> sh;
    extern __shared__ unsigned int chunk_masks[];
    const int mode = begin_dispatch<R, kNumWarps>(a, wctx, c, sh, chunk_masks);
    if (mode == 1) {
        // Peers drop the rows past num_out_rows; this rank reports them.
        if (blockIdx.x == 0 && threadIdx.x == 0 && num_recv > args.num_out_rows)
            report_timeout(args.err, kOpDispatchOverflow, args.rank, args.rank, __LINE__, num_recv);
        dispatch_direct<R, kNumWarps, kUnroll>(a, wctx, c, sh, chunk_masks, args.own_rows_claims + c);
    } else if (mode == 0) {
        // Role of this warp: push to a peer or receive from one, then join the own-rows copy; or start on
        // the own-rows copy (with a single rank every warp does).
        const int own_rows_in_block = is_sender ? args.num_own_rows_warps : args.num_recv_own_rows_warps;
        bool ok = true;
        if (warp >= own_rows_in_block && R > 1) {
            int g, gi, gs;
            split_warps(warp - own_rows_in_block, kNumWarps - own_rows_in_block, R - 1, g, gi, gs);
            const int peer = (args.rank + 1 + g) % R;
            ok = is_sender ? dispatch_send<R, kUnroll>(a, wctx, c, peer, gi, gs, lane)
                           : dispatch_recv<R, kUnroll>(a, wctx, c, peer, gi, gs, lane);
        }
        if (ok) dispatch_own_rows<R, kUnroll>(a, c, lane);
    }
    end_kernel(ctrl, seq, args.own_rows_claims, args.num_channels);
}

}  // namespace deepep_cupy::intranode

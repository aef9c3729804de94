// Intranode combine, copy mode: the rows go home through the copy engines; this kernel only sums them.
//
// Why: the ring mode spends SM time on every row twice (a push over NVLink into the home's ring, then the
// home's read of the ring) and splits the SMs between pushing and summing. In the copy mode the rows this
// rank received from home h are one contiguous block of x (rows rank_prefix_matrix[h - 1][me] onwards),
// so they go back with plain device-to-device copies that the copy engines run at link speed while all the
// SMs sum what has arrived.
//
// Before this kernel, on a side stream (deepep_cupy/ops/intranode/copy.py), every rank p copies, for every
// home h != p, that block (its top-k weights first) into h's staging area, slot of source p, in chunks;
// after each chunk, a stream write on a second stream (ordered after the chunk by an event) stores
// (copy_seq << 32) | (rows of the block copied so far) into copy_flag[p] of h's control words (the write
// is fenced).
//
// Staging area of home h (a fixed region of h's output pool, mapped into every rank): the row slots of
// the sources in rank order (h itself has none), then, at weights_offset, their weights slots in the same
// order. Source q's slot starts after the rows h sent to every source q' < q, q' != h.
//
// Grid: any number of blocks. Warp g of the G warps of the grid sums tokens g, g + G, g + 2G, ...: all warps
// move through the tokens in order together, so tokens whose rows arrived first are summed first and every
// warp helps with the last chunk; each warp's next token is known ahead, so its send_head row is loaded one
// token early. For token t, lane r < R reads send_head[t][r] (its row among those rank r received from this
// rank, -1 if none) and, for a peer, waits until copy_flag[r] counts that row as copied. Rows: this rank's
// from x, peers' from their staging slots; sums as in the ring mode (combine_sum.cuh); the top-k weights are
// loaded before the row's sum and added after it, so their latency hides behind it.
//
// Turn waits: a peer's copy into a home may wait until the home's previous occupant has landed its rows, that is
// for a copy flag in the home's control words (copy.py's turn_waits). A kernel whose wait for rows runs out sets
// every copy flag of its own rank to the largest value of the call, so that those copies wait no longer.
//
// End: the last block to finish stores copy_done[me] = seq into every peer's control words and waits for
// the same from every peer. A peer queues its next copies into this rank's staging area after its own
// kernel, which ends only once this rank has stored copy_done, i.e. read every row of this call.

#include "common/nvrtc_compat.cuh"
#include "intranode/combine_sum.cuh"
#include "intranode/args.cuh"
#include "intranode/buffer_map.cuh"
#include "intranode/sync.cuh"

namespace deepep_cupy::intranode {

constexpr int kCopyRowBits = 32;

// The peer a timed-out wait for `waited_for`'s rows names: a rank that has not started this kernel, if any (its
// copies, or the turns waiting for them, are what held the rows back), else `waited_for`.
__device__ __forceinline__ int blamed_peer(const Ctrl& ctrl, int num_ranks, int rank, uint64_t seq, int waited_for) {
    for (int r = 0; r < num_ranks; ++r)
        if (r != rank && ld_acquire_sys(ctrl.arrive(r)) < seq) return r;
    return waited_for;
}

// kOrdered: V2's summation order, as in combine.cu.
template <int kNumRanks, int kNumWarps, int kUnroll, bool kOrdered = false>
__global__ void __launch_bounds__(kNumWarps * 32, 1)
combine_copy(const __grid_constant__ CombineCopyArgs args) {
    constexpr int R = kNumRanks;
    const int lane = threadIdx.x % 32;
    uint8_t* my_base = rank_base(args.bases, args.rank);
    const Ctrl ctrl = ctrl_of(my_base, R);
    const uint64_t seq = begin_kernel(ctrl);
    const WaitCtx wctx{args.err, args.timeout_ns, args.rank};
    if (blockIdx.x == 0) announce_arrival(args.bases, R, args.rank, seq);

    // Lane r < R: the first row of rank r's rows for this rank. A peer's is in its staging slot (rows this
    // rank sent to every source before it); this rank's own is in x (rows received from ranks before it).
    long long first_row = 0;
    if (lane < R) {
        if (lane == args.rank) {
            first_row = args.rank > 0 ? args.rank_prefix_matrix[(args.rank - 1) * R + args.rank] : 0;
        } else {
            for (int q = 0; q < lane; ++q) {
                if (q == args.rank) continue;
                first_row += args.rank_prefix_matrix[args.rank * R + q] - (args.rank > 0 ? args.rank_prefix_matrix[(args.rank - 1) * R + q] : 0);
            }
        }
    }
    const uint64_t* my_flag = lane < R && lane != args.rank ? ctrl.copy_flag(lane) : nullptr;
    uint64_t seen = 0;  // this lane's latest copy_flag value (chunks only ever complete)
    const int4* staging_rows = reinterpret_cast<const int4*>(args.staging);
    const float* staging_weights = reinterpret_cast<const float*>(args.staging + args.weights_offset);
    const bool with_weights = args.combined_topk_weights != nullptr;

    const int num_warps = gridDim.x * kNumWarps;
    int t = blockIdx.x * kNumWarps + threadIdx.x / 32;
    int next_pos = lane < R && t < args.num_tokens ? args.send_head[static_cast<long long>(t) * R + lane] : -1;
    bool ok = true;
    while (t < args.num_tokens) {
        const int pos = next_pos;
        const int next = t + num_warps;
        next_pos = lane < R && next < args.num_tokens ? args.send_head[static_cast<long long>(next) * R + lane] : -1;
        if (my_flag != nullptr && pos >= 0) {
            const uint64_t want = (static_cast<uint64_t>(args.copy_seq) << kCopyRowBits) | static_cast<uint64_t>(pos + 1);
            uint64_t start = 0;
            for (unsigned int spin = 1; seen < want; ++spin) {
                seen = ld_acquire_sys(my_flag);
                if ((spin & 63u) == 0 && seen < want &&
                    wait_expired(spin, start, wctx, kOpCombineCopyRecv, blamed_peer(ctrl, R, args.rank, seq, lane),
                                 __LINE__)) {
                    ok = false;
                    break;
                }
            }
        }
        if (!__all_sync(kFullMask, ok)) {
            // A wait ran out: every copy flag of this rank goes to its largest value of this call, so that no
            // peer's copies still wait for one of them (copy.py's turn_waits); the error is reported already.
            if (lane < R && lane != args.rank)
                st_relaxed_sys(ctrl.copy_flag(lane), (static_cast<uint64_t>(args.copy_seq) << kCopyRowBits) | 0xffffffffull);
            break;
        }

        const int4* rows[R];
        const float* weights[R];
        float w[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int p = __shfl_sync(kFullMask, pos, r);
            const long long row = __shfl_sync(kFullMask, first_row, r) + p;
            rows[r] = nullptr;
            weights[r] = nullptr;
            w[r] = 0.0f;
            if (p < 0) continue;
            rows[r] = (r == args.rank ? args.x : staging_rows) + row * args.hidden_int4;
            weights[r] = (r == args.rank ? args.topk_weights : staging_weights) + row * args.num_topk;
            if (with_weights && lane < args.num_topk) w[r] = r == args.rank ? weights[r][lane] : ld_cg_f32(weights[r] + lane);
        }
        if constexpr (!kOrdered) {
            sum_token<R, kUnroll, true>(rows, args.bias_0, args.bias_1, static_cast<long long>(t) * args.hidden_int4,
                                        args.hidden_int4, args.combined_x, lane);
        } else {
            const int4* ordered[R];
            order_by_last_slot<R>(rows, ordered, args.order_topk_idx + static_cast<long long>(t) * args.order_num_topk,
                                  args.order_num_topk, args.num_local_experts);
            sum_token<R, kUnroll, true>(ordered, args.bias_0, args.bias_1, static_cast<long long>(t) * args.hidden_int4,
                                        args.hidden_int4, args.combined_x, lane);
        }
        if (with_weights) {
            float* out = args.combined_topk_weights + static_cast<long long>(t) * args.num_topk;
            if (lane < args.num_topk) {
                float acc = 0.0f;
#pragma unroll
                for (int r = 0; r < R; ++r)
                    if (weights[r] != nullptr) acc += w[r];
                out[lane] = acc;
            }
            if (args.num_topk > 32) {  // the rest, lanes 32.. of the row
                const float* rest[R];
#pragma unroll
                for (int r = 0; r < R; ++r) rest[r] = weights[r] != nullptr ? weights[r] + 32 : nullptr;
                sum_weights<R>(rest, args.rank, args.num_topk - 32, out + 32, lane);
            }
        }
        t = next;
    }

    // Every block has read its rows: the last one tells the peers, then waits until they have read theirs.
    end_kernel(ctrl, seq, nullptr, 0, [&] {
        for (int r = 0; r < R; ++r)
            if (r != args.rank) st_release_sys(ctrl_of(rank_base(args.bases, r), R).copy_done(args.rank), seq);
        for (int r = 0; r < R; ++r) {
            if (r == args.rank) continue;
            if (!thread_wait(ctrl.copy_done(r), [seq](uint64_t v) { return v >= seq; }, wctx, kOpCombineCopyDone, r,
                             __LINE__))
                break;
        }
    });
}

}  // namespace deepep_cupy::intranode

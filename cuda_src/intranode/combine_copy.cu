// Intranode combine, copy mode: the rows go home through the copy engines; this kernel only sums them.
//
// Why: the ring mode spends SM time on every row twice (a push over NVLink into the home's ring, then the
// home's read of the ring) and splits the SMs between pushing and summing. In the copy mode the rows this
// rank received from home h are one contiguous block of x (rows rank_prefix_matrix[h - 1][me] onwards),
// so they go back with plain device-to-device copies that the copy engines run at link speed while all the
// SMs sum what has arrived.
//
// Before this kernel, on a side stream (deepep_cupy/ops/intranode_copy.py), every rank p copies, for every
// home h != p, that block (its top-k weights first) into h's staging area, slot of source p, in chunks of
// chunk_rows rows; after chunk k a stream write stores (copy_seq << 20) | (k + 1) into copy_flag[p] of h's
// control words (the write is fenced after the copy).
//
// Staging area of home h (a fixed region of h's output pool, mapped into every rank): the row slots of
// the sources in rank order (h itself has none), then, at weights_offset, their weights slots in the same
// order. Source q's slot starts after the rows h sent to every source q' < q, q' != h.
//
// Grid: any number of blocks of kNumWarps warps. Warp 0 of a block feeds the others: it takes batches of
// 32 / R tokens in token order from a counter (claims[0], back to 0 at the end), so tokens whose rows
// arrived first are summed first and every block helps with the last chunk. Lane k * R + r reads
// send_head[t][r] for token t = batch + k (its row among those rank r received from this rank, -1 if none)
// and, for a peer, waits until copy_flag[r] covers that row's chunk. Then lane 0 hands the batch's tokens,
// one per stage, to a ring of num_stages shared-memory stages: each row of the token (this rank's from x,
// peers' from their staging slots; then the bias rows, when given) is one bulk copy into the stage,
// completing on the stage's "full" barrier. The other warps sum stage after stage (combine_sum.cuh's order) and free it on its "empty"
// barrier. Bulk copies keep a stage's rows in flight without registers, which is what lets a few SMs read
// at the rate the copy engines deliver (the register loop of the ring mode reached ~45 GB/s per SM).
//
// End: the last block to finish stores copy_done[me] = seq into every peer's control words and waits for
// the same from every peer. A peer queues its next copies into this rank's staging area after its own
// kernel, which ends only once this rank has stored copy_done, i.e. read every row of this call.

#include "common/bulk.cuh"
#include "common/nvrtc_compat.cuh"
#include "intranode/combine_sum.cuh"
#include "intranode/layout.cuh"

namespace deepep_cupy::intranode {

using namespace ::deepep_intranode;

constexpr int kCopyChunkBits = 20;
constexpr int kMaxCopyStages = 8;

template <int kNumRanks, int kNumWarps>
__global__ void __launch_bounds__(kNumWarps * 32, 1)
combine_copy(const int4* __restrict__ x, const float* __restrict__ topk_weights, int num_topk,
             const int4* __restrict__ bias_0, const int4* __restrict__ bias_1, const int* __restrict__ rank_prefix_matrix,
             const int* __restrict__ send_head, int num_tokens, int hidden_int4, int4* __restrict__ combined_x,
             float* __restrict__ combined_topk_weights, const long long* __restrict__ bases,
             const uint8_t* __restrict__ staging, long long weights_offset, unsigned long long copy_seq,
             int chunk_rows, int num_stages, int* __restrict__ claims, deepep::ErrorRecord* err, long long timeout_ns,
             int rank) {
    constexpr int R = kNumRanks;
    static_assert(kNumWarps >= 2, "one feeding warp and at least one summing warp");
    extern __shared__ __align__(128) uint8_t stage_data[];
    __shared__ uint64_t full[kMaxCopyStages], empty[kMaxCopyStages];
    __shared__ long long stage_rows[kMaxCopyStages][R];  // row of each rank's copy of the token, -1: none
    __shared__ int stage_token[kMaxCopyStages];          // -1: no more tokens

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    uint8_t* my_base = rank_base(bases, rank);
    const Ctrl ctrl = ctrl_of(my_base, R);
    const uint64_t seq = begin_kernel(ctrl);
    const WaitCtx wctx{err, timeout_ns, rank};
    if (blockIdx.x == 0) announce_arrival(bases, R, rank, seq);
    if (threadIdx.x == 0) {
        for (int s = 0; s < num_stages; ++s) {
            deepep::mbar_init(&full[s], 1);
            deepep::mbar_init(&empty[s], kNumWarps - 1);
        }
        deepep::mbar_init_fence();
    }
    __syncthreads();
    const long long row_bytes = static_cast<long long>(hidden_int4) * 16;
    // A stage: slots 0..R-1 for the ranks' rows, then bias_0 and bias_1 when a bias is given.
    const bool has_bias = bias_0 != nullptr || bias_1 != nullptr;
    const long long stage_bytes = (R + (has_bias ? 2 : 0)) * row_bytes;
    const int4* staging_rows = reinterpret_cast<const int4*>(staging);
    const float* staging_weights = reinterpret_cast<const float*>(staging + weights_offset);

    if (warp == 0) {
        // Lane k * R + r: rank r's row of token batch + k. Its rows for this rank start at first_row: a peer's
        // in its staging slot (rows this rank sent to every source before it), this rank's own in x (rows
        // received from ranks before it).
        constexpr int B = 32 / R;
        const int k = lane / R, r = lane % R;
        long long first_row = 0;
        if (r == rank) {
            first_row = rank > 0 ? rank_prefix_matrix[(rank - 1) * R + rank] : 0;
        } else {
            for (int q = 0; q < r; ++q) {
                if (q == rank) continue;
                first_row += rank_prefix_matrix[rank * R + q] - (rank > 0 ? rank_prefix_matrix[(rank - 1) * R + q] : 0);
            }
        }
        const uint64_t* my_flag = r != rank && k < B ? ctrl.copy_flag(r) : nullptr;
        uint64_t seen = 0;  // this lane's latest copy_flag value (chunks only ever complete)
        int stage_iter = 0;
        int batch = 0;
        if (lane == 0) batch = atomicAdd(claims, B);
        batch = __shfl_sync(kFullMask, batch, 0);
        while (batch < num_tokens) {
            int next = 0;
            if (lane == 0) next = atomicAdd(claims, B);  // read after this batch: its latency is hidden
            const int t = batch + k;
            const int pos = k < B && t < num_tokens ? send_head[static_cast<long long>(t) * R + r] : -1;
            bool ok = true;
            if (my_flag != nullptr && pos >= 0) {
                const uint64_t want = (static_cast<uint64_t>(copy_seq) << kCopyChunkBits) |
                                      static_cast<uint64_t>(pos / chunk_rows + 1);
                uint64_t start = 0;
                for (unsigned int spin = 1; seen < want; ++spin) {
                    seen = deepep::ld_acquire_sys(my_flag);
                    if ((spin & 63u) == 0 && seen < want &&
                        wait_expired(spin, start, wctx, kOpCombineCopyRecv, r, __LINE__)) {
                        ok = false;
                        break;
                    }
                }
            }
            if (!__all_sync(kFullMask, ok)) break;
            deepep::fence_proxy_async();  // the rows' bulk copies read what the acquires above made visible
            const long long row = pos >= 0 ? first_row + pos : -1;
            const int len = min(B, num_tokens - batch);
            for (int kk = 0; kk < len; ++kk, ++stage_iter) {
                long long rows[R];
#pragma unroll
                for (int q = 0; q < R; ++q) rows[q] = __shfl_sync(kFullMask, row, kk * R + q);
                if (lane == 0) {
                    const int s = stage_iter % num_stages;
                    deepep::mbar_wait(&empty[s], ((stage_iter / num_stages) & 1) ^ 1);
                    stage_token[s] = batch + kk;
                    const long long out_row = static_cast<long long>(batch + kk) * hidden_int4;
                    unsigned int bytes = 0;
#pragma unroll
                    for (int q = 0; q < R; ++q) {
                        stage_rows[s][q] = rows[q];
                        if (rows[q] >= 0) bytes += static_cast<unsigned int>(row_bytes);
                    }
                    bytes += static_cast<unsigned int>(row_bytes) * ((bias_0 != nullptr) + (bias_1 != nullptr));
                    deepep::mbar_arrive_expect_tx(&full[s], bytes);
                    uint8_t* dst = stage_data + s * stage_bytes;
#pragma unroll
                    for (int q = 0; q < R; ++q) {
                        if (rows[q] < 0) continue;
                        const int4* src = (q == rank ? x : staging_rows) + rows[q] * hidden_int4;
                        deepep::bulk_load(dst + q * row_bytes, src, static_cast<unsigned int>(row_bytes), &full[s]);
                    }
                    if (bias_0 != nullptr)
                        deepep::bulk_load(dst + R * row_bytes, bias_0 + out_row, static_cast<unsigned int>(row_bytes),
                                          &full[s]);
                    if (bias_1 != nullptr)
                        deepep::bulk_load(dst + (R + 1) * row_bytes, bias_1 + out_row,
                                          static_cast<unsigned int>(row_bytes), &full[s]);
                }
            }
            batch = __shfl_sync(kFullMask, next, 0);
        }
        if (lane == 0) {  // no more tokens (or a timeout): release the summing warps
            const int s = stage_iter % num_stages;
            deepep::mbar_wait(&empty[s], ((stage_iter / num_stages) & 1) ^ 1);
            stage_token[s] = -1;
            deepep::mbar_arrive(&full[s]);
        }
    } else {
        const int tid = threadIdx.x - 32, num_threads = (kNumWarps - 1) * 32;
        for (int stage_iter = 0;; ++stage_iter) {
            const int s = stage_iter % num_stages;
            deepep::mbar_wait(&full[s], (stage_iter / num_stages) & 1);
            const int t = stage_token[s];
            if (t < 0) break;
            const int4* rows[R];
            const float* weights[R];
            const uint8_t* data = stage_data + s * stage_bytes;
#pragma unroll
            for (int q = 0; q < R; ++q) {
                const long long row = stage_rows[s][q];
                rows[q] = row >= 0 ? reinterpret_cast<const int4*>(data + q * row_bytes) : nullptr;
                weights[q] = row < 0 ? nullptr : (q == rank ? topk_weights : staging_weights) + row * num_topk;
            }
            const int4* b0 = bias_0 != nullptr ? reinterpret_cast<const int4*>(data + R * row_bytes) : nullptr;
            const int4* b1 = bias_1 != nullptr ? reinterpret_cast<const int4*>(data + (R + 1) * row_bytes) : nullptr;
            sum_staged_token<R>(rows, b0, b1, static_cast<long long>(t) * hidden_int4, hidden_int4, combined_x, tid,
                                num_threads);
            if (combined_topk_weights != nullptr && warp == 1)
                sum_weights<R>(weights, rank, num_topk, combined_topk_weights + static_cast<long long>(t) * num_topk,
                               lane);
            __syncwarp();
            if (lane == 0) deepep::mbar_arrive(&empty[s]);
        }
    }

    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned int old = atomicAdd(ctrl.done_count(), 1u);
        if (old + 1 == gridDim.x) {
            // Every block has read its rows: tell the peers, then wait until they have read theirs.
            for (int r = 0; r < R; ++r)
                if (r != rank) deepep::st_release_sys(ctrl_of(rank_base(bases, r), R).copy_done(rank), seq);
            for (int r = 0; r < R; ++r) {
                if (r == rank) continue;
                if (!thread_wait(ctrl.copy_done(r), [seq](uint64_t v) { return v >= seq; }, wctx, kOpCombineCopyDone,
                                 r, __LINE__))
                    break;
            }
            *ctrl.done_count() = 0;
            claims[0] = 0;
            *reinterpret_cast<volatile unsigned long long*>(ctrl.local_seq()) = static_cast<unsigned long long>(seq);
            __threadfence();
        }
    }
}

}  // namespace deepep_cupy::intranode

// Intranode dispatch, step 1: exchange token counts between the ranks of one NVLink domain.
//
// One block of 1024 threads:
//   1. announce this kernel's sequence number to every rank (arrive words);
//   2. count, per channel and destination rank, the tokens of this rank that go there
//      (is_token_in_rank), giving channel_prefix_matrix [R, C] (inclusive prefix over channels);
//   3. wait until every rank has arrived (it finished its earlier kernels on the buffer), then write into
//      each rank d's notify area, record [me]: my per-rank token totals [R], my per-channel counts to d [C]
//      and my per-expert counts for d's experts [E_local]; release notify_flag[me] in d's buffer;
//   4. wait for every rank's record in my buffer and derive rank_prefix_matrix [R, R],
//      recv_channel_prefix_matrix [R, C] (exclusive prefix over channels of what source s sends me,
//      relative to the start of s's rows) and meta = [num_recv, aligned count of each local expert].
// On a timeout the block stops early; the host raises from the error record after its sync.

#include "common/nvrtc_compat.cuh"
#include "intranode/args.cuh"
#include "intranode/buffer_map.cuh"
#include "intranode/copies.cuh"
#include "intranode/sync.cuh"

namespace deepep_cupy::intranode {

constexpr int kNotifyThreads = 1024;

template <int kNumRanks>
__global__ void __launch_bounds__(kNotifyThreads, 1)
notify(const __grid_constant__ NotifyArgs args) {
    constexpr int R = kNumRanks;
    extern __shared__ int s_counts[];  // [R][C] per-channel counts, then [R] totals
    __shared__ int s_abort;
    int* s_totals = s_counts + R * args.num_channels;

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, num_warps = blockDim.x / 32;
    uint8_t* my_base = rank_base(args.bases, args.rank);
    const Ctrl ctrl = ctrl_of(my_base, R);
    const uint64_t seq = begin_kernel(ctrl);
    const WaitCtx wctx{args.err, args.timeout_ns, args.rank};
    if (tid == 0) s_abort = 0;
    announce_arrival(args.bases, R, args.rank, seq);

    // 2. Per-channel counts, one warp per channel.
    for (int c = warp; c < args.num_channels; c += num_warps) {
        int begin, end;
        channel_range(args.num_tokens, args.num_channels, c, begin, end);
        int cnt[R];
#pragma unroll
        for (int r = 0; r < R; ++r) cnt[r] = 0;
        for (int t = begin + lane; t < end; t += 32) {
            const bool* row = args.is_token_in_rank + static_cast<long long>(t) * R;
#pragma unroll
            for (int r = 0; r < R; ++r) cnt[r] += row[r] ? 1 : 0;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            int v = cnt[r];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
            if (lane == 0) s_counts[r * args.num_channels + c] = v;
        }
    }
    __syncthreads();
    if (tid < R) {
        int acc = 0;
        for (int c = 0; c < args.num_channels; ++c) {
            acc += s_counts[tid * args.num_channels + c];
            args.channel_prefix_matrix[tid * args.num_channels + c] = acc;
        }
        s_totals[tid] = acc;
    }

    // 3. Every rank must have arrived before its notify area is written.
    if (tid < R) {
        if (!thread_wait(ctrl.arrive(tid), [seq](uint64_t v) { return v >= seq; }, wctx, kOpNotifyArrive, tid, __LINE__))
            atomicExch(&s_abort, 1);
    }
    __syncthreads();
    if (s_abort == 0) {
        const int rec_ints = R + args.num_channels + args.num_local_experts;
        for (int k = tid; k < R * rec_ints; k += blockDim.x) {
            const int dst = k / rec_ints, j = k % rec_ints;
            int value;
            if (j < R)
                value = s_totals[j];
            else if (j < R + args.num_channels)
                value = s_counts[dst * args.num_channels + (j - R)];
            else
                value = args.num_tokens_per_expert[dst * args.num_local_experts + (j - R - args.num_channels)];
            int* area = reinterpret_cast<int*>(rank_base(args.bases, dst) + args.notify_offset);
            area[args.rank * args.notify_stride + j] = value;
        }
        __threadfence_system();
    }
    __syncthreads();
    if (s_abort == 0 && tid < R) {
        const Ctrl peer = ctrl_of(rank_base(args.bases, tid), R);
        st_release_sys(peer.notify_flag(args.rank), seq);
    }

    // 4. Collect every source's record.
    if (s_abort == 0 && tid < R) {
        if (!thread_wait(ctrl.notify_flag(tid), [seq](uint64_t v) { return v >= seq; }, wctx, kOpNotifyCounts, tid,
                         __LINE__))
            atomicExch(&s_abort, 1);
    }
    __syncthreads();
    if (s_abort == 0) {
        const int* area = reinterpret_cast<const int*>(my_base + args.notify_offset);
        if (tid < R) {
            // Column r = tid of the rank prefix matrix.
            int acc = 0;
            for (int i = 0; i < R; ++i) {
                acc += ld_cg_s32(area + i * args.notify_stride + tid);
                args.rank_prefix_matrix[i * R + tid] = acc;
            }
            if (tid == args.rank) args.meta[0] = acc;
            // Row s = tid of the receive channel prefix matrix.
            int run = 0;
            const int* rec = area + tid * args.notify_stride + R;
            for (int c = 0; c < args.num_channels; ++c) {
                args.recv_channel_prefix_matrix[tid * args.num_channels + c] = run;
                run += ld_cg_s32(rec + c);
            }
        }
        for (int e = tid; e < args.num_local_experts; e += blockDim.x) {
            long long total = 0;
            for (int s = 0; s < R; ++s) total += ld_cg_s32(area + s * args.notify_stride + R + args.num_channels + e);
            if (args.expert_alignment > 1) total = (total + args.expert_alignment - 1) / args.expert_alignment * args.expert_alignment;
            args.meta[1 + e] = static_cast<int>(total);
        }
    }
    end_kernel(ctrl, seq);
}

}  // namespace deepep_cupy::intranode

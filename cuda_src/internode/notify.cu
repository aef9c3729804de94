// Internode dispatch, step 1: token counts across domains (docs/design/internode.md, "Notify").
//
// One block. (1) Count this rank's tokens per channel and rank / domain: handle entries 1 and 2.
// (2) Put to each forwarder (d, l_me) one record {tokens for each rank of d, tokens per expert of d,
// tokens reaching d} with a signal. (3) As a forwarder, wait for the D records, write entry 4 and, into
// the NVLink buffer of each rank j of the domain, what sources (d, l_me) send j (per domain) and the
// per-expert sums for j's experts. (4) Wait for the L forwarders of the domain and form entry 6 and the
// per-expert counts. `meta` gets [rows received, rows arriving over RDMA, aligned count per local expert].
//
// Signals and flags carry the notify sequence number (state word 0, advanced here), so nothing is
// cleared. A record area is reused by the next notify only after its reader finished: the writer's next
// notify follows its dispatch, which cannot finish before the reader's forwarder ran (it waits for the
// reader's meta), and the reader's forwarder runs after the reader's notify.

#include "common/nvshmem_includes.cuh"
#include "internode/args.cuh"
#include "internode/buffer_map.cuh"
#include "internode/sync.cuh"

namespace deepep_cupy::internode {

constexpr int kNotifyThreads = 1024;

template <int kNumNvlRanks, int kNumDomains>
__global__ void __launch_bounds__(kNotifyThreads, 1)
notify(const __grid_constant__ NotifyArgs args) {
    constexpr int L = kNumNvlRanks, D = kNumDomains, R = L * D;
    const int tid = threadIdx.x, C = args.num_channels;
    const int l_me = args.rank % L, d_me = args.rank / L;
    const int El = args.num_local_experts;
    __shared__ int s_abort;
    const State state{args.state_words};
    const Signals signals{args.sig, D};
    const WaitCtx wctx{args.err, args.timeout_ns, args.rank};
    const uint64_t seq = static_cast<uint64_t>(*state.notify_seq()) + 1;
    if (tid == 0) s_abort = 0;

    // (1) Per-channel counts straight into the outputs (zeroed first), then inclusive prefixes.
    for (int k = tid; k < R * C; k += blockDim.x) args.gbl_channel_prefix_matrix[k] = 0;
    for (int k = tid; k < D * C; k += blockDim.x) args.rdma_channel_prefix_matrix[k] = 0;
    __syncthreads();
    const int per = (args.num_tokens + C - 1) / max(C, 1);
    for (int t = tid; t < args.num_tokens; t += blockDim.x) {
        const int c = t / per;
        const bool* row = args.is_token_in_rank + static_cast<long long>(t) * R;
        for (int d = 0; d < D; ++d) {
            bool any = false;
            for (int j = 0; j < L; ++j) {
                if (row[d * L + j]) {
                    any = true;
                    atomicAdd(args.gbl_channel_prefix_matrix + (d * L + j) * C + c, 1);
                }
            }
            if (any) atomicAdd(args.rdma_channel_prefix_matrix + d * C + c, 1);
        }
    }
    __syncthreads();
    for (int r = tid; r < R + D; r += blockDim.x) {
        int* row = r < R ? args.gbl_channel_prefix_matrix + r * C : args.rdma_channel_prefix_matrix + (r - R) * C;
        for (int c = 1; c < C; ++c) row[c] += row[c - 1];
    }
    __syncthreads();

    // (2) Records for the forwarders: staged in half 0 of the record area, put into half 1 slot d_me.
    int* send_rec = reinterpret_cast<int*>(args.sig + args.record_offset);
    int* recv_rec = send_rec + D * args.record_stride;
    const int rec_ints = L + L * El + 1;
    for (int k = tid; k < D * rec_ints; k += blockDim.x) {
        const int d = k / rec_ints, j = k % rec_ints;
        int v;
        if (j < L)
            v = args.gbl_channel_prefix_matrix[(d * L + j) * C + C - 1];
        else if (j < L + L * El)
            v = args.num_tokens_per_expert[d * L * El + (j - L)];
        else
            v = args.rdma_channel_prefix_matrix[d * C + C - 1];
        send_rec[d * args.record_stride + j] = v;
    }
    __syncthreads();
    // One warp per forwarder (puts are warp-collective).
    const int warp = tid / 32;
    if (warp < D)
        put_signal_warp(recv_rec + d_me * args.record_stride, send_rec + warp * args.record_stride,
                        static_cast<size_t>(rec_ints) * sizeof(int), signals.notify(d_me), seq, NVSHMEM_SIGNAL_SET,
                        warp * L + l_me, tid % 32);
    if (tid < D) {
        if (!thread_wait(signals.notify(tid), [seq](uint64_t v) { return v >= seq; }, wctx, kOpNotifyRdma,
                         tid * L + l_me, __LINE__))
            atomicExch(&s_abort, 1);
    }
    __syncthreads();

    // (3) Forwarder: entry 4, and what each rank j of the domain receives through this rank.
    if (s_abort == 0) {
        if (tid == 0) {
            int acc = 0;
            for (int d = 0; d < D; ++d) {
                acc += ld_cg_s32(recv_rec + d * args.record_stride + L + L * El);
                args.recv_rdma_rank_prefix_sum[d] = acc;
            }
            args.meta[1] = acc;
        }
        const int nvl_ints = D + El;
        for (int k = tid; k < L * nvl_ints; k += blockDim.x) {
            const int j = k / nvl_ints, x = k % nvl_ints;
            int v = 0;
            if (x < D) {
                v = ld_cg_s32(recv_rec + x * args.record_stride + j);
            } else {
                for (int d = 0; d < D; ++d) v += ld_cg_s32(recv_rec + d * args.record_stride + L + j * El + (x - D));
            }
            int* area = reinterpret_cast<int*>(nvl_base(args.nvl_bases, j) + args.nvl_notify_offset);
            area[l_me * args.nvl_record_stride + x] = v;
        }
        __threadfence_system();
    }
    __syncthreads();
    if (s_abort == 0 && tid < L) {
        const NvlCtrl peer{nvl_base(args.nvl_bases, tid), L};
        st_release_sys(peer.notify_flag(l_me), seq);
    }

    // (4) Collect the domain's forwarders.
    const NvlCtrl mine{nvl_base(args.nvl_bases, l_me), L};
    if (s_abort == 0 && tid < L) {
        if (!thread_wait(mine.notify_flag(tid), [seq](uint64_t v) { return v >= seq; }, wctx, kOpNotifyNvl,
                         d_me * L + tid, __LINE__))
            atomicExch(&s_abort, 1);
    }
    __syncthreads();
    if (s_abort == 0) {
        const int* area = reinterpret_cast<const int*>(mine.base + args.nvl_notify_offset);
        if (tid == 0) {
            int acc = 0;
            for (int s = 0; s < R; ++s) {  // s = d * L + l: count sits in forwarder l's record, entry d
                acc += ld_cg_s32(area + (s % L) * args.nvl_record_stride + s / L);
                args.recv_gbl_rank_prefix_sum[s] = acc;
            }
            args.meta[0] = acc;
        }
        for (int e = tid; e < El; e += blockDim.x) {
            long long total = 0;
            for (int l = 0; l < L; ++l) total += ld_cg_s32(area + l * args.nvl_record_stride + D + e);
            if (args.expert_alignment > 1) total = (total + args.expert_alignment - 1) / args.expert_alignment * args.expert_alignment;
            args.meta[2 + e] = static_cast<int>(total);
        }
    }
    __syncthreads();
    if (tid == 0) {
        nvshmem_quiet();  // the staged records may be rewritten by the next notify
        *state.notify_seq() = static_cast<long long>(seq);
    }
}

}  // namespace deepep_cupy::internode

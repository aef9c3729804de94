// DeepEP V2's layout arrays for one dispatch, from what V1's dispatch returned: two launches in place of
// the few dozen array operations that derive them (deepep_cupy/ep/recv_rows.py says what each array
// means; it is also the oracle these kernels are tested against).
//
// count_recv_rows: block e < L scans the received rows in order, one thread per row, and counts the rows
// that select local expert e; a block-wide prefix of those flags gives each selection its place among
// the expert's selections, so within an expert the rows keep received order (a stable counting sort
// without atomics). Block L + r scans this rank's own tokens the same way for destination rank r: the
// place of a token among those sent to r, V2's dst_buffer_slot_idx. Every block also sets a share of the
// expanded layout's row sources to -1, the value of a padding row.
//
// place_recv_rows: every block adds the aligned segment starts (a prefix over the L counts, made in
// shared memory by each block) to the places, scatters each selection's source into the expanded layout,
// and writes the per-row metadata; block 0 writes the per-expert and per-rank prefix sums.
//
// A row selects each local expert at most once (top-k ids are distinct), so one flag per (row, expert).

#include "common/nvrtc_compat.cuh"
#include "layout/args.cuh"

namespace deepep_cupy::layout {

constexpr int kRecvRowsThreads = 512;
constexpr int kPlaceThreads = 256;
constexpr int kPlaceBlocks = 64;

// Exclusive prefix of `flag` over the block's threads; `total` gets the block's sum. Every thread calls it.
template <int kThreads>
__device__ __forceinline__ int block_exclusive_scan(int flag, int& total) {
    static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps");
    constexpr int kWarps = kThreads / 32;
    __shared__ int warp_sums[kWarps];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const unsigned ballot = __ballot_sync(0xffffffffu, flag != 0);
    int before = __popc(ballot & ((1u << lane) - 1u));
    if (lane == 0) warp_sums[warp] = __popc(ballot);
    __syncthreads();
    int sum = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
        const int s = warp_sums[w];
        if (w < warp) before += s;
        sum += s;
    }
    __syncthreads();  // warp_sums is reused by the next call
    total = sum;
    return before;
}

__global__ void __launch_bounds__(kRecvRowsThreads, 1) count_recv_rows(const __grid_constant__ CountRecvRowsArgs args) {
    const int b = blockIdx.x;
    const int k = args.num_topk;
    if (args.expand) {
        for (long long r = static_cast<long long>(b) * kRecvRowsThreads + threadIdx.x; r < args.num_expanded_rows;
             r += static_cast<long long>(gridDim.x) * kRecvRowsThreads)
            args.sources[r] = -1;
    }
    int carry = 0;
    if (b < args.num_local_experts) {
        // The loop bound is uniform across the block: every thread joins each scan.
        for (int base = 0; base < args.num_rows; base += kRecvRowsThreads) {
            const int i = base + static_cast<int>(threadIdx.x);
            int slot = -1;
            if (i < args.num_rows) {
                const int64_t* row = args.recv_topk_idx + static_cast<long long>(i) * k;
                for (int j = 0; j < k; ++j)
                    if (row[j] == b) slot = j;
            }
            int total;
            const int before = block_exclusive_scan<kRecvRowsThreads>(slot >= 0, total);
            if (slot >= 0 && args.expand) args.rows[static_cast<long long>(i) * k + slot] = carry + before;
            carry += total;
        }
        if (threadIdx.x == 0) args.counts[b] = carry;
        return;
    }
    const int dst = b - args.num_local_experts;  // a destination rank
    const int num_experts = args.num_local_experts * args.num_ranks;
    for (int base = 0; base < args.num_tokens; base += kRecvRowsThreads) {
        const int t = base + static_cast<int>(threadIdx.x);
        const bool live = t < args.num_tokens;
        const bool sent = live && args.is_token_in_rank[static_cast<long long>(t) * args.num_ranks + dst];
        int total;
        const int before = block_exclusive_scan<kRecvRowsThreads>(sent, total);
        if (live) {
            const int64_t* ids = args.topk_idx + static_cast<long long>(t) * k;
            int* out = args.dst_slots + static_cast<long long>(t) * k;
            for (int j = 0; j < k; ++j) {
                const int64_t e = ids[j];
                if (e >= 0 && e < num_experts) {
                    if (e / args.num_local_experts == dst) out[j] = dst * args.num_max_tokens + carry + before;
                } else if (dst == 0) {
                    out[j] = -1;  // no expert (or one the layout already refused): slot 0's block says so
                }
            }
        }
        carry += total;
    }
}

// Launched with (L + R) * 4 bytes of dynamic shared memory.
__global__ void __launch_bounds__(kPlaceThreads, 1) place_recv_rows(const __grid_constant__ PlaceRecvRowsArgs args) {
    extern __shared__ int s_words[];
    int* starts = s_words;                              // [L] aligned exclusive prefix of the counts
    int* psum_rank = s_words + args.num_local_experts;  // [R]
    const int k = args.num_topk, num_experts = args.num_local_experts, a = args.expert_alignment;
    // The starts: chunks of the block's width, each an exclusive scan of the aligned counts plus a carry.
    int carry = 0;
    for (int base = 0; base < num_experts; base += kPlaceThreads) {
        const int e = base + static_cast<int>(threadIdx.x);
        const int aligned = e < num_experts ? (args.counts[e] + a - 1) / a * a : 0;
        // A sum scan (not a flag count): lanes add their neighbours' values in log steps.
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        int inclusive = aligned;
#pragma unroll
        for (int d = 1; d < 32; d *= 2) {
            const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
            if (lane >= d) inclusive += v;
        }
        __shared__ int warp_sums[kPlaceThreads / 32];
        if (lane == 31) warp_sums[warp] = inclusive;
        __syncthreads();
        int before = 0, total = 0;
#pragma unroll
        for (int w = 0; w < kPlaceThreads / 32; ++w) {
            if (w < warp) before += warp_sums[w];
            total += warp_sums[w];
        }
        if (e < num_experts) {
            const int start = carry + before + inclusive - aligned;
            starts[e] = start;
            if (blockIdx.x == 0) args.psum_expert[e] = start + (args.expand ? args.counts[e] : aligned);
        }
        carry += total;
        __syncthreads();
    }
    for (int r = threadIdx.x; r < args.num_ranks; r += kPlaceThreads) {
        const int v = args.rank_prefix[static_cast<long long>(r) * args.prefix_stride + args.prefix_column];
        psum_rank[r] = v;
        if (blockIdx.x == 0) args.psum_rank[r] = v;
    }
    __syncthreads();
    for (int i = blockIdx.x * kPlaceThreads + threadIdx.x; i < args.num_rows; i += gridDim.x * kPlaceThreads) {
        const int64_t* ids = args.recv_topk_idx + static_cast<long long>(i) * k;
        long long* rows = args.rows + static_cast<long long>(i) * k;
        int* meta = args.metadata + static_cast<long long>(i) * (k + 2);
        int master = -1;
        for (int j = 0; j < k; ++j) {
            const int64_t e = ids[j];
            long long row = -1;
            if (e >= 0) {
                master = j;
                if (args.expand) {
                    row = rows[j] + starts[e];
                    if (row < args.num_expanded_rows) args.sources[row] = static_cast<long long>(i) * k + j;
                }
            }
            rows[j] = row;
            meta[2 + j] = static_cast<int>(row);
        }
        int src_rank = 0;  // the first rank whose inclusive prefix passes i
        while (src_rank < args.num_ranks && psum_rank[src_rank] <= i) ++src_rank;
        const bool real = master >= 0;
        meta[0] = real ? src_rank * args.num_max_tokens + args.recv_src_idx[i] : -1;
        meta[1] = real ? src_rank * k + master : -1;
    }
}

}  // namespace deepep_cupy::layout

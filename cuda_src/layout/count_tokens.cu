// Dispatch layout: from each token's top-k expert ids, count tokens per expert, per rank and per RDMA
// rank (node), and mark which ranks each token goes to.
//
// One kernel, no memset: the grid is one thread-block cluster of kCluster blocks (sm_90; a single block
// elsewhere). Block b takes a contiguous 1/kCluster of the tokens, one thread per token: it reads the
// token's ids once, adds them to a histogram of all E experts in its shared memory, builds the token's
// bit mask over ranks (and RDMA ranks) 32 at a time (a token counts once per rank however many of its
// experts live there), writes its is_token_in_rank bytes, and warps count the masks with ballots. Then
// the blocks add up each other's shared counts through distributed shared memory, each block writing a
// share of the outputs, so every output element is written exactly once.
// (A block per 32 experts and one per 32 ranks, each reading all N*K ids, was several times slower: the
// single rank block did all the per-id work on one SM.)
// The grid does not depend on N, so N = 0 still launches and writes zero counts.
// Experts map to ranks contiguously: rank = e / (E / R); RDMA rank = rank / num_nvl_ranks.
// Id -1 selects nothing. Any other id outside [0, E) is bad: it selects nothing either, and the first
// warp of each block that meets one reports it as a value error (op kValueOpLayout; the first report
// wins) when given an error record, so the host needs no check of its own before the launch.

#include "common/nvrtc_compat.cuh"
#include "common/ptx.cuh"
#include "common/value_errors.cuh"
#include "layout/args.cuh"

namespace deepep_cupy::layout {

constexpr int kThreads = 512;
constexpr int kRanksPerPass = 32;  // one warp lane per rank of a pass

// Blocks of the launch's cluster. Without clusters (before sm_90) the kernel is one block and these
// reduce to the block's own shared memory.
template <int kCluster>
__device__ __forceinline__ int cluster_block() {
    if constexpr (kCluster == 1) {
        return 0;
    } else {
#if __CUDA_ARCH__ >= 900
        return cluster_ctarank();
#else
        __trap();  // never launched: the host picks kCluster = 1 before sm_90
        return 0;
#endif
    }
}

// Every thread of every block of the cluster: shared-memory writes before it are visible to all blocks
// after it.
template <int kCluster>
__device__ __forceinline__ void cluster_barrier() {
    if constexpr (kCluster == 1) {
        __syncthreads();
    } else {
#if __CUDA_ARCH__ >= 900
        cluster_sync();
#endif
    }
}

// Block `block`'s copy of the shared word at `p` (this block's address of it).
template <int kCluster>
__device__ __forceinline__ int ld_cluster_shared(const int* p, int block) {
    if constexpr (kCluster == 1) {
        return *p;
    } else {
#if __CUDA_ARCH__ >= 900
        return ld_shared_cluster(p, block);
#else
        return *p;
#endif
    }
}

// floor(n / d) for a runtime divisor d >= 1 and n in [0, 2^31), as one multiply and one shift instead of
// the ~20 instructions of an integer division (two per id: a block's instruction count, not its loads,
// bounds it). With l = ceil(log2 d) and m = ceil(2^(31 + l) / d) < 2^32,
// m * d = 2^(31 + l) + err with err < d <= 2^l, so n * m / 2^(31 + l) exceeds n / d by less than 1 / d
// and the floor is exact.
struct FastDiv {
    uint32_t mul;
    int shift;
    __device__ __forceinline__ explicit FastDiv(int d) {
        shift = 31 + (32 - __clz(d - 1));
        mul = static_cast<uint32_t>(((uint64_t{1} << shift) + static_cast<uint64_t>(d) - 1) / static_cast<uint64_t>(d));
    }
    __device__ __forceinline__ int operator()(int n) const {
        return static_cast<int>((static_cast<uint64_t>(static_cast<uint32_t>(n)) * mul) >> shift);
    }
};

// The K ids of token t (16-byte loads when the rows are 16-byte aligned), all issued before any is used,
// as int32: the ids that select nothing become -1, and a bad one (not -1, not in [0, E)) is noted.
template <int kTopK>
__device__ __forceinline__ void load_row(const int64_t* __restrict__ topk_idx, int t, bool vec_rows, int num_experts,
                                         int (&ids)[kTopK], BadValue& bad) {
    const int64_t* row = topk_idx + static_cast<int64_t>(t) * kTopK;
    const auto keep = [&](int k, int64_t e) {
        const bool valid = e >= 0 && e < num_experts;
        if (!valid) bad.check_expert_id(e, num_experts);
        ids[k] = valid ? static_cast<int>(e) : -1;
    };
    if constexpr (kTopK % 2 == 0) {
        if (vec_rows) {
            const longlong2* vec = reinterpret_cast<const longlong2*>(row);
#pragma unroll
            for (int k = 0; k < kTopK / 2; ++k) {
                const longlong2 v = __ldg(vec + k);
                keep(2 * k, v.x);
                keep(2 * k + 1, v.y);
            }
            return;
        }
    }
#pragma unroll
    for (int k = 0; k < kTopK; ++k) keep(k, __ldg(row + k));
}

// is_token_in_rank bytes [0, n) of one token from the bits of `mask` (0x00 / 0x01 each), in the widest
// stores the row's alignment allows (`width` 4, 2 or 1 bytes, chosen per launch).
__device__ __forceinline__ void store_rank_bytes(bool* out, uint32_t mask, int n, int width) {
    if (width == 4) {
        for (int j = 0; j < n; j += 4) {
            const uint32_t b = mask >> j;
            *reinterpret_cast<uint32_t*>(out + j) =
                (b & 1u) | ((b >> 1) & 1u) << 8 | ((b >> 2) & 1u) << 16 | ((b >> 3) & 1u) << 24;
        }
    } else if (width == 2) {
        for (int j = 0; j < n; j += 2) {
            const uint32_t b = mask >> j;
            *reinterpret_cast<uint16_t*>(out + j) = static_cast<uint16_t>((b & 1u) | ((b >> 1) & 1u) << 8);
        }
    } else {
        for (int j = 0; j < n; ++j) out[j] = (mask >> j) & 1u;
    }
}

// Lane j of the warp gets the number of live lanes whose mask has bit j, for j < n.
__device__ __forceinline__ int count_bits_per_lane(uint32_t mask, int n, int lane) {
    int mine = 0;
    for (int j = 0; j < n; ++j) {
        const int c = __popc(__ballot_sync(0xffffffffu, (mask >> j) & 1u));
        if (lane == j) mine = c;
    }
    return mine;
}

// One block's share of the tokens (see the top); every thread calls it. Shared counts: hist[E],
// rank_counts[R], rdma_counts[R_rdma], zeroed by the caller.
template <int kTopK, int kCluster>
__device__ __forceinline__ void count_block(const int64_t* __restrict__ topk_idx, int num_tokens, int num_experts,
                                            int num_ranks, int num_nvl_ranks, int num_rdma_ranks, int* hist,
                                            int* rank_counts, int* rdma_counts, bool* __restrict__ is_token_in_rank,
                                            ErrorRecord* err, int rank) {
    __shared__ int bad_claimed;  // one warp of the block reports
    if (threadIdx.x == 0) bad_claimed = 0;
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int per_block = (num_tokens + kCluster - 1) / kCluster;
    const int t0 = cluster_block<kCluster>() * per_block;
    const int t1 = min(num_tokens, t0 + per_block);
    const FastDiv rank_of(num_experts / num_ranks), rdma_of(num_nvl_ranks);
    // Rows are 16-byte aligned when K is even and the base is; then each row is K/2 vector loads.
    const bool vec_rows = (kTopK % 2 == 0) && (reinterpret_cast<uintptr_t>(topk_idx) & 15) == 0;
    const uintptr_t out_base = reinterpret_cast<uintptr_t>(is_token_in_rank);
    const int width = (num_ranks % 4 == 0 && (out_base & 3) == 0) ? 4 : (num_ranks % 2 == 0 && (out_base & 1) == 0) ? 2 : 1;
    const int passes = (max(num_ranks, num_rdma_ranks) + kRanksPerPass - 1) / kRanksPerPass;
    BadValue bad;
    __syncthreads();

    // The loop bound is uniform per warp so that every lane joins the ballots.
    for (int base = t0 + warp * 32; base < t1; base += kThreads) {
        const int t = base + lane;
        const bool live = t < t1;
        int ids[kTopK];
        if (live) {
            load_row<kTopK>(topk_idx, t, vec_rows, num_experts, ids, bad);
        } else {
#pragma unroll
            for (int k = 0; k < kTopK; ++k) ids[k] = -1;
        }
#pragma unroll
        for (int k = 0; k < kTopK; ++k)
            if (ids[k] >= 0) atomicAdd(hist + ids[k], 1);
        for (int pass = 0; pass < passes; ++pass) {
            const int r_lo = pass * kRanksPerPass;
            uint32_t rank_mask = 0, rdma_mask = 0;
#pragma unroll
            for (int k = 0; k < kTopK; ++k) {
                if (ids[k] < 0) continue;
                const int dst = rank_of(ids[k]);
                const int rel = dst - r_lo;
                if (rel >= 0 && rel < kRanksPerPass) rank_mask |= 1u << rel;
                if (rdma_counts != nullptr) {
                    const int rdma_rel = rdma_of(dst) - r_lo;
                    if (rdma_rel >= 0 && rdma_rel < kRanksPerPass) rdma_mask |= 1u << rdma_rel;
                }
            }
            const int n_rank = max(0, min(kRanksPerPass, num_ranks - r_lo));
            const int n_rdma = rdma_counts != nullptr ? max(0, min(kRanksPerPass, num_rdma_ranks - r_lo)) : 0;
            if (live && n_rank > 0)
                store_rank_bytes(is_token_in_rank + static_cast<int64_t>(t) * num_ranks + r_lo, rank_mask, n_rank, width);
            const int c_rank = count_bits_per_lane(rank_mask, n_rank, lane);
            const int c_rdma = count_bits_per_lane(rdma_mask, n_rdma, lane);
            if (c_rank) atomicAdd(rank_counts + r_lo + lane, c_rank);
            if (c_rdma) atomicAdd(rdma_counts + r_lo + lane, c_rdma);
        }
    }

    // Every lane is here (the loop bound is uniform per warp): the block's first warp with a bad id reports.
    if (err != nullptr && __any_sync(0xffffffffu, bad.found)) {
        const int claimed = lane == 0 ? atomicExch(&bad_claimed, 1) : 0;
        if (__shfl_sync(0xffffffffu, claimed, 0) == 0)
            bad.report_from_warp(err, kValueOpLayout, rank, __LINE__);
    }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define DEEPEP_LAYOUT_CLUSTER(n)
#else
#define DEEPEP_LAYOUT_CLUSTER(n) __cluster_dims__(n, 1, 1)
#endif

// Grid: kCluster blocks of kThreads threads (one cluster; kCluster = 1 before sm_90), with
// (E + R + R_rdma) * 4 bytes of dynamic shared memory. num_tokens_per_rdma_rank may be null (single
// NVLink domain). err may be null (bad ids are then only ignored); rank is the value reported with a
// bad id.
template <int kTopK, int kCluster>
__global__ void DEEPEP_LAYOUT_CLUSTER(kCluster) __launch_bounds__(kThreads, 1)
    count_tokens(const __grid_constant__ CountTokensArgs args) {
    static_assert(kTopK >= 1 && kTopK <= 128, "top-k out of range");
    static_assert(kCluster >= 1 && kCluster <= 8, "a portable cluster has at most 8 blocks");
    extern __shared__ int s_counts[];
    const int num_rdma_ranks = args.num_tokens_per_rdma_rank != nullptr ? args.num_ranks / args.num_nvl_ranks : 0;
    const int words = args.num_experts + args.num_ranks + num_rdma_ranks;
    int* hist = s_counts;
    int* rank_counts = hist + args.num_experts;
    int* rdma_counts = num_rdma_ranks > 0 ? rank_counts + args.num_ranks : nullptr;
    for (int i = static_cast<int>(threadIdx.x); i < words; i += kThreads) s_counts[i] = 0;
    count_block<kTopK, kCluster>(args.topk_idx, args.num_tokens, args.num_experts, args.num_ranks, args.num_nvl_ranks, num_rdma_ranks,
                                 hist, rank_counts, rdma_counts, args.is_token_in_rank, args.err, args.rank);
    // Every block's counts are final; block b sums words b, b + kCluster, ... over the cluster and writes
    // them. The second barrier keeps every block's shared memory alive until the others have read it.
    cluster_barrier<kCluster>();
    const int me = cluster_block<kCluster>();
    for (int i = me + kCluster * static_cast<int>(threadIdx.x); i < words; i += kCluster * kThreads) {
        int sum = 0;
#pragma unroll
        for (int b = 0; b < kCluster; ++b) sum += ld_cluster_shared<kCluster>(s_counts + i, b);
        if (i < args.num_experts) args.num_tokens_per_expert[i] = sum;
        else if (i < args.num_experts + args.num_ranks) args.num_tokens_per_rank[i - args.num_experts] = sum;
        else args.num_tokens_per_rdma_rank[i - args.num_experts - args.num_ranks] = sum;
    }
    cluster_barrier<kCluster>();
}

#undef DEEPEP_LAYOUT_CLUSTER

}  // namespace deepep_cupy::layout

// Dispatch layout: from each token's top-k expert ids, count tokens per expert, per rank and per RDMA
// rank (node), and mark which ranks each token goes to.
//
// One kernel, no memset: every output element is written exactly once by the block that owns it.
//   * Blocks [0, num_expert_blocks) each own kExpertsPerBlock experts, scan all N*K ids and count the
//     ones in their range in shared memory.
//   * The remaining ceil(R / 32) blocks each own 32 ranks (and the RDMA ranks with the same indices):
//     one thread per token builds the token's bit mask over those ranks (a token counts once per rank
//     however many of its experts live there), writes its is_token_in_rank bytes, and warps count
//     the masks with ballots, lane j keeping the count of rank j.
// The grid does not depend on N, so N = 0 still launches and writes zero counts.
// Experts map to ranks contiguously: rank = e / (E / R); RDMA rank = rank / num_nvl_ranks.
// Id -1 selects nothing. Any other id outside [0, E) is bad: it selects nothing either, and the first
// rank block (which reads every id) reports one of them as a value error (op kValueOpLayout) when given
// an error record, so the host needs no check of its own before the launch.

#include "common/nvrtc_compat.cuh"
#include "common/value_errors.cuh"

namespace deepep_layout {

constexpr int kThreads = 1024;
constexpr int kExpertsPerBlock = 32;
constexpr int kRanksPerBlock = 32;  // one warp lane per rank

__device__ __forceinline__ void count_expert(int64_t e, int64_t e_lo, int64_t e_hi, int* hist) {
    if (e >= e_lo && e < e_hi) atomicAdd(&hist[static_cast<int>(e - e_lo)], 1);
}

__device__ void count_experts(const int64_t* __restrict__ topk_idx, int64_t total, int num_experts, int block,
                              int* __restrict__ num_tokens_per_expert) {
    __shared__ int hist[kExpertsPerBlock];
    if (threadIdx.x < kExpertsPerBlock) hist[threadIdx.x] = 0;
    __syncthreads();

    const int64_t e_lo = static_cast<int64_t>(block) * kExpertsPerBlock;
    const int64_t e_hi = e_lo + kExpertsPerBlock < num_experts ? e_lo + kExpertsPerBlock : num_experts;
    int64_t scalar_from = 0;
    if ((reinterpret_cast<uintptr_t>(topk_idx) & 15) == 0) {
        // Two ids per 16-byte load through the read-only path (the ids are not written during the kernel);
        // kUnroll loads are issued before their ids are counted, to keep several in flight: 8 x 16 bytes
        // per thread is 128 KB per block, so N x K = 32768 ids take two passes (one L2 round trip each).
        constexpr int kUnroll = 8;
        const longlong2* vec = reinterpret_cast<const longlong2*>(topk_idx);
        const int64_t num_vec = total / 2;
        for (int64_t i = threadIdx.x; i < num_vec; i += kUnroll * kThreads) {
            longlong2 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                v[u] = i + u * kThreads < num_vec ? __ldg(vec + i + u * kThreads) : make_longlong2(-1, -1);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                count_expert(v[u].x, e_lo, e_hi, hist);
                count_expert(v[u].y, e_lo, e_hi, hist);
            }
        }
        scalar_from = num_vec * 2;
    }
    for (int64_t i = scalar_from + threadIdx.x; i < total; i += kThreads)
        count_expert(__ldg(topk_idx + i), e_lo, e_hi, hist);
    __syncthreads();

    if (threadIdx.x < kExpertsPerBlock && e_lo + threadIdx.x < e_hi)
        num_tokens_per_expert[e_lo + threadIdx.x] = hist[threadIdx.x];
}

// floor(n / d) for a runtime divisor d >= 1 and n in [0, 2^31), as one multiply and one shift instead of
// the ~20 instructions of an integer division (the rank block does two per id, and its instruction
// count, not its loads, was its critical path). With l = ceil(log2 d) and m = ceil(2^(31 + l) / d) < 2^32,
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

// Calls f(id) for the K ids of token t (16-byte loads when the rows are 16-byte aligned). Small K: every
// load of the row is issued before f sees any id; large K: the compiler interleaves them (registers).
template <int kTopK, typename F>
__device__ __forceinline__ void for_row(const int64_t* __restrict__ topk_idx, int t, bool vec_rows, F f) {
    const int64_t* row = topk_idx + static_cast<int64_t>(t) * kTopK;
    if constexpr (kTopK % 2 == 0) {
        if (vec_rows) {
            const longlong2* vec = reinterpret_cast<const longlong2*>(row);
#pragma unroll
            for (int k = 0; k < kTopK / 2; ++k) {
                const longlong2 v = __ldg(vec + k);
                f(v.x);
                f(v.y);
            }
            return;
        }
    }
#pragma unroll
    for (int k = 0; k < kTopK; ++k) f(__ldg(row + k));
}

// err: where to report a bad id (null: this block does not report; the kernel passes it to one block).
template <int kTopK>
__device__ void count_ranks(const int64_t* __restrict__ topk_idx, int num_tokens, int num_experts, int num_ranks,
                            int num_nvl_ranks, int block, int* __restrict__ num_tokens_per_rank,
                            int* __restrict__ num_tokens_per_rdma_rank, bool* __restrict__ is_token_in_rank,
                            deepep::ErrorRecord* err, int rank) {
    // Rows per thread per pass: with small K, two rows' loads are issued before either is used, halving
    // the passes (each an L2 round trip for the whole block).
    constexpr int kRows = kTopK <= 8 ? 2 : 1;
    __shared__ int rank_counts[kRanksPerBlock];
    __shared__ int rdma_counts[kRanksPerBlock];
    __shared__ int bad_claimed;  // one warp of the block reports
    if (threadIdx.x < kRanksPerBlock) {
        rank_counts[threadIdx.x] = 0;
        rdma_counts[threadIdx.x] = 0;
    }
    if (threadIdx.x == 0) bad_claimed = 0;
    __syncthreads();

    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int r_lo = block * kRanksPerBlock;
    const int n_rank = min(kRanksPerBlock, num_ranks - r_lo);
    const bool with_rdma = num_tokens_per_rdma_rank != nullptr;
    const int num_rdma_ranks = with_rdma ? num_ranks / num_nvl_ranks : 0;
    const int n_rdma = max(0, min(kRanksPerBlock, num_rdma_ranks - r_lo));
    const FastDiv rank_of(num_experts / num_ranks), rdma_of(num_nvl_ranks);
    // Rows are 16-byte aligned when K is even and the base is; then each row is K/2 vector loads.
    const bool vec_rows = (kTopK % 2 == 0) && (reinterpret_cast<uintptr_t>(topk_idx) & 15) == 0;
    const bool word_stores = (num_ranks % 4 == 0) && (reinterpret_cast<uintptr_t>(is_token_in_rank) & 3) == 0;

    int my_rank_count = 0;  // lane j: tokens of this warp that reach rank r_lo + j
    int my_rdma_count = 0;
    deepep::BadValue bad;
    // The loop bound is uniform per warp so that every lane joins the ballots. A warp's pass covers the
    // kRows * 32 tokens from `base`, lane l taking base + l + 32 r.
    for (int base = warp * 32 * kRows; base < num_tokens; base += kThreads * kRows) {
        // Small K: the ids of all kRows rows are loaded first, in one branch-free block so that every load
        // is issued before any is used (a lane past the end loads the last row again and ignores it), then
        // kept as 32-bit values, -1 for every id that selects nothing (a bad one is noted here).
        constexpr int kHeld = kRows > 1 ? kTopK : 1;
        int held[kRows][kHeld];
        if constexpr (kRows > 1) {
            int64_t raw[kRows][kTopK];
            if (vec_rows) {
#pragma unroll
                for (int r = 0; r < kRows; ++r) {
                    const int t = min(base + 32 * r + lane, num_tokens - 1);
                    const longlong2* vec =
                        reinterpret_cast<const longlong2*>(topk_idx + static_cast<int64_t>(t) * kTopK);
#pragma unroll
                    for (int k = 0; k < kTopK / 2; ++k) {
                        const longlong2 v = __ldg(vec + k);
                        raw[r][2 * k] = v.x;
                        raw[r][2 * k + 1] = v.y;
                    }
                }
            } else {
#pragma unroll
                for (int r = 0; r < kRows; ++r) {
                    const int t = min(base + 32 * r + lane, num_tokens - 1);
#pragma unroll
                    for (int k = 0; k < kTopK; ++k) raw[r][k] = __ldg(topk_idx + static_cast<int64_t>(t) * kTopK + k);
                }
            }
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                const bool live = base + 32 * r + lane < num_tokens;
#pragma unroll
                for (int k = 0; k < kTopK; ++k) {
                    const int64_t e = raw[r][k];
                    const bool valid = e >= 0 && e < num_experts;
                    if (live && !valid) bad.check_expert_id(e, num_experts);
                    held[r][k] = valid ? static_cast<int>(e) : -1;
                }
            }
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const int t = base + 32 * r + lane;
            uint32_t rank_mask = 0, rdma_mask = 0;
            if (t < num_tokens) {
                auto add = [&](int64_t e) {
                    if (e < 0 || e >= num_experts) {
                        bad.check_expert_id(e, num_experts);  // off the common path: ids that select nothing
                        return;
                    }
                    const int dst = rank_of(static_cast<int>(e));
                    const int rel = dst - r_lo;
                    if (rel >= 0 && rel < kRanksPerBlock) rank_mask |= 1u << rel;
                    if (with_rdma) {
                        const int rdma_rel = rdma_of(dst) - r_lo;
                        if (rdma_rel >= 0 && rdma_rel < kRanksPerBlock) rdma_mask |= 1u << rdma_rel;
                    }
                };
                if constexpr (kRows > 1) {
#pragma unroll
                    for (int k = 0; k < kTopK; ++k) add(held[r][k]);
                } else {
                    for_row<kTopK>(topk_idx, t, vec_rows, add);
                }
                bool* out = is_token_in_rank + static_cast<int64_t>(t) * num_ranks + r_lo;
                if (word_stores) {
                    // n_rank is a multiple of 4 here; one 32-bit store per 4 bools (bytes 0x00 / 0x01).
                    for (int j = 0; j < n_rank; j += 4) {
                        const uint32_t bits = rank_mask >> j;
                        const uint32_t word = (bits & 1u) | ((bits >> 1) & 1u) << 8 | ((bits >> 2) & 1u) << 16 |
                                              ((bits >> 3) & 1u) << 24;
                        *reinterpret_cast<uint32_t*>(out + j) = word;
                    }
                } else {
                    for (int j = 0; j < n_rank; ++j) out[j] = (rank_mask >> j) & 1u;
                }
            }
            for (int j = 0; j < n_rank; ++j) {
                const int c = __popc(__ballot_sync(0xffffffffu, (rank_mask >> j) & 1u));
                if (lane == j) my_rank_count += c;
            }
            for (int j = 0; j < n_rdma; ++j) {
                const int c = __popc(__ballot_sync(0xffffffffu, (rdma_mask >> j) & 1u));
                if (lane == j) my_rdma_count += c;
            }
        }
    }

    // Every lane is here (the loop bound is uniform per warp): the first warp with a bad id reports it.
    if (err != nullptr && __any_sync(0xffffffffu, bad.found)) {
        const int claimed = lane == 0 ? atomicExch(&bad_claimed, 1) : 0;
        if (__shfl_sync(0xffffffffu, claimed, 0) == 0)
            bad.report_from_warp(err, deepep::kValueOpLayout, rank, __LINE__);
    }
    if (lane < n_rank && my_rank_count) atomicAdd(&rank_counts[lane], my_rank_count);
    if (lane < n_rdma && my_rdma_count) atomicAdd(&rdma_counts[lane], my_rdma_count);
    __syncthreads();
    if (threadIdx.x < n_rank) num_tokens_per_rank[r_lo + threadIdx.x] = rank_counts[threadIdx.x];
    if (threadIdx.x < n_rdma) num_tokens_per_rdma_rank[r_lo + threadIdx.x] = rdma_counts[threadIdx.x];
}

}  // namespace deepep_layout

namespace deepep_cupy::layout {

// Grid: num_expert_blocks (= ceil(E / 32)) + ceil(R / 32) blocks of 1024 threads.
// num_tokens_per_rdma_rank may be null (single NVLink domain). err may be null (bad ids are then only
// ignored); rank is the value reported with a bad id.
template <int kTopK>
__global__ void __launch_bounds__(deepep_layout::kThreads, 1)
    count_tokens(const int64_t* __restrict__ topk_idx, int num_tokens, int num_experts, int num_ranks,
                 int num_nvl_ranks, int num_expert_blocks, int* __restrict__ num_tokens_per_expert,
                 int* __restrict__ num_tokens_per_rank, int* __restrict__ num_tokens_per_rdma_rank,
                 bool* __restrict__ is_token_in_rank, deepep::ErrorRecord* err, int rank) {
    static_assert(kTopK >= 1 && kTopK <= 128, "top-k out of range");
    const int block = static_cast<int>(blockIdx.x);
    if (block < num_expert_blocks) {
        deepep_layout::count_experts(topk_idx, static_cast<int64_t>(num_tokens) * kTopK, num_experts, block,
                                     num_tokens_per_expert);
    } else {
        // Every rank block reads all ids; the first one reports.
        const int rank_block = block - num_expert_blocks;
        deepep_layout::count_ranks<kTopK>(topk_idx, num_tokens, num_experts, num_ranks, num_nvl_ranks, rank_block,
                                          num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                          rank_block == 0 ? err : nullptr, rank);
    }
}

}  // namespace deepep_cupy::layout

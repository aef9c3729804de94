// Intranode dispatch, direct mode: every token is written straight into the output rows of each rank it
// goes to, with no ring in between.
//
// Each rank's outputs of a direct dispatch live in its output pool, device memory mapped into every rank
// (deepep_cupy/device/output_pool.py). A rank's kernel starts by telling every rank where its outputs of
// this call are (a dest entry in the fixed control area, published with the kernel's sequence number);
// after that any warp can write any token to any rank: a push over NVLink and the copy of an own token are
// the same operation with a different base pointer. The ring mode moves every peer's row twice on the
// receiving GPU (NVLink into the ring, then ring into the output) and pays a flag per run of tokens; here
// a row crosses once and nothing is published per token.
//
// Work: channel c (token range [c * ceil(N/C), ...)) belongs to blocks 2c and 2c + 1. Both build, in
// shared memory, the 32-token masks of the channel for every destination (from is_token_in_rank) and their
// prefix counts. Items are claimed from the channel's counter in chunk order, so every warp works until the
// channel is done; an item is one of two kinds, the same for the whole call (DispatchArgs::fan_out, chosen by
// the host from the launch's SM count: ops/intranode/engine.py, FAN_OUT_MAX_SMS):
// * By destination: (32-token chunk j, destination d, part p), the set bits p * kDirectRun ... of mask (j, d),
//   one copy each; this rank's part of a chunk before the peers' (faster than the peers first), so NVLink and
//   local copies stay interleaved.
//   Warps pushing over NVLink and warps copying locally then wait on different things, which keeps NVLink busy
//   on many SMs.
// * By token (fan-out): (chunk j, part p), the tokens at positions p * kDirectRun ... of the chunk, each loaded
//   once (row, scales, top-k) and stored into every rank it goes to. With R destinations a token's row, scales
//   and top-k were loaded up to R times; on few SMs, where the SMs' own loads and stores bound the dispatch,
//   that was the difference.
// Row of the k-th token of mask (j, d) at rank d: (rows d receives from ranks before this one) + (tokens
// this rank sends d in channels before c) + prefix (j, d) + k, the same row the ring mode fills.
//
// End: after its last write, each block releases a done word (sequence number) into every peer's buffer;
// block b of each rank then waits for block b of every peer, so when the kernel ends on a rank every row
// written into its outputs has landed there. Peers write only into the outputs this call published, and
// a rank's outputs of earlier calls are never touched.
//
// Mode: a call takes the direct mode only when every rank's outputs are in its pool; a rank whose pool
// could not hold them allocates them normally and says so in its dest entry, and then every rank runs the
// ring mode (dispatch.cu) for this call. Each rank sees every dest entry, so all ranks pick the same mode
// without the hosts talking.
//
// Bounds: a destination's rows are clipped at its num_out_rows (num_worst_tokens mode); the destination
// itself reports the overflow, from its own received count.
#pragma once

#include "intranode/buffer_map.cuh"
#include "intranode/copies.cuh"
#include "intranode/dispatch_token.cuh"
#include "intranode/sync.cuh"

namespace deepep_cupy::intranode {

constexpr int kDirectRun = 2;                  // tokens per claimed item
constexpr int kDirectParts = 32 / kDirectRun;  // items per chunk and destination

// Dest entry (8 uint64 in the owner's slot of every rank's control area): [0] sequence number, [1..5] byte
// offsets of x, scales, top-k ids, top-k weights and source indices in the owner's pool (-1: none),
// [6] the owner's num_out_rows, [7] 1 when the owner's outputs are in its pool (it can take the direct
// mode), 0 when they are ordinary allocations.
__device__ __forceinline__ uint64_t pool_offset(const void* p, const DispatchCtx& a) {
    return p == nullptr ? ~uint64_t{0}
                        : static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p) - static_cast<uintptr_t>(a.args.pool_bases[a.args.rank]));
}

// Thread r < R of block 0: tell rank r where this rank's outputs of this kernel are.
template <int kNumRanks>
__device__ __forceinline__ void publish_dest(const DispatchCtx& a) {
    const int r = threadIdx.x;
    if (r >= kNumRanks) return;
    uint64_t* e = ctrl_of(rank_base(a.args.bases, r), kNumRanks).dest(a.args.rank);
    const bool in_pool = a.args.pool_bases != nullptr;
    if (in_pool) {
        st_relaxed_sys(e + 1, pool_offset(a.args.recv_x, a));
        st_relaxed_sys(e + 2, pool_offset(a.args.recv_x_scales, a));
        st_relaxed_sys(e + 3, pool_offset(a.args.recv_topk_idx, a));
        st_relaxed_sys(e + 4, pool_offset(a.args.recv_topk_weights, a));
        st_relaxed_sys(e + 5, pool_offset(a.args.recv_src_idx, a));
    }
    st_relaxed_sys(e + 6, static_cast<uint64_t>(a.args.num_out_rows));
    st_relaxed_sys(e + 7, in_pool ? 1u : 0u);
    st_release_sys(e, a.seq);
}

template <typename T>
__device__ __forceinline__ T* pool_ptr(const DispatchCtx& a, int r, uint64_t offset) {
    return offset == ~uint64_t{0} ? nullptr
                                  : reinterpret_cast<T*>(static_cast<uintptr_t>(a.args.pool_bases[r]) + offset);
}

// Warp 0: waits for every peer's dest entry of this kernel; then every rank's outputs, where channel c's rows
// start at each rank and where its send_head entries count from. Returns 1 when every rank's outputs are in
// its pool (the direct mode), 0 when some are not (the ring mode), -1 on timeout (reported).
template <int kNumRanks>
__device__ __forceinline__ int load_dests(const DispatchCtx& a, const WaitCtx& wctx, int c, DestRows* dests,
                                          int* row_base, int* send_base, int lane) {
    constexpr int R = kNumRanks;
    const Ctrl ctrl = ctrl_of(rank_base(a.args.bases, a.args.rank), R);
    const bool peer = lane < R && lane != a.args.rank;
    if (!warp_wait_lanes(peer ? ctrl.dest(lane) : nullptr, a.seq, lane, wctx, kOpDispatchArrive, __LINE__))
        return -1;
    bool in_pool = true;
    if (lane < R) {
        DestRows d{a.args.recv_x, a.args.recv_x_scales, a.args.recv_topk_idx, a.args.recv_topk_weights, a.args.recv_src_idx, a.args.num_out_rows};
        in_pool = a.args.pool_bases != nullptr;
        if (peer) {
            const uint64_t* e = ctrl.dest(lane);
            in_pool = in_pool && ld_cg_u64(e + 7) != 0;  // peers' pools are known only through ours
            if (in_pool) {
                d.x = pool_ptr<int4>(a, lane, ld_cg_u64(e + 1));
                d.scales = pool_ptr<unsigned int>(a, lane, ld_cg_u64(e + 2));
                d.topk_idx = pool_ptr<long long>(a, lane, ld_cg_u64(e + 3));
                d.topk_weights = pool_ptr<float>(a, lane, ld_cg_u64(e + 4));
                d.src_idx = pool_ptr<int>(a, lane, ld_cg_u64(e + 5));
            }
            d.num_rows = static_cast<int>(ld_cg_u64(e + 6));
        }
        dests[lane] = d;
        const int sent_before = channel_start(a.args.channel_prefix_matrix, lane, a.args.num_channels, c);
        send_base[lane] = sent_before;
        row_base[lane] = (a.args.rank > 0 ? a.args.rank_prefix_matrix[(a.args.rank - 1) * R + lane] : 0) + sent_before;
    }
    return __all_sync(kFullMask, in_pool) ? 1 : 0;
}

// Masks of channel c's 32-token chunks per destination (mask[j * R + d]) and their exclusive prefix counts
// (prefix[j * R + d]), built by the whole block.
template <int kNumRanks, int kNumWarps>
__device__ __forceinline__ void build_masks(const DispatchCtx& a, int t_begin, int t_end, int num_chunks,
                                            unsigned int* mask, int* prefix, int warp, int lane) {
    constexpr int R = kNumRanks;
    for (int j = warp; j < num_chunks; j += kNumWarps) {
        const int t = t_begin + 32 * j + lane;
        bool in[R];
#pragma unroll
        for (int d = 0; d < R; ++d) in[d] = t < t_end && a.args.is_token_in_rank[static_cast<long long>(t) * R + d];
#pragma unroll
        for (int d = 0; d < R; ++d) {
            const unsigned int m = __ballot_sync(kFullMask, in[d]);
            if (lane == 0) mask[j * R + d] = m;
        }
    }
    __syncthreads();
    if (threadIdx.x < R) {
        int sum = 0;
        for (int j = 0; j < num_chunks; ++j) {
            prefix[j * R + threadIdx.x] = sum;
            sum += __popc(mask[j * R + threadIdx.x]);
        }
    }
}

// Shared state of a dispatch block: every rank's outputs, where channel c's rows start at each rank and the
// call's mode (the chunk masks live in dynamic shared memory).
template <int kNumRanks>
struct DirectShared {
    DestRows dests[kNumRanks];
    int row_base[kNumRanks], send_base[kNumRanks];
    int mode;  // load_dests' result
};

// Every block, first: the dest entries of all ranks (warp 0) and, meanwhile, the chunk masks of channel c
// (the other warps). Returns the mode (see load_dests).
template <int kNumRanks, int kNumWarps>
__device__ __forceinline__ int begin_dispatch(const DispatchCtx& a, const WaitCtx& wctx, int c,
                                              DirectShared<kNumRanks>& sh, unsigned int* masks) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int t_begin, t_end;
    channel_range(a.args.num_tokens, a.args.num_channels, c, t_begin, t_end);
    const int num_chunks = (t_end - t_begin + 31) / 32;
    if (warp == 0) {
        const int mode = load_dests<kNumRanks>(a, wctx, c, sh.dests, sh.row_base, sh.send_base, lane);
        if (lane == 0) sh.mode = mode;
    }
    build_masks<kNumRanks, kNumWarps>(a, t_begin, t_end, num_chunks, masks,
                                      reinterpret_cast<int*>(masks + num_chunks * kNumRanks), warp, lane);
    __syncthreads();
    return sh.mode;
}

// One token into every rank of `targets` (bit d: rank d gets it, at row `row` of lane d): its row, scales and
// top-k pair are loaded once and stored into each of them (top-k ids made local to each, -1 for another rank's
// experts, weight 0), with the source index. An own token's row is left out when the copy engines move the own
// rows (a.args.own_rows_copied). Bad ids are noted in `bad`.
template <int kNumRanks, int kUnroll>
__device__ __forceinline__ void fan_out_token(const DispatchCtx& a, const DirectShared<kNumRanks>& sh, int token,
                                              unsigned int targets, int row, BadValue& bad, int lane) {
    constexpr int R = kNumRanks;
    const TokenAux aux = load_aux(a, token, a.args.topk_idx != nullptr, lane);
    const unsigned int row_targets = a.args.own_rows_copied ? targets & ~(1u << a.args.rank) : targets;
    const int n = a.args.hidden_int4;
    if (row_targets != 0u) {
        const int4* src = a.args.x + static_cast<long long>(token) * n;
        warp_copy_rounds<kUnroll>(n, lane, [&](int j) { return ld_nc_v4(src + j); },
                                  [&](int base, const int4 (&v)[kUnroll]) {
#pragma unroll
            for (int i = 0; i < R; ++i) {
                const int d = (a.args.rank + i) % R;  // this rank first, the peers in turn: not every rank on one at once
                const int r = __shfl_sync(kFullMask, row, d);
                if ((row_targets >> d) & 1u)
                    store_round<kUnroll>(sh.dests[d].x + static_cast<long long>(r) * n, base, n, v, lane);
            }
        });
    }
#pragma unroll
    for (int d = 0; d < R; ++d) {
        const int r = __shfl_sync(kFullMask, row, d);
        if ((targets >> d) & 1u) store_extras<R>(a, token, aux, sh.dests[d], d, r, bad, lane);
    }
}

// Runs item(i) for every item i this warp claims from `claim`, until num_items. The next claim is issued before
// an item's work and read after it, so its latency is hidden.
template <class Item>
__device__ __forceinline__ void for_each_claimed(int* claim, int num_items, int lane, Item&& item) {
    int i = 0;
    if (lane == 0) i = atomicAdd(claim, 1);
    i = __shfl_sync(kFullMask, i, 0);
    while (i < num_items) {
        int next = 0;
        if (lane == 0) next = atomicAdd(claim, 1);
        item(i);
        i = __shfl_sync(kFullMask, next, 0);
    }
}

// send_head of the chunk's tokens for rank d (lane l: token chunk + l, m: the chunk's mask for d, whose first
// token is number `before_chunk` of the (channel, d) stream there): the token's index in that stream, or -1.
template <int kNumRanks>
__device__ __forceinline__ void store_send_head(const DispatchCtx& a, const DirectShared<kNumRanks>& sh,
                                                unsigned int m, int before_chunk, int d, int chunk, int t_end,
                                                int lane) {
    if (chunk + lane >= t_end) return;
    const int before = __popc(m & ((1u << lane) - 1u));
    a.args.send_head[static_cast<long long>(chunk + lane) * kNumRanks + d] =
        (m >> lane) & 1u ? sh.send_base[d] + before_chunk + before : -1;
}

// Item (chunk j, destination d, part p) of the channel [t_begin, t_end): the set bits p * kDirectRun ... of mask
// (j, d), one copy each; this rank's part of a chunk first (see the header). `prefix`: the chunks' prefix counts
// (begin_dispatch).
template <int kNumRanks, int kUnroll>
__device__ __forceinline__ void direct_item_by_destination(const DispatchCtx& a, const DirectShared<kNumRanks>& sh,
                                                           const unsigned int* mask, const int* prefix, int t_begin,
                                                           int t_end, int item, BadValue& bad, int lane) {
    constexpr int R = kNumRanks;
    const int j = item / (R * kDirectParts);
    const int i = item / kDirectParts % R;
    const int part = item % kDirectParts;
    const int d = (a.args.rank + i) % R;  // this rank first, then the peers
    const unsigned int m = mask[j * R + d];
    const int chunk = t_begin + 32 * j;
    if (part == 0) {
        if (i == 0) prefetch_scales(a, chunk + 32, min(chunk + 64, t_end), lane);
        if (a.args.send_head != nullptr) store_send_head<R>(a, sh, m, prefix[j * R + d], d, chunk, t_end, lane);
    }
    const int n = __popc(m);
    for (int k = part * kDirectRun; k < n && k < (part + 1) * kDirectRun; ++k) {
        const int row = sh.row_base[d] + prefix[j * R + d] + k;
        if (row < sh.dests[d].num_rows)
            copy_token<R, kUnroll>(a, chunk + nth_set_bit(m, k), sh.dests[d], d, row, bad, lane);
    }
}

// Item (chunk j, part p): the tokens at positions p * kDirectRun ... of the chunk, each loaded once and stored
// into every rank it goes to (fan_out_token; see the header).
template <int kNumRanks, int kUnroll>
__device__ __forceinline__ void direct_item_by_token(const DispatchCtx& a, const DirectShared<kNumRanks>& sh,
                                                     const unsigned int* mask, const int* prefix, int t_begin,
                                                     int t_end, int item, BadValue& bad, int lane) {
    constexpr int R = kNumRanks;
    const int j = item / kDirectParts;
    const int part = item % kDirectParts;
    const int chunk = t_begin + 32 * j;
    // Lane d < R: chunk j's mask for rank d and where its rows start there.
    const unsigned int m = lane < R ? mask[j * R + lane] : 0u;
    const int first_row = lane < R ? sh.row_base[lane] + prefix[j * R + lane] : 0;
    if (part == 0) {
        prefetch_scales(a, chunk + 32, min(chunk + 64, t_end), lane);
        if (a.args.send_head != nullptr) {
#pragma unroll
            for (int d = 0; d < R; ++d)
                store_send_head<R>(a, sh, __shfl_sync(kFullMask, m, d), prefix[j * R + d], d, chunk, t_end, lane);
        }
    }
    for (int k = part * kDirectRun; k < (part + 1) * kDirectRun && chunk + k < t_end; ++k) {
        // Lane d: the token's row at rank d, and whether it goes there (within d's outputs).
        const int row = first_row + __popc(m & ((1u << k) - 1u));
        const bool to_d = lane < R && ((m >> k) & 1u) && row < sh.dests[lane].num_rows;
        const unsigned int targets = __ballot_sync(kFullMask, to_d);
        if (targets != 0u) fan_out_token<R, kUnroll>(a, sh, chunk + k, targets, row, bad, lane);
    }
}

// The direct dispatch of one block (see the header), after begin_dispatch returned 1. Returns false when
// a wait timed out (reported).
template <int kNumRanks, int kNumWarps, int kUnroll>
__device__ __noinline__ bool dispatch_direct(const DispatchCtx& a, const WaitCtx& wctx, int c,
                                             const DirectShared<kNumRanks>& sh, const unsigned int* mask, int* claim) {
    constexpr int R = kNumRanks;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int t_begin, t_end;
    channel_range(a.args.num_tokens, a.args.num_channels, c, t_begin, t_end);
    const int num_chunks = (t_end - t_begin + 31) / 32;
    const int* prefix = reinterpret_cast<const int*>(mask + num_chunks * R);  // behind the masks (begin_dispatch)
    BadValue bad;
    if (a.args.fan_out)
        for_each_claimed(claim, num_chunks * kDirectParts, lane, [&](int item) {
            direct_item_by_token<R, kUnroll>(a, sh, mask, prefix, t_begin, t_end, item, bad, lane);
        });
    else
        for_each_claimed(claim, num_chunks * R * kDirectParts, lane, [&](int item) {
            direct_item_by_destination<R, kUnroll>(a, sh, mask, prefix, t_begin, t_end, item, bad, lane);
        });
    bad.report_from_warp(a.args.err, kValueOpIntranodeDispatch, a.args.rank, __LINE__);

    // Every write of this block is done: release this block's done word into every peer, then wait for
    // the same block of every peer (done words at a.args.done_offset: [source rank][block]).
    __syncthreads();
    if (threadIdx.x < R && threadIdx.x != a.args.rank) {
        fence_acq_rel_sys();
        uint64_t* word = reinterpret_cast<uint64_t*>(rank_base(a.args.bases, threadIdx.x) + a.args.done_offset) +
                         static_cast<long long>(a.args.rank) * gridDim.x + blockIdx.x;
        st_release_sys(word, a.seq);
    }
    if (warp == 0) {
        const uint64_t* words = reinterpret_cast<const uint64_t*>(rank_base(a.args.bases, a.args.rank) + a.args.done_offset);
        const bool peer = lane < R && lane != a.args.rank;
        return warp_wait_lanes(peer ? words + static_cast<long long>(lane) * gridDim.x + blockIdx.x : nullptr, a.seq,
                               lane, wctx, kOpDispatchRecv, __LINE__);
    }
    return true;
}

}  // namespace deepep_cupy::intranode

// Shared pieces of the intranode (NVLink) kernels: the NVL buffer map, per-kernel sequence numbers,
// bounded waits and warp copy loops.
//
// NVL buffer of every rank (all offsets in bytes from the start of that rank's buffer; the host computes
// the per-call offsets in deepep_cupy/ops/intranode/buffer_map.py and passes them as kernel arguments):
//
//   [0, ctrl_bytes)        control words, fixed for the buffer's lifetime (uint64 each):
//       arrive[R]          arrive[s] = sequence number of the latest kernel rank s has started; s stores
//                          it into every rank's buffer when its kernel begins (all earlier kernels of s
//                          on this buffer are finished by then).
//       notify_flag[R]     notify_flag[s] = sequence number of the notify kernel whose counts s has
//                          written into this buffer.
//       local_seq          sequence number of the last communicating kernel of this rank (local only).
//       done_count         blocks of the running kernel that have finished (local only, back to 0 at the end).
//       dest[R]            8 words each: dest[s] = where rank s's outputs of its running direct dispatch are
//                          (s writes it into every rank's buffer when that kernel begins; dispatch_direct.cuh).
//       copy_flag[R]       combine copy mode: copy_flag[s] = (copy sequence << 32) | rows rank s has copied
//                          into this rank's staging area so far (written by s's copy streams; combine_copy.cu).
//       copy_done[R]       combine copy mode: copy_done[s] = sequence number of the latest combine kernel in
//                          which rank s has read all the rows this rank copied to it.
//   [ring_offset, ...)     per call: C * R rings, ring (c, s) holds what rank s sends to this rank in
//                          channel c: `cap` slots of `slot_bytes`; slot 0 of ring (c, s) starts at
//                          ring_offset + (c * R + s) * cap * slot_bytes.
//   [free_offset, ...)     per call: C * R * cap uint64 "slot free" words; word (c, d, k) is written by
//                          rank d's receiver when slot k of ring (c, me) in d's buffer may be reused.
//   [done_offset, ...)     dispatch only, right after the free words: R * 2C uint64 done words; word (s, b)
//                          is written by block b of rank s when all it sends is written (direct mode).
//   notify area            the notify kernel uses the start of the ring region for the counts each
//                          source sends: R records of notify_stride ints.
//
// Slot: [uint64 flag][int32 source token][int32 unused][payload at 16-byte aligned offsets].
// The flag of the slot holding the i-th token (per channel and source) of the kernel with sequence
// number q is (q << 32) | i. The "slot free" word that lets token i (i >= cap) use slot i % cap holds
// (q << 32) | i. Tags include q, so nothing is ever re-zeroed: a value left by an earlier kernel never
// equals a value waited for now.
//
// Ordering rules that keep this safe across calls:
//   * A kernel writes into a peer's ring/free/notify areas only after that peer's arrive word reached
//     the kernel's sequence number (the peer finished its earlier kernels), or after receiving data
//     of this kernel from that peer (which proves the same).
//   * Every remote write into a peer's data region is waited for by the peer within the same kernel
//     (free words are written only when the sender will need them), so no write of an old kernel
//     can land in a region the next kernel lays out differently.
//   * Sequence numbers live in device memory and advance inside the kernels, so CUDA graphs replay
//     correctly.
#pragma once

#include "common/nvrtc_compat.cuh"
#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "intranode/args.cuh"

namespace deepep_cupy::intranode {

// Bytes of a ring slot's header, [uint64 flag][int32 source token][int32 unused]; the payload follows
// (deepep_cupy/ops/intranode/buffer_map.py reads this value).
constexpr int kSlotHeaderBytes = 16;

// Op codes of the error record (names in deepep_cupy/ops/intranode/engine.py).
enum OpCode : int {
    kOpNotifyArrive = 1,
    kOpNotifyCounts = 2,
    kOpDispatchArrive = 3,
    kOpDispatchSlot = 4,
    kOpDispatchRecv = 5,
    kOpDispatchOverflow = 6,
    kOpCombineArrive = 7,
    kOpCombineSlot = 8,
    kOpCombineRecv = 9,
    kOpCombineCopyRecv = 10,
    kOpCombineCopyDone = 11,
};

// ---- control words -----------------------------------------------------------------------------

struct Ctrl {
    uint64_t* words;  // this rank's buffer, viewed as uint64
    int num_ranks;

    __device__ __forceinline__ uint64_t* arrive(int src) const { return words + src; }
    __device__ __forceinline__ uint64_t* notify_flag(int src) const { return words + num_ranks + src; }
    __device__ __forceinline__ uint64_t* local_seq() const { return words + 2 * num_ranks; }
    __device__ __forceinline__ unsigned int* done_count() const {
        return reinterpret_cast<unsigned int*>(words + 2 * num_ranks + 1);
    }
    // Direct dispatch: where rank src's outputs of its running kernel are (dispatch_direct.cuh).
    __device__ __forceinline__ uint64_t* dest(int src) const { return words + 2 * num_ranks + 2 + 8 * src; }
    // Combine copy mode (combine_copy.cu).
    __device__ __forceinline__ uint64_t* copy_flag(int src) const { return words + 10 * num_ranks + 2 + src; }
    __device__ __forceinline__ uint64_t* copy_done(int src) const { return words + 11 * num_ranks + 2 + src; }
};

__device__ __forceinline__ uint8_t* rank_base(const long long* bases, int r) {
    return reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(bases[r]));
}

__device__ __forceinline__ Ctrl ctrl_of(uint8_t* base, int num_ranks) {
    return Ctrl{reinterpret_cast<uint64_t*>(base), num_ranks};
}

__device__ __forceinline__ uint64_t tag(uint64_t seq, int i) {
    return (seq << 32) | static_cast<uint64_t>(static_cast<uint32_t>(i));
}

// Sequence number of the running kernel: one more than the last one. Every block reads it at its start;
// the last block to finish publishes it (see end_kernel), so all blocks read the same value.
__device__ __forceinline__ uint64_t begin_kernel(const Ctrl& ctrl) {
    __shared__ uint64_t seq_shared;
    if (threadIdx.x == 0) seq_shared = static_cast<uint64_t>(ld_volatile(reinterpret_cast<const int64_t*>(ctrl.local_seq()))) + 1;
    __syncthreads();
    return seq_shared;
}

// `counters` (n ints, optional): per-kernel work counters, back to 0 for the next kernel once every block is done.
// `on_last` runs on thread 0 of the last block to finish, before the kernel's sequence number is published
// (a kernel that must hear from its peers before it ends waits there).
template <typename OnLast>
__device__ __forceinline__ void end_kernel(const Ctrl& ctrl, uint64_t seq, int* counters, int n, OnLast on_last) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned int old = atomicAdd(ctrl.done_count(), 1u);
        if (old + 1 == gridDim.x) {
            on_last();
            // Every block has read local_seq already (they all passed begin_kernel before counting).
            *ctrl.done_count() = 0;
            for (int i = 0; i < n; ++i) counters[i] = 0;
            *reinterpret_cast<volatile unsigned long long*>(ctrl.local_seq()) = static_cast<unsigned long long>(seq);
            __threadfence();
        }
    }
}

__device__ __forceinline__ void end_kernel(const Ctrl& ctrl, uint64_t seq, int* counters = nullptr, int n = 0) {
    end_kernel(ctrl, seq, counters, n, [] {});
}

// Tell every rank (self included) that this rank has started the kernel with sequence number seq.
__device__ __forceinline__ void announce_arrival(const long long* bases, int num_ranks, int rank, uint64_t seq) {
    for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) {
        Ctrl peer = ctrl_of(rank_base(bases, r), num_ranks);
        st_release_sys(peer.arrive(rank), seq);
    }
}

// ---- bounded waits -----------------------------------------------------------------------------

struct WaitCtx {
    ErrorRecord* err;
    long long budget_ns;
    int rank;
};

// The deadline check of every wait below, done by one thread every 64 polls: true when the wait must
// end, either past the budget (reported here, naming `peer`) or because another thread already reported
// a timeout (read every 4096 polls only: the record is host-mapped). `start` is the first check's time.
__device__ __forceinline__ bool wait_expired(unsigned int spin, uint64_t& start, const WaitCtx& w, int op, int peer,
                                             int line) {
    const uint64_t now = globaltimer();
    if (start == 0) start = now;
    const long long waited = static_cast<long long>(now - start);
    if (waited > w.budget_ns) {
        report_timeout(w.err, op, w.rank, peer, line, waited);
        return true;
    }
    return (spin & 4095u) == 0 && timeout_reported(w.err);
}

// Warp-wide wait until *flag satisfies pred (every lane polls with an acquire load, so every lane's later
// loads are ordered after it). Returns false on timeout (reported) or when another thread reported one.
// Must be called by all 32 lanes.
template <typename Pred>
__device__ __forceinline__ bool warp_wait(const uint64_t* flag, Pred pred, const WaitCtx& w, int op, int peer,
                                          int line) {
    uint64_t start = 0;
    for (unsigned int spin = 1;; ++spin) {
        const uint64_t v = ld_acquire_sys(flag);
        if (__all_sync(kFullMask, pred(v))) return true;
        if ((spin & 63u) == 0) {
            const int give_up = lane_id() == 0 && wait_expired(spin, start, w, op, peer, line);
            if (__shfl_sync(kFullMask, give_up, 0)) return false;
        }
    }
}

// Warp-wide wait where every lane watches its own flag (nullptr: nothing to wait for) until it equals
// that lane's `want`; `peer` is the lane's peer rank for the timeout report (the first lane still waiting
// is reported). Lets one warp wait for a run of slots at once instead of one round trip per slot.
__device__ __forceinline__ bool warp_wait_lanes(const uint64_t* flag, uint64_t want, int peer, const WaitCtx& w,
                                                int op, int line) {
    uint64_t start = 0;
    for (unsigned int spin = 1;; ++spin) {
        const bool done = flag == nullptr || ld_acquire_sys(flag) == want;
        const unsigned int waiting = __ballot_sync(kFullMask, !done);
        if (waiting == 0u) return true;
        if ((spin & 63u) == 0) {
            const int first = __ffs(waiting) - 1;
            const int first_peer = __shfl_sync(kFullMask, peer, first);
            const int give_up = lane_id() == 0 && wait_expired(spin, start, w, op, first_peer, line);
            if (__shfl_sync(kFullMask, give_up, 0)) return false;
        }
    }
}

// Single-thread variant (notify kernel).
template <typename Pred>
__device__ __forceinline__ bool thread_wait(const uint64_t* flag, Pred pred, const WaitCtx& w, int op, int peer,
                                            int line) {
    uint64_t start = 0;
    for (unsigned int spin = 1;; ++spin) {
        if (pred(ld_acquire_sys(flag))) return true;
        if ((spin & 63u) == 0 && wait_expired(spin, start, w, op, peer, line)) return false;
    }
}

// ---- batched publishing -------------------------------------------------------------------------

// Largest run of tokens published with one fence: at most 32 (one lane per flag) and at most
// ceil(cap / 2), so that a sender waiting for a free slot never waits for a token of its own unpublished
// run (see the deadlock note in dispatch.cu). The host clamps the same way (intranode.publish_batch).
__device__ __forceinline__ int clamp_batch(int batch, int cap) {
    return max(1, min(batch, min(32, (cap + 1) / 2)));
}

// Release the flags of `len` (<= 32) slots: after every lane's stores to them (ordered by __syncwarp),
// one system-scope fence for the warp, then lane j stores `tag(seq, first + j)` into the flag of slot
// (first + j) % cap. Same guarantee as a release store per slot, one fence instead of `len`.
__device__ __forceinline__ void publish_run(uint8_t* ring, long long slot_bytes, int cap, uint64_t seq, int first,
                                            int len, int lane) {
    __syncwarp();
    fence_acq_rel_sys();
    if (lane < len) {
        const int idx = first + lane;
        st_relaxed_sys(reinterpret_cast<uint64_t*>(ring + static_cast<long long>(idx % cap) * slot_bytes),
                       tag(seq, idx));
    }
    __syncwarp();
}

// ---- copies and work split ---------------------------------------------------------------------

// A warp copy of n int4 in rounds: kUnroll loads per lane (load(j) for int4 j) issued before the round's stores
// (store(base, v), v[u] being int4 base + 32 u + lane when below n), so a warp keeps 32 * kUnroll * 16 bytes in
// flight. The stores go to one place (store_round) or to several (a token fanned out to its ranks).
template <int kUnroll, class Load, class Store>
__device__ __forceinline__ void warp_copy_rounds(int n, int lane, Load&& load, Store&& store) {
    for (int base = 0; base < n; base += 32 * kUnroll) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int j = base + u * 32 + lane;
            if (j < n) v[u] = load(j);
        }
        store(base, v);
    }
}

// The stores of one round of warp_copy_rounds into dst.
template <int kUnroll>
__device__ __forceinline__ void store_round(int4* __restrict__ dst, int base, int n, const int4 (&v)[kUnroll],
                                            int lane) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int j = base + u * 32 + lane;
        if (j < n) st_na_v4(dst + j, v[u]);
    }
}

// Warp copy of n int4 from memory that does not change during the kernel (user inputs) to dst.
template <int kUnroll>
__device__ __forceinline__ void warp_copy_nc(int4* __restrict__ dst, const int4* __restrict__ src, int n, int lane) {
    warp_copy_rounds<kUnroll>(n, lane, [&](int j) { return ld_nc_v4(src + j); },
                              [&](int base, const int4 (&v)[kUnroll]) { store_round<kUnroll>(dst, base, n, v, lane); });
}

// Same, reading a ring slot (coherent L2 loads).
template <int kUnroll>
__device__ __forceinline__ void warp_copy_ring(int4* __restrict__ dst, const int4* __restrict__ src, int n, int lane) {
    warp_copy_rounds<kUnroll>(n, lane, [&](int j) { return ld_cg_v4(src + j); },
                              [&](int base, const int4 (&v)[kUnroll]) { store_round<kUnroll>(dst, base, n, v, lane); });
}

// Token range [begin, end) of channel c: contiguous ranges of ceil(N / C) tokens.
__device__ __forceinline__ void channel_range(int num_tokens, int num_channels, int c, int& begin, int& end) {
    const int per = (num_tokens + num_channels - 1) / num_channels;
    begin = min(per * c, num_tokens);
    end = min(begin + per, num_tokens);
}

// Where channel c of row `row` starts in an inclusive channel prefix matrix [rows, C]: the entry before it, 0
// for the first channel.
__device__ __forceinline__ int channel_start(const int* matrix, int row, int C, int c) {
    return c > 0 ? matrix[row * C + c - 1] : 0;
}

// Split `num_warps` warps into `groups` groups as evenly as possible; returns the group of `warp` and its
// index/size within the group.
__device__ __forceinline__ void split_warps(int warp, int num_warps, int groups, int& group, int& index, int& size) {
    const int base = num_warps / groups, extra = num_warps % groups;
    // The first `extra` groups get base + 1 warps.
    const int big = extra * (base + 1);
    if (warp < big) {
        group = warp / (base + 1);
        index = warp % (base + 1);
        size = base + 1;
    } else {
        group = extra + (warp - big) / base;
        index = (warp - big) % base;
        size = base;
    }
}

}  // namespace deepep_cupy::intranode

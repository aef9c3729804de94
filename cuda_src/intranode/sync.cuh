// Shared helpers of the intranode kernels for working with their peers: per-kernel sequence numbers
// (begin_kernel, end_kernel, announce_arrival), bounded waits on flag words, and batched publishing of
// ring slots. The words they read and write are laid out in buffer_map.cuh.
#pragma once

#include "common/nvrtc_compat.cuh"
#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "intranode/buffer_map.cuh"

namespace deepep_cupy::intranode {

// ---- sequence numbers --------------------------------------------------------------------------

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

}  // namespace deepep_cupy::intranode

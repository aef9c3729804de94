// Shared helpers of the internode normal kernels for working with their peers: waits for progress words
// (warp-wide, and for a word of shared memory), publishing slots and giving them back, the put-with-signal
// over NVSHMEM, and the wait profile of diagnostics builds (DEEPEP_CUPY_WAIT_PROFILE). The words are laid
// out in buffer_map.cuh; the bounded waits underneath are the intranode ones (intranode/sync.cuh).
#pragma once

#include "common/nvrtc_compat.cuh"
#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "intranode/sync.cuh"
#include "common/nvshmem_includes.cuh"

namespace deepep_cupy::internode {

using intranode::thread_wait;
using intranode::WaitCtx;
using intranode::warp_wait;

#if DEEPEP_CUPY_WAIT_PROFILE
// Diagnostics only (tools/internode_waits.py builds with DEEPEP_CUPY_WAIT_PROFILE=1): by op code - 400 and side
// (0: RDMA senders / the combine's first side, NVLink senders or L == 1 forwarders; 1: receivers / forwarders
// and reducers), the nanoseconds warps waited, the waits that found their word short, the waits that did not;
// slot 31: warps' time in their role, and warps. Summed over every launch since the module was loaded (the
// tool zeroes it).
extern "C" {
__device__ unsigned long long deepep_cupy_internode_waits[32][2][3];
}
// Bit w: warp w of this block has a receiving role (set by its WarpClock before any wait).
__shared__ unsigned deepep_cupy_receiving_warps;
__device__ __forceinline__ void count_wait(int op, int slot, unsigned long long value) {
    if ((threadIdx.x & 31) == 0) {
        const int side = (deepep_cupy_receiving_warps >> (threadIdx.x / 32)) & 1;
        atomicAdd(&deepep_cupy_internode_waits[(op - 400) & 31][side][slot], value);
    }
}
#endif

// The smallest of the lanes' values (the same in every lane).
__device__ __forceinline__ uint64_t warp_min(uint64_t v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = min(v, __shfl_xor_sync(kFullMask, v, off));
    return v;
}

// Warp-wide acquire load of a progress word: a value every lane has read at least, so every lane's later
// accesses are ordered after the write that published it. A caller may keep it and trust it for as long as it
// suffices (progress words only grow), reading the word again only when it falls short.
__device__ __forceinline__ uint64_t warp_acquire(const uint64_t* word) { return warp_min(ld_acquire_sys(word)); }

// Warp-wide wait for a progress word to reach `want`; returns a value every lane has seen (0 on timeout/abort,
// with *ok cleared). Every lane reads with acquire semantics, so later loads see what the word publishes.
__device__ __forceinline__ uint64_t wait_at_least(const uint64_t* word, uint64_t want, const WaitCtx& w, int op,
                                                  int peer, int line, bool* ok) {
    if (!*ok) return 0;
    const uint64_t now = ld_acquire_sys(word);
    if (__all_sync(kFullMask, now >= want)) {
#if DEEPEP_CUPY_WAIT_PROFILE
        count_wait(op, 2, 1);
#endif
        return warp_min(now);
    }
#if DEEPEP_CUPY_WAIT_PROFILE
    const uint64_t t0 = globaltimer();
#endif
    if (!warp_wait(word, [want](uint64_t v) { return v >= want; }, w, op, peer, line)) {
        *ok = false;
        return 0;
    }
#if DEEPEP_CUPY_WAIT_PROFILE
    count_wait(op, 0, globaltimer() - t0);
    count_wait(op, 1, 1);
#endif
    return warp_acquire(word);
}

// Warp-wide: make sure `word` has reached `need`. `seen` is the last value this warp acquired from it (0: none)
// and is trusted while it suffices; otherwise the word is read again, and only if the fresh value is short too
// does the warp run `before_wait` (hand over or give back what the peer may be waiting for: publishing drains
// this warp's stores, so doing it on every call would serialize the rows) and wait. Returns a value every lane
// has seen (0 on timeout/abort, with *ok cleared; nothing runs once *ok is clear).
template <class BeforeWait>
__device__ __forceinline__ uint64_t wait_reaching(const uint64_t* word, uint64_t need, uint64_t seen,
                                                  BeforeWait&& before_wait, const WaitCtx& w, int op, int peer,
                                                  int line, bool* ok) {
    if (!*ok) return 0;
    if (seen >= need) return seen;
    seen = warp_acquire(word);
    if (seen >= need) return seen;
    before_wait();
    return wait_at_least(word, need, w, op, peer, line, ok);
}

// Diagnostics: a warp's time in its role, from construction to stop() (nothing without the define).
struct WarpClock {
#if DEEPEP_CUPY_WAIT_PROFILE
    uint64_t start;
    __device__ __forceinline__ explicit WarpClock(bool sending) : start(globaltimer()) {
        if ((threadIdx.x & 31) == 0) {
            const unsigned bit = 1u << (threadIdx.x / 32);
            if (sending)
                atomicAnd(&deepep_cupy_receiving_warps, ~bit);
            else
                atomicOr(&deepep_cupy_receiving_warps, bit);
        }
        __syncwarp();
    }
    __device__ __forceinline__ void stop() const {
        count_wait(400 + 31, 0, globaltimer() - start);
        count_wait(400 + 31, 1, 1);
    }
#else
    __device__ __forceinline__ explicit WarpClock(bool) {}
    __device__ __forceinline__ void stop() const {}
#endif
};

// Diagnostics: one warp's time in its role cut into phases, one counter each (PhaseCode; names in
// tools/internode_waits.py): lap(code) charges the time since the previous lap to that phase. The clock reads
// no memory, so a phase ends when the warp has issued its stores, and the fence that drains them is charged
// to the phase holding it.
struct PhaseClock {
#if DEEPEP_CUPY_WAIT_PROFILE
    uint64_t last;
    __device__ __forceinline__ PhaseClock() : last(globaltimer()) {}
    __device__ __forceinline__ void lap(int code) {
        const uint64_t now = globaltimer();
        count_wait(code, 0, now - last);
        count_wait(code, 1, 1);
        last = now;
    }
#else
    __device__ __forceinline__ void lap(int) {}
#endif
};

// What shared_wait returns when its wait ran out (reported).
constexpr int kWaitExpired = -0x7fffffff - 1;

// Warp-wide wait for a word of shared memory that another warp of the block sets (lane 0 reads it for the
// warp) until ready(value) holds, calling between(spin) after each read that finds it short. Returns that
// value, its later reads ordered after it (block-scope fence), or kWaitExpired when the wait ran out (every 64
// reads the deadline is checked; the report names op `op` and this rank).
template <typename Ready, typename Between>
__device__ __forceinline__ int shared_wait(const volatile int* word, Ready ready, Between between, const WaitCtx& w,
                                           int op, int line, int lane) {
    uint64_t start = 0;
    for (unsigned int spin = 1;; ++spin) {
        const int v = __shfl_sync(kFullMask, lane == 0 ? *word : 0, 0);
        if (ready(v)) {
            __threadfence_block();
            return v;
        }
        between(spin);
        if ((spin & 63u) == 0) {
            const int give_up = lane == 0 && wait_expired(spin, start, w, op, w.rank, line);
            if (__shfl_sync(kFullMask, give_up, 0)) return kWaitExpired;
        }
    }
}

// Slots a ring's writer hands over per system-scope fence (and its reader hands back per store); every wait
// publishes (gives back) first.
constexpr int kPublishBatch = 8;

// Giving slots back to their writer takes no fence: the reader's lanes have met after using every value they
// loaded from those slots (stored or summed it), so each load has returned before the word can change, and
// nothing else the reader wrote has to reach the writer. A fence would also wait for the reader's own output
// stores to land, microseconds a row of the dispatch's L == 1 forwarder and a token of the combine's
// reducers. Hand-backs are relaxed stores of a count, or signal ADDs that commute;
// a SET through the NVSHMEM API still goes behind nvshmem_fence, since two SETs must land in order.
__device__ __forceinline__ void give_back_store(uint64_t* writer_word, uint64_t count) {
    st_relaxed_sys(writer_word, count);
}

// Publish, to a peer reachable by stores (an RDMA peer over NVLink or P2P, or a rank of the domain),
// everything this warp wrote so far: the lanes meet, a system-scope fence, then lane 0 stores the tail value
// into the peer's word (the reader acquires it). Fence and store make a release, so the store itself is
// relaxed: a release store would fence a second time.
__device__ __forceinline__ void publish_p2p(uint64_t* peer_word, uint64_t value, int lane) {
    __syncwarp();
    fence_acq_rel_sys();
    if (lane == 0) st_relaxed_sys(peer_word, value);
    __syncwarp();
}

// Warp-collective put of `bytes` from local symmetric `src` to `dst` on `pe`, then a signal op on `sig`.
// NVSHMEM's shipped device library has no put-with-signal for NVRTC builds, so the signal is a separate
// op behind nvshmem_fence, which orders it after this and every earlier put to that PE: a reader that
// sees the signal may read all of it. Lanes' stores into `src` are made visible first.
__device__ __forceinline__ void put_signal_warp(void* dst, const void* src, size_t bytes, uint64_t* sig,
                                                uint64_t value, int op, int pe, int lane) {
    __threadfence_system();
    __syncwarp();
    nvshmemx_putmem_nbi_warp(dst, src, bytes, pe);
    __syncwarp();
    if (lane == 0) {
        nvshmem_fence();
        nvshmemx_signal_op(sig, value, op, pe);
    }
    __syncwarp();
}

}  // namespace deepep_cupy::internode

// Shared pieces of the internode normal kernels (groups of several NVLink domains): buffer maps,
// progress counters, bounded waits. Design: docs/design/internode.md; the host computes every offset in
// deepep_cupy/ops/internode/buffer_map.py and passes it as an argument.
//
// Topology: L = kNumNvlRanks ranks per domain, D = kNumDomains domains, rank r is local rank r % L of
// domain r / L. A token of source (d_s, l) bound for domain d crosses RDMA once, to the forwarder (d, l),
// which copies it over NVLink to each of its destinations in d.
//
// RDMA buffer (symmetric, same offsets on every PE), ring i = c * D + d:
//   meta  int32 [2][C*D][2L+2] at 0 (half 0: local staging of what is put, half 1: what peers put)
//   ring  slots [2][C*D][Rt] at ring_offset (same two halves)
// Ring i of PE X is written only by PE (d, l_X) (dispatch: that source; combine: that forwarder), so one
// writer and one reader per ring, in dispatch and combine alike. Ring (c, d_me) of each PE (its own rows) is
// not used by the dispatch: its forwarders read those rows from x (send_own with L == 1, OwnTokens with more).
// With L == 1 the combine's reducer reads x directly too, so the ring is not used at all; with more the
// combine's partials of the own domain pass through it. An op that skips the ring touches neither its words
// nor its `state` counts, so both sides still agree.
// Signal allocation (symmetric, small): uint64 tail[kMaxChannels*D], head[kMaxChannels*D],
// notify[D], then the notify records int32 [2][D][record_stride].
// NVLink buffer of each domain rank (peers reached through `nvl_bases`), ring k = c * L + l:
//   uint64 nvl_tail[kMaxChannels*L], nvl_head[kMaxChannels*L], nvl_notify_flag[L] at 0,
//   nvl meta int32 [C][L][D][2] at nvl_meta_offset, ring [C*L][Rn] slots at nvl_ring_offset,
//   notify records int32 [L][nvl_record_stride] at nvl_notify_offset.
//
// Progress words never go back to zero, so nothing has to be cleaned between ops and CUDA graphs replay
// correctly. Each ring counts "units" for ever: one for its meta record, then one per slot. Writer and
// reader each keep, in local device memory (`state`), how many units passed through the ring before this
// op; the two counts are equal when an op starts, since every op drains every ring it uses. The writer
// SETs tail = base + units written (monotonic: one writer, fenced); the reader returns head = base + units
// released (RDMA: ADDs of the increments, since several forwarder warps release; NVLink: stores by one
// warp). A writer touches a slot (or the meta) only once head shows the previous user of that memory
// released it, which also keeps a fast peer's next op off a slow peer's current one.
#pragma once

#include "common/nvrtc_compat.cuh"
#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "internode/args.cuh"
#include "intranode/buffer_map.cuh"
#include "common/nvshmem_includes.cuh"

namespace deepep_cupy::internode {

using intranode::channel_range;
using intranode::channel_start;  // of entries 1, 2 and 3
using intranode::thread_wait;
using intranode::WaitCtx;
using intranode::warp_wait;

// Op codes of the error record (names in deepep_cupy/ops/internode/engine.py).
enum OpCode : int {
    kOpNotifyRdma = 401,      // forwarder waiting for a source domain's counts (RDMA signal)
    kOpNotifyNvl = 402,       // rank waiting for a forwarder of its domain (NVLink flag)
    kOpDispatchHead = 403,    // RDMA sender waiting for the forwarder to free slots
    kOpDispatchTail = 404,    // forwarder waiting for RDMA slots
    kOpDispatchNvlHead = 405, // forwarder waiting for NVLink ring space
    kOpDispatchNvlTail = 406, // NVLink receiver waiting for rows
    kOpDispatchOverflow = 407,
    kOpCombineNvlHead = 408,  // rank waiting for NVLink ring space at a forwarder
    kOpCombineNvlTail = 409,  // forwarder waiting for rows of a domain rank
    kOpCombineHead = 410,     // forwarder waiting for the source to free RDMA slots
    kOpCombineTail = 411,     // source waiting for a domain's partial sums
    kOpDispatchHelper = 425,  // helper warp of a forwarder waiting for that forwarder's word (rows in place)
    kOpCombinePartner = 426,  // combine forwarder waiting for its partner warp's half rows
};

// Channels the progress words are sized for (Config.num_sms / 2 never reaches it on current GPUs).
constexpr int kMaxChannels = 256;

// Slot header (first 16 bytes of every ring slot, RDMA and NVLink).
struct SlotHeader {
    int src_domain;  // SourceMeta.src_domain
    int bits;        // SourceMeta bits: destinations in the target domain
    int token;       // source token index (debugging aid)
    int unused;
};
// Bytes of a slot's header; the row follows (deepep_cupy/ops/internode/buffer_map.py reads this value).
constexpr int kSlotHeaderBytes = 16;
static_assert(sizeof(SlotHeader) == kSlotHeaderBytes, "the slot header is kSlotHeaderBytes");

// Persistent per-rank counters (int64, local memory), see the header comment.
struct State {
    long long* words;
    __device__ __forceinline__ long long* notify_seq() const { return words; }
    __device__ __forceinline__ long long* rdma_sent(int i) const { return words + 8 + i; }
    __device__ __forceinline__ long long* rdma_recvd(int i, int num_domains) const {
        return words + 8 + kMaxChannels * num_domains + i;
    }
    __device__ __forceinline__ long long* nvl_sent(int k, int num_domains) const {
        return words + 8 + 2 * kMaxChannels * num_domains + k;
    }
    __device__ __forceinline__ long long* nvl_recvd(int k, int num_domains, int num_nvl) const {
        return words + 8 + 2 * kMaxChannels * num_domains + kMaxChannels * num_nvl + k;
    }
};

// Signal allocation words.
struct Signals {
    uint8_t* base;
    int num_domains;
    __device__ __forceinline__ uint64_t* tail(int i) const { return reinterpret_cast<uint64_t*>(base) + i; }
    __device__ __forceinline__ uint64_t* head(int i) const {
        return reinterpret_cast<uint64_t*>(base) + kMaxChannels * num_domains + i;
    }
    __device__ __forceinline__ uint64_t* notify(int d) const {
        return reinterpret_cast<uint64_t*>(base) + 2 * kMaxChannels * num_domains + d;
    }
};

// NVLink control words of one rank's NVLink buffer.
struct NvlCtrl {
    uint8_t* base;
    int num_nvl;
    __device__ __forceinline__ uint64_t* tail(int k) const { return reinterpret_cast<uint64_t*>(base) + k; }
    __device__ __forceinline__ uint64_t* head(int k) const {
        return reinterpret_cast<uint64_t*>(base) + kMaxChannels * num_nvl + k;
    }
    __device__ __forceinline__ uint64_t* notify_flag(int l) const {
        return reinterpret_cast<uint64_t*>(base) + 2 * kMaxChannels * num_nvl + l;
    }
};

__device__ __forceinline__ uint8_t* nvl_base(const long long* bases, int l) {
    return reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(bases[l]));
}

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

// Phase codes of PhaseClock (between the op codes 401-411 and 425-426, below the role clock's 431).
enum PhaseCode : int {
    kPhaseSendExtras = 412, kPhaseSendCopy, kPhaseSendMeta, kPhaseSendPublish,    // dispatch, RDMA sender
    kPhaseRecvWait = 416, kPhaseRecvStore, kPhaseRecvRelease,                    // dispatch, L == 1 forwarder
    kPhaseFwdPosition = 419, kPhaseFwdCopy, kPhaseFwdPublish,                    // combine forwarder
    kPhaseRedWait = 422, kPhaseRedSum, kPhaseRedRelease,                         // combine reducer
};

// Which block of an SM pair runs the sending side of channel `sub` of the pair's S (dispatch: the RDMA
// senders; combine: with L == 1 the forwarders, with more the NVLink senders and the reducers), the other
// block its receiving side: alternating by channel, so that each SM carries both sides' bytes instead of one
// SM of the pair waiting for the other (docs/design/internode_measurements.md, "Sides alternating by channel").
__device__ __forceinline__ bool sends_here(int sub) { return ((blockIdx.x ^ static_cast<unsigned>(sub)) & 1) == 0; }

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

// Warps of one channel in a dispatch block (a sender per domain, or a forwarder and a receiver per local
// rank; with L == 1 one warp forwards straight into the outputs) and in a combine block (an NVLink sender per
// (domain, other local rank) and a reducer per domain, or a forwarder pair per domain: L * D >= 2 * D; with
// L == 1 there are no NVLink senders, so the forwarders take one block and the D reducers the other). A block
// runs several consecutive channels side by side: every role of a channel is one warp moving one row at a
// time, so more channels per SM is what keeps more bytes in flight. By default blocks stay within 768 threads
// (80 registers a thread) with one rank a domain, or 1024 on few SMs, and within 512 (128 registers) with more
// (sub_channels in ops/internode/buffer_map.py).
constexpr int dispatch_channel_warps(int L, int D) { return D > 2 * L ? D : 2 * L; }
constexpr int combine_channel_warps(int L, int D) { return L == 1 ? D : L * D; }
// Registers a thread of a combine block of S channels may hold (what a loop may keep in flight).
constexpr int combine_registers(int L, int D, int S) {
    const int registers = 65536 / (32 * combine_channel_warps(L, D) * S);
    return registers > 255 ? 255 : registers;
}

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

// Warp copies of `n` int4. Each lane keeps kCopyUnroll loads in flight before it stores: one load at a time
// leaves a warp latency-bound at about 1 GB/s, far below what one warp can move. A short last batch loads its
// missing words from the last one (clamped addresses, stored nowhere) instead of looping one word at a time or
// predicating loads (which spills at 80 registers): a BF16 row of 7168 is then two batches a lane, not 13
// round trips, and an FP8 row one.
constexpr int kCopyUnroll = 16;

// The dispatch's loads a lane in flight by its block's warps: in 1024-thread blocks a thread has 64 registers,
// which sixteen int4 would fill alone, so 14 there (a row of 7168 is still two batches in BF16 and one in FP8,
// and the copies spill less); 8 measured slower, and the combine's one-row copy keeps 16
// (docs/design/internode_measurements.md).
constexpr int dispatch_copy_unroll(int warps) { return warps >= 32 ? 14 : kCopyUnroll; }

template <bool kL2Only, int U>
__device__ __forceinline__ void warp_copy(int4* __restrict__ dst, const int4* __restrict__ src, int n, int lane) {
    for (int j = lane; j < n; j += U * 32) {
        int4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = min(j + u * 32, n - 1);  // past the end: reload the last word (not stored)
            v[u] = kL2Only ? ld_cg_v4(src + k) : ld_nc_v4(src + k);
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (j + u * 32 < n) st_na_v4(dst + j + u * 32, v[u]);
    }
}

// `src` may be rewritten by peers later (a ring slot), so loads go to L2 only.
template <int U = kCopyUnroll>
__device__ __forceinline__ void warp_copy_cg(int4* __restrict__ dst, const int4* __restrict__ src, int n, int lane) {
    warp_copy<true, U>(dst, src, n, lane);
}

// `src` is read-only for the whole kernel (the caller's tokens).
template <int U = kCopyUnroll>
__device__ __forceinline__ void warp_copy_nc(int4* __restrict__ dst, const int4* __restrict__ src, int n, int lane) {
    warp_copy<false, U>(dst, src, n, lane);
}

// The sum of an inclusive prefix's entries before entry k: where k's rows start among those it counts (a rank's
// or domain's first row in entry 4 or 6).
__device__ __forceinline__ int prefix_before(const int* inclusive, int k) { return k > 0 ? inclusive[k - 1] : 0; }

}  // namespace deepep_cupy::internode

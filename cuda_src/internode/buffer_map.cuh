// The internode normal kernels' buffer maps (groups of several NVLink domains): the RDMA buffer, the signal
// allocation, the NVLink buffers and their progress words, the slot header and the persistent counters
// (State); with them what else the host mirrors: the op and phase codes of the error record and the wait
// profile, and the warps of a channel. Design: docs/design/internode.md; the host computes every offset in
// deepep_cupy/ops/internode/buffer_map.py and passes it as an argument. The kernels' shared helpers are in
// sync.cuh (waits, publishing, the wait profile) and copies.cuh (row copies and the split of the work).
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

namespace deepep_cupy::internode {

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

// Phase codes of PhaseClock (sync.cuh; between the op codes 401-411 and 425-426, below the role clock's 431).
enum PhaseCode : int {
    kPhaseSendExtras = 412, kPhaseSendCopy, kPhaseSendMeta, kPhaseSendPublish,    // dispatch, RDMA sender
    kPhaseRecvWait = 416, kPhaseRecvStore, kPhaseRecvRelease,                    // dispatch, L == 1 forwarder
    kPhaseFwdPosition = 419, kPhaseFwdCopy, kPhaseFwdPublish,                    // combine forwarder
    kPhaseRedWait = 422, kPhaseRedSum, kPhaseRedRelease,                         // combine reducer
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

}  // namespace deepep_cupy::internode

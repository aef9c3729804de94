// The intranode (NVLink) buffer map: how the NVL buffer of every rank is carved, the format of its
// flag words, the control words (Ctrl) and the op codes of the error record. The kernels' shared
// helpers are in sync.cuh (sequence numbers, bounded waits, batched publishing) and copies.cuh (warp
// copies and the split of the work over channels and warps).
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

// The tag of the i-th token of the kernel with sequence number seq, as its slot flag and "slot free" word
// carry it (see "Slot:" above).
__device__ __forceinline__ uint64_t tag(uint64_t seq, int i) {
    return (seq << 32) | static_cast<uint64_t>(static_cast<uint32_t>(i));
}

}  // namespace deepep_cupy::intranode

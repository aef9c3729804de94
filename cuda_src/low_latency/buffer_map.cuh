// Low-latency kernels: the buffer map, the completion protocol and the format of its tag words, and the
// limits, phases and op codes the host mirrors. The helpers shared by dispatch.cu and combine.cu are in
// sync.cuh (sequence numbers, the launch prologue, waits, grid completion) and indexing.cuh (where a
// thread, an item or a row goes, block scans); the BF16 / FP8 row codecs and copies are in rows.cuh, LogFMT
// in logfmt.cuh.
//
// Buffer map (byte offsets are computed on the host, deepep_cupy/ops/low_latency/buffer_map.py, and the
// kernels receive the local address of every region of the half they use):
//   tags      uint32 [E]          (sequence tag << 16) | count, written by the sending rank
//   arrivals  uint64 [E]          put-with-signal counters (RMA path), or per-rank dispatch words
//                                 (dispatch_ranks.cuh)
//   receipts  uint32 [R]          the last receive each rank finished on its copy of this half
//                                 (receipts.cuh)
//   src_idx   int32  [E][T]       dispatch: source token of each received row
//   recv      [E][T] slots of 2H bytes
//   send      [E_local][R*T] rows of 2H bytes (combine), or [T] staged dispatch messages
// Dispatch addresses tags/arrivals/recv by u = local_expert * R + source_rank (one sender per u);
// combine addresses them by the global expert e (again one sender per e).
//
// Completion protocol (no flag is ever reset by the receiver):
//   * Every op on a buffer half carries a sequence number S (1, 2, ...), counted on the device by each
//     rank for each half and phase (claim_sequence), so it is the same on every rank and CUDA-graph
//     replays keep counting. Its 16-bit tag (S - 1) % 65535 + 1 is never 0.
//   * A sender finishes a slot by writing (tag << 16) | count into the receiver's tags[slot]. Over
//     NVLink (nvshmem_ptr != nullptr) the rows are plain stores and the tag is a release store after a
//     system fence, so the tag implies the rows. Over any other transport the warp that puts a row (and,
//     in the dispatch, its token id) follows it with nvshmem_fence and a signal add of 1 to
//     arrivals[slot] at the receiver, and the tag is an atomic set; the receiver waits for the tag and
//     then for arrivals[slot] to grow by the row count since the last op (tracked in a local base
//     array), so no ordering is assumed between different warps' operations.
//   * Readers compare the tag, so stale values from older ops are never mistaken for new ones, and any
//     number of readers may look at a tag. clean_low_latency_buffer zeroes tags, arrivals, bases and the
//     sequence counters on every rank together (and the receipts with them).
#pragma once

#include "common/nvrtc_compat.cuh"

namespace deepep_cupy::low_latency {

constexpr int kChannelsPerBlock = 128;
// Wire bytes of a LogFMT-10 block: 128 low code bytes, 128 x 2-bit high parts, float lo and step (byte
// order of a row: logfmt.cuh).
constexpr int kLogfmtBlockBytes = 8 + 128 + 32;
constexpr int kLogfmtLevels = 510;
// Token chunks of 32 tracked in shared memory: T <= 8192.
constexpr int kMaxTokenChunks = 256;
// Mask snapshot in shared memory.
constexpr int kMaxRanks = 1024;
// The combine's receive phase keeps one "arrived" bit per global expert in shared memory.
constexpr int kMaxExperts = 8192;

constexpr int kPhaseSend = 1;
constexpr int kPhaseRecv = 2;

// Op codes reported in the error record (mirrored in deepep_cupy/ops/low_latency/engine.py).
constexpr int kOpDispatchRecv = 201;
constexpr int kOpCombineRecv = 202;
constexpr int kOpCombineSend = 203;  // its sources' routes (partial sums), or an owner's receipt (receipts.cuh)
constexpr int kOpDispatchSend = 204;  // a destination's receipt (receipts.cuh)

__host__ __device__ constexpr int align16(int n) { return (n + 15) / 16 * 16; }

// ---- sequence tags ----------------------------------------------------------------------------------

// The 16-bit tag of sequence number s >= 1: never 0, so a zeroed word never matches.
__device__ __forceinline__ uint32_t seq_tag(uint32_t s) { return (s - 1u) % 65535u + 1u; }

__device__ __forceinline__ uint32_t tag_word(uint32_t tag, uint32_t payload) { return (tag << 16) | (payload & 0xffffu); }

}  // namespace deepep_cupy::low_latency

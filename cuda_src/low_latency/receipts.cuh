// Receipts: a send never overwrites a receive area that its owner has not read yet.
//
// A buffer half at rank r is written by its peers' sends and read by r's own receive, and the next call
// on that half (two calls later) writes it again. With hooks, sends and receives of one rank may be far
// apart: two calls in flight, compute between a send and its hook, ranks out of step. A peer that has
// received everything of call k + 1 may then reach its send of call k + 2 while r still has to read
// call k. So each receive, once its whole grid is done reading the half, leaves its sequence number in
// receipts[r] of every rank's copy of the half, and a send to rank d first waits until receipts[d]
// carries the sequence number of the previous call on the half (its own minus one: every call on a half
// claims one send and one receive number, the same on every rank).
//
// In the usual order (every rank receives call k before its send of call k + 2) the receipt is already
// there when the send starts: the wait is one load per destination. It waits only where the send would
// overwrite rows not yet read; a late peer's send never holds this rank's send, and neither does its
// compute before a hook as long as it called the hook of the call two back.
#pragma once

#include "common/nvshmem_includes.cuh"
#include "low_latency/sync.cuh"

namespace deepep_cupy::low_latency {

// Every thread of the block calls it, before the block writes to any rank (it ends with a block barrier).
// Thread i waits for the destinations i, i + blockDim.x, ... that are not masked; one that runs out is
// masked (shrink) or reported, as any wait for a peer is.
__device__ __forceinline__ void wait_receipts(const uint32_t* receipts, uint32_t send_seq, const int* s_mask,
                                              int num_ranks, bool self_masked, int* mask, bool shrink,
                                              ErrorRecord* err, int op, int rank, const Deadline& deadline) {
    const uint32_t need = send_seq - 1u;  // 0 before the first call on the half: a zeroed word passes
    for (int r = static_cast<int>(threadIdx.x); !self_masked && r < num_ranks; r += static_cast<int>(blockDim.x)) {
        if (s_mask[r] != 0) continue;
        // An acquire load first: the receipt is usually there, and then orders this block's writes after
        // the owner's reads with no fence. Otherwise relaxed polls and one fence, as every wait here.
        if (static_cast<int32_t>(ld_acquire_sys(receipts + r) - need) >= 0) continue;
        bool ok = false;
        for (uint32_t spin = 0;; ++spin) {
            if (static_cast<int32_t>(ld_relaxed_sys(receipts + r) - need) >= 0) {
                fence_acq_rel_sys();
                ok = true;
                break;
            }
            if (!poll_pause(spin, deadline, err, !shrink)) break;
        }
        if (!ok) peer_timed_out(mask, r, shrink, err, op, rank, __LINE__, deadline);
    }
    __syncthreads();
}

// End of a receive: every thread of every block calls it after its last read of the half. Once the whole
// grid is done (grid_completion, counter `done_counter`), the last block clears this rank's send count
// `sent` (when counted, else null) and leaves `recv_seq` in receipts[rank] of every unmasked rank's copy of
// the half: a release store where the rank is reached by stores, else an atomic set through the transport.
__device__ __forceinline__ void publish_receipts(uint32_t* receipts, uint32_t recv_seq, int num_ranks, int rank,
                                                 const int* s_mask, bool force_rma, uint32_t* done_counter,
                                                 int* s_last, uint32_t* sent) {
    grid_completion(done_counter, s_last);
    if (*s_last == 0) return;
    if (sent != nullptr) {
        // Cleared before any receipt is out: a source of the next call on the half counts itself only
        // after it has seen this receive's receipt. An atomic, at the same point as the sources' adds.
        if (threadIdx.x == 0) {
            atomicExch(sent, 0u);
            __threadfence_system();
        }
        __syncthreads();
    }
    for (int r = static_cast<int>(threadIdx.x); r < num_ranks; r += static_cast<int>(blockDim.x)) {
        if (s_mask[r] != 0) continue;
        uint32_t* peer = force_rma && r != rank ? nullptr : static_cast<uint32_t*>(nvshmem_ptr(receipts, r));
        if (peer != nullptr) {
            st_release_sys(peer + rank, recv_seq);
        } else {
            __threadfence_system();
            nvshmem_int_atomic_set(reinterpret_cast<int*>(receipts + rank), static_cast<int>(recv_seq), r);
        }
    }
}

// Send counts, for a receive launched before its hook (hook mode, count_sends): once the whole send grid
// is done, the last block adds 1 to `sent` of every unmasked rank's copy of the half, itself included. The
// host queues a stream memory wait (no SMs) for its own word to reach R, then the receive, which clears the
// word (publish_receipts). The count says only when to launch: the receive still waits for every tag and
// arrival itself, so an early or a forced release (the host's watchdog) costs time, never data.
__device__ __forceinline__ void count_send(uint32_t* sent, int num_ranks, int rank, const int* s_mask, bool self_masked,
                                           bool force_rma, uint32_t* done_counter, int* s_last) {
    grid_completion(done_counter, s_last);
    if (*s_last == 0 || self_masked) return;
    __threadfence_system();
    for (int r = static_cast<int>(threadIdx.x); r < num_ranks; r += static_cast<int>(blockDim.x)) {
        if (s_mask[r] != 0) continue;
        uint32_t* peer = force_rma && r != rank ? nullptr : static_cast<uint32_t*>(nvshmem_ptr(sent, r));
        if (peer != nullptr) {
            atomicAdd_system(peer, 1u);
        } else {
            nvshmem_quiet();  // the last block's puts; the others' puts the receive awaits by itself
            nvshmem_uint_atomic_add(reinterpret_cast<unsigned int*>(sent), 1u, r);
        }
    }
}

}  // namespace deepep_cupy::low_latency

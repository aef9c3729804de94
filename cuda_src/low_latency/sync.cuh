// Shared helpers of the low-latency kernels for working with their peers: the per-launch sequence numbers
// and the launch prologue, the waits for tags, arrival counters and ready words, and the end of a grid-wide
// phase. The words they read and the protocol they follow are described in buffer_map.cuh.
#pragma once

#include "common/nvrtc_compat.cuh"
#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "low_latency/buffer_map.cuh"

namespace deepep_cupy::low_latency {

// ---- sequence numbers -------------------------------------------------------------------------------

// Sequence word of a (half, phase): bits 0-31 the sequence number of the last launch, bits 32-63 the
// blocks of the running launch that have claimed it. Each block adds 1 << 32 with one atomic (its read
// of the number and its count in one step: no load, fence and atomic in a row), and the last block
// stores the next number with a count of 0, so the next launch on the stream sees it. `old`: what
// the block's atomic returned; returns the launch's number.
__device__ __forceinline__ uint32_t claim_sequence(unsigned long long* word, unsigned long long old) {
    const uint32_t s = static_cast<uint32_t>(old) + 1u;
    if ((old >> 32) == gridDim.x - 1) atomicExch(word, static_cast<unsigned long long>(s));
    return s;
}

// This block's launch's sequence word (set by begin_launch): a timeout reads from it how many of the
// launch's blocks had begun (peer_timed_out).
static __shared__ unsigned long long* s_launch_word;

// Prologue shared by the dispatch and combine kernels: claim this launch's sequence numbers for the
// phases it runs (0 for a phase it skips) and snapshot the rank mask, so every warp of the block sees
// one consistent view for the whole launch. Ends with a block barrier.
// The block's last threads do it: the first ones may hold an acquire load issued ahead of the prologue
// (read_tag_ahead), which holds back their later loads. Both phases' atomics are in flight at once.
__device__ __forceinline__ void begin_launch(int phases, uint32_t* seq_state, const int* mask, int num_ranks,
                                             uint32_t* s_seq, int* s_mask) {
    const int from_last = static_cast<int>(blockDim.x - 1u - threadIdx.x);
    if (from_last == 0) {
        unsigned long long* words = reinterpret_cast<unsigned long long*>(seq_state);  // [0] send, [1] receive
        const bool send = (phases & kPhaseSend) != 0, recv = (phases & kPhaseRecv) != 0;
        const unsigned long long send_old = send ? atomicAdd(words, 1ull << 32) : 0ull;
        const unsigned long long recv_old = recv ? atomicAdd(words + 1, 1ull << 32) : 0ull;
        s_seq[0] = send ? claim_sequence(words, send_old) : 0u;
        s_seq[1] = recv ? claim_sequence(words + 1, recv_old) : 0u;
        s_launch_word = send ? words : words + 1;
    }
    for (int r = from_last; r < num_ranks; r += blockDim.x) s_mask[r] = ld_volatile(mask + r);
    __syncthreads();
}

// ---- waits ------------------------------------------------------------------------------------------
// Every wait is done by ONE thread per flag word: it polls with relaxed loads (no cache-invalidating
// acquire per poll), backs off with __nanosleep once the flag is late, and fences (acquire, system
// scope) once it has seen the value. The deadline (GPU timer, cheap) is checked every 32 polls; the
// error record lives in host-mapped memory, so reading it is a PCIe round trip: it is read only every
// 512 polls (about every 100 us of waiting), never in the hot loop. (Reading it every 16 polls from
// thousands of spinning lanes queued PCIe reads and made the fused combine take milliseconds.)

// Pause between polls; false when the wait must give up (deadline passed, or another thread reported a
// timeout and bail_on_report is set).
__device__ __forceinline__ bool poll_pause(uint32_t spin, const Deadline& deadline, const ErrorRecord* err,
                                           bool bail_on_report) {
    if (spin >= 8) __nanosleep(spin < 128 ? 64u : 200u);
    if ((spin & 31u) == 31u) {
        if (deadline.expired()) return false;
        if ((spin & 511u) == 511u && bail_on_report && timeout_reported(err)) return false;
    }
    return true;
}

// Spin until tags[...] carries `tag`; returns the payload, or -1 on timeout (or, when bail_on_report, as
// soon as another thread has reported a timeout).
__device__ __forceinline__ int wait_tag(const uint32_t* word, uint32_t tag, const Deadline& deadline,
                                        const ErrorRecord* err, bool bail_on_report) {
    for (uint32_t spin = 0;; ++spin) {
        const uint32_t v = ld_relaxed_sys(word);
        if ((v >> 16) == tag) {
            fence_acq_rel_sys();
            return static_cast<int>(v & 0xffffu);
        }
        if (!poll_pause(spin, deadline, err, bail_on_report)) return -1;
    }
}

// Word threadIdx.x of `tags`, read before the launch's prologue when the launch receives, so that its
// latency overlaps the prologue. An acquire load: when it already carries the tag (the data arrived
// before the launch, as with a receive hook) it orders the data reads after it, and wait_tag_seen needs
// no system fence (the measured cost of confirming a tag that was already set). 0 otherwise.
__device__ __forceinline__ uint32_t read_tag_ahead(int phases, const uint32_t* tags, int num_words) {
    return (phases & kPhaseRecv) && static_cast<int>(threadIdx.x) < num_words ? ld_acquire_sys(tags + threadIdx.x)
                                                                                : 0u;
}

// Word threadIdx.x of `words` with a relaxed load, ahead of the prologue, when the launch receives (0
// otherwise): for tagged data words, which are usable as read when they carry the launch's tag.
__device__ __forceinline__ uint32_t read_word_ahead(int phases, const uint32_t* words, int num_words) {
    return (phases & kPhaseRecv) && static_cast<int>(threadIdx.x) < num_words ? ld_relaxed_sys(words + threadIdx.x)
                                                                                : 0u;
}

// wait_tag for a word already read once with acquire semantics (`seen`, from read_tag_ahead): nothing more
// when that value carries the tag. seen = 0 never does (tags are never 0), so it is a plain wait_tag.
__device__ __forceinline__ int wait_tag_seen(uint32_t seen, const uint32_t* word, uint32_t tag,
                                             const Deadline& deadline, const ErrorRecord* err, bool bail_on_report) {
    if ((seen >> 16) == tag) return static_cast<int>(seen & 0xffffu);
    return wait_tag(word, tag, deadline, err, bail_on_report);
}

// Spin until the arrival counter has grown by `need` since `base`.
__device__ __forceinline__ bool wait_arrivals(const uint64_t* counter, uint64_t base, uint64_t need,
                                              const Deadline& deadline, const ErrorRecord* err, bool bail_on_report) {
    for (uint32_t spin = 0;; ++spin) {
        if (ld_relaxed_sys(counter) - base >= need) {
            fence_acq_rel_sys();
            return true;
        }
        if (!poll_pause(spin, deadline, err, bail_on_report)) return false;
    }
}

// Spin until a local ready word carries `tag`.
__device__ __forceinline__ bool wait_ready(const uint32_t* word, uint32_t tag, const Deadline& deadline,
                                           const ErrorRecord* err, bool bail_on_report) {
    for (uint32_t spin = 0;; ++spin) {
        if (ld_relaxed_sys(word) == tag) {
            fence_acq_rel_sys();
            return true;
        }
        if (!poll_pause(spin, deadline, err, bail_on_report)) return false;
    }
}

// Blocks of this launch that have begun: the count the claims left in the sequence word, or all of them
// once the last block has claimed (it sets the count back to 0).
__device__ __forceinline__ int blocks_begun() {
    const unsigned long long word = atomicAdd(s_launch_word, 0ull);
    const uint32_t claimed = static_cast<uint32_t>(word >> 32);
    return claimed == 0u ? static_cast<int>(gridDim.x) : static_cast<int>(claimed);
}

// A wait for `peer` gave up: with shrinking enabled the peer is masked, else the timeout is reported, with
// how much of the launch had begun (a grid not wholly resident waits for its own missing blocks).
__device__ __forceinline__ void peer_timed_out(int* mask, int peer, bool shrink, ErrorRecord* err, int op,
                                               int rank, int line, const Deadline& deadline) {
    if (shrink) {
        atomicExch(mask + peer, 1);
        __threadfence_system();
    } else {
        report_timeout(err, op, rank, peer, line, deadline.elapsed_ns(), blocks_begun(), static_cast<int>(gridDim.x));
    }
}

// End of a grid-wide phase: each block's stores are made system-visible before the block counts itself
// done; the block that finds the counter at gridDim.x - 1 is the last, resets the counter for the next
// launch and gets *s_last = 1 (shared), so it may publish for the whole grid. Every thread of every block
// calls it. In the last block, thread 0's last memory operation is an acquire-release fence, so its
// relaxed stores right after it publish everything the grid wrote (fence + strong store: a release).
__device__ __forceinline__ void grid_completion(uint32_t* done_counter, int* s_last) {
    // The block barrier orders every thread's stores before thread 0's fence, and a release is cumulative
    // over what happens before it (the pattern of a cooperative grid sync), so one fence per block
    // releases the block's stores: a fence in every warp cost ~3-4 us per launch here. Acquire-release,
    // not sequentially consistent (an SC fence also waits for a global ordering point, which the last
    // block's readers do not need), then one increment per block.
    __syncthreads();
    if (threadIdx.x == 0) {
        fence_acq_rel_sys();
        const uint32_t before = atomicAdd(done_counter, 1u);
        *s_last = before == gridDim.x - 1 ? 1 : 0;
        if (*s_last) {
            // Every block has counted: reset for the next launch (it starts after this kernel ends, so a
            // plain store suffices) and acquire what the other blocks released.
            st_relaxed_gpu(done_counter, 0u);
            fence_acq_rel_sys();
        }
    }
    __syncthreads();
}

}  // namespace deepep_cupy::low_latency

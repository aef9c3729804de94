// Low-latency kernels: buffer map, sequence tags, waits and grid-wide helpers shared by dispatch.cu and
// combine.cu (the BF16 / FP8 row codecs and copies are in rows.cuh, LogFMT in logfmt.cuh).
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
#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "low_latency/args.cuh"

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

__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
    return v;
}

// ---- sequence numbers -------------------------------------------------------------------------------

// The 16-bit tag of sequence number s >= 1: never 0, so a zeroed word never matches.
__device__ __forceinline__ uint32_t seq_tag(uint32_t s) { return (s - 1u) % 65535u + 1u; }

__device__ __forceinline__ uint32_t tag_word(uint32_t tag, uint32_t payload) { return (tag << 16) | (payload & 0xffffu); }

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

// Where a thread sits in a dispatch or combine launch: each block holds kGroups groups of kWarps warps,
// and a group (not a block) is the unit of work, with its own named barrier.
template <int kWarps, int kGroups>
struct GroupCoords {
    static constexpr int kGroupThreads = kWarps * 32;
    int warp_in_block, lane, group, warp, gthread, barrier_id, total_groups, gid;

    __device__ __forceinline__ GroupCoords()
        : warp_in_block(static_cast<int>(threadIdx.x) / 32),
          lane(lane_id()),
          group(warp_in_block / kWarps),
          warp(warp_in_block % kWarps),
          gthread(static_cast<int>(threadIdx.x) - group * kGroupThreads),
          barrier_id(1 + group),
          total_groups(static_cast<int>(gridDim.x) * kGroups),
          gid(static_cast<int>(blockIdx.x) * kGroups + group) {}
};

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

// A wait for `peer` gave up: with shrinking enabled the peer is masked, else the timeout is reported.
__device__ __forceinline__ void peer_timed_out(int* mask, int peer, bool shrink, ErrorRecord* err, int op,
                                               int rank, int line, const Deadline& deadline) {
    if (shrink) {
        atomicExch(mask + peer, 1);
        __threadfence_system();
    } else {
        report_timeout(err, op, rank, peer, line, deadline.elapsed_ns());
    }
}

// The first item of this warp when the grid's warps take items warp_in_block * gridDim.x + block, + all
// warps: consecutive items go to different blocks, so a short list (fewer items than warps) still keeps
// the load/store units of every SM busy instead of filling the first few SMs.
__device__ __forceinline__ int first_grid_item() {
    return static_cast<int>(threadIdx.x / 32 * gridDim.x + blockIdx.x);
}

// The segment of a non-decreasing prefix (s_prefix[0] <= g) that holds item g: the last u in [0, n] with
// s_prefix[u] <= g (empty segments share their prefix with the next one, so this skips them).
__device__ __forceinline__ int prefix_segment(const int* s_prefix, int n, int g) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (s_prefix[mid] <= g) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// The order of the source groups in a receiver's expert slabs: the receiver's own group first, then the
// other ranks cyclically, so a sender knows where its rows start in its own slabs (row 0) before any
// count arrives. source_position: the group's place; source_at: the source at a place.
__device__ __forceinline__ int source_position(int src, int rank, int num_ranks) {
    return src >= rank ? src - rank : src - rank + num_ranks;
}
__device__ __forceinline__ int source_at(int position, int rank, int num_ranks) {
    return rank + position < num_ranks ? rank + position : rank + position - num_ranks;
}

// The dispatch's record of a received row: its source token, in the handle's source info, and where
// row_map is given, the inverse, row_map[(source * T + token) * E_local + local expert] = row, which the
// partial-sum combine reads instead of rebuilding it from the source info (combine_partials_send.cuh).
__device__ __forceinline__ void record_row(int* out_src_info, int* out_row_map, int le, int row, int src, int t,
                                           int max_tokens, int num_ranks, int num_local) {
    out_src_info[static_cast<size_t>(le) * num_ranks * max_tokens + row] = t;
    if (out_row_map != nullptr && t >= 0 && t < max_tokens)
        out_row_map[(static_cast<size_t>(src) * max_tokens + t) * num_local + le] = row;
}

// Exclusive prefix, in thread order, of every thread's `value` over the block (s_warp_sum: one word per
// warp). Every thread of the block calls it (it holds a block barrier).
__device__ __forceinline__ int block_exclusive_prefix(int value, int* s_warp_sum) {
    const int lane = lane_id(), warp = static_cast<int>(threadIdx.x) / 32;
    int incl = value;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(kFullMask, incl, o);
        if (lane >= o) incl += n;
    }
    if (lane == 31) s_warp_sum[warp] = incl;
    __syncthreads();
    int run = incl - value;
    for (int w = 0; w < warp; ++w) run += s_warp_sum[w];
    return run;
}

// In-place exclusive prefix sum of s_vals[0 .. n) with the total in s_vals[n] (s_vals holds n + 1 ints):
// each thread sums a contiguous run, then one block scan of the runs. Every thread of the block calls
// it; it starts and ends with a block barrier (callers have just written s_vals).
__device__ __forceinline__ void block_exclusive_scan(int* s_vals, int n, int* s_warp_sum) {
    __syncthreads();
    const int per = (n + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
    const int i0 = min(n, static_cast<int>(threadIdx.x) * per), i1 = min(n, i0 + per);
    int sum = 0;
    for (int i = i0; i < i1; ++i) sum += s_vals[i];
    int run = block_exclusive_prefix(sum, s_warp_sum);
    for (int i = i0; i < i1; ++i) {
        const int c = s_vals[i];
        s_vals[i] = run;
        run += c;
    }
    if (threadIdx.x == blockDim.x - 1) s_vals[n] = run;
    __syncthreads();
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

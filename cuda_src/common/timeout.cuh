// Bounded waits and the error record a kernel leaves when a wait times out.
//
// Every spin-wait in a kernel must give up after a budget (nanoseconds, passed as a kernel argument) and
// report through an ErrorRecord instead of hanging or trapping: __trap() would poison the CUDA context,
// while a reported timeout lets the kernel return and the host raise a clear Python error
// (deepep_cupy.runtime.kernel_errors.KernelErrorRecord.check()).
//
//   __global__ void k(..., deepep::ErrorRecord* err, int64_t timeout_ns, int rank) {
//       deepep::Deadline deadline(timeout_ns);
//       if (!deepep::wait_until([&] { return deepep::ld_acquire_sys(flag) != 0; }, deadline, err,
//                               OP_DISPATCH_RECV, rank, peer, __LINE__))
//           return;   // timed out (here or in another thread): leave the kernel
//   }
//
// Or use the macro DEEPEP_WAIT_OR_RETURN(cond, deadline, err, op, rank, peer), which fills in __LINE__.
#pragma once

#include "nvrtc_compat.cuh"
#include "ptx.cuh"

namespace deepep {

// Layout shared with the host: 8 x int32 words (32 bytes). waited_ns sits at byte offset 24.
// flag: 0 = no error; -1 = a writer is filling the record; 1 = complete (fields valid).
struct ErrorRecord {
    int flag;
    int op;
    int rank;
    int peer;
    int line;
    int reserved;
    long long waited_ns;
};
static_assert(sizeof(ErrorRecord) == 32, "ErrorRecord must stay 8 int32 words");

// Budget used when the host passes a non-positive value: 100 s (longer than any sane transfer, short
// enough to turn a hang into an error).
constexpr long long kDefaultTimeoutNs = 100LL * 1000 * 1000 * 1000;

// Has any thread (of any kernel sharing this record) already reported? Lets other waiters give up early.
__device__ __forceinline__ bool timeout_reported(const ErrorRecord* rec) {
    return rec != nullptr && ld_volatile(&rec->flag) != 0;
}

// Record a timeout. The first writer wins; later reports are dropped. Returns true for the winner.
// The record is written with system-scope visibility so the host can read it from mapped memory.
__device__ __forceinline__ bool report_timeout(ErrorRecord* rec, int op, int rank, int peer, int line,
                                               long long waited_ns) {
    if (rec == nullptr) return false;
    if (atomic_cas_acq_rel_sys(&rec->flag, 0, -1) != 0) return false;
    rec->op = op;
    rec->rank = rank;
    rec->peer = peer;
    rec->line = line;
    rec->waited_ns = waited_ns;
    __threadfence_system();
    st_release_sys(&rec->flag, 1);
    return true;
}

// A point in time after which waits give up. Cheap to copy; build one per kernel (or per wait).
struct Deadline {
    uint64_t start_ns;
    uint64_t budget_ns;

    __device__ __forceinline__ explicit Deadline(long long budget)
        : start_ns(globaltimer()), budget_ns(static_cast<uint64_t>(budget > 0 ? budget : kDefaultTimeoutNs)) {}

    __device__ __forceinline__ long long elapsed_ns() const {
        return static_cast<long long>(globaltimer() - start_ns);
    }
    __device__ __forceinline__ bool expired() const { return globaltimer() - start_ns > budget_ns; }
};

// Spin until pred() is true. Returns true when it became true; false when the deadline passed (the
// timeout is then reported) or another thread already reported one. pred must re-read memory with
// volatile or acquire loads.
template <typename Pred>
__device__ __forceinline__ bool wait_until(Pred pred, const Deadline& deadline, ErrorRecord* rec, int op,
                                           int rank, int peer, int line) {
    for (unsigned int spin = 0;; ++spin) {
        if (pred()) return true;
        // Checking the clock and the record every few polls keeps the loop tight on the flag itself.
        if ((spin & 15u) == 15u) {
            if (deadline.expired()) {
                report_timeout(rec, op, rank, peer, line, deadline.elapsed_ns());
                return false;
            }
            if (timeout_reported(rec)) return false;
        }
    }
}

}  // namespace deepep

// Wait for `cond` (an expression re-evaluated each poll) or return from the calling kernel on timeout.
#define DEEPEP_WAIT_OR_RETURN(cond, deadline, rec, op, rank, peer)                                        \
    do {                                                                                                  \
        if (!::deepep::wait_until([&]() { return static_cast<bool>(cond); }, (deadline), (rec), (op), (rank), \
                                  (peer), __LINE__))                                                      \
            return;                                                                                       \
    } while (0)

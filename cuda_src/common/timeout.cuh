// The error record a kernel leaves when a wait times out, and the deadline the waits measure against.
//
// Every spin-wait in a kernel must give up after a budget (nanoseconds, passed as a kernel argument) and
// report through an ErrorRecord instead of hanging or trapping: __trap() would poison the CUDA context,
// while a reported timeout lets the kernel return and the host raise a clear Python error
// (deepep_cupy.runtime.kernel_errors.KernelErrorRecord.check()). The waits themselves live with their
// kernel families (intranode/layout.cuh, low_latency/layout.cuh): each polls its flag tightly and reads
// the host-mapped record only rarely, since every such read is a PCIe round trip.
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

}  // namespace deepep

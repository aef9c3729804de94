// The error record a kernel leaves when a wait times out or an input value is out of range, and the
// deadline the waits measure against.
//
// Every spin-wait in a kernel must give up after a budget (nanoseconds, passed as a kernel argument) and
// report through an ErrorRecord instead of hanging or trapping: __trap() would poison the CUDA context,
// while a reported timeout lets the kernel return and the host raise a clear Python error
// (deepep_cupy.device.kernel_errors.KernelErrorRecord.check()). The waits themselves live with their
// kernel families (intranode/sync.cuh, low_latency/sync.cuh): each polls its flag tightly
// and reads the host-mapped record only rarely, since every such read is a PCIe round trip.
//
// The same record carries value errors (report_value_error, see common/value_errors.cuh): a kernel that
// finds a bad input value treats it as harmless, finishes its work normally and leaves the value for the
// host to raise on. Such a report must not make other waits give up (timeout_reported ignores it): the
// peers still expect every byte of this kernel.
#pragma once

#include "nvrtc_compat.cuh"
#include "ptx.cuh"

namespace deepep_cupy {

// The host reads the same kRecordWords x int32 words. waited_ns sits at byte offset 24.
// flag: 0 = no error; -1 = a timeout is being written, -2 = a value error is being written (the host
// treats both as "not yet recorded"); 1 = complete (fields valid).
// reserved: what the complete record holds, kRecordTimeout (waited_ns = nanoseconds waited on `peer`) or
// kRecordValueError (waited_ns = the offending value, peer = -1).
// blocks_started / blocks_in_grid: of a timeout in a kernel that can tell (the low-latency ones), how many
// blocks of the launch had begun when it was reported, of how many; 0 / 0 where unknown. Fewer than all
// means the grid was not wholly resident: its running blocks waited for work its waiting blocks hold.
constexpr int kRecordWords = 12;
struct ErrorRecord {
    int flag;
    int op;
    int rank;
    int peer;
    int line;
    int reserved;
    long long waited_ns;
    int blocks_started;
    int blocks_in_grid;
    int spare[2];
};
static_assert(sizeof(ErrorRecord) == 4 * kRecordWords, "ErrorRecord must stay kRecordWords int32 words");

// Budget used when the host passes a non-positive value: 100 s (longer than any sane transfer, short
// enough to turn a hang into an error).
constexpr long long kDefaultTimeoutNs = 100LL * 1000 * 1000 * 1000;

// Values of ErrorRecord::reserved and of the in-progress flag of each kind of report.
constexpr int kRecordTimeout = 0;
constexpr int kRecordValueError = 1;
constexpr int kFlagWritingTimeout = -1;
constexpr int kFlagWritingValueError = -2;

// Has any thread (of any kernel sharing this record) already reported a timeout? Lets other waiters give
// up early. A value error does not count: it never stops a kernel, so waiting on stays right. The kind of
// a complete record is read only once its flag is seen (volatile load, then an acquire fence), so a
// record without errors costs one load as before.
__device__ __forceinline__ bool timeout_reported(const ErrorRecord* rec) {
    if (rec == nullptr) return false;
    const int flag = ld_volatile(&rec->flag);
    if (flag == 0 || flag == kFlagWritingValueError) return false;
    if (flag != 1) return true;  // a timeout is being written
    fence_acq_rel_sys();
    return ld_volatile(&rec->reserved) == kRecordTimeout;
}

// Fill the record once: the first writer (of either kind) wins and later reports are dropped. Returns
// true for the winner. The record is written with system-scope visibility so the host can read it from
// mapped memory.
__device__ __forceinline__ bool fill_error_record(ErrorRecord* rec, int writing_flag, int kind, int op, int rank,
                                                  int peer, int line, long long payload, int blocks_started = 0,
                                                  int blocks_in_grid = 0) {
    if (rec == nullptr) return false;
    if (atomic_cas_acq_rel_sys(&rec->flag, 0, writing_flag) != 0) return false;
    rec->op = op;
    rec->rank = rank;
    rec->peer = peer;
    rec->line = line;
    rec->reserved = kind;
    rec->waited_ns = payload;
    rec->blocks_started = blocks_started;
    rec->blocks_in_grid = blocks_in_grid;
    __threadfence_system();
    st_release_sys(&rec->flag, 1);
    return true;
}

// Record a timeout of op `op` waiting on `peer` for waited_ns nanoseconds (reserved = kRecordTimeout).
// `blocks_started` of `blocks_in_grid`: how much of the launch had begun, where the kernel can tell.
__device__ __forceinline__ bool report_timeout(ErrorRecord* rec, int op, int rank, int peer, int line,
                                               long long waited_ns, int blocks_started = 0, int blocks_in_grid = 0) {
    return fill_error_record(rec, kFlagWritingTimeout, kRecordTimeout, op, rank, peer, line, waited_ns,
                             blocks_started, blocks_in_grid);
}

// Record a bad input value of op `op` (reserved = kRecordValueError, peer = -1, waited_ns = the value).
// The op codes are listed in common/value_errors.cuh.
__device__ __forceinline__ bool report_value_error(ErrorRecord* rec, int op, int rank, int line, long long value) {
    return fill_error_record(rec, kFlagWritingValueError, kRecordValueError, op, rank, -1, line, value);
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

}  // namespace deepep_cupy

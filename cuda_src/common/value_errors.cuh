// Checks of input values done inside the kernels, reported through the error record (common/timeout.cuh)
// instead of a host-side reduction and synchronisation before the launch.
//
// A kernel that meets a bad value treats it as harmless (an expert id out of range selects nothing, like
// -1), finishes its work, and leaves the value in the record: flag = 1, op = one of the codes below,
// rank, peer = -1, line, reserved = kRecordValueError, waited_ns = the offending value. The host raises a
// ValueError from it after the kernel. The first report wins, so a launch leaves at most one.
//
// Op codes (mirrored as VALUE_OP_* in deepep_cupy/ops/kernel_names.py):
//   301  layout count_tokens           topk_idx
//   302  intranode dispatch            topk_idx
//   303  low-latency dispatch          topk_idx
//   304  low-latency combine           topk_idx
#pragma once

#include "nvrtc_compat.cuh"
#include "timeout.cuh"

namespace deepep_cupy {

constexpr int kValueOpLayout = 301;
constexpr int kValueOpIntranodeDispatch = 302;
constexpr int kValueOpLowLatencyDispatch = 303;
constexpr int kValueOpLowLatencyCombine = 304;
constexpr int kValueOpInternodeDispatch = 305;

// An expert id is valid when -1 <= id < num_experts (-1: no expert). Shifted by one and compared
// unsigned, both bounds cost one compare.
__device__ __forceinline__ bool bad_expert_id(long long id, long long num_experts) {
    return static_cast<unsigned long long>(id) + 1ull > static_cast<unsigned long long>(num_experts);
}

// What one lane has seen of bad values: a flag and the last offending value. Kept in registers through a
// kernel's loop and reported once at its end, so the loop only pays a compare and a select per value.
struct BadValue {
    bool found = false;
    long long value = 0;

    __device__ __forceinline__ void check_expert_id(long long id, long long num_experts) {
        if (bad_expert_id(id, num_experts)) {
            found = true;
            value = id;
        }
    }

    // Warp-collective (all 32 lanes, converged): the lowest lane that found a bad value reports it.
    __device__ __forceinline__ void report_from_warp(ErrorRecord* rec, int op, int rank, int line) const {
        const unsigned int lanes = __ballot_sync(0xffffffffu, found);
        if (lanes != 0u && lane_id() == __ffs(lanes) - 1) report_value_error(rec, op, rank, line, value);
    }
};

}  // namespace deepep_cupy

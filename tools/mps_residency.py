"""Can every rank's grid be wholly resident when the ranks share one GPU under MPS?

Run under ``mpirun`` with ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` set, one process per rank, as
tools/gpu_suite.sh does before its stages when ``MPS_PCT`` is given. The low-latency kernels launch one
block per SM of what the process sees (768 threads at 80 registers leave room for one block) and their
blocks wait for each other through the peers, so a rank whose grid starts in part spins until the
library's timeout. Whether MPS gives each client its share of SMs side by side depends on the number of
clients and the share (seen on one H100: 2 clients at 40% and 4 at 10% were always whole, 4 at 20% or 24%
were not), so the suite asks the GPU instead of assuming it.

Each rank launches grids of one block per SM (shared memory past half an SM's keeps a second block out).
Every block checks in on the launch's counter, waits until its whole grid has checked in, then holds its
SM for HOLD_US so that the ranks' grids overlap in time. A block that waited much longer than a check-in
takes saw its grid start in part. Exit status 3 (PARTIAL_EXIT), with the longest wait, when any rank saw that.
"""

from __future__ import annotations

import argparse
import os
import sys

HOLD_US = 30
#: A whole grid checks in within about a microsecond; a partial one waits for another client's grid.
PARTIAL_US = 10
#: Exit status when some grid started in part (a crash exits 1, the suite's time limit 124).
PARTIAL_EXIT = 3

_SOURCE = r"""
extern "C" __global__ void __launch_bounds__(768, 1)
check_in(unsigned int* counter, unsigned long long* longest_wait, unsigned long long hold_ns) {
    extern __shared__ char keep_out_a_second_block[];
    if (threadIdx.x == 0) {
        keep_out_a_second_block[0] = 1;
        unsigned long long start, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        atomicAdd(counter, 1u);
        now = start;
        // Bounded: a grid that never completes (a block that cannot start) is reported, not waited for.
        while (atomicAdd(counter, 0u) < gridDim.x && now - start < 200000000ull)
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        atomicMax(longest_wait, now - start);
        const unsigned long long complete = now;
        while (now - complete < hold_ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    }
    __syncthreads();
}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=20000)
    args = parser.parse_args()

    import cupy
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    device = cupy.cuda.Device(comm.rank % cupy.cuda.runtime.getDeviceCount())  # the GPU the tests give this rank
    device.use()
    sms = int(device.attributes["MultiProcessorCount"])
    shared = 150 * 1024
    kernel = cupy.RawKernel(_SOURCE, "check_in")
    kernel.max_dynamic_shared_size_bytes = shared
    counters = cupy.zeros(args.launches, dtype=cupy.uint32)
    waits = cupy.zeros(args.launches, dtype=cupy.uint64)
    stream = cupy.cuda.Stream(non_blocking=True)
    hold_ns = cupy.uint64(HOLD_US * 1000)
    comm.Barrier()
    with stream:
        for i in range(args.launches):
            kernel((sms,), (768,), (counters[i:], waits[i:], hold_ns), shared_mem=shared)
    stream.synchronize()
    waits_us = waits.get() / 1e3
    partial = int((waits_us > PARTIAL_US).sum())
    rows = comm.gather((comm.rank, sms, partial, float(waits_us.max())), root=0)
    ok = True
    if comm.rank == 0:
        share = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "all")
        for rank, rank_sms, rank_partial, longest in rows:
            print(f"MPS_RESIDENCY rank {rank} ({rank_sms} SMs, {share}% each, {comm.size} ranks): "
                  f"{rank_partial}/{args.launches} grids started in part, longest wait {longest:.1f} us")
        ok = all(r[2] == 0 for r in rows)
        if not ok:
            print(f"MPS_RESIDENCY FAILED: with {comm.size} ranks at {share}% of the SMs each, a rank's grid of one "
                  f"block per SM did not always start whole; the low-latency kernels would wait for their own "
                  f"blocks until they time out. Choose a smaller MPS_PCT.")
    return 0 if comm.bcast(ok, root=0) else PARTIAL_EXIT


if __name__ == "__main__":
    sys.exit(main())

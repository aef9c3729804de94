"""What plain copy loops reach on a few SMs: the floor under the intranode dispatch and combine.
One process, two GPUs with peer access (GPU 0 and 1 copy at the same time, each towards the other):

    python tools/copy_floor.py

Jobs (no flags, no rings, no protocol; rows of 14336 B = 7168 BF16 and 7168 B = FP8, 4096 rows):
  push   rows from local memory into the peer's memory (what the dispatch senders and combine senders do)
  local  rows from local memory to local memory (the self copy and the ring-to-output copy)
  mix    12 SMs push 4096 rows while 12 more copy 8192 rows locally: the bytes one 24-SM dispatch moves
Each job runs with warp copies (16-byte loads, 8 in flight per lane, then stores) or with bulk copies
(`cp.async.bulk` global -> shared -> global, one lane per warp driving a few stages). Times are CUDA-event
medians of 5 x 10 launches, the slower GPU's.
"""

import numpy as np

SOURCE = r"""
typedef unsigned long long u64;
__device__ __forceinline__ unsigned sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

template <int U>
__device__ void warp_copy(int4* dst, const int4* src, int n, int lane) {
  for (int base = 0; base < n; base += 32 * U) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = base + u * 32 + lane;
      if (j < n) asm("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(src + j));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = base + u * 32 + lane;
      if (j < n) asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1,%2,%3,%4};"
                              :: "l"(dst + j), "r"(v[u].x), "r"(v[u].y), "r"(v[u].z), "r"(v[u].w) : "memory");
    }
  }
}

// Lane 0 of a warp keeps `stages` rows in flight: bulk load into shared memory, then bulk store out.
// Rows r0 + first + k * step (k < count) go to ring slot (row - r0) % cap.
__device__ void bulk_copy(char* ring, const char* src, int r0, int first, int count, int step, int rows_in_src,
                          int cap, int row_bytes, char* stage, u64* bars, int stages) {
  for (int s = 0; s < stages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(sa(bars + s)));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  auto load = [&](int k) {
    u64* bar = bars + k % stages;
    const char* from = src + (long long)((r0 + first + k * step) % rows_in_src) * row_bytes;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(sa(bar)), "r"(row_bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(sa(stage + (long long)(k % stages) * row_bytes)), "l"(from), "r"(row_bytes), "r"(sa(bar))
                 : "memory");
  };
  for (int k = 0; k < min(count, stages); ++k) load(k);
  for (int k = 0; k < count; ++k) {
    unsigned done = 0, parity = (k / stages) & 1;
    while (!done)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(sa(bars + k % stages)), "r"(parity) : "memory");
    char* to = ring + (long long)((first + k * step) % cap) * row_bytes;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 :: "l"(to), "r"(sa(stage + (long long)(k % stages) * row_bytes)), "r"(row_bytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    // Refill the stage of row k - 1 once its store has read it (row k's store may still be reading).
    if (k >= 1 && k - 1 + stages < count) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      load(k - 1 + stages);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// Blocks [0, nb0) run job 0 (rows0 rows of src0 into dst0), the others job 1. Block b of a job copies its
// share of rows into its own ring of `cap` rows in dst; bulk: 0 warp copies, else warps 0..bulk-1 drive bulk copies.
extern "C" __global__ void __launch_bounds__(1024, 1)
copy_rows(const char* src0, char* dst0, int rows0, int bulk0, const char* src1, char* dst1, int rows1, int bulk1,
          int nb0, int rows_in_src, int row_bytes, int cap, int stages) {
  extern __shared__ __align__(128) char smem[];
  __shared__ u64 bars[32 * 16];
  const bool first_job = blockIdx.x < nb0;
  const int b = first_job ? blockIdx.x : blockIdx.x - nb0, nb = first_job ? nb0 : gridDim.x - nb0;
  const char* src = first_job ? src0 : src1;
  char* dst = first_job ? dst0 : dst1;
  const int rows = first_job ? rows0 : rows1, bulk = first_job ? bulk0 : bulk1;
  const int per = (rows + nb - 1) / nb, r0 = min(rows, b * per), r1 = min(rows, r0 + per);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
  char* ring = dst + (long long)b * cap * row_bytes;
  if (bulk == 0) {
    for (int r = r0 + warp; r < r1; r += nw)
      warp_copy<8>((int4*)(ring + (long long)((r - r0) % cap) * row_bytes),
                   (const int4*)(src + (long long)(r % rows_in_src) * row_bytes), row_bytes / 16, lane);
  } else if (warp < bulk && lane == 0) {
    const int count = r1 - r0 > warp ? (r1 - r0 - warp + bulk - 1) / bulk : 0;
    bulk_copy(ring, src, r0, warp, count, bulk, rows_in_src, cap, row_bytes,
              smem + (long long)warp * stages * row_bytes, bars + warp * 16, stages);
  }
}
"""

ROWS, SMS, CAP, WARPS, BULK_WARPS, SMEM = 4096, 12, 512, 16, 4, 200 * 1024


def main() -> None:
    import cupy as cp

    assert cp.cuda.runtime.getDeviceCount() >= 2, "needs two GPUs"
    devs = (0, 1)
    kernels, streams = {}, {}
    for d in devs:
        with cp.cuda.Device(d):
            try:
                cp.cuda.runtime.deviceEnablePeerAccess(1 - d)
            except cp.cuda.runtime.CUDARuntimeError:
                pass  # already enabled
            kernels[d] = cp.RawModule(code=SOURCE, options=("-std=c++17",)).get_function("copy_rows")
            streams[d] = cp.cuda.Stream(non_blocking=True)

    def measure(row_bytes, jobs):
        """jobs: [(rows, blocks, to_peer, bulk)] (one or two). Returns us per launch (slower GPU)."""
        stages = max(2, min(16, SMEM // (BULK_WARPS * row_bytes)))
        smem = stages * BULK_WARPS * row_bytes if any(j[3] for j in jobs) else 0
        args = {}
        for d in devs:
            with cp.cuda.Device(d):
                src = cp.random.randint(0, 255, ROWS * row_bytes, dtype=cp.uint8)
                packed = []
                for rows, blocks, to_peer, bulk in list(jobs) + [(0, 0, False, 0)] * (2 - len(jobs)):
                    with cp.cuda.Device(1 - d if to_peer else d):
                        dst = cp.empty(max(blocks, 1) * CAP * row_bytes, dtype=cp.uint8)
                    packed.append((src, dst, np.int32(rows), np.int32(BULK_WARPS if bulk else 0)))
                kernels[d].max_dynamic_shared_size_bytes = smem
                args[d] = (*packed[0], *packed[1], np.int32(jobs[0][1]), np.int32(ROWS), np.int32(row_bytes),
                           np.int32(CAP), np.int32(stages))
        grid = sum(j[1] for j in jobs)

        def launch():
            for d in devs:
                with cp.cuda.Device(d):
                    kernels[d]((grid,), (WARPS * 32,), args[d], stream=streams[d], shared_mem=smem)

        for _ in range(3):
            launch()
        times = []
        for _ in range(5):
            events = {}
            for d in devs:
                with cp.cuda.Device(d):
                    events[d] = (cp.cuda.Event(), cp.cuda.Event())
                    events[d][0].record(streams[d])
            for _ in range(10):
                launch()
            for d in devs:
                with cp.cuda.Device(d):
                    events[d][1].record(streams[d])
            for d in devs:
                streams[d].synchronize()
            times.append(max(cp.cuda.get_elapsed_time(*events[d]) for d in devs) * 100.0)
        args.clear()
        for d in devs:
            with cp.cuda.Device(d):
                cp.get_default_memory_pool().free_all_blocks()
        return float(np.median(times))

    print(f"{'job':44s} {'row B':>6s} {'us':>8s} {'GB/s of the first job':>22s}")
    for row_bytes in (14336, 7168):
        for name, jobs in (
            ("push, 12 SMs, warp copies", [(ROWS, SMS, True, 0)]),
            ("push, 12 SMs, bulk copies", [(ROWS, SMS, True, 1)]),
            ("push, 24 SMs, warp copies", [(ROWS, 2 * SMS, True, 0)]),
            ("push, 6 SMs, warp copies", [(ROWS, SMS // 2, True, 0)]),
            ("push, 6 SMs, bulk copies", [(ROWS, SMS // 2, True, 1)]),
            ("push, 4 SMs, warp copies", [(ROWS, SMS // 3, True, 0)]),
            ("local, 6 SMs, warp copies", [(ROWS, SMS // 2, False, 0)]),
            ("local, 12 SMs, warp copies", [(ROWS, SMS, False, 0)]),
            ("local, 12 SMs, bulk copies", [(ROWS, SMS, False, 1)]),
            ("mix: push 12 SMs + 2x local 12 SMs, warp", [(ROWS, SMS, True, 0), (2 * ROWS, SMS, False, 0)]),
            ("mix: push 12 SMs + 2x local 12 SMs, bulk", [(ROWS, SMS, True, 1), (2 * ROWS, SMS, False, 1)]),
        ):
            us = measure(row_bytes, jobs)
            print(f"{name:44s} {row_bytes:6d} {us:8.1f} {ROWS * row_bytes / us / 1e3:22.1f}", flush=True)


if __name__ == "__main__":
    main()

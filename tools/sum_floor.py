"""What plain sums of rows reach on a few SMs: the floor under the intranode combine's copy-mode sums.
One process, one GPU:

    python tools/sum_floor.py [--sms 8,12,24]

Jobs (no flags, no protocol; 4096 tokens of 7168 BF16, each the sum of two rows read from two 4096-row
arrays, float32 accumulation, one rounding, as the combine sums two ranks' rows):
  sum    two rows loaded, one row stored (the combine's bytes per token)
  load2  the same loads, nothing stored but a word per warp (the reads alone)
  copy   one row loaded, one stored (the local copy of tools/copy_floor.py)
  red    one row loaded and added into the output by L2 reductions (red.global.add.noftz.v4.bf16x2): the
         bytes an SM moves if the sum's other row were already in the output and L2 did the adds (bf16
         rounding at each add, so not the combine's one rounding of a float32 sum above two rows)
Each with W warps a block, one block an SM, U 16-byte loads a lane a row in flight. Times are CUDA-event
medians of 5 x 10 launches; GB/s counts the bytes the job reads and writes, per SM.
"""

from __future__ import annotations

import argparse

import numpy as np

SOURCE = r"""
#include <cuda_bf16.h>
__device__ __forceinline__ int4 ld(const int4* p) {
  int4 v;
  asm volatile("ld.global.v4.s32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void st(int4* p, int4 v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1,%2,%3,%4};"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ void red_add(int4* p, int4 v) {
  asm volatile("red.global.add.noftz.v4.bf16x2 [%0], {%1,%2,%3,%4};"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ int4 add(int4 a, int4 b) {
  const __nv_bfloat162* x = reinterpret_cast<const __nv_bfloat162*>(&a);
  const __nv_bfloat162* y = reinterpret_cast<const __nv_bfloat162*>(&b);
  int4 out;
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(x[i]), g = __bfloat1622float2(y[i]);
    o[i] = __floats2bfloat162_rn((0.0f + f.x) + g.x, (0.0f + f.y) + g.y);
  }
  return out;
}

// kind 0: sum, 1: load2, 2: copy, 3: red. Warp g of G takes tokens g, g + G, ...
template <int U>
__device__ void run(const int4* a, const int4* b, int4* out, int* sink, int tokens, int words, int kind) {
  const int lane = threadIdx.x % 32, G = gridDim.x * (blockDim.x / 32);
  int acc = 0;
  for (int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; t < tokens; t += G) {
    const long long row = (long long)t * words;
    for (int base = lane; base < words; base += 32 * U) {
      int4 va[U], vb[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int j = base + 32 * u;
        if (j < words) {
          if (kind != 3) va[u] = ld(a + row + j);
          if (kind != 2) vb[u] = ld(b + row + j);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int j = base + 32 * u;
        if (j >= words) continue;
        if (kind == 0) st(out + row + j, add(va[u], vb[u]));
        else if (kind == 2) st(out + row + j, va[u]);
        else if (kind == 3) red_add(out + row + j, vb[u]);
        else acc ^= va[u].x ^ vb[u].y;
      }
    }
  }
  if (kind == 1 && acc == 0x7fffffff) sink[0] = acc;
}

extern "C" __global__ void __launch_bounds__(1024, 1)
sum_rows(const int4* a, const int4* b, int4* out, int* sink, int tokens, int words, int kind, int unroll) {
  switch (unroll) {
    case 1: run<1>(a, b, out, sink, tokens, words, kind); break;
    case 2: run<2>(a, b, out, sink, tokens, words, kind); break;
    case 4: run<4>(a, b, out, sink, tokens, words, kind); break;
    default: run<8>(a, b, out, sink, tokens, words, kind); break;
  }
}
"""

TOKENS, HIDDEN = 4096, 7168


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sms", default="8,12,24")
    p.add_argument("--shapes", default="32x2,32x4,16x4,16x8,8x8", help="WxU,... warps a block x loads a lane")
    args = p.parse_args()
    import cupy as cp

    kernel = cp.RawModule(code=SOURCE, options=("-std=c++17",)).get_function("sum_rows")
    words = HIDDEN * 2 // 16
    rng = cp.random.default_rng(1)
    a = rng.standard_normal(TOKENS * HIDDEN, dtype=cp.float32).astype(cp.float16).view(cp.int16)  # any bits
    b = rng.standard_normal(TOKENS * HIDDEN, dtype=cp.float32).astype(cp.float16).view(cp.int16)
    out = cp.empty_like(a)
    sink = cp.zeros(1, dtype=cp.int32)
    stream = cp.cuda.Stream(non_blocking=True)
    row_bytes = HIDDEN * 2
    moved = {0: 3, 1: 2, 2: 2, 3: 2}  # rows read and written per token
    print(f"{'job':6s} {'SMs':>4s} {'shape':>6s} {'us':>8s} {'GB/s a SM':>10s}")
    for sms in (int(s) for s in args.sms.split(",")):
        for kind, name in ((0, "sum"), (1, "load2"), (2, "copy"), (3, "red")):
            for shape in args.shapes.split(","):
                w, u = (int(v) for v in shape.split("x"))
                call = ((sms,), (w * 32,), (a, b, out, sink, np.int32(TOKENS), np.int32(words), np.int32(kind),
                                             np.int32(u)))
                for _ in range(3):
                    kernel(*call, stream=stream)
                times = []
                for _ in range(5):
                    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                    e0.record(stream)
                    for _ in range(10):
                        kernel(*call, stream=stream)
                    e1.record(stream)
                    stream.synchronize()
                    times.append(cp.cuda.get_elapsed_time(e0, e1) * 100.0)
                us = float(np.median(times))
                gbs = TOKENS * row_bytes * moved[kind] / us / 1e3 / sms
                print(f"{name:6s} {sms:4d} {shape:>6s} {us:8.1f} {gbs:10.1f}", flush=True)


if __name__ == "__main__":
    main()

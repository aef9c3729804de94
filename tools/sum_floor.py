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
  bulk   the same through the bulk-copy unit: a row's pieces loaded into shared memory
         (cp.async.bulk) and added into the output by cp.reduce.async.bulk .add.noftz.bf16
  bulkcp the same pieces stored by cp.async.bulk instead of added (a copy through shared memory)
Each with W warps a block, one block an SM, U 16-byte loads a lane a row in flight; for the bulk jobs
(--bulk-shapes W x N x S) one lane a warp keeps N pieces of S bytes in flight. Times are CUDA-event
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

BULK_SOURCE = r"""
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void wait_parity(unsigned bar, unsigned parity) {
  asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
               " @!p bra W;\n}" :: "r"(bar), "r"(parity) : "memory");
}
// kind 4: bulk reduce, 5: bulk copy. Warp g of G takes tokens g, g + G, ...; its lane 0 keeps `stages` pieces
// of `piece` bytes in flight.
extern "C" __global__ void __launch_bounds__(1024, 1)
bulk_rows(const char* b, char* out, int tokens, int row_bytes, int kind, int stages, int piece) {
  extern __shared__ __align__(128) char smem[];
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (threadIdx.x % 32 != 0) return;
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(smem) + warp * 8;
  char* buf = smem + warps * 64 + (long long)warp * stages * piece;
  for (int s = 0; s < stages; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(bars + s)));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const int G = gridDim.x * warps, per_row = (row_bytes + piece - 1) / piece;
  const int first = blockIdx.x * warps + warp;
  const int my_tokens = first < tokens ? (tokens - first + G - 1) / G : 0;
  const long long total = (long long)my_tokens * per_row;
  auto where = [&](long long p, int& bytes) {
    const long long t = first + (p / per_row) * G;
    const int off = (int)(p % per_row) * piece;
    bytes = min(piece, row_bytes - off);
    return t * row_bytes + off;
  };
  auto load = [&](long long p) {
    int bytes; const long long at = where(p, bytes);
    const int s = (int)(p % stages);
    const unsigned bar = smem_addr(bars + s);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_addr(buf + (long long)s * piece)), "l"(b + at), "r"(bytes), "r"(bar) : "memory");
  };
  for (long long p = 0; p < total && p < stages - 1; ++p) load(p);
  for (long long p = 0; p < total; ++p) {
    const int s = (int)(p % stages);
    wait_parity(smem_addr(bars + s), (unsigned)((p / stages) & 1));
    int bytes; const long long at = where(p, bytes);
    const unsigned src = smem_addr(buf + (long long)s * piece);
    if (kind == 4)
      asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.bf16 [%0], [%1], %2;"
                   :: "l"(out + at), "r"(src), "r"(bytes) : "memory");
    else
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   :: "l"(out + at), "r"(src), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
    if (p + stages - 1 < total) load(p + stages - 1);
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""

TOKENS, HIDDEN = 4096, 7168


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even (finite inputs)."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bulk_kernel(cp):
    """``bulk_rows``, allowed all of an SM's shared memory."""
    kernel = cp.RawModule(code=BULK_SOURCE, options=("-std=c++17", "-arch=sm_90")).get_function("bulk_rows")
    kernel.max_dynamic_shared_size_bytes = 227 * 1024
    return kernel


def bulk_jobs(cp, sms_list, shapes) -> None:
    """Times the bulk jobs and checks the bulk reduce's bits against float32 sums rounded once."""
    kernel = bulk_kernel(cp)
    rng = np.random.default_rng(2)
    fa = rng.standard_normal((TOKENS, HIDDEN), dtype=np.float32)
    fb = rng.standard_normal((TOKENS, HIDDEN), dtype=np.float32)
    a_bits, b_bits = bf16_bits(fa), bf16_bits(fb)
    def as_f(bits):
        return (bits.astype(np.uint32) << 16).view(np.float32)

    want = bf16_bits(as_f(a_bits) + as_f(b_bits))
    a = cp.asarray(a_bits)
    b = cp.asarray(b_bits)
    out = cp.empty_like(a)
    row_bytes = HIDDEN * 2
    stream = cp.cuda.Stream(non_blocking=True)
    for sms in sms_list:
        for kind, name in ((4, "bulk"), (5, "bulkcp")):
            for shape in shapes:
                w, n, piece = (int(v) for v in shape.split("x"))
                smem = w * 64 + w * n * piece
                if smem > 227 * 1024 or n > 8:
                    continue
                call = ((sms,), (w * 32,), (b, out, np.int32(TOKENS), np.int32(row_bytes), np.int32(kind),
                                            np.int32(n), np.int32(piece)))
                out[...] = a
                kernel(*call, stream=stream, shared_mem=smem)
                stream.synchronize()
                if kind == 4:
                    got = cp.asnumpy(out)
                    bad = int((got != want).sum())
                    note = f"mismatches {bad}"
                else:
                    note = "equal" if bool((out == b).all()) else "WRONG"
                for _ in range(3):
                    kernel(*call, stream=stream, shared_mem=smem)
                times = []
                for _ in range(5):
                    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                    e0.record(stream)
                    for _ in range(10):
                        kernel(*call, stream=stream, shared_mem=smem)
                    e1.record(stream)
                    stream.synchronize()
                    times.append(cp.cuda.get_elapsed_time(e0, e1) * 100.0)
                us = float(np.median(times))
                gbs = TOKENS * row_bytes * 2 / us / 1e3 / sms
                print(f"{name:6s} {sms:4d} {shape:>10s} {us:8.1f} {gbs:10.1f}  {note}", flush=True)


def ce_overlap(cp, sms_list, shape) -> None:
    """A local device-to-device copy of TOKENS rows in 16 pieces (the driver's copy kernel) alone and beside a bulk
    reduce on another stream: what the own rows' copies would cost if they filled the output first."""
    kernel = bulk_kernel(cp)
    row_bytes = HIDDEN * 2
    src = cp.ones(TOKENS * HIDDEN, dtype=cp.uint16)
    dst = cp.empty_like(src)
    b = cp.ones_like(src)
    out = cp.empty_like(src)
    w, n, piece = (int(v) for v in shape.split("x"))
    s_copy, s_kern = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    step = TOKENS // 16 * HIDDEN

    def copies():
        for i in range(16):
            cp.cuda.runtime.memcpyAsync(dst.data.ptr + i * step * 2, src.data.ptr + i * step * 2, step * 2,
                                        cp.cuda.runtime.memcpyDeviceToDevice, s_copy.ptr)

    for sms in sms_list:
        call = ((sms,), (w * 32,), (b, out, np.int32(TOKENS), np.int32(row_bytes), np.int32(4), np.int32(n),
                                    np.int32(piece)))
        smem = w * 64 + w * n * piece
        for label, ce, k in (("ce", True, False), ("kernel", False, True), ("both", True, True)):
            times = []
            for _ in range(7):
                cp.cuda.Device().synchronize()
                e0 = cp.cuda.Event()
                e0.record(s_kern)
                s_copy.wait_event(e0)
                if ce:
                    copies()
                if k:
                    kernel(*call, stream=s_kern, shared_mem=smem)
                e1 = cp.cuda.Event()
                e1.record(s_copy)
                s_kern.wait_event(e1)
                e2 = cp.cuda.Event()
                e2.record(s_kern)
                e2.synchronize()
                times.append(cp.cuda.get_elapsed_time(e0, e2) * 1000.0)
            print(f"ce-overlap {label:6s} {sms:4d} {shape:>10s} {float(np.median(times[2:])):8.1f} us", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sms", default="8,12,24")
    p.add_argument("--shapes", default="32x2,32x4,16x4,16x8,8x8", help="WxU,... warps a block x loads a lane")
    p.add_argument("--bulk-shapes", default="4x8x7168,8x4x7168,8x6x3584,16x4x3584,32x3x2048,8x2x14336",
                   help="WxNxS,... warps a block x pieces in flight a warp x bytes a piece ('' for none)")
    p.add_argument("--bulk-only", action="store_true")
    p.add_argument("--ce", action="store_true", help="also time a local copy-engine copy of a row block in 16 "
                   "pieces, alone and beside the first bulk shape's reduce")
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
    sms_list = [int(s) for s in args.sms.split(",")]
    if args.bulk_shapes:
        bulk_jobs(cp, sms_list, args.bulk_shapes.split(","))
    if args.ce:
        ce_overlap(cp, sms_list, args.bulk_shapes.split(",")[0])
    if args.bulk_only:
        return
    for sms in sms_list:
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

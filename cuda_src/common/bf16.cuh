// bf16 in registers as float32 and back, 8 values (one int4) at a time: what the intranode and internode
// combines sum with (float32 accumulation, one rounding to nearest even at the end).
#pragma once

namespace deepep_cupy {

__device__ __forceinline__ float bf16_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }

// Two floats -> bf16x2 bits (`lo` in the low half), each rounded to nearest even (a NaN becomes the canonical
// NaN): one instruction, where rounding in integer arithmetic took about eight a value and left the few-SM
// combine bound by instruction issue.
__device__ __forceinline__ unsigned int pack_bf16x2(float lo, float hi) {
    unsigned int d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4& v) {
    const unsigned int w[4] = {static_cast<unsigned int>(v.x), static_cast<unsigned int>(v.y),
                               static_cast<unsigned int>(v.z), static_cast<unsigned int>(v.w)};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        acc[2 * k] += bf16_lo(w[k]);
        acc[2 * k + 1] += bf16_hi(w[k]);
    }
}

__device__ __forceinline__ int4 pack_bf16x8(const float (&acc)[8]) {
    unsigned int w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = pack_bf16x2(acc[2 * k], acc[2 * k + 1]);
    return make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]), static_cast<int>(w[3]));
}

}  // namespace deepep_cupy

// bf16 in registers as float32 and back, 8 values (one int4) at a time: what the intranode and internode
// combines sum with (float32 accumulation, one rounding to nearest even at the end).
#pragma once

namespace deepep_cupy {

__device__ __forceinline__ float bf16_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }

// float -> bf16 bits, round to nearest even; NaN stays a (quiet) NaN.
__device__ __forceinline__ unsigned int f32_to_bf16_rn(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
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
    for (int k = 0; k < 4; ++k) w[k] = f32_to_bf16_rn(acc[2 * k]) | (f32_to_bf16_rn(acc[2 * k + 1]) << 16);
    return make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]), static_cast<int>(w[3]));
}

}  // namespace deepep_cupy

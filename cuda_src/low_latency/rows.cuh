// Low-latency kernels: BF16 / FP8 row codecs (the reference's FP8 cast exactly), the store of received
// scales into the column-major scale outputs, and warp copies.
#pragma once

#include "common/ptx.cuh"
#include "low_latency/buffer_map.cuh"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace deepep_cupy::low_latency {

// ---- BF16 / FP8 -------------------------------------------------------------------------------------

__device__ __forceinline__ float bf16_bits_to_float(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

__device__ __forceinline__ void unpack_bf16x8(const int4& v, float (&f)[8]) {
    const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                           static_cast<uint32_t>(v.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = bf16_bits_to_float(w[i] & 0xffffu);
        f[2 * i + 1] = bf16_bits_to_float(w[i] >> 16);
    }
}

__device__ __forceinline__ uint32_t float_to_bf16_bits(float f) {
    return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(f)));
}

__device__ __forceinline__ int4 pack_bf16x8(const float (&f)[8]) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = float_to_bf16_bits(f[2 * i]) | (float_to_bf16_bits(f[2 * i + 1]) << 16);
    return make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]), static_cast<int>(w[3]));
}

// Round a positive normal float up to a power of two, exactly (mantissa cleared, exponent bumped).
__device__ __forceinline__ float round_up_pow2(float s) {
    uint32_t bits = __float_as_uint(s);
    if (bits & 0x007fffffu) bits = (bits & 0x7f800000u) + 0x00800000u;
    return __uint_as_float(bits);
}

__device__ __forceinline__ uint32_t fp8_e4m3(float v) {
    return static_cast<uint32_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// FP8 cast of 16 channels per lane (8 lanes per 128-channel block), the arithmetic of the reference's
// FP8 cast exactly: amax over the block (at least 1e-4), scale = amax / 448 (IEEE), optionally rounded up to a
// power of two, q = e4m3_satfinite(v / scale). Lanes whose block is past the row pass zeros.
__device__ __forceinline__ int4 cast16_fp8(const int4& r0, const int4& r1, bool active, bool round_scale,
                                           float& scale_out) {
    float v[16];
    if (active) {
        float fa[8], fb[8];
        unpack_bf16x8(r0, fa);
        unpack_bf16x8(r1, fb);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            v[i] = fa[i];
            v[8 + i] = fb[i];
        }
    } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = 0.0f;
    }
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 2));
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 4));
    amax = fmaxf(amax, 1e-4f);
    float scale = __fdiv_rn(amax, 448.0f);
    if (round_scale) scale = round_up_pow2(scale);
    scale_out = scale;
    uint32_t w[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        w[q] = fp8_e4m3(__fdiv_rn(v[4 * q], scale)) | (fp8_e4m3(__fdiv_rn(v[4 * q + 1], scale)) << 8) |
               (fp8_e4m3(__fdiv_rn(v[4 * q + 2], scale)) << 16) | (fp8_e4m3(__fdiv_rn(v[4 * q + 3], scale)) << 24);
    }
    return make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]), static_cast<int>(w[3]));
}

// One warp casts a BF16 row [kHidden] to FP8 e4m3 with one float32 scale per 128 channels:
//   amax = max(max|x|, 1e-4), scale = amax / 448 (IEEE division), optionally rounded up to 2^k,
//   q = e4m3_satfinite(x / scale). Data go to dst[0 .. kHidden), scales to dst_scales[kHidden / 128].
// Each lane handles 16 consecutive channels per step, so 8 lanes cover one block; the loads of two
// steps are in flight together.
template <int kHidden>
__device__ __forceinline__ void cast_row_fp8(const uint16_t* __restrict__ src, uint8_t* dst, float* dst_scales,
                                             bool round_scale, int lane) {
    static_assert(kHidden % kChannelsPerBlock == 0, "FP8 rows need hidden % 128 == 0");
    constexpr int kPerStep = 32 * 16;
    constexpr int kSteps = (kHidden + kPerStep - 1) / kPerStep;
    constexpr int kBatch = 2;
#pragma unroll 1
    for (int s0 = 0; s0 < kSteps; s0 += kBatch) {
        int4 raw[kBatch][2];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
            const int col = (s0 + j) * kPerStep + lane * 16;
            if (s0 + j < kSteps && col < kHidden) {
                raw[j][0] = ld_nc_v4_no_prefetch(src + col);
                raw[j][1] = ld_nc_v4_no_prefetch(src + col + 8);
            }
        }
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
            if (s0 + j >= kSteps) break;  // uniform over the warp
            const int col = (s0 + j) * kPerStep + lane * 16;
            const bool active = col < kHidden;
            float scale;
            const int4 q = cast16_fp8(raw[j][0], raw[j][1], active, round_scale, scale);
            if (active) {
                st_na_v4(reinterpret_cast<int4*>(dst + col), q);
                if ((lane & 7) == 0) dst_scales[col / kChannelsPerBlock] = scale;
            }
        }
    }
}

// A received row's FP8 scales, held in registers between loading them from the message and storing them
// into the scale outputs ([local expert][block][slab rows], float32; or, with use_ue8m0, four UE8M0
// exponents packed per int32), so one load serves several output rows. Whole warp: lane l holds scale
// (or packed word) l + 32 i.
template <int kNumScales>
struct RecvScales {
    static constexpr int kWords = (kNumScales + 3) / 4;
    static constexpr int kRegs = kNumScales > 32 ? (kNumScales + 31) / 32 : 1;
    uint32_t v[kRegs];

    __device__ __forceinline__ void load(const uint8_t* scales, bool use_ue8m0, int lane) {
#pragma unroll
        for (int i = 0; i < kRegs; ++i) {
            const int w = lane + 32 * i;
            uint32_t word = 0;
            if (use_ue8m0) {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int b = 4 * w + j;
                    if (w < kWords && b < kNumScales) word |= ((ld_cg_u32(scales + 4 * b) >> 23) & 0xffu) << (8 * j);
                }
            } else if (w < kNumScales) {
                word = ld_cg_u32(scales + 4 * w);
            }
            v[i] = word;
        }
    }

    __device__ __forceinline__ void store(bool use_ue8m0, float* out_scales, int* out_scales_ue8m0, int le, int slab,
                                          int row, int lane) const {
#pragma unroll
        for (int i = 0; i < kRegs; ++i) {
            const int w = lane + 32 * i;
            if (use_ue8m0) {
                if (w < kWords) out_scales_ue8m0[(static_cast<size_t>(le) * kWords + w) * slab + row] = static_cast<int>(v[i]);
            } else if (w < kNumScales) {
                out_scales[(static_cast<size_t>(le) * kNumScales + w) * slab + row] = __uint_as_float(v[i]);
            }
        }
    }
};

template <int kNumScales>
__device__ __forceinline__ void store_recv_scales(const uint8_t* scales, bool use_ue8m0, float* out_scales,
                                                  int* out_scales_ue8m0, int le, int slab, int row, int lane) {
    RecvScales<kNumScales> s;
    s.load(scales, use_ue8m0, lane);
    s.store(use_ue8m0, out_scales, out_scales_ue8m0, le, slab, row, lane);
}

// ---- copies -----------------------------------------------------------------------------------------

enum class Load { kNonCoherent, kL2, kPlain };

template <Load kLoad>
__device__ __forceinline__ int4 load_v4(const int4* p) {
    if constexpr (kLoad == Load::kNonCoherent) return ld_nc_v4_no_prefetch(p);
    else if constexpr (kLoad == Load::kL2) return ld_cg_v4(p);
    else return ld_v4(p);
}

// One warp copies kInt4 16-byte words, four per lane in flight.
template <int kInt4, Load kLoad>
__device__ __forceinline__ void warp_copy(void* dst, const void* src, int lane) {
    constexpr int kIters = (kInt4 + 31) / 32;
    constexpr int kBatch = 4;
    int4* d = reinterpret_cast<int4*>(dst);
    const int4* s = reinterpret_cast<const int4*>(src);
#pragma unroll
    for (int i0 = 0; i0 < kIters; i0 += kBatch) {
        int4 r[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
            const int idx = (i0 + j) * 32 + lane;
            if (i0 + j < kIters && idx < kInt4) r[j] = load_v4<kLoad>(s + idx);
        }
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
            const int idx = (i0 + j) * 32 + lane;
            if (i0 + j < kIters && idx < kInt4) st_na_v4(d + idx, r[j]);
        }
    }
}

}  // namespace deepep_cupy::low_latency

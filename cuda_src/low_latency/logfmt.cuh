// LogFMT-10 codec of the low-latency combine (deepep_cupy/reference/quant.py defines the format).
//
// Block of 128 channels: lo / hi = min / max of log2|v| over nonzero v; step = (hi - lo) / 510;
// code 0 = zero, else (sign << 9) | (round((log2|v| - lo) / step) + 1). Wire block: float lo, float step,
// low code bytes [128], then 2-bit high parts packed 4 per byte [32] (channel i at bits 2*(i%4)).
//
// Speed over exactness: log2 and exp2 use the SFU approximations (lg2/ex2.approx, about 2^-22 relative
// error) and the encoder multiplies by 1/step instead of dividing. A value can therefore land one code
// away from the reference's (one code is a relative change of 2^step - 1, at most a few percent),
// which is inside the combine's LogFMT tolerance; the result is still deterministic. The decoder keeps
// the reference's float32 step (computed once, by the encoder, and sent in place of hi), multiply and add.
//
// Lane mapping: a lane holds 8 consecutive channels (one 16-byte BF16 load), so a half-warp holds one
// block and a warp two; min/max are reduced over the 16 lanes of each half with 4 shuffle rounds.
#pragma once

#include "low_latency/layout.cuh"

namespace deepep {
namespace ll {

// kLogfmtBlockBytes and kLogfmtLevels live in layout.cuh with the rest of the wire layout.
constexpr int kLogfmtHighOffset = 8 + 128;

__device__ __forceinline__ float lg2_approx(float x) {
    float y;
    asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));  // keeps subnormal inputs (no .ftz)
    return y;
}

__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Encode the block whose channels [8 * hl, 8 * hl + 8) this lane holds as 8 BF16 values in `raw` (hl =
// lane % 16) into blk. `active` must be the same over the half-warp (false: the half has no block; its
// lanes still take part in the shuffles). All 32 lanes of the warp must call it together.
__device__ __forceinline__ void logfmt_encode_block(const int4& raw, bool active, uint8_t* blk, int hl) {
    const uint32_t w[4] = {static_cast<uint32_t>(raw.x), static_cast<uint32_t>(raw.y), static_cast<uint32_t>(raw.z),
                           static_cast<uint32_t>(raw.w)};
    float lg[8];
    uint32_t bits[8];
    float lo = __int_as_float(0x7f800000);  // +inf
    float hi = __int_as_float(0xff800000);  // -inf
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        bits[i] = active ? (w[i / 2] >> (16 * (i % 2))) & 0xffffu : 0u;
        const uint32_t mag = bits[i] & 0x7fffu;
        lg[i] = lg2_approx(__uint_as_float(mag << 16));  // |v| as float32, exactly
        if (mag != 0) {
            lo = fminf(lo, lg[i]);
            hi = fmaxf(hi, lg[i]);
        }
    }
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) {
        lo = fminf(lo, __shfl_xor_sync(kFullMask, lo, o));
        hi = fmaxf(hi, __shfl_xor_sync(kFullMask, hi, o));
    }
    if (lo > hi) {  // no nonzero value in the block
        lo = 0.0f;
        hi = 0.0f;
    }
    const float step = __fdiv_rn(__fsub_rn(hi, lo), static_cast<float>(kLogfmtLevels));
    const float inv = step > 0.0f ? __frcp_rn(step) : 0.0f;  // 0: every nonzero value gets m = 0
    uint32_t low[2] = {0u, 0u};
    uint32_t high = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        int m = __float2int_rn(__fmul_rn(__fsub_rn(lg[i], lo), inv));
        m = min(max(m, 0), kLogfmtLevels);
        const uint32_t code = (bits[i] & 0x7fffu) != 0 ? ((bits[i] >> 15) << 9) | static_cast<uint32_t>(m + 1) : 0u;
        low[i / 4] |= (code & 0xffu) << (8 * (i % 4));
        high |= (code >> 8) << (2 * i);
    }
    if (active) {
        *reinterpret_cast<uint2*>(blk + 8 + hl * 8) = make_uint2(low[0], low[1]);
        *reinterpret_cast<uint16_t*>(blk + kLogfmtHighOffset + hl * 2) = static_cast<uint16_t>(high);
        if (hl == 0) *reinterpret_cast<float2*>(blk) = make_float2(lo, step);
    }
}

// One warp encodes a BF16 row [kHidden] into dst (kHidden / 128 wire blocks), two blocks per step. dst
// may alias src (the staged zero-copy path): each step loads before any lane stores, and the blocks a
// step writes end at or before the first source byte of the next step (168 <= 256 bytes per block).
template <int kHidden, Load kLoad>
__device__ __forceinline__ void logfmt_encode_row(const uint16_t* src, uint8_t* dst, int lane) {
    static_assert(kHidden % kChannelsPerBlock == 0, "LogFMT rows need hidden % 128 == 0");
    constexpr int kBlocks = kHidden / kChannelsPerBlock;
    const int half = lane / 16, hl = lane % 16;
#pragma unroll 1
    for (int b0 = 0; b0 < kBlocks; b0 += 2) {
        const int b = b0 + half;
        const bool active = b < kBlocks;
        int4 raw = make_int4(0, 0, 0, 0);
        if (active) raw = load_v4<kLoad>(reinterpret_cast<const int4*>(src + b * kChannelsPerBlock + hl * 8));
        __syncwarp();
        logfmt_encode_block(raw, active, dst + b * kLogfmtBlockBytes, hl);
        __syncwarp();
    }
}

// The wire bytes one lane needs to decode channels [col, col + 8) of a received row.
struct LogfmtPiece {
    float2 meta;  // lo, step
    uint2 low;
    uint32_t high;
};

// Plain L2 loads (no volatile asm), so that the caller can have the pieces of all its top-k rows in
// flight at once. Only called after the row's arrival was acquired.
__device__ __forceinline__ LogfmtPiece logfmt_load8(const uint8_t* row, int col) {
    const int j = (col % kChannelsPerBlock) / 8;
    const uint8_t* blk = row + (col / kChannelsPerBlock) * kLogfmtBlockBytes;
    LogfmtPiece p;
    p.meta = __ldcg(reinterpret_cast<const float2*>(blk));
    p.low = __ldcg(reinterpret_cast<const uint2*>(blk + 8 + j * 8));
    p.high = __ldcg(reinterpret_cast<const unsigned short*>(blk + kLogfmtHighOffset + j * 2));
    return p;
}

// Decode a piece to float32, rounded to BF16 as the combine wants.
__device__ __forceinline__ void logfmt_decode8(const LogfmtPiece& p, float (&f)[8]) {
    // The encoder's step travels with the block: an IEEE division per 8 values here cost more than the
    // rest of the decode.
    const float lo = p.meta.x, step = p.meta.y;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const uint32_t byte = ((i < 4 ? p.low.x : p.low.y) >> (8 * (i % 4))) & 0xffu;
        const uint32_t code = byte | (((p.high >> (2 * i)) & 3u) << 8);
        const uint32_t mag = code & 0x1ffu;
        const float e = __fadd_rn(lo, __fmul_rn(static_cast<float>(mag - 1u), step));
        float x = ex2_approx(e);
        x = bf16_bits_to_float(float_to_bf16_bits(x));
        x = (code & 0x200u) ? -x : x;
        f[i] = mag != 0 ? x : 0.0f;
    }
}

}  // namespace ll
}  // namespace deepep

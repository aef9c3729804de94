// LogFMT-10 codec of the low-latency combine (deepep_cupy/reference/quant.py defines the format).
//
// Block of 128 channels: lo / hi = min / max of log2|v| over nonzero v; step = (hi - lo) / 510;
// code 0 = zero, else (sign << 9) | (round((log2|v| - lo) / step) + 1). On the wire a row is a run of
// segments of 256 channels (two blocks; one for the last segment when the row has an odd block count):
// the low code bytes of its blocks [128 per block], their 2-bit high parts packed 4 per byte [32 per
// block] (channel i at bits 2*(i%4)), then float lo, float step per block [8 per block]: 168 bytes per
// block, segment s at 336 s, so that a warp writes a segment with 16-byte stores (it wrote three small
// stores per block before, 2 and 8 bytes per lane, and the LogFMT send moved fewer bytes than BF16's yet
// took longer).
//
// Speed over exactness: log2 and exp2 use the SFU approximations (lg2/ex2.approx, about 2^-22 relative
// error) and the encoder multiplies by 1/step instead of dividing. A value can therefore land one code
// away from the reference's (one code is a relative change of 2^step - 1, at most a few percent),
// which is inside the combine's LogFMT tolerance; the result is still deterministic. The decoder keeps
// the reference's float32 step (computed once, by the encoder, and sent in place of hi), multiply and add.
//
// Lane mapping: a lane holds 8 consecutive channels (one 16-byte BF16 load), so a half-warp holds one
// block and a warp a segment; min/max are reduced over the 16 lanes of each half with 4 shuffle rounds.
#pragma once

#include "common/ptx.cuh"
#include "low_latency/buffer_map.cuh"
#include "low_latency/rows.cuh"

namespace deepep_cupy::low_latency {

// kLogfmtBlockBytes and kLogfmtLevels live in buffer_map.cuh with the rest of the wire format.
constexpr int kLogfmtSegBytes = 2 * kLogfmtBlockBytes;

// Encode the (one or two, nb) blocks of wire segment `seg`: lane L holds channels [8 L, 8 L + 8) of the
// segment as 8 BF16 values in `raw`; lanes 16..31 hold the second block (idle, zeros, when nb == 1). The
// lanes then gather their codes so that the segment leaves as 16-byte stores: even lanes write their own
// and their neighbour's low bytes, every eighth lane eight lanes' high parts, lane 0 the (lo, step)
// pairs. All 32 lanes call it together.
__device__ __forceinline__ void logfmt_encode_segment(const int4& raw, int nb, uint8_t* seg, int lane) {
    const bool active = lane / 16 < nb;
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
    for (int o = 1; o < 16; o <<= 1) {  // within each half-warp: one block
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
    // Low bytes: lane L's 8 at 8 L; even lanes store 16 (theirs and lane L + 1's).
    const uint32_t next0 = __shfl_down_sync(kFullMask, low[0], 1), next1 = __shfl_down_sync(kFullMask, low[1], 1);
    // High parts: lane L's 16 bits at 128 nb + 2 L; lanes 0 mod 8 gather lanes L .. L + 7.
    const uint32_t h2 = high | (__shfl_down_sync(kFullMask, high, 1) << 16);
    const uint32_t h4 = __shfl_down_sync(kFullMask, h2, 2);
    const uint32_t h6 = __shfl_down_sync(kFullMask, h2, 4), h8 = __shfl_down_sync(kFullMask, h4, 4);
    const float lo1 = __shfl_sync(kFullMask, lo, 16), step1 = __shfl_sync(kFullMask, step, 16);
    if (active && (lane & 1) == 0)
        *reinterpret_cast<uint4*>(seg + 8 * lane) = make_uint4(low[0], low[1], next0, next1);
    if (active && (lane & 7) == 0) *reinterpret_cast<uint4*>(seg + 128 * nb + 2 * lane) = make_uint4(h2, h4, h6, h8);
    if (lane == 0) {
        if (nb == 2) *reinterpret_cast<float4*>(seg + 320) = make_float4(lo, step, lo1, step1);
        else *reinterpret_cast<float2*>(seg + 160) = make_float2(lo, step);
    }
}

// One warp encodes a BF16 row [kHidden] into dst, one wire segment (256 channels) per step. dst may alias
// src (the staged zero-copy path): each step loads before any lane stores, and the segment a step writes
// ends at or before the first source byte of the next step (336 <= 512 bytes per segment).
template <int kHidden, Load kLoad>
__device__ __forceinline__ void logfmt_encode_row(const uint16_t* src, uint8_t* dst, int lane) {
    static_assert(kHidden % kChannelsPerBlock == 0, "LogFMT rows need hidden % 128 == 0");
    constexpr int kBlocks = kHidden / kChannelsPerBlock;
#pragma unroll 1
    for (int s = 0; 2 * s < kBlocks; ++s) {
        const int nb = min(2, kBlocks - 2 * s);
        int4 raw = make_int4(0, 0, 0, 0);
        if (lane / 16 < nb) raw = load_v4<kLoad>(reinterpret_cast<const int4*>(src + s * 256 + lane * 8));
        __syncwarp();
        logfmt_encode_segment(raw, nb, dst + s * kLogfmtSegBytes, lane);
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
template <int kBlocks>
__device__ __forceinline__ LogfmtPiece logfmt_load8(const uint8_t* row, int col) {
    const int b = col / kChannelsPerBlock, s = b / 2, h = b % 2, j = (col % kChannelsPerBlock) / 8;
    const int nb = (kBlocks % 2 == 1 && s == kBlocks / 2) ? 1 : 2;
    const uint8_t* seg = row + s * kLogfmtSegBytes;
    LogfmtPiece p;
    p.meta = __ldcg(reinterpret_cast<const float2*>(seg + 160 * nb + 8 * h));
    p.low = __ldcg(reinterpret_cast<const uint2*>(seg + 128 * h + 8 * j));
    p.high = __ldcg(reinterpret_cast<const unsigned short*>(seg + 128 * nb + 32 * h + 2 * j));
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

}  // namespace deepep_cupy::low_latency

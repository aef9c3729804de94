"""Number formats of the reference backend: FP8 per-128 cast, UE8M0 scales, LogFMT-10, fused multiply-add.

Every function here works on NumPy arrays, is deterministic (no platform-dependent float32
transcendental functions: logarithms and powers of two are evaluated in float64 and rounded once to
float32, or derived from the IEEE bits) and never modifies its inputs. The GPU kernels implement
exactly these definitions.

FP8 per-128 cast (``fp8_cast_per_128``)
    For each row and each block of 128 consecutive channels, in float32 arithmetic::

        amax  = max(max(|x_block|), 1e-4)
        scale = amax / 448                     # float32 division, rounded to nearest even
        scale = 2 ** ceil(log2(scale))         # only with round_scale (or UE8M0): exact, from the bits
        q     = e4m3(clip(x / scale, -448, 448))   # float32 division, then round-to-nearest-even

    The dequantised value is ``float32(q) * scale``.

UE8M0 (``scale_to_ue8m0``, ``pack_ue8m0``, ``unpack_ue8m0``)
    A power-of-two float32 scale ``2**e`` is stored as its biased exponent byte ``e + 127``
    (``(bits >> 23) & 0xff``). Four consecutive blocks share one int32: block ``4*i + j`` sits in byte
    ``j`` (bits ``8*j .. 8*j+7``) of word ``i``. When the number of blocks is not a multiple of four
    the unused high bytes of the last word are 0.

LogFMT-10 (``logfmt_encode``, ``logfmt_decode``)
    A block of values ``v`` (one block = the last axis, 128 channels in the combine) is described by
    two float32 numbers and one 10-bit code per value:

    * ``l(v) = float32(log2(|v|))`` (log2 evaluated in float64, rounded once to float32);
    * ``lo = min l(v)``, ``hi = max l(v)`` over the nonzero ``v`` of the block (both 0 when the block
      is all zeros);
    * ``step = (hi - lo) / 510`` (float32 division; 0 when ``hi == lo``);
    * ``m = rint((l(v) - lo) / step)`` (float32 subtraction and division, ties to even, clipped to
      ``[0, 510]``; ``m = 0`` when ``step == 0``);
    * code ``0`` means zero (both signed zeros encode to it, so ``-0.0`` decodes as ``+0.0``);
      otherwise ``code = (sign << 9) | (m + 1)`` with ``sign = 1`` for negative ``v``.

    Decoding gives ``(-1)**sign * float32(2 ** float32(lo + float32(m) * step))`` (the multiply and the
    add are two float32 operations, not fused; the power of two is evaluated in float64 and rounded once).
    The relative error of a nonzero value is at most ``2 ** (step / 2) - 1`` plus float32 rounding.
    The low-latency combine additionally rounds the decoded block to bfloat16.

Fused multiply-add (``fma_f32``)
    ``float32(a * b + c)`` with one rounding, as the GPU's ``fmaf`` computes it. Used for the weighted
    sum of the low-latency combine so that the reference is bit-identical to a kernel that writes
    ``acc += x * w`` (which the CUDA compilers contract into an FMA).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = np.float32(448.0)
AMAX_FLOOR = np.float32(1e-4)
BLOCK = 128

LOGFMT_LEVELS = 510  # magnitudes 0..510 map to codes 1..511; code 0 is zero


# --------------------------------------------------------------------------------------------------
# power-of-two helpers on float32 bits
# --------------------------------------------------------------------------------------------------
def round_up_pow2(scale: np.ndarray) -> np.ndarray:
    """Round positive normal float32 values up to a power of two (unchanged if already one).

    Exact: a value whose mantissa bits are all zero is returned as is; otherwise the exponent field is
    incremented and the mantissa cleared.
    """
    s = np.ascontiguousarray(scale, dtype=np.float32)
    bits = s.view(np.uint32)
    mant = bits & np.uint32(0x007FFFFF)
    expo = bits & np.uint32(0x7F800000)
    rounded = np.where(mant != 0, expo + np.uint32(0x00800000), expo).astype(np.uint32)
    return rounded.view(np.float32).reshape(s.shape)


def scale_to_ue8m0(scale: np.ndarray) -> np.ndarray:
    """Biased exponent byte ``(bits >> 23) & 0xff`` of float32 power-of-two scales, as uint8."""
    bits = np.ascontiguousarray(scale, dtype=np.float32).view(np.uint32)
    return ((bits >> np.uint32(23)) & np.uint32(0xFF)).astype(np.uint8)


def ue8m0_to_scale(exponent_bytes: np.ndarray) -> np.ndarray:
    """Inverse of ``scale_to_ue8m0``: the float32 ``2 ** (byte - 127)`` (byte 0 gives 0.0)."""
    bits = np.asarray(exponent_bytes).astype(np.uint32) << np.uint32(23)
    return bits.view(np.float32)


def pack_ue8m0(exponent_bytes: np.ndarray) -> np.ndarray:
    """Pack uint8 exponents ``[..., nb]`` into int32 ``[..., ceil(nb / 4)]``, block ``4i`` in the lowest byte."""
    e = np.asarray(exponent_bytes, dtype=np.uint8)
    nb = e.shape[-1]
    nw = -(-nb // 4)
    padded = np.zeros(e.shape[:-1] + (nw * 4,), dtype=np.uint32)
    padded[..., :nb] = e
    padded = padded.reshape(e.shape[:-1] + (nw, 4))
    words = (padded[..., 0] | (padded[..., 1] << np.uint32(8)) | (padded[..., 2] << np.uint32(16))
             | (padded[..., 3] << np.uint32(24)))
    return words.astype(np.uint32).view(np.int32)


def unpack_ue8m0(packed: np.ndarray, num_blocks: int | None = None) -> np.ndarray:
    """Unpack int32 words ``[..., nw]`` into uint8 exponents ``[..., num_blocks]`` (default ``4 * nw``)."""
    w = np.ascontiguousarray(packed, dtype=np.int32).view(np.uint32)
    parts = [((w >> np.uint32(8 * j)) & np.uint32(0xFF)).astype(np.uint8) for j in range(4)]
    out = np.stack(parts, axis=-1).reshape(w.shape[:-1] + (w.shape[-1] * 4,))
    return out if num_blocks is None else out[..., :num_blocks]


# --------------------------------------------------------------------------------------------------
# FP8 per-128 cast
# --------------------------------------------------------------------------------------------------
def fp8_cast_per_128(x: np.ndarray, *, round_scale: bool = False, use_ue8m0: bool = False):
    """Cast ``x [N, H]`` (any float dtype, H a multiple of 128) to e4m3 with one scale per 128 channels.

    Returns ``(q [N, H] float8_e4m3fn, scale [N, H/128] float32)``. ``use_ue8m0`` implies
    ``round_scale``; the scale is still returned as float32 (see ``scale_to_ue8m0``/``pack_ue8m0``).
    """
    x = np.asarray(x)
    n, h = x.shape
    if h % BLOCK:
        raise ValueError(f"FP8 cast needs hidden to be a multiple of {BLOCK}, got {h}")
    xf = x.astype(np.float32).reshape(n, h // BLOCK, BLOCK)
    amax = np.maximum(np.abs(xf).max(axis=-1, initial=np.float32(0)), AMAX_FLOOR).astype(np.float32)
    scale = (amax / FP8_MAX).astype(np.float32)
    if round_scale or use_ue8m0:
        scale = round_up_pow2(scale)
    scaled = (xf / scale[..., None]).astype(np.float32)
    q = np.clip(scaled, -FP8_MAX, FP8_MAX).astype(FP8).reshape(n, h)
    return q, scale


def fp8_dequant_per_128(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``float32(q) * scale`` broadcast per 128-channel block; returns float32 ``[N, H]``."""
    n, h = q.shape
    qf = q.astype(np.float32).reshape(n, h // BLOCK, BLOCK)
    return (qf * np.asarray(scale, dtype=np.float32)[..., None]).reshape(n, h)


# --------------------------------------------------------------------------------------------------
# LogFMT-10
# --------------------------------------------------------------------------------------------------
def _log2_f32(a: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log2(a.astype(np.float64)).astype(np.float32)


def logfmt_encode(v: np.ndarray):
    """Encode float32 blocks ``v [..., B]`` (one block per last-axis row).

    Returns ``(codes [..., B] uint16 (10 significant bits), lo [...] float32, hi [...] float32)``.
    """
    v = np.asarray(v, dtype=np.float32)
    nz = v != 0
    lg = np.where(nz, _log2_f32(np.abs(v)), np.float32(0)).astype(np.float32)
    any_nz = nz.any(axis=-1)
    lo = np.where(any_nz, np.where(nz, lg, np.float32(np.inf)).min(axis=-1, initial=np.float32(np.inf)),
                  np.float32(0)).astype(np.float32)
    hi = np.where(any_nz, np.where(nz, lg, np.float32(-np.inf)).max(axis=-1, initial=np.float32(-np.inf)),
                  np.float32(0)).astype(np.float32)
    step = ((hi - lo) / np.float32(LOGFMT_LEVELS)).astype(np.float32)
    safe = np.where(step > 0, step, np.float32(1)).astype(np.float32)
    m = np.rint(((lg - lo[..., None]).astype(np.float32) / safe[..., None]).astype(np.float32))
    m = np.where(step[..., None] > 0, np.clip(m, 0, LOGFMT_LEVELS), 0).astype(np.uint16)
    sign = (v < 0).astype(np.uint16)
    codes = np.where(nz, (sign << np.uint16(9)) | (m + np.uint16(1)), np.uint16(0)).astype(np.uint16)
    return codes, lo, hi


def logfmt_decode(codes: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Decode the output of ``logfmt_encode`` back to float32 ``[..., B]``."""
    codes = np.asarray(codes, dtype=np.uint16)
    lo = np.asarray(lo, dtype=np.float32)
    hi = np.asarray(hi, dtype=np.float32)
    step = ((hi - lo) / np.float32(LOGFMT_LEVELS)).astype(np.float32)
    mag = (codes & np.uint16(0x1FF)).astype(np.int32)
    m = np.maximum(mag - 1, 0).astype(np.float32)
    expo = (lo[..., None] + (m * step[..., None]).astype(np.float32)).astype(np.float32)
    val = np.exp2(expo.astype(np.float64)).astype(np.float32)
    val = np.where((codes >> np.uint16(9)) & np.uint16(1), -val, val)
    return np.where(mag == 0, np.float32(0), val).astype(np.float32)


def logfmt_roundtrip_bf16(rows: np.ndarray) -> np.ndarray:
    """What the combine receiver sees for bf16 ``rows [n, H]``: per-128 LogFMT then a bf16 cast."""
    n, h = rows.shape
    blocks = rows.astype(np.float32).reshape(n, h // BLOCK, BLOCK)
    codes, lo, hi = logfmt_encode(blocks)
    return logfmt_decode(codes, lo, hi).reshape(n, h).astype(BF16)


# --------------------------------------------------------------------------------------------------
# fused multiply-add
# --------------------------------------------------------------------------------------------------
def fma_f32(a, b, c) -> np.ndarray:
    """Correctly rounded float32 ``a * b + c`` (one rounding), element-wise with broadcasting.

    The float32 product is exact in float64; the float64 sum is made round-to-odd (using the exact
    TwoSum error) and then rounded to float32, which yields the correctly rounded result.
    """
    p = np.asarray(a, dtype=np.float32).astype(np.float64) * np.asarray(b, dtype=np.float32).astype(np.float64)
    c64 = np.asarray(c, dtype=np.float32).astype(np.float64)
    p, c64 = np.broadcast_arrays(p, c64)
    shape = p.shape
    p, c64 = p.ravel(), c64.ravel()
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    even = (s.view(np.uint64) & np.uint64(1)) == 0
    fix = (err != 0) & even & np.isfinite(s)
    s[fix] = np.nextafter(s[fix], np.where(err[fix] > 0, np.inf, -np.inf))
    return s.astype(np.float32).reshape(shape)

"""Number formats of the reference backend: FP8 per-128 cast, UE8M0, LogFMT-10, fused multiply-add."""

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from deepep_cupy.reference import quant

BF16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn


def _rand_bf16(rng, shape, spread=4.0):
    mag = np.exp2(rng.uniform(-spread, spread, shape))
    return (mag * rng.choice([-1.0, 1.0], shape)).astype(np.float32).astype(BF16)


# ------------------------------------------------------------------------------------------ FP8
def test_fp8_hand_example():
    x = np.zeros((1, 256), dtype=np.float32)
    x[0, :4] = [896.0, -1.0, 0.0, 3.0]  # block 0: amax 896 -> scale 2
    # block 1 is all zeros -> amax floor 1e-4
    q, s = quant.fp8_cast_per_128(x.astype(BF16))
    assert q.dtype == FP8 and s.dtype == np.float32 and s.shape == (1, 2)
    assert s[0, 0] == np.float32(2.0)
    assert s[0, 1] == np.float32(np.float32(1e-4) / np.float32(448.0))
    np.testing.assert_array_equal(q[0, :4].astype(np.float32), [448.0, -0.5, 0.0, 1.5])
    assert not q[0, 4:].astype(np.float32).any()


def test_round_up_pow2_hand():
    v = np.array([3.0, 4.0, 0.3, 1.0, 0.75, 2.0**-20 * 1.5], dtype=np.float32)
    np.testing.assert_array_equal(quant.round_up_pow2(v), np.array([4.0, 4.0, 0.5, 1.0, 1.0, 2.0**-19], np.float32))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("round_scale", [False, True])
def test_fp8_roundtrip_error(seed, round_scale):
    rng = np.random.default_rng(seed)
    x = _rand_bf16(rng, (7, 384), spread=6)
    x[3] = 0  # an all-zero token
    q, s = quant.fp8_cast_per_128(x, round_scale=round_scale)
    xf = x.astype(np.float32)
    amax = np.maximum(np.abs(xf.reshape(7, 3, 128)).max(-1), np.float32(1e-4))
    if round_scale:
        mant = s.view(np.uint32) & 0x7FFFFF
        assert not mant.any(), "scales must be powers of two"
        assert np.all(s >= amax / 448) and np.all(s < 2 * amax / 448)
    else:
        np.testing.assert_array_equal(s, (amax / np.float32(448)).astype(np.float32))
    deq = quant.fp8_dequant_per_128(q, s)
    srep = np.repeat(s, 128, axis=1)
    # e4m3: 3 mantissa bits (relative half-ulp 2**-4), subnormal spacing 2**-9 in units of the scale
    bound = np.maximum(np.abs(xf) * 2.0**-4, srep * 2.0**-10) * (1 + 1e-6)
    assert np.all(np.abs(deq - xf) <= bound)
    assert np.all(np.abs(q.astype(np.float32)) <= 448)
    assert not deq[3].any()


def test_fp8_saturates_not_nan():
    x = np.full((1, 128), 1.0, dtype=np.float32)
    x[0, 0] = 3.0e38  # huge amax; float32 division by the scale stays finite
    q, _ = quant.fp8_cast_per_128(x)
    assert np.isfinite(q.astype(np.float32)).all()


def test_fp8_rejects_bad_hidden():
    with pytest.raises(ValueError):
        quant.fp8_cast_per_128(np.zeros((2, 100), dtype=BF16))


# ------------------------------------------------------------------------------------------ UE8M0
def test_ue8m0_pack_hand():
    packed = quant.pack_ue8m0(np.array([[1, 2, 3, 4, 0x7F, 0x80]], dtype=np.uint8))
    assert packed.dtype == np.int32 and packed.shape == (1, 2)
    assert packed.view(np.uint32)[0, 0] == 0x04030201
    assert packed.view(np.uint32)[0, 1] == 0x0000807F


@pytest.mark.parametrize("seed", [0, 1])
def test_ue8m0_roundtrip_exact(seed):
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (5, 3, 16), dtype=np.uint8)
    np.testing.assert_array_equal(quant.unpack_ue8m0(quant.pack_ue8m0(b)), b)
    b = rng.integers(0, 256, (4, 6), dtype=np.uint8)
    np.testing.assert_array_equal(quant.unpack_ue8m0(quant.pack_ue8m0(b), 6), b)
    scales = np.exp2(rng.integers(-40, 40, (3, 8)).astype(np.float32))
    e = quant.scale_to_ue8m0(scales)
    np.testing.assert_array_equal(e.astype(np.int32) - 127, np.log2(scales).astype(np.int32))
    np.testing.assert_array_equal(quant.ue8m0_to_scale(e), scales)


# ------------------------------------------------------------------------------------------ LogFMT
def test_logfmt_hand_example():
    v = np.zeros((1, 8), dtype=np.float32)
    v[0, :4] = [1.0, -2.0, 4.0, 0.0]
    codes, lo, hi = quant.logfmt_encode(v)
    assert lo[0] == 0.0 and hi[0] == 2.0
    # step = 2/510: 1 -> m 0 -> code 1; -2 -> m 255 -> sign | 256; 4 -> m 510 -> code 511; zeros -> 0
    np.testing.assert_array_equal(codes[0, :4], [1, (1 << 9) | 256, 511, 0])
    assert not codes[0, 4:].any()
    dec = quant.logfmt_decode(codes, lo, hi)
    np.testing.assert_allclose(dec[0, :4], [1.0, -2.0, 4.0, 0.0], rtol=1e-6)


def test_logfmt_constant_magnitude_and_zero_block():
    v = np.array([[3.0, -3.0, 3.0, 0.0], [0.0, -0.0, 0.0, 0.0]], dtype=np.float32)
    codes, lo, hi = quant.logfmt_encode(v)
    np.testing.assert_array_equal(codes, [[1, 513, 1, 0], [0, 0, 0, 0]])
    assert lo[1] == 0 and hi[1] == 0
    dec = quant.logfmt_decode(codes, lo, hi)
    np.testing.assert_allclose(dec[0], v[0], rtol=1e-6)
    assert not dec[1].any() and not np.signbit(dec[1]).any()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_logfmt_error_bound_signs_zeros(seed):
    rng = np.random.default_rng(seed)
    v = _rand_bf16(rng, (6, 128), spread=3 + 3 * seed).astype(np.float32)
    v[rng.random(v.shape) < 0.1] = 0.0
    codes, lo, hi = quant.logfmt_encode(v)
    assert codes.max() < 1024
    dec = quant.logfmt_decode(codes, lo, hi)
    nz = v != 0
    assert np.array_equal(dec == 0, ~nz), "zeros must decode exactly and only zeros"
    assert np.array_equal(np.sign(dec), np.sign(v))
    step = ((hi - lo) / np.float32(510)).astype(np.float64)
    bound = np.exp2(step / 2) - 1 + 2.0**-20  # plus float32 rounding of log2, the step and exp2
    rel = np.abs(dec.astype(np.float64) / np.where(nz, v, 1) - 1)
    assert np.all(rel[nz] <= np.broadcast_to(bound[:, None], v.shape)[nz])
    assert np.all(lo <= hi)


def test_logfmt_roundtrip_bf16_shape():
    rng = np.random.default_rng(5)
    rows = _rand_bf16(rng, (3, 256))
    out = quant.logfmt_roundtrip_bf16(rows)
    assert out.dtype == BF16 and out.shape == rows.shape
    np.testing.assert_allclose(out.astype(np.float32), rows.astype(np.float32), rtol=0.03)


# ------------------------------------------------------------------------------------------ FMA
def _is_nearest_f32(r: np.float32, exact: Fraction) -> bool:
    up = np.nextafter(r, np.float32(np.inf))
    down = np.nextafter(r, np.float32(-np.inf))
    d = abs(Fraction(float(r)) - exact)
    return d <= abs(Fraction(float(up)) - exact) and d <= abs(Fraction(float(down)) - exact)


def test_fma_single_rounding():
    rng = np.random.default_rng(11)
    a = (1 + rng.integers(0, 2**23, 400) * 2.0**-23).astype(np.float32) * rng.choice([-1, 1], 400)
    b = (1 + rng.integers(0, 2**23, 400) * 2.0**-23).astype(np.float32)
    c = (-(a.astype(np.float64) * b) * (1 + rng.normal(0, 1e-6, 400))).astype(np.float32)
    r = quant.fma_f32(a, b, c)
    for i in range(400):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        assert _is_nearest_f32(r[i], exact), i
    # a case where the fused and the unfused results differ
    a1, b1, c1 = np.float32(1 + 2.0**-12), np.float32(1 + 2.0**-12), np.float32(-(1 + 2.0**-11))
    assert quant.fma_f32(a1, b1, c1) == np.float32(2.0**-24)
    assert np.float32(a1 * b1) + c1 == 0


def test_fma_double_rounding_case():
    # exact a*b + c = 1 + 2**-24 + 2**-60: just above a float32 tie; a plain float64 sum would hit the tie
    a = np.float32(2.0**-24 * (1 + 2.0**-12))
    b = np.float32(1 - 2.0**-12 + 2.0**-24)
    c = np.float32(1.0)
    assert np.float32(np.float64(a) * np.float64(b) + np.float64(c)) == np.float32(1.0)
    assert quant.fma_f32(a, b, c) == np.float32(1 + 2.0**-23)
    assert quant.fma_f32(-a, b, -c) == np.float32(-(1 + 2.0**-23))
    assert quant.fma_f32(np.array([[a]]), b, c).shape == (1, 1)

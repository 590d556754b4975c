"""flashcupy.fp8: scales, rounding and round trips against an independent float64 model of the formats."""
from __future__ import annotations

import math

import numpy as np
import pytest

from flashcupy import fp8

# (mantissa bits, exponent of the smallest normal) of the formats, from their definitions
SPEC = {"e4m3": (3, -6), "e5m2": (2, -14)}


def _round_model(v: np.ndarray, fmt: str) -> np.ndarray:
    """Round float64 values to the format, nearest with ties to even, by its grid alone: the spacing at
    |v| is 2^(max(floor(log2 |v|), emin) - mantissa bits)."""
    mbits, emin = SPEC[fmt]
    out = np.zeros_like(v)
    for idx, x in np.ndenumerate(v):
        if x == 0:
            continue
        e = max(math.floor(math.log2(abs(x))), emin)
        q = 2.0 ** (e - mbits)
        out[idx] = np.round(x / q) * q  # numpy rounds halves to even
    return out


def _inputs(rng, shape=(2, 3, 37, 16), outliers=True):
    x = rng.standard_normal(shape)
    if outliers:  # FlashAttention-3's outlier inputs: N(0, 1) + N(0, 100) * Bernoulli(0.001)
        x += rng.normal(0, 10, shape) * (rng.random(shape) < 0.001)
    return x.astype(np.float32)


GROUPS = [("tensor", None), ("head", None), ("block", 8), ("token", None)]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity,block", GROUPS)
def test_quantize_is_scale_then_round_to_nearest_even(rng, fmt, granularity, block):
    x = _inputs(rng)
    q = fp8.quantize(x, fmt, granularity, block)
    assert q.data.dtype.name == fp8.FORMATS[fmt][0] and q.data.shape == x.shape
    s = fp8.expand_scale(q).astype(np.float64)
    assert s.shape[:3] in {(1, 1, 1), x.shape[:2] + (1,), x.shape[:3]} and s.shape[3] == 1
    v = (x.astype(np.float32) / fp8.expand_scale(q)).astype(np.float64)  # x / s as the code computes it
    np.testing.assert_array_equal(q.data.astype(np.float64), _round_model(v, fmt))
    # every group's largest value lands on the format's largest finite value
    fmax = fp8.FORMATS[fmt][1]
    assert np.abs(q.data.astype(np.float64)).max() == fmax


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity,block", [("tensor", None), ("block", 16), ("token", None)])
def test_round_trip_error_is_within_half_a_step(rng, fmt, granularity, block):
    x = _inputs(rng).astype(np.float64)
    q = fp8.quantize(x.astype(np.float32), fmt, granularity, block)
    err = np.abs(fp8.dequantize(q).astype(np.float64) - x)
    mbits, emin = SPEC[fmt]
    s = np.broadcast_to(fp8.expand_scale(q), x.shape).astype(np.float64)
    bound = np.maximum(2.0 ** -(mbits + 1) * np.abs(x), 2.0 ** (emin - mbits - 1) * s) * (1 + 1e-6)
    assert (err <= bound).all(), float((err / bound).max())


def test_scales_are_group_amax_over_fmax_and_one_for_zero_groups(rng):
    x = _inputs(rng, (1, 2, 10, 8), outliers=False)
    x[0, 1] = 0.0
    q = fp8.quantize(x, "e4m3", "block", 4)
    assert q.scale.shape == (1, 2, 3, 1) and q.scale.dtype == np.float32
    for g, (lo, hi) in enumerate(((0, 4), (4, 8), (8, 10))):
        amax = np.float32(np.abs(x[0, 0, lo:hi]).max())
        assert q.scale[0, 0, g, 0] == np.float32(amax / np.float32(448.0))
    assert (q.scale[0, 1] == 1).all() and (q.data[0, 1].astype(np.float32) == 0).all()


def test_finer_scales_matter_only_when_an_outlier_pushes_values_into_subnormals(rng):
    """e4m3 is a floating-point format: dividing by a larger scale keeps every value's relative
    precision (2^-4) until the values fall below the smallest normal (2^-6 in units of s). An outlier of
    200 (FlashAttention-3's inputs reach about 40) leaves N(0, 1) values normal under one tensor scale:
    token scales gain little, the FA3 paper's finding that block quantization alone barely helps. An
    outlier of 1e5 pushes them into the subnormals: token scales cut the error by more than half."""
    def rmse(x, g):
        return float(np.sqrt(np.mean((fp8.dequantize(fp8.quantize(x, "e4m3", g)) - x) ** 2)))

    x = _inputs(rng, (1, 4, 256, 64))
    for outlier, (lo, hi) in ((200.0, (0.8, 1.0)), (1e5, (0.0, 0.5))):
        y = x.copy()
        y[0, 0, 3, 5] = outlier
        ratio = rmse(y, "token") / rmse(y, "tensor")
        assert lo <= ratio <= hi, (outlier, ratio)


@pytest.mark.parametrize("kwargs,exc,words", [
    ({"fmt": "e3m4"}, ValueError, ["fmt", "e4m3"]),
    ({"granularity": "row"}, ValueError, ["granularity", "token"]),
    ({"granularity": "block"}, ValueError, ["block", "positive int"]),
    ({"granularity": "block", "block": 0}, ValueError, ["block"]),
    ({"granularity": "token", "block": 8}, ValueError, ["block is only for"]),
])
def test_bad_arguments_are_refused(rng, kwargs, exc, words):
    with pytest.raises(exc) as info:
        fp8.quantize(_inputs(rng, (1, 1, 4, 8)), **kwargs)
    for w in words:
        assert w in str(info.value)


def test_bad_inputs_are_refused(rng):
    with pytest.raises(ValueError, match="4-D"):
        fp8.quantize(np.ones((4, 8), np.float32))
    with pytest.raises(TypeError, match="floating-point"):
        fp8.quantize(np.ones((1, 1, 4, 8), np.int32))
    x = _inputs(rng, (1, 1, 4, 8))
    x[0, 0, 1, 2] = np.inf
    with pytest.raises(ValueError, match="inf or NaN"):
        fp8.quantize(x)
    with pytest.raises(ValueError, match="extent >= 1"):
        fp8.quantize(np.ones((1, 1, 0, 8), np.float32))


@pytest.mark.parametrize("value,word", [(1e300, "a larger value"), (1e-300, "a group whose largest")])
def test_float64_values_float32_scales_cannot_carry_are_refused(rng, value, word):
    """A finite float64 1e300 is not "inf or NaN", and a token of magnitude 1e-300 would quantize to zeros
    silently (its float32 scale is 0): both are refused with the range quantize takes (1e-300 beside
    larger values in its group is fp8's ordinary rounding to zero); the edges of that range quantize and
    come back."""
    x = _inputs(rng, (1, 1, 4, 8)).astype(np.float64)
    x[0, 0, 1] = value
    with pytest.raises(ValueError, match=word) as info:
        fp8.quantize(x, "e4m3", "token")
    x[0, 0, 1] = 1.0
    x[0, 0, 1, 2] = 1e-300
    assert fp8.dequantize(fp8.quantize(x, "e4m3", "token"))[0, 0, 1, 2] == 0
    assert "float32" in str(info.value)
    for edge in (448.0 * 2.0 ** -149, float(np.finfo(np.float32).max)):
        y = np.full((1, 1, 2, 8), edge)
        back = fp8.dequantize(fp8.quantize(y))
        assert np.isfinite(back).all() and np.allclose(back, y, rtol=2 ** -3)


@pytest.mark.gpu
@pytest.mark.parametrize("granularity,block", GROUPS)
def test_cupy_arrays_get_the_same_bits_as_uint8(rng, granularity, block):
    import cupy

    x = _inputs(rng)
    host = fp8.quantize(x, "e4m3", granularity, block)
    dev = fp8.quantize(cupy.asarray(x), "e4m3", granularity, block)
    assert isinstance(dev.data, cupy.ndarray) and dev.data.dtype == cupy.uint8
    np.testing.assert_array_equal(cupy.asnumpy(dev.data), host.data.view(np.uint8))
    np.testing.assert_array_equal(cupy.asnumpy(dev.scale), host.scale)
    np.testing.assert_array_equal(cupy.asnumpy(fp8.dequantize(dev)), fp8.dequantize(host))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_tiny_groups_get_the_host_bits(rng, fmt, dtype):
    """Groups whose amax is below fmax * 2^-126 (scale subnormal in float32) and float32 subnormal inputs:
    CuPy's flush-to-zero arithmetic would give them a scale of 0 (and NaN data); quantize sees them in the
    bits and takes the host path, so the GPU returns the host's scales and bits."""
    import cupy

    fmax = fp8.FORMATS[fmt][1]
    x = rng.standard_normal((1, 3, 5, 8))
    x[:, 0] *= fmax * 2.0 ** -130            # head 0: normal float32 values, a subnormal scale
    x[:, 1] *= 2.0 ** -128                   # head 1: float32 subnormals (most of them)
    x = x.astype(dtype)
    for granularity in ("head", "token"):
        host = fp8.quantize(x, fmt, granularity)
        assert (host.scale[:, :2] < np.finfo(np.float32).tiny).all() and (host.scale > 0).all()
        dev = fp8.quantize(cupy.asarray(x), fmt, granularity)
        np.testing.assert_array_equal(cupy.asnumpy(dev.scale), host.scale)
        np.testing.assert_array_equal(cupy.asnumpy(dev.data), host.data.view(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_gpu_rounding_matches_ml_dtypes_on_every_value_and_tie(fmt):
    """Every finite value of the format, every midpoint between neighbours (ties: to even), values below
    half the smallest subnormal and signed zeros, with the tensor's amax at the format's maximum (scale 1,
    so x / s is x): the GPU's rounding (cvt.rn.satfinite, on compute capability >= 8.9) gives ml_dtypes'
    bits; on an older GPU the host path runs and this compares it with itself."""
    import cupy
    import ml_dtypes

    dt = np.dtype(ml_dtypes.float8_e4m3fn if fmt == "e4m3" else ml_dtypes.float8_e5m2)
    vals = np.arange(256, dtype=np.uint8).view(dt).astype(np.float32)
    pos = np.unique(vals[np.isfinite(vals) & (vals > 0)])
    mids = (pos[:-1] + pos[1:]) / 2
    tiny = np.array([pos[0] / 2, pos[0] / 4, pos[0] * 0.5001, 0.0, -0.0], np.float32)
    x = np.concatenate([pos, mids, -pos, -mids, tiny, -tiny]).astype(np.float32)
    assert np.all((mids > pos[:-1]) & (mids < pos[1:]))  # exact midpoints in float32
    x = x.reshape(1, 1, -1, 1)
    host = fp8.quantize(x, fmt, "tensor")
    dev = fp8.quantize(cupy.asarray(x), fmt, "tensor")
    assert host.scale.item() == 1.0 and cupy.asnumpy(dev.scale).item() == 1.0
    np.testing.assert_array_equal(cupy.asnumpy(dev.data), host.data.view(np.uint8))

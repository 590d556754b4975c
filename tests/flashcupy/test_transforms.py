"""flashcupy.transforms in float64: incoherent processing and key smoothing leave attention unchanged
(exactly, up to float64 rounding) and shrink the outliers they target; bad input is refused clearly."""
from __future__ import annotations

import numpy as np
import pytest

from flashcupy import reference
from flashcupy.transforms import hadamard, incoherent, rotation, smooth_keys


def _f64_inputs(rng, shape=(2, 6, 3, 97, 131, 64)):
    b, hq, hkv, nq, nk, d = shape
    return (rng.standard_normal((b, hq, nq, d)), rng.standard_normal((b, hkv, nk, d)),
            rng.standard_normal((b, hkv, nk, d)))


@pytest.mark.parametrize("d", [1, 2, 8, 64, 128, 256])
def test_hadamard_and_rotation_are_orthogonal(d):
    h = hadamard(d)
    np.testing.assert_array_equal(h @ h.T, d * np.eye(d))
    m = rotation(d, seed=5)
    assert np.max(np.abs(m @ m.T - np.eye(d))) < 1e-13


@pytest.mark.parametrize("causal", [False, True])
def test_incoherent_processing_keeps_attention(rng, causal):
    q, k, v = _f64_inputs(rng)
    k[..., 7] += 40.0  # an outlier channel
    qr, kr = incoherent(q, k, seed=3)
    o, lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    o2, lse2 = reference.attention(qr, kr, v, causal=causal, return_lse=True)
    assert np.max(np.abs(o2 - o)) < 1e-12 and np.max(np.abs(lse2 - lse)) < 1e-10
    # the outlier channel is spread over all 64: the largest |k| drops by about sqrt(64)
    assert np.max(np.abs(kr)) < 0.25 * np.max(np.abs(k))


def test_incoherent_keeps_dtype_and_module(rng):
    q, k, _ = (x.astype(np.float16) for x in _f64_inputs(rng, (1, 2, 1, 16, 24, 32)))
    qr, kr = incoherent(q, k)
    assert qr.dtype == np.float16 and kr.dtype == np.float16 and qr.shape == q.shape and kr.shape == k.shape


@pytest.mark.parametrize("causal", [False, True])
def test_smoothing_keys_keeps_the_output_and_shifts_the_lse(rng, causal):
    q, k, v = _f64_inputs(rng)
    bias = 30.0 * rng.standard_normal(64)  # a channel bias shared by every key
    k = k + bias
    ks, mean = smooth_keys(k)
    assert mean.shape == (2, 3, 1, 64) and np.max(np.abs(ks.mean(axis=2))) < 1e-12
    o, lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    o2, lse2 = reference.attention(q, ks, v, causal=causal, return_lse=True)
    assert np.max(np.abs(o2 - o)) < 1e-12
    # LSE(k) = LSE(k - mean) + scale * q . mean, per query row (its kv head's mean under GQA)
    shift = (q.reshape(2, 3, 2, 97, 64) @ np.swapaxes(mean, -1, -2)[:, :, None]).reshape(2, 6, 97) / 8.0
    fin = np.isfinite(lse)
    assert np.max(np.abs((lse2 + shift - lse)[fin])) < 1e-9
    assert np.max(np.abs(ks)) < 0.25 * np.max(np.abs(k))  # the bias is gone


@pytest.mark.parametrize("bad,exc,words", [
    (lambda q, k: incoherent(q[..., :48], k[..., :48]), ValueError, ["power of two", "48"]),
    (lambda q, k: incoherent(q, k.astype(np.float32)), ValueError, ["dtype", "float32"]),
    (lambda q, k: incoherent(q[0], k), ValueError, ["4-D"]),
    (lambda q, k: incoherent(q.tolist(), k), TypeError, ["numpy.ndarray or cupy.ndarray", "list"]),
    (lambda q, k: smooth_keys(k[0]), ValueError, ["k", "4-D"]),
    (lambda q, k: smooth_keys((k * 10).astype(np.int32)), TypeError, ["floating-point", "int32"]),
])
def test_bad_input_is_refused_clearly(rng, bad, exc, words):
    q, k, _ = _f64_inputs(rng, (1, 2, 1, 8, 8, 64))
    with pytest.raises(exc) as e:
        bad(q, k)
    for w in words:
        assert w in str(e.value), (w, str(e.value))

"""flashcupy.reference: the float64 truth, checked against SciPy, finite differences and the seed."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.special import logsumexp, softmax

from flashcupy import reference

SHAPES = [  # (B, Hq, Hkv, Nq, Nk, D)
    pytest.param((2, 3, 3, 7, 7, 8), id="mha-square"),
    pytest.param((1, 6, 2, 5, 11, 16), id="gqa-nq<nk"),
    pytest.param((2, 4, 1, 13, 6, 8), id="mqa-nq>nk"),
]


def _scipy_attention(q, k, v, causal, scale):
    """Per (b, h) loop over SciPy's softmax/logsumexp: an independent route to the same numbers."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    o = np.zeros_like(q)
    lse = np.full((b, hq, nq), -np.inf)
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hkv)
            s = scale * q[bi, h] @ k[bi, kh].T
            for i in range(nq):
                seen = [j for j in range(nk) if not causal or j <= i + nk - nq]
                if not seen:
                    continue
                lse[bi, h, i] = logsumexp(s[i, seen])
                o[bi, h, i] = softmax(s[i, seen]) @ v[bi, kh, seen]
    return o, lse


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_scipy(rng, shape, causal):
    b, hq, hkv, nq, nk, d = shape
    q = rng.standard_normal((b, hq, nq, d))
    k = rng.standard_normal((b, hkv, nk, d))
    v = rng.standard_normal((b, hkv, nk, d))
    scale = 0.37
    o, lse = reference.attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    o_ref, lse_ref = _scipy_attention(q, k, v, causal, scale)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], rtol=1e-12, atol=1e-12)


def test_seed_worked_example():
    """x = v = [1..6]: softmax(x) . v = 5.4329 (the seed's worked example)."""
    x = np.arange(1.0, 7.0)
    q = np.ones((1, 1, 1, 1))
    k = x.reshape(1, 1, 6, 1)
    o = reference.attention(q, k, k, scale=1.0)
    assert round(float(o[0, 0, 0, 0]), 4) == 5.4329


@pytest.mark.parametrize("q_shape,k_shape,words", [
    ((1, 2, 9, 8), (1, 2, 0, 8), ["every extent", "(1, 2, 0, 8)"]),
    ((1, 2, 0, 8), (1, 2, 4, 8), ["every extent"]),
    ((1, 2, 9, 8), (1, 2, 4, 16), ["q's B and D"]),
])
def test_empty_or_mismatched_shapes_are_refused_clearly(rng, q_shape, k_shape, words):
    q, k = rng.standard_normal(q_shape), rng.standard_normal(k_shape)
    for call in (lambda: reference.attention(q, k, k), lambda: reference.attention_backward(q, q, k, k)):
        with pytest.raises(ValueError) as e:
            call()
        assert all(w in str(e.value) for w in words), str(e.value)


def test_empty_rows_are_zero_with_neg_inf_lse(rng):
    """Causal with Nq > Nk: the first Nq - Nk rows see no key."""
    q = rng.standard_normal((1, 2, 9, 8))
    k = rng.standard_normal((1, 2, 4, 8))
    o, lse = reference.attention(q, k, k, causal=True, return_lse=True)
    assert np.all(o[:, :, :5] == 0) and np.all(np.isneginf(lse[:, :, :5]))
    assert np.all(np.isfinite(lse[:, :, 5:])) and np.all(np.abs(o[:, :, 5:]).sum(-1) > 0)
    do = rng.standard_normal(q.shape)
    dq, dk, dv = reference.attention_backward(do, q, k, k, causal=True)
    assert np.all(dq[:, :, :5] == 0)


def test_row_chunking_changes_nothing(rng, monkeypatch):
    q = rng.standard_normal((2, 4, 37, 8))
    k = rng.standard_normal((2, 2, 29, 8))
    v = rng.standard_normal((2, 2, 29, 8))
    do = rng.standard_normal(q.shape)
    whole = reference.attention(q, k, v, causal=True, return_lse=True)
    whole_bwd = reference.attention_backward(do, q, k, v, causal=True)
    monkeypatch.setattr(reference, "_CHUNK_ELEMENTS", 2 * 4 * 29 * 3)  # 3 rows per chunk
    assert len(list(reference._chunks(37, 2, 4, 29))) == 13
    chunked = reference.attention(q, k, v, causal=True, return_lse=True)
    chunked_bwd = reference.attention_backward(do, q, k, v, causal=True)
    for a, b in zip(whole + whole_bwd, chunked + chunked_bwd):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)


def _assert_matches_central_differences(grads, loss, inputs, eps: float = 1e-6):
    """(dq, dk, dv) against central differences of the float64 ``loss(q, k, v)``, element by element."""
    for which, x in enumerate(inputs):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            args = [a.copy() for a in inputs]
            args[which][idx] += eps
            plus = loss(*args)
            args[which][idx] -= 2 * eps
            num[idx] = (plus - loss(*args)) / (2 * eps)
        np.testing.assert_allclose(grads[which], num, rtol=1e-6, atol=1e-7,
                                   err_msg="dq dk dv"[3 * which:3 * which + 2])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_matches_finite_differences(rng, causal):
    b, hq, hkv, nq, nk, d = 1, 4, 2, 5, 7, 8
    q = rng.standard_normal((b, hq, nq, d))
    k = rng.standard_normal((b, hkv, nk, d))
    v = rng.standard_normal((b, hkv, nk, d))
    do = rng.standard_normal((b, hq, nq, d))
    scale = 0.45
    grads = reference.attention_backward(do, q, k, v, causal=causal, scale=scale)

    def loss(q_, k_, v_):
        return float(np.sum(do * reference.attention(q_, k_, v_, causal=causal, scale=scale)))

    _assert_matches_central_differences(grads, loss, (q, k, v))


def test_accepts_16_bit_and_bfloat16_inputs(rng):
    import ml_dtypes

    x = rng.standard_normal((1, 1, 4, 8))
    for dt in (np.float16, ml_dtypes.bfloat16, np.float32):
        xd = x.astype(dt)
        o = reference.attention(xd, xd, xd)
        assert o.dtype == np.float64
        np.testing.assert_allclose(o, reference.attention(xd.astype(np.float64), xd.astype(np.float64),
                                                          xd.astype(np.float64)), rtol=0, atol=0)


def test_backward_with_lse_gradient_matches_finite_differences(rng):
    """The loss sum(do * o) + sum(g * lse): dlse=g adds g_i * P_ij to dS."""
    b, hq, hkv, nq, nk, d = 1, 2, 1, 4, 6, 8
    q, do = rng.standard_normal((b, hq, nq, d)), rng.standard_normal((b, hq, nq, d))
    k, v = rng.standard_normal((b, hkv, nk, d)), rng.standard_normal((b, hkv, nk, d))
    g = rng.standard_normal((b, hq, nq))
    grads = reference.attention_backward(do, q, k, v, causal=True, dlse=g)

    def loss(q_, k_, v_):
        o, lse = reference.attention(q_, k_, v_, causal=True, return_lse=True)
        return float(np.sum(do * o) + np.sum(g * lse))

    _assert_matches_central_differences(grads, loss, (q, k, v))
    # dv does not see the LSE; dq and dk do
    plain = reference.attention_backward(do, q, k, v, causal=True)
    np.testing.assert_allclose(grads[2], plain[2], rtol=1e-12, atol=1e-12)
    assert np.abs(grads[0] - plain[0]).max() > 1e-3

"""flashcupy.reference: the float64 truth, checked against SciPy, finite differences and the seed."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.special import logsumexp, softmax

from flashcupy import reference
from tests.helpers import SCORE_VARIANTS, score_variant_args

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
                                   err_msg=("dq", "dk", "dv", "dsinks")[which])


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


# ---- the score variants: sliding window, softcap, ALiBi, sinks ----------------------------------------


def _brute_variants(q, k, v, scale, causal, window, softcap, sinks, slopes):
    """Per (b, h, i) loop over plain Python floats: each score capped, biased and masked by hand, the sink
    in the denominator; an independent route to the reference's numbers."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    left, right = window
    o = np.zeros_like(q)
    lse = np.full((b, hq, nq), -np.inf)
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hkv)
            for i in range(nq):
                ip = i + nk - nq
                terms = []
                for j in range(nk):
                    hidden = (causal and j > ip) or (left >= 0 and j < ip - left)
                    if hidden or (right >= 0 and j > ip + right):
                        continue
                    s = scale * float(q[bi, h, i] @ k[bi, kh, j])
                    if softcap:
                        s = softcap * np.tanh(s / softcap)
                    if slopes is not None:
                        slope = slopes[h] if slopes.ndim == 1 else slopes[bi, h]
                        s -= slope * abs(ip - j)
                    terms.append((s, j))
                logits = [s for s, _ in terms] + ([sinks[h]] if sinks is not None else [])
                if not logits:
                    continue
                lse[bi, h, i] = logsumexp(logits)
                for s, j in terms:
                    o[bi, h, i] += np.exp(s - lse[bi, h, i]) * v[bi, kh, j]
    return o, lse


def _variant_inputs(rng, shape, sinks, slopes):
    b, hq, hkv, nq, nk, d = shape
    q = rng.standard_normal((b, hq, nq, d))
    k, v = rng.standard_normal((b, hkv, nk, d)), rng.standard_normal((b, hkv, nk, d))
    args = score_variant_args(rng, b, hq, sinks, slopes)  # float64 here: the truth, and finite differences
    sink, slope = (None if x is None else x.astype(np.float64) for x in (args["sinks"], args["alibi_slopes"]))
    return q, k, v, sink, slope


@pytest.mark.parametrize("causal,window,softcap,sinks,slopes", SCORE_VARIANTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_variants_match_a_per_element_loop(rng, shape, causal, window, softcap, sinks, slopes):
    q, k, v, sink, slope = _variant_inputs(rng, shape, sinks, slopes)
    kw = dict(window_size=window, softcap=softcap, sinks=sink, alibi_slopes=slope)
    o, lse = reference.attention(q, k, v, causal=causal, scale=0.4, return_lse=True, **kw)
    o_ref, lse_ref = _brute_variants(q, k, v, 0.4, causal, window, softcap, sink, slope)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_ref))
    np.testing.assert_allclose(lse[np.isfinite(lse)], lse_ref[np.isfinite(lse_ref)], rtol=1e-12, atol=1e-12)
    assert np.abs(o).max() > 0


def test_causal_is_the_window_minus_one_zero_and_variants_change_the_output(rng):
    q, k, v, sink, slope = _variant_inputs(rng, (1, 2, 2, 9, 13, 8), True, "h")
    causal = reference.attention(q, k, v, causal=True)
    np.testing.assert_array_equal(reference.attention(q, k, v, window_size=(-1, 0)), causal)
    np.testing.assert_array_equal(reference.attention(q, k, v, causal=True, window_size=(-1, 3)), causal)
    plain = reference.attention(q, k, v)
    for kw in (dict(window_size=(2, 2)), dict(softcap=0.5), dict(sinks=sink), dict(alibi_slopes=slope)):
        assert np.abs(reference.attention(q, k, v, **kw) - plain).max() > 1e-3, kw


def test_a_sink_takes_its_share_and_a_row_that_sees_nothing_keeps_it(rng):
    """With sinks the probabilities of a row sum to 1 - exp(sink - LSE); a row whose window holds no key
    has o = 0 and LSE = its head's sink."""
    q, k, v, sink, _ = _variant_inputs(rng, (1, 2, 1, 6, 4, 8), True, None)
    o, lse = reference.attention(q, k, v, causal=True, sinks=sink, return_lse=True)
    rows_seeing_nothing = o[:, :, :2]  # Nq - Nk = 2 rows see no key under the causal mask
    np.testing.assert_array_equal(rows_seeing_nothing, 0.0)
    np.testing.assert_allclose(lse[0, :, :2], np.repeat(sink[:, None], 2, axis=1), rtol=0, atol=0)
    p, lse2, p_sink, _ = reference._probabilities(q.reshape(1, 1, 2, 6, 8), k[:, :, None], 8 ** -0.5,
                                                  np.arange(6), 6, 4, True,
                                                  ((-1, -1), 0.0, sink.reshape(1, 1, 2, 1, 1), None))
    np.testing.assert_allclose(p.sum(-1) + p_sink[..., 0], 1.0, rtol=1e-13)


@pytest.mark.parametrize("shape", [(1, 4, 2, 5, 8, 8), (1, 2, 1, 9, 5, 8)], ids=["nq<nk", "nq>nk"])
@pytest.mark.parametrize("causal,window,softcap,sinks,slopes", SCORE_VARIANTS)
def test_variant_backward_matches_finite_differences(rng, causal, window, softcap, sinks, slopes, shape):
    """dq, dk, dv and d sinks of sum(do * o) + sum(g * lse) against central differences (Nq > Nk: rows
    that see no key under a causal mask or a window, whose d sinks is their dlse)."""
    q, k, v, sink, slope = _variant_inputs(rng, shape, sinks, slopes)
    do, g = rng.standard_normal(q.shape), rng.standard_normal(q.shape[:3])
    kw = dict(window_size=window, softcap=softcap, alibi_slopes=slope)
    grads = reference.attention_backward(do, q, k, v, causal=causal, scale=0.45, dlse=g, sinks=sink, **kw)
    assert len(grads) == (4 if sinks else 3)

    def loss(q_, k_, v_, *s_):
        o, lse = reference.attention(q_, k_, v_, causal=causal, scale=0.45, return_lse=True,
                                     sinks=s_[0] if s_ else None, **kw)
        finite = np.isfinite(lse)
        return float(np.sum(do * o) + np.sum((g * lse)[finite]))

    _assert_matches_central_differences(grads, loss, (q, k, v, sink) if sinks else (q, k, v))


@pytest.mark.parametrize("kw,words", [
    (dict(window_size=(-2, 0)), "window_size entries"),
    (dict(window_size=3), "pair of ints"),
    (dict(softcap=-1.0), "softcap"),
    (dict(softcap=float("inf")), "softcap"),
    (dict(sinks=np.zeros(3)), "sinks"),
    (dict(sinks=np.array([0.0, np.nan])), "sinks"),
    (dict(alibi_slopes=np.zeros((2, 2, 1))), "alibi_slopes"),
], ids=["window-below", "window-scalar", "negative-cap", "inf-cap", "sinks-shape", "sinks-nan", "slopes"])
def test_bad_variant_arguments_are_refused(rng, kw, words):
    x = rng.standard_normal((1, 2, 4, 8))
    with pytest.raises((ValueError, TypeError), match=words):
        reference.attention(x, x, x, **kw)

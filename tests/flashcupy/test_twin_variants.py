"""The NumPy twin's score variants (issue 35: sliding window, softcap, ALiBi, sinks), computed as the
kernels will (raw scores, the scale folded into the exponent, tiles of block_n keys, the sink as the
online softmax's first term), against the float64 reference, forward and backward (d sinks included)."""
from __future__ import annotations

import numpy as np
import pytest

from flashcupy import _twin, naive, reference
from flashcupy._checks import backward_problem, forward_problem
from flashcupy.accuracy import assert_accurate, assert_lse_accurate, backward_reduction
from tests.helpers import SCORE_VARIANTS, do_qkv, score_variant_args

SHAPES = [  # (B, Hq, Hkv, Nq, Nk, D)
    pytest.param((2, 4, 2, 37, 70, 16), id="gqa-37x70"),
    pytest.param((1, 2, 1, 70, 37, 16), id="mqa-70x37"),
]


def _no_window(kw: dict) -> dict:
    """The twin's keyword arguments: the window travels in the problem's variant."""
    return {name: value for name, value in kw.items() if name != "window_size"}


@pytest.mark.parametrize("dname", ["f32", "bf16"])
@pytest.mark.parametrize("causal,window,softcap,sinks,slopes", SCORE_VARIANTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_twin_variants_match_the_reference(rng, shape, causal, window, softcap, sinks, slopes, dname):
    do, q, k, v = do_qkv(rng, shape, dname)
    kw = dict(window_size=window, softcap=softcap,
              **score_variant_args(rng, shape[0], shape[1], sinks, slopes))
    g = rng.standard_normal(q.shape[:3]).astype(np.float32)
    p = forward_problem(q, k, v, causal=causal, scale=None, block_m=None, block_n=16, accum="fp32",
                        kernel="simt", ablate=None, window_size=window)
    o, lse = _twin.forward(q, k, v, p, **_no_window(kw))
    o_ref, lse_ref = reference.attention(q, k, v, causal=causal, return_lse=True, **kw)
    # the package's accuracy rule: within a bound set by the naive same-precision attention's error
    assert_accurate(o, o_ref, naive.attention(q, k, v, causal=causal, **kw), dname, "fp32", what="o")
    assert_lse_accurate(lse, lse_ref, "fp32", what="lse")
    pb = backward_problem(do, q, k, v, o, lse, causal=causal, scale=None, block_m=None, block_n=16,
                          accum="fp32", kernel="simt", deterministic=True, window_size=window)
    grads = _twin.backward(do, q, k, v, o, lse, pb, dlse=g, **_no_window(kw))
    refs = reference.attention_backward(do, q, k, v, causal=causal, dlse=g, **kw)
    # the naive backward has no LSE gradient: its error is measured against the plain gradients
    naives = naive.attention_backward(do, q, k, v, causal=causal, **kw)
    plain = reference.attention_backward(do, q, k, v, causal=causal, **kw)
    assert len(grads) == len(refs) == len(naives) == (4 if sinks else 3)
    for name, a, r, n, nr in zip(("dq", "dk", "dv", "dsinks"), grads, refs, naives, plain):
        assert_accurate(a, r, n, dname, "fp32", kind="bwd", what=name, reduction=backward_reduction(q, k),
                        naive_ref=nr)


def test_a_window_costs_what_its_keys_cost_and_sinks_fill_empty_rows(rng):
    """Tile boundaries do not move a window's result (block_n 16 against 64), and with sinks a row that
    sees no key has o = 0 and lse = its head's sink."""
    _, q, k, v = do_qkv(rng, (1, 2, 1, 40, 24, 16), "f32")
    sinks = np.array([0.5, -1.0], dtype=np.float32)
    outs = []
    for bn in (16, 64):
        p = forward_problem(q, k, v, causal=True, scale=None, block_m=None, block_n=bn, accum="fp32",
                            kernel="simt", ablate=None, window_size=(5, 0))
        outs.append(_twin.forward(q, k, v, p, sinks=sinks))
    np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-6)
    o, lse = outs[0]
    np.testing.assert_array_equal(o[:, :, :16], 0)  # Nq - Nk = 16 rows see no key
    np.testing.assert_allclose(lse[0, :, :16], np.repeat(sinks[:, None], 16, axis=1), rtol=1e-6)


@pytest.mark.parametrize("causal,window,softcap,sinks,slopes", SCORE_VARIANTS)
def test_naive_variants_follow_the_reference(rng, causal, window, softcap, sinks, slopes):
    """The naive baseline sets the accuracy rule's bound: with float32 inputs it must be the reference's
    attention to float32 roundoff, variants and d sinks included (a naive that dropped a variant would
    widen the bound until any twin passed)."""
    shape = (2, 4, 2, 37, 70, 16)
    do, q, k, v = do_qkv(rng, shape, "f32")
    kw = dict(window_size=window, softcap=softcap,
              **score_variant_args(rng, shape[0], shape[1], sinks, slopes))
    outs = (naive.attention(q, k, v, causal=causal, **kw),
            *naive.attention_backward(do, q, k, v, causal=causal, **kw))
    refs = (reference.attention(q, k, v, causal=causal, **kw),
            *reference.attention_backward(do, q, k, v, causal=causal, **kw))
    assert len(outs) == len(refs)
    for name, a, r in zip(("o", "dq", "dk", "dv", "dsinks"), outs, refs):
        err = np.abs(a.astype(np.float64) - r).max()
        # (relative to the largest value, or to 1 where the truth is 0: a one-key window's dS)
        assert err <= 1e-5 * max(np.abs(r).max(), 1.0), f"{name}: {err:.3g} against {np.abs(r).max():.3g}"


def test_the_entry_points_run_the_variants_on_numpy_inputs(rng):
    """flashcupy.attention and attention_backward take the variants on NumPy inputs (the twin's bits;
    d sinks a fourth output); on CuPy inputs ALiBi is refused by name before any launch (checked here on
    the refusal itself: it runs right after the call's checks, from the problem's backend)."""
    import types

    import flashcupy

    do, q, k, v = do_qkv(rng, (1, 2, 1, 30, 41, 16), "f32")
    kw = dict(window_size=(6, 2), softcap=3.0, sinks=np.array([0.4, -0.3], dtype=np.float32),
              alibi_slopes=np.array([0.2, 0.1], dtype=np.float32))
    o, lse = flashcupy.attention(q, k, v, causal=True, return_lse=True, **kw)
    p = forward_problem(q, k, v, causal=True, scale=None, block_m=None, block_n=None, accum="fp32",
                        kernel="auto", ablate=None, window_size=kw["window_size"], softcap=kw["softcap"])
    assert p.variant.softcap == 3.0 and ".cap3." in p.variant.key + "."
    twin = _twin.forward(q, k, v, p, **_no_window(kw))
    assert np.array_equal(o, twin[0]) and np.array_equal(lse, twin[1])
    grads = flashcupy.attention_backward(do, q, k, v, o, lse, causal=True, **kw)
    assert len(grads) == 4 and grads[3].shape == (2,) and np.abs(grads[3]).max() > 0
    plain = flashcupy.attention(q, k, v, causal=True, window_size=[-1, -1], softcap=0)
    assert np.array_equal(plain, flashcupy.attention(q, k, v, causal=True))
    gpu = types.SimpleNamespace(backend="cuda", heads_q=2, batch=1)
    assert flashcupy._score_variants(gpu, None, None, q) == {}
    # the kernels' slopes are checked before any launch (the shape, the dtype, finite where readable)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(Hq,\) = \(2,\) or \(B, Hq\)"):
        flashcupy._score_variants(gpu, None, np.ones(3, np.float32), q)
    with pytest.raises(TypeError, match="alibi_slopes must be float32 or float64"):
        flashcupy._score_variants(gpu, None, np.ones(2, np.float16), q)
    with pytest.raises(ValueError, match="alibi_slopes must be finite"):
        flashcupy._score_variants(gpu, None, np.array([1.0, np.nan], np.float32), q)
    for bad in (None, True, "3"):
        with pytest.raises(TypeError, match="softcap must be a number"):
            flashcupy.attention(q, k, v, softcap=bad)
    for bad in (-1.0, float("inf"), 2.0 ** -17, 2.0 ** 33):
        with pytest.raises(ValueError, match="softcap must"):
            flashcupy.attention(q, k, v, softcap=bad)


def test_the_softcap_after_the_mask_leaks_e_to_the_minus_cap_per_masked_key(rng):
    """ablate='softcap_after_mask' (the twin's break): each masked key scores -c instead of -inf, so a row
    with M masked keys gains M e^(-c - lse) of denominator: the LSE moves by exactly that (to float32
    rounding), rows that see no key get a finite LSE, the intact order leaks nothing; the break needs a
    softcap and a mask to mean anything, and without a softcap it is refused."""
    import flashcupy

    _, q, k, v = do_qkv(rng, (1, 2, 1, 40, 30, 16), "f32")  # Nq > Nk: the first 10 rows see no key
    kw = dict(causal=True, scale=0.9, softcap=2.0)
    o_ref, lse_ref = reference.attention(q, k, v, return_lse=True, **kw)
    o, lse = flashcupy.attention(q, k, v, return_lse=True, ablate="softcap_after_mask", **kw)
    intact_o, intact_lse = flashcupy.attention(q, k, v, return_lse=True, **kw)
    seen = reference.visible_mask(np.arange(40), 40, 30, True)
    masked = (~seen).sum(axis=1).astype(np.float64)
    assert np.isneginf(lse_ref[..., :10]).all() and np.isfinite(lse).all()
    with np.errstate(divide="ignore"):  # (rows with no masked key: log 0 = -inf adds nothing)
        want = np.logaddexp(lse_ref, np.log(masked) - 2.0)  # lse_ref + log(1 + M e^(-c - lse_ref))
    np.testing.assert_allclose(lse, want, rtol=0, atol=1e-5)
    assert np.abs(o - o_ref).max() > 0.1  # the leak is visible in o
    np.testing.assert_allclose(intact_lse[..., 10:], lse_ref[..., 10:], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="needs softcap > 0"):
        flashcupy.attention(q, k, v, causal=True, ablate="softcap_after_mask")
    # the break lives on the problem, not in a kernel variant: no module compiles under its name
    from flashcupy import inspect

    var = inspect.forward_variant(q, k, v, causal=True, softcap=2.0, ablate="softcap_after_mask")
    assert var.ablate is None and "ablate" not in var.key
    with pytest.raises(ValueError, match="runs on the NumPy twin only"):
        inspect.Variant("fwd_simt", "f32", "fp32", 64, 64, 16, softcap=2.0, ablate="softcap_after_mask")


def test_alibi_rows_above_the_diagonal_measured_from_key_0(rng):
    """517 queries on 113 keys without a mask: the first 404 rows sit 1 to 404 places before key 0. The
    kernels (and the twin) measure their bias from max(i', 0) and give the LSE the difference back, so
    their biased scores stay small: with fp16 accumulators the far rows stay near the fp32 accumulators'
    error, as near the diagonal (300 x 300 causal). ``ablate="alibi_unshifted"`` (the twin only) measures
    from i' itself, which puts those raw scores near -1000, whose fp16 spacing is 0.5: tens of times the
    error. In fp32 the two agree to float32 roundings, and rows at or below the diagonal's start give the
    same bits; the LSE is the reference's either way."""
    import flashcupy

    q, k, v = do_qkv(rng, (2, 4, 2, 517, 113, 64), "f16")[1:]
    slopes = (2.0 ** (-8.0 * np.arange(1, 5) / 4)).astype(np.float32)
    ref, ref_lse = reference.attention(q, k, v, alibi_slopes=slopes, return_lse=True)

    def run(accum, ablate=None):
        o, lse = flashcupy.attention(q, k, v, accum=accum, kernel="mma", alibi_slopes=slopes, ablate=ablate,
                                     return_lse=True)
        return o, lse, float(np.abs(o.astype(np.float64) - ref).max() / np.abs(ref).max())

    (_, lse16, e16), (_, _, u16) = run("fp16"), run("fp16", "alibi_unshifted")
    (o32, lse32, e32), (u_o32, u_lse32, _) = run("fp32"), run("fp32", "alibi_unshifted")
    # (measured over seeds 0-2: shifted 2.3-3.1x the fp32 accumulators', unshifted 44-54x)
    assert e16 < 5 * e32 and u16 > 10 * e16, (e16, u16, e32)
    below = np.arange(517) >= 404  # i' >= 0: no shift
    np.testing.assert_array_equal(o32[:, :, below], u_o32[:, :, below])
    np.testing.assert_array_equal(lse32[:, :, below], u_lse32[:, :, below])
    np.testing.assert_allclose(o32.astype(np.float64), u_o32.astype(np.float64), rtol=0, atol=2e-3)
    assert_lse_accurate(lse32, ref_lse, "fp32")
    assert_lse_accurate(lse16, ref_lse, "fp16")
    with pytest.raises(ValueError, match="alibi_unshifted.*needs alibi_slopes"):
        flashcupy.attention(q, k, v, ablate="alibi_unshifted")


def test_sink_first_with_alibi_rows_above_the_diagonal(rng):
    """The twin's sink-first order (the sink's term starts the online softmax) with ALiBi: a row measured
    from key 0 starts from the sink in its own raised units, z / scale + a d0, so o and the LSE are the
    reference's, the break that exponentiates raw scores included."""
    shapes = ((2, 4, 130, 32), (2, 2, 77, 32), (2, 2, 77, 32))
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    slopes = rng.uniform(0.05, 0.5, (2, 4)).astype(np.float32)
    z = (3 * rng.standard_normal(4)).astype(np.float32)
    for ablate, x in ((None, q), ("max_subtraction", 0.2 * q)):
        p = forward_problem(x, k, v, causal=False, scale=None, block_m=None, block_n=None, accum="fp32",
                            kernel="auto", ablate=ablate, alibi=True)
        o, lse = _twin.forward(x, k, v, p, sinks=z, alibi_slopes=slopes, sink_first=True)
        ro, rl = reference.attention(x, k, v, sinks=z, alibi_slopes=slopes, return_lse=True)
        np.testing.assert_allclose(o, ro, rtol=0, atol=1e-5)
        np.testing.assert_allclose(lse, rl, rtol=0, atol=1e-5)

"""flashcupy.attention_backward on NumPy arrays (the twin) against float64 and finite differences."""
from __future__ import annotations

import numpy as np
import pytest

import flashcupy
from flashcupy import naive, reference
from flashcupy.accuracy import F32_BLOCK_INVARIANCE, assert_accurate, backward_reduction, max_abs_err
from tests.helpers import do_qkv, parametrize_causal

CASES = [  # (B, Hq, Hkv, Nq, Nk, D)
    pytest.param((1, 2, 2, 1, 1, 32), id="n1"),
    pytest.param((2, 6, 2, 113, 203, 40), id="gqa-113x203-d40"),
    pytest.param((1, 3, 1, 203, 113, 64), id="mqa-203x113-d64"),
]


@parametrize_causal
@pytest.mark.parametrize("accum", ["fp32", "fp16"])
@pytest.mark.parametrize("dname", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("shape", CASES)
def test_twin_backward_matches_reference(rng, shape, dname, accum, causal):
    do, q, k, v = do_qkv(rng, shape, dname)
    o, lse = flashcupy.attention(q, k, v, causal=causal, accum=accum, kernel="simt", return_lse=True)
    grads = flashcupy.attention_backward(do, q, k, v, o, lse, causal=causal, accum=accum, kernel="simt",
                                         block_n=32)
    refs = reference.attention_backward(do, q, k, v, causal=causal)
    naives = naive.attention_backward(do, q, k, v, causal=causal)
    for name, g, r, n, x in zip(("dq", "dk", "dv"), grads, refs, naives, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert_accurate(g, r, n, dname, accum, kind="bwd", what=name, reduction=backward_reduction(q, k))


def test_twin_backward_matches_finite_differences(rng):
    """fp32 twin gradients against central differences of the float64 loss sum(do * o)."""
    do, q, k, v = do_qkv(rng, (1, 2, 1, 9, 12, 8), "f32")
    o, lse = flashcupy.attention(q, k, v, causal=True, return_lse=True)
    grads = flashcupy.attention_backward(do, q, k, v, o, lse, causal=True, block_n=16)
    x64 = [x.astype(np.float64) for x in (q, k, v)]
    eps = 1e-5
    for which, g in enumerate(grads):
        num = np.zeros_like(x64[which])
        for idx in np.ndindex(num.shape):
            hi = [x.copy() for x in x64]
            lo = [x.copy() for x in x64]
            hi[which][idx] += eps
            lo[which][idx] -= eps
            num[idx] = np.sum(do * (reference.attention(*hi, causal=True)
                                    - reference.attention(*lo, causal=True))) / (2 * eps)
        np.testing.assert_allclose(g, num, atol=2e-5, rtol=1e-4)


def test_twin_backward_is_block_size_invariant_in_fp32(rng):
    do, q, k, v = do_qkv(rng, (1, 2, 2, 150, 260, 32), "f32")
    o, lse = flashcupy.attention(q, k, v, return_lse=True)
    a = flashcupy.attention_backward(do, q, k, v, o, lse, kernel="simt", block_n=16)
    b = flashcupy.attention_backward(do, q, k, v, o, lse, kernel="simt", block_n=64)
    for x, y in zip(a, b):
        assert np.abs(x - y).max() < F32_BLOCK_INVARIANCE["bwd"]


def test_backward_argument_checks(rng):
    do, q, k, v = do_qkv(rng, (1, 2, 2, 16, 16, 32), "f16")
    o, lse = flashcupy.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="do must have q's shape"):
        flashcupy.attention_backward(do[:, :, :8], q, k, v, o, lse)
    with pytest.raises(TypeError, match="o must have q's dtype"):
        flashcupy.attention_backward(do, q, k, v, o.astype(np.float32), lse)
    with pytest.raises(ValueError, match="lse must have shape"):
        flashcupy.attention_backward(do, q, k, v, o, lse[..., :4])
    with pytest.raises(TypeError, match="lse must be float32"):
        flashcupy.attention_backward(do, q, k, v, o, lse.astype(np.float64))
    with pytest.raises(TypeError, match="deterministic"):
        flashcupy.attention_backward(do, q, k, v, o, lse, deterministic="yes")
    with pytest.raises(TypeError, match="do must be a numpy.ndarray or cupy.ndarray"):
        flashcupy.attention_backward(do.tolist(), q, k, v, o, lse)
    with pytest.raises(ValueError, match="dlse must have lse's shape"):
        flashcupy.attention_backward(do, q, k, v, o, lse, dlse=lse[..., :4])
    with pytest.raises(TypeError, match="dlse must be float32"):
        flashcupy.attention_backward(do, q, k, v, o, lse, dlse=lse.astype(np.float16))
    with pytest.raises(TypeError, match="dlse must be a numpy.ndarray or cupy.ndarray"):
        flashcupy.attention_backward(do, q, k, v, o, lse, dlse=lse.tolist())


@pytest.mark.parametrize("dname", ["f32", "f16"])
def test_twin_backward_with_lse_gradient_matches_reference(rng, dname):
    """dlse folds into delta: the twin's gradients of sum(do * o) + sum(g * lse) against float64 within
    the accuracy rule, whose naive same-precision error is the plain backward's (the naive backward has
    no LSE term; folding it adds one fp32 subtraction)."""
    do, q, k, v = do_qkv(rng, (1, 4, 2, 37, 70, 32), dname)
    g = rng.standard_normal((1, 4, 37)).astype(np.float32)
    o, lse = flashcupy.attention(q, k, v, causal=True, return_lse=True)
    grads = flashcupy.attention_backward(do, q, k, v, o, lse, causal=True, dlse=g)
    refs = reference.attention_backward(do, q, k, v, causal=True, dlse=g)
    plain = reference.attention_backward(do, q, k, v, causal=True)
    naives = naive.attention_backward(do, q, k, v, causal=True)
    for name, x, r, r0, n in zip(("dq", "dk", "dv"), grads, refs, plain, naives):
        assert_accurate(x, r, n, dname, "fp32", kind="bwd", what=name, reduction=backward_reduction(q, k),
                        naive_ref=r0)
    assert max_abs_err(grads[0], plain[0]) > 100 * max_abs_err(grads[0], refs[0])  # the term is there

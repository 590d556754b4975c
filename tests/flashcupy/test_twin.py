"""The NumPy twin (flashcupy.attention on NumPy arrays) against the float64 reference."""
from __future__ import annotations

import numpy as np
import pytest

import flashcupy
from flashcupy import naive, reference
from flashcupy.accuracy import (
    F32_BLOCK_INVARIANCE,
    F32_NEAR_FLOAT64,
    assert_accurate,
    assert_lse_accurate,
    max_abs_err,
    tolerance,
)
from tests.helpers import LN_MAX, one_hot_score_inputs, parametrize_causal, qkv

DTYPES = ["f32", "f16", "bf16"]
CASES = [  # (B, Hq, Hkv, Nq, Nk, D)
    pytest.param((1, 2, 2, 1, 1, 32), id="n1"),
    pytest.param((2, 6, 2, 113, 203, 40), id="gqa-113x203-d40"),
    pytest.param((1, 3, 1, 203, 113, 64), id="mqa-203x113-d64"),
    pytest.param((1, 2, 2, 257, 257, 8), id="257-d8"),
]


@parametrize_causal
@pytest.mark.parametrize("accum", ["fp32", "fp16"])
@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("shape", CASES)
def test_twin_matches_reference(rng, shape, dname, accum, causal):
    q, k, v = qkv(rng, shape, dname)
    q0 = q.copy()
    o, lse = flashcupy.attention(q, k, v, causal=causal, accum=accum, kernel="simt", block_n=32,
                                 return_lse=True)
    assert o.dtype == q.dtype and o.shape == q.shape and lse.dtype == np.float32
    np.testing.assert_array_equal(q, q0)  # inputs untouched
    o_ref, lse_ref = reference.attention(q, k, v, causal=causal, return_lse=True)
    assert_accurate(o, o_ref, naive.attention(q, k, v, causal=causal), dname, accum, what="o")
    assert_lse_accurate(lse, lse_ref, accum, what="lse")


def test_twin_fp32_is_near_1e6(rng):
    q, k, v = qkv(rng, (1, 4, 4, 300, 517, 64), "f32")
    err = max_abs_err(flashcupy.attention(q, k, v, block_n=64, kernel="simt"), reference.attention(q, k, v))
    assert err < F32_NEAR_FLOAT64["fwd"]


@pytest.mark.parametrize("dname", DTYPES)
def test_intact_twin_is_block_size_invariant(rng, dname):
    """Changing the tiles changes only the rounding, never the function."""
    q, k, v = qkv(rng, (1, 2, 2, 200, 300, 32), dname)
    o_ref = reference.attention(q, k, v)
    outs = [flashcupy.attention(q, k, v, kernel="simt", block_m=bm, block_n=bn)
            for bm, bn in [(16, 16), (64, 32), (128, 128), (32, 128)]]
    base = max_abs_err(naive.attention(q, k, v), o_ref)
    for o in outs:
        assert max_abs_err(o, o_ref) <= tolerance(dname, "fp32", base)
    if dname == "f32":
        for o in outs[1:]:
            assert np.abs(o - outs[0]).max() < F32_BLOCK_INVARIANCE["fwd"]


@pytest.mark.parametrize("accum", ["fp32", "fp16"])
@pytest.mark.parametrize("dname", DTYPES)
def test_max_subtraction_break_overflows_at_ln_max(dname, accum):
    """Without the max subtraction exp(s) overflows the element type once s > ln(max finite)."""
    threshold = LN_MAX["f16" if accum == "fp16" else dname]  # fp16 accumulators: the fp16 sum overflows first
    below = one_hot_score_inputs(threshold - 0.3, dname)
    above = one_hot_score_inputs(threshold + 0.3, dname)
    kw = dict(scale=1.0, kernel="simt", ablate="max_subtraction", accum=accum)
    o_below = flashcupy.attention(*below, **kw)
    o_above = flashcupy.attention(*above, **kw)
    ref_below = reference.attention(*below, scale=1.0)
    ref_above = reference.attention(*above, scale=1.0)
    assert_accurate(o_below, ref_below, naive.attention(*below, scale=1.0), dname, accum,
                    what=f"max_subtraction just below ln(max)={threshold:.2f}")
    # Above: inf/NaN where P or O overflows, 0 where only the running sum did: broken either way.
    assert max_abs_err(o_above, ref_above) > 0.1
    if accum == "fp32" or dname == "f16":
        assert not np.any(np.isfinite(o_above[..., 5].astype(np.float64)))
    # The intact algorithm on the overflowing inputs: finite and accurate.
    intact = flashcupy.attention(*above, scale=1.0, kernel="simt", accum=accum)
    ref = reference.attention(*above, scale=1.0)
    assert_accurate(intact, ref, naive.attention(*above, scale=1.0), dname, accum, what="intact")


@pytest.mark.parametrize("dname", DTYPES)
def test_max_subtraction_break_is_harmless_for_small_scores(rng, dname):
    q, k, v = qkv(rng, (1, 2, 2, 100, 150, 32), dname)
    o = flashcupy.attention(q, k, v, ablate="max_subtraction", kernel="simt")
    ref = reference.attention(q, k, v)
    assert_accurate(o, ref, naive.attention(q, k, v), dname, "fp32", what="max_subtraction, |s| < 5")


def test_rescaling_break_exact_with_one_tile_wrong_with_two(rng):
    """The tutorial's setup (Under The Hood, ch. 8): B=2, H=4, N=256, D=32, blocks of 32."""
    q, k, v = qkv(rng, (2, 4, 4, 256, 256, 32), "f32")
    ref = reference.attention(q, k, v)
    broken = flashcupy.attention(q, k, v, ablate="rescaling", kernel="simt", block_m=32, block_n=32)
    err = max_abs_err(broken, ref)
    assert np.all(np.isfinite(broken)) and err > 1e-2, err
    one_tile = flashcupy.attention(q[:, :, :, :], k[:, :, :128], v[:, :, :128], ablate="rescaling",
                                   kernel="simt", block_n=128)
    assert max_abs_err(one_tile, reference.attention(q, k[:, :, :128], v[:, :, :128])) < 1e-5


def test_rescaling_break_lse_and_causal_empty_rows(rng):
    q, k, v = qkv(rng, (1, 2, 2, 40, 20, 16), "f32")
    for ablate in (None, "max_subtraction", "rescaling"):
        o, lse = flashcupy.attention(q, k, v, causal=True, ablate=ablate, kernel="simt", block_n=16,
                                     return_lse=True)
        assert np.all(o[:, :, :20] == 0) and np.all(np.isneginf(lse[:, :, :20]))
        assert np.all(np.isfinite(lse[:, :, 20:]))


def test_strided_bnhd_view_matches_contiguous(rng):
    x = rng.standard_normal((2, 50, 4, 16)).astype(np.float32)  # (B, N, H, D)
    q = x.transpose(0, 2, 1, 3)
    o = flashcupy.attention(q, q, q, causal=True)
    o2 = flashcupy.attention(*(np.ascontiguousarray(q),) * 3, causal=True)
    np.testing.assert_array_equal(o, o2)

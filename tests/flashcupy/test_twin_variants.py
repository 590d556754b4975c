"""The NumPy twin's score variants (issue 35: sliding window, softcap, ALiBi, sinks), computed as the
kernels will (raw scores, the scale folded into the exponent, tiles of block_n keys, the sink as the
online softmax's first term), against the float64 reference, forward and backward (d sinks included)."""
from __future__ import annotations

import numpy as np
import pytest

from flashcupy import _twin, reference
from flashcupy._checks import backward_problem, forward_problem
from tests.helpers import do_qkv

VARIANTS = [  # (causal, window, softcap, sinks?, slopes: None, "h" or "bh")
    pytest.param(False, (3, 2), 0.0, False, None, id="window"),
    pytest.param(True, (17, -1), 0.0, False, None, id="window-causal"),
    pytest.param(False, (0, 0), 0.0, False, None, id="window-diagonal"),
    pytest.param(False, (-1, -1), 1.5, False, None, id="softcap"),
    pytest.param(False, (-1, -1), 0.0, True, None, id="sinks"),
    pytest.param(True, (-1, -1), 0.0, True, None, id="sinks-causal"),
    pytest.param(False, (-1, -1), 0.0, False, "h", id="alibi"),
    pytest.param(True, (-1, -1), 0.0, False, "bh", id="alibi-per-batch-causal"),
    pytest.param(True, (20, 3), 4.0, True, "h", id="all"),
]
SHAPES = [  # (B, Hq, Hkv, Nq, Nk, D)
    pytest.param((2, 4, 2, 37, 70, 16), id="gqa-37x70"),
    pytest.param((1, 2, 1, 70, 37, 16), id="mqa-70x37"),
]
# the twin's error against float64, relative to the largest reference magnitude: float32 arithmetic (f32);
# bf16 operands and P rounded to bf16 before P V and dS before its products
TOLERANCE = {"f32": 2e-5, "bf16": 3e-2}


def _variant_args(rng, shape, sinks, slopes):
    b, hq = shape[0], shape[1]
    return dict(sinks=rng.standard_normal(hq).astype(np.float32) + 1.0 if sinks else None,
                alibi_slopes=None if slopes is None else
                rng.uniform(0.05, 0.6, (hq,) if slopes == "h" else (b, hq)).astype(np.float32))


def _close(name, got, ref, tol):
    ref = np.asarray(ref, dtype=np.float64)
    err = np.abs(np.asarray(got, dtype=np.float64) - ref).max()
    top = np.abs(ref).max()
    assert err <= tol * max(top, 1e-30), f"{name}: max error {err:.3g} against a largest value {top:.3g}"


@pytest.mark.parametrize("dname", ["f32", "bf16"])
@pytest.mark.parametrize("causal,window,softcap,sinks,slopes", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_twin_variants_match_the_reference(rng, shape, causal, window, softcap, sinks, slopes, dname):
    do, q, k, v = do_qkv(rng, shape, dname)
    kw = dict(window_size=window, softcap=softcap, **_variant_args(rng, shape, sinks, slopes))
    g = rng.standard_normal(q.shape[:3]).astype(np.float32)
    p = forward_problem(q, k, v, causal=causal, scale=None, block_m=None, block_n=16, accum="fp32",
                        kernel="simt", ablate=None)
    o, lse = _twin.forward(q, k, v, p, **kw)
    o_ref, lse_ref = reference.attention(q, k, v, causal=causal, return_lse=True, **kw)
    tol = TOLERANCE[dname]
    _close("o", o, o_ref, tol)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    finite = np.isfinite(lse_ref)
    _close("lse", lse[finite], lse_ref[finite], 1e-6)
    pb = backward_problem(do, q, k, v, o, lse, causal=causal, scale=None, block_m=None, block_n=16,
                          accum="fp32", kernel="simt", deterministic=True)
    grads = _twin.backward(do, q, k, v, o, lse, pb, dlse=g, **kw)
    refs = reference.attention_backward(do, q, k, v, causal=causal, dlse=g, **kw)
    assert len(grads) == len(refs) == (4 if sinks else 3)
    for name, a, r in zip(("dq", "dk", "dv", "dsinks"), grads, refs):
        _close(name, a, r, 2 * tol)


def test_a_window_costs_what_its_keys_cost_and_sinks_fill_empty_rows(rng):
    """Tile boundaries do not move a window's result (block_n 16 against 64), and with sinks a row that
    sees no key has o = 0 and lse = its head's sink."""
    _, q, k, v = do_qkv(rng, (1, 2, 1, 40, 24, 16), "f32")
    sinks = np.array([0.5, -1.0], dtype=np.float32)
    outs = []
    for bn in (16, 64):
        p = forward_problem(q, k, v, causal=True, scale=None, block_m=None, block_n=bn, accum="fp32",
                            kernel="simt", ablate=None)
        outs.append(_twin.forward(q, k, v, p, window_size=(5, 0), sinks=sinks))
    np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-6)
    o, lse = outs[0]
    np.testing.assert_array_equal(o[:, :, :16], 0)  # Nq - Nk = 16 rows see no key
    np.testing.assert_allclose(lse[0, :, :16], np.repeat(sinks[:, None], 16, axis=1), rtol=1e-6)

"""Sliding windows (issue 35) on every kernel family, forward and backward, against the float64
reference by the accuracy rule, into NaN-poisoned outputs. The windows' edges fall on and beside the
tiles' boundaries (64 and 128 keys), one side or both bounded, with and without causal; the shapes put
Nq above and below Nk, so that some rows see no key (o = 0, lse = -inf, zero gradients)."""
from __future__ import annotations

import numpy as np
import pytest

import flashcupy
from flashcupy import _checks, naive, reference
from flashcupy.accuracy import assert_accurate, assert_lse_accurate, assert_matches_twin, backward_reduction
from tests.helpers import (
    BWD_COMBOS,
    FWD_COMBOS,
    combo_id,
    do_qkv,
    run_backward_poisoned,
    run_poisoned,
    to_device,
)

pytestmark = pytest.mark.gpu

WINDOWS = [  # (causal, window_size)
    pytest.param(False, (64, 64), id="w64-64"),
    pytest.param(True, (127, -1), id="causal-w127"),
    pytest.param(True, (128, 0), id="causal-w128"),
    pytest.param(False, (0, 0), id="w0-0"),
    pytest.param(False, (37, -1), id="w37-inf"),
    pytest.param(False, (-1, 21), id="winf-21"),
]
SHAPES = [(300, 300), (113, 517), (517, 113)]


def _forward(rng, combo, shape, causal, window, d=64):
    kernel, dname, accum = combo
    host = do_qkv(rng, (1, 4, 2, *shape, d), dname)
    q, k, v = to_device(*host[1:])
    o, lse = run_poisoned(q, k, v, causal=causal, accum=accum, kernel=kernel, window_size=window)
    return host, (q, k, v), o, lse


@pytest.mark.parametrize("causal,window", WINDOWS)
@pytest.mark.parametrize("combo", FWD_COMBOS, ids=combo_id)
def test_window_forward_matches_reference(rng, combo, causal, window):
    import cupy

    kernel, dname, accum = combo
    for shape in SHAPES:
        host, dev, o, lse = _forward(rng, combo, shape, causal, window)
        what = f"{kernel} {dname} acc={accum} {shape} causal={causal} window={window}"
        o_ref, lse_ref = reference.attention(*host[1:], causal=causal, window_size=window, return_lse=True)
        assert_accurate(o, o_ref, naive.attention(*dev, causal=causal, window_size=window), dname, accum,
                        what=what)
        assert_lse_accurate(lse, lse_ref, accum, what=what)
        seen = reference.visible_mask(np.arange(shape[0]), *shape, causal, window).any(axis=1)
        np.testing.assert_array_equal(cupy.asnumpy(lse)[..., ~seen], -np.inf)
        np.testing.assert_array_equal(cupy.asnumpy(o.astype(cupy.float32))[..., ~seen, :], 0)


@pytest.mark.parametrize("ablate", [None, "rescaling"])
@pytest.mark.parametrize("combo", [("wgmma", "f16", "fp32"), ("mma", "bf16", "fp32"),
                                   ("simt", "f16", "fp16")], ids=combo_id)
def test_window_forward_matches_the_twin(rng, combo, ablate):
    """The kernels' rounding model holds with a window (the twin visits every tile, the kernels only
    those the window reaches: a tile no row of a CTA sees changes no bit of the model), the rescaling
    break included (each visited tile on its own max)."""
    import cupy

    kernel, dname, accum = combo
    host = do_qkv(rng, (1, 4, 2, 517, 300, 64), dname)[1:]
    kw = dict(causal=True, window_size=(100, 0), accum=accum, kernel=kernel, block_n=64, ablate=ablate)
    o_gpu = cupy.asnumpy(flashcupy.attention(*to_device(*host), **kw))
    assert_matches_twin(o_gpu, flashcupy.attention(*host, **kw), dname, accum, what=f"{kernel} {ablate}")


@pytest.mark.parametrize("causal,window", WINDOWS)
@pytest.mark.parametrize("combo", BWD_COMBOS, ids=combo_id)
def test_window_backward_matches_reference(rng, combo, causal, window):
    kernel, dname, accum = combo
    for shape in SHAPES:
        host, dev, o, lse = _forward(rng, combo, shape, causal, window)
        do = to_device(host[0])[0]
        refs = reference.attention_backward(*host, causal=causal, window_size=window)
        naives = naive.attention_backward(do, *dev, causal=causal, window_size=window)
        red = backward_reduction(*host[1:3])
        dets = (False, True) if kernel in ("mma", "wgmma") and accum == "fp32" else (True,)
        for det in dets:
            grads = run_backward_poisoned(do, *dev, o, lse, causal=causal, accum=accum, kernel=kernel,
                                          deterministic=det, window_size=window)
            for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
                assert_accurate(g, r, n, dname, accum, kind="bwd", reduction=red,
                                what=f"{kernel} {dname} acc={accum} {shape} causal={causal} window={window} "
                                     f"det={det} {name}")


@pytest.mark.parametrize("d", [64, 128])
def test_window_deterministic_backward_repeats_its_bits(rng, d):
    """The ordered dQ of the wgmma backward counts, per query tile, the key tiles the window reaches
    (a miscount would hang or drop an addition): two runs give the same bits, and they match the
    reference."""
    combo = ("wgmma", "bf16", "fp32")
    host, dev, o, lse = _forward(rng, combo, (1500, 2100), False, (200, 90), d=d)
    do = to_device(host[0])[0]
    runs = [run_backward_poisoned(do, *dev, o, lse, kernel="wgmma", deterministic=True, window_size=(200, 90))
            for _ in range(2)]
    for a, b in zip(*runs):
        assert bool((a == b).all())
    refs = reference.attention_backward(*host, window_size=(200, 90))
    naives = naive.attention_backward(do, *dev, window_size=(200, 90))
    for name, g, r, n in zip(("dq", "dk", "dv"), runs[0], refs, naives):
        assert_accurate(g, r, n, "bf16", "fp32", kind="bwd", reduction=backward_reduction(*host[1:3]),
                        what=f"d={d} {name}")


def test_window_wider_than_the_problem_runs_the_plain_kernel(rng):
    """A side that reaches past every key is unbounded: the plain (or causal) module runs, same bits."""
    host, dev, o, _ = _forward(rng, ("mma", "f16", "fp32"), (200, 300), True, (299, 5))
    o_causal, _ = run_poisoned(*dev, causal=True, kernel="mma")
    assert bool((o == o_causal).all())
    p = _checks.check_forward(*dev, causal=False, scale=None, block_m=None, block_n=None, accum="fp32",
                              kernel="mma", ablate=None, window_size=(299, 199))
    assert p.variant.window is None and not p.variant.causal

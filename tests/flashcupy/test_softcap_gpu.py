"""The softcap (issue 35: S <- c tanh(S / c) on the scaled scores, before the mask) on every kernel family,
forward and backward (both dQ paths), against the float64 reference by the accuracy rule, into
NaN-poisoned outputs. The scales put the scaled scores well into tanh's bend (standard deviations of 2.4 c
and 0.5 c), with masks (causal, a window) and shapes whose rows see no key (o = 0, lse = -inf)."""
from __future__ import annotations

import numpy as np
import pytest

import flashcupy
from flashcupy import naive, reference
from flashcupy.accuracy import (
    assert_accurate,
    assert_lse_accurate,
    assert_matches_twin,
    backward_reduction,
    softcap_score_error,
)
from flashcupy.inspect import kernel_build
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

CAPS = [  # (softcap, scale): scaled scores of standard deviation 8 scale against the cap
    pytest.param(4.0, 1.2, id="cap4-deep"),
    pytest.param(30.0, 2.0, id="cap30"),
]
MASKS = [  # (causal, window_size)
    pytest.param(False, (-1, -1), id="full"),
    pytest.param(True, (-1, -1), id="causal"),
    pytest.param(False, (64, 64), id="w64-64"),
]
SHAPES = [(300, 300), (113, 517), (517, 113)]


def _forward(rng, combo, shape, causal, window, cap, scale, d=64):
    kernel, dname, accum = combo
    host = do_qkv(rng, (1, 4, 2, *shape, d), dname)
    q, k, v = to_device(*host[1:])
    o, lse = run_poisoned(q, k, v, causal=causal, scale=scale, accum=accum, kernel=kernel, window_size=window,
                          softcap=cap)
    return host, (q, k, v), o, lse


@pytest.mark.parametrize("causal,window", MASKS)
@pytest.mark.parametrize("cap,scale", CAPS)
@pytest.mark.parametrize("combo", FWD_COMBOS, ids=combo_id)
def test_softcap_forward_matches_reference(rng, combo, cap, scale, causal, window):
    import cupy

    kernel, dname, accum = combo
    kw = dict(causal=causal, scale=scale, window_size=window, softcap=cap)
    for shape in SHAPES:
        host, dev, o, lse = _forward(rng, combo, shape, causal, window, cap, scale)
        what = f"{kernel} {dname} acc={accum} {shape} cap={cap} causal={causal} window={window}"
        o_ref, lse_ref = reference.attention(*host[1:], return_lse=True, **kw)
        assert_accurate(o, o_ref, naive.attention(*dev, **kw), dname, accum, what=what)
        assert_lse_accurate(lse, lse_ref, accum, what=what, score_error=softcap_score_error(dname, cap))
        seen = reference.visible_mask(np.arange(shape[0]), *shape, causal, window).any(axis=1)
        np.testing.assert_array_equal(cupy.asnumpy(lse)[..., ~seen], -np.inf)
        # the cap bites: without it the output is far from the capped reference
        if shape == (300, 300):
            plain = reference.attention(*host[1:], causal=causal, scale=scale, window_size=window)
            assert np.abs(plain - o_ref).max() > 0.05, what


# float32 inputs with a cap of 30 on scaled scores of standard deviation 16 (exponents of 40): the simt
# backward's gradients sit at 3.9-4.2x the naive float32 error, beyond the rule's 3x (measured on an H100:
# dq 6.2e-5 against a bound of 5.5e-5, dk 4.6e-5 against 4.3e-5, 113 x 517). The float32 kernels without
# a cap measured 2.4x (o) and 7-12x (gradients) the naive float32 error on scores of standard deviation 8
# (scale 1, D = 64, N = 2048: docs/design/score_variants.md), so the excess is the float32 kernels' at large
# exponents, not the softcap's (not measured without a cap at this test's scale 2). Strict, and on an
# assertion only: a fix makes these pass, and then they must be unmarked.
F32_CAP30_EXCESS = pytest.mark.xfail(strict=True, raises=AssertionError,
                                     reason="float32 kernels above the rule on scores with exponents near 40 "
                                            "(docs/design/score_variants.md)")


def _bwd_params():
    for combo in BWD_COMBOS:
        for cap in CAPS:
            for mask in MASKS:
                marks = (F32_CAP30_EXCESS,) if (combo[1] == "f32" and cap.id == "cap30"
                                                and mask.id in ("full", "causal")) else ()
                yield pytest.param(combo, *cap.values, *mask.values, marks=marks,
                                   id=f"{combo_id(combo)}-{cap.id}-{mask.id}")


@pytest.mark.parametrize("combo,cap,scale,causal,window", list(_bwd_params()))
def test_softcap_backward_matches_reference(rng, combo, cap, scale, causal, window):
    kernel, dname, accum = combo
    kw = dict(causal=causal, scale=scale, window_size=window, softcap=cap)
    for shape in SHAPES:
        host, dev, o, lse = _forward(rng, combo, shape, causal, window, cap, scale)
        do = to_device(host[0])[0]
        refs = reference.attention_backward(*host, **kw)
        naives = naive.attention_backward(do, *dev, **kw)
        red = backward_reduction(*host[1:3])
        dets = (False, True) if kernel in ("mma", "wgmma") and accum == "fp32" else (True,)
        for det in dets:
            grads = run_backward_poisoned(do, *dev, o, lse, accum=accum, kernel=kernel, deterministic=det,
                                          **kw)
            for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
                assert_accurate(g, r, n, dname, accum, kind="bwd", reduction=red,
                                what=f"{kernel} {dname} acc={accum} {shape} cap={cap} causal={causal} "
                                     f"window={window} det={det} {name}")


@pytest.mark.parametrize("combo", [("wgmma", "f16", "fp32"), ("mma", "bf16", "fp32"),
                                   ("simt", "f16", "fp16")], ids=combo_id)
def test_softcap_forward_matches_the_twin_with_an_accurate_tanh(rng, combo):
    """With the accurate tanh (FC_TANH_APPROX 0, the float32 inputs' default) the kernels follow the
    twin's rounding model, softcap included; the default tanh.approx of 16-bit inputs moves them off it
    by more than the model's tolerance at a deep cap, which is what ``analysis softcap`` measures."""
    import cupy

    kernel, dname, accum = combo
    host = do_qkv(rng, (1, 4, 2, 517, 300, 64), dname)[1:]
    kw = dict(causal=True, scale=1.2, softcap=4.0, accum=accum, kernel=kernel, block_n=64)
    twin = flashcupy.attention(*host, **kw)
    with kernel_build(defines={"FC_TANH_APPROX": 0}):
        o_gpu = cupy.asnumpy(flashcupy.attention(*to_device(*host), **kw))
    assert_matches_twin(o_gpu, twin, dname, accum, what=f"{kernel} accurate tanh")


@pytest.mark.parametrize("combo", [("wgmma", "f16", "fp32"), ("mma", "bf16", "fp32")], ids=combo_id)
def test_softcap_backward_at_d128_matches_reference(rng, combo):
    """D = 128, where the wgmma backward's softcap tile (64 queries, P's fragments formed with P) differs
    most from its plain one (80 queries): both dQ paths against float64."""
    kernel, dname, accum = combo
    kw = dict(causal=True, scale=1.4, window_size=(-1, -1), softcap=30.0)
    for shape in [(300, 300), (517, 113)]:
        host, dev, o, lse = _forward(rng, combo, shape, True, (-1, -1), 30.0, 1.4, d=128)
        do = to_device(host[0])[0]
        refs = reference.attention_backward(*host, **kw)
        naives = naive.attention_backward(do, *dev, **kw)
        for det in (False, True):
            grads = run_backward_poisoned(do, *dev, o, lse, accum=accum, kernel=kernel, deterministic=det,
                                          **kw)
            for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
                assert_accurate(g, r, n, dname, accum, kind="bwd", reduction=backward_reduction(*host[1:3]),
                                what=f"{kernel} d128 {shape} det={det} {name}")


def test_softcap_deterministic_backward_repeats_its_bits(rng):
    """The ordered dQ of the wgmma backward with a softcap (its 64-query tile): two runs, same bits."""
    combo = ("wgmma", "bf16", "fp32")
    host, dev, o, lse = _forward(rng, combo, (700, 900), False, (-1, -1), 30.0, 2.0, d=128)
    do = to_device(host[0])[0]
    runs = [run_backward_poisoned(do, *dev, o, lse, kernel="wgmma", deterministic=True, scale=2.0,
                                  softcap=30.0) for _ in range(2)]
    for a, b in zip(*runs):
        assert bool((a == b).all())


def test_softcap_is_refused_where_it_does_not_run():
    """The wgmma backward runs a softcap on its 64-query tile only; a bad cap is refused by name."""
    import cupy

    q = cupy.ones((1, 2, 64, 64), dtype=cupy.float16)
    with pytest.raises(ValueError, match="softcap at block_m=64, not 128"):
        flashcupy.attention_backward(q, q, q, q, q, cupy.zeros((1, 2, 64), cupy.float32), kernel="wgmma",
                                     softcap=30.0, block_m=128)
    with pytest.raises(ValueError, match=r"softcap must be 0 \(off\) or lie in"):
        flashcupy.attention(q, q, q, softcap=1e-9)
    with pytest.raises(ValueError, match="runs on NumPy inputs .the twin. only"):
        flashcupy.attention(q, q, q, causal=True, softcap=3.0, ablate="softcap_after_mask")

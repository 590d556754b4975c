"""Attention sinks merged after the key loop (``flashcupy._sinks``), on the NumPy side: the order against
the online softmax started from the sink (the twin's ``sink_first``), and the argument checks."""
from __future__ import annotations

import numpy as np
import pytest

import flashcupy
from flashcupy import _sinks, _twin, reference
from flashcupy._checks import forward_problem, numpy_dtype


def _problem(q, k, v):
    return forward_problem(q, k, v, causal=False, scale=None, block_m=None, block_n=None, accum="fp32",
                           kernel="auto", ablate=None, window_size=(-1, -1), softcap=0.0)


@pytest.mark.parametrize("dname", ["f16", "bf16"])
def test_a_dominant_sink_collapses_fp16_p_only_when_it_starts_the_softmax(rng, dname):
    """A sink e^10 above the keys' LSE: started from it, the online softmax's P = exp(s - z) fall below
    fp16's normal range (6.1e-5) and lose their bits (the "P-collapse"); merged after the loop, P keep
    their own max. bf16's range holds them either way. Relative errors against float64, v ~ N(1, 1) so
    that o' = w o stays in fp16's normal range."""
    dt = numpy_dtype(dname)
    q, k = (rng.standard_normal((1, 2, 256, 64)).astype(dt) for _ in range(2))
    v = (rng.standard_normal((1, 2, 256, 64)) + 1).astype(dt)
    lse_keys = reference.attention(q, k, v, return_lse=True)[1]
    sinks = (lse_keys.max(axis=(0, 2)) + 10.0).astype(np.float32)
    ref = reference.attention(q, k, v, sinks=sinks)
    p = _problem(q, k, v)
    size = np.abs(ref).max()
    last, first = (np.abs(_twin.forward(q, k, v, p, sinks=sinks, sink_first=f)[0] - ref).max() / size
                   for f in (False, True))
    assert last < {"f16": 2e-3, "bf16": 1.6e-2}[dname]  # an fp16 or bf16 rounding or two
    if dname == "f16":
        assert first > 10 * last, (first, last)
    else:
        assert first < 2 * last, (first, last)


def test_the_merge_gives_the_reference_lse_and_a_row_without_keys_the_sink(rng):
    lse = np.array([[[0.5, -np.inf, 80.0]]], dtype=np.float32)
    o = rng.standard_normal((1, 1, 3, 8)).astype(np.float32)
    o[0, 0, 1] = 0
    z = np.array([1.25], dtype=np.float32)
    o2, lse2 = _sinks.apply(o.copy(), lse.copy(), z)
    np.testing.assert_allclose(lse2[0, 0], [np.logaddexp(0.5, 1.25), 1.25, 80.0], rtol=1e-6)
    np.testing.assert_allclose(o2[0, 0, 0], o[0, 0, 0] / (1 + np.exp(1.25 - 0.5)), rtol=1e-6)
    assert (o2[0, 0, 1] == 0).all() and np.array_equal(o2[0, 0, 2], o[0, 0, 2])


def test_the_sink_gradient_with_an_lse_gradient_matches_central_differences(rng):
    """d z of sum(dO o') + sum(dlse lse') through the merge, against central differences in float64."""
    o = rng.standard_normal((2, 3, 5, 4))
    lse = rng.standard_normal((2, 3, 5)) * 2
    do, dlse = rng.standard_normal(o.shape), rng.standard_normal(lse.shape)
    z = rng.standard_normal(3)

    def loss(zz):
        lse2 = np.logaddexp(lse, zz[None, :, None])
        return (do * o * np.exp(lse - lse2)[..., None]).sum() + (dlse * lse2).sum()

    o2, lse2 = _sinks.apply(o.astype(np.float32), lse.astype(np.float32), z.astype(np.float32))
    got = _sinks.grad(do.astype(np.float32), o2, lse2, z.astype(np.float32), dlse.astype(np.float32))
    eps = 1e-6
    num = [(loss(z + eps * e) - loss(z - eps * e)) / (2 * eps) for e in np.eye(3)]
    np.testing.assert_allclose(got, num, rtol=1e-4, atol=1e-5)


def test_bad_sinks_are_refused_by_name(rng):
    q = rng.standard_normal((1, 2, 8, 16)).astype(np.float32)
    for bad, err, msg in (
        (np.zeros(3, np.float32), ValueError, r"sinks must have shape \(Hq,\) = \(2,\)"),
        (np.zeros((1, 2), np.float32), ValueError, "sinks must have shape"),
        (np.zeros(2, np.int32), TypeError, "sinks must be a float array"),
        (np.array([0.0, np.nan], np.float32), ValueError, "sinks must be finite"),
        (np.array([0.0, np.inf], np.float32), ValueError, "sinks must be finite"),
        ("ab", TypeError, "sinks must be a NumPy or CuPy array"),
    ):
        with pytest.raises(err, match=msg):
            flashcupy.attention(q, q, q, sinks=bad)
    o = flashcupy.attention(q, q, q, sinks=[0.5, -1.0])  # a list is taken as a NumPy array
    assert np.isfinite(o).all()


def test_the_fp8_twin_takes_sinks(rng):
    """attention_fp8 on NumPy inputs merges the sinks after its key loop: against float64 with the sinks
    within the fp8 twin's own error without them (relative, P in e4m3), rows without keys at the sink."""
    from flashcupy import fp8

    q, k = (fp8.quantize(rng.standard_normal(s).astype(np.float32), "e4m3", "token")
            for s in ((1, 2, 100, 128), (1, 1, 90, 128)))
    v = fp8.quantize((rng.standard_normal((1, 1, 90, 128)) + 0.5).astype(np.float32), "e4m3", "head")
    deq = [fp8.dequantize(x).astype(np.float64) for x in (q, k, v)]
    z = np.array([3.0, 9.0], np.float32)
    o, lse = flashcupy.attention_fp8(q, k, v, causal=True, sinks=z, return_lse=True)
    ro, rl = reference.attention(*deq, causal=True, sinks=z, return_lse=True)
    o0 = flashcupy.attention_fp8(q, k, v, causal=True)
    r0 = reference.attention(*deq, causal=True)
    rel = lambda a, r: np.abs(a.astype(np.float64) - r).max() / np.abs(r).max()  # noqa: E731
    assert rel(o, ro) < 1.5 * rel(o0, r0)
    assert (lse[..., :10] == z[None, :, None]).all() and (o[..., :10, :] == 0).all()
    np.testing.assert_allclose(lse[..., 10:], rl[..., 10:], atol=1e-3)
    assert not np.allclose(o.astype(np.float64), r0, atol=1e-2)  # the sinks are applied
    with pytest.raises(ValueError, match="sinks must have shape"):
        flashcupy.attention_fp8(q, k, v, sinks=z[:1])

"""fp8 attention (the NumPy twin of issue 13's kernel) and the tensor-core matmul model it runs on, against
float64 and against independent re-derivations of the same steps."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import flashcupy
from flashcupy import _twin, fp8, reference
from flashcupy.inspect import tensorcore as _tensorcore

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
EXACT = (None, "rn", None)  # exact sums, rounded to fp32 each k step


def _e4m3_values(rng, shape, spread=1.0):
    return (rng.standard_normal(shape) * spread).astype(np.float32).astype(E4M3).astype(np.float64)


def test_matmul_exact_model_is_an_fp32_rounding_per_k_step(rng):
    a, b = _e4m3_values(rng, (3, 5, 72)), _e4m3_values(rng, (3, 72, 4))  # K = 72: a ragged last step
    c = rng.standard_normal((3, 5, 4)).astype(np.float32).astype(np.float64)
    want = c.copy()
    for k0 in range(0, 72, 32):
        want = (want + a[..., k0:k0 + 32] @ b[..., k0:k0 + 32, :]).astype(np.float32).astype(np.float64)
    np.testing.assert_array_equal(_tensorcore.matmul(a, b, c, "e4m3", "fp32", EXACT), want)


def test_matmul_measured_e4m3_model_truncates_to_14_bits(rng):
    """Every result has at most 14 significant bits, and with positive terms it never exceeds the exact
    sum (truncation toward zero at every step) while staying within 2^-11 of it per k step."""
    a, b = np.abs(_e4m3_values(rng, (64, 128))), np.abs(_e4m3_values(rng, (128, 64)))
    got = _tensorcore.matmul(a, b, None, "e4m3")
    exact = a @ b
    mant, _ = np.frexp(got)
    assert np.all(mant * 2 ** 14 == np.trunc(mant * 2 ** 14))
    assert np.all(got <= exact) and np.any(got < exact)
    assert np.all(exact - got <= 4 * 2.0 ** -11 * exact)


def _quantized(rng, shape, granularity="tensor", block=None, shift=0.0):
    x = (rng.standard_normal(shape) + shift).astype(np.float32)
    return fp8.quantize(x, "e4m3", granularity, block)


def test_one_tile_twin_matches_its_pipeline_written_out_in_float64(rng):
    """With one key tile (Nk <= block_n) the online softmax reduces to its textbook form: S = (Q8 K8^T) sq
    sk, P = 2^(c (S - rowmax)), P8 = e4m3(P p_scale), o = (P8 V8) sv / (p_scale rowsum P). Differences
    left: fp32 roundings, which can move a P across an e4m3 rounding boundary (one step is 2^-4 of it)."""
    q = _quantized(rng, (1, 2, 24, 64), "token")
    k = _quantized(rng, (1, 1, 100, 64), "block", 32)
    v = _quantized(rng, (1, 1, 100, 64), "head")
    q8, k8, v8 = (x.data.astype(np.float64) for x in (q, k, v))
    o, lse = _twin.forward_fp8(q8, k8, v8, fp8.expand_scale(q), fp8.expand_scale(k), v.scale, causal=False,
                               scale=0.2, block_n=128, p_scale=256.0, accumulation="single", model=EXACT)
    s = (q8 @ np.swapaxes(k8, -1, -2)) * fp8.expand_scale(q) * np.swapaxes(fp8.expand_scale(k), -1, -2)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp2((s - m) * 0.2 / np.log(2))
    denom = p.sum(axis=-1, keepdims=True)
    p8 = (p * 256).astype(np.float32).astype(E4M3).astype(np.float64)
    want = (p8 @ v8) * v.scale / (256 * denom)
    assert np.max(np.abs(o - want)) <= 2.0 ** -4 * np.max(np.abs(want)) / 8
    np.testing.assert_allclose(lse, (m * 0.2 + np.log(denom))[..., 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("accumulation", fp8.ACCUMULATIONS)
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_attention_is_close_to_float64_on_its_dequantized_inputs(rng, accumulation, causal):
    """Against float64 attention of what the quantized inputs stand for (GQA, ragged Nk, Nq > Nk so that
    some causal rows see no key): RMSE within 5% of the output's RMS (e4m3 P costs up to 2^-4 per
    element), empty rows exactly 0 with LSE -inf."""
    q = _quantized(rng, (2, 4, 70, 64), "token")
    k = _quantized(rng, (2, 2, 45, 64), "block", 16)
    v = _quantized(rng, (2, 2, 45, 64), "head")
    o, lse = flashcupy.attention_fp8(q, k, v, causal=causal, block_n=64, accumulation=accumulation,
                                     return_lse=True)
    assert o.dtype == np.float16 and lse.dtype == np.float32
    ro, rl = reference.attention(*(fp8.dequantize(x).astype(np.float64) for x in (q, k, v)), causal=causal,
                                 return_lse=True)
    seen = np.isfinite(rl)
    assert (not causal) or not seen.all()
    assert np.all(o[~seen] == 0) and np.all(np.isneginf(lse[~seen]))
    err = o.astype(np.float64)[seen] - ro[seen]
    assert np.sqrt(np.mean(err ** 2)) <= 0.05 * np.sqrt(np.mean(ro[seen] ** 2))
    np.testing.assert_allclose(lse[seen], rl[seen], atol=0.05)


@pytest.mark.parametrize("accumulation", fp8.ACCUMULATIONS)
def test_fp8_softcap_is_close_to_float64_and_bites(rng, accumulation):
    """The softcap on the fp8 twin (S descaled, then (c / scale) tanh(scale S / c) in float32, the kernel's
    model): within the e4m3 bound of float64 softcapped attention on the dequantized inputs, with a window
    and Nq > Nk; the cap moves o by many times that error; the LSE within 1e-3 (the e4m3 products' 14-bit
    accumulation moves each score by about 2^-14 of the sum's size)."""
    q = _quantized(rng, (1, 4, 70, 64), "token")
    k = _quantized(rng, (1, 2, 45, 64), "block", 16)
    v = _quantized(rng, (1, 2, 45, 64), "head")
    kw = dict(window_size=(20, 3), softcap=1.5)
    o, lse = flashcupy.attention_fp8(q, k, v, block_n=64, accumulation=accumulation, return_lse=True, **kw)
    deq = [fp8.dequantize(x).astype(np.float64) for x in (q, k, v)]
    ro, rl = reference.attention(*deq, return_lse=True, **kw)
    seen = np.isfinite(rl)
    assert not seen.all() and np.all(np.isneginf(lse[~seen])) and np.all(o[~seen] == 0)
    err = np.sqrt(np.mean((o.astype(np.float64) - ro)[seen] ** 2))
    assert err <= 0.05 * np.sqrt(np.mean(ro[seen] ** 2))
    uncapped = reference.attention(*deq, window_size=(20, 3))
    assert np.sqrt(np.mean((uncapped - ro)[seen] ** 2)) > 5 * err
    np.testing.assert_allclose(lse[seen], rl[seen], rtol=0, atol=1e-3)


def test_single_level_accumulation_loses_bits_that_two_level_keeps(rng):
    """Over 2048 keys the tensor core's 14-bit accumulator, carried across tiles, truncates every new
    product against a running sum hundreds of times larger: a bias toward zero of about 2% (measured
    model). Two-level accumulation (a fresh accumulator per 128-key tile, added in fp32) stays within
    0.1% of the exact-sum twin on the same quantized inputs."""
    q = _quantized(rng, (1, 1, 4, 64))
    k = _quantized(rng, (1, 1, 2048, 64))
    v = _quantized(rng, (1, 1, 2048, 64), shift=1.0)  # a positive mean: o grows with every key
    args = [x.data.astype(np.float64) for x in (q, k, v)] + [q.scale, k.scale, v.scale]
    kw = dict(causal=False, scale=0.05, block_n=128, p_scale=256.0)
    exact, _ = _twin.forward_fp8(*args, accumulation="tile", model=EXACT, **kw)
    rel = {a: (_twin.forward_fp8(*args, accumulation=a, **kw)[0] - exact) / np.abs(exact).max()
           for a in fp8.ACCUMULATIONS}
    assert np.sqrt(np.mean(rel["tile"] ** 2)) < 1e-3
    assert np.sqrt(np.mean(rel["single"] ** 2)) > 10 * np.sqrt(np.mean(rel["tile"] ** 2))
    assert rel["single"].mean() < -2e-3  # truncation toward zero: the positive outputs shrink


@pytest.mark.parametrize("kwargs,exc,words", [
    ({"block_n": 96}, ValueError, ["block_n", "64"]),
    ({"p_scale": 500.0}, ValueError, ["p_scale", "448"]),
    ({"p_scale": "256"}, TypeError, ["p_scale"]),
    ({"accumulation": "two"}, ValueError, ["accumulation", "tile"]),
    ({"out_dtype": "float32"}, ValueError, ["out_dtype", "bfloat16"]),
    ({"scale": -1.0}, ValueError, ["scale"]),
    ({"causal": 1}, TypeError, ["causal"]),
    ({"ablate": "max"}, ValueError, ["ablate", "rescaling"]),
    ({"block_m": 96}, ValueError, ["block_m", "192"]),
    ({"block_m": 128.0}, TypeError, ["block_m", "int"]),
    ({"block_n": 64.0}, TypeError, ["block_n", "int"]),
    ({"out_dtype": np.float16}, ValueError, ["out_dtype", "names"]),
    ({"scale": 1e38}, ValueError, ["scale", "2^12"]),
    ({"softcap": -1.0}, ValueError, ["softcap", ">= 0"]),
    ({"softcap": True}, TypeError, ["softcap"]),
    ({"softcap": 1e-9}, ValueError, ["softcap", "2^-16"]),
])
def test_bad_arguments_are_refused(rng, kwargs, exc, words):
    q, k, v = (_quantized(rng, (1, 1, 8, 64)) for _ in range(3))
    with pytest.raises(exc) as info:
        flashcupy.attention_fp8(q, k, v, **kwargs)
    for w in words:
        assert w in str(info.value)


def test_scales_that_contradict_their_label_are_refused(rng):
    """A hand-built Quantized whose scale does not match its granularity (the kernel would read one k
    descale per key tile where the twin applies one per key) or with uint8 host data, refused by
    attention_fp8; a scale that is not positive, finite float32 is refused when the Quantized is made."""
    q, k, v = (_quantized(rng, (1, 1, 8, 64)) for _ in range(3))
    tok = _quantized(rng, (1, 1, 8, 64), "token")
    bad = {
        "label": (fp8.Quantized(k.data, tok.scale, "e4m3", "tensor"), ValueError, "shape"),
        "block": (fp8.Quantized(k.data, tok.scale, "e4m3", "block", 3), ValueError, "shape"),
        "uint8": (fp8.Quantized(k.data.view(np.uint8), k.scale, "e4m3", "tensor"), TypeError, "uint8"),
    }
    for what, (kb, exc, word) in bad.items():
        with pytest.raises(exc, match=word):
            flashcupy.attention_fp8(q, kb, v)
    flashcupy.attention_fp8(q, tok, v)  # a label that matches its scale runs
    for scale, word in ((-k.scale, "positive"), (0 * k.scale, "positive"), (k.scale * np.inf, "finite"),
                        (k.scale * np.nan, "finite"), (k.scale.astype(np.float64), "float64"),
                        (1.0, "float")):
        with pytest.raises(ValueError, match=word):
            fp8.Quantized(k.data, scale, "e4m3", "tensor")


def test_bad_inputs_are_refused(rng):
    q, k = _quantized(rng, (1, 2, 8, 64)), _quantized(rng, (1, 1, 8, 64))
    with pytest.raises(TypeError, match="Quantized"):
        flashcupy.attention_fp8(q, k, fp8.dequantize(k))
    with pytest.raises(ValueError, match="'tensor' or 'head'"):
        flashcupy.attention_fp8(q, k, _quantized(rng, (1, 1, 8, 64), "token"))
    with pytest.raises(ValueError, match="e4m3"):
        flashcupy.attention_fp8(q, k, fp8.quantize(rng.standard_normal((1, 1, 8, 64)), "e5m2"))
    with pytest.raises(ValueError, match="head dims"):
        flashcupy.attention_fp8(*(_quantized(rng, (1, 1, 8, 32)) for _ in range(3)))
    with pytest.raises(ValueError, match="multiple"):
        kv = _quantized(rng, (1, 2, 8, 64))
        flashcupy.attention_fp8(_quantized(rng, (1, 3, 8, 64)), kv, kv)
    with pytest.raises(ValueError, match="k and v"):
        flashcupy.attention_fp8(q, k, _quantized(rng, (1, 1, 9, 64)))


def test_magnitudes_past_float32_scores_are_refused_and_tiny_ones_are_exact(rng):
    """q and k so large that the scores overflow float32 (448^2 D max(sq) max(sk) scale log2(e) past
    float32's largest) and v so large that o overflows float16 are refused, naming the bound; inputs of
    magnitude 1e-30 (scores ~ 1e-60: a uniform softmax) give the float64 reference's output."""
    shape = (1, 2, 40, 64)
    big = fp8.quantize((rng.standard_normal(shape) * 1e19).astype(np.float32))
    small = fp8.quantize(rng.standard_normal(shape).astype(np.float32))
    with pytest.raises(ValueError, match="too large for float32 scores"):
        flashcupy.attention_fp8(big, big, small)
    with pytest.raises(ValueError, match="exceeds the largest float16"):
        flashcupy.attention_fp8(small, small, fp8.quantize(np.full(shape, 1e5, np.float32)))
    flashcupy.attention_fp8(small, small, fp8.quantize(np.full(shape, 1e5, np.float32)), out_dtype="bfloat16")
    x = [(rng.standard_normal(shape) * 1e-30).astype(np.float32) for _ in range(3)]
    q8, k8 = (fp8.quantize(t, "e4m3", "token") for t in x[:2])
    v8 = fp8.quantize(x[2] * 1e30, "e4m3", "head")  # v of order 1, so that o is visible in float16
    o, lse = flashcupy.attention_fp8(q8, k8, v8, causal=True, return_lse=True)
    ref_o, ref_lse = reference.attention(*(fp8.dequantize(t) for t in (q8, k8, v8)), causal=True,
                                         return_lse=True)
    assert np.isfinite(o.astype(np.float32)).all() and np.isfinite(lse).all()
    assert np.abs(o.astype(np.float64) - ref_o).max() < 0.05  # e4m3's P and V roundings
    assert np.abs(lse - ref_lse).max() < 1e-5


@pytest.mark.parametrize("ablate", ["max_subtraction", "rescaling"])
def test_breaks_in_the_fp8_twin(rng, ablate):
    """The breaks as written out in float64 over two key tiles: no max subtraction exponentiates the raw
    scores (P * p_scale then saturates at 448, as cvt.rn.satfinite does; lse = ln l); no rescaling sums
    each tile on its own max."""
    q, k, v = (_quantized(rng, (1, 1, n, 64)) for n in (16, 200, 200))
    q8, k8, v8 = (x.data.astype(np.float64) for x in (q, k, v))
    o, lse = _twin.forward_fp8(q8, k8, v8, q.scale, k.scale, v.scale, causal=False, scale=0.3, block_n=128,
                               p_scale=256.0, accumulation="single", model=EXACT, ablate=ablate)
    s = (q8 @ np.swapaxes(k8, -1, -2)) * q.scale * k.scale
    c = 0.3 / np.log(2)
    tiles = [slice(0, 128), slice(128, 200)]
    sub = [s[..., t].max(-1, keepdims=True) * (ablate != "max_subtraction") for t in tiles]
    p = [np.exp2((s[..., t] - m) * c) for t, m in zip(tiles, sub)]
    p8 = [np.clip(x * 256, 0, 448).astype(np.float32).astype(E4M3).astype(np.float64) for x in p]
    if ablate == "max_subtraction":
        assert max(x.max() for x in p) * 256 > 448  # the saturation is exercised
    denom = sum(x.sum(-1, keepdims=True) for x in p)
    want = sum(a @ v8[..., t, :] for a, t in zip(p8, tiles)) * v.scale / (256 * denom)
    assert np.max(np.abs(o - want)) <= 2.0 ** -4 * np.max(np.abs(want)) / 4
    want_lse = np.log(denom) + np.maximum(*sub) * 0.3  # (0 without the max subtraction)
    np.testing.assert_allclose(lse, want_lse[..., 0], rtol=1e-5, atol=1e-4)

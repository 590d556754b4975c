"""The fp8 (e4m3) wgmma forward on the GPU against its NumPy twin and against float64 (issue 13).

The twin (``flashcupy._twin.forward_fp8``) applies the measured e4m3 tensor-core accumulation to the same
quantized inputs, so the kernel and the twin share every rounding but three: ``ex2.approx`` against exact
exp2, the fused ``S c - m c`` and the order of l's sum. Those move P by about 1e-6 of itself, which now
and then moves P * p_scale across an e4m3 rounding boundary (one step is 2^-4 of it): that changes the
whole row of o (every column), by a visible amount where the key weighs in the row. And they move
each output's rounding by an ulp now and then. So the kernel must agree with the twin far more closely
than either agrees with float64 (the quantization's error: ``_agree``), and in almost every row to 2 ulps.
Every run writes into NaN-poisoned outputs."""
from __future__ import annotations

import numpy as np
import pytest

import flashcupy
from flashcupy import _launch, fp8, reference
from tests.helpers import record_scratch, replay_beside_sentinels

pytestmark = pytest.mark.gpu


def _pair(rng, shape, granularity, block=None, shift=0.0):
    """The same tensor quantized on the host (the twin's inputs) and on the GPU (the kernel's): the same
    bits, from the same function."""
    import cupy

    x = (rng.standard_normal(shape) + shift).astype(np.float32)
    host = fp8.quantize(x, "e4m3", granularity, block)
    dev = fp8.quantize(cupy.asarray(x), "e4m3", granularity, block)
    np.testing.assert_array_equal(cupy.asnumpy(dev.data), host.data.view(np.uint8))
    return host, dev


def _agree(o, ot, ro, seen, out_dtype="float16"):
    """Kernel o against the twin's ot (float64 copies) on the rows that see a key: at most 2% of the rows
    hold an element more than 2 ulps of the output type from the twin's (a flipped e4m3 rounding of P moves
    a whole row), and the RMS of the difference is at most a tenth of the twin's own error against
    float64 (ro). Returns (kernel's, twin's) RMS error against float64."""
    if out_dtype == "float16":
        ulp = np.spacing(np.abs(ot).astype(np.float16)).astype(np.float64)
    else:  # bfloat16: 8 significant bits
        ulp = np.abs(ot) * 2.0 ** -7 + 2.0 ** -133
    rows_off = (np.abs(o - ot) > 2 * ulp)[seen].any(axis=-1).mean()
    err_twin = np.sqrt(np.mean((ot - ro)[seen] ** 2))
    err_kern = np.sqrt(np.mean((o - ro)[seen] ** 2))
    gap = np.sqrt(np.mean((o - ot)[seen] ** 2))
    msg = f"rows off {rows_off:.2e}, gap {gap:.3e}, err kernel {err_kern:.3e} twin {err_twin:.3e}"
    print(msg)
    assert rows_off <= 0.02, msg
    assert gap <= 0.1 * err_twin, msg
    return err_kern, err_twin


@pytest.fixture
def poisoned(monkeypatch):
    """attention_fp8's kernel path writing into NaN-filled o and lse; checks afterwards that every element
    was written."""
    import cupy

    real = _launch.forward
    seen = []

    def run(q8, k8, v8, p, **kw):
        if kw.get("fp8") is None:  # (a 16-bit forward: not this fixture's)
            return real(q8, k8, v8, p, **kw)
        b, hq, nq, d = q8.shape
        dt = flashcupy._checks.numpy_dtype(p.variant.dtype)
        o = cupy.full((b, hq, nq, d), cupy.nan, dtype=cupy.float32).astype(dt)
        lse = cupy.full((b, hq, nq), cupy.nan, dtype=cupy.float32)
        out = real(q8, k8, v8, p, o=o, lse=lse, **kw)
        cupy.cuda.get_current_stream().synchronize()
        assert not bool(cupy.isnan(o.astype(cupy.float32)).any()), "o has unwritten (NaN) elements"
        assert not bool(cupy.isnan(lse).any()), "lse has unwritten (NaN) elements"
        seen.append(p.variant.key)
        return out

    monkeypatch.setattr(_launch, "forward", run)
    return seen


# (B, Hq, Hkv, Nq, Nk, q granularity, k granularity, block_m, out_dtype): ragged lengths, GQA, Nq > Nk
# (causal rows that see no key), k's descale constant over a key tile (tensor, head, blocks of 128) or
# not (token, blocks of 64), both tiles. Sizes kept small for the twin (NumPy, about 8 us per query-key
# pair at D=128).
CASES = [
    (1, 2, 1, 1, 1, ("tensor",), ("tensor",), 192, "float16"),
    (1, 2, 2, 113, 203, ("token",), ("block", 128), 192, "float16"),
    (2, 4, 2, 203, 113, ("head",), ("token",), 128, "bfloat16"),
    (1, 1, 1, 400, 700, ("token",), ("token",), 192, "bfloat16"),
    (1, 2, 1, 257, 2049, ("block", 64), ("block", 64), 128, "float16"),
    (1, 2, 2, 300, 1024, ("tensor",), ("head",), 64, "float16"),
]


def _case_id(c):
    qg, kg = "".join(map(str, c[5])), "".join(map(str, c[6]))
    return f"b{c[0]}h{c[1]}k{c[2]}_{c[3]}x{c[4]}_q{qg}_k{kg}_bm{c[7]}_{c[8]}"


@pytest.mark.parametrize("accumulation", ["single", "tile"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fp8_kernel_agrees_with_twin_and_float64(rng, poisoned, case, causal, accumulation):
    import cupy

    b, hq, hkv, nq, nk, qg, kg, bm, out_dtype = case
    qh, qd = _pair(rng, (b, hq, nq, 128), *qg)
    kh, kd = _pair(rng, (b, hkv, nk, 128), *kg)
    vh, vd = _pair(rng, (b, hkv, nk, 128), "head", shift=0.5)
    kw = dict(causal=causal, accumulation=accumulation, out_dtype=out_dtype, return_lse=True)
    bm = min(bm, 128) if accumulation == "tile" else bm  # two-level runs at most two consumer warpgroups
    o, lse = flashcupy.attention_fp8(qd, kd, vd, block_m=bm, **kw)
    assert len(poisoned) == 1 and poisoned[0].endswith(
        f"e4m3_{accumulation}" + ("" if kg[0] in ("tensor", "head") or kg[-1] == 128 else "_kkey"))
    o, lse = cupy.asnumpy(o).astype(np.float64), cupy.asnumpy(lse)
    ot, lt = flashcupy.attention_fp8(qh, kh, vh, **kw)
    ot = ot.astype(np.float64)
    ro, rl = reference.attention(*(fp8.dequantize(x).astype(np.float64) for x in (qh, kh, vh)), causal=causal,
                                 return_lse=True)
    seen = np.isfinite(lt)
    np.testing.assert_array_equal(np.isfinite(lse), seen)
    assert np.all(o[~seen] == 0)

    err_kern, err_twin = _agree(o, ot, ro, seen, out_dtype)
    assert err_kern <= 1.05 * err_twin
    assert err_kern <= 0.05 * np.sqrt(np.mean(ro[seen] ** 2))  # the e4m3 bound of the twin's CPU test
    np.testing.assert_allclose(lse[seen], lt[seen], rtol=0, atol=1e-4)


@pytest.mark.parametrize("accumulation", ["single", "tile"])
@pytest.mark.parametrize("causal,window", [(True, (200, -1)), (False, (77, 128))],
                         ids=["causal-w200", "w77-128"])
def test_fp8_kernel_with_a_window(rng, poisoned, causal, window, accumulation):
    """A sliding window (issue 35) on the fp8 kernel: it visits the key tiles the window reaches only, and
    agrees with the twin (which visits every tile) as closely as without one; rows that see no key
    (Nq > Nk) get o = 0, lse = -inf."""
    import cupy

    qh, qd = _pair(rng, (1, 2, 700, 128), "token")
    kh, kd = _pair(rng, (1, 1, 500, 128), "token")
    vh, vd = _pair(rng, (1, 1, 500, 128), "head", shift=0.5)
    kw = dict(causal=causal, window_size=window, accumulation=accumulation, return_lse=True)
    o, lse = flashcupy.attention_fp8(qd, kd, vd, block_m=128, **kw)
    assert len(poisoned) == 1 and ".win" in poisoned[0]
    o, lse = cupy.asnumpy(o).astype(np.float64), cupy.asnumpy(lse)
    ot, lt = flashcupy.attention_fp8(qh, kh, vh, **kw)
    ro = reference.attention(*(fp8.dequantize(x).astype(np.float64) for x in (qh, kh, vh)), causal=causal,
                             window_size=window)
    seen = np.isfinite(lt)
    assert not seen.all()
    np.testing.assert_array_equal(np.isfinite(lse), seen)
    assert np.all(o[~seen] == 0)
    err_kern, err_twin = _agree(o, ot.astype(np.float64), ro, seen, "float16")
    assert err_kern <= 1.05 * err_twin
    np.testing.assert_allclose(lse[seen], lt[seen], rtol=0, atol=1e-4)


@pytest.mark.parametrize("accumulation", ["single", "tile"])
@pytest.mark.parametrize("kg", [("head",), ("token",)], ids=["k-per-tile", "k-per-key"])
def test_fp8_kernel_with_a_softcap(rng, poisoned, kg, accumulation):
    """The softcap (issue 35) on the fp8 kernel, causal, on both of k's descale paths (per tile, which
    descales S element by element only with a hook, and per key). With the accurate tanh the kernel follows
    the twin as closely as without a cap; with its default tanh.approx it answers to float64 as the twin
    does (the approximation's 2^-17 is far below e4m3's rounding). The cap bites: without it o moves by
    many times the error."""
    import cupy

    from flashcupy.inspect import kernel_build

    qh, qd = _pair(rng, (1, 4, 300, 128), "token")
    kh, kd = _pair(rng, (1, 2, 520, 128), *kg)
    vh, vd = _pair(rng, (1, 2, 520, 128), "head", shift=0.5)
    kw = dict(causal=True, softcap=2.0, accumulation=accumulation, return_lse=True)
    ot, lt = flashcupy.attention_fp8(qh, kh, vh, **kw)
    ot = ot.astype(np.float64)
    deq = [fp8.dequantize(x).astype(np.float64) for x in (qh, kh, vh)]
    ro, rl = reference.attention(*deq, causal=True, softcap=2.0, return_lse=True)
    seen = np.isfinite(lt)
    errs = {}
    for arm in ("accurate", "approx"):
        with kernel_build(defines={"FC_TANH_APPROX": int(arm == "approx")}):
            o, lse = flashcupy.attention_fp8(qd, kd, vd, **kw)
        # (the variant's key ends with the build's label: each arm ran its own tanh)
        assert poisoned[-1].endswith(f"cap2.e4m3_{accumulation}" + ("_kkey" if kg == ("token",) else "")
                                     + f"+FC_TANH_APPROX={int(arm == 'approx')}"), poisoned[-1]
        assert ".bm128." in poisoned[-1]  # (the softcap's default tile)
        o, lse = cupy.asnumpy(o).astype(np.float64), cupy.asnumpy(lse)
        np.testing.assert_array_equal(np.isfinite(lse), seen)
        if arm == "accurate":
            errs[arm] = _agree(o, ot, ro, seen)[0]
            np.testing.assert_allclose(lse[seen], lt[seen], rtol=0, atol=1e-4)
        else:
            errs[arm] = np.sqrt(np.mean((o - ro)[seen] ** 2))
            np.testing.assert_allclose(lse[seen], rl[seen], rtol=0, atol=1e-3)
    err_twin = np.sqrt(np.mean((ot - ro)[seen] ** 2))
    assert errs["accurate"] <= 1.05 * err_twin and errs["approx"] <= 1.1 * err_twin, (errs, err_twin)
    uncapped = reference.attention(*deq, causal=True)
    assert np.sqrt(np.mean((uncapped - ro)[seen] ** 2)) > 5 * err_twin


def test_fp8_kernel_with_a_softcap_at_d256_with_a_window_and_sinks(rng, poisoned):
    """The softcap with every other fp8 variant at once, at D = 256: a window, sinks, GQA, Nq > Nk."""
    import cupy

    qh, qd = _pair(rng, (1, 4, 203, 256), "tensor")
    kh, kd = _pair(rng, (1, 2, 150, 256), "head")
    vh, vd = _pair(rng, (1, 2, 150, 256), "head", shift=0.5)
    z = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    kw = dict(window_size=(40, 0), softcap=2.0, return_lse=True)
    o, lse = flashcupy.attention_fp8(qd, kd, vd, sinks=cupy.asarray(z), **kw)
    # (a cap at D = 256 takes the per-key descale path for any granularity: the per-tile one spills)
    assert ".cap2." in poisoned[-1] and ".win" in poisoned[-1] and poisoned[-1].endswith("_kkey")
    o, lse = cupy.asnumpy(o).astype(np.float64), cupy.asnumpy(lse)
    ot, lt = flashcupy.attention_fp8(qh, kh, vh, sinks=z, **kw)
    ro = reference.attention(*(fp8.dequantize(x).astype(np.float64) for x in (qh, kh, vh)), sinks=z, **kw)[0]
    seen = np.isfinite(lt)
    np.testing.assert_array_equal(np.isfinite(lse), seen)
    err_kern, err_twin = np.sqrt(np.mean((o - ro)[seen] ** 2)), np.sqrt(np.mean((ot - ro)[seen] ** 2))
    assert err_kern <= 1.1 * err_twin, (err_kern, err_twin)
    assert err_twin <= 0.05 * np.sqrt(np.mean(ro[seen] ** 2))


@pytest.mark.parametrize("strength", [0.0, 8.0], ids=["sink-even", "sink-dominant"])
def test_fp8_kernel_with_sinks(rng, poisoned, strength):
    """Sinks (issue 35) on the fp8 kernel, merged after the key loop: the kernel agrees with the twin
    (which merges the same way) as closely as without sinks, against float64 with the sinks; rows that
    see no key (Nq > Nk, causal) get o = 0 and lse = the sink. A sink e^8 above the keys' LSE leaves the
    e4m3 P untouched (no P-collapse): the agreement holds there too."""
    import cupy

    qh, qd = _pair(rng, (1, 2, 700, 128), "token")
    kh, kd = _pair(rng, (1, 1, 500, 128), "token")
    vh, vd = _pair(rng, (1, 1, 500, 128), "head", shift=0.5)
    deq = [fp8.dequantize(x).astype(np.float64) for x in (qh, kh, vh)]
    lse_keys = reference.attention(*deq, causal=True, return_lse=True)[1]
    z = (np.nanmax(np.where(np.isfinite(lse_keys), lse_keys, np.nan), axis=(0, 2)) + strength
         + np.array([0.0, -1.0])).astype(np.float32)
    kw = dict(causal=True, return_lse=True)
    o, lse = flashcupy.attention_fp8(qd, kd, vd, sinks=cupy.asarray(z), **kw)
    assert len(poisoned) == 1
    o, lse = cupy.asnumpy(o).astype(np.float64), cupy.asnumpy(lse)
    ot, lt = flashcupy.attention_fp8(qh, kh, vh, sinks=z, **kw)
    ro = reference.attention(*deq, causal=True, sinks=z)
    seen = np.isfinite(lse_keys)
    assert not seen.all()
    assert np.all(o[~seen] == 0) and np.all(lse[~seen] == np.broadcast_to(z[None, :, None], lse.shape)[~seen])
    err_kern, err_twin = _agree(o, ot.astype(np.float64), ro, seen, "float16")
    assert err_kern <= 1.05 * err_twin
    np.testing.assert_allclose(lse, lt, rtol=0, atol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", [(1, 2, 1, 113, 300, ("token",), ("tensor",)),
                                  (1, 2, 2, 200, 129, ("block", 64), ("token",))], ids=["kt", "kk"])
def test_fp8_kernel_at_d256(rng, poisoned, case, causal):
    """D=256 (single-level accumulation, 128-row tiles): the same agreement with the twin and float64 as
    at D=128; k's descale per key tile and per key."""
    import cupy

    b, hq, hkv, nq, nk, qg, kg = case
    qh, qd = _pair(rng, (b, hq, nq, 256), *qg)
    kh, kd = _pair(rng, (b, hkv, nk, 256), *kg)
    vh, vd = _pair(rng, (b, hkv, nk, 256), "head", shift=0.5)
    o, lse = (cupy.asnumpy(x) for x in flashcupy.attention_fp8(qd, kd, vd, causal=causal, return_lse=True))
    assert poisoned[0].split(".")[3:6] == ["bm128", "bn128", "d256"]
    ot, lt = flashcupy.attention_fp8(qh, kh, vh, causal=causal, return_lse=True)
    o, ot = o.astype(np.float64), ot.astype(np.float64)
    ro = reference.attention(*(fp8.dequantize(x).astype(np.float64) for x in (qh, kh, vh)), causal=causal)
    seen = np.isfinite(lt)
    err_kern, _ = _agree(o, ot, ro, seen)
    assert err_kern <= 0.05 * np.sqrt(np.mean(ro[seen] ** 2))
    np.testing.assert_allclose(lse[seen], lt[seen], rtol=0, atol=1e-4)
    np.testing.assert_array_equal(np.isfinite(lse), seen)


def test_single_level_accumulation_truncates_on_the_gpu(rng, poisoned):
    """The twin's prediction, measured on the hardware: over 2048 keys with a positive-mean v, carrying O
    in the tensor core's 14-bit truncating accumulator biases the output toward zero by about 2%, and the
    two-level accumulation removes the bias (same inputs, both against float64)."""
    import cupy

    qh, qd = _pair(rng, (1, 2, 64, 128), "tensor")
    kh, kd = _pair(rng, (1, 2, 2048, 128), "tensor")
    vh, vd = _pair(rng, (1, 2, 2048, 128), "tensor", shift=1.0)
    ro = reference.attention(*(fp8.dequantize(x).astype(np.float64) for x in (qh, kh, vh)), scale=0.02)
    rel = {}
    for a in ("single", "tile"):
        o = cupy.asnumpy(flashcupy.attention_fp8(qd, kd, vd, scale=0.02, accumulation=a)).astype(np.float64)
        rel[a] = (o - ro) / np.abs(ro).max()
    assert rel["single"].mean() < -5e-3, rel["single"].mean()
    assert abs(rel["tile"].mean()) < 1e-3, rel["tile"].mean()
    assert np.sqrt(np.mean(rel["single"] ** 2)) > 5 * np.sqrt(np.mean(rel["tile"] ** 2))


def test_v_transpose_permutes_keys_in_groups_of_16(rng):
    """The V^T pre-pass: vt[b, h, d, 16 G + 4 u + e] = v[b, h, 16 G + 2 u + (e & 1) + 8 (e >> 1), d], zeros
    past Nk, from a strided (B, N, H, D) view."""
    import cupy

    from flashcupy._compile import get_kernel
    from flashcupy._variant import Variant

    nk, d = 203, 128
    host = rng.integers(0, 256, size=(2, nk, 3, d), dtype=np.uint8)
    v = cupy.asarray(host).transpose(0, 2, 1, 3)  # (B, H, N, D) view of a (B, N, H, D) array
    var = Variant("fwd_wgmma", "f16", "fp32", 128, 128, d, fp8="single")
    pad = -(-nk // _launch.FP8_VT_KEYS) * _launch.FP8_VT_KEYS
    vt = cupy.full((2, 3, d, pad), 7, dtype=cupy.uint8)
    get_kernel(var, "v_transpose")((pad // _launch.FP8_VT_KEYS, 3, 2),
                                   (v, vt, np.int32(nk), np.int32(pad), *_launch.element_strides(v)))
    p = np.arange(pad)
    u, e = (p % 16) // 4, p % 4
    key = 16 * (p // 16) + 2 * u + (e & 1) + 8 * (e >> 1)
    want = np.zeros((2, 3, d, pad), dtype=np.uint8)
    ok = key < nk
    want[..., ok] = np.swapaxes(host.transpose(0, 2, 1, 3)[:, :, key[ok], :], -1, -2)
    np.testing.assert_array_equal(cupy.asnumpy(vt), want)


def test_v_with_a_strided_last_axis_is_read_right(rng, poisoned):
    """q, k and v whose last axis steps by 2 bytes (every other element of a wider array): the call copies
    them (TMA and the V^T pre-pass read rows as contiguous bytes) and gives the bits of contiguous
    inputs."""
    import cupy

    _, qd = _pair(rng, (1, 2, 130, 128), "token")
    _, kd = _pair(rng, (1, 1, 200, 128), "tensor")
    _, vd = _pair(rng, (1, 1, 200, 128), "head", shift=0.5)
    want = cupy.asnumpy(flashcupy.attention_fp8(qd, kd, vd))

    def strided(x):
        wide = cupy.asarray(rng.integers(0, 256, size=x.shape[:3] + (2 * x.shape[3],), dtype=np.uint8))
        wide[..., ::2] = x.data
        return fp8.Quantized(wide[..., ::2], x.scale, x.fmt, x.granularity, x.block)

    got = cupy.asnumpy(flashcupy.attention_fp8(strided(qd), strided(kd), strided(vd)))
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_kernel_path_refuses_what_it_does_not_run(rng):
    import cupy

    q = fp8.quantize(cupy.asarray(rng.standard_normal((1, 1, 8, 64)).astype(np.float32)))
    with pytest.raises(ValueError, match=r"D \(128, 256\)"):
        flashcupy.attention_fp8(q, q, q)
    q = fp8.quantize(cupy.asarray(rng.standard_normal((1, 1, 8, 128)).astype(np.float32)))
    with pytest.raises(ValueError, match="twin only"):
        flashcupy.attention_fp8(q, q, q, accumulation="exact")
    with pytest.raises(ValueError, match="block_n=128"):
        flashcupy.attention_fp8(q, q, q, block_n=64)
    with pytest.raises(ValueError, match="block_m 64 or 128"):
        flashcupy.attention_fp8(q, q, q, accumulation="tile", block_m=192)
    qh = fp8.quantize(rng.standard_normal((1, 1, 8, 128)).astype(np.float32))
    with pytest.raises(TypeError, match="all be NumPy arrays"):
        flashcupy.attention_fp8(q, qh, q)


@pytest.mark.parametrize("ablate", ["max_subtraction", "rescaling"])
@pytest.mark.parametrize("accumulation", ["single", "tile"])
def test_fp8_breaks_agree_with_twin(rng, poisoned, ablate, accumulation):
    """Both breaks on the kernel as on the twin: q and k of spread 4 (scores in the hundreds: without the
    max subtraction P reaches 2^70 and saturates e4m3 at 448, without the rescaling the tiles are summed on
    their own maxima), far from float64 either way; k's descale per key tile (folded into the exponent)
    with single-level accumulation, per key with two-level."""
    import cupy

    qh, qd = _pair(rng, (1, 2, 150, 128), "tensor")
    kh, kd = _pair(rng, (1, 1, 300, 128), *(("block", 128) if accumulation == "single" else ("token",)))
    vh, vd = _pair(rng, (1, 1, 300, 128), "head")
    qh, qd, kh, kd = (fp8.Quantized(x.data, x.scale * 4, x.fmt, x.granularity, x.block)
                      for x in (qh, qd, kh, kd))
    kw = dict(accumulation=accumulation, ablate=ablate, return_lse=True)
    o, lse = (cupy.asnumpy(x) for x in flashcupy.attention_fp8(qd, kd, vd, **kw))
    ot, lt = flashcupy.attention_fp8(qh, kh, vh, **kw)
    o, ot = o.astype(np.float64), ot.astype(np.float64)
    ro = reference.attention(*(fp8.dequantize(x).astype(np.float64) for x in (qh, kh, vh)))
    _, err_twin = _agree(o, ot, ro, np.ones(lt.shape, dtype=bool))
    assert err_twin > 0.05 * np.sqrt(np.mean(ro ** 2))  # the break breaks
    np.testing.assert_allclose(lse, lt, rtol=1e-5, atol=1e-4)


def test_the_kernel_path_never_waits_for_the_device(rng):
    """attention_fp8 on CuPy inputs (as attention) only enqueues work: with the stream held busy for
    200 ms by a spinning kernel, a call returns long before it. A check that reads the device (e.g. the
    scales' values, which Quantized checks once when made) would wait for the spin: that cost the fp8
    path 6.5x its time at N=1024 when it ran on every call (the bench on the H200)."""
    import time

    import cupy

    from analysis.bench import _hold_gpu

    _, qd = _pair(rng, (1, 2, 256, 128), "token")
    _, kd = _pair(rng, (1, 1, 256, 128), "tensor")
    _, vd = _pair(rng, (1, 1, 256, 128), "head", shift=0.5)
    q16, k16, v16 = (fp8.dequantize(x).astype(cupy.float16) for x in (qd, kd, vd))
    calls = {"fp8": lambda: flashcupy.attention_fp8(qd, kd, vd, causal=True),
             "16-bit": lambda: flashcupy.attention(q16, k16, v16, causal=True)}
    for name, call in calls.items():
        call()  # compiled and planned
        cupy.cuda.get_current_stream().synchronize()
        _hold_gpu(200.0)
        t0 = time.perf_counter()
        call()
        waited = time.perf_counter() - t0
        cupy.cuda.get_current_stream().synchronize()
        assert waited < 0.1, f"{name}: the call took {waited * 1e3:.0f} ms behind a 200 ms kernel"



@pytest.mark.parametrize("qg,kg", [(("block", 64), ("token",)), (("token",), ("block", 128))])
def test_a_captured_fp8_forward_replays_into_its_own_memory(rng, monkeypatch, qg, kg):
    """attention_fp8 captured into a CUDA graph (scales per block of tokens, per token, per head: each
    flattening path): arrays allocated after the capture, three of each size the call asked its scratch
    for (the pool would hand them a freed temporary's block first), are untouched by three replays, and
    the replayed output is the eager one, bit for bit; new q data copied into the captured input's
    memory changes the replayed output as it changes the eager one."""
    import cupy

    requests = record_scratch(monkeypatch)
    _, qd = _pair(rng, (1, 2, 300, 128), *qg)
    _, kd = _pair(rng, (1, 1, 257, 128), *kg)
    _, vd = _pair(rng, (1, 1, 257, 128), "head", shift=0.5)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        eager = flashcupy.attention_fp8(qd, kd, vd, causal=True)  # warm-up: compile, plan
        stream.synchronize()
        requests.clear()
        stream.begin_capture()
        captured = flashcupy.attention_fp8(qd, kd, vd, causal=True)
        graph = stream.end_capture()
    assert len(requests) >= 4, requests  # three descales (q or k by blocks: one more), V^T
    replay_beside_sentinels(graph, stream, requests)
    assert bool((captured == eager).all()) and float(cupy.abs(eager.astype(cupy.float32)).max()) > 0
    _, other = _pair(rng, (1, 2, 300, 128), *qg)
    cupy.cuda.Device().synchronize()
    with stream:  # the new q in the captured input's memory, in the replay's stream order
        qd.data[...] = other.data
        qd.scale[...] = other.scale
        graph.launch(stream)
        fresh = flashcupy.attention_fp8(qd, kd, vd, causal=True)
        stream.synchronize()
    assert bool((captured == fresh).all()) and not bool((fresh == eager).all())

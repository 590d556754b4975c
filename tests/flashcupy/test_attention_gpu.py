"""flashcupy.attention on CuPy arrays: both kernel families against the float64 reference, the NumPy
twin, and themselves (determinism). Every run writes into NaN-poisoned outputs."""
from __future__ import annotations

import math

import numpy as np
import pytest

import flashcupy
from flashcupy import naive, reference
from flashcupy._checks import check_forward, numpy_dtype
from tests.numerics import assert_accurate, max_abs_err

pytestmark = pytest.mark.gpu

SHAPES = [(1, 1), (113, 203), (203, 113), (1023, 1024), (1024, 1023), (2048, 2048)]
COMBOS = [  # (kernel, dtype, accum)
    ("mma", "f16", "fp32"), ("mma", "f16", "fp16"), ("mma", "bf16", "fp32"),
    ("simt", "f32", "fp32"), ("simt", "f32", "fp16"), ("simt", "f16", "fp32"), ("simt", "f16", "fp16"),
    ("simt", "bf16", "fp32"), ("simt", "bf16", "fp16"),
]


def _combo_id(c):
    return f"{c[0]}-{c[1]}-acc{c[2][2:]}"


def _host_inputs(rng, b, hq, hkv, nq, nk, d, dname, q_scale=1.0):
    dt = numpy_dtype(dname)
    return ((q_scale * rng.standard_normal((b, hq, nq, d))).astype(dt),
            rng.standard_normal((b, hkv, nk, d)).astype(dt),
            rng.standard_normal((b, hkv, nk, d)).astype(dt))


def run_poisoned(q, k, v, **kw):
    """flashcupy's forward into NaN-filled o and lse; returns (o, lse) after checking every element
    was written (no NaN left where the kernel must write a number)."""
    import cupy

    from flashcupy._launch import forward

    p = check_forward(q, k, v, **{"causal": False, "scale": None, "block_m": None, "block_n": None,
                                  "accum": "fp32", "kernel": "auto", "ablate": None, **kw})
    o = cupy.full((p.batch, p.heads_q, p.nq, p.head_dim), cupy.nan, dtype=cupy.float32).astype(q.dtype)
    lse = cupy.full((p.batch, p.heads_q, p.nq), cupy.nan, dtype=cupy.float32)
    forward(q, k, v, p, o=o, lse=lse)
    cupy.cuda.get_current_stream().synchronize()
    if kw.get("ablate") is None:
        assert not bool(cupy.isnan(o.astype(cupy.float32)).any()), f"{p.variant.key}: o has unwritten (NaN) elements"
        assert not bool(cupy.isnan(lse).any()), f"{p.variant.key}: lse has unwritten (NaN) elements"
    return o, lse


def _check_against_reference(qh, kh, vh, o, lse, dname, accum, causal, what):
    import cupy

    o_ref, lse_ref = reference.attention(qh, kh, vh, causal=causal, return_lse=True)
    o_naive = naive.attention(*(cupy.asarray(x) for x in (qh, kh, vh)), causal=causal)
    err, nerr = assert_accurate(o, o_ref, o_naive, dname, accum, what=what)
    lse = cupy.asnumpy(lse)
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref)), f"{what}: empty rows differ"
    fin = np.isfinite(lse_ref)
    lse_tol = 2e-5 * (1 + np.abs(lse_ref[fin]).max(initial=0)) if accum == "fp32" else \
        8 * 2.0 ** -11 * (1 + np.abs(lse_ref[fin]).max(initial=0))
    lerr = max_abs_err(lse[fin], lse_ref[fin])
    assert lerr <= lse_tol, f"{what}: lse error {lerr:.3e} > {lse_tol:.3e}"
    return err, nerr


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
@pytest.mark.parametrize("nq,nk", SHAPES, ids=[f"{a}x{b}" for a, b in SHAPES])
def test_forward_matches_reference(rng, nq, nk, combo, d, causal):
    import cupy

    kernel, dname, accum = combo
    qh, kh, vh = _host_inputs(rng, 1, 6, 2, nq, nk, d, dname)
    q, k, v = (cupy.asarray(x) for x in (qh, kh, vh))
    o, lse = run_poisoned(q, k, v, causal=causal, accum=accum, kernel=kernel)
    _check_against_reference(qh, kh, vh, o, lse, dname, accum, causal,
                             what=f"{kernel} {dname} acc={accum} d={d} {nq}x{nk} causal={causal}")


HEAD_DIMS = [8, 32, 40, 64, 96, 128, 256]


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("combo", [("mma", "f16", "fp32"), ("mma", "bf16", "fp32"), ("mma", "f16", "fp16"),
                                   ("simt", "f32", "fp32"), ("simt", "bf16", "fp16")], ids=_combo_id)
def test_head_dims(rng, combo, d):
    import cupy

    kernel, dname, accum = combo
    qh, kh, vh = _host_inputs(rng, 2, 4, 4, 203, 333, d, dname)
    q, k, v = (cupy.asarray(x) for x in (qh, kh, vh))
    o, lse = run_poisoned(q, k, v, causal=True, accum=accum, kernel=kernel)
    _check_against_reference(qh, kh, vh, o, lse, dname, accum, True, what=f"{kernel} {dname} d={d}")


def _block_params():
    from flashcupy._build import FAMILIES

    out = []
    for kernel, dname in (("mma", "f16"), ("simt", "f16")):
        fam = FAMILIES["fwd_" + kernel]
        for bm in fam.block_m:
            for bn in fam.block_n:
                out.append(pytest.param(kernel, dname, bm, bn, id=f"{kernel}-bm{bm}-bn{bn}"))
    return out


@pytest.mark.parametrize("kernel,dname,bm,bn", _block_params())
def test_block_sizes(rng, kernel, dname, bm, bn):
    import cupy

    qh, kh, vh = _host_inputs(rng, 1, 4, 2, 300, 517, 64, dname)
    q, k, v = (cupy.asarray(x) for x in (qh, kh, vh))
    for causal in (False, True):
        o, lse = run_poisoned(q, k, v, causal=causal, kernel=kernel, block_m=bm, block_n=bn)
        _check_against_reference(qh, kh, vh, o, lse, dname, "fp32", causal,
                                 what=f"{kernel} bm={bm} bn={bn} causal={causal}")


@pytest.mark.parametrize("kernel,dname", [("mma", "f16"), ("mma", "bf16"), ("simt", "f32")])
def test_strided_bnhd_view_runs_without_copy(rng, kernel, dname):
    """A (B, N, H, D) tensor viewed as (B, H, N, D): same bits as the contiguous layout."""
    import cupy

    dt = numpy_dtype(dname)
    x = cupy.asarray(rng.standard_normal((2, 301, 6, 64)).astype(dt))   # (B, N, H, D)
    kv = cupy.asarray(rng.standard_normal((2, 301, 2, 64)).astype(dt))
    q, k = x.transpose(0, 2, 1, 3), kv.transpose(0, 2, 1, 3)
    assert not q.flags.c_contiguous
    o = flashcupy.attention(q, k, k, causal=True, kernel=kernel)
    o2 = flashcupy.attention(cupy.ascontiguousarray(q), cupy.ascontiguousarray(k),
                             cupy.ascontiguousarray(k), causal=True, kernel=kernel)
    assert bool((o == o2).all())
    qh, kh = cupy.asnumpy(q), cupy.asnumpy(k)
    _check_against_reference(qh, kh, kh, o, flashcupy.attention(q, k, k, causal=True, kernel=kernel,
                                                                return_lse=True)[1],
                             dname, "fp32", True, what="strided view")


@pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
def test_bitwise_deterministic_and_public_api_matches(rng, combo):
    import cupy

    kernel, dname, accum = combo
    q, k, v = (cupy.asarray(x) for x in _host_inputs(rng, 2, 4, 2, 777, 1029, 64, dname))
    runs = [flashcupy.attention(q, k, v, causal=True, accum=accum, kernel=kernel, return_lse=True)
            for _ in range(3)]
    poisoned = run_poisoned(q, k, v, causal=True, accum=accum, kernel=kernel)
    for o, lse in runs[1:] + [poisoned]:
        assert bool((o.view(cupy.uint16 if o.itemsize == 2 else cupy.uint32) ==
                     runs[0][0].view(cupy.uint16 if o.itemsize == 2 else cupy.uint32)).all())
        assert bool((lse.view(cupy.uint32) == runs[0][1].view(cupy.uint32)).all())


@pytest.mark.parametrize("ablate", [None, "max_subtraction", "rescaling"])
@pytest.mark.parametrize("combo", [("mma", "f16", "fp32"), ("mma", "f16", "fp16"), ("simt", "f32", "fp32"),
                                   ("simt", "f16", "fp16"), ("simt", "bf16", "fp32")], ids=_combo_id)
def test_kernels_agree_with_numpy_twin(rng, combo, ablate):
    """Same tiles, same breaks: the GPU kernel and the twin compute the same function."""
    import cupy

    kernel, dname, accum = combo
    qh, kh, vh = _host_inputs(rng, 1, 4, 2, 250, 390, 64, dname, q_scale=2.0)
    kw = dict(causal=True, accum=accum, kernel=kernel, block_n=64, ablate=ablate)
    o_gpu = cupy.asnumpy(flashcupy.attention(*(cupy.asarray(x) for x in (qh, kh, vh)), **kw))
    o_twin = flashcupy.attention(qh, kh, vh, **kw)
    g, t = o_gpu.astype(np.float64), o_twin.astype(np.float64)
    assert np.array_equal(np.isfinite(g), np.isfinite(t)), "the breaks break different elements"
    fin = np.isfinite(t)
    diff = np.abs(g[fin] - t[fin]).max(initial=0.0)
    ref = reference.attention(qh, kh, vh, causal=True)
    tol = {"f32": 2e-6, "f16": 2e-3, "bf16": 1.6e-2}[dname] * max(1.0, np.abs(t[fin]).max(initial=1.0))
    if accum == "fp16":
        tol = max(tol, 4e-3 * max(1.0, np.abs(t[fin]).max(initial=1.0)))
    assert diff <= tol, f"gpu vs twin {diff:.3e} > {tol:.3e}"
    if ablate == "rescaling":
        assert max_abs_err(t, ref) > 10 * tol  # the break is far bigger than the disagreement


@pytest.mark.parametrize("kernel,dname,threshold", [("mma", "f16", math.log(65504.0)),
                                                    ("simt", "f16", math.log(65504.0)),
                                                    ("mma", "bf16", 88.72), ("simt", "f32", 88.72),
                                                    ("simt", "bf16", 88.72)])
def test_max_subtraction_break_overflows_past_threshold(kernel, dname, threshold):
    import cupy

    from tests.flashcupy.test_twin import _one_hot_score_inputs

    for smax, broken in ((threshold - 0.3, False), (threshold + 0.3, True)):
        qh, kh, vh = _one_hot_score_inputs(smax, dname)
        o = cupy.asnumpy(flashcupy.attention(*(cupy.asarray(x) for x in (qh, kh, vh)), scale=1.0,
                                             kernel=kernel, ablate="max_subtraction")).astype(np.float64)
        ref = reference.attention(qh, kh, vh, scale=1.0)
        if broken:
            assert not np.isfinite(o[..., 5]).any()
        else:
            assert np.isfinite(o).all()
            assert_accurate(o, ref, naive.attention(qh, kh, vh, scale=1.0), dname, "fp32",
                            what=f"no max subtraction, max score {smax:.2f}")


@pytest.mark.parametrize("kernel,dname", [("mma", "f16"), ("simt", "f32")])
def test_rescaling_break_seed_setup(rng, kernel, dname):
    """B=2, H=4, N=256, D=32, blocks of 32 (mma: block_m 64): exact with one tile, wrong with eight."""
    import cupy

    qh, kh, vh = _host_inputs(rng, 2, 4, 4, 256, 256, 32, dname)
    q, k, v = (cupy.asarray(x) for x in (qh, kh, vh))
    bm = 64 if kernel == "mma" else 32
    broken = flashcupy.attention(q, k, v, kernel=kernel, block_m=bm, block_n=32, ablate="rescaling")
    err = max_abs_err(broken, reference.attention(qh, kh, vh))
    assert np.isfinite(cupy.asnumpy(broken).astype(np.float64)).all() and err > 1e-2, err
    one = flashcupy.attention(q, k[:, :, :32], v[:, :, :32], kernel=kernel, block_m=bm, block_n=32,
                              ablate="rescaling")
    exact = flashcupy.attention(q, k[:, :, :32], v[:, :, :32], kernel=kernel, block_m=bm, block_n=32)
    assert bool((one == exact).all())


def test_empty_causal_rows_and_inputs_untouched(rng):
    import cupy

    qh, kh, vh = _host_inputs(rng, 1, 2, 2, 300, 70, 64, "f16")
    q, k, v = (cupy.asarray(x) for x in (qh, kh, vh))
    copies = [x.copy() for x in (q, k, v)]
    for kernel in ("mma", "simt"):
        o, lse = run_poisoned(q, k, v, causal=True, kernel=kernel)
        assert bool((o[:, :, :230] == 0).all()) and bool(cupy.isneginf(lse[:, :, :230]).all())
        assert bool(cupy.isfinite(lse[:, :, 230:]).all())
    for a, b in zip(copies, (q, k, v)):
        assert bool((a == b).all())


def test_runs_on_the_current_stream(rng):
    import cupy

    q, k, v = (cupy.asarray(x) for x in _host_inputs(rng, 1, 4, 4, 512, 512, 64, "f16"))
    expected = flashcupy.attention(q, k, v)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        o = flashcupy.attention(q, k, v)
    s.synchronize()
    assert bool((o == expected).all())

"""flashcupy.attention on CuPy arrays: both kernel families against the float64 reference, the NumPy
twin, and themselves (determinism). Every run writes into NaN-poisoned outputs."""
from __future__ import annotations

import numpy as np
import pytest

import flashcupy
from flashcupy import naive, reference
from flashcupy._checks import check_forward, numpy_dtype
from flashcupy._variant import Variant
from flashcupy.accuracy import assert_accurate, assert_lse_accurate, assert_matches_twin, max_abs_err
from tests.helpers import (
    FORWARD_DEFAULTS,
    LN_MAX,
    block_params,
    combo_id,
    one_hot_score_inputs,
    parametrize_causal,
    qkv,
    run_poisoned,
    shape_ids,
    to_device,
)

pytestmark = pytest.mark.gpu

SHAPES = [(1, 1), (113, 203), (203, 113), (1023, 1024), (1024, 1023), (2049, 2049)]
COMBOS = [  # (kernel, dtype, accum)
    ("wgmma", "f16", "fp32"), ("wgmma", "f16", "fp16"), ("wgmma", "bf16", "fp32"),
    ("mma", "f16", "fp32"), ("mma", "f16", "fp16"), ("mma", "bf16", "fp32"),
    ("simt", "f32", "fp32"), ("simt", "f32", "fp16"), ("simt", "f16", "fp32"), ("simt", "f16", "fp16"),
    ("simt", "bf16", "fp32"), ("simt", "bf16", "fp16"),
]


def _check_against_reference(qh, kh, vh, o, lse, dname, accum, causal, what):
    o_ref, lse_ref = reference.attention(qh, kh, vh, causal=causal, return_lse=True)
    o_naive = naive.attention(*to_device(qh, kh, vh), causal=causal)
    err, nerr = assert_accurate(o, o_ref, o_naive, dname, accum, what=what)
    assert_lse_accurate(lse, lse_ref, accum, what=what)
    return err, nerr


@parametrize_causal
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
@pytest.mark.parametrize("nq,nk", SHAPES, ids=shape_ids(SHAPES))
def test_forward_matches_reference(rng, nq, nk, combo, d, causal):
    kernel, dname, accum = combo
    qh, kh, vh = qkv(rng, (1, 6, 2, nq, nk, d), dname)
    q, k, v = to_device(qh, kh, vh)
    o, lse = run_poisoned(q, k, v, causal=causal, accum=accum, kernel=kernel)
    _check_against_reference(qh, kh, vh, o, lse, dname, accum, causal,
                             what=f"{kernel} {dname} acc={accum} d={d} {nq}x{nk} causal={causal}")


HEAD_DIMS = [8, 32, 40, 64, 96, 128, 256]
WGMMA_COMBOS = [c for c in COMBOS if c[0] == "wgmma"]
SHAPES_256 = [(113, 203), (1023, 1024), (2049, 2049)]


@parametrize_causal
@pytest.mark.parametrize("bm,bn", [(64, 64), (128, 64), (64, 80), (128, 80)])
@pytest.mark.parametrize("combo", WGMMA_COMBOS, ids=combo_id)
@pytest.mark.parametrize("nq,nk", SHAPES_256, ids=shape_ids(SHAPES_256))
def test_wgmma_head_dim_256(rng, nq, nk, combo, bm, bn, causal):
    """D=256 on the Hopper family: each of its tiles (block_n 64 and FlashAttention-3's 80, whose key tiles
    straddle the 128-row query tiles' diagonal at varying offsets), GQA, ragged lengths."""
    kernel, dname, accum = combo
    qh, kh, vh = qkv(rng, (1, 4, 2, nq, nk, 256), dname)
    o, lse = run_poisoned(*to_device(qh, kh, vh), causal=causal, accum=accum, kernel=kernel, block_m=bm,
                          block_n=bn)
    _check_against_reference(qh, kh, vh, o, lse, dname, accum, causal,
                             what=f"{kernel} {dname} acc={accum} d=256 {bm}x{bn} {nq}x{nk} causal={causal}")


@parametrize_causal
@pytest.mark.parametrize("bm", [64, 128])
@pytest.mark.parametrize("combo", WGMMA_COMBOS, ids=combo_id)
@pytest.mark.parametrize("nq,nk", SHAPES_256, ids=shape_ids(SHAPES_256))
def test_wgmma_key_tile_176(rng, nq, nk, combo, bm, causal):
    """D=128 with FlashAttention-3's 176-key tile (11 k16 steps of P V; not a divisor of the query tile,
    so the causal edge falls at every offset inside a key tile), GQA, ragged lengths."""
    kernel, dname, accum = combo
    qh, kh, vh = qkv(rng, (1, 4, 2, nq, nk, 128), dname)
    o, lse = run_poisoned(*to_device(qh, kh, vh), causal=causal, accum=accum, kernel=kernel, block_m=bm,
                          block_n=176)
    _check_against_reference(qh, kh, vh, o, lse, dname, accum, causal,
                             what=f"{kernel} {dname} acc={accum} d=128 {bm}x176 {nq}x{nk} causal={causal}")


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("combo", [("mma", "f16", "fp32"), ("mma", "bf16", "fp32"), ("mma", "f16", "fp16"),
                                   ("simt", "f32", "fp32"), ("simt", "bf16", "fp16")], ids=combo_id)
def test_head_dims(rng, combo, d):
    kernel, dname, accum = combo
    qh, kh, vh = qkv(rng, (2, 4, 4, 203, 333, d), dname)
    q, k, v = to_device(qh, kh, vh)
    o, lse = run_poisoned(q, k, v, causal=True, accum=accum, kernel=kernel)
    _check_against_reference(qh, kh, vh, o, lse, dname, accum, True, what=f"{kernel} {dname} d={d}")


@pytest.mark.parametrize("kernel,dname,bm,bn",
                         block_params("fwd", (("wgmma", "f16"), ("mma", "f16"), ("simt", "f16"))))
def test_block_sizes(rng, kernel, dname, bm, bn):
    qh, kh, vh = qkv(rng, (1, 4, 2, 300, 517, 64), dname)
    q, k, v = to_device(qh, kh, vh)
    for accum in ("fp32", "fp16") if kernel == "wgmma" else ("fp32",):
        try:
            Variant(f"fwd_{kernel}", dname, accum, bm, bn, 64)
        except ValueError:  # a tile the family refuses for this accumulator: a clear error, no launch
            with pytest.raises(ValueError, match="block_m"):
                flashcupy.attention(q, k, v, accum=accum, kernel=kernel, block_m=bm, block_n=bn)
            continue
        for causal in (False, True):
            o, lse = run_poisoned(q, k, v, causal=causal, accum=accum, kernel=kernel, block_m=bm, block_n=bn)
            _check_against_reference(qh, kh, vh, o, lse, dname, accum, causal,
                                     what=f"{kernel} acc={accum} bm={bm} bn={bn} causal={causal}")


def _counter(stream):
    """The tile counter this thread's eager launches on ``stream`` use (the array at its address)."""
    import cupy

    from flashcupy import _launch

    ptr = _launch._tile_counter(stream.ptr, _launch._Scratch(stream))
    counter = _launch._THREAD.tile_counters[(cupy.cuda.runtime.getDevice(), stream.ptr)]
    assert counter.data.ptr == ptr
    return counter


@pytest.mark.parametrize("nq,nk", [(333, 517), (517, 333)], ids=["333x517", "517x333"])
@parametrize_causal
@pytest.mark.parametrize("combo", WGMMA_COMBOS, ids=combo_id)
def test_wgmma_persistent_grid_of_any_size_writes_the_same_bits(rng, combo, causal, nq, nk, monkeypatch):
    """A persistent variant (D=64: a static split without a causal mask, the dynamic scheduler with one)
    with 1, 3 or 7 CTAs (each running many tiles, its mbarrier phases running on across them) and with
    one CTA per tile: the bits of the default grid (one CTA per SM). 517 x 333 causal has query tiles
    that see no key (they take no K/V load yet one turn of the scheduler). The dynamic scheduler's
    counter is back to zero after every launch."""
    import cupy

    from flashcupy import _launch
    from flashcupy._policy import wgmma_persistent

    kernel, dname, accum = combo
    q, k, v = to_device(*qkv(rng, (2, 4, 2, nq, nk, 64), dname))
    kw = dict(accum=accum, kernel=kernel, causal=causal)
    variant = check_forward(q, k, v, **{**FORWARD_DEFAULTS, **kw}).variant
    assert wgmma_persistent(variant) == (2 if causal else 1)
    o_ref, lse_ref = flashcupy.attention(q, k, v, return_lse=True, **kw)
    for n_cta in (1, 3, 7, 10 ** 6):
        monkeypatch.setattr(_launch, "_wgmma_ctas", lambda tiles, n=n_cta: min(tiles, n))
        o, lse = run_poisoned(q, k, v, **kw)
        assert bool((o.view(cupy.uint16) == o_ref.view(cupy.uint16)).all()), n_cta
        assert bool((lse.view(cupy.uint32) == lse_ref.view(cupy.uint32)).all()), n_cta
        if causal:
            counter = _counter(cupy.cuda.get_current_stream())
            assert counter.tolist() == [0, 0], n_cta
    if causal:  # a second stream gets its own counter, and its launches the same bits
        with cupy.cuda.Stream(non_blocking=True) as s:
            o2 = flashcupy.attention(q, k, v, **kw)
            s.synchronize()
            assert _counter(s).data.ptr != _counter(cupy.cuda.Stream.null).data.ptr
        assert bool((o2.view(cupy.uint16) == o_ref.view(cupy.uint16)).all())


def test_wgmma_dynamic_scheduler_on_per_thread_streams_and_in_a_cuda_graph(rng):
    """The dynamic scheduler's counter (D=64 causal) under concurrency: two host threads launching at
    once on their per-thread default streams (one handle, two streams) get the default stream's bits
    every time; a forward captured into a CUDA graph gives them at each replay, and eager launches on
    the capturing stream before the capture and between replays stay right; every counter reads zero
    after the launches."""
    import threading

    import cupy

    from flashcupy import _launch
    from flashcupy._policy import wgmma_persistent

    q, k, v = to_device(*qkv(rng, (2, 8, 4, 700, 700, 64), "f16"))
    kw = dict(causal=True, kernel="wgmma")
    p = check_forward(q, k, v, **{**FORWARD_DEFAULTS, **kw})
    assert wgmma_persistent(p.variant) == 2
    o_ref, lse_ref = flashcupy.attention(q, k, v, return_lse=True, **kw)
    cupy.cuda.Device().synchronize()

    def same(o):
        return bool((o.view(cupy.uint16) == o_ref.view(cupy.uint16)).all())

    results, errors = [], []

    def worker():
        try:
            with cupy.cuda.Stream.ptds:
                outs = [flashcupy.attention(q, k, v, **kw) for _ in range(8)]
                cupy.cuda.Stream.ptds.synchronize()
                results.append(all(same(o) for o in outs))
                results.append(_counter(cupy.cuda.Stream.ptds).tolist() == [0, 0])
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == [True] * 4, results

    stream = cupy.cuda.Stream(non_blocking=True)
    o, lse = cupy.empty_like(o_ref), cupy.empty_like(lse_ref)
    with stream:
        _launch.forward(q, k, v, p, o, lse)  # eager, before the capture
        stream.begin_capture()
        _launch.forward(q, k, v, p, o, lse)
        graph = stream.end_capture()
        for _ in range(3):
            o.fill(cupy.nan)
            graph.launch(stream)
            stream.synchronize()
            assert same(o)
            o2 = flashcupy.attention(q, k, v, **kw)  # eager on the same stream, between replays
            stream.synchronize()
            assert same(o2)
    assert _counter(stream).tolist() == [0, 0]


@pytest.mark.parametrize("kernel,dname", [("wgmma", "f16"), ("wgmma", "bf16"), ("mma", "f16"),
                                          ("mma", "bf16"), ("simt", "f32")])
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
    lse = flashcupy.attention(q, k, k, causal=True, kernel=kernel, return_lse=True)[1]
    _check_against_reference(qh, kh, kh, o, lse, dname, "fp32", True, what="strided view")


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_bitwise_deterministic_and_public_api_matches(rng, combo):
    import cupy

    kernel, dname, accum = combo
    q, k, v = to_device(*qkv(rng, (2, 4, 2, 777, 1029, 64), dname))
    runs = [flashcupy.attention(q, k, v, causal=True, accum=accum, kernel=kernel, return_lse=True)
            for _ in range(3)]
    poisoned = run_poisoned(q, k, v, causal=True, accum=accum, kernel=kernel)
    bits = cupy.uint16 if q.itemsize == 2 else cupy.uint32
    for o, lse in runs[1:] + [poisoned]:
        assert bool((o.view(bits) == runs[0][0].view(bits)).all())
        assert bool((lse.view(cupy.uint32) == runs[0][1].view(cupy.uint32)).all())


@pytest.mark.parametrize("ablate", [None, "max_subtraction", "rescaling"])
@pytest.mark.parametrize("combo", [*WGMMA_COMBOS, ("mma", "f16", "fp32"), ("mma", "f16", "fp16"),
                                   ("simt", "f32", "fp32"), ("simt", "f16", "fp16"),
                                   ("simt", "bf16", "fp32")], ids=combo_id)
def test_kernels_agree_with_numpy_twin(rng, combo, ablate):
    """Same tiles, same breaks: the GPU kernel and the twin compute the same function."""
    import cupy

    kernel, dname, accum = combo
    qh, kh, vh = qkv(rng, (1, 4, 2, 250, 390, 64), dname, q_scale=2.0)
    kw = dict(causal=True, accum=accum, kernel=kernel, block_n=64, ablate=ablate)
    o_gpu = cupy.asnumpy(flashcupy.attention(*to_device(qh, kh, vh), **kw))
    o_twin = flashcupy.attention(qh, kh, vh, **kw)
    tol = assert_matches_twin(o_gpu, o_twin, dname, accum, what=f"{kernel} {dname} acc={accum} {ablate}")
    if ablate == "rescaling":
        ref = reference.attention(qh, kh, vh, causal=True)
        assert max_abs_err(o_twin, ref) > 10 * tol  # the break is far bigger than the disagreement


@pytest.mark.parametrize("kernel,dname", [("wgmma", "f16"), ("wgmma", "bf16"), ("mma", "f16"),
                                          ("simt", "f16"), ("mma", "bf16"), ("simt", "f32"),
                                          ("simt", "bf16")])
def test_max_subtraction_break_overflows_past_threshold(kernel, dname):
    import cupy

    threshold = LN_MAX[dname]
    for smax, broken in ((threshold - 0.3, False), (threshold + 0.3, True)):
        qh, kh, vh = one_hot_score_inputs(smax, dname, d=64 if kernel == "wgmma" else 8)
        o = cupy.asnumpy(flashcupy.attention(*to_device(qh, kh, vh), scale=1.0, kernel=kernel,
                                             ablate="max_subtraction")).astype(np.float64)
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

    qh, kh, vh = qkv(rng, (2, 4, 4, 256, 256, 32), dname)
    q, k, v = to_device(qh, kh, vh)
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

    q, k, v = to_device(*qkv(rng, (1, 2, 2, 300, 70, 64), "f16"))
    copies = [x.copy() for x in (q, k, v)]
    for kernel in ("wgmma", "mma", "simt"):
        o, lse = run_poisoned(q, k, v, causal=True, kernel=kernel)
        assert bool((o[:, :, :230] == 0).all()) and bool(cupy.isneginf(lse[:, :, :230]).all())
        assert bool(cupy.isfinite(lse[:, :, 230:]).all())
    for a, b in zip(copies, (q, k, v)):
        assert bool((a == b).all())


def test_runs_on_the_current_stream(rng):
    import cupy

    q, k, v = to_device(*qkv(rng, (1, 4, 4, 512, 512, 64), "f16"))
    expected = flashcupy.attention(q, k, v)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        o = flashcupy.attention(q, k, v)
    s.synchronize()
    assert bool((o == expected).all())


def test_auto_picks_wgmma_on_hopper_where_it_has_the_variant():
    import cupy

    from flashcupy._checks import resolve_family

    hopper = int(cupy.cuda.Device().compute_capability) == 90
    kw = dict(head_dim=128, backend="cuda")
    assert resolve_family("auto", "f16", "fp32", "fwd", **kw) == ("fwd_wgmma" if hopper else "fwd_mma")
    assert resolve_family("auto", "bf16", "fp32", "fwd", **kw) == ("fwd_wgmma" if hopper else "fwd_mma")
    assert resolve_family("auto", "f16", "fp16", "fwd", **kw) == ("fwd_wgmma" if hopper else "fwd_mma")
    assert resolve_family("auto", "f16", "fp32", "fwd", head_dim=256, backend="cuda") == (
        "fwd_wgmma" if hopper else "fwd_mma")
    # where the wgmma family lacks the variant, auto keeps mma (or simt)
    assert resolve_family("auto", "bf16", "fp16", "fwd", **kw) == "fwd_simt"
    assert resolve_family("auto", "f16", "fp32", "fwd", head_dim=96, backend="cuda") == "fwd_mma"
    assert resolve_family("auto", "f16", "fp32", "fwd", block_n=32, **kw) == "fwd_mma"
    assert resolve_family("auto", "f16", "fp32", "fwd", head_dim=256, block_n=128,
                          backend="cuda") == "fwd_mma"
    # the backward: wgmma on Hopper for its head dims (64, 128) with fp32 accumulators, else mma
    assert resolve_family("auto", "f16", "fp32", "bwd", **kw) == ("bwd_wgmma" if hopper else "bwd_mma")
    assert resolve_family("auto", "bf16", "fp32", "bwd", head_dim=64, backend="cuda") == (
        "bwd_wgmma" if hopper else "bwd_mma")
    assert resolve_family("auto", "f16", "fp16", "bwd", **kw) == "bwd_mma"
    assert resolve_family("auto", "f16", "fp32", "bwd", head_dim=256, backend="cuda") == "bwd_mma"
    assert resolve_family("auto", "f16", "fp32", "bwd", block_m=128, **kw) == "bwd_mma"
    assert resolve_family("auto", "f32", "fp32", "fwd", **kw) == "fwd_simt"
    if not hopper:
        with pytest.raises(ValueError, match="needs a Hopper GPU"):
            resolve_family("wgmma", "f16", "fp32", "fwd", **kw)

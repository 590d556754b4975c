"""Every bad argument raises before any work, naming the argument and what is allowed."""
from __future__ import annotations

import functools

import numpy as np
import pytest

import flashcupy
from tests.helpers import FORWARD_DEFAULTS, qkv


def _qkv(dname="f16"):
    """Fixed inputs (seed 0): q (1, 4, 16, 32), k and v (1, 2, 24, 32)."""
    return qkv(np.random.default_rng(0), (1, 4, 2, 16, 24, 32), dname)


BAD = [  # (id, mutate(q, k, v, kwargs), error type, words the message must contain)
    ("ndim", lambda q, k, v, kw: (q[0], k, v, kw), ValueError, ["q", "4-D"]),
    ("kv-shape", lambda q, k, v, kw: (q, k, v[:, :, :5], kw), ValueError, ["k and v", "shape"]),
    ("batch", lambda q, k, v, kw: (q, np.concatenate([k, k]), np.concatenate([v, v]), kw), ValueError,
     ["batch"]),
    ("head-dim-mismatch", lambda q, k, v, kw: (q, k[..., :16], v[..., :16], kw), ValueError, ["head dim"]),
    ("gqa", lambda q, k, v, kw: (q[:, :3], k, v, kw), ValueError, ["multiple", "heads"]),
    ("dtype-mismatch", lambda q, k, v, kw: (q.astype(np.float32), k, v, kw), TypeError, ["same dtype"]),
    ("dtype-float64", lambda q, k, v, kw: (q.astype(np.float64), k.astype(np.float64),
                                           v.astype(np.float64), kw), TypeError, ["float16", "bfloat16"]),
    ("head-dim-12", lambda q, k, v, kw: (q[..., :12], k[..., :12], v[..., :12], kw), ValueError,
     ["multiple of 8"]),
    ("head-dim-264", lambda q, k, v, kw: (*(np.concatenate([x] * 9, -1)[..., :264] for x in (q, k, v)), kw),
     ValueError, ["256"]),
    ("empty-q", lambda q, k, v, kw: (q[:, :, :0], k, v, kw), ValueError, ["empty", "Nq"]),
    ("empty-k", lambda q, k, v, kw: (q, k[:, :, :0], v[:, :, :0], kw), ValueError, ["empty", "Nk"]),
    ("accum", lambda q, k, v, kw: (q, k, v, {**kw, "accum": "fp8"}), ValueError, ["accum", "fp32"]),
    ("kernel", lambda q, k, v, kw: (q, k, v, {**kw, "kernel": "cuda"}), ValueError,
     ["kernel", "wgmma", "simt"]),
    ("wgmma-head-dim", lambda q, k, v, kw: (q, k, v, {**kw, "kernel": "wgmma"}), ValueError,
     ["wgmma", "(64, 128, 256)", "D=32", "mma", "simt"]),
    ("wgmma-fp16-bm192", lambda q, k, v, kw: (*(np.concatenate([x] * 2, -1) for x in (q, k, v)),
                                              {**kw, "kernel": "wgmma", "accum": "fp16", "block_m": 192}),
     ValueError, ["wgmma", "accum='fp16'", "block_m 64 or 128", "192"]),
    ("wgmma-d256-block_n", lambda q, k, v, kw: (*(np.concatenate([x] * 8, -1) for x in (q, k, v)),
                                                {**kw, "kernel": "wgmma", "block_n": 128}), ValueError,
     ["wgmma", "D=256", "block_n 64", "block_n=128"]),
    ("wgmma-float32", lambda q, k, v, kw: (*(np.concatenate([x] * 2, -1).astype(np.float32)
                                             for x in (q, k, v)),
                                           {**kw, "kernel": "wgmma"}), ValueError, ["wgmma", "simt"]),
    ("wgmma-block_n", lambda q, k, v, kw: (*(np.concatenate([x] * 2, -1) for x in (q, k, v)),
                                           {**kw, "kernel": "wgmma", "block_n": 32}), ValueError,
     ["block_n", "wgmma", "64, 80, 128, 176"]),
    ("wgmma-block_n-80", lambda q, k, v, kw: (*(np.concatenate([x] * 2, -1) for x in (q, k, v)),
                                              {**kw, "kernel": "wgmma", "block_n": 80}), ValueError,
     ["wgmma", "block_n=80", "D=256", "D=64"]),
    ("wgmma-block_n-176", lambda q, k, v, kw: (*(np.concatenate([x] * 4, -1) for x in (q, k, v)),
                                               {**kw, "kernel": "wgmma", "block_n": 176, "block_m": 192}),
     ValueError, ["wgmma", "block_n=176", "D=128", "block_m 64 or 128", "block_m=192"]),
    ("ablate", lambda q, k, v, kw: (q, k, v, {**kw, "ablate": "max"}), ValueError,
     ["ablate", "max_subtraction"]),
    ("block_m", lambda q, k, v, kw: (q, k, v, {**kw, "block_m": 48}), ValueError, ["block_m", "64, 128"]),
    ("block_n-simt", lambda q, k, v, kw: (q, k, v, {**kw, "kernel": "simt", "block_n": 256}), ValueError,
     ["block_n", "16, 32, 64, 128"]),
    ("block_m-type", lambda q, k, v, kw: (q, k, v, {**kw, "block_m": 64.0}), TypeError, ["block_m"]),
    ("scale-negative", lambda q, k, v, kw: (q, k, v, {**kw, "scale": -0.1}), ValueError, ["scale", "> 0"]),
    ("scale-nan", lambda q, k, v, kw: (q, k, v, {**kw, "scale": float("nan")}), ValueError, ["scale"]),
    ("scale-type", lambda q, k, v, kw: (q, k, v, {**kw, "scale": "0.1"}), TypeError, ["scale"]),
    ("scale-subnormal", lambda q, k, v, kw: (q, k, v, {**kw, "scale": 1e-39}), ValueError,
     ["scale", "[2^-64, 2^12]", "flushes to zero", "1e-39"]),
    ("scale-below-range", lambda q, k, v, kw: (q, k, v, {**kw, "scale": 2.0 ** -64 * 0.99}), ValueError,
     ["scale", "[2^-64, 2^12]"]),
    ("scale-huge", lambda q, k, v, kw: (q, k, v, {**kw, "scale": 1e38}), ValueError,
     ["scale", "[2^-64, 2^12]", "rounds"]),
    ("scale-above-range", lambda q, k, v, kw: (q, k, v, {**kw, "scale": 4096.4}), ValueError,
     ["scale", "[2^-64, 2^12]", "4096.4", "rounds"]),
    ("block_n-float", lambda q, k, v, kw: (q, k, v, {**kw, "block_n": 64.0}), TypeError, ["block_n", "int"]),
    ("causal-type", lambda q, k, v, kw: (q, k, v, {**kw, "causal": 1}), TypeError, ["causal", "bool"]),
    ("return_lse-type", lambda q, k, v, kw: (q, k, v, {**kw, "return_lse": "yes"}), TypeError,
     ["return_lse"]),
    ("mma-float32", lambda q, k, v, kw: (q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                                         {**kw, "kernel": "mma"}), ValueError, ["mma", "simt"]),
    ("not-an-array", lambda q, k, v, kw: (q.tolist(), k, v, kw), TypeError, ["q", "numpy.ndarray"]),
    ("simt-bm128-d256", lambda q, k, v, kw: (*(np.concatenate([x] * 8, -1) for x in (q, k, v)),
                                             {**kw, "kernel": "simt", "block_m": 128, "block_n": 64}),
     ValueError, ["block_m=128", "D <= 128"]),
]


@pytest.mark.parametrize("mutate,exc,words", [pytest.param(*b[1:], id=b[0]) for b in BAD])
def test_bad_argument_raises_clearly(mutate, exc, words):
    q, k, v, kw = mutate(*_qkv(), {})
    with pytest.raises(exc) as info:
        flashcupy.attention(q, k, v, **kw)
    for w in words:
        assert w in str(info.value), f"{w!r} not in message: {info.value}"


@pytest.mark.parametrize("kernel", ["mma", "wgmma"])
def test_bf16_tensor_core_fp16_accum_is_refused(kernel):
    q, k, v = (np.concatenate([x] * 2, -1) for x in _qkv("bf16"))  # D=64: a head dim both families run
    msg = f"kernel='{kernel}' with bfloat16 inputs supports accum='fp32' only"
    with pytest.raises(ValueError, match=msg):
        flashcupy.attention(q, k, v, kernel=kernel, accum="fp16")
    # auto falls back to the scalar family, which has fp16 accumulators for every dtype
    o = flashcupy.attention(q, k, v, accum="fp16")
    assert o.dtype == q.dtype


@pytest.mark.gpu
def test_mixing_numpy_and_cupy_is_refused():
    import cupy

    q, k, v = _qkv()
    with pytest.raises(TypeError, match="NumPy arrays .* or all CuPy arrays"):
        flashcupy.attention(cupy.asarray(q), k, v)


def test_wgmma_backward_refuses_what_it_does_not_run_and_names_the_families_that_do():
    q, k, v = _qkv()  # D = 32
    o, lse = flashcupy.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"backward runs head dims \(64, 128\).*kernel='mma'.*kernel='simt'"):
        flashcupy.attention_backward(o, q, k, v, o, lse, kernel="wgmma")
    q, k, v = (np.concatenate([x] * 2, -1) for x in _qkv())  # D = 64: the twin runs the family's knobs
    o, lse = flashcupy.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="accum='fp32' only.*kernel='mma'"):
        flashcupy.attention_backward(o, q, k, v, o, lse, kernel="wgmma", accum="fp16")
    with pytest.raises(ValueError, match="block_m=192 is not supported by kernel='wgmma'"):
        flashcupy.attention_backward(o, q, k, v, o, lse, kernel="wgmma", block_m=192)
    auto = r"block_m=100 is not supported by kernel='auto' \(resolved to 'mma'\)"
    with pytest.raises(ValueError, match=auto):
        flashcupy.attention(q, k, v, block_m=100)
    with pytest.raises(ValueError, match="block_m=128 at D=64 with block_n=128 only"):
        flashcupy.attention_backward(o, q, k, v, o, lse, kernel="wgmma", block_m=128, block_n=64)
    grads = flashcupy.attention_backward(o, q, k, v, o, lse, kernel="wgmma")
    assert all(np.isfinite(g.astype(np.float32)).all() for g in grads)


# The checks are memoized on what they read (arrays' types, shapes, strides, dtypes, devices; knobs'
# values and types): a remembered call must never let a different, bad call through.

@pytest.mark.parametrize("mutate,exc,words", [pytest.param(*b[1:], id=b[0]) for b in BAD])
def test_bad_argument_raises_after_good_calls_are_remembered(mutate, exc, words):
    q0, k0, v0 = _qkv()
    for kw in ({}, {"kernel": "simt"}, {"causal": True}, {"block_m": 64, "scale": 0.5}):
        flashcupy.attention(q0, k0, v0, **kw)  # remembered
    q, k, v, kw = mutate(*_qkv(), {})
    for _ in range(2):  # a failed check is not remembered either
        with pytest.raises(exc) as info:
            flashcupy.attention(q, k, v, **kw)
        for w in words:
            assert w in str(info.value), f"{w!r} not in message: {info.value}"


@pytest.mark.parametrize("good,bad,exc", [
    ({"causal": True}, {"causal": 1}, TypeError),
    ({"causal": False}, {"causal": 0}, TypeError),
    ({"block_m": 64}, {"block_m": 64.0}, TypeError),
    ({"block_m": 64}, {"block_m": True}, TypeError),
    ({"scale": 1.0}, {"scale": True}, TypeError),
    ({"return_lse": True}, {"return_lse": 1}, TypeError),
], ids=["causal-1", "causal-0", "block_m-float", "block_m-bool", "scale-bool", "return_lse-1"])
def test_equal_knobs_of_another_type_are_checked_again(good, bad, exc):
    q, k, v = _qkv()
    flashcupy.attention(q, k, v, **good)
    with pytest.raises(exc):
        flashcupy.attention(q, k, v, **bad)


def test_any_strides_give_the_contiguous_arrays_bits():
    """Every layout is accepted (the kernels copy what they cannot read; the twin reads any): a strided
    last axis, a (B, N, H, D) buffer viewed as (B, H, N, D), reversed and broadcast views give the bits of
    the same values stored contiguously."""
    q, k, v = _qkv()
    want = flashcupy.attention(q, k, v)
    wide = np.repeat(q, 2, axis=-1)[..., ::2]  # q's values, last axis strided
    assert wide.strides[-1] == 2 * q.itemsize
    np.testing.assert_array_equal(flashcupy.attention(wide, k, v), want)
    bnhd = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(flashcupy.attention(bnhd, k, v), want)
    rev = np.ascontiguousarray(k[:, :, ::-1])[:, :, ::-1]  # k's values through negative strides
    assert rev.strides[2] < 0
    np.testing.assert_array_equal(flashcupy.attention(q, rev, v), want)
    kb = np.broadcast_to(k[:, :1], k.shape)  # stride 0 over heads
    np.testing.assert_array_equal(flashcupy.attention(q, kb, v),
                                  flashcupy.attention(q, np.ascontiguousarray(kb), v))


def test_scale_range_is_the_same_for_every_entry_point():
    """The edges of SCALE_RANGE are accepted and give finite, accurate outputs and LSEs on the twin (the
    kernels: test_trust_gpu), what lies past them is refused, by attention, attention_backward and
    attention_fp8 alike. The gradients are finite at both edges and within the accuracy rule at the
    lower one. At the upper one they are not held to it: the backward recomputes P from the float32 LSE,
    of order scale * max q.k (1e5 here), whose rounding 2^-24 |lse| becomes P's relative error, while the
    rule's naive baseline exponentiates S - max directly (dq and dk also carry that error times the
    scale: the softmax is nearly one-hot, and dS = P (dP - delta) cancels)."""
    from flashcupy import fp8, naive, reference
    from flashcupy._checks import SCALE_RANGE
    from flashcupy.accuracy import assert_accurate, backward_reduction

    q, k, v = _qkv()
    do = np.random.default_rng(1).standard_normal(q.shape).astype(q.dtype)
    for s in SCALE_RANGE:
        for causal in (False, True):
            o, lse = flashcupy.attention(q, k, v, scale=s, causal=causal, return_lse=True)
            assert np.isfinite(o.astype(np.float32)).all() and not np.isnan(lse).any()
            assert_accurate(o, reference.attention(q, k, v, scale=s, causal=causal),
                            naive.attention(q, k, v, scale=s, causal=causal), "f16", "fp32",
                            what=f"scale={s} causal={causal}")
            grads = flashcupy.attention_backward(do, q, k, v, o, lse, scale=s, causal=causal)
            refs = reference.attention_backward(do, q, k, v, scale=s, causal=causal)
            naives = naive.attention_backward(do, q, k, v, scale=s, causal=causal)
            for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
                assert np.isfinite(g.astype(np.float32)).all(), f"{name} at scale={s}"
                if s < 1:
                    assert_accurate(g, r, n, "f16", "fp32", kind="bwd", what=f"{name} at scale={s}",
                                    reduction=backward_reduction(q, k))
    q8, k8, v8 = (fp8.quantize(np.concatenate([x] * 2, -1).astype(np.float32)) for x in (q, k, v))
    for bad in (SCALE_RANGE[0] / 2, SCALE_RANGE[1] * 2):
        with pytest.raises(ValueError, match=r"\[2\^-64, 2\^12\]"):
            flashcupy.attention(q, k, v, scale=bad)
        with pytest.raises(ValueError, match=r"\[2\^-64, 2\^12\]"):
            flashcupy.attention_backward(q, q, k, v, q, np.zeros(q.shape[:3], np.float32), scale=bad)
        with pytest.raises(ValueError, match=r"\[2\^-64, 2\^12\]"):
            flashcupy.attention_fp8(q8, k8, v8, scale=bad)


def test_a_remembered_problem_is_the_one_a_fresh_check_returns():
    from flashcupy import _checks

    rng = np.random.default_rng(7)
    for dname in ("f16", "bf16", "f32"):
        for kw in ({}, {"causal": True}, {"accum": "fp16", "kernel": "simt"}, {"block_n": 32, "scale": 0.3}):
            q, k, v = qkv(rng, (2, 4, 1, 9, 13, 16), dname)
            fresh = _checks.check_forward(q, k, v, **{**FORWARD_DEFAULTS, **kw})
            for _ in range(2):
                assert _checks.forward_problem(q, k, v, **{**FORWARD_DEFAULTS, **kw}) == fresh


def test_backward_arguments_are_checked_after_a_remembered_call():
    q, k, v = _qkv()
    o, lse = flashcupy.attention(q, k, v, return_lse=True)
    flashcupy.attention_backward(o, q, k, v, o, lse)
    with pytest.raises(TypeError, match="lse must be float32"):
        flashcupy.attention_backward(o, q, k, v, o, lse.astype(np.float64))
    with pytest.raises(TypeError, match="deterministic"):
        flashcupy.attention_backward(o, q, k, v, o, lse, deterministic=1)
    with pytest.raises(ValueError, match="do must have q's shape"):
        flashcupy.attention_backward(o[:, :, :5], q, k, v, o, lse)


def test_default_tiles_of_the_wgmma_backward():
    """128 query rows a tile at D=64 (measured faster on the H200); at D=128, where 128 does not fit in
    registers, FlashAttention-3's 80, except 64 with a causal mask up to 2048 query rows; a block_n given
    alone takes the default block_m where the family runs it with that block_n, else the largest it runs
    (block_n=64 at D=64: 64 rows, as before 128 became the default)."""
    from flashcupy._policy import default_tile
    from flashcupy._variant import Variant

    tile = functools.partial(default_tile, "bwd_wgmma", "f16")
    assert tile(64, "fp32", False) == (128, 128)
    assert tile(64, "fp32", True) == (128, 128)
    assert tile(128, "fp32", False) == (80, 128)
    assert tile(128, "fp32", True) == (80, 128)
    assert tile(128, "fp32", True, n=4096) == (80, 128)
    assert tile(128, "fp32", True, n=2048) == (64, 128)
    assert tile(128, "fp32", False, n=1024) == (80, 128)
    assert tile(64, "fp32", False, None, 64) == (64, 64)
    assert tile(64, "fp32", False, 64) == (64, 128)
    assert tile(128, "fp32", False, None, 128) == (80, 128)
    assert tile(128, "fp32", True, None, 128, n=1024) == (64, 128)
    for d, bn in ((128, 128), (64, 64)):
        with pytest.raises(ValueError, match="block_m=128 at D=64 with block_n=128 only"):
            Variant("bwd_wgmma", "f16", "fp32", 128, bn, d)
    for d, bn in ((64, 128), (64, 64)):
        with pytest.raises(ValueError, match="block_m=80 at D=128 with block_n=128 only"):
            Variant("bwd_wgmma", "f16", "fp32", 80, bn, d)


def test_default_tiles_of_the_wgmma_forward():
    """FlashAttention-3's wide key tiles where they were measured faster (flashcupy/_policy.py): 176 keys at
    D=128 without a causal mask (fp32 accumulators), 80 at D=256; a block_m given alone keeps the default
    key tile where the family runs it with that block_m, else takes the widest it runs."""
    from flashcupy._policy import default_tile

    tile = functools.partial(default_tile, "fwd_wgmma", "f16")
    assert tile(128, "fp32", False) == (128, 176)
    assert tile(128, "fp32", True) == (128, 128)
    assert tile(128, "fp16", False) == (128, 128)
    assert tile(256, "fp32", True) == (128, 80)
    assert tile(64, "fp32", False) == (192, 128)
    assert tile(128, "fp32", False, 64) == (64, 176)
    assert tile(128, "fp32", False, 192) == (192, 128)      # 176 keys need at most two consumer warpgroups
    assert tile(256, "fp32", False, 64) == (64, 80)
    assert tile(128, "fp32", False, None, 64) == (128, 64)
    assert tile(128, "fp32", False, 96) == (96, 176)         # not a block_m: the caller's check reports it


def test_how_the_wgmma_forward_stores_o():
    """FC_WG_O_STAGE (flashcupy/_policy.py wgmma_o_stage, measured on the H200): o goes through the Q buffer
    and a TMA store with one tile per CTA, through a buffer of its own in the tile loops where shared
    memory has room (which the layout then counts), and straight from registers for e4m3 variants, the
    static split at D=64 and loops on tiles that leave no room."""
    from flashcupy._families import SMEM_LIMIT
    from flashcupy._policy import wgmma_o_stage
    from flashcupy._variant import Variant

    def var(bm, bn, d, causal=False, schedule=None, **kw):
        return Variant("fwd_wgmma", "f16", "fp32", bm, bn, d, causal, schedule=schedule, **kw)

    assert wgmma_o_stage(var(128, 176, 128)) == 1
    assert wgmma_o_stage(var(128, 80, 256, True)) == 1
    assert wgmma_o_stage(var(128, 128, 128, True, "dynamic")) == 2
    assert wgmma_o_stage(var(128, 128, 128, False, "static")) == 2
    assert wgmma_o_stage(var(128, 128, 64, True)) == 2                 # D=64 causal: dynamic
    assert wgmma_o_stage(var(192, 128, 64)) == 0                       # D=64: the static split
    assert wgmma_o_stage(var(128, 176, 128, False, "static")) == 0     # no room for a buffer
    assert wgmma_o_stage(var(128, 80, 256, False, "static")) == 0
    assert wgmma_o_stage(var(128, 128, 128, fp8="single")) == 0
    tile, loop = var(128, 128, 128, True), var(128, 128, 128, True, "dynamic")
    assert loop.smem_bytes == tile.smem_bytes + 128 * 128 * 2 <= SMEM_LIMIT


def test_default_tiles_and_schedules_that_depend_on_the_length():
    """The wgmma forward's choices per query length (flashcupy/_policy.py, measured on the H200): D=64 with
    a causal mask takes 128-row tiles up to 1024 rows, 192 above; D=128 causal runs the dynamic tile
    scheduler up to 2048 rows on tiles of at most 128 x 128 and one tile per CTA above, D=128 without a
    mask the static split up to 1024 rows on tiles of at most 128 rows; D=64 always loops
    (a static split without a mask, the dynamic scheduler with one). A schedule equal to the default for
    any length leaves the variant's key as it was."""
    from flashcupy._checks import check_forward
    from flashcupy._policy import default_tile, wgmma_persistent, wgmma_schedule
    from flashcupy._variant import Variant

    tile = functools.partial(default_tile, "fwd_wgmma", "f16")
    assert tile(64, "fp32", True, n=1024) == (128, 128)
    assert tile(64, "fp32", True, n=1025) == (192, 128)
    assert tile(64, "fp32", False, n=1024) == (192, 128)
    assert tile(64, "fp32", True, 192, n=1024) == (192, 128)   # a caller's block_m wins
    assert tile(128, "fp32", False, n=1024) == (128, 128)      # its static split stores o by TMA
    assert tile(128, "fp32", False, n=1025) == tile(128, "fp32", False) == (128, 176)
    assert wgmma_schedule(128, True, 2048) == "dynamic"
    assert wgmma_schedule(128, True, 2049) == wgmma_schedule(128, True) == "tile"
    assert wgmma_schedule(128, True, 1024, (128, 176)) == "tile"
    assert wgmma_schedule(128, False, 1024, (128, 176)) == "static"
    assert wgmma_schedule(128, False, 1025) == wgmma_schedule(128, False, 1024, (192, 128)) == "tile"
    assert (wgmma_schedule(64, False), wgmma_schedule(64, True)) == ("static", "dynamic")

    q = np.zeros((1, 2, 1024, 128), np.float16)
    p = check_forward(q, q, q, **{**FORWARD_DEFAULTS, "causal": True, "kernel": "wgmma"})
    assert p.variant.key == "fwd_wgmma.f16.acc32.bm128.bn128.d128.causal.dynamic"
    assert wgmma_persistent(p.variant) == 2
    q = np.zeros((1, 2, 4096, 128), np.float16)
    p = check_forward(q, q, q, **{**FORWARD_DEFAULTS, "causal": True, "kernel": "wgmma"})
    assert p.variant.key == "fwd_wgmma.f16.acc32.bm128.bn128.d128.causal" and wgmma_persistent(p.variant) == 0
    q = np.zeros((1, 2, 1000, 64), np.float16)
    p = check_forward(q, q, q, **{**FORWARD_DEFAULTS, "causal": True, "kernel": "wgmma"})
    assert p.variant.key == "fwd_wgmma.f16.acc32.bm128.bn128.d64.causal" and wgmma_persistent(p.variant) == 2
    same = Variant("fwd_wgmma", "f16", "fp32", 192, 128, 64, schedule="static")
    assert same == Variant("fwd_wgmma", "f16", "fp32", 192, 128, 64) and same.schedule is None
    for family, bm, bn, schedule in (("fwd_mma", 128, 64, "dynamic"), ("fwd_wgmma", 128, 128, "loop")):
        with pytest.raises(ValueError, match="schedule must be"):
            Variant(family, "f16", "fp32", bm, bn, 64, schedule=schedule)


# ---- sliding windows: one form per mask ----------------------------------------------------------------

@pytest.mark.parametrize("window,causal,nq,nk,want", [
    ((-1, -1), False, 10, 10, (False, None)),
    ((-1, 0), False, 10, 10, (True, None)),          # flash_attn_func's causal
    ((5, -1), True, 10, 10, (False, (5, 0))),        # a causal window has right reach 0
    ((5, 7), True, 10, 10, (False, (5, 0))),
    ((9, -1), True, 10, 10, (True, None)),           # left >= Nk - 1 reaches every key: plain causal
    ((3, 20), False, 10, 30, (False, (3, -1))),      # right >= Nq - 1: unbounded on the right
    ((3, 8), False, 10, 30, (False, (3, 8))),
    ((29, 9), False, 10, 30, (False, None)),         # wider than the problem: no window at all
    ((2, 0), True, 1, 5, (False, (2, -1))),          # one row (decoding): right 0 reaches its last key
    ((2, 7), False, 1, 5, (False, (2, -1))),         # the same mask, the same form
    ((-1, 0), False, 1, 5, (False, None)),
])
def test_a_window_has_one_form(window, causal, nq, nk, want):
    """``window_of`` maps equal masks to one (causal, window) pair, so that they compile one module and a
    window wider than the problem runs the kernel without one; the reference's mask agrees."""
    from flashcupy._checks import window_of
    from flashcupy.reference import visible_mask

    got = window_of(window, causal, nq, nk)
    assert got == want
    rows = np.arange(nq)
    np.testing.assert_array_equal(visible_mask(rows, nq, nk, causal, window),
                                  visible_mask(rows, nq, nk, got[0], got[1] or (-1, -1)))


def test_window_reaches_the_variant_and_bad_windows_are_refused():
    """The call's window lands in the variant (key and defines); bad values are refused before any work,
    and a Variant holds only the one form."""
    from flashcupy._checks import check_forward
    from flashcupy._variant import Variant

    q, k, v = qkv(np.random.default_rng(0), (1, 2, 1, 40, 60, 16), "f32")
    p = check_forward(q, k, v, **{**FORWARD_DEFAULTS, "causal": True, "window_size": (7, 3)})
    assert p.variant.window == (7, 0) and not p.variant.causal and ".win7_0" in p.variant.key
    d = p.variant.defines()
    assert (d["FC_WINDOW"], d["FC_WINDOW_LEFT"], d["FC_WINDOW_RIGHT"], d["FC_CAUSAL"]) == (1, 7, 0, 0)
    plain = check_forward(q, k, v, **FORWARD_DEFAULTS).variant.defines()
    assert (plain["FC_WINDOW"], plain["FC_WINDOW_LEFT"], plain["FC_WINDOW_RIGHT"]) == (0, -1, -1)
    for bad, exc in (((-2, 0), ValueError), ((1 << 30, 0), ValueError), ((1.0, 2), TypeError),
                     ((True, 2), TypeError), (3, TypeError), ((1, 2, 3), TypeError)):
        with pytest.raises(exc, match="window_size"):
            flashcupy.attention(q, k, v, window_size=bad)
    for bad in ((-1, 0), (-1, -1)):
        with pytest.raises(ValueError, match="window must be None"):
            Variant("fwd_simt", "f32", "fp32", 64, 64, 16, window=bad)
    with pytest.raises(ValueError, match="window must be None"):
        Variant("fwd_simt", "f32", "fp32", 64, 64, 16, causal=True, window=(5, 0))


def test_a_remembered_window_does_not_pass_a_bool_for_an_int():
    """(True, 3) equals (1, 3) as a tuple: the memo keys the entries' types too, so the bool is refused."""
    from flashcupy import _checks

    q, k, v = qkv(np.random.default_rng(0), (1, 1, 1, 20, 20, 16), "f32")
    kw = {**FORWARD_DEFAULTS, "window_size": (1, 3)}
    kw.pop("ablate", None)
    good = _checks.forward_problem(q, k, v, ablate=None, **kw)
    assert good.variant.window == (1, 3)
    with pytest.raises(TypeError, match="window_size"):
        _checks.forward_problem(q, k, v, ablate=None, **{**kw, "window_size": (True, 3)})


def test_softcap_reaches_the_variant_as_float32_bits():
    """A call's softcap lands in the variant as the float32 the kernels hold (key and -D bits, one module
    per float32 value); 0 is no hook at all; fp8 and the wgmma backward's wide tiles refuse it by name,
    and that backward's default tile takes 64 queries with it."""
    from flashcupy._checks import check_forward
    from flashcupy._policy import default_tile
    from flashcupy._variant import Variant

    q, k, v = qkv(np.random.default_rng(0), (1, 2, 1, 40, 60, 16), "f32")
    p = check_forward(q, k, v, **{**FORWARD_DEFAULTS, "softcap": 0.1})
    assert p.variant.softcap == float(np.float32(0.1)) and p.variant.key.endswith(".cap0p1")
    d = p.variant.defines()
    assert d["FC_SCORE_HOOK"] == 2 and np.uint32(d["FC_SOFTCAP_BITS"]).view(np.float32) == np.float32(0.1)
    plain = check_forward(q, k, v, **{**FORWARD_DEFAULTS, "softcap": 0}).variant
    assert plain.softcap == 0 and "FC_SCORE_HOOK" not in plain.defines() and "cap" not in plain.key
    same = check_forward(q, k, v, **{**FORWARD_DEFAULTS, "softcap": np.float32(0.1)}).variant
    assert same == p.variant
    fp8cap = Variant("fwd_wgmma", "f16", "fp32", 128, 128, 128, fp8="single", softcap=30.0)
    assert fp8cap.defines()["FC_SCORE_HOOK"] == 2 and fp8cap.key.endswith(".cap30.e4m3_single")
    with pytest.raises(ValueError, match="alibi_slopes do not run with fp8"):
        Variant("fwd_wgmma", "f16", "fp32", 128, 128, 128, fp8="single", alibi=True)
    with pytest.raises(ValueError, match="softcap at block_m=64, not 80"):
        Variant("bwd_wgmma", "f16", "fp32", 80, 128, 128, softcap=30.0)
    assert default_tile("bwd_wgmma", "f16", 128, "fp32", False, n=4096, softcap=30.0) == (64, 128)
    assert default_tile("bwd_wgmma", "f16", 128, "fp32", False, n=4096) == (80, 128)
    # kernel='auto' with a softcap and a tile the wgmma backward does not run with one: mma, not a refusal
    from flashcupy._policy import auto_family

    assert auto_family("bwd", "bf16", "fp32", 64, 128, None, False, hopper=True, softcap=30.0) == "bwd_mma"
    assert auto_family("bwd", "bf16", "fp32", 64, 128, None, False, hopper=True) == "bwd_wgmma"
    assert auto_family("bwd", "bf16", "fp32", 64, None, None, False, hopper=True, softcap=30.0) == "bwd_wgmma"
    # the inspection API names the variant a call with a cap and a window runs
    from flashcupy import inspect

    v = inspect.forward_variant(q, k, v, causal=True, window_size=(9, 0), softcap=30.0)
    assert v.softcap == 30.0 and v.window == (9, 0) and v.key.endswith(".win9_0.cap30")


@pytest.mark.parametrize("forward,backward,words", [
    ({"causal": True}, {}, "mask='causal' there, 'none' here"),
    ({}, {"scale": 0.5}, "scale="),
    ({"causal": True}, {"causal": True, "window_size": (4, 0)}, "window (4, 0)"),
    ({"softcap": 5.0}, {}, "softcap=5.0 there, 0.0 here"),
    ({"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625])}, {}, "alibi_slopes='given' there, None here"),
], ids=["causal", "scale", "window", "softcap", "alibi"])
def test_a_backward_refuses_the_lse_of_another_score_function(rng, forward, backward, words):
    """attention_backward given the lse attention returned with another scale, mask, softcap or ALiBi
    names the difference (before it, the gradients came back silently wrong: max error ~10); the lse of
    the same score function, and a copy of any (whose origin is unknown), run."""
    q, k, v = _qkv("f32")
    do = rng.standard_normal(q.shape).astype(np.float32)
    o, lse = flashcupy.attention(q, k, v, return_lse=True, **forward)
    with pytest.raises(ValueError, match="lse comes from a forward with another score function") as err:
        flashcupy.attention_backward(do, q, k, v, o, lse, **backward)
    assert words in str(err.value)
    flashcupy.attention_backward(do, q, k, v, o, lse, **forward)
    flashcupy.attention_backward(do, q, k, v, o, lse.copy(), **backward)


def test_the_lse_origins_are_dropped_with_their_arrays():
    """The backward's check keeps a weak reference per lse a forward returned: none outlives its array."""
    import gc

    from flashcupy import _checks

    q, k, v = _qkv("f32")
    gc.collect()  # (earlier tests' arrays, held by their tracebacks until collected)
    before = len(_checks._LSE_ORIGINS)
    outs = [flashcupy.attention(q, k, v, return_lse=True) for _ in range(5)]
    assert len(_checks._LSE_ORIGINS) == before + 5
    del outs
    gc.collect()
    assert len(_checks._LSE_ORIGINS) == before


@pytest.mark.parametrize("forward,backward", [
    ({}, {"scale": 32 ** -0.5}),  # (1 / sqrt(32) and 32 ** -0.5: one ulp apart)
    ({"scale": 0.2}, {"scale": np.float32(0.2)}),
    ({"causal": True}, {"window_size": (-1, 0)}),
    ({"window_size": (100, 100)}, {}),  # (a window wider than the problem: no window)
    ({"causal": True, "window_size": (100, 0)}, {"causal": True}),
], ids=["default-scale", "float32-scale", "causal-as-window", "wide-window", "wide-causal-window"])
def test_a_backward_takes_the_lse_of_the_same_score_function_spelled_otherwise(rng, forward, backward):
    """Spellings of one score function (a scale one ulp or a float32 rounding away, causal as a window,
    a window wider than the problem) are not refused, and give the gradients of the forward's own
    arguments."""
    q, k, v = _qkv("f32")
    do = rng.standard_normal(q.shape).astype(np.float32)
    o, lse = flashcupy.attention(q, k, v, return_lse=True, **forward)
    got = flashcupy.attention_backward(do, q, k, v, o, lse, **backward)
    want = flashcupy.attention_backward(do, q, k, v, o, lse, **forward)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)

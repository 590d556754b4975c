"""The packed forward (issue 36): ``attention_varlen`` on CuPy arrays runs one launch of the family's
varlen kernel for the whole ragged batch. Each sequence's o and lse must be the bits of its own
``attention`` call on the same tile (the per-sequence path, which the float64 tests of test_varlen.py
and test_attention_gpu.py hold to the accuracy rule), in every family, with every mask, the softcap and
ALiBi per sequence, sinks, GQA, sequences of 0 and 1 tokens, one without keys, and the wgmma tile walks; every
element of o and lse is written (NaN-poisoned outputs)."""
from __future__ import annotations

import numpy as np
import pytest

import flashcupy
from flashcupy import _varlen
from flashcupy._checks import numpy_dtype
from tests.helpers import _assert_written, _poisoned

pytestmark = pytest.mark.gpu

LENGTHS_Q = [5, 1, 0, 130, 64, 129, 7, 300]
LENGTHS_K = [9, 1, 4, 200, 64, 0, 7, 260]  # (the sixth: queries without keys; the third: keys, no queries)
COMBOS = [("wgmma", "f16", "fp32", (128, 128)), ("wgmma", "bf16", "fp32", (192, 128)),
          ("wgmma", "f16", "fp16", (128, 128)), ("mma", "bf16", "fp32", (128, 64)),
          ("mma", "f16", "fp16", (64, 64)), ("simt", "f32", "fp32", (64, 64)),
          ("simt", "f16", "fp16", (32, 64))]
MASKS = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(40, 3)),
         "softcap-alibi": dict(causal=True, softcap=5.0, alibi=True), "sinks": dict(causal=True, sinks=True)}


def _packed(rng, dname, d, hq=4, hkv=2):
    import cupy

    dt = numpy_dtype(dname)
    q = rng.standard_normal((sum(LENGTHS_Q), hq, d)).astype(dt)
    k, v = (rng.standard_normal((sum(LENGTHS_K), hkv, d)).astype(dt) for _ in range(2))
    cu = [np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (LENGTHS_Q, LENGTHS_K)]
    return [cupy.asarray(x) for x in (q, k, v)], cu


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"{c[0]}-{c[1]}-acc{c[2][2:]}-bm{c[3][0]}")
def test_packed_forward_is_each_sequence_alone_bit_for_bit(rng, combo, mask, d):
    import cupy

    kernel, dname, accum, (bm, bn) = combo
    if d == 128 and bm == 192:
        bm = 128  # (192 rows at D = 128 take 128 keys; the tile stays the same on both paths)
    (q, k, v), (cq, ck) = _packed(rng, dname, d)
    kw = {key: val for key, val in MASKS[mask].items() if key not in ("alibi", "sinks")}
    if MASKS[mask].get("alibi"):
        kw["alibi_slopes"] = cupy.asarray(rng.uniform(0.01, 0.3, (len(LENGTHS_Q), 4)).astype(np.float32))
    if MASKS[mask].get("sinks"):
        kw["sinks"] = cupy.asarray(rng.uniform(-1.0, 3.0, 4).astype(np.float32))
    kw.update(kernel=kernel, accum=accum, block_m=bm, block_n=bn)
    o = _poisoned((q.shape[0], q.shape[1], d), q.dtype)
    lse = _poisoned((q.shape[1], q.shape[0]), cupy.float32)
    _varlen._forward_packed(q, k, v, cq, ck, o=o, lse=lse, **{"causal": False, **kw})
    cupy.cuda.get_current_stream().synchronize()
    _assert_written(f"{combo} {mask} d={d}", o=o, lse=lse)
    for i in range(len(LENGTHS_Q)):
        (qa, qb), (ka, kb) = cq[i:i + 2], ck[i:i + 2]
        if qb == qa:
            continue
        if kb == ka:  # rows that see no key: o = 0, lse = -inf (with sinks: the sink)
            want = kw["sinks"][:, None] if "sinks" in kw else -np.inf
            assert bool((o[qa:qb] == 0).all()) and bool((lse[:, qa:qb] == want).all()), i
            continue
        one = {**kw, "alibi_slopes": kw["alibi_slopes"][i]} if "alibi_slopes" in kw else kw
        oi, li = flashcupy.attention(_varlen._view(q, qa, qb), _varlen._view(k, ka, kb),
                                     _varlen._view(v, ka, kb), return_lse=True, **{"causal": False, **one})
        assert bool((o[qa:qb] == oi[0].transpose(1, 0, 2)).all()), f"o of sequence {i}"
        assert bool((lse[:, qa:qb] == li[0]).all()), f"lse of sequence {i}"


def test_attention_varlen_takes_the_packed_launch_and_the_walks_change_sequences(rng, monkeypatch):
    """The public entry point runs the packed kernel (one forward launch), and the persistent wgmma
    forward on 3 CTAs, whose tiles then belong to several sequences, gives the same bits as on one CTA
    per SM."""
    import cupy

    from flashcupy import _launch

    (q, k, v), (cq, ck) = _packed(rng, "f16", 64)
    calls = []
    real = _launch.forward
    monkeypatch.setattr(_launch, "forward", lambda *a, **kw: calls.append(kw.get("cu")) or real(*a, **kw))
    for causal in (False, True):  # D = 64: the static split and the dynamic scheduler
        calls.clear()
        o, lse = flashcupy.attention_varlen(q, k, v, cq, ck, causal=causal, kernel="wgmma", return_lse=True)
        assert len(calls) == 1 and calls[0] is not None
        _launch._FORWARD_PLANS.clear()  # (a plan keeps its grid)
        with monkeypatch.context() as m:
            m.setattr(_launch, "_wgmma_ctas", lambda tiles: min(tiles, 3))
            o3, lse3 = flashcupy.attention_varlen(q, k, v, cq, ck, causal=causal, kernel="wgmma",
                                                  return_lse=True)
            cupy.cuda.get_current_stream().synchronize()
        _launch._FORWARD_PLANS.clear()
        assert bool((o == o3).all()) and bool((lse == lse3).all()), causal


# (kernel, dtype, accumulator, the backward's tile at D = 64, at D = 128); the wgmma tiles cover its
# three dQ forms: by columns (64 x 128, 64 x 64), by rows (128 x 128, D = 64), transposed (80 x 128, D = 128)
BWD_COMBOS = [("wgmma", "f16", "fp32", (64, 128), (64, 128)),
              ("wgmma", "bf16", "fp32", (128, 128), (80, 128)),
              ("wgmma", "f16", "fp32", (64, 64), (80, 128)),
              ("mma", "bf16", "fp32", (64, 128), (64, 128)), ("mma", "f16", "fp16", (64, 64), (64, 64)),
              ("simt", "f32", "fp32", (64, 64), (64, 64)), ("simt", "f16", "fp16", (32, 64), (32, 64))]


@pytest.mark.parametrize("deterministic", [True, False], ids=["ordered", "atomic"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("combo", BWD_COMBOS,
                         ids=lambda c: f"{c[0]}-{c[1]}-acc{c[2][2:]}-{c[3][0]}x{c[3][1]}-{c[4][0]}")
def test_packed_backward_is_each_sequence_alone(rng, combo, mask, d, deterministic):
    """The backwards' varlen kernels: dq, dk, dv of each sequence are the bits of its own
    attention_backward call on the same tile and path (the atomic dQ path: dk, dv; dq within two
    roundings of the element type, its fp32 sums running in another order), every element written; d
    sinks the sum of the sequences' within float32 rounding. wgmma: its three dQ forms (by columns, by
    rows at block_m 128, transposed at block_m 80), ordered and atomic (rotated without a mask)."""
    import cupy

    kernel, dname, accum, tile64, tile128 = combo
    bm, bn = tile64 if d == 64 else tile128
    refused = kernel == "wgmma" and mask == "softcap-alibi" and d == 128  # (the family's limit)
    if kernel == "wgmma" and mask == "softcap-alibi":
        bm, bn = 64, 128  # (its softcap runs at block_m 64)
    (q, k, v), (cq, ck) = _packed(rng, dname, d)
    do = cupy.asarray(rng.standard_normal(q.shape).astype(numpy_dtype(dname)))
    kw = {key: val for key, val in MASKS[mask].items() if key not in ("alibi", "sinks")}
    if MASKS[mask].get("alibi"):
        kw["alibi_slopes"] = cupy.asarray(rng.uniform(0.01, 0.3, (len(LENGTHS_Q), 4)).astype(np.float32))
    if MASKS[mask].get("sinks"):
        kw["sinks"] = cupy.asarray(rng.uniform(-1.0, 3.0, 4).astype(np.float32))
    kw.update(kernel=kernel, accum=accum)
    kw = {"causal": False, **kw}
    o, lse = flashcupy.attention_varlen(q, k, v, cq, ck, return_lse=True, **kw)  # (the forward's own tile)
    kw.update(block_m=bm, block_n=bn)
    grads = tuple(_poisoned(x.shape, x.dtype) for x in (q, k, v))
    if refused:  # by name, before any launch, as attention_backward refuses it
        with pytest.raises(ValueError, match="softcap with ALiBi at D=64 only"):
            _varlen._backward_packed(do, q, k, v, o, lse, cq, ck, deterministic=deterministic, grads=grads,
                                     **kw)
        return
    got = _varlen._backward_packed(do, q, k, v, o, lse, cq, ck, deterministic=deterministic, grads=grads,
                                   **kw)
    assert got is not None, "the packed backward did not run"
    cupy.cuda.get_current_stream().synchronize()
    _assert_written(f"{combo} {mask} d={d}", dq=got[0], dk=got[1], dv=got[2])
    eps = float(np.finfo(np.float32).eps) if dname == "f32" else 2.0 ** (-8 if dname == "bf16" else -11)
    dsinks = 0
    for i in range(len(LENGTHS_Q)):
        (qa, qb), (ka, kb) = cq[i:i + 2], ck[i:i + 2]
        if qb == qa:  # keys without queries: dk = dv = 0
            assert bool((got[1][ka:kb] == 0).all()) and bool((got[2][ka:kb] == 0).all()), i
            continue
        if kb == ka:  # queries without keys: dq = 0
            assert bool((got[0][qa:qb] == 0).all()), i
            continue
        one = {**kw, "alibi_slopes": kw["alibi_slopes"][i]} if "alibi_slopes" in kw else kw
        views = [_varlen._view(x, qa, qb) for x in (do, q)] + [_varlen._view(x, ka, kb) for x in (k, v)]
        lse_i = cupy.ascontiguousarray(lse[None, :, qa:qb])
        ref = flashcupy.attention_backward(*views, _varlen._view(o, qa, qb), lse_i,
                                           deterministic=deterministic, **one)
        for name, g, r, (a, b) in (("dk", got[1], ref[1], (ka, kb)), ("dv", got[2], ref[2], (ka, kb)),
                                   ("dq", got[0], ref[0], (qa, qb))):
            want = r[0].transpose(1, 0, 2)
            if name == "dq" and not deterministic:
                diff = float(cupy.abs(g[a:b].astype(cupy.float32) - want.astype(cupy.float32)).max())
                assert diff <= 2 * eps * float(cupy.abs(want.astype(cupy.float32)).max()), (name, i, diff)
            else:
                assert bool((g[a:b] == want).all()), f"{name} of sequence {i}"
        if "sinks" in kw:
            dsinks = dsinks + ref[3]
    if "sinks" in kw:
        cupy.testing.assert_allclose(got[3], dsinks, rtol=1e-5, atol=1e-6)


def test_attention_varlen_backward_takes_the_packed_launches(rng, monkeypatch):
    """attention_varlen_backward runs the packed backward (one call of the launcher) in every family."""
    import cupy

    from flashcupy import _launch

    (q, k, v), (cq, ck) = _packed(rng, "bf16", 64)
    do = cupy.asarray(rng.standard_normal(q.shape).astype(q.dtype))
    calls = []
    real = _launch.backward
    monkeypatch.setattr(_launch, "backward", lambda *a, **kw: calls.append(kw.get("cu")) or real(*a, **kw))
    for kernel in ("mma", "wgmma", "simt"):
        calls.clear()
        o, lse = flashcupy.attention_varlen(q, k, v, cq, ck, causal=True, kernel=kernel, return_lse=True)
        flashcupy.attention_varlen_backward(do, q, k, v, o, lse, cq, ck, causal=True, kernel=kernel,
                                            deterministic=True)
        assert len(calls) == 1 and calls[0] is not None, (kernel, calls)


def test_packed_backward_refuses_what_attention_backward_refuses(rng):
    """The packed backward checks do, o, lse and dlse as attention_backward does, before any launch."""
    import cupy

    (q, k, v), (cq, ck) = _packed(rng, "f16", 64)
    do = cupy.asarray(rng.standard_normal(q.shape).astype(np.float16))
    o, lse = flashcupy.attention_varlen(q, k, v, cq, ck, kernel="mma", return_lse=True)
    cases = ((dict(do=do.astype(cupy.float32)), "do must be float16"),
             (dict(lse=lse.astype(cupy.float64)), "lse must be float32"),
             (dict(dlse=cupy.zeros(lse.shape, cupy.float16)), "dlse must be float32"),
             (dict(o=cupy.asnumpy(o)), "o must be a CuPy array"))
    for change, words in cases:
        args = dict(do=do, o=o, lse=lse)
        extra = {"dlse": change.pop("dlse")} if "dlse" in change else {}
        args.update(change)
        with pytest.raises(TypeError, match=words):
            flashcupy.attention_varlen_backward(args["do"], q, k, v, args["o"], args["lse"], cq, ck,
                                                kernel="mma", **extra)


@pytest.mark.parametrize("kernel", ["wgmma", "mma", "simt"])
def test_packed_paths_take_broadcast_reversed_and_misaligned_views(rng, kernel):
    """Everyday views on the packed forward and backward in every family: do broadcast over its tokens
    (stride 0, torch's gradient of a sum), k and v reversed in their heads (negative strides), q
    starting one element into a buffer (misaligned for 16-byte loads and TMA). Each gives the bits of
    the same call on contiguous copies (copied where a kernel cannot read the view), and the context
    survives (a plain call after)."""
    import cupy

    (q, k, v), (cq, ck) = _packed(rng, "f32" if kernel == "simt" else "f16", 64)
    do = cupy.asarray(rng.standard_normal(q.shape[1:]).astype(q.dtype))
    base = cupy.empty(q.size + 1, q.dtype)
    q_mis = base[1:].reshape(q.shape)
    q_mis[...] = q
    views = dict(q=q_mis, k=k[:, ::-1], v=v[:, ::-1], do=cupy.broadcast_to(do, q.shape))
    plain = {name: cupy.ascontiguousarray(x) for name, x in views.items()}
    for det in (False, True):
        outs = []
        for args in (views, plain):
            o, lse = flashcupy.attention_varlen(args["q"], args["k"], args["v"], cq, ck, causal=True,
                                                kernel=kernel, return_lse=True)
            grads = flashcupy.attention_varlen_backward(args["do"], args["q"], args["k"], args["v"], o, lse,
                                                        cq, ck, causal=True, kernel=kernel, deterministic=det)
            outs.append((o, lse, *grads))
        for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), *outs):
            if name == "dq" and not det:  # (the atomic path's fp32 sums run in any order: two roundings)
                eps = float(np.finfo(np.float32).eps) if kernel == "simt" else 2.0 ** -11
                diff = float(cupy.abs(a.astype(cupy.float32) - b.astype(cupy.float32)).max())
                assert diff <= 2 * eps * float(cupy.abs(b.astype(cupy.float32)).max()), (kernel, diff)
            else:
                assert bool((a == b).all()), (kernel, det, name)
    cupy.cuda.get_current_stream().synchronize()
    flashcupy.attention_varlen(q, k, v, cq, ck, kernel=kernel)  # (the context survives)
    cupy.cuda.get_current_stream().synchronize()

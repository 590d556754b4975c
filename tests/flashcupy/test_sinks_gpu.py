"""Attention sinks on every kernel family (issue 35: a logit per head in each row's denominator, merged
after the key loop by ``flashcupy._sinks``), forward and backward (both dQ paths), d sinks included,
against the float64 reference by the accuracy rule; with masks, GQA, Nq != Nk and rows that see no key
(o = 0, lse = the sink); sinks from NumPy and from CuPy; a captured call replayed."""
from __future__ import annotations

import numpy as np
import pytest

import flashcupy
from flashcupy import naive, reference
from flashcupy.accuracy import assert_accurate, assert_lse_accurate, assert_matches_twin, backward_reduction
from tests.helpers import (
    BWD_COMBOS,
    FWD_COMBOS,
    combo_id,
    do_qkv,
    record_scratch,
    replay_beside_sentinels,
    to_device,
)

pytestmark = pytest.mark.gpu

MASKS = [  # (causal, window_size)
    pytest.param(False, (-1, -1), id="full"),
    pytest.param(True, (-1, -1), id="causal"),
    pytest.param(True, (64, 0), id="w64-0"),
]
SHAPES = [(300, 300), (113, 517), (517, 113)]  # 517 x 113 causal: 404 rows see no key


def _sinks(rng, hq: int):
    """Sink logits from about the keys' LSE (ln 300 ~ 5.7) to well above it: a sink that takes little of
    its row, one that takes most of it."""
    return (rng.standard_normal(hq) * 3 + 5).astype(np.float32)


@pytest.mark.parametrize("causal,window", MASKS)
@pytest.mark.parametrize("combo", FWD_COMBOS, ids=combo_id)
def test_sinks_forward_matches_reference(rng, combo, causal, window):
    import cupy

    kernel, dname, accum = combo
    kw = dict(causal=causal, window_size=window)
    for i, shape in enumerate(SHAPES):
        host = do_qkv(rng, (2, 4, 2, *shape, 64), dname)
        z = _sinks(rng, 4)
        dev = to_device(*host[1:])
        sinks = z if i % 2 else cupy.asarray(z)  # NumPy and CuPy sinks
        o, lse = flashcupy.attention(*dev, return_lse=True, accum=accum, kernel=kernel, sinks=sinks, **kw)
        what = f"{kernel} {dname} acc={accum} {shape} causal={causal} window={window}"
        o_ref, lse_ref = reference.attention(*host[1:], return_lse=True, sinks=z, **kw)
        assert_accurate(o, o_ref, naive.attention(*dev, sinks=z, **kw), dname, accum, what=what)
        assert_lse_accurate(lse, lse_ref, accum, what=what)
        seen = reference.visible_mask(np.arange(shape[0]), *shape, causal, window).any(axis=1)
        lse_h = cupy.asnumpy(lse)
        assert (lse_h[..., ~seen] == z[None, :, None]).all(), what  # a row without keys: the sink alone
        assert (cupy.asnumpy(o)[..., ~seen, :] == 0).all(), what


@pytest.mark.parametrize("causal,window", MASKS)
@pytest.mark.parametrize("combo", BWD_COMBOS, ids=combo_id)
def test_sinks_backward_matches_reference(rng, combo, causal, window):
    kernel, dname, accum = combo
    kw = dict(causal=causal, window_size=window)
    for shape in SHAPES:
        host = do_qkv(rng, (2, 4, 2, *shape, 64), dname)
        z = _sinks(rng, 4)
        do, q, k, v = to_device(*host)
        o, lse = flashcupy.attention(q, k, v, return_lse=True, accum=accum, kernel=kernel, sinks=z, **kw)
        refs = reference.attention_backward(*host, sinks=z, **kw)
        naives = naive.attention_backward(do, q, k, v, sinks=z, **kw)
        red = backward_reduction(*host[1:3])
        dets = (False, True) if kernel in ("mma", "wgmma") and accum == "fp32" else (True,)
        for det in dets:
            grads = flashcupy.attention_backward(do, q, k, v, o, lse, accum=accum, kernel=kernel,
                                                 deterministic=det, sinks=z, **kw)
            assert len(grads) == 4
            for name, g, r, n in zip(("dq", "dk", "dv", "dsinks"), grads, refs, naives):
                assert_accurate(g, r, n, dname, accum, kind="bwd", reduction=red,
                                what=f"{kernel} {dname} acc={accum} {shape} causal={causal} window={window} "
                                     f"det={det} {name}")


TWIN_COMBOS = [("wgmma", "bf16", "fp32"), ("mma", "f16", "fp16"), ("simt", "f32", "fp32")]


@pytest.mark.parametrize("combo", TWIN_COMBOS, ids=combo_id)
def test_sinks_with_a_softcap_match_the_twin(rng, combo):
    """The kernels' forward and backward with sinks and a softcap against the twin's rounding model (which
    merges the sinks with the same formula, in NumPy's float32)."""
    import cupy

    kernel, dname, accum = combo
    host = do_qkv(rng, (1, 4, 2, 517, 300, 64), dname)
    z = _sinks(rng, 4)
    kw = dict(causal=True, softcap=20.0, sinks=z, accum=accum, kernel=kernel, block_n=64)
    twin = flashcupy.attention(*host[1:], return_lse=True, **kw)
    dev = to_device(*host)
    o, lse = flashcupy.attention(*dev[1:], return_lse=True, **kw)
    assert_matches_twin(cupy.asnumpy(o), twin[0], dname, accum, what=f"{kernel} o")
    kwb = {**kw, "block_n": None, "deterministic": True}
    twin_g = flashcupy.attention_backward(*host, *twin, **kwb)
    grads = flashcupy.attention_backward(*dev, o, lse, **kwb)
    for name, g, t in zip(("dq", "dk", "dv", "dsinks"), grads, twin_g):
        assert_matches_twin(cupy.asnumpy(g), t, dname, accum, kind="bwd", what=f"{kernel} {name}")


def test_a_captured_call_with_sinks_replays_and_keeps_to_its_memory(rng, monkeypatch):
    """Forward and deterministic backward with CuPy sinks captured into one CUDA graph: a replay on new
    q data gives the eager bits, and leaves arrays the pool hands out afterwards alone."""
    import cupy

    host = do_qkv(rng, (2, 4, 2, 300, 517, 64), "bf16")
    do, q, k, v = to_device(*host)
    z = cupy.asarray(_sinks(rng, 4))
    kw = dict(causal=True, sinks=z, deterministic=True)
    requests = record_scratch(monkeypatch)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        def step():
            o, lse = flashcupy.attention(q, k, v, return_lse=True, causal=True, sinks=z)
            return (o, lse, *flashcupy.attention_backward(do, q, k, v, o, lse, **kw))
        step()  # compile outside the capture
        stream.synchronize()
        stream.begin_capture()
        outs = step()
        graph = stream.end_capture()
    replay_beside_sentinels(graph, stream, requests)
    q[...] = cupy.asarray(np.flip(host[1], axis=2).copy())
    graph.launch(stream)
    stream.synchronize()
    with stream:
        want = step()
    stream.synchronize()
    for name, got, ref in zip(("o", "lse", "dq", "dk", "dv", "dsinks"), outs, want):
        assert cupy.array_equal(got, ref), name


def test_sinks_on_cupy_are_checked_before_any_launch(rng):
    import cupy

    q, = to_device(rng.standard_normal((1, 2, 8, 64)).astype(np.float16))
    with pytest.raises(ValueError, match=r"sinks must have shape \(Hq,\)"):
        flashcupy.attention(q, q, q, sinks=cupy.zeros(3, cupy.float32))
    with pytest.raises(TypeError, match="sinks must be a float array"):
        flashcupy.attention(q, q, q, sinks=cupy.zeros(2, cupy.int32))
    with pytest.raises(TypeError, match="pass NumPy sinks"):
        qh = cupy.asnumpy(q)
        flashcupy.attention(qh, qh, qh, sinks=cupy.zeros(2, cupy.float32))

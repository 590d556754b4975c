"""flashcupy.attention_varlen and attention_varlen_backward (issue 36): packed ragged batches (lengths 0,
1, tile - 1, tile + 1, long; queries without keys; keys without queries) against the float64 reference of
each sequence alone, forward and backward, causal and not, GQA, with a window and with sinks; bad
cumulative lengths refused by name before any work. NumPy inputs (the twin) here; the CuPy path runs the
same calls on the kernels (test at the end, GPU)."""
from __future__ import annotations

import numpy as np
import pytest

import flashcupy
from flashcupy import naive, reference
from flashcupy._checks import numpy_dtype
from flashcupy.accuracy import assert_accurate, assert_lse_accurate, backward_reduction

LENGTHS_Q = [5, 1, 63, 65, 0, 130, 7, 40]
LENGTHS_K = [9, 1, 63, 65, 4, 200, 0, 10]   # (the last: more queries than keys, causal rows that see none)


def _packed(rng, dname, hq=4, hkv=2, d=16):
    dt = numpy_dtype(dname)
    tq, tk = sum(LENGTHS_Q), sum(LENGTHS_K)
    q, do = (rng.standard_normal((tq, hq, d)).astype(dt) for _ in range(2))
    k, v = (rng.standard_normal((tk, hkv, d)).astype(dt) for _ in range(2))
    cu = [np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (LENGTHS_Q, LENGTHS_K)]
    return q, k, v, do, cu


def _seq(x, cu, i):
    """Sequence i of a packed array as (1, H, n, D)."""
    return x[cu[i]:cu[i + 1]].transpose(1, 0, 2)[None]


@pytest.mark.parametrize("kw", [dict(causal=False), dict(causal=True),
                                dict(causal=True, window_size=(20, 0))],
                         ids=["full", "causal", "window"])
@pytest.mark.parametrize("dname", ["f32", "bf16"])
def test_varlen_is_each_sequence_alone(rng, dname, kw):
    q, k, v, do, (cq, ck) = _packed(rng, dname)
    o, lse = flashcupy.attention_varlen(q, k, v, cq, ck, max(LENGTHS_Q), max(LENGTHS_K), block_n=64,
                                        return_lse=True, **kw)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (q.shape[1], q.shape[0])
    grads = flashcupy.attention_varlen_backward(do, q, k, v, o, lse, cq, ck, **kw)
    for i in range(len(LENGTHS_Q)):
        qi, ki, vi, doi = _seq(q, cq, i), _seq(k, ck, i), _seq(v, ck, i), _seq(do, cq, i)
        oi, li = _seq(o, cq, i), lse[:, cq[i]:cq[i + 1]]
        if LENGTHS_Q[i] == 0:
            continue
        if LENGTHS_K[i] == 0:  # queries that see no key
            assert np.all(oi == 0) and np.all(np.isneginf(li))
            assert np.all(_seq(grads[0], cq, i) == 0)
            continue
        o_ref, lse_ref = reference.attention(qi, ki, vi, return_lse=True, **kw)
        assert_accurate(oi, o_ref, naive.attention(qi, ki, vi, **kw), dname, "fp32", what=f"seq {i} o")
        assert_lse_accurate(li, lse_ref[0], "fp32", what=f"seq {i} lse")
        refs = reference.attention_backward(doi, qi, ki, vi, **kw)
        naives = naive.attention_backward(doi, qi, ki, vi, **kw)
        gi = (_seq(grads[0], cq, i), _seq(grads[1], ck, i), _seq(grads[2], ck, i))
        for name, g, r, n in zip(("dq", "dk", "dv"), gi, refs, naives):
            assert_accurate(g, r, n, dname, "fp32", kind="bwd", reduction=backward_reduction(qi, ki),
                            what=f"seq {i} {name}")
    # keys of a sequence without queries get no gradient
    assert np.all(_seq(grads[1], ck, 4) == 0) and np.all(_seq(grads[2], ck, 4) == 0)


def test_varlen_sinks_sum_their_gradient_over_the_sequences(rng):
    """With sinks, rows without keys keep lse = their head's sink, and d sinks is the sum of each
    sequence's (the reference's, sequence by sequence)."""
    q, k, v, do, (cq, ck) = _packed(rng, "f32")
    sinks = rng.standard_normal(q.shape[1]).astype(np.float32)
    o, lse = flashcupy.attention_varlen(q, k, v, cq, ck, causal=True, sinks=sinks, return_lse=True)
    np.testing.assert_allclose(lse[:, cq[6]:cq[7]], np.repeat(sinks[:, None], LENGTHS_Q[6], axis=1))
    grads = flashcupy.attention_varlen_backward(do, q, k, v, o, lse, cq, ck, causal=True, sinks=sinks)
    assert len(grads) == 4
    want = sum(reference.attention_backward(_seq(do, cq, i), _seq(q, cq, i), _seq(k, ck, i), _seq(v, ck, i),
                                            causal=True, sinks=sinks)[3]
               for i in range(len(LENGTHS_Q)) if LENGTHS_Q[i] and LENGTHS_K[i])
    np.testing.assert_allclose(grads[3], want, rtol=1e-4, atol=1e-5)


def test_varlen_alibi_per_sequence_and_the_lse_gradient(rng):
    """ALiBi slopes (B, Hq) give each sequence its row; the LSE's gradient (packed as lse) reaches each
    sequence's backward: both against the reference of each sequence alone."""
    q, k, v, do, (cq, ck) = _packed(rng, "f32")
    nseq, hq = len(LENGTHS_Q), q.shape[1]
    slopes = rng.uniform(0.05, 0.5, (nseq, hq)).astype(np.float32)
    dlse = rng.standard_normal((hq, q.shape[0])).astype(np.float32)
    o, lse = flashcupy.attention_varlen(q, k, v, cq, ck, causal=True, alibi_slopes=slopes, return_lse=True)
    grads = flashcupy.attention_varlen_backward(do, q, k, v, o, lse, cq, ck, causal=True, alibi_slopes=slopes,
                                                dlse=dlse)
    for i in (0, 3, 5, 7):
        qi, ki, vi, doi = _seq(q, cq, i), _seq(k, ck, i), _seq(v, ck, i), _seq(do, cq, i)
        kw = dict(causal=True, alibi_slopes=slopes[i])
        np.testing.assert_allclose(_seq(o, cq, i), reference.attention(qi, ki, vi, **kw), rtol=0, atol=2e-6)
        refs = reference.attention_backward(doi, qi, ki, vi, dlse=dlse[None, :, cq[i]:cq[i + 1]], **kw)
        got = (_seq(grads[0], cq, i), _seq(grads[1], ck, i), _seq(grads[2], ck, i))
        for g, r in zip(got, refs):
            np.testing.assert_allclose(g, r, rtol=0, atol=2e-5 * max(1.0, np.abs(r).max()))
    # slopes as lists, which attention takes too: the same bits
    o_list, lse_list = flashcupy.attention_varlen(q, k, v, cq, ck, causal=True, alibi_slopes=slopes.tolist(),
                                                  return_lse=True)
    assert np.array_equal(o_list, o) and np.array_equal(lse_list, lse)
    for bad in (slopes[:3], slopes[0, :3]):
        words = "alibi_slopes must have shape \\(Hq,\\) = \\(4,\\) or, per sequence, \\(B, Hq\\) = \\(8, 4\\)"
        with pytest.raises(ValueError, match=words):
            flashcupy.attention_varlen(q, k, v, cq, ck, alibi_slopes=bad)


@pytest.mark.parametrize("mutate,exc,words", [
    (lambda cq, ck: (cq.astype(np.int64), ck), TypeError, "cu_seqlens_q must be int32"),
    (lambda cq, ck: (cq, ck[::-1].copy()), ValueError, "cu_seqlens_k must start at 0, never decrease"),
    (lambda cq, ck: (cq[:-1], ck), ValueError, "cu_seqlens_q must start at 0, never decrease and end"),
    (lambda cq, ck: (cq, np.append(ck, ck[-1] + 1).astype(np.int32)), ValueError, "cu_seqlens_k must start"),
    (lambda cq, ck: (cq[None], ck), ValueError, "1-D of length B \\+ 1"),
    (lambda cq, ck: (list(cq), ck), TypeError, "int32 NumPy or CuPy array"),
])
def test_bad_cumulative_lengths_are_refused_by_name(rng, mutate, exc, words):
    q, k, v, _, (cq, ck) = _packed(rng, "f32")
    with pytest.raises(exc, match=words):
        flashcupy.attention_varlen(q, k, v, *mutate(cq, ck))


def test_bad_shapes_and_bounds_are_refused(rng):
    q, k, v, do, (cq, ck) = _packed(rng, "f32")
    with pytest.raises(ValueError, match="max_seqlen_q is 100, but cu_seqlens_q has a sequence of 130"):
        flashcupy.attention_varlen(q, k, v, cq, ck, max_seqlen_q=100)
    with pytest.raises(ValueError, match="q must be packed"):
        flashcupy.attention_varlen(q[None], k, v, cq, ck)
    with pytest.raises(ValueError, match="one batch"):
        flashcupy.attention_varlen(q, k, v, cq, np.array([0, k.shape[0]], dtype=np.int32))
    o, lse = flashcupy.attention_varlen(q, k, v, cq, ck, return_lse=True)
    with pytest.raises(ValueError, match="lse must have shape"):
        flashcupy.attention_varlen_backward(do, q, k, v, o, lse.T, cq, ck)
    with pytest.raises(TypeError, match="o must be an array of shape .* got NoneType"):
        flashcupy.attention_varlen_backward(do, q, k, v, None, lse, cq, ck)
    for fn, args in ((flashcupy.attention_varlen, (q, k, v)),
                     (flashcupy.attention_varlen_backward, (do, q, k, v, o, lse))):
        words = f"{fn.__name__}\\(\\) got unexpected keyword arguments \\['foo'\\]"
        with pytest.raises(TypeError, match=words):
            fn(*args, cq, ck, foo=1)


def test_knobs_are_checked_when_no_sequence_runs(rng):
    """A batch in which no sequence has both queries and keys runs no call, yet a bad knob is refused
    as attention refuses it."""
    q = rng.standard_normal((5, 4, 16)).astype(np.float32)
    k = rng.standard_normal((3, 2, 16)).astype(np.float32)
    cq, ck = np.array([0, 5, 5], np.int32), np.array([0, 0, 3], np.int32)  # queries without keys; keys alone
    do, lse = np.ones_like(q), np.full((4, 5), -np.inf, np.float32)
    for kw, exc, words in ((dict(scale=-1.0), ValueError, "scale must be finite and > 0"),
                           (dict(window_size=5), (TypeError, ValueError), "window_size"),
                           (dict(accum="fp8"), ValueError, "accum must be one of"),
                           (dict(sinks=np.zeros(3, np.float32)), ValueError, "sinks")):
        with pytest.raises(exc, match=words):
            flashcupy.attention_varlen(q, k, k, cq, ck, **kw)
        with pytest.raises(exc, match=words):
            flashcupy.attention_varlen_backward(do, q, k, k, np.zeros_like(q), lse, cq, ck, **kw)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flashcupy.attention_varlen_backward(do, q, k, k, np.zeros_like(q), lse, cq, ck, deterministic=1)
    o, lse2 = flashcupy.attention_varlen(q, k, k, cq, ck, return_lse=True)
    assert (o == 0).all() and (lse2 == -np.inf).all()


def test_rows_without_keys_give_the_sinks_their_lse_gradient(rng):
    """With sinks, a row that sees no key has lse = z and o = 0, so delta = -dlse and d z gains
    -e^(z - lse) delta = dlse: a sequence with queries and no keys adds its rows' dlse to d sinks."""
    q, k, v, do, (cq, ck) = _packed(rng, "f32")
    sinks = rng.standard_normal(4).astype(np.float32)
    o, lse = flashcupy.attention_varlen(q, k, v, cq, ck, causal=True, sinks=sinks, return_lse=True)
    dlse = rng.standard_normal(lse.shape).astype(np.float32)
    with_dlse = flashcupy.attention_varlen_backward(do, q, k, v, o, lse, cq, ck, causal=True, sinks=sinks,
                                                    dlse=dlse)[3]
    keyless = [i for i in range(len(LENGTHS_Q)) if LENGTHS_K[i] == 0 and LENGTHS_Q[i] > 0]
    assert keyless, "the lengths must hold a sequence with queries and no keys"
    # the same batch with dlse zero on the keyless rows, plus those rows' dlse by hand
    cut = dlse.copy()
    for i in keyless:
        cut[:, cq[i]:cq[i + 1]] = 0
    without = flashcupy.attention_varlen_backward(do, q, k, v, o, lse, cq, ck, causal=True, sinks=sinks,
                                                  dlse=cut)[3]
    extra = sum(dlse[:, cq[i]:cq[i + 1]].sum(axis=1) for i in keyless)
    assert np.abs(extra).min() > 0.1
    np.testing.assert_allclose(with_dlse, without + extra, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_varlen_on_the_kernels_matches_the_reference(rng):
    import cupy

    q, k, v, do, (cq, ck) = _packed(rng, "bf16", d=64)
    dev = [cupy.asarray(x) for x in (q, k, v, do, cq, ck)]
    for kernel in ("wgmma", "mma"):
        o, lse = flashcupy.attention_varlen(*dev[:3], dev[4], dev[5], causal=True, kernel=kernel,
                                            return_lse=True)
        grads = flashcupy.attention_varlen_backward(dev[3], *dev[:3], o, lse, dev[4], dev[5], causal=True,
                                                    kernel=kernel)
        for i in (0, 2, 3, 5):
            qi, ki, vi, doi = _seq(q, cq, i), _seq(k, ck, i), _seq(v, ck, i), _seq(do, cq, i)
            o_ref = reference.attention(qi, ki, vi, causal=True)
            assert_accurate(_seq(cupy.asnumpy(o), cq, i), o_ref, naive.attention(qi, ki, vi, causal=True),
                            "bf16", "fp32", what=f"{kernel} seq {i}")
            refs = reference.attention_backward(doi, qi, ki, vi, causal=True)
            naives = naive.attention_backward(doi, qi, ki, vi, causal=True)
            gi = (_seq(cupy.asnumpy(grads[0]), cq, i), _seq(cupy.asnumpy(grads[1]), ck, i),
                  _seq(cupy.asnumpy(grads[2]), ck, i))
            for name, g, r, n in zip(("dq", "dk", "dv"), gi, refs, naives):
                assert_accurate(g, r, n, "bf16", "fp32", kind="bwd", reduction=backward_reduction(qi, ki),
                                what=f"{kernel} seq {i} {name}")


def test_the_packed_variants():
    """A varlen variant (the packed kernels) is its family's variant with FC_VARLEN and the key part
    "varlen": the three forwards and the three backwards, with the plain variant's way out for o (the
    wgmma kernel stores by TMA only the warpgroups whose rows lie in their sequence); fp8 operands refuse
    it by name."""
    from flashcupy._variant import Variant

    for family, bm, bn in (("fwd_simt", 64, 64), ("fwd_mma", 128, 64), ("fwd_wgmma", 128, 128),
                           ("bwd_simt", 64, 64), ("bwd_mma", 64, 128), ("bwd_wgmma", 64, 128)):
        plain = Variant(family, "f16", "fp32", bm, bn, 128, True)
        packed = Variant(family, "f16", "fp32", bm, bn, 128, True, varlen=True)
        assert packed.key == plain.key + ".varlen"
        extra = set(packed.defines().items()) - set(plain.defines().items())
        assert ("FC_VARLEN", 1) in extra and "FC_VARLEN" not in plain.defines()
        assert packed.o_stage == plain.o_stage
    for kw, words in ((dict(family="fwd_wgmma", block_m=128, block_n=128, fp8="single"), "fp8"),):
        with pytest.raises(ValueError, match=words):
            Variant(dtype="f16", accum="fp32", head_dim=128, varlen=True, **kw)
    with pytest.raises(TypeError, match="varlen must be a bool"):
        Variant("fwd_mma", "f16", "fp32", 128, 64, 64, varlen=1)


def test_sinks_merge_on_packed_rows_is_the_merge_per_sequence(rng):
    """The packed forward merges sinks into (o (total, Hq, D), lse (Hq, total)) after its launch: the same
    bits as the merge of each sequence's (1, Hq, n, D) output (NumPy form here; the CUDA form is compared
    on the kernels in test_varlen_gpu.py)."""
    from flashcupy import _sinks

    o = rng.standard_normal((37, 4, 16)).astype(np.float16)
    lse = rng.standard_normal((4, 37)).astype(np.float32) * 4
    lse[:, 3], o[3] = -np.inf, 0  # a row that saw no key
    z = rng.standard_normal(4).astype(np.float32)
    o1, lse1 = _sinks.apply(o.copy(), lse.copy(), z, packed=True)
    o2, lse2 = _sinks.apply(o.transpose(1, 0, 2)[None].copy(), lse[None].copy(), z)
    assert (o1 == o2[0].transpose(1, 0, 2)).all() and (lse1 == lse2[0]).all()
    assert (o1 != o).any() and (lse1[:, 3] == z).all() and (o1[3] == 0).all()

"""flashcupy.merge_states: the attention over a union of disjoint key sets from the parts' (o, lse),
against the float64 attention over all the keys, both forms, every partial dtype; rows no part saw; the
max-subtraction break; bad arguments refused by name."""
from __future__ import annotations

import numpy as np
import pytest

import flashcupy
from flashcupy import reference
from flashcupy._checks import numpy_dtype


def _parts(rng, splits, nk=300, q_scale=1.0, dtype=np.float32, shape=(2, 3, 17, 16)):
    """q, k, v (float64) and the exact per-part (o, lse) of ``splits`` contiguous key ranges, o rounded to
    ``dtype``."""
    b, h, n, d = shape
    q = q_scale * rng.standard_normal((b, h, n, d))
    k, v = rng.standard_normal((2, b, h, nk, d))
    edges = np.linspace(0, nk, splits + 1).astype(int)
    outs = [reference.attention(q, k[:, :, a:z], v[:, :, a:z], return_lse=True)
            for a, z in zip(edges, edges[1:])]
    o = np.stack([x[0] for x in outs]).astype(dtype)
    lse = np.stack([x[1] for x in outs]).astype(np.float32)
    return (q, k, v), o, lse


@pytest.mark.parametrize("form", flashcupy._merge.FORMS)
@pytest.mark.parametrize("dname", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("splits", [1, 2, 7, 40])
def test_merge_matches_the_whole_attention(rng, splits, dname, form):
    dt = numpy_dtype(dname)
    (q, k, v), o_parts, lse_parts = _parts(rng, splits, dtype=dt)
    o, lse = flashcupy.merge_states(o_parts, lse_parts, form=form)
    o_ref, lse_ref = reference.attention(q, k, v, return_lse=True)
    assert o.dtype == dt and lse.dtype == np.float32 and o.shape == o_ref.shape
    # each part rounded to the dtype, then a convex combination in float32, rounded once more
    u = {"f32": 2.0 ** -24, "bf16": 2.0 ** -8, "f16": 2.0 ** -11}[dname]
    bound = 2 * u * np.abs(o_parts.astype(np.float64)).max() + 8 * 2.0 ** -24 * splits
    assert np.abs(o.astype(np.float64) - o_ref).max() <= bound
    np.testing.assert_allclose(lse, lse_ref, rtol=0, atol=1e-5 * (1 + np.abs(lse_ref).max()))


def test_rows_no_part_saw_and_parts_that_saw_nothing(rng):
    """A part at lse = -inf takes no weight (o = 0 there); a row no part saw gets o = 0, lse = -inf, in
    both forms; a part that saw a row alone gives that part's state."""
    (_, _, _), o_parts, lse_parts = _parts(rng, 3)
    o_parts[1, :, :, :5] = 0
    lse_parts[1, :, :, :5] = -np.inf
    o_parts[:, :, :, 5:8] = 0
    lse_parts[:, :, :, 5:8] = -np.inf
    o_parts[[0, 2], :, :, 8:10] = 0
    lse_parts[[0, 2], :, :, 8:10] = -np.inf
    for form in flashcupy._merge.FORMS:
        o, lse = flashcupy.merge_states(o_parts, lse_parts, form=form)
        two, two_lse = flashcupy.merge_states(o_parts[[0, 2]], lse_parts[[0, 2]], form=form)
        np.testing.assert_allclose(o[:, :, :5], two[:, :, :5], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(lse[:, :, :5], two_lse[:, :, :5], rtol=1e-6)
        assert np.all(o[:, :, 5:8] == 0) and np.all(np.isneginf(lse[:, :, 5:8]))
        np.testing.assert_allclose(o[:, :, 8:10], o_parts[1, :, :, 8:10], rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(lse[:, :, 8:10], lse_parts[1, :, :, 8:10])
        assert np.isfinite(o).all()


def test_the_max_subtraction_break_overflows_past_ln_max(rng):
    """Without the max, the weights exp(lse_s) overflow float32 once an LSE passes 88.72: large scores
    give NaN rows; the intact merge of the same parts is accurate."""
    (q, k, v), o_parts, lse_parts = _parts(rng, 4, q_scale=40.0)
    assert lse_parts.max() > 88.73
    broken, _ = flashcupy.merge_states(o_parts, lse_parts, ablate="max_subtraction")
    rows_over = (lse_parts > np.log(np.finfo(np.float32).max)).any(axis=0)
    assert np.isnan(broken).any(axis=-1)[rows_over].all()
    assert np.isfinite(broken[~rows_over]).all()
    o, _ = flashcupy.merge_states(o_parts, lse_parts)
    assert np.abs(o - reference.attention(q, k, v)).max() < 1e-5


@pytest.mark.parametrize("call,exc,words", [
    (lambda o, ls: flashcupy.merge_states(o[0], ls[0]), ValueError, "(S, B, H, N, D)"),
    (lambda o, ls: flashcupy.merge_states(o, ls[..., :3]), ValueError, "lse_parts (S, B, H, N)"),
    (lambda o, ls: flashcupy.merge_states(o.astype(np.int32), ls), TypeError, "o_parts must be float16"),
    (lambda o, ls: flashcupy.merge_states(o, ls.astype(np.float16)), TypeError, "lse_parts must be float32"),
    (lambda o, ls: flashcupy.merge_states(o, ls, form="log"), ValueError, "form must be one of"),
    (lambda o, ls: flashcupy.merge_states(o, ls, out_dtype="int8"), ValueError, "out_dtype"),
    (lambda o, ls: flashcupy.merge_states(o, ls, form="logsigmoid", ablate="max_subtraction"), ValueError,
     "one-pass"),
    (lambda o, ls: flashcupy.merge_states(o, ls, ablate="stable_softplus"), ValueError, "pairwise fold"),
    (lambda o, ls: flashcupy.merge_states(o.tolist(), ls), TypeError, "numpy.ndarray or cupy.ndarray"),
    (lambda o, ls: flashcupy.merge_states(o, ls, state_dtype="f16"), ValueError, "state_dtype"),
])
def test_bad_arguments_are_refused_by_name(rng, call, exc, words):
    _, o, lse = _parts(rng, 2)
    with pytest.raises(exc, match=words.replace("(", r"\(").replace(")", r"\)")):
        call(o, lse)


@pytest.mark.parametrize("form", flashcupy._merge.FORMS)
def test_a_bf16_running_output_loses_what_a_float32_one_keeps(rng, form):
    """state_dtype='bfloat16' rounds the running output after every part: with 64 parts it is several
    times worse than the float32 merge of the same bf16 parts, which stays at one part's rounding."""
    (q, k, v), o_parts, lse_parts = _parts(rng, 64, nk=2048, dtype=numpy_dtype("bf16"))
    ref = reference.attention(q, k, v)
    err = {}
    for st in ("float32", "bfloat16"):
        o, _ = flashcupy.merge_states(o_parts, lse_parts, form=form, state_dtype=st, out_dtype="float32")
        err[st] = np.abs(o - ref).max()
    assert err["bfloat16"] > 3 * err["float32"]
    assert err["float32"] <= 2 * 2.0 ** -8 * np.abs(o_parts.astype(np.float64)).max()


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("dname", ["bf16", "f32"])
@pytest.mark.parametrize("form", flashcupy._merge.FORMS)
def test_merge_on_cupy_arrays_gives_the_numpy_result(rng, form, dname, out_dtype):
    """CuPy's merge (form "exp": one kernel) against NumPy's on the same parts: strided views of the
    parts, a part that saw nothing for some rows, rows no part saw (o = 0, lse = -inf), every output
    dtype; within float32 rounding of the sums' order (one unit of a 16-bit output)."""
    import cupy

    _, o_parts, lse_parts = _parts(rng, 5, dtype=numpy_dtype(dname))
    o_parts[1, :, :, :4], lse_parts[1, :, :, :4] = 0, -np.inf
    o_parts[:, :, :, 4:6], lse_parts[:, :, :, 4:6] = 0, -np.inf
    # (S, B, H, N, D) views of (B, S, N, H, D) buffers, as the one-launch decoding path passes them
    o_dev = cupy.asarray(np.ascontiguousarray(o_parts.transpose(1, 0, 3, 2, 4))).transpose(1, 0, 3, 2, 4)
    lse_dev = cupy.asarray(np.ascontiguousarray(lse_parts.transpose(1, 0, 3, 2))).transpose(1, 0, 3, 2)
    o, lse = flashcupy.merge_states(o_dev, lse_dev, form=form, out_dtype=out_dtype)
    oh, lh = flashcupy.merge_states(o_parts, lse_parts, form=form, out_dtype=out_dtype)
    assert o.dtype == oh.dtype and o.shape == oh.shape and lse.shape == lh.shape
    ulp = {"float32": 1e-6, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}[out_dtype]
    np.testing.assert_allclose(cupy.asnumpy(o).astype(np.float64), oh.astype(np.float64), rtol=ulp,
                               atol=1e-7)
    np.testing.assert_allclose(cupy.asnumpy(lse), lh, rtol=1e-6)
    got = cupy.asnumpy(o)
    assert (got[:, :, 4:6] == 0).all() and np.isneginf(cupy.asnumpy(lse)[:, :, 4:6]).all()
    assert np.isfinite(got.astype(np.float32)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("splits, d", [(2100, 40), (3, 300)])
def test_merge_kernel_past_its_staged_parts_and_columns(rng, splits, d):
    """The CuPy merge kernel stages FC_MERGE_CHUNK = 2048 parts' LSEs at a time and covers 256 columns a
    pass: S = 2100 parts (two chunks, reloaded for the second pass) and D = 300 (two column passes), on
    reversed-stride views with empty parts, against the float64 merge of the same parts."""
    import cupy

    s_, b, h, n = splits, 1, 2, 3
    o_parts = rng.standard_normal((s_, b, h, n, d)).astype(np.float32)
    lse_parts = (8.0 * rng.standard_normal((s_, b, h, n))).astype(np.float32)
    lse_parts[::7, :, :, 0], o_parts[::7, :, :, 0] = -np.inf, 0     # empty parts in row 0
    lse64 = lse_parts.astype(np.float64)
    m = lse64.max(axis=0)
    w = np.exp(lse64 - m)
    want = (w[..., None] * o_parts).sum(axis=0) / w.sum(axis=0)[..., None]
    want_lse = m + np.log(w.sum(axis=0))
    o_dev = cupy.asarray(o_parts[::-1, :, :, :, ::-1].copy())[::-1, :, :, :, ::-1]   # negative strides
    lse_dev = cupy.asarray(lse_parts[::-1].copy())[::-1]
    o, lse = flashcupy.merge_states(o_dev, lse_dev)
    np.testing.assert_allclose(cupy.asnumpy(o), want, rtol=0, atol=1e-5 * np.abs(o_parts).max())
    np.testing.assert_allclose(cupy.asnumpy(lse), want_lse, rtol=1e-6, atol=0)


def test_the_fold_without_the_stable_softplus_overflows_past_a_gap_of_88(rng):
    """ablate='stable_softplus': a part whose LSE exceeds the running one by more than ln(float32 max)
    = 88.72 sends the merged LSE to inf while o still takes that part's weight; below the gap, and with
    the stable form at any gap, the two forms agree to float32 rounding."""
    _, o, lse = _parts(rng, 3)
    for gap, overflows in ((80.0, False), (95.0, True)):
        shifted = lse.copy()
        shifted[1] = lse[0] + np.float32(gap)  # part 1 dominates part 0 by the gap
        good_o, good_lse = flashcupy.merge_states(o, shifted, form="logsigmoid")
        bad_o, bad_lse = flashcupy.merge_states(o, shifted, form="logsigmoid", ablate="stable_softplus")
        assert np.isfinite(good_lse).all()
        if overflows:
            assert np.isposinf(bad_lse).all()
            # the output barely moves: part 1 dominates, and the overflowed LSE only drops part 2
            assert np.abs(bad_o.astype(np.float64) - good_o).max() < 2 * np.abs(o).max()
        else:
            np.testing.assert_allclose(bad_lse, good_lse, rtol=1e-6)
            np.testing.assert_allclose(bad_o.astype(np.float64), good_o.astype(np.float64), rtol=0, atol=1e-3)

"""attention_with_kvcache (issue 36), first version: against the float64 reference of each batch entry's
queries over the keys its cache holds after the append, contiguous and paged (pages in random order,
appends that cross page boundaries), entries at length 0 and at capacity, causal chunked prefill, GQA,
key splits merged by merge_states; bad lengths and page tables refused before the cache is written."""
from __future__ import annotations

import numpy as np
import pytest

import flashcupy
from flashcupy import naive, reference
from flashcupy.accuracy import assert_accurate, assert_lse_accurate, softcap_score_error

B, HQ, HKV, D = 3, 4, 2, 16


def _case(rng, dt, lengths, nnew, nq, capacity, page=None, d=D):
    """q (B, Nq, Hq, D), a contiguous cache or a paged one with a shuffled page table, new k, v, and the
    keys each entry should see after the append (L_b, Hkv, D)."""
    q = rng.standard_normal((B, nq, HQ, d)).astype(dt)
    full_k = rng.standard_normal((B, capacity, HKV, d)).astype(dt)
    full_v = rng.standard_normal((B, capacity, HKV, d)).astype(dt)
    k = rng.standard_normal((B, nnew, HKV, d)).astype(dt) if nnew else None
    v = rng.standard_normal((B, nnew, HKV, d)).astype(dt) if nnew else None
    want_k, want_v = full_k.copy(), full_v.copy()
    for i, n in enumerate(lengths):
        if nnew:
            want_k[i, n:n + nnew], want_v[i, n:n + nnew] = k[i], v[i]
    seen = [(want_k[i, :n + nnew], want_v[i, :n + nnew]) for i, n in enumerate(lengths)]
    if page is None:
        return q, full_k, full_v, None, k, v, seen
    per = capacity // page
    order = rng.permutation(B * per + 3)[:B * per]  # pages of all entries shuffled, three spare ones
    table = order.reshape(B, per).astype(np.int32)
    kc = rng.standard_normal((B * per + 3, page, HKV, d)).astype(dt)  # garbage in the spare pages
    vc = rng.standard_normal((B * per + 3, page, HKV, d)).astype(dt)
    for i in range(B):
        for j in range(per):
            kc[table[i, j]] = full_k[i, j * page:(j + 1) * page]
            vc[table[i, j]] = full_v[i, j * page:(j + 1) * page]
    return q, kc, vc, table, k, v, seen


def _check(q, o, lse, seen, causal, dname, **kw):
    for i, (ks, vs) in enumerate(seen):
        qb = q[i].transpose(1, 0, 2)[None]
        if ks.shape[0] == 0:
            empty_lse = -np.inf if kw.get("sinks") is None else kw["sinks"][:, None]
            assert (o[i] == 0).all() and (lse[i] == empty_lse).all()
            continue
        kb, vb = (x.transpose(1, 0, 2)[None] for x in (ks, vs))
        o_ref, lse_ref = reference.attention(qb, kb, vb, causal=causal, return_lse=True, **kw)
        got = o[i].transpose(1, 0, 2)[None]
        assert_accurate(got, o_ref, naive.attention(qb, kb, vb, causal=causal, **kw), dname, "fp32",
                        what=f"entry {i}, L = {ks.shape[0]}")
        # (the softcap's tanh adds its own bound to every score: accuracy.softcap_score_error)
        assert_lse_accurate(lse[i][None], lse_ref, "fp32", what=f"entry {i}",
                            score_error=softcap_score_error(dname, kw.get("softcap", 0.0)))


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("nq,causal", [(1, True), (5, True), (40, True), (3, False)],
                         ids=["decode", "nq5", "prefill40", "nq3-full"])
def test_kvcache_matches_the_reference(rng, page, splits, nq, causal):
    """Lengths 0, one page minus one with an append crossing into the next page, and the capacity."""
    import ml_dtypes

    dname, dt = "bf16", ml_dtypes.bfloat16
    capacity, nnew = 96, 7
    lengths = np.array([0, 15 - 2, capacity - nnew], dtype=np.int32)
    q, kc, vc, table, k, v, seen = _case(rng, dt, lengths, nnew, nq, capacity, page)
    o, lse = flashcupy.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, block_table=table, k=k, v=v,
                                              causal=causal, num_splits=splits, return_lse=True, softcap=3.0)
    assert o.shape == (B, nq, HQ, D) and lse.shape == (B, HQ, nq)
    _check(q, o, lse, seen, causal, dname, softcap=3.0)
    # the cache holds the appended keys where flash_attn puts them
    for i, n in enumerate(lengths):
        for j in range(nnew):
            pos = n + j
            got = kc[i, pos] if table is None else kc[table[i, pos // page], pos % page]
            assert np.array_equal(got, k[i, j])


def test_kvcache_without_append_and_an_empty_cache(rng):
    """No new keys: the cache is read as it is; an entry of length 0 gets o = 0, lse = -inf."""
    q, kc, vc, _, _, _, seen = _case(rng, np.float32, np.array([0, 5, 64], np.int32), 0, 2, 64)
    lengths = np.array([0, 5, 64], np.int32)
    before = kc.copy()
    o, lse = flashcupy.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, causal=False, return_lse=True)
    assert np.array_equal(kc, before)
    _check(q, o, lse, seen, False, "f32")


def test_kvcache_refuses_bad_tables_and_lengths_before_writing(rng):
    q, kc, vc, table, k, v, _ = _case(rng, np.float32, np.array([3, 3, 3], np.int32), 2, 1, 32, page=16)
    before = kc.copy()
    lengths = np.array([3, 3, 3], np.int32)
    cases = [
        (dict(cache_seqlens=lengths.astype(np.int64)), TypeError, "cache_seqlens must be int32"),
        (dict(cache_seqlens=np.array([3, 3, 31], np.int32)), ValueError, "capacity"),
        (dict(cache_seqlens=np.array([3, -1, 3], np.int32)), ValueError, "capacity"),
        (dict(cache_seqlens=lengths, block_table=np.where(table == table[1, 0], 99, table).astype(np.int32)),
         ValueError, "outside"),
        (dict(cache_seqlens=lengths, block_table=table[:2]), ValueError, "block_table must be"),
        (dict(cache_seqlens=lengths, num_splits=2, window_size=(4, 0)), ValueError, "num_splits > 1"),
        (dict(cache_seqlens=lengths, num_splits=-1), ValueError, "num_splits"),
    ]
    for kw, exc, msg in cases:
        kw = {"block_table": table, **kw}
        with pytest.raises(exc, match=msg):
            flashcupy.attention_with_kvcache(q, kc, vc, k=k, v=v, **kw)
        assert np.array_equal(kc, before), msg
    with pytest.raises(ValueError, match="give both"):
        flashcupy.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, block_table=table, k=k)


def test_kvcache_names_what_a_user_got_wrong_before_writing(rng):
    """Mistakes a new user makes (a trial of the API found them): each refused with the argument named,
    and the cache untouched: a read-only value cache under an append (the keys must not be written
    first), lists and NumPy scalars for arrays, a float num_splits, an empty batch, q's batch against
    the lengths', and an append into a page the entry itself lists twice (it would overwrite a key the
    entry reads)."""
    q, kc, vc, table, k, v, _ = _case(rng, np.float32, np.array([3, 3, 3], np.int32), 2, 1, 32, page=16)
    lengths = np.array([3, 3, 3], np.int32)
    before = kc.copy()
    read_only = np.broadcast_to(vc[:1], vc.shape)
    cases = [
        (dict(v_cache=read_only), ValueError, "v_cache is read-only"),
        (dict(cache_seqlens=[3, 3, 3]), TypeError, "cache_seqlens must be a NumPy or CuPy array, got list"),
        (dict(cache_seqlens=np.int32(3)), TypeError, "cache_seqlens must be a NumPy or CuPy array"),
        (dict(k=k.tolist()), TypeError, "k must be a NumPy or CuPy array"),
        (dict(num_splits=2.0), TypeError, "num_splits must be an int"),
        (dict(q=q[:0], cache_seqlens=lengths[:0], block_table=table[:0], k=k[:0], v=v[:0]), ValueError,
         "B >= 1"),
        (dict(q=q[:2]), ValueError, r"B from q"),
        # (entry 0's keys 15 and 16 land in rows 15 and 0 of page 0, whose row 0 is its key 0)
        (dict(cache_seqlens=np.array([15, 3, 3], np.int32), block_table=np.array([[0, 0], [1, 2], [3, 4]],
                                                                                  np.int32)),
         ValueError, "lists twice"),
    ]
    for kw, exc, msg in cases:
        kw = {"q": q, "v_cache": vc, "cache_seqlens": lengths, "block_table": table, "k": k, "v": v, **kw}
        with pytest.raises(exc, match=msg):
            flashcupy.attention_with_kvcache(kw.pop("q"), kc, kw.pop("v_cache"), **kw)
        assert np.array_equal(kc, before), msg


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["wgmma", "mma"])
def test_kvcache_on_the_kernels_matches_the_reference(rng, kernel):
    """The same path on CuPy arrays, paged with splits, D = 64 (the wgmma head dims)."""
    import cupy
    import ml_dtypes

    lengths = np.array([0, 100, 250], np.int32)
    q, kc, vc, table, k, v, seen = _case(rng, ml_dtypes.bfloat16, lengths, 6, 4, 256, page=64, d=64)
    dev = [cupy.asarray(x) for x in (q, kc, vc, table, k, v)]
    o, lse = flashcupy.attention_with_kvcache(dev[0], dev[1], dev[2], cache_seqlens=cupy.asarray(lengths),
                                              block_table=dev[3], k=dev[4], v=dev[5], num_splits=2,
                                              kernel=kernel, return_lse=True)
    _check(q, cupy.asnumpy(o), cupy.asnumpy(lse), seen, True, "bf16")
    for i, n in enumerate(lengths):  # the append happened on the device's cache
        pos = n + 5
        assert np.array_equal(cupy.asnumpy(dev[1][table[i, pos // 64], pos % 64]), k[i, 5])


def test_kvcache_checks_every_knob_before_writing(rng):
    """Knobs ``attention`` would refuse, unknown knobs (flash_attn's rotary_cos, cache_batch_idx) and bad
    q shapes or dtypes are refused before the append touches the cache; ALiBi refuses splits by name."""
    q, kc, vc, _, k, v, _ = _case(rng, np.float32, np.array([3, 3, 3], np.int32), 2, 1, 32)
    lengths = np.array([3, 3, 3], np.int32)
    before = (kc.copy(), vc.copy())
    cases = [
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(kernel="bogus"), ValueError, "kernel"),
        (dict(window_size=(-2, 0)), ValueError, "window_size"),
        (dict(scale=0.0), ValueError, "scale"),
        (dict(rotary_cos=q), TypeError, "unknown knobs"),
        (dict(sinks=np.zeros(HQ + 1, np.float32)), ValueError, "sinks"),
        (dict(alibi_slopes=np.ones((B + 1, HQ), np.float32)), ValueError, "alibi_slopes"),
        (dict(alibi_slopes=np.ones(HQ, np.float32), num_splits=2), ValueError, "with alibi_slopes"),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            flashcupy.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, k=k, v=v, **kw)
        assert np.array_equal(kc, before[0]) and np.array_equal(vc, before[1]), msg
    for bad_q, exc in ((q[:, :0], ValueError), (q.astype(np.float64), TypeError), (q[..., :12], ValueError)):
        with pytest.raises(exc):
            flashcupy.attention_with_kvcache(bad_q, kc, vc, cache_seqlens=lengths, k=k, v=v)
        assert np.array_equal(kc, before[0])


def test_kvcache_shared_pages_are_read_not_written(rng):
    """Two entries may share a prefix page (read); an append into a page another entry reads, or two
    appends into one slot, are refused before any write."""
    page = 4
    kc = rng.standard_normal((6, page, HKV, D)).astype(np.float32)
    vc = rng.standard_normal((6, page, HKV, D)).astype(np.float32)
    q = rng.standard_normal((2, 1, HQ, D)).astype(np.float32)
    table = np.array([[0, 1, 2], [0, 3, 4]], np.int32)  # page 0 shared by both entries
    lengths = np.array([6, 5], np.int32)
    o, lse = flashcupy.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, block_table=table,
                                              return_lse=True)
    seen = [(kc[table[i]].reshape(-1, HKV, D)[:n], vc[table[i]].reshape(-1, HKV, D)[:n])
            for i, n in enumerate(lengths)]
    _check(q, o, lse, seen, True, "f32")
    k1 = rng.standard_normal((2, 1, HKV, D)).astype(np.float32)
    before = kc.copy()
    with pytest.raises(ValueError, match="another entry reads"):  # entry 1 at length 2 appends into page 0
        flashcupy.attention_with_kvcache(q, kc, vc, cache_seqlens=np.array([6, 2], np.int32),
                                         block_table=table, k=k1, v=k1)
    with pytest.raises(ValueError, match="one cache slot"):  # page 3 listed twice, both rows appended to
        flashcupy.attention_with_kvcache(q[:1], kc, vc, cache_seqlens=np.array([3], np.int32),
                                         block_table=np.array([[1, 3, 3]], np.int32),
                                         k=np.ones((1, 6, HKV, D), np.float32),
                                         v=np.ones((1, 6, HKV, D), np.float32))
    assert np.array_equal(kc, before)


def test_kvcache_more_splits_than_keys_and_alibi_per_entry(rng):
    """num_splits above an entry's length runs one range per key; ALiBi slopes given per entry (B, Hq)
    reach each entry's call."""
    lengths = np.array([1, 2, 9], np.int32)
    q, kc, vc, _, _, _, seen = _case(rng, np.float32, lengths, 0, 2, 16)
    o, lse = flashcupy.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, num_splits=5, return_lse=True)
    _check(q, o, lse, seen, True, "f32")
    slopes = rng.uniform(0.1, 0.9, (B, HQ)).astype(np.float32)
    o, lse = flashcupy.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, alibi_slopes=slopes,
                                              return_lse=True)
    for i, (ks, vs) in enumerate(seen):
        qb, kb, vb = q[i].transpose(1, 0, 2)[None], ks.transpose(1, 0, 2)[None], vs.transpose(1, 0, 2)[None]
        o_ref, lse_ref = reference.attention(qb, kb, vb, causal=True, alibi_slopes=slopes[i], return_lse=True)
        np.testing.assert_allclose(o[i].transpose(1, 0, 2)[None], o_ref, atol=2e-6, rtol=0)
        np.testing.assert_allclose(lse[i][None], lse_ref, atol=2e-6, rtol=0)


def test_kvcache_reads_views_in_place(rng):
    """q broadcast over its heads (stride 0) and a cache that is a strided window of a larger buffer (an
    offset, a step over the batch) run as their contiguous copies do, and the append lands in the
    buffer."""
    lengths = np.array([4, 9, 0], np.int32)
    q, kc, vc, _, k, v, seen = _case(rng, np.float32, lengths, 3, 2, 24)
    q_b = np.broadcast_to(q[:, :, :1], q.shape)  # every query head the same, stride 0
    big_k = rng.standard_normal((2 * B + 1, 30, HKV, D)).astype(np.float32)
    big_v = rng.standard_normal((2 * B + 1, 30, HKV, D)).astype(np.float32)
    big_k[1::2, 2:26], big_v[1::2, 2:26] = kc, vc
    kv_view, vv_view = big_k[1::2, 2:26], big_v[1::2, 2:26]
    o_view = flashcupy.attention_with_kvcache(q_b, kv_view, vv_view, cache_seqlens=lengths, k=k, v=v)
    o_copy = flashcupy.attention_with_kvcache(np.ascontiguousarray(q_b), kc, vc, cache_seqlens=lengths,
                                              k=k, v=v)
    assert np.array_equal(o_view, o_copy)
    assert np.array_equal(big_k[1::2, 2:26], kc)  # the append reached the buffer behind the view


@pytest.mark.parametrize("splits", [1, 3])
def test_kvcache_with_sinks_at_any_split(rng, splits):
    """Sinks merged once after the key ranges: paged, with splits, an empty entry (o = 0, lse = the
    sink), against the float64 reference with the sinks."""
    import ml_dtypes

    lengths = np.array([0, 13, 89], np.int32)
    q, kc, vc, table, k, v, seen = _case(rng, ml_dtypes.bfloat16, lengths, 7, 5, 96, page=16)
    sinks = (rng.standard_normal(HQ) + 2).astype(np.float32)
    o, lse = flashcupy.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, block_table=table, k=k, v=v,
                                              num_splits=splits, return_lse=True, sinks=sinks)
    _check(q, o, lse, seen, True, "bf16", sinks=sinks)



@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("kernel,bm,bn", [("wgmma", 128, 128), ("mma", 128, 64), ("simt", 64, 64)])
def test_kvcache_in_one_launch_is_the_per_entry_path(rng, kernel, bm, bn, paged):
    """Without splits a cache runs in one launch of the packed forward (a contiguous cache read in place,
    entry b's first L_b keys of its capacity; a paged one gathered): the bits of one call per entry on
    the same tile, with decoding and a chunk of queries, causal or not, GQA, the softcap, ALiBi per
    entry and sinks, an entry of length 0 and one at capacity; NaN in the slots past the keys stays out
    (the wgmma kernel, whose TMA tiles read them, zeroes those rows of V and masks those keys)."""
    import cupy
    import ml_dtypes

    from flashcupy import _kvcache

    dt = np.float32 if kernel == "simt" else ml_dtypes.bfloat16
    lengths = np.array([0, 100, 256], np.int32)
    for nq, causal in ((1, True), (5, False), (40, True)):
        q, kc, vc, table, _, _, _ = _case(rng, dt, lengths, 0, nq, 256, page=64 if paged else None, d=64)
        if not paged:  # NaN in the slots past each entry's keys (a cache's unwritten rows hold anything)
            for i, n in enumerate(lengths):
                kc[i, n:], vc[i, n:] = np.nan, np.nan
        dev = [None if x is None else cupy.asarray(x) for x in (q, kc, vc, table)]
        slopes = cupy.asarray(rng.uniform(0.01, 0.3, (B, HQ)).astype(np.float32))
        sinks = cupy.asarray(rng.standard_normal(HQ).astype(np.float32))
        knobs = dict(kernel=kernel, block_m=bm, block_n=bn, softcap=20.0, alibi_slopes=slopes)
        used, pages = lengths.astype(np.int64), None if table is None else table.astype(np.int64)
        o, lse = _kvcache._packed(*dev[:3], used, pages, 64, causal, knobs, sinks)
        o_e, lse_e = _kvcache._per_entry(*dev[:3], used, pages, 64, causal, 1, knobs)
        flashcupy._sinks.apply(o_e, lse_e, sinks)
        assert bool((o == o_e.transpose(0, 2, 1, 3)).all()), (nq, causal)
        assert bool((lse == lse_e).all()), (nq, causal)
        got = flashcupy.attention_with_kvcache(*dev[:3], cache_seqlens=cupy.asarray(lengths),
                                               block_table=dev[3], causal=causal, return_lse=True,
                                               sinks=sinks, **knobs)
        assert bool((got[0] == o).all()) and bool((got[1] == lse).all()), (nq, causal)


def _emulated_packed_launch(q, k, v, cq, ck, *, causal, used_k=None, sinks=None, max_k=None, pages=None,
                            **knobs):
    """The contract of ``_varlen._forward_packed`` on NumPy arrays: entry e's queries are rows cq[e] ..
    cq[e + 1] of q (total_q, H, D), its keys rows ck[e] .. of k and v, used_k[e] of them (or up to
    ck[e + 1]), at most ``max_k``; with ``pages`` (table, row, page) k and v are a paged cache's pages
    and entry e's key j (from ck[e], a multiple of the page) the row table[row[e], j // page] page +
    j % page; o (total_q, H, D) in q's dtype and lse (H, total_q) float32, each entry by
    ``reference.attention`` (float64, then rounded as the kernels' outputs are)."""
    lengths = used_k if used_k is not None else np.diff(ck)
    assert max_k is None or lengths.max() <= max_k, (max_k, lengths)
    assert set(knobs) <= {"scale", "softcap", "kernel", "block_m", "block_n", "accum"}, sorted(knobs)
    o = np.zeros(q.shape)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for e in range(cq.size - 1):
        a, z = int(cq[e]), int(cq[e + 1])
        n = int(used_k[e]) if used_k is not None else int(ck[e + 1] - ck[e])
        if n == 0 and sinks is not None:  # (rows without keys: the sink)
            lse[:, a:z] = sinks[:, None]
        if z == a or n == 0:
            continue
        rows = np.arange(int(ck[e]), int(ck[e]) + n)
        if pages is not None:
            table, row, page = pages
            assert ck[e] % page == 0, (e, ck[e], page)
            rows = table[row[e], rows // page] * page + rows % page
        kk, vv = (x[rows].transpose(1, 0, 2)[None].astype(np.float64) for x in (k, v))
        qq = q[a:z].transpose(1, 0, 2)[None].astype(np.float64)
        oe, le = reference.attention(qq, kk, vv, causal=causal, return_lse=True, sinks=sinks,
                                     **{n_: x for n_, x in knobs.items() if n_ in ("scale", "softcap")})
        # (the tile knobs change no float64 value; windows and ALiBi are refused above: not emulated)
        o[a:z], lse[:, a:z] = oe[0].transpose(1, 0, 2), le[0]
    return o.astype(q.dtype), lse.astype(np.float32)


def _emulated_packed_plan(q, k, v, cq, ck, **kw):
    """``_varlen.packed_launch`` with its launch replaced by the float64 contract above, run on the arrays
    the launch is given (the plan's q, k, v only carry the layout)."""
    return lambda q, k, v, o=None, lse=None: _emulated_packed_launch(q, k, v, cq, ck, **kw)


@pytest.mark.parametrize("paged", [False, "gathered", "in_place"])
@pytest.mark.parametrize("nq,causal,splits", [(1, True, 1), (1, True, 3), (1, False, 4), (6, False, 3),
                                              (6, True, 1)])
def test_one_launch_layout_packs_heads_and_splits_keys(rng, monkeypatch, paged, nq, causal, splits):
    """The host side of the one-launch path (``_kvcache._packed``) with the packed launch replaced by its
    float64 contract (above): GQA packing (decoding: the query heads of a KV head as one entry's rows),
    S key ranges per entry as S packed entries merged by merge_states, sinks merged after, entries of
    0 keys, fewer keys than ranges, and ranges of unequal lengths. Every entry must equal the float64
    reference of its queries over its keys within float32 rounding: a wrong row, head or range order
    would not."""
    from flashcupy import _kvcache, _varlen

    monkeypatch.setattr(_varlen, "packed_launch", _emulated_packed_plan)
    # a paged cache gathered, or read in place through its table (as the wgmma kernel does)
    monkeypatch.setattr(_kvcache, "_pages_in_place", lambda *a: paged == "in_place")
    lengths = np.array([0, 2, 97], np.int64)  # (97 in 4 ranges: 24, 24, 25, 24 keys)
    q, kc, vc, table, _, _, seen = _case(rng, np.float32, lengths, 0, nq, 112, page=16 if paged else None)
    sinks = rng.standard_normal(HQ).astype(np.float32)
    for knobs, with_sinks in (({}, False), ({"softcap": 3.0}, True)):
        tol = 1e-5  # (float32 outputs and merges; a row, head or range out of place is off by O(1))
        o, lse = _kvcache._packed(q, kc, vc, lengths, table, 16, causal, knobs,
                                  sinks if with_sinks else None, splits)
        assert o.shape == (B, nq, HQ, D) and lse.shape == (B, HQ, nq)
        for i, (ks, vs) in enumerate(seen):
            if ks.shape[0] == 0:  # no key: o = 0, lse = -inf (with sinks: the sink)
                want = np.broadcast_to(sinks[:, None] if with_sinks else -np.inf, (HQ, nq))
                assert (o[i] == 0).all() and (lse[i] == want).all(), i
                continue
            want_o, want_lse = reference.attention(
                q[i].transpose(1, 0, 2)[None], ks.transpose(1, 0, 2)[None], vs.transpose(1, 0, 2)[None],
                causal=causal, return_lse=True, sinks=sinks if with_sinks else None, **knobs)
            np.testing.assert_allclose(o[i].transpose(1, 0, 2), want_o[0], rtol=tol, atol=tol)
            np.testing.assert_allclose(lse[i], want_lse[0], rtol=tol, atol=tol)


def test_the_split_rule_fills_idle_sms_only():
    """num_splits=0's rule (_policy.kvcache_splits): one range when the launch fills the SMs or the cache
    is short; else ranges of at least 1024 keys, as many as fit two waves, at most 64; a given S is kept."""
    from flashcupy._policy import kvcache_splits

    assert kvcache_splits(3, ctas=1000, longest=10, sms=132) == 3
    assert kvcache_splits(0, ctas=132, longest=1 << 17, sms=132) == 1
    assert kvcache_splits(0, ctas=8, longest=1000, sms=132) == 1
    assert kvcache_splits(0, ctas=8, longest=4096, sms=132) == 4
    assert kvcache_splits(0, ctas=8, longest=1 << 17, sms=132) == 33
    assert kvcache_splits(0, ctas=64, longest=1 << 15, sms=132) == 4
    assert kvcache_splits(0, ctas=100, longest=1 << 15, sms=132) == 2
    assert kvcache_splits(0, ctas=1, longest=1 << 20, sms=132) == 64
    assert kvcache_splits(0) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("kernel,bm,bn", [("wgmma", 64, 128), ("wgmma", 128, 128), ("wgmma", 192, 128),
                                          ("mma", 128, 64), ("simt", 64, 64)])
def test_decoding_packs_heads_and_splits_in_one_launch(rng, monkeypatch, kernel, bm, bn, paged):
    """Decoding on the kernels in one launch (counted): GQA packing (the query heads of a KV head as one
    tile's rows) gives each head the bits of the per-entry path on the same tile without a mask (a row's
    arithmetic does not depend on the other rows; one query sees every key, so the packed launch runs
    unmasked), and S = 3 key ranges as packed entries of one launch, merged, give the per-entry path's
    ranges merged. NaN in the cache's unused slots, an entry of no key, sinks, the softcap; through
    attention_with_kvcache (causal, as decoding calls it) the float64 reference holds every entry by the
    accuracy rule."""
    import cupy
    import ml_dtypes

    from flashcupy import _kvcache, _varlen

    dt = np.float32 if kernel == "simt" else ml_dtypes.bfloat16
    dname = "f32" if kernel == "simt" else "bf16"
    lengths = np.array([0, 100, 256], np.int32)
    q, kc, vc, table, _, _, seen = _case(rng, dt, lengths, 0, 1, 256, page=64 if paged else None, d=64)
    if not paged:
        for i, n in enumerate(lengths):
            kc[i, n:], vc[i, n:] = np.nan, np.nan
    dev = [None if x is None else cupy.asarray(x) for x in (q, kc, vc, table)]
    sinks = cupy.asarray(rng.standard_normal(HQ).astype(np.float32))
    knobs = dict(kernel=kernel, block_m=bm, block_n=bn, softcap=20.0)
    used, pages = lengths.astype(np.int64), None if table is None else table.astype(np.int64)
    launches = []
    real = _varlen.packed_launch  # (made once a call, run once: a launch)
    monkeypatch.setattr(_varlen, "packed_launch", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    for splits in (1, 3):
        launches.clear()
        o, lse = _kvcache._packed(*dev[:3], used, pages, 64, False, knobs, sinks, splits)
        assert len(launches) == 1, splits
        o_e, lse_e = _kvcache._per_entry(*dev[:3], used, pages, 64, False, splits, knobs)
        flashcupy._sinks.apply(o_e, lse_e, sinks)
        assert bool((o == o_e.transpose(0, 2, 1, 3)).all()), splits
        assert bool((lse == lse_e).all()), splits
        launches.clear()
        got_o, got_lse = flashcupy.attention_with_kvcache(
            *dev[:3], cache_seqlens=cupy.asarray(lengths), block_table=dev[3], num_splits=splits,
            return_lse=True, sinks=sinks, **knobs)
        assert len(launches) == 1, splits
        _check(q, cupy.asnumpy(got_o), cupy.asnumpy(got_lse), seen, True, dname, sinks=cupy.asnumpy(sinks),
               softcap=20.0)
    # the rest by the float64 reference, one launch each: num_splits=0 (the policy's rule), one query head
    # per KV head (no packing; causal ranges, each query at its range's end) and 5 queries without a mask
    q5 = rng.standard_normal((B, 5, HQ, 64)).astype(dt)
    for qh, causal, splits in ((q, True, 0), (q[:, :, :HKV], True, 3), (q5, False, 3)):
        launches.clear()
        got_o, got_lse = flashcupy.attention_with_kvcache(
            cupy.asarray(qh), *dev[1:3], cache_seqlens=cupy.asarray(lengths), block_table=dev[3],
            causal=causal, num_splits=splits, return_lse=True, sinks=sinks[:qh.shape[2]], **knobs)
        assert len(launches) == 1, (qh.shape, splits)
        _check(qh, cupy.asnumpy(got_o), cupy.asnumpy(got_lse), seen, causal, dname,
               sinks=cupy.asnumpy(sinks[:qh.shape[2]]), softcap=20.0)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [None, 16, 128], ids=["contiguous", "paged16", "paged128"])
def test_a_decoding_loop_checks_its_launch_once(rng, monkeypatch, page):
    """A decoding loop as a user writes it: 40 steps, each appending one key per entry (crossing page
    boundaries) with the lengths kept on the host and advanced by the caller, the policy's splits, the
    wgmma kernel with 128-key tiles. Every step matches the float64 reference of its entry's keys so far;
    the launch's checks run once for a contiguous cache (its Problem bounded by the capacity, not by the
    lengths that grow each step) and for pages of 128 rows (read in place: the cache's shape), and for
    16-row pages once to find that they are not read in place, then once per number of pages in use (the
    gathered array's shape); the knobs' checks once."""
    import cupy

    from flashcupy import _checks, _kvcache, _varlen

    cap, steps = 256, 40
    lengths = np.array([0, 17, 100], np.int32)
    q, kc, vc, table, _, _, _ = _case(rng, np.float16, lengths, 0, 1, cap, page=page, d=64)
    ks = rng.standard_normal((steps, B, 1, HKV, 64)).astype(np.float16)
    vs = rng.standard_normal((steps, B, 1, HKV, 64)).astype(np.float16)
    # the keys each entry holds, as the loop should leave them (the cache's own first L_b rows, then appends)
    if page is None:
        held = [(kc[i, :n].copy(), vc[i, :n].copy()) for i, n in enumerate(lengths)]
    else:
        flat = [(np.concatenate([kc[p] for p in table[i]]), np.concatenate([vc[p] for p in table[i]]))
                for i in range(B)]
        held = [(fk[:n].copy(), fv[:n].copy()) for (fk, fv), n in zip(flat, lengths)]
    dq, dkc, dvc = (cupy.asarray(x) for x in (q, kc, vc))
    dtable = None if table is None else cupy.asarray(table)
    calls = {"launch": 0, "knobs": 0}

    def counted(name, fn):
        def wrapper(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapper

    monkeypatch.setattr(_checks, "_MEMO", {})  # (a memo filled by earlier tests could be cleared mid-loop)
    monkeypatch.setattr(_varlen, "_packed_problem", counted("launch", _varlen._packed_problem))
    monkeypatch.setattr(_kvcache, "_entry_problem", counted("knobs", _kvcache._entry_problem))
    totals = set()
    for t in range(steps):
        o, lse = flashcupy.attention_with_kvcache(
            dq, dkc, dvc, cache_seqlens=lengths, block_table=dtable, k=cupy.asarray(ks[t]),
            v=cupy.asarray(vs[t]), num_splits=0, return_lse=True, kernel="wgmma", block_n=128)
        held = [(np.concatenate([hk, ks[t, i]]), np.concatenate([hv, vs[t, i]])) for i, (hk, hv) in
                enumerate(held)]
        lengths = lengths + 1
        if page is not None:
            totals.add(int((-(-lengths // page)).sum()))
        if t % 13 == 0 or t == steps - 1:
            _check(q, cupy.asnumpy(o), cupy.asnumpy(lse), held, True, "f16")
    assert calls["knobs"] == 1, calls
    assert calls["launch"] == (1 + len(totals) if page == 16 else 1), (calls, totals)


@pytest.mark.gpu
def test_a_cache_on_another_gpu_runs_there(rng):
    """Arrays on GPU 1 while GPU 0 is current: the call's uploads, temporaries and launches (the append,
    the launch, the merge, the sinks; the one-launch path and the per-entry one) go to the arrays' device,
    and every entry holds the float64 reference."""
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    lengths = np.array([5, 0, 70], np.int32)
    sinks = rng.standard_normal(HQ).astype(np.float32)  # (NumPy: taken onto q's device by the call)
    for nq, splits in ((1, 2), (6, 2)):  # decoding in one launch; a causal chunk with ranges: per entry
        q, kc, vc, table, k, v, seen = _case(rng, np.float16, lengths, 2, nq, 96, page=16, d=64)
        with cupy.cuda.Device(1):
            dev = [cupy.asarray(x) for x in (q, kc, vc, table, k, v)]
        with cupy.cuda.Device(0):
            o, lse = flashcupy.attention_with_kvcache(
                dev[0], dev[1], dev[2], cache_seqlens=lengths, block_table=dev[3], k=dev[4], v=dev[5],
                num_splits=splits, return_lse=True, sinks=sinks)
        assert o.data.device_id == 1 and lse.data.device_id == 1
        _check(q, cupy.asnumpy(o), cupy.asnumpy(lse), seen, True, "f16", sinks=sinks)


@pytest.mark.gpu
@pytest.mark.parametrize("page,bn,d", [(128, 128, 128), (128, 64, 128), (256, 128, 128), (64, None, 128),
                                       (256, None, 256)])
def test_a_paged_cache_is_read_in_place_by_the_wgmma_kernel(rng, monkeypatch, page, bn, d):
    """Pages of a multiple of block_n: the wgmma kernel reads them through the shuffled block table (no
    gather: counted), with the bits of the gathered path on the same tile (each key tile is one TMA box
    inside one page either way); NaN in each entry's slots past its keys and in the pages no entry
    names; decoding with 1 and 3 key ranges (starting at pages), a chunk of queries without a mask, a
    causal chunk, the softcap and sinks; every entry by the float64 reference (accuracy rule).
    bn None: the policy's key tile (``_policy.paged_block_n``), 64 for pages of 64 at D = 128 (default
    128) and of 256 at D = 256 (default 80), compared with the gathered path at 64."""
    import cupy

    from flashcupy import _kvcache

    lengths = np.array([1, 129, 300], np.int32)
    gathers = []
    real_gather = _kvcache._gather_pages
    monkeypatch.setattr(_kvcache, "_gather_pages", lambda *a: gathers.append(1) or real_gather(*a))
    for nq, causal, splits in ((1, True, 1), (1, True, 3), (5, False, 2), (40, True, 1)):
        q, kc, vc, table, _, _, seen = _case(rng, np.float16, lengths, 0, nq, 512, page=page, d=d)
        for i, n in enumerate(lengths):  # NaN past the keys: in the entry's last page and its later ones
            for j in range(n, 512):
                kc[table[i, j // page], j % page] = vc[table[i, j // page], j % page] = np.nan
        spare = np.setdiff1d(np.arange(kc.shape[0]), table)
        kc[spare], vc[spare] = np.nan, np.nan
        dev = [cupy.asarray(x) for x in (q, kc, vc)]
        sinks = cupy.asarray(rng.standard_normal(HQ).astype(np.float32))
        knobs = dict(kernel="wgmma", softcap=20.0, **({} if bn is None else {"block_n": bn}))
        used, pages = lengths.astype(np.int64), table.astype(np.int64)
        gathers.clear()
        o, lse = _kvcache._packed(*dev, used, pages, page, causal, knobs, sinks, splits)
        assert not gathers, (nq, splits)
        with monkeypatch.context() as m:
            m.setattr(_kvcache, "_pages_in_place", lambda *a: False)
            o_g, lse_g = _kvcache._packed(*dev, used, pages, page, causal, {**knobs, "block_n": bn or 64},
                                          sinks, splits)
        assert gathers, (nq, splits)
        assert bool((o == o_g).all()) and bool((lse == lse_g).all()), (nq, causal, splits)
        _check(q, cupy.asnumpy(o), cupy.asnumpy(lse), seen, causal, "f16", sinks=cupy.asnumpy(sinks),
               softcap=20.0)


def test_the_policy_picks_a_key_tile_that_reads_the_pages_in_place():
    """``_policy.paged_block_n``: the wgmma forward's default key tile where it divides the page, else the
    widest narrower tile of 64 or more that divides it and that the family runs, else the default (the
    pages are gathered); other families keep theirs."""
    from flashcupy._policy import paged_block_n

    def runs(bn):
        return True

    assert paged_block_n("fwd_wgmma", 256, 128, runs) == 128
    assert paged_block_n("fwd_wgmma", 64, 128, runs) == 64
    assert paged_block_n("fwd_wgmma", 192, 128, runs) == 64
    assert paged_block_n("fwd_wgmma", 256, 80, runs) == 64      # D = 256's default tile
    assert paged_block_n("fwd_wgmma", 16, 128, runs) == 128     # no tile divides 16: gathered
    assert paged_block_n("fwd_wgmma", 64, 128, lambda bn: False) == 128
    assert paged_block_n("fwd_wgmma", 0, 128, runs) == 128
    assert paged_block_n("fwd_mma", 64, 128, runs) == 128


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged16"])
def test_a_plan_runs_each_layer_as_its_own_call(rng, page):
    """``plan_kvcache`` made from layer 0's arrays (nothing written), then ``run`` on each layer's own
    queries, caches and new keys: the caches' appends and outputs have the bits of
    ``attention_with_kvcache`` on the same layer (the twin), and the float64 reference of its keys."""
    lengths = np.array([0, 17, 100], np.int32)
    layers = [_case(rng, np.float32, lengths, 1, 1, 256, page=page) for _ in range(3)]
    table = layers[0][3]
    q0, kc0, vc0, _, k0, v0, _ = layers[0]
    before = kc0.copy(), vc0.copy()
    plan = flashcupy.plan_kvcache(q0, kc0, vc0, cache_seqlens=lengths, block_table=table, k=k0, v=v0,
                                  num_splits=3, return_lse=True, softcap=5.0)
    assert (kc0 == before[0]).all() and (vc0 == before[1]).all()  # (planning writes nothing)
    for q, kc, vc, own_table, k, v, seen in layers:
        if page is not None:  # (this layer's pages moved to the shared table's slots)
            moved_k, moved_v = kc.copy(), vc.copy()
            for i in range(B):
                for j in range(table.shape[1]):
                    moved_k[table[i, j]], moved_v[table[i, j]] = kc[own_table[i, j]], vc[own_table[i, j]]
            kc, vc = moved_k, moved_v
        kc2, vc2 = kc.copy(), vc.copy()
        o, lse = plan.run(q, kc, vc, k=k, v=v)
        o2, lse2 = flashcupy.attention_with_kvcache(q, kc2, vc2, cache_seqlens=lengths, block_table=table,
                                                    k=k, v=v, num_splits=3, return_lse=True, softcap=5.0)
        assert (kc == kc2).all() and (vc == vc2).all()
        assert (o == o2).all() and (lse == lse2).all()
        _check(q, o, lse, seen, True, "f32", softcap=5.0)


def test_a_plan_refuses_arrays_laid_out_otherwise(rng):
    """``run`` on an array whose kind, shape or dtype differ from the plan's, k and v given to one of plan
    and run only, lengths other than the plan's, or a read-only cache to append into: a ValueError naming
    it, before either cache is written. A NumPy cache of other strides runs (the twin reads any strides)."""
    lengths = np.array([3, 17, 100], np.int32)
    q, kc, vc, _, k, v, _ = _case(rng, np.float32, lengths, 1, 1, 256)
    plan = flashcupy.plan_kvcache(q, kc, vc, cache_seqlens=lengths, k=k, v=v)
    bare = flashcupy.plan_kvcache(q, kc, vc, cache_seqlens=lengths)
    frozen = np.broadcast_to(vc[:1], vc.shape)
    cases = (("q is not laid out", plan, (q[:, :, :2], kc, vc), dict(k=k, v=v)),
             ("q is not laid out", plan, (q.astype(np.float64), kc, vc), dict(k=k, v=v)),
             ("v_cache is not laid out", plan, (q, kc, vc[:2]), dict(k=k, v=v)),
             ("k is not given, but the plan was made with new keys", plan, (q, kc, vc), {}),
             ("k is given, but the plan was made without new keys", bare, (q, kc, vc), dict(k=k, v=v)),
             ("cache_seqlens differ from the lengths this plan was made with", plan, (q, kc, vc),
              dict(k=k, v=v, cache_seqlens=lengths + 1)),
             ("v_cache is read-only", plan, (q, kc, frozen), dict(k=k, v=v)))
    for match, p, args, kw in cases:
        kept = kc.copy()
        with pytest.raises(ValueError, match=f"^{match}"):
            p.run(*args, **kw)
        assert (kc == kept).all(), match
    with pytest.raises(TypeError, match="^k_cache must be a NumPy or CuPy array"):
        plan.run(q, kc.tolist(), vc, k=k, v=v)
    wide_k, wide_v = (np.zeros((B, 512, HKV, D), np.float32)[:, ::2] for _ in range(2))
    wide_k[...], wide_v[...] = kc, vc
    o = plan.run(q, kc, vc, k=k, v=v, cache_seqlens=lengths)
    assert (plan.run(q, wide_k, wide_v, k=k, v=v) == o).all() and (wide_k == kc).all()


def test_a_plan_keeps_the_knobs_it_was_made_with(rng):
    """Array knobs (sinks, ALiBi slopes) are copied into the plan: changing the caller's arrays after
    planning changes nothing that a run computes."""
    lengths = np.array([3, 17, 100], np.int32)
    q, kc, vc, _, _, _, _ = _case(rng, np.float32, lengths, 0, 1, 256)
    sinks = rng.standard_normal(HQ).astype(np.float32)
    slopes = np.abs(rng.standard_normal(HQ)).astype(np.float32)
    plan = flashcupy.plan_kvcache(q, kc, vc, cache_seqlens=lengths, sinks=sinks, alibi_slopes=slopes)
    o = plan.run(q, kc, vc)
    sinks[...], slopes[...] = np.nan, 100.0
    assert (plan.run(q, kc, vc) == o).all()


@pytest.mark.gpu
@pytest.mark.parametrize("page", [None, 16, 64, 128], ids=["contiguous", "paged16", "paged64", "paged128"])
def test_a_plan_decodes_every_layer_of_a_step_with_one_launch_made(rng, monkeypatch, page):
    """A decoding step of three layers on the kernels: one ``plan_kvcache`` (its launch made once: the
    checks, the entries, the lengths' upload), then ``run`` per layer with that layer's queries, caches and
    new keys; the policy's splits and tile (pages of 16 gathered, of 64 and 128 read in place). Each
    layer's append and outputs have the bits of ``attention_with_kvcache`` on the same layer, and its
    entries the float64 reference."""
    import cupy

    from flashcupy import _varlen

    lengths = np.array([0, 17, 200], np.int32)
    made = []
    real = _varlen.packed_launch
    monkeypatch.setattr(_varlen, "packed_launch", lambda *a, **kw: made.append(1) or real(*a, **kw))
    base = _case(rng, np.float16, lengths, 1, 1, 256, page=page, d=128)
    table = None if base[3] is None else cupy.asarray(base[3])
    layers = [base] + [(rng.standard_normal(base[0].shape).astype(np.float16),
                        rng.standard_normal(base[1].shape).astype(np.float16),
                        rng.standard_normal(base[2].shape).astype(np.float16)) for _ in range(2)]
    new = [(rng.standard_normal(base[4].shape).astype(np.float16),
            rng.standard_normal(base[5].shape).astype(np.float16)) for _ in range(3)]
    dev = [[cupy.asarray(x) for x in layer[:3]] for layer in layers]
    plan = flashcupy.plan_kvcache(*dev[0], cache_seqlens=lengths, block_table=table,
                                  k=cupy.asarray(new[0][0]), v=cupy.asarray(new[0][1]), num_splits=0,
                                  return_lse=True)
    assert len(made) == 1
    for (q, kc, vc), (k, v) in zip(dev, new):
        kc2, vc2 = kc.copy(), vc.copy()
        o, lse = plan.run(q, kc, vc, k=cupy.asarray(k), v=cupy.asarray(v))
        o2, lse2 = flashcupy.attention_with_kvcache(q, kc2, vc2, cache_seqlens=lengths, block_table=table,
                                                    k=cupy.asarray(k), v=cupy.asarray(v), num_splits=0,
                                                    return_lse=True)
        assert bool((kc == kc2).all()) and bool((vc == vc2).all())
        assert bool((o == o2).all()) and bool((lse == lse2).all())
        hk, hv = cupy.asnumpy(kc), cupy.asnumpy(vc)
        if page is None:
            seen = [(hk[i, :n + 1], hv[i, :n + 1]) for i, n in enumerate(lengths)]
        else:
            def entry(x, i, n):  # entry i's first n keys, page after page of its row of the table
                return np.concatenate([x[p] for p in base[3][i]])[:n]

            seen = [(entry(hk, i, n + 1), entry(hv, i, n + 1)) for i, n in enumerate(lengths)]
        _check(cupy.asnumpy(q), cupy.asnumpy(o), cupy.asnumpy(lse), seen, True, "f16")
    assert len(made) == 4  # (the plan's, then one per attention_with_kvcache)


@pytest.mark.gpu
def test_a_plan_runs_on_the_stream_it_was_made_on(rng):
    """A plan's uploads are ordered on the stream current when it was made: a run on another stream is
    refused (ValueError) before anything is written; a plan made on that stream runs there, with the bits
    of the first."""
    import cupy

    lengths = np.array([3, 17, 100], np.int32)
    q, kc, vc, _, k, v, _ = _case(rng, np.float16, lengths, 1, 1, 256, d=64)
    dq, dkc, dvc, dk, dv = (cupy.asarray(x) for x in (q, kc, vc, k, v))
    plan = flashcupy.plan_kvcache(dq, dkc, dvc, cache_seqlens=lengths, k=dk, v=dv, num_splits=0)
    stream = cupy.cuda.Stream(non_blocking=True)
    kept = dkc.copy()
    with stream:
        with pytest.raises(ValueError, match="^this plan was made on another CUDA stream"):
            plan.run(dq, dkc, dvc, k=dk, v=dv)
        assert bool((dkc == kept).all())
        there = flashcupy.plan_kvcache(dq, dkc, dvc, cache_seqlens=lengths, k=dk, v=dv, num_splits=0)
        o_there = there.run(dq, dkc.copy(), dvc.copy(), k=dk, v=dv)
    stream.synchronize()
    assert bool((plan.run(dq, dkc, dvc, k=dk, v=dv) == o_there).all())

"""Attention against a KV cache (issue 36): ``attention_with_kvcache`` on flash_attn_with_kvcache's layout.

Batch entry b attends to the first L_b = cache_seqlens[b] + Nnew keys of its cache, after the new keys
``k``, ``v`` (if given) have been written at positions cache_seqlens[b] .. L_b - 1, in place. A contiguous
cache is (B, capacity, Hkv, D); a paged one is (num_blocks, page_size, Hkv, D) with ``block_table``
(B, max_blocks) int32 naming the pages of entry b in order (key j lives in page block_table[b, j // page]
at row j % page). The mask is bottom-right aligned: query i sits at position L_b - Nq + i.

How it runs. On CuPy arrays, every entry in one launch of the packed forward (``_varlen``): the queries
as B sequences of Nq, a contiguous cache read in place (entry b's keys the first L_b of its capacity:
the kernels' used_k, flash_attn's seqused_k), a paged one read in place through its block table by the
wgmma kernel where its pages hold a multiple of the tile's keys (``_pages_in_place``), else its
pages in use gathered into one packed array (one copy). Decoding (Nq = 1) without a window or ALiBi
packs the query heads of each KV head into the rows of one tile (GQA packing: each KV head's keys read
once for its Hq / Hkv query heads). ``num_splits`` = S > 1 cuts each entry's keys into S ranges,
run as S packed entries of the same launch (decoding, or no causal mask), and combines them with
``merge_states``: flash-decoding's arithmetic, with the partial outputs in the inputs' dtype (a
split-KV kernel keeps them in float32; the merge experiment measures what the dtype of the partials
costs).

Otherwise (NumPy inputs; S > 1 with a causal mask and Nq > 1) one ``attention`` call per entry (and per
range): its keys a (1, Hkv, L, D) view of the contiguous cache or a gather of its pages. A causal range
[a, b) that ends before the cache does sees keys up to i' + (L - b) of its own i' = i + (b - a) - Nq:
the window (-1, L - b).

The lengths and the page table are read on the host: given as CuPy arrays they are copied there (a
synchronization); given as NumPy arrays (CuPy q takes them) the host runs ahead. A call under CUDA-graph
capture is refused (RuntimeError): its uploads and temporaries come from CuPy's pool per call.

A call is ``plan_kvcache`` (the checks, the key ranges, the uploads of the append's slots and the
entries' lengths (and a paged cache's table), the launch's Problem) then the plan's ``run``: a few
launches on q's device, the append (one kernel for both caches), the queries' copy (GQA packing or
splits), the attention, the merge (one kernel), the sinks. A decoding step of many layers plans once and
runs each layer. Next: a run that costs its kernels (``docs/design/varlen.md``), float32 partials.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import _sinks
from ._checks import _GRID_YZ_MAX
from ._policy import kvcache_splits
from .transforms import _xp

if TYPE_CHECKING:
    from ._types import Array

# ``attention``'s knobs that a call here passes on; of them, those whose positions a key split would move
KNOBS = ("scale", "block_m", "block_n", "accum", "kernel", "ablate", "window_size", "softcap", "sinks",
         "alibi_slopes")
_NO_SPLIT_KNOBS = ("window_size", "alibi_slopes")


def _host_ints(name: str, x):
    """An int32 array's values on the host, as int64."""
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{name} must be an int32 NumPy or CuPy array, got {type(x).__name__}")
    if x.dtype != np.int32:
        raise TypeError(f"{name} must be int32, got {x.dtype}")
    host = x if isinstance(x, np.ndarray) else x.get()
    return host.astype(np.int64)


def _check(q, k_cache, v_cache, cache_seqlens, block_table, k, v, num_splits, knobs):
    """Shapes, dtypes, lengths and pages checked before anything is written; returns (B, Nq, Nnew,
    capacity, page size or 0, lengths on the host (B,), the page table on the host or None)."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must be 4-D; got shape {tuple(getattr(x, 'shape', ()))}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape; got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"q, k_cache, v_cache must have one dtype; got {q.dtype}, {k_cache.dtype}, "
                        f"{v_cache.dtype}")
    b, nq, hq, d = q.shape
    if b < 1 or nq < 1:
        raise ValueError(f"q must be (B, Nq, Hq, D) with B >= 1 and Nq >= 1; got shape {tuple(q.shape)}")
    _, rows, hkv, dk = k_cache.shape
    if dk != d or hkv < 1 or hq % hkv:
        raise ValueError(f"the cache must be (..., Hkv, D) with q's D = {d} and Hq = {hq} a multiple of "
                         f"Hkv; got {tuple(k_cache.shape)}")
    if (k is None) != (v is None):
        raise ValueError("k and v are appended together: give both or neither")
    nnew = 0
    if k is not None:
        for name, x in (("k", k), ("v", v)):
            if getattr(x, "ndim", None) != 4 or x.shape[0] != b or x.shape[2:] != (hkv, d):
                raise ValueError(f"{name} must be (B, Nnew, Hkv, D) = ({b}, Nnew, {hkv}, {d}), B from q and "
                                 f"Hkv, D from the cache; got {tuple(getattr(x, 'shape', ()))}")
            if x.dtype != q.dtype:
                raise TypeError(f"{name} must have q's dtype {q.dtype}; got {x.dtype}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have one shape; got {tuple(k.shape)} and {tuple(v.shape)}")
        nnew = k.shape[1]
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if isinstance(x, np.ndarray) and nnew and not x.flags.writeable:
                raise ValueError(f"{name} is read-only (a broadcast view?): k and v are appended into it "
                                 "in place")
    lengths = _host_ints("cache_seqlens", cache_seqlens)
    if lengths.shape != (b,):
        raise ValueError(f"cache_seqlens must be (B,) = ({b},), B from q; got {tuple(lengths.shape)}")
    table = None
    if block_table is None:
        if k_cache.shape[0] != b:
            raise ValueError(f"a contiguous cache must be (B, capacity, Hkv, D) with B = {b} from q; got "
                             f"{tuple(k_cache.shape)}")
        page, capacity = 0, rows
    else:
        table = _host_ints("block_table", block_table)
        if table.ndim != 2 or table.shape[0] != b:
            raise ValueError(f"block_table must be (B, max_blocks) with B = {b} from q; got "
                             f"{tuple(table.shape)}")
        page, capacity = rows, rows * table.shape[1]
    if (lengths < 0).any() or (lengths + nnew > capacity).any():
        shown = lengths.tolist() if lengths.size <= 16 else lengths
        raise ValueError(f"cache_seqlens + Nnew must lie in [0, {capacity}] (the cache's capacity); got "
                         f"cache_seqlens {shown}, Nnew = {nnew}")
    if table is not None:
        counts = -(-(lengths + nnew) // page)
        owner, pages = _pages_in_use(table, counts)
        if pages.size and (pages.min() < 0 or pages.max() >= k_cache.shape[0]):
            raise ValueError(f"block_table names pages outside [0, {k_cache.shape[0]}) among the pages in "
                             "use")
        if nnew:  # the appended slots: each written once, in no page another entry reads
            pos = lengths[:, None] + np.arange(nnew)
            written = table[np.arange(b)[:, None], pos // page]
            slots = (written * page + pos % page).reshape(-1)
            if np.unique(slots).size != slots.size:
                raise ValueError("block_table: two appended keys would land in one cache slot (a page listed "
                                 "twice, or shared by entries that both append); each entry's new keys need "
                                 "slots of their own")
            # how many entries read each written page, and how many times it is listed among the pages
            # in use: the (page, entry) pairs sorted, then each written page's run of them (every
            # appended page is read by its own entry, once or more)
            pairs = np.sort(pages * b + owner)
            listed = pairs // b
            distinct = pairs[np.r_[True, pairs[1:] != pairs[:-1]]] // b
            def runs(sorted_pages):
                return (np.searchsorted(sorted_pages, written, "right")
                        - np.searchsorted(sorted_pages, written, "left"))
            for bad, why in ((runs(distinct) > 1, "a page another entry reads (shared pages may be read, "
                              "not written)"),
                             (runs(listed) > 1, "a page it lists twice among its pages in use (the append "
                              "would overwrite a key it reads)")):
                if bad.any():
                    i = int(np.nonzero(bad.any(axis=1))[0][0])
                    raise ValueError(f"block_table: entry {i} would append into {why}")
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, (int, np.integer)):
        raise TypeError(f"num_splits must be an int >= 0 (0: the policy's choice), got "
                        f"{type(num_splits).__name__} {num_splits!r}")
    if num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: the policy's choice), got {num_splits!r}")
    if num_splits > 1:
        used = _no_split_knobs(knobs)
        if used:
            raise ValueError(f"num_splits > 1 does not run with {', '.join(used)} yet (their positions "
                             "would move with each key range); use num_splits=1")
    return b, nq, nnew, capacity, page, lengths, table


def _pages_in_use(table: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pages the entries read, entry after entry: (owner, page) int64 arrays, entry b's first
    counts[b] pages of its row of ``table`` (host arrays)."""
    owner = np.repeat(np.arange(table.shape[0]), counts)
    within = np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, table[owner, within]


def _no_split_knobs(knobs) -> list[str]:
    """The knobs of a call whose positions a key split would move (``_NO_SPLIT_KNOBS``) that it uses."""
    window = knobs.get("window_size")
    return [name for name in _NO_SPLIT_KNOBS
            if (knobs.get(name) is not None if name != "window_size"
                else window is not None and tuple(window) != (-1, -1))]


def _check_knobs(q, k_cache, causal, return_lse, knobs) -> None:
    """``attention``'s checks of the knobs, run once on views of q and the cache before the cache is
    written (each entry's call checks them again on its own shapes), remembered as ``attention``'s are
    (``_checks._memoized``: a decoding loop checks its knobs once)."""
    from ._checks import _check_bool, _knobs, _memoized
    from .reference import _variants

    unknown = sorted(set(knobs) - set(KNOBS))
    if unknown:
        raise TypeError(f"attention_with_kvcache got unknown knobs {unknown}; it takes {list(KNOBS)}")
    _check_bool("return_lse", return_lse)
    kw = dict(causal=causal, scale=knobs.get("scale"), block_m=knobs.get("block_m"),
              block_n=knobs.get("block_n"), accum=knobs.get("accum", "fp32"),
              kernel=knobs.get("kernel", "auto"), ablate=knobs.get("ablate"),
              window_size=knobs.get("window_size", (-1, -1)), softcap=knobs.get("softcap", 0.0))
    _memoized(_entry_problem, (q, k_cache), _knobs(kw), kw)
    if knobs.get("sinks") is not None or knobs.get("alibi_slopes") is not None:
        hq, hkv = q.shape[2], k_cache.shape[2]
        _variants((q.shape[0], hkv, hq // hkv), (-1, -1), 0.0, knobs.get("sinks"), knobs.get("alibi_slopes"))


def _entry_problem(q, k_cache, **knobs):
    """``attention``'s checks on entry 0 of q and the cache seen as (1, H, N, D)."""
    from ._checks import check_forward

    qv, kv = q[0].transpose(1, 0, 2)[None], k_cache[0].transpose(1, 0, 2)[None]
    return check_forward(qv, kv, kv, **knobs)


def attention_with_kvcache(q: Array, k_cache: Array, v_cache: Array, *, cache_seqlens: Array,
                           block_table: Array | None = None, k: Array | None = None, v: Array | None = None,
                           causal: bool = True, num_splits: int = 1, return_lse: bool = False,
                           **knobs) -> Array | tuple[Array, Array]:
    """Attention of new queries against a KV cache, flash_attn_with_kvcache's call (decoding, chunked
    prefill).

    Parameters
    ----------
    q : (B, Nq, Hq, D), NumPy (the twin) or CuPy (the kernels), float16, bfloat16 or float32.
    k_cache, v_cache : (B, capacity, Hkv, D) contiguous, or (num_blocks, page_size, Hkv, D) pages with
        ``block_table``; q's dtype; Hq a multiple of Hkv.
    cache_seqlens : int32 (B,): the keys already in each entry's cache. With CuPy q it may be a NumPy
        array: the lengths are read on the host, and a CuPy array's copy there waits for the GPU (a
        decoding loop that keeps its lengths on the host lets the host run ahead of the GPU).
    block_table : int32 (B, max_blocks) or None: entry b's pages in order (only the pages that hold its
        keys are read, and checked to name pages of the cache); NumPy or CuPy with CuPy q, as
        cache_seqlens.
    k, v : (B, Nnew, Hkv, D) or None: new keys and values, written into the cache in place at positions
        cache_seqlens[b] .. + Nnew before the attention (cache_seqlens is not changed: the caller
        advances it, as with flash_attn).
    causal : bottom-right aligned over the L = cache_seqlens + Nnew keys (query i at L - Nq + i).
    num_splits : S >= 1 key ranges merged by ``merge_states`` (flash-decoding's arithmetic; partial
        outputs in the inputs' dtype; a paged cache's ranges are whole pages, so ranges past its pages
        are empty). On CuPy arrays the S ranges of every entry run in one launch when
        Nq = 1 or causal=False, else one call each. 0: the policy's choice (``_policy.kvcache_splits``:
        ranges only while one launch leaves SMs idle; on NumPy inputs, and where the call cannot run in
        one launch, one range). S > 1 does not take window_size or alibi_slopes
        yet. Sinks are merged once, after the splits
        (``flashcupy._sinks``), so they take any S.
    return_lse : also return the LSE, float32 (B, Hq, Nq).
    **knobs : ``flashcupy.attention``'s other knobs (``KNOBS``: scale, block_m, block_n, accum, kernel,
        ablate, window_size, softcap, sinks (Hq,), alibi_slopes (Hq,) or (B, Hq)), checked before the
        cache is written.

    Where it differs from flash_attn_with_kvcache: ``causal`` defaults to True (flash_attn: False);
    ``cache_seqlens`` is an int32 array, not an int; ``num_splits`` defaults to 1, and 0 is
    this package's rule (it depends on the GPU's SM count, and so do the bits); there is no
    ``cache_batch_idx``, ``cache_leftpad`` or rotary embedding; appends into a page that another entry
    reads, or two appends into one slot, are refused (flash_attn leaves them undefined); shared pages
    may be read.

    Returns o (B, Nq, Hq, D) in q's dtype (contiguous from one launch of one range and one query head a
    row; else a view of a (B, Hq, Nq, D) array), and the LSE with ``return_lse``. An entry with no key
    (L = 0) gets o = 0 and LSE -inf (with sinks: the sink). Everything is checked before the cache is
    written.

    One call is ``plan_kvcache`` of its arguments, then the plan's ``run`` on the same arrays: a decoding
    step over many layers plans once and runs each layer.
    """
    return plan_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, k=k, v=v,
                        causal=causal, num_splits=num_splits, return_lse=return_lse, **knobs).run(
        q, k_cache, v_cache, k=k, v=v)


def plan_kvcache(q: Array, k_cache: Array, v_cache: Array, *, cache_seqlens: Array,
                 block_table: Array | None = None, k: Array | None = None, v: Array | None = None,
                 causal: bool = True, num_splits: int = 1, return_lse: bool = False,
                 **knobs) -> KVCachePlan:
    """The part of an ``attention_with_kvcache`` call that its lengths, page table, shapes and knobs
    decide, done once (FlashInfer's plan / run split): every check, the key ranges, the packed entries'
    lengths and the append's slots uploaded, the launch's Problem. ``plan.run(q, k_cache, v_cache, k=None,
    v=None)`` then runs the call, append included, on any arrays with these arrays' shapes, dtypes and
    device and the caches' strides and 16-byte alignment (a ValueError names one that differs): a
    decoding step plans once and runs each layer, whose caches and queries differ and whose lengths and
    pages do not. The arguments are ``attention_with_kvcache``'s; the arrays given here are only read
    for their shapes and layouts (nothing is written), and the knobs are the plan's (array knobs, sinks
    and ALiBi slopes, copied). A plan holds the lengths it was made with: after the caller advances them,
    a new step needs a new plan (``run(..., cache_seqlens=)`` checks them). On CuPy arrays a plan runs on
    the stream that was current when it was made (its uploads are ordered there; another stream is
    refused)."""
    return KVCachePlan(q, k_cache, v_cache, cache_seqlens, block_table, k, v, causal, num_splits, return_lse,
                       knobs)


_ARRAYS = ("q", "k_cache", "v_cache", "k", "v")


def _layout(name: str, x):
    """What a plan's ``run`` requires of argument ``name`` to be as the plan's: the array kind, shape and
    dtype, and on CuPy the device and, for the caches (which the kernels read in place, and a paged one
    through TMA where it is aligned), the strides and the 16-byte alignment. (The twin reads NumPy caches
    through any strides.)"""
    if x is None:
        return None
    if isinstance(x, np.ndarray):
        return ("numpy", tuple(x.shape), x.dtype, None, None, None)
    cache = name in ("k_cache", "v_cache")
    return ("cupy", tuple(x.shape), x.dtype, x.data.device_id, tuple(x.strides) if cache else None,
            x.data.ptr % 16 == 0 if cache else None)


class KVCachePlan:
    """An ``attention_with_kvcache`` call planned once (``plan_kvcache``), run per layer (``run``)."""

    def __init__(self, q, k_cache, v_cache, cache_seqlens, block_table, k, v, causal, num_splits,
                 return_lse, knobs):
        for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                        ("block_table", block_table), ("cache_seqlens", cache_seqlens)):
            if x is not None and not (isinstance(x, np.ndarray) or type(x).__module__.startswith("cupy")):
                raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(x).__name__}")
        xp = _xp(q)
        host_ok = ("block_table", "cache_seqlens") if xp is not np else ()  # (NumPy: read without a sync)
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                        ("block_table", block_table), ("cache_seqlens", cache_seqlens)):
            if x is not None and _xp(x) is not xp and not (name in host_ok and isinstance(x, np.ndarray)):
                kinds = "CuPy or NumPy" if name in host_ok else "NumPy" if xp is np else "CuPy"
                raise TypeError(f"{name} must be a {kinds} array like q")
        from ._varlen import _refuse_capture

        _refuse_capture("attention_with_kvcache", q)
        self._layouts = tuple(_layout(n, x) for n, x in zip(_ARRAYS, (q, k_cache, v_cache, k, v)))
        self._return_lse = return_lse
        self._device = None if xp is np else q.data.device_id
        if xp is np:
            self._plan(q, k_cache, v_cache, cache_seqlens, block_table, k, v, causal, num_splits, knobs)
        else:
            with xp.cuda.Device(self._device):  # (every upload on q's device, on the current stream)
                self._stream = xp.cuda.get_current_stream().ptr
                self._plan(q, k_cache, v_cache, cache_seqlens, block_table, k, v, causal, num_splits, knobs)

    def _plan(self, q, k_cache, v_cache, cache_seqlens, block_table, k, v, causal, num_splits, knobs):
        xp = _xp(q)
        # (array knobs copied, each on its own device: a run computes what the plan was made with)
        knobs = {n: _copied(x) for n, x in knobs.items()}
        b, nq, nnew, _, page, lengths, table = _check(q, k_cache, v_cache, cache_seqlens, block_table, k, v,
                                                      num_splits, knobs)
        self._lengths = lengths
        _check_knobs(q, k_cache, causal, self._return_lse, knobs)
        sinks = None if knobs.get("sinks") is None else _sinks.check(knobs["sinks"], q.shape[2], q)
        knobs = {name: value for name, value in knobs.items() if name != "sinks"}  # merged once, at the end
        splits = int(num_splits)
        # num_splits=0: the policy's ranges where they run in one launch (decoding or no causal mask; the
        # twin and the per-entry path: one range)
        if splits == 0 and xp is not np and (nq == 1 or not causal) and not _no_split_knobs(knobs):
            from ._launch import _sm_count

            hkv = k_cache.shape[2]
            heads = hkv if _gqa_packed(nq, q.shape[2], hkv, knobs) else q.shape[2]
            longest = int((lengths + nnew).max())
            splits = kvcache_splits(0, ctas=b * heads * -(-nq // 64), longest=longest,
                                    sms=_sm_count(q.data.device_id))
            if page:  # (a paged cache's ranges are whole pages: no more ranges than the longest has pages)
                splits = max(1, min(splits, -(-longest // page)))
        splits = kvcache_splits(splits)
        self._append = None if k is None or not nnew else _append_slots(lengths, table, page, nnew, xp)
        used = lengths + nnew
        self._packed = self._per_entry = None
        if xp is not np and used.max() > 0 and _one_launch(nq, causal, splits, b):
            self._packed = _Packed(q, k_cache, v_cache, used, table, page, causal, knobs, sinks, splits)
        else:
            self._per_entry = (used, table, page, causal, splits, knobs, sinks)

    def run(self, q: Array, k_cache: Array, v_cache: Array, k: Array | None = None, v: Array | None = None, *,
            cache_seqlens: Array | None = None) -> Array | tuple[Array, Array]:
        """The planned call on these arrays (``plan_kvcache``): k and v appended into the caches in place,
        then the attention. Returns o, and the LSE with the plan's ``return_lse``. The arrays must be laid
        out as the plan's (a ValueError names the first that is not); k and v are given if and only if
        the plan was made with them. ``cache_seqlens``, if given, must equal the lengths the plan was made
        with (a ValueError otherwise: a plan reused after the caller advanced them would append over the
        last step's keys). Everything is checked before either cache is written."""
        for name, x, want in zip(_ARRAYS, (q, k_cache, v_cache, k, v), self._layouts):
            if x is not None and not (isinstance(x, np.ndarray) or type(x).__module__.startswith("cupy")):
                raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(x).__name__}")
            if name in ("k", "v") and (x is None) != (want is None):
                raise ValueError(f"{name} is {'not ' if x is None else ''}given, but the plan was made "
                                 f"{'with' if x is None else 'without'} new keys and values: give k and v to "
                                 "both plan_kvcache and run, or to neither")
            got = _layout(name, x)
            if got != want:
                raise ValueError(f"{name} is not laid out as the plan's {name}: (array kind, shape, dtype, "
                                 f"device, strides, 16-byte aligned) {got} against {want}; make a plan for "
                                 "these arrays")
        if cache_seqlens is not None:
            got = _host_ints("cache_seqlens", cache_seqlens)
            if got.shape != self._lengths.shape or (got != self._lengths).any():
                shown = self._lengths.tolist() if self._lengths.size <= 16 else self._lengths
                raise ValueError(f"cache_seqlens differ from the lengths this plan was made with ({shown}); "
                                 "make a new plan for these lengths")
        if self._append is not None:
            for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
                if isinstance(x, np.ndarray) and not x.flags.writeable:
                    raise ValueError(f"{name} is read-only (a broadcast view?): k and v are appended into it "
                                     "in place")
        if self._device is None:
            return self._run(q, k_cache, v_cache, k, v)
        from ._varlen import _refuse_capture

        _refuse_capture("attention_with_kvcache", q)
        xp = _xp(q)
        with xp.cuda.Device(self._device):
            if xp.cuda.get_current_stream().ptr != self._stream:
                raise ValueError("this plan was made on another CUDA stream: its uploads are ordered on that "
                                 "stream only; run it there, or make a plan on this stream")
            return self._run(q, k_cache, v_cache, k, v)

    def _run(self, q, k_cache, v_cache, k, v):
        if self._append is not None:
            _append(k_cache, v_cache, k, v, self._append)
        if self._packed is not None:
            o, lse = self._packed(q, k_cache, v_cache)
            return (o, lse) if self._return_lse else o
        used, table, page, causal, splits, knobs, sinks = self._per_entry
        o, lse = _per_entry(q, k_cache, v_cache, used, table, page, causal, splits, knobs)
        if sinks is not None:  # after the ranges are merged, as after a kernel's key loop (no key: lse = z)
            _sinks.apply(o, lse, sinks)
        o = o.transpose(0, 2, 1, 3)
        return (o, lse) if self._return_lse else o


# The append on CuPy arrays: a thread per element of the new keys and values, each copied (as its bits)
# into its slot of either cache through the arrays' strides (elements); slots (2, B Nnew) int64: the
# cache entry or page, and the row. One launch for both caches, through the driver (CuPy's scatter
# `cache[entries, rows] = new` took about 70 us of host time a cache on an H200's host).
_APPEND_SOURCE = r"""
extern "C" __global__ void flashcupy_append(
        FC_BITS *__restrict__ kc, FC_BITS *__restrict__ vc, const FC_BITS *__restrict__ k,
        const FC_BITS *__restrict__ v, const long long *__restrict__ slots, const long long tokens,
        const long long nnew, const long long heads, const long long d,
        const long long kc0, const long long kc1, const long long kc2, const long long kc3,
        const long long vc0, const long long vc1, const long long vc2, const long long vc3,
        const long long k0, const long long k1, const long long k2, const long long k3,
        const long long v0, const long long v1, const long long v2, const long long v3) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= tokens * heads * d) return;
    const long long t = i / (heads * d), e = i - t * heads * d, h = e / d, c = e - h * d;
    const long long b = t / nnew, j = t - b * nnew, slot = slots[t], row = slots[tokens + t];
    kc[slot * kc0 + row * kc1 + h * kc2 + c * kc3] = k[b * k0 + j * k1 + h * k2 + c * k3];
    vc[slot * vc0 + row * vc1 + h * vc2 + c * vc3] = v[b * v0 + j * v1 + h * v2 + c * v3];
}
"""
_APPEND_KERNELS: dict = {}   # element size -> cupy.RawKernel
_APPEND_LAUNCHES: dict = {}  # (element size, shapes, strides) -> its launcher (_launch.small_launcher)


def _append(k_cache, v_cache, k, v, slots) -> None:
    """Write the new keys and values k, v (B, Nnew, Hkv, D) into the caches in place, at ``slots``
    (``_append_slots``): NumPy by a scatter per cache, CuPy by one launch on the current stream."""
    xp = _xp(k)
    if xp is np:
        for cache, new in ((k_cache, k), (v_cache, v)):
            cache[slots[0], slots[1]] = new
        return
    from ._launch import PTR, small_launcher

    size = k.itemsize
    kern = _APPEND_KERNELS.get(size)
    if kern is None:
        bits = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}[size]
        kern = _APPEND_KERNELS[size] = xp.RawKernel(f"#define FC_BITS {bits}\n" + _APPEND_SOURCE,
                                                    "flashcupy_append")
    b, nnew, heads, d = k.shape
    key = (size, k.shape, k_cache.strides, v_cache.strides, k.strides, v.strides)
    launch = _APPEND_LAUNCHES.get((key, xp.cuda.runtime.getDevice()))
    if launch is None:
        strides = tuple(s // size for x in (k_cache, v_cache, k, v) for s in x.strides)
        layout = (PTR,) * 5 + tuple(np.int64(x) for x in (b * nnew, nnew, heads, d, *strides))
        launch = small_launcher(kern, (-(-b * nnew * heads * d // 256),), 256, layout, _APPEND_LAUNCHES, key)
    launch(xp.cuda.get_current_stream().ptr, (k_cache.data.ptr, v_cache.data.ptr, k.data.ptr, v.data.ptr,
                                              slots.data.ptr))


def _copied(x):
    """A copy of a NumPy or CuPy array (on its own device), anything else as it is."""
    if isinstance(x, np.ndarray):
        return x.copy()
    if type(x).__module__.startswith("cupy") and hasattr(x, "data"):
        import cupy

        with cupy.cuda.Device(x.data.device_id):
            return x.copy()
    return x


def _append_slots(lengths: np.ndarray, table, page: int, nnew: int, xp):
    """The (cache entry or page, row) of each new key, (2, B, Nnew) int64, entry b's at its positions
    lengths[b] .. + Nnew (through ``table`` into pages of ``page`` rows where paged): computed on the
    host, uploaded in one copy (CuPy)."""
    b = lengths.size
    pos = lengths[:, None] + np.arange(nnew)
    if table is None:
        index = np.stack([np.broadcast_to(np.arange(b)[:, None], pos.shape), pos])
    else:
        index = np.stack([table[np.arange(b)[:, None], pos // page], pos % page])
    return index if xp is np else xp.asarray(np.ascontiguousarray(index, dtype=np.int64))


def _per_entry(q, k_cache, v_cache, used, table, page, causal, splits, knobs):
    """One ``attention`` call per entry (and per key range with splits): o (B, Hq, Nq, D) and lse
    (B, Hq, Nq), sinks not merged."""
    from . import attention, merge_states

    xp = _xp(q)
    b, nq, hq, d = q.shape
    o = xp.zeros((b, hq, nq, d), dtype=q.dtype)
    lse = xp.full((b, hq, nq), -np.inf, dtype=np.float32)
    for i in range(b):
        n = int(used[i])
        if n == 0:
            continue
        if table is None:
            keys, values = k_cache[i, :n], v_cache[i, :n]
        else:
            pages = table[i, :-(-n // page)]
            keys, values = (_gather_pages(x, pages)[:n] for x in (k_cache, v_cache))
        qb = q[i].transpose(1, 0, 2)[None]
        unit = 1 if table is None else page  # (a paged cache's ranges start at pages, as _packed's)
        edges = _split_edges(np.array([n]), min(splits, -(-n // unit)), unit)[0]
        parts = []
        for a, e in zip(edges[:-1], edges[1:]):
            kb, vb = (x[a:e].transpose(1, 0, 2)[None] for x in (keys, values))
            mask = dict(causal=causal)
            if causal and e < n:  # an earlier range: keys up to i' + (n - e) of its own bottom-right i'
                mask = dict(causal=False, window_size=(-1, n - e))
            slopes = knobs.get("alibi_slopes")
            per_entry = {} if slopes is None or slopes.ndim == 1 else {"alibi_slopes": slopes[i]}
            parts.append(attention(qb, kb, vb, return_lse=True, **{**knobs, **per_entry, **mask}))
        if len(parts) == 1:
            o[i], lse[i] = parts[0][0][0], parts[0][1][0]
        else:
            ob, lb = merge_states(xp.stack([p[0] for p in parts]), xp.stack([p[1] for p in parts]))
            o[i], lse[i] = ob[0], lb[0]
    return o, lse


def _one_launch(nq: int, causal: bool, splits: int, batch: int) -> bool:
    """Whether ``_packed`` runs a call (CuPy inputs): without key splits always; with them for decoding
    (one query per entry: every range's mask is its own) or without a causal mask, and while the B x S
    entries fit in the grid."""
    return (splits == 1 or nq == 1 or not causal) and batch * splits <= _GRID_YZ_MAX


def _gqa_packed(nq: int, hq: int, hkv: int, knobs) -> bool:
    """Whether the query heads of one KV head run as the rows of one tile (GQA packing): decoding (one
    query per entry, so every row sits at the same position) with more than one query head per KV head,
    and no window or ALiBi (positions or slopes that would differ between the rows of a tile)."""
    return nq == 1 and hq > hkv and not _no_split_knobs(knobs)


def _split_edges(n: np.ndarray, splits: int, unit: int = 1) -> np.ndarray:
    """The edges of ``splits`` key ranges of n[b] keys, (B, S + 1) int64: round(s n[b] / S), the values of
    np.linspace(0, n[b], S + 1) (s times the step n / S, the last n itself), at NumPy's arithmetic cost
    (linspace's own overhead is a decoding step's host time). ``unit`` > 1: in whole units of that many
    keys (a paged cache's pages: a range starts at a page), the last unit partial: the edges of
    ceil(n / unit) units, times the unit, at most n."""
    n = np.asarray(n, np.int64)
    units = (-(-n // unit)).astype(np.float64)[:, None]
    edges = np.arange(splits + 1) * (units / splits)
    edges[:, -1:] = units
    return np.minimum(edges.round().astype(np.int64) * unit, n[:, None])


def _entries(used: np.ndarray, starts: np.ndarray, splits: int, unit: int = 1):
    """The packed entries of B cache entries, each cut into ``splits`` key ranges: entry e = b S + s takes
    keys [edge_s, edge_{s + 1}) of entry b (``_split_edges``, as the per-entry
    path cuts them; ranges may be empty when used[b] < S), which start at row starts[b] of the keys'
    array. Returns (first, count): entry e's first key row and its key count (int64, host)."""
    edges = _split_edges(used, splits, unit)
    return (starts[:, None] + edges[:, :-1]).reshape(-1), np.diff(edges, axis=1).reshape(-1)


def _pages_in_place(qp, kp, vp, cq, ck, causal, used_k, max_k, page, knobs) -> bool:
    """Whether the packed launch of these arguments (``_packed``'s, k and v a paged cache's pages as
    (pages x page, Hkv, D)) reads the pages in place: CuPy arrays that the kernels' TMA reads as they lie
    (else ``_launch.forward`` would copy the whole cache, where the gather copies the pages in use) and a
    variant that can (``_varlen.reads_pages``; its Problem is remembered for the launch)."""
    from ._launch import _strides_readable
    from ._varlen import packed_problem

    if _xp(qp) is np:
        return False
    for x in (kp, vp):  # (the kernels' (1, Hkv, rows, D) view of the pages)
        view = x.transpose(1, 0, 2)[None]
        if x.data.ptr % 16 or not _strides_readable(view.shape, view.strides, x.itemsize, True):
            return False
    plain = {n: x for n, x in knobs.items() if n != "alibi_slopes"}
    p = packed_problem(qp, kp, vp, cq, ck, causal=causal, used_k=used_k, max_k=max_k,
                       alibi=knobs.get("alibi_slopes") is not None, page=page, **plain)
    return p.variant.paged


def _gather_pages(x, pages):
    """Pages ``pages`` (host or device ints) of a paged cache x (num_blocks, page, Hkv, D), one after
    another, as one packed (len(pages) page, Hkv, D) array: one copy of them (16 bytes a thread where
    each page is whole 16-byte units of a C-contiguous cache, the units copied as complex128)."""
    xp = _xp(x)
    rows = xp.asarray(pages)
    flat = x.reshape(x.shape[0], -1)
    if (xp is not np and x.flags.c_contiguous and flat.shape[1] * x.itemsize % 16 == 0
            and x.data.ptr % 16 == 0):
        out = flat.view(xp.complex128)[rows].view(x.dtype)
    else:
        out = x[rows]
    return out.reshape(-1, *x.shape[2:])


def _like(x, shape):
    """An array of x's kind, dtype and device with this shape, C-strided over x's memory: for the launch's
    checks, which read its shape, strides, dtype and device only (never its elements)."""
    xp = _xp(x)
    strides = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) * x.itemsize for i in range(len(shape)))
    return xp.lib.stride_tricks.as_strided(x, shape, strides)


def _packed(q, k_cache, v_cache, used, table, page, causal, knobs, sinks, splits: int = 1):
    """``_Packed`` made and run on these arrays: o (B, Nq, Hq, D), lse (B, Hq, Nq)."""
    return _Packed(q, k_cache, v_cache, used, table, page, causal, knobs, sinks, splits)(q, k_cache, v_cache)


class _Packed:
    """Every entry in one launch of the packed forward (``_varlen``): the queries as B sequences of Nq;
    a contiguous cache read in place as (B capacity, Hkv, D) (copied first where its entries do not lie
    capacity rows apart), entry b's keys the first used[b] of its capacity (the kernels' used_k: the mma
    and simt loads stop there, and the wgmma kernel zeroes the rows of V past them that its TMA tiles
    read); a paged cache read in place through its block table where the launch's variant can
    (``_pages_in_place``: the wgmma forward, pages a multiple of its block_n that lie page rows apart and
    that TMA reads as they lie, fewer than 2^31 rows in all), else its pages in use gathered entry
    after entry (``_gather_pages``: one copy, as the per-entry path makes), entry b's keys the first
    used[b] from its first page. Key ranges (splits) of a paged cache start at multiples of the page
    size (``_split_edges``' unit), in both paths.

    Decoding (Nq = 1) packs the query heads of each KV head into the rows of one tile where
    ``_gqa_packed`` says so: the launch then sees Hkv heads of Hq / Hkv queries, reads each KV head's keys
    once for all its query heads, and runs without a mask (the one query sees every key). ``splits`` = S
    > 1 (``_one_launch``) makes each entry S packed entries over consecutive key ranges, with the entry's
    queries repeated, in the same launch; their outputs and LSEs are merged by ``merge_states``' kernel
    (partials in the inputs' dtype, as the per-entry path's). Made once (a plan: the
    entries, the lengths' upload, the launch's checks), called per layer on arrays of the same layout:
    returns o (B, Nq, Hq, D) and lse (B, Hq, Nq), sinks merged."""
    def __init__(self, q, k_cache, v_cache, used, table, page, causal, knobs, sinks, splits):
        from ._varlen import packed_launch

        b, nq, hq, d = q.shape
        hkv = k_cache.shape[2]
        self.pack = pack = _gqa_packed(nq, hq, hkv, knobs)
        rows, heads = (hq // hkv, hkv) if pack else (nq, hq)  # each packed entry's queries and query heads
        self.dims = (b, nq, hq, d, rows, heads, splits)
        cap = k_cache.shape[1]
        used = np.asarray(used, np.int64)
        entries = b * splits
        cq = np.arange(entries + 1, dtype=np.int64) * rows
        qp = _like(q, (entries * rows, heads, d))  # (the packed queries' layout: they are made per call)
        self.copy = False   # a contiguous cache whose entries do not lie capacity rows apart: copied per call
        self.gather = None  # the pages in use, where a paged cache is gathered (uploaded once)
        in_place = None
        if table is None:  # entry b's keys at rows b cap .. of the cache seen as (B cap, Hkv, D)
            self.copy = not all(x.strides[0] == cap * x.strides[1] for x in (k_cache, v_cache))
            kp = vp = _like(k_cache, (b * cap, hkv, d))
            ck, used_k = _entries(used, np.arange(b, dtype=np.int64) * cap, splits)
            ck = np.concatenate([ck, [b * cap]])
            max_k = cap
        else:
            max_k = page * table.shape[1]
            counts = -(-used // page)
            if k_cache.shape[0] * page < 2**31 and all(x.strides[0] == page * x.strides[1]
                                                       for x in (k_cache, v_cache)):
                # the pages as (pages x page, Hkv, D), read in place through the table if the variant can
                kp, vp = (x.reshape(-1, *x.shape[2:]) for x in (k_cache, v_cache))
                ck, used_k = _entries(used, np.zeros(b, np.int64), splits, unit=page)
                ck = np.concatenate([ck, [0]])
                if _pages_in_place(qp, kp, vp, cq, ck, causal and not pack, used_k, max_k, page, knobs):
                    in_place = (table, np.repeat(np.arange(b), splits), page)
            if in_place is None:  # the pages in use, entry after entry, copied once a call
                pages = _pages_in_use(table, counts)[1]
                self.gather = _xp(q).asarray(pages)
                kp = vp = _like(k_cache, (pages.size * page, hkv, d))
                starts = (np.cumsum(counts) - counts) * page  # entry b's keys from its first page's row
                ck, used_k = _entries(used, starts, splits, unit=page)
                ck = np.concatenate([ck, [int(counts.sum()) * page]])
        self.plain = splits == 1 and not pack  # (else sinks after the ranges are merged and heads unpacked)
        self.sinks = None if self.plain else sinks
        self.launch = packed_launch(qp, kp, vp, cq, ck, causal=causal and not pack, used_k=used_k,
                                    max_k=max_k, pages=in_place, sinks=sinks if self.plain else None, **knobs)

    def __call__(self, q, k_cache, v_cache):
        from ._merge import _merge_exp_cupy, merge_states

        xp = _xp(q)
        b, nq, hq, d, rows, heads, splits = self.dims
        hkv = k_cache.shape[2]
        # the packed queries, (entries x rows, heads, D): entry b's once per key range; packed heads: row j
        # of KV head hk is query head hk (Hq / Hkv) + j
        qp = q.reshape(b, 1, hkv, rows, d).transpose(0, 1, 3, 2, 4) if self.pack else q[:, None]
        if splits > 1 or self.pack:
            qp = xp.ascontiguousarray(xp.broadcast_to(qp, (b, splits, rows, heads, d)))
        qp = qp.reshape(b * splits * rows, heads, d)
        if self.gather is not None:
            kp, vp = (_gather_pages(x, self.gather) for x in (k_cache, v_cache))
        else:
            if self.copy:
                k_cache, v_cache = xp.ascontiguousarray(k_cache), xp.ascontiguousarray(v_cache)
            kp, vp = (x.reshape(-1, *x.shape[2:]) for x in (k_cache, v_cache))  # (views: read in place)
        o, lse = self.launch(qp, kp, vp)
        if self.plain:
            return o.reshape(b, nq, hq, d), xp.ascontiguousarray(lse.reshape(hq, b, nq).transpose(1, 0, 2))
        # (S, B, heads, rows, D) partial outputs and (S, B, heads, rows) LSEs: views of the launch's outputs
        # (merged as they lie); packed heads then unpack as (B, Hq, 1, D), query head hk (Hq / Hkv) + j
        o = o.reshape(b, splits, rows, heads, d).transpose(1, 0, 3, 2, 4)
        lse = lse.reshape(heads, b, splits, rows).transpose(2, 1, 0, 3)
        if splits > 1:  # (CuPy: merge_states' kernel, past its checks: these parts are the launch's)
            o, lse = merge_states(o, lse) if xp is np else _merge_exp_cupy(o, lse, o.dtype)
        else:
            o, lse = xp.ascontiguousarray(o[0]), xp.ascontiguousarray(lse[0])
        if self.pack:
            o, lse = o.reshape(b, hq, 1, d), lse.reshape(b, hq, 1)
        if self.sinks is not None:  # after the ranges are merged, as after a kernel's key loop
            _sinks.apply(o, lse, self.sinks)
        return o.transpose(0, 2, 1, 3), lse

"""Packed sequences (issue 36): ``attention_varlen`` and ``attention_varlen_backward`` on flash_attn's
packed layout.

Sequence i of a batch occupies rows cu_seqlens_q[i] .. cu_seqlens_q[i + 1] of q (total_q, Hq, D) and
rows cu_seqlens_k[i] .. cu_seqlens_k[i + 1] of k, v (total_k, Hkv, D); it attends to its own keys only
(the causal mask, and every knob, per sequence as in ``attention``).

The forward on CuPy arrays is one launch for the whole ragged batch: the varlen variant of the family's
kernel (``FC_VARLEN``; kernels_cu/flash_common.cuh's batch entries) walks ceil(longest / block_m) x Hq x
B query tiles, each tile reads its sequence's bounds from the cumulative lengths, and tiles past a
sequence's end do nothing, so the cost follows the tokens. Every knob runs there (sinks merged after it,
on the packed rows). The backward on CuPy arrays is one launch of each backward kernel, in every family
(the wgmma backward pads each sequence's rows to whole query tiles in its fp32 temporaries, so that no
TMA tile holds two sequences). A batch of more than 65,535 sequences (the grid's limit) takes the
per-sequence path, and so does the twin (NumPy): one ``attention`` (``attention_backward``) call per
sequence, on (1, H, n_i, D) views of the packed arrays (read in place: a (N, H, D) slice seen as (1, H,
N, D) is one of the strided layouts every family reads). Where no sequence runs a call, the knobs are
still checked once. The packed and per-sequence paths give the same bits on the same tile (the tests
compare them).

The lengths are read on the host: with CuPy inputs, ``cu_seqlens`` is copied to the host once per call
(a synchronization). A call under CUDA-graph capture is refused before any copy (``_refuse_capture``):
its uploads and temporaries come from CuPy's pool per call, and a replay would find them reused.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from ._checks import _GRID_YZ_MAX
from ._families import VARLEN_FAMILIES
from .transforms import _xp

if TYPE_CHECKING:
    from ._types import Array


def _lengths(name: str, cu, total: int, max_seqlen, max_name: str) -> np.ndarray:
    """``cu`` (B + 1,) checked (int32, from 0, non-decreasing, ending at ``total``), on the host; its
    bound ``max_seqlen`` (the argument ``max_name``) at least the longest length."""
    if not hasattr(cu, "dtype") or not hasattr(cu, "shape"):
        raise TypeError(f"{name} must be an int32 NumPy or CuPy array, got {type(cu).__name__}")
    if cu.dtype != np.int32:
        raise TypeError(f"{name} must be int32 (flash_attn's cumulative lengths), got {cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must be 1-D of length B + 1 >= 2, got shape {tuple(cu.shape)}")
    host = cu if isinstance(cu, np.ndarray) else cu.get()
    host = host.astype(np.int64)
    if host[0] != 0 or host[-1] != total or (np.diff(host) < 0).any():
        raise ValueError(f"{name} must start at 0, never decrease and end at the packed length {total}; got "
                         f"{host.tolist() if host.size <= 16 else host}")
    longest = int(np.diff(host).max())
    if max_seqlen is not None:
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (int, np.integer)):
            raise TypeError(f"{max_name} must be an int or None, got {type(max_seqlen).__name__}")
        if max_seqlen < longest:
            raise ValueError(f"{max_name} is {max_seqlen}, but {name} has a sequence of {longest} tokens")
    return host


def _packed(name: str, x, heads_name: str):
    if getattr(x, "ndim", None) != 3:
        raise ValueError(f"{name} must be packed (total, {heads_name}, D); got shape "
                         f"{tuple(getattr(x, 'shape', ()))}")


def _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    _packed("q", q, "Hq")
    _packed("k", k, "Hkv")
    _packed("v", v, "Hkv")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    cq = _lengths("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
    ck = _lengths("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k")
    if cq.size != ck.size:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe one batch: {cq.size - 1} and "
                         f"{ck.size - 1} sequences")
    return cq, ck


def _refuse_capture(fn: str, q) -> None:
    """A packed call (and a KV-cache call) reads its lengths on the host and takes per-call uploads and
    temporaries from CuPy's pool, which a CUDA graph would replay after the pool had handed them to
    other arrays (and the lengths it saw at capture). Under stream capture it is refused, before any
    copy: RuntimeError. (A CuPy array's copy to the host would otherwise fail inside the capture.)"""
    if not type(q).__module__.startswith("cupy"):
        return
    import cupy

    with cupy.cuda.Device(q.data.device_id):
        if cupy.cuda.get_current_stream().is_capturing():
            raise RuntimeError(f"{fn} cannot be captured into a CUDA graph: it reads its lengths on the "
                               "host and uploads them, with its temporaries, per call; call it outside the "
                               "capture")


def _view(x, a: int, b: int):
    """Rows [a, b) of a packed (total, H, D) array as a (1, H, b - a, D) view."""
    return x[a:b].transpose(1, 0, 2)[None]


def _per_sequence(knobs: dict, i: int) -> dict:
    """The knobs of sequence i: ALiBi slopes given per batch entry, (B, Hq), are sequence i's."""
    slopes = knobs.get("alibi_slopes")
    if slopes is not None and np.ndim(slopes) == 2:  # (a list of lists too)
        return {**knobs, "alibi_slopes": slopes[i]}
    return knobs


def _check_slopes(knobs: dict, batch: int, heads: int) -> None:
    slopes = knobs.get("alibi_slopes")
    shape = None if slopes is None else tuple(np.shape(slopes))  # (lists too, as attention takes them)
    if shape is not None and shape not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape (Hq,) = ({heads},) or, per sequence, (B, Hq) = "
                         f"({batch}, {heads}); got {shape}")


# the knobs of attention and attention_backward that the packed entry points pass on (dlse apart)
_FORWARD_KNOBS = ("scale", "block_m", "block_n", "accum", "kernel", "ablate", "window_size", "softcap",
                  "sinks", "alibi_slopes")
_BACKWARD_KNOBS = ("scale", "block_m", "block_n", "accum", "kernel", "deterministic", "window_size",
                   "softcap", "sinks", "alibi_slopes")


def _check_knob_names(fn: str, knobs: dict, allowed: tuple) -> None:
    unknown = sorted(set(knobs) - set(allowed))
    if unknown:
        raise TypeError(f"{fn}() got unexpected keyword arguments {unknown}; its knobs are "
                        f"{', '.join(allowed)} (as in {fn.replace('_varlen', '')})")


def _check_knobs_once(q, k, v, b: int, causal, knobs: dict, backward: bool) -> None:
    """The knobs checked as ``attention`` (``attention_backward``) checks them, for a batch in which no
    sequence runs a call (none has both queries and keys): on the shape of b sequences of one query and
    one key, so that a bad knob is refused whatever the lengths."""
    from . import _sinks
    from ._checks import _check_bool, check_forward

    xp = _xp(q)

    def shaped(x):  # x's dtype, device and heads in a (b, H, 1, D) shape (never read)
        return xp.lib.stride_tricks.as_strided(x, (b, x.shape[1], 1, x.shape[2]), (0, 0, 0, x.itemsize))

    kw = {"scale": None, "block_m": None, "block_n": None, "accum": "fp32", "kernel": "auto",
          "window_size": (-1, -1), "softcap": 0.0}
    kw.update((n, knobs[n]) for n in kw if n in knobs)
    check_forward(shaped(q), shaped(k), shaped(v), causal=causal, ablate=knobs.get("ablate"),
                  alibi=knobs.get("alibi_slopes") is not None, direction="bwd" if backward else "fwd", **kw)
    if backward:
        _check_bool("deterministic", knobs.get("deterministic", False))
    if knobs.get("sinks") is not None:
        _sinks.check(knobs["sinks"], q.shape[1], q)



def attention_varlen(q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array,
                     max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, *,
                     causal: bool = False, return_lse: bool = False, **knobs) -> Array | tuple[Array, Array]:
    """Attention over a batch of packed sequences of different lengths (flash_attn_varlen_func's layout).

    q (total_q, Hq, D), k and v (total_k, Hkv, D), NumPy or CuPy, as ``flashcupy.attention`` takes them
    per sequence; ``cu_seqlens_q``, ``cu_seqlens_k`` int32 (B + 1,) cumulative lengths (from 0,
    non-decreasing, ending at total_q and total_k); ``max_seqlen_q``, ``max_seqlen_k`` optional bounds,
    checked. ``causal`` is bottom-right aligned per sequence; ``knobs`` are ``attention``'s (scale,
    block_m, block_n, accum, kernel, ablate, window_size, ...; ALiBi slopes (Hq,) or per sequence
    (B, Hq)). A sequence with queries and no keys gives o = 0 and lse = -inf for its rows (with sinks, the
    head's sink). Returns o (total_q, Hq, D) and, with ``return_lse``, lse float32
    (Hq, total_q) (flash_attn's layout). On CuPy arrays the attention is one kernel launch for the whole
    batch (every family; sinks add their two merge kernels after it; a batch of more than 65,535
    sequences runs one call per sequence); NumPy inputs run the twin one sequence at a time. The lengths
    are checked on the host before any launch: CuPy ``cu_seqlens`` are copied there (a device-to-host
    copy that waits for the stream). A call under CUDA-graph capture is refused (RuntimeError: its
    uploads and temporaries would not outlive the call). How it runs: ``flashcupy._varlen``.
    """
    import flashcupy

    from ._checks import _check_bool

    _check_bool("return_lse", return_lse)
    _check_knob_names("attention_varlen", knobs, _FORWARD_KNOBS)
    _refuse_capture("attention_varlen", q)
    cq, ck = _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_slopes(knobs, cq.size - 1, q.shape[1])
    xp = _xp(q)
    if xp is not np and np.diff(cq).max() > 0 and np.diff(ck).max() > 0 and cq.size - 1 <= _GRID_YZ_MAX:
        o, lse = _forward_packed(q, k, v, cq, ck, causal=causal, cu=(cu_seqlens_q, cu_seqlens_k), **knobs)
        return (o, lse) if return_lse else o
    if not ((np.diff(cq) > 0) & (np.diff(ck) > 0)).any():  # (no call below checks the knobs)
        _check_knobs_once(q, k, v, cq.size - 1, causal, knobs, backward=False)
    o = xp.zeros(q.shape, dtype=q.dtype)
    lse = xp.full((q.shape[1], q.shape[0]), -np.inf, dtype=xp.float32)
    for i in range(cq.size - 1):
        (qa, qb), (ka, kb) = cq[i:i + 2], ck[i:i + 2]
        if qb == qa or kb == ka:  # no rows, or rows that see no key: o = 0, lse = -inf (with sinks: the sink)
            if kb == ka and knobs.get("sinks") is not None:
                lse[:, qa:qb] = xp.asarray(knobs["sinks"], dtype=xp.float32)[:, None]
            continue
        o_i, lse_i = flashcupy.attention(_view(q, qa, qb), _view(k, ka, kb), _view(v, ka, kb), causal=causal,
                                         return_lse=True, **_per_sequence(knobs, i))
        o[qa:qb] = o_i[0].transpose(1, 0, 2)
        lse[:, qa:qb] = lse_i[0]
    return (o, lse) if return_lse else o


def _packed_problem(q, k, v, *, b, nq, nk, page=0, **knobs):
    """The Problem of a packed call (``direction`` "bwd" among the knobs: a backward): ``attention``'s
    checks of the knobs, made on the shape of b sequences of the longest lengths nq, nk, then the family's
    varlen variant and the packed lengths; a family without one (VARLEN_FAMILIES) keeps its Problem.
    ``page`` > 0: k and v are a paged cache's pages, read in place where the variant can
    (``reads_pages``): its paged variant, else the varlen one (the caller then gathers the pages); a
    caller who leaves block_n None gets the policy's key tile for the pages (``_policy.paged_block_n``)."""
    import cupy

    from ._checks import check_forward
    from ._policy import paged_block_n

    def shaped(x, n):  # x's dtype, device and heads in the (B, H, n, D) shape of the call (never read)
        return cupy.lib.stride_tricks.as_strided(x, (b, x.shape[1], n, x.shape[2]), (0, 0, 0, x.itemsize))

    p = check_forward(shaped(q, nq), shaped(k, nk), shaped(v, nk), **knobs)
    if page and knobs.get("block_n") is None:  # (the policy's key tile for these pages)
        def runs(bn):
            try:
                return check_forward(shaped(q, nq), shaped(k, nk), shaped(v, nk), **{**knobs, "block_n": bn})
            except ValueError:
                return None

        bn = paged_block_n(p.variant.family, page, p.variant.block_n, runs)
        p = runs(bn) if bn != p.variant.block_n else p
    if p.variant.family not in VARLEN_FAMILIES:  # (a family without one: one call per sequence)
        return p
    paged = reads_pages(p.variant, page)
    return dataclasses.replace(p, variant=dataclasses.replace(p.variant, varlen=True, paged=paged),
                               total_q=q.shape[0], total_k=k.shape[0], page=page if paged else 0)


def reads_pages(variant, page: int) -> bool:
    """Whether ``variant``'s varlen kernel reads a paged cache of ``page``-row pages in place: the wgmma
    forward (its key tiles are TMA boxes, each inside one page when block_n divides the page)."""
    return bool(page) and variant.family == "fwd_wgmma" and page % variant.block_n == 0


def _device_lengths(given: tuple, hosts: tuple, device: int) -> tuple:
    """The checked lengths as the kernels read them (int32 on the device): each given array itself where
    it is an int32 C-contiguous CuPy array on the device (what the host check read), the others' host
    copies uploaded together (one copy, sliced)."""
    import cupy

    def usable(c):
        return (isinstance(c, cupy.ndarray) and c.dtype == np.int32 and c.flags.c_contiguous
                and c.data.device_id == device)

    upload = [h for c, h in zip(given, hosts) if not usable(c)]
    if upload:
        with cupy.cuda.Device(device):
            flat = cupy.asarray(np.concatenate(upload).astype(np.int32))
    out, at = [], 0
    for c, h in zip(given, hosts):
        if usable(c):
            out.append(c)
        else:
            out.append(flat[at:at + h.size])
            at += h.size
    return tuple(out)


def _forward_packed(q, k, v, cq, ck, *, o=None, lse=None, **kw):
    """The forward of a packed batch on CuPy arrays in one launch (the module docstring): ``packed_launch``
    of these arguments run on q, k, v. ``o``, ``lse``: preallocated outputs, as ``_launch.forward`` takes
    them (the tests poison them)."""
    return packed_launch(q, k, v, cq, ck, **kw)(q, k, v, o=o, lse=lse)


def packed_launch(q, k, v, cq, ck, *, causal, scale=None, block_m=None, block_n=None, accum="fp32",
                  kernel="auto", ablate=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                  sinks=None, cu=(None, None), used_k=None, max_k=None, pages=None):
    """The packed forward's launch, made ready: the knobs checked as ``attention`` checks them, on the
    shape of B sequences of the longest lengths (at least one query and one key; remembered per arrays'
    shapes, lengths and knobs, as ``attention``'s checks are), and the lengths uploaded. Returns
    ``launch(q, k, v, o=None, lse=None) -> (o, lse)``, which runs it on arrays of q, k, v's shapes,
    dtypes and device (the KV-cache plan makes it once and runs it per layer). ``cu``: the caller's
    cumulative lengths (``cq``, ``ck`` are their checked host copies), read in place where the kernels
    can. ``used_k``: checked host ints (B,), the keys each entry uses from the start of its range
    (flash_attn's seqused_k; attention_with_kvcache's lengths in a cache of fixed capacity per entry);
    None: all of them. ``max_k``: a bound on every entry's keys (a cache's capacity) that the checks
    take as the longest length in place of the longest ``used_k``, so that a decoding loop, whose lengths
    grow by one a step, finds its Problem remembered (without a window the longest length decides nothing
    else: the kernels take it only to size the dynamic tile walk's L2 sections; with a window it decides
    whether a side is unbounded, so there the longest itself is used). ``pages``: (block table (B',
    max_blocks), each entry's row of it (B,), page size) on the host, with ``used_k`` (the kernel reads
    every entry's count): k and v are a paged cache's pages as (pages x page size, Hkv, D), ``ck[e]``
    entry e's first key in its own sequence (a multiple of the page size where the entry has keys) and
    ``used_k`` its key count; the call's Problem must read them in place (the caller asks
    ``packed_problem`` first, ``reads_pages``)."""
    from . import _sinks
    from ._checks import check_alibi_slopes
    from ._launch import forward

    b = cq.size - 1
    p = packed_problem(q, k, v, cq, ck, causal=causal, scale=scale, block_m=block_m, block_n=block_n,
                       accum=accum, kernel=kernel, ablate=ablate, window_size=window_size, softcap=softcap,
                       alibi=alibi_slopes is not None, used_k=used_k, max_k=max_k,
                       page=0 if pages is None else pages[2])
    if pages is not None and used_k is None:
        raise ValueError("a paged cache's entries need used_k, their key counts")
    if pages is not None and not p.variant.paged:
        raise ValueError(f"{p.variant.key} does not read a paged cache of {pages[2]}-row pages in place")
    slopes = None if alibi_slopes is None else check_alibi_slopes(alibi_slopes, b, q.shape[1], q)
    sinks = None if sinks is None else _sinks.check(sinks, q.shape[1], q)
    given, hosts = tuple(cu), (cq, ck)
    if used_k is not None:
        given, hosts = given + (None,), hosts + (used_k,)
    if pages is not None:
        given, hosts = given + (None, None), hosts + (pages[0].reshape(-1), pages[1] * pages[0].shape[1])
    lengths = _device_lengths(given, hosts, p.device)

    def launch(q, k, v, o=None, lse=None):
        o, lse = forward(q, k, v, p, o=o, lse=lse, alibi=slopes, cu=lengths)
        return (o, lse) if sinks is None else _sinks.apply(o, lse, sinks, packed=True)

    return launch


def packed_problem(q, k, v, cq, ck, *, causal, scale=None, block_m=None, block_n=None, accum="fp32",
                   kernel="auto", ablate=None, window_size=(-1, -1), softcap=0.0, alibi=False, used_k=None,
                   max_k=None, page=0):
    """The Problem of ``_forward_packed``'s launch (its arguments), remembered per arrays' shapes and
    knobs (``_checks._memoized``)."""
    from ._checks import _knobs, _memoized

    nk = int(np.diff(ck).max()) if used_k is None else int(used_k.max())
    if max_k is not None and (window_size is None or tuple(window_size) == (-1, -1)):
        nk = max(min(int(max_k), 2**31 - 1), nk)  # (an int32 of the kernels)
    kw = dict(b=cq.size - 1, nq=int(np.diff(cq).max()), nk=nk, causal=causal, scale=scale,
              block_m=block_m, block_n=block_n, accum=accum, kernel=kernel, ablate=ablate,
              window_size=window_size, softcap=softcap, alibi=alibi, page=int(page))
    return _memoized(_packed_problem, (q, k, v), _knobs(kw), kw)


def _backward_packed(do, q, k, v, o, lse, cq, ck, *, causal, dlse=None, scale=None, block_m=None,
                     block_n=None, accum="fp32", kernel="auto", deterministic=False, window_size=(-1, -1),
                     softcap=0.0, alibi_slopes=None, sinks=None, grads=None, cu=(None, None)):
    """The backward of a packed batch on CuPy arrays by one launch of each backward kernel (the families'
    varlen variants), or None where the call's family has none: the caller then runs one call per
    sequence. Knobs as ``_forward_packed``; ``grads``: preallocated
    (dq, dk, dv), as ``_launch.backward`` takes them (the tests poison them)."""
    from . import _sinks
    from ._checks import _backend_of, _check_bool, _common_device, _knobs, _memoized, check_alibi_slopes
    from ._launch import backward

    _check_bool("deterministic", deterministic)
    # what attention_backward's checks say of do, o, lse and dlse (their shapes are the caller's)
    given = {"do": do, "o": o, "lse": lse, **({} if dlse is None else {"dlse": dlse})}
    for name, x in given.items():
        if _backend_of(name, x) != "cuda":
            raise TypeError(f"{name} must be a CuPy array like q")
        want = q.dtype if name in ("do", "o") else np.dtype(np.float32)
        if x.dtype != want:
            like = "q" if name in ("do", "o") else "the lse attention_varlen returns"
            raise TypeError(f"{name} must be {want} like {like}; got {x.dtype}")
    _common_device({"q": q, "k": k, "v": v, **given})
    b = cq.size - 1
    kw = dict(b=b, nq=int(np.diff(cq).max()), nk=int(np.diff(ck).max()), causal=causal, scale=scale,
              block_m=block_m, block_n=block_n, accum=accum, kernel=kernel, ablate=None,
              window_size=window_size, softcap=softcap, alibi=alibi_slopes is not None, direction="bwd")
    p = _memoized(_packed_problem, (q, k, v), _knobs(kw), kw)
    if not p.variant.varlen:
        return None
    slopes = None if alibi_slopes is None else check_alibi_slopes(alibi_slopes, b, q.shape[1], q)
    sinks = None if sinks is None else _sinks.check(sinks, q.shape[1], q)
    lengths = _device_lengths(tuple(cu), (cq, ck), p.device)
    grads = backward(do, q, k, v, o, lse, p, deterministic=bool(deterministic), grads=grads, dlse=dlse,
                     alibi=slopes, cu=lengths)
    if sinks is None:
        return grads
    # d sinks over every row (rows without keys too: lse = z, o = 0 there give dlse), on (1, Hq, total_q)
    # views of the packed rows
    def heads_first(x):
        return None if x is None else x.transpose(1, 0, 2)[None]

    return (*grads, _sinks.grad(heads_first(do), heads_first(o), lse[None], sinks,
                                None if dlse is None else dlse[None]))


def attention_varlen_backward(do: Array, q: Array, k: Array, v: Array, o: Array, lse: Array,
                              cu_seqlens_q: Array, cu_seqlens_k: Array, max_seqlen_q: int | None = None,
                              max_seqlen_k: int | None = None, *, causal: bool = False,
                              **knobs) -> tuple[Array, ...]:
    """The gradients (dq, dk, dv) of ``sum(do * attention_varlen(q, k, v, ...))``, in the packed layouts
    of q, k, v; ``o`` and ``lse`` ((Hq, total_q)) as ``attention_varlen(..., return_lse=True)`` returned
    them; ``knobs`` are ``attention_backward``'s (``dlse`` packed as lse, (Hq, total_q)). On CuPy arrays
    every family runs one launch of each backward kernel for the whole batch; NumPy inputs (the twin)
    and more than 65,535 sequences run one ``attention_backward`` call per sequence. Keys of a sequence
    with no queries get dk = dv = 0. With ``sinks``, d sinks (summed over the sequences) is a fourth
    output, as in ``attention_backward``."""
    import flashcupy

    dlse = knobs.pop("dlse", None)  # (Hq, total_q), as lse: cut per sequence like it
    _check_knob_names("attention_varlen_backward", knobs, _BACKWARD_KNOBS)
    _refuse_capture("attention_varlen_backward", q)
    cq, ck = _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_slopes(knobs, cq.size - 1, q.shape[1])
    for name, x, want in (("do", do, q.shape), ("o", o, q.shape), ("lse", lse, (q.shape[1], q.shape[0])),
                          ("dlse", lse if dlse is None else dlse, (q.shape[1], q.shape[0]))):
        if not hasattr(x, "shape"):
            raise TypeError(f"{name} must be an array of shape {tuple(want)}, got {type(x).__name__}")
        if tuple(x.shape) != tuple(want):
            raise ValueError(f"{name} must have shape {tuple(want)}, got {tuple(x.shape)}")
    xp = _xp(q)
    if xp is not np and np.diff(cq).max() > 0 and np.diff(ck).max() > 0 and cq.size - 1 <= _GRID_YZ_MAX:
        grads = _backward_packed(do, q, k, v, o, lse, cq, ck, causal=causal, dlse=dlse,
                                 cu=(cu_seqlens_q, cu_seqlens_k), **knobs)
        if grads is not None:
            return grads
    if not ((np.diff(cq) > 0) & (np.diff(ck) > 0)).any():  # (no call below checks the knobs)
        _check_knobs_once(q, k, v, cq.size - 1, causal, knobs, backward=True)
    dq, dk, dv = (xp.zeros(x.shape, dtype=x.dtype) for x in (q, k, v))
    dsinks = None if knobs.get("sinks") is None else xp.zeros(q.shape[1], dtype=xp.float32)
    for i in range(cq.size - 1):
        (qa, qb), (ka, kb) = cq[i:i + 2], ck[i:i + 2]
        if qb == qa or kb == ka:
            # rows that see no key have o = 0, so delta = -dlse: with sinks (lse = z there) the sink's
            # gradient gains sum(dlse) over those rows, and nothing without dlse
            if kb == ka and dsinks is not None and dlse is not None:
                dsinks += dlse[:, qa:qb].sum(axis=1, dtype=xp.float32)
            continue
        def rows(x):  # sequence i's columns of an (Hq, total_q) array, as (1, Hq, n)
            return None if x is None else xp.ascontiguousarray(x[None, :, qa:qb])

        grads = flashcupy.attention_backward(_view(do, qa, qb), _view(q, qa, qb), _view(k, ka, kb),
                                             _view(v, ka, kb), _view(o, qa, qb), rows(lse), causal=causal,
                                             dlse=rows(dlse), **_per_sequence(knobs, i))
        for total, g, (a, b) in ((dq, grads[0], (qa, qb)), (dk, grads[1], (ka, kb)),
                                 (dv, grads[2], (ka, kb))):
            total[a:b] = g[0].transpose(1, 0, 2)
        if dsinks is not None:
            dsinks += grads[3]
    return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)

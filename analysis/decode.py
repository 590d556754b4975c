"""``decode``: decoding steps of ``flashcupy.attention_with_kvcache`` (issue 36's speed bar): one query per
entry (Nq = 1) against a full KV cache, Hq 32, Hkv 8, D 128, fp16 and bf16, with a contiguous cache and
with paged caches of 64 and 256 tokens a page (the pages in random order: a shuffled block_table),
num_splits=0 (the policy's ranges), kernel='auto'.

Decoding is memory-bound: a step reads the whole cache once, B L Hkv D x 2 tensors x the element size
bytes of K and V. The measure is that number of bytes over the call's device time, as a fraction of the
card's copy bandwidth measured in the same run (a device-to-device copy of 1 GiB: bytes read and written
over its time). The device time is every kernel of one call, between two CUDA events, with the host
running ahead (20 back-to-back calls enqueued behind a GPU-holding kernel, the time divided by 20; median
of 5 rounds): for a paged cache it includes the gather of its pages. The host's time per call is
time.perf_counter around the same calls as they are enqueued (nothing synchronized before the end); the
step time is the wall time per call of a loop of calls synchronized only at the end of each round, what a
decoding loop costs when host and device overlap. The same call as a plan made once and run
(``flashcupy.plan_kvcache``, then ``plan.run``, which must give the call's bits): the plan's host time and
the run's host, step and device times; and a step of LAYERS layers as a model runs it (one plan, then a
run on each layer's own cache, copies of the case's at their own addresses), its times per layer. Where
the host's time goes: cProfile over the calls of the first dtype's first case, once a layout, the
functions of most own time.

Peers in the same run, when torch imports and sees the GPU: torch SDPA with each backend forced by
``torch.nn.attention.sdpa_kernel`` (flash, mem-efficient, cuDNN, math; GQA through enable_gqa=True, or by
repeating the K and V heads beforehand where a backend refuses it; a backend that refuses both is listed
with its reason), and FlexAttention compiled (``torch.compile(flex_attention)``, enable_gqa=True), each on
a contiguous (B, Hkv, L, D) copy of the same K and V (made outside the timing) and under
``torch.no_grad()``. Each peer's output is compared with flashcupy's on the same inputs (the memory shared
through DLPack); a peer farther from it than twice the accuracy rule's bound is reported as wrong and not
timed. flashcupy's outputs (every layout) are held to the float64 reference (``flashcupy.reference``) on
the first and last entry of each case by the accuracy rule (``flashcupy.accuracy.tolerance``).

On the NumPy backend the same decoding calls run through the twin on tiny caches (no timing, no peers):
the plumbing and the paged path's correctness against float64, not a speed.
"""
from __future__ import annotations

import time
import warnings

import numpy as np

import flashcupy
from flashcupy import naive, reference
from flashcupy.accuracy import tolerance
from flashcupy.inspect import numpy_dtype

from . import sdpa
from .bench import _device_us, _wall_us
from .common import Context, Report, Table, log, new_figure

HQ, HKV, D = 32, 8, 128
DTYPES = ("f16", "bf16")
FULL_CASES = [(1, 131072), (8, 32768), (32, 8192), (64, 4096)]   # (B, L): 131,072 cached tokens each
QUICK_CASES = [(1, 32768), (8, 4096)]                           # K and V: 64 or 16 MiB, past the L2 cache
TWIN_CASES = [(1, 1024), (4, 512)]                              # the NumPy backend: correctness only
PAGES = (None, 64, 256)                                         # contiguous, then tokens per page
CALLS, ROUNDS = 20, 5
LAYERS = 4                                                      # a step's layers: one plan, a run each
HOST_TOP = 12                                                   # functions in the host-time profile
COPY_BYTES = 2 ** 30
PEER_BACKENDS = {**sdpa.BACKENDS, "math": "MATH"}   # short name -> torch.nn.attention.SDPBackend member
FLEX = "torch flex (compiled)"


def _layout(page) -> str:
    return "contiguous" if page is None else f"paged {page}"


def _reason(e: BaseException, caught=()) -> str:
    """One line for a refusal: the exception and torch's first warning (SDPA says there why a backend
    declined), without the characters a Markdown table cell cannot hold."""
    text = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    if caught:
        text += f" ({str(caught[0].message).strip().splitlines()[0]})"
    return text.replace("|", "/")[:160]


# ---------------------------------------------------------------------------------------------------
# inputs


def _draw(ctx: Context, rng, shape, dname):
    """N(0, 1) in the dtype: drawn on the device when there is one (the full caches hold 2^27 values)."""
    dt = numpy_dtype(dname)
    if ctx.backend == "cuda":
        import cupy

        g = cupy.random.default_rng(int(rng.integers(2 ** 31)))
        try:
            return g.standard_normal(shape, dtype=cupy.float32).astype(dt)
        except Exception:  # a CuPy without device-side casts to this dtype: draw on the host
            pass
    return ctx.dev(rng.standard_normal(shape, dtype=np.float32).astype(dt))


def _bits(x):
    """A 16-bit array as its uint16 bits (copies and scatters need no arithmetic on bf16)."""
    return x.view(np.uint16)


def _paged(k, v, page: int, rng):
    """The contiguous (B, L, Hkv, D) cache as pages of ``page`` tokens in a shuffled order: (k pages,
    v pages, block_table int32 (B, L / page) as a NumPy array, read on the host without a sync)."""
    b, n = k.shape[:2]
    per = n // page
    order = rng.permutation(b * per)
    if isinstance(k, np.ndarray):
        xp, where = np, order
    else:
        import cupy as xp

        where = xp.asarray(order)
    pages = []
    for x in (k, v):
        p = xp.empty((b * per, page) + x.shape[2:], dtype=x.dtype)
        _bits(p)[where] = _bits(x).reshape((b * per, page) + x.shape[2:])   # page j of entry i: table[i, j]
        pages.append(p)
    return pages[0], pages[1], order.reshape(b, per).astype(np.int32)


def _host(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.get()


# ---------------------------------------------------------------------------------------------------
# float64 truth of the checked entries


def _truths(q, k, v, dname, entries):
    """Per checked entry: (entry, its float64 output (Hq, D), the rule's bound): the bound from the naive
    same-precision attention's error (computed on the backend's arrays) and the reference's magnitude."""
    out = []
    for i in entries:
        qb, kb, vb = (x[i].transpose(1, 0, 2)[None] for x in (q, k, v))   # (1, H, N, D)
        ref = reference.attention(_host(qb), _host(kb), _host(vb))[0, :, 0]
        nerr = float(np.abs(_host(naive.attention(qb, kb, vb))[0, :, 0].astype(np.float64) - ref).max())
        out.append((i, ref, tolerance(dname, "fp32", nerr, "fwd", float(np.abs(ref).max())), nerr))
    return out


def _against_truth(o, truths):
    """(max abs error, naive error, bound) at the entry with the largest error over its bound, and that
    ratio, for an output (B, Hq, D) in float64."""
    worst = None
    for i, ref, bound, nerr in truths:
        err = float(np.abs(o[i] - ref).max()) if np.isfinite(o[i]).all() else float("inf")
        if worst is None or err / bound > worst[3]:
            worst = (err, nerr, bound, err / bound)
    return worst


# ---------------------------------------------------------------------------------------------------
# timing (CUDA)


def _timed(ctx: Context, fn) -> dict:
    """Device and host time per call (us, medians of ROUNDS rounds of CALLS calls, ``bench._device_us``,
    the GPU held for twice the host's time per call as first measured) and the step time of a loop of
    calls (``bench._wall_us``); ``covered``: every round's calls were enqueued within the hold."""
    _, host0 = _device_us(fn, CALLS, host_us=True)
    hold_ms = max(0.3, 2e-3 * host0)
    runs = [_device_us(fn, CALLS, host_us=True, hold_ms_per_call=hold_ms) for _ in range(ROUNDS)]
    (step, _), = _wall_us(ctx, [fn], calls=CALLS, rounds=ROUNDS)
    return {"device_us": float(np.median([r[0] for r in runs])),
            "host_us": float(np.median([r[1] for r in runs])), "step_us": step,
            "covered": all(r[1] <= 1e3 * hold_ms for r in runs), "hold_ms_per_call": hold_ms}


def _host_profile(fn, calls: int = CALLS, top: int = HOST_TOP):
    """Where the host's time per call goes: cProfile over ``calls`` calls (after one more), the ``top``
    functions by their own time: [function (file:line), calls per call, own us per call, share of the
    profiled time], and the profiled time per call (us; the profiler's own cost inflates it, so the
    shares are the measure, not the sum)."""
    import cProfile
    import os
    import pstats

    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof)
    total = stats.total_tt
    ranked = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    rows = [[f"{name} ({os.path.basename(path)}:{line})", nc / calls, 1e6 * tt / calls, tt / total]
            for (path, line, name), (_, nc, tt, _, _) in ranked]
    return rows, 1e6 * total / calls


def _copy_bandwidth() -> dict:
    """The card's copy bandwidth: a device-to-device cudaMemcpyAsync of COPY_BYTES, (read + written
    bytes) / device time, median of ROUNDS rounds of 10 copies."""
    import cupy

    src = cupy.arange(COPY_BYTES // 4, dtype=cupy.int32)
    dst = cupy.empty_like(src)

    def copy():
        dst.data.copy_from_device_async(src.data, COPY_BYTES)

    us = float(np.median([_device_us(copy, 10) for _ in range(ROUNDS)]))
    assert bool((dst == src).all()), "the copy did not copy"
    return {"bytes": COPY_BYTES, "us": us, "tb_s": 2 * COPY_BYTES / us / 1e6}


# ---------------------------------------------------------------------------------------------------
# peers (CUDA, torch)


def _to_torch(torch, x):
    """A CuPy array as a torch tensor on the same memory (DLPack); bf16 through an int16 view where this
    CuPy's DLPack does not carry the dtype."""
    try:
        return torch.from_dlpack(x)
    except Exception:
        import cupy

        return torch.from_dlpack(x.view(cupy.int16)).view(
            torch.bfloat16 if x.dtype == numpy_dtype("bf16") else torch.float16)


def _from_torch(t) -> np.ndarray:
    """A torch output (B, Hq, 1, D) as float64 (B, Hq, D) on the host, through CuPy (DLPack; float32 first:
    exact for fp16 and bf16 values)."""
    import cupy

    return cupy.from_dlpack(t.float().contiguous())[:, :, 0].get().astype(np.float64)


def _first_call(torch, fn):
    """(output, seconds, None) of a first call, or (None, None, reason) where it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        try:
            out = fn()
            torch.cuda.synchronize()
        except Exception as e:
            return None, None, _reason(e, caught)
    return out, time.perf_counter() - t0, None


def _peer_calls(torch, tq, tk, tv):
    """(provider, GQA mode, fn or None, first output, first-call seconds, refusal reason) per peer: each
    SDPA backend with enable_gqa=True, else with the K and V heads repeated beforehand; FlexAttention
    compiled, enable_gqa=True. Each call is built inside its backend context and under no_grad."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = tq.shape[1] // tk.shape[1]
    sdpa_fn = torch.nn.functional.scaled_dot_product_attention
    repeated = None
    out = []
    for short, member in PEER_BACKENDS.items():
        backend = getattr(SDPBackend, member)

        def call(k, v, backend=backend, **kw):
            def fn():
                with torch.no_grad(), sdpa_kernel(backend):
                    return sdpa_fn(tq, k, v, **kw)
            return fn

        fn = call(tk, tv, enable_gqa=True)
        first, secs, why = _first_call(torch, fn)
        mode = "enable_gqa"
        if why is not None:
            if repeated is None:
                with torch.no_grad():
                    repeated = (tk.repeat_interleave(group, dim=1), tv.repeat_interleave(group, dim=1))
            fn = call(*repeated)
            first, secs, why2 = _first_call(torch, fn)
            mode = f"heads repeated (enable_gqa refused: {why})"
            if why2 is not None:
                out.append((f"torch {short}", "-", None, None, None,
                            f"enable_gqa: {why}; repeated heads: {why2}"))
                continue
        out.append((f"torch {short}", mode, fn, first, secs, None))
    try:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.reset()   # a fresh compile per case (each shape recompiles; the cache is limited)
        flex = torch.compile(flex_attention)

        def fn():
            with torch.no_grad():
                return flex(tq, tk, tv, enable_gqa=True)
        first, secs, why = _first_call(torch, fn)
    except Exception as e:  # no flex_attention in this torch
        fn, first, secs, why = None, None, None, _reason(e)
    out.append((FLEX, "enable_gqa", fn if why is None else None, first, secs, why))
    return out


def _peers(ctx: Context, torch, q, k, v, o_fc, truths, kv_bytes, copy_tb_s):
    """Rows per peer: provider, GQA mode, status, max |peer - flashcupy|, agreement bound, the peer's
    error over the rule's bound on the checked entries, first call s, device us, host us, step us, TB/s,
    fraction of the copy bandwidth."""
    import cupy

    tq, tk, tv = (_to_torch(torch, cupy.ascontiguousarray(_bits(x).transpose(0, 2, 1, 3)).view(x.dtype))
                  for x in (q, k, v))   # (B, Hq, 1, D) and (B, Hkv, L, D)
    agree = 2 * max(t[2] for t in truths)
    rows = []
    for prov, mode, fn, first, secs, why in _peer_calls(torch, tq, tk, tv):
        if fn is None:
            rows.append([prov, mode, f"refused: {why}"] + [None] * 9)
            continue
        got = _from_torch(first)
        diff = float(np.abs(got - o_fc).max()) if np.isfinite(got).all() else float("inf")
        rel = _against_truth(got, truths)[3]
        if not diff <= agree:
            rows.append([prov, mode, "wrong: not timed", diff, agree, rel, secs] + [None] * 5)
            log(f"[decode]   {prov}: WRONG, max |peer - flashcupy| = {diff:.3e} > {agree:.3e}")
            continue
        t = _timed(ctx, fn)
        tb_s = kv_bytes / t["device_us"] / 1e6
        rows.append([prov, mode, "ok" if t["covered"] else "ok (hold short of the enqueue)", diff, agree, rel,
                     secs, t["device_us"], t["host_us"], t["step_us"], tb_s, tb_s / copy_tb_s])
        log(f"[decode]   {prov}: {t['device_us']:.1f} us device, {t['host_us']:.1f} us host, "
            f"{tb_s / copy_tb_s:.2f} of copy bandwidth")
    del tq, tk, tv
    torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------------
# the run


def _case(ctx: Context, dname, b, n, torch, copy, acc_rows, fc_rows, peer_rows, host_rows=None):
    rng = ctx.rng(f"decode.{dname}.{b}.{n}")
    q = _draw(ctx, rng, (b, 1, HQ, D), dname)
    k, v = _draw(ctx, rng, (b, n, HKV, D), dname), _draw(ctx, rng, (b, n, HKV, D), dname)
    lengths = np.full(b, n, dtype=np.int32)
    kv_bytes = b * n * HKV * D * 2 * k.dtype.itemsize
    cuda = ctx.backend == "cuda"
    entries = sorted({0, b - 1}) if cuda else list(range(b))
    truths = _truths(q, k, v, dname, entries)
    outs = {}
    for page in PAGES:
        kc, vc, table = (k, v, None) if page is None else _paged(k, v, page, rng)

        def fn(kc=kc, vc=vc, table=table):
            return flashcupy.attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, block_table=table,
                                                    causal=True, num_splits=0)

        t0 = time.perf_counter()
        o = fn()
        ctx.sync()
        first = time.perf_counter() - t0
        o = _host(o)[:, 0].astype(np.float64)        # (B, Hq, D)
        outs[page] = o
        err, nerr, bound, rel = _against_truth(o, truths)
        same = float(np.abs(o - outs[None]).max())
        acc_rows.append([dname, b, n, _layout(page), len(entries), err, nerr, bound, rel, rel <= 1.0, same])
        log(f"[decode] {dname} B={b} L={n} {_layout(page)}: error {err:.2e} ({rel:.2f} of the rule's bound)"
            + (f", first call {first:.2f} s" if cuda else ""))
        # the same call as a plan made once and run (one layer of a decoding step): the call's bits
        def make(kc=kc, vc=vc, table=table):
            return flashcupy.plan_kvcache(q, kc, vc, cache_seqlens=lengths, block_table=table, causal=True,
                                          num_splits=0)

        plan = make()

        def run(kc=kc, vc=vc, plan=plan):
            return plan.run(q, kc, vc)

        same_run = bool((_bits(_host(run())) == _bits(_host(fn()))).all())
        assert same_run, f"plan.run differs from the call ({dname}, B={b}, L={n}, {_layout(page)})"
        # a step of LAYERS layers as a model runs it: one plan, then a run on each layer's own cache (copies
        # of this one, at their own addresses: each layer's K and V maps are its own)
        layers = [(kc, vc)] + [(kc.copy(), vc.copy()) for _ in range(LAYERS - 1)]

        def step(layers=layers, make=make):
            plan = make()
            return [plan.run(q, lk, lv) for lk, lv in layers]

        same_step = all(bool((_bits(_host(x)) == _bits(_host(o_run))).all())
                        for x, o_run in zip(step(), [run()] * LAYERS))
        assert same_step, f"a step's runs differ from the call ({dname}, B={b}, L={n}, {_layout(page)})"
        if cuda:
            t = _timed(ctx, fn)
            tr = _timed(ctx, run)
            tp = _device_us(make, CALLS, host_us=True)[1]
            ts = {key: x / LAYERS for key, x in _timed(ctx, step).items()
                  if key in ("device_us", "host_us", "step_us")}
            tb_s = kv_bytes / t["device_us"] / 1e6
            fc_rows.append({"dtype": dname, "B": b, "L": n, "layout": _layout(page), "kv_bytes": kv_bytes,
                            "first_call_s": first, "tb_s": tb_s, "fraction": tb_s / copy["tb_s"], **t,
                            "run": tr, "plan_host_us": tp, "layer": ts})
            log(f"[decode]   flashcupy: {t['device_us']:.1f} us device, {t['host_us']:.1f} us host, "
                f"{t['step_us']:.1f} us a step, {tb_s / copy['tb_s']:.2f} of copy bandwidth; a plan's run "
                f"{tr['host_us']:.1f} us host, {tr['step_us']:.1f} us a step (the plan {tp:.1f} us); a step "
                f"of {LAYERS} layers {ts['host_us']:.1f} us host a layer, {ts['device_us']:.1f} us device")
            if host_rows is not None:
                prof, per_call = _host_profile(fn)
                host_rows += [[dname, b, n, _layout(page), per_call, *r] for r in prof]
        del fn, run, step, make, plan, layers, kc, vc   # (a paged cache is freed before the next is built)
    if cuda and torch is not None:
        for r in _peers(ctx, torch, q, k, v, outs[None], truths, kv_bytes, copy["tb_s"]):
            peer_rows.append([dname, b, n, *r])


def _fc_table(fc_rows, peer_rows):
    """flashcupy's rows with the best peer of their case (the fastest that agreed) and the paged /
    contiguous time."""
    rows = []
    for r in fc_rows:
        ok = [p for p in peer_rows if tuple(p[:3]) == (r["dtype"], r["B"], r["L"]) and p[10] is not None]
        best = min(ok, key=lambda p: p[10]) if ok else None
        contiguous = next(c for c in fc_rows if (c["dtype"], c["B"], c["L"], c["layout"])
                          == (r["dtype"], r["B"], r["L"], "contiguous"))
        rows.append([r["dtype"], r["B"], r["L"], r["layout"], r["kv_bytes"] / 2 ** 20, r["device_us"],
                     r["host_us"], r["step_us"], r["tb_s"], r["fraction"], best and best[3],
                     best and best[10], best and r["device_us"] / best[10],
                     r["device_us"] / contiguous["device_us"], r["covered"], r["plan_host_us"],
                     r["run"]["host_us"], r["run"]["step_us"], r["run"]["device_us"], r["layer"]["host_us"],
                     r["layer"]["step_us"], r["layer"]["device_us"]])
    return rows


FC_COLUMNS = ["dtype", "B", "L", "layout", "K+V MiB", "device us", "host us", "step us", "TB/s",
              "fraction of copy bandwidth", "best peer", "best peer device us",
              "flashcupy / best peer (time)", "layout / contiguous (time)", "hold covered the enqueue",
              "plan host us", "plan.run host us", "plan.run step us", "plan.run device us",
              f"step of {LAYERS} layers: host us a layer", f"step of {LAYERS} layers: step us a layer",
              f"step of {LAYERS} layers: device us a layer"]
PEER_COLUMNS = ["dtype", "B", "L", "provider", "GQA", "status", "max abs difference from flashcupy",
                "agreement bound", "peer error / rule bound (float64)", "first call s", "device us",
                "host us", "step us", "TB/s", "fraction of copy bandwidth"]
HOST_COLUMNS = ["dtype", "B", "L", "layout", "profiled us per call", "function", "calls per call",
                "own us per call", "share of the profiled time"]
ACC_COLUMNS = ["dtype", "B", "L", "layout", "entries checked", "max abs error", "naive max abs error",
               "rule bound", "error / bound", "within the rule",
               "max abs difference from the contiguous o"]


def _span(xs, f="{:.2f}") -> str:
    lo, hi = min(xs), max(xs)
    return f.format(lo) if f.format(lo) == f.format(hi) else f"{f.format(lo)}-{f.format(hi)}"


def _finding(ctx, card, copy, acc_rows, fc_table, peer_rows, torch_note) -> str:
    held = sum(r[9] for r in acc_rows)
    rule = f"flashcupy's outputs held the float64 rule in {held} of {len(acc_rows)} checks"
    if ctx.backend != "cuda":
        same = all(r[10] == 0 for r in acc_rows)
        return (f"The NumPy twin's decoding path (contiguous and paged caches of 64 and 256 tokens, pages "
                f"shuffled) held the accuracy rule in {held} of {len(acc_rows)} cases (worst "
                f"{max(r[8] for r in acc_rows):.2f} of the bound); paged outputs "
                f"{'equal' if same else 'differ from'} the contiguous ones bit for bit; the timing and the "
                "peers run on the CUDA backend only.")
    cont = [r for r in fc_table if r[3] == "contiguous"]
    text = (f"On {card} (copy bandwidth {copy['tb_s']:.2f} TB/s) decoding with a contiguous cache reads K "
            f"and V at {_span([r[9] for r in cont], '{:.0%}')} of the copy bandwidth "
            f"({_span([r[5] for r in cont], '{:.0f}')} us of kernels a step)")
    ratios = [r[12] for r in cont if r[12] is not None]
    if ratios:
        best = sorted({r[10] for r in cont if r[10]})
        text += f", {_span(ratios)}x the best peer's time ({', '.join(best)})"
    else:
        text += f"; no peer ran ({torch_note})"
    wrong = [p for p in peer_rows if p[5].startswith("wrong")]
    if wrong:
        text += f"; {len(wrong)} peer calls disagreed with flashcupy and were not timed"
    for page in PAGES[1:]:
        pr = [r[13] for r in fc_table if r[3] == _layout(page)]
        text += f"; pages of {page} take {_span(pr)}x the contiguous time"
    host_bound = sum(r[6] > r[5] for r in fc_table)
    text += (f"; the host's time per call ({_span([r[6] for r in fc_table], '{:.0f}')} us) exceeds the "
             f"device's in {host_bound} of {len(fc_table)} rows, a plan's run (one layer of a step, "
             f"`plan_kvcache`) takes {_span([r[16] for r in fc_table], '{:.0f}')} us of host time, in "
             f"{sum(r[16] > r[18] for r in fc_table)} rows more than its device time, a step of {LAYERS} "
             f"layers (one plan, a run on each layer's cache) {_span([r[19] for r in fc_table], '{:.0f}')} "
             f"us a layer; {rule}.")
    return text


def _figure(ctx, card, copy, acc_rows, fc_table, peer_rows):
    dtypes = [d for d in DTYPES if any(r[0] == d for r in acc_rows)]
    fig, axes = new_figure(ncols=len(dtypes), width=7.0)
    for ax, dname in zip(axes, dtypes):
        if ctx.backend == "cuda":
            cases = sorted({(r[1], r[2]) for r in fc_table if r[0] == dname})
            provs = [("flashcupy " + _layout(p), lambda c, p=p: next(
                (r[9] for r in fc_table if (r[0], r[1], r[2], r[3]) == (dname, *c, _layout(p))), np.nan))
                for p in PAGES]
            names = sorted({p[3] for p in peer_rows if p[0] == dname and p[14] is not None})
            provs += [(name, lambda c, name=name: next(
                (p[14] for p in peer_rows if (p[0], p[1], p[2], p[3]) == (dname, *c, name) and p[14]),
                np.nan)) for name in names]
            ylabel, line, line_label = ("(K + V bytes / device time) / copy bandwidth", 1.0,
                                        f"copy bandwidth ({copy['tb_s']:.2f} TB/s)")
        else:
            cases = sorted({(r[1], r[2]) for r in acc_rows if r[0] == dname})
            provs = [("twin " + _layout(p), lambda c, p=p: next(
                r[8] for r in acc_rows if (r[0], r[1], r[2], r[3]) == (dname, *c, _layout(p))))
                for p in PAGES]
            ylabel, line, line_label = "max error / the accuracy rule's bound", 1.0, "the rule's bound"
        x = np.arange(len(cases))
        width = 0.8 / len(provs)
        for i, (name, value) in enumerate(provs):
            ax.bar(x + (i - (len(provs) - 1) / 2) * width, [value(c) for c in cases], width, label=name)
        ax.axhline(line, color="k", lw=1, ls="--", label=line_label)
        ax.set_xticks(x, [f"B={b}\nL={n}" for b, n in cases], fontsize=8)
        ax.set_xlabel("batch entries x cached tokens")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{dname}, Hq {HQ}, Hkv {HKV}, D {D}", fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()  # (one legend for both panels, below them)
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=8, frameon=False)
    if ctx.backend == "cuda":
        cont = [r[9] for r in fc_table if r[3] == "contiguous"]
        ratios = [r[12] for r in fc_table if r[3] == "contiguous" and r[12] is not None]
        title = (f"{card}: flashcupy decodes at {_span(cont, '{:.0%}')} of the copy bandwidth "
                 "(contiguous cache)"
                 + (f", {_span(ratios)}x the best peer's time" if ratios else ", no peer ran"))
    else:
        title = "NumPy twin: the decoding paths within the accuracy rule (no timing on this backend)"
    fig.suptitle(title, fontsize=10)
    rows = -(-len(labels) // min(len(labels), 5))
    fig.tight_layout(rect=(0, 0.05 + 0.045 * rows, 1, 1))
    return fig


def run_decode(ctx: Context) -> Report:
    cuda = ctx.backend == "cuda"
    cases = ctx.sizes(QUICK_CASES, FULL_CASES) if cuda else TWIN_CASES
    card = ctx.device_name().split(" (")[0]
    torch, torch_note = None, "the CUDA backend only"
    if cuda:
        try:
            torch = sdpa.load_torch()
            torch_note = f"torch {torch.__version__}"
        except Exception as e:
            torch_note = f"torch not usable: {_reason(e)}"
    copy = _copy_bandwidth() if cuda else None
    if copy:
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()   # the copy's 2 GiB
        log(f"[decode] copy bandwidth {copy['tb_s']:.2f} TB/s ({card})")
    acc_rows, fc_rows, peer_rows, host_rows = [], [], [], []
    for dname in DTYPES:
        for b, n in cases:
            # (the host's profile once a layout: the first dtype's first case)
            profile = host_rows if cuda and dname == DTYPES[0] and (b, n) == cases[0] else None
            _case(ctx, dname, b, n, torch, copy, acc_rows, fc_rows, peer_rows, profile)
            if cuda:   # the case's caches back to the device
                import cupy

                cupy.get_default_memory_pool().free_all_blocks()
    fc_table = _fc_table(fc_rows, peer_rows) if cuda else []
    finding = _finding(ctx, card, copy, acc_rows, fc_table, peer_rows, torch_note)
    tables = []
    if cuda:
        tables.append(Table(f"Copy bandwidth of the card ({card}): device-to-device cudaMemcpyAsync, "
                            f"read + written bytes / device time, median of {ROUNDS} rounds of 10 copies",
                            ["bytes copied", "device us", "TB/s"],
                            [[copy["bytes"], copy["us"], copy["tb_s"]]]))
        tables.append(Table("flashcupy decoding steps: device time of every kernel of one call (median of "
                            f"{ROUNDS} rounds of {CALLS} calls enqueued ahead), host time per call, step "
                            "time of a loop; TB/s = K + V bytes / device time", FC_COLUMNS, fc_table))
        if peer_rows:
            tables.append(Table("Peers on a contiguous (B, Hkv, L, D) copy of the same K and V, same run",
                                PEER_COLUMNS, peer_rows))
        if host_rows:
            tables.append(Table(f"Host time of one flashcupy call by function (cProfile over {CALLS} calls, "
                                f"the {HOST_TOP} functions of most own time per layout; the profiler "
                                "inflates the times, the shares are the measure)", HOST_COLUMNS, host_rows))
    tables.append(Table("Accuracy against float64 (flashcupy.reference) of the checked entries "
                        + ("(first and last)" if cuda else "(all; the NumPy twin)"), ACC_COLUMNS, acc_rows))
    setup = {"shapes": f"Nq = 1, Hq = {HQ}, Hkv = {HKV}, D = {D}; (B, L) in {cases}; dtypes {list(DTYPES)}; "
                       "q, K, V ~ N(0, 1) rounded to the dtype",
             "call": "flashcupy.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=L (int32, NumPy: "
                     "read on the host without a sync), block_table=None or the shuffled page table (NumPy), "
                     "causal=True, num_splits=0), kernel='auto'",
             "layouts": "contiguous (B, L, Hkv, D); paged (B L / page, page, Hkv, D) with pages of 64 and "
                        "256 tokens, the pages of all entries in one random order",
             "accuracy": "the accuracy rule (flashcupy.accuracy.tolerance, fp32 accumulators) against "
                         "flashcupy.reference on the " + ("first and last entry" if cuda else "entries")}
    if cuda:
        setup["timing"] = (f"bench._device_us: {CALLS} back-to-back calls behind a GPU-holding kernel of "
                           "twice the host's time per call, between CUDA events, median of "
                           f"{ROUNDS} rounds (device us); time.perf_counter around the enqueue of the same "
                           f"calls (host us); bench._wall_us: {ROUNDS} rounds of {CALLS} calls synchronized "
                           "per round (step us)")
        setup["bytes"] = "B L Hkv D x 2 (K and V) x the element size, read once a step"
        setup["peers"] = (f"{torch_note}; torch SDPA backends {list(PEER_BACKENDS)} forced by sdpa_kernel, "
                          "and FlexAttention compiled, under no_grad; agreement: max |peer - flashcupy| <= "
                          "twice the rule's bound" if torch is not None else torch_note)
    notes = [__doc__.split("\n\n")[1].replace("\n", " "),
             "A peer reads a contiguous (B, Hkv, L, D) cache (its own layout); flashcupy's paged rows "
             "compare the paged call's time with the peers' contiguous one."]
    if cuda and torch is None:
        notes.append(f"No peer ran: {torch_note}.")
    data = {"copy": copy, "flashcupy": fc_rows, "cases": cases, "torch": torch_note}
    return Report("decode", "Decoding against a KV cache: bandwidth, host time and peers", finding, setup,
                  tables, data=data, notes=notes,
                  figure=_figure(ctx, card, copy, acc_rows, fc_table, peer_rows),
                  figure_caption=(f"{card}: K + V bytes read per step over the device time of a call, as a "
                                  "fraction of the copy bandwidth measured in the same run, per case and "
                                  "provider (peers on a contiguous cache)." if cuda else
                                  f"{card}: the twin's error over the accuracy rule's bound per case and "
                                  "layout (no timing on the NumPy backend)."))

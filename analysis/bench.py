"""``bench``: forward and backward speed of flashcupy against naive attention and torch SDPA, measured in
one process on the same inputs, reported as TFLOP/s and as ratios flashcupy / peer.

FLOPs: forward 4 B H N^2 D (halved when causal), backward 2.5x the forward. Time: CUDA events around
each call, after a warm-up call (compilation excluded; the compile time is measured on its own, once
through NVRTC without any cache and once as the first call), median of repeated calls, cycling through
enough input sets to exceed the L2 cache. Before each timed call a one-thread kernel holds the GPU for
2 ms, so that the host has enqueued the whole call before the start event fires: the events measure
device time, not Python, CuPy or torch dispatch (nvbench's blocking-kernel method). torch SDPA runs on
the CuPy arrays through DLPack (zero copy) with one backend forced by ``torch.nn.attention.sdpa_kernel``;
its backward is ``torch.autograd.grad`` of the same call. On the NumPy backend a tiny configuration runs
through the same code with wall-clock timing: the plumbing is real, the numbers mean nothing.
"""
from __future__ import annotations

import functools
import math
import time

import numpy as np

import flashcupy
from flashcupy import naive
from flashcupy.inspect import (
    FAMILIES,
    WGMMA_HEAD_DIMS,
    CompileError,
    Variant,
    compile_report,
    default_blocks,
    launch_roles,
    numpy_dtype,
)

from . import sdpa
from .common import Context, Report, Table, git_commit, log, new_figure

SIMT_MAX_N = 4096   # the scalar family is a readable reference, not a fast path: capped to fit the budget


def flops(b, h, n, d, causal, direction):
    f = 4.0 * b * h * n * n * d / (2 if causal else 1)
    return f * (2.5 if direction == "bwd" else 1.0)


def full_grid():
    """fp16 and bf16 at N 1024 / 4096 / 16384, D 64 and 128, causal or not; plus fp16 D=256 at N 4096 and
    16384 (the widest head dim of the mma and wgmma families)."""
    return ([(dname, n, d, causal) for dname in ("f16", "bf16") for n in (1024, 4096, 16384)
             for d in (64, 128) for causal in (False, True)]
            + [("f16", n, 256, causal) for n in (4096, 16384) for causal in (False, True)])


def tiny_grid():
    return [("f16", 128, 64, causal) for causal in (False, True)]


# ---------------------------------------------------------------------------------------------------
# timing


# The events time the device, not the host: before each timed call a one-thread kernel holds the GPU
# for HOLD_MS while the host records the start event and enqueues the call behind it (nvbench's
# "blocking kernel" idea). Without it, a call whose host-side work (argument checks, allocations,
# torch's dispatch and autograd) outlasts its kernels is timed as host time: the GPU idles between
# the start event and the first kernel. HOLD_MS must exceed the host time of one call.
HOLD_MS = 2.0


@functools.lru_cache(maxsize=None)
def _hold_kernel():
    import cupy

    return cupy.RawKernel(r"""
extern "C" __global__ void hold_gpu(const long long ns) {
    long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}""", "hold_gpu")


def _hold_gpu(ms: float) -> None:
    import cupy

    _hold_kernel()((1,), (1,), (cupy.int64(int(ms * 1e6)),))


class Timer:
    def __init__(self, ctx: Context, budget_s: float, min_reps: int, max_reps: int):
        self.ctx, self.budget_s, self.min_reps, self.max_reps = ctx, budget_s, min_reps, max_reps

    def first_call(self, fn, arg) -> float:
        t0 = time.perf_counter()
        fn(arg)
        self.ctx.sync()
        return time.perf_counter() - t0

    def median_ms(self, fn, sets) -> tuple[float, int]:
        if self.ctx.backend == "cuda":
            import cupy

            def once(arg):
                a, b = cupy.cuda.Event(), cupy.cuda.Event()
                _hold_gpu(HOLD_MS)
                a.record()
                fn(arg)
                b.record()
                b.synchronize()
                return cupy.cuda.get_elapsed_time(a, b)
        else:
            def once(arg):
                t0 = time.perf_counter()
                fn(arg)
                return (time.perf_counter() - t0) * 1e3
        fn(sets[0])  # warm-up
        self.ctx.sync()
        est = once(sets[-1])
        reps = int(min(self.max_reps, max(self.min_reps, self.budget_s * 1e3 / max(est, 1e-3))))
        times = [once(sets[i % len(sets)]) for i in range(reps)]
        return float(np.median(times)), reps


# ---------------------------------------------------------------------------------------------------
# measuring: one cell's inputs, and every provider's result on them


def _random_set(ctx, rng, shape, dname):
    """q, k, v, dO ~ N(0,1): drawn on the device when there is one (host generation of the largest
    cells would take longer than timing them)."""
    dt = numpy_dtype(dname)
    if ctx.backend == "cuda":
        import cupy

        g = cupy.random.default_rng(int(rng.integers(2 ** 31)))
        try:
            return tuple(g.standard_normal(shape, dtype=cupy.float32).astype(dt) for _ in range(4))
        except Exception:  # a CuPy without device-side casts to this dtype: draw on the host
            pass
    return ctx.dev(*(rng.standard_normal(shape, dtype=np.float32).astype(dt) for _ in range(4)))


def _fits_naive(ctx, b, h, n, arrays: int) -> bool:
    need = arrays * b * h * n * n * 4
    if ctx.backend != "cuda":
        return need < 2 ** 31
    import cupy

    free = cupy.cuda.runtime.memGetInfo()[0] + cupy.get_default_memory_pool().free_bytes()
    return need < 0.8 * free


class _Cell:
    """One (dtype, N, D, causal) cell: its input sets (q, k, v, dO; enough of them to exceed twice the
    L2 cache, at most 4) and ``res[(provider, direction)]``: {ms, tflops, reps, first_call_s} or {error}."""

    def __init__(self, ctx: Context, timer: Timer, cell, b: int, h: int, l2: int):
        self.ctx, self.timer, self.b, self.h = ctx, timer, b, h
        self.dname, self.n, self.d, self.causal = cell
        rng = ctx.rng(f"bench.{self.dname}.{self.n}.{self.d}")
        nsets = int(min(4, max(1, math.ceil(2 * l2 / (4 * b * h * self.n * self.d * 2)))))
        self.sets = [_random_set(ctx, rng, (b, h, self.n, self.d), self.dname) for _ in range(nsets)]
        self.res = {}

    def timed(self, fn, inputs, direction) -> dict:
        first = self.timer.first_call(fn, inputs[0])
        ms, reps = self.timer.median_ms(fn, inputs)
        fl = flops(self.b, self.h, self.n, self.d, self.causal, direction)
        return {"ms": ms, "tflops": fl / (ms * 1e-3) / 1e12, "reps": reps, "first_call_s": first}

    def measure(self, provider, direction, fn, inputs=None):
        """Time ``fn`` over ``inputs`` (default: the cell's sets); running out of memory, and any
        failure of a torch provider, is recorded as the result."""
        try:
            self.res[(provider, direction)] = self.timed(fn, self.sets if inputs is None else inputs,
                                                         direction)
        except Exception as e:
            if self.ctx.backend == "cuda":
                import cupy

                if isinstance(e, cupy.cuda.memory.OutOfMemoryError):
                    self.res[(provider, direction)] = {"error": "out of memory"}
                    return
            if provider.startswith("torch"):
                self.res[(provider, direction)] = {"error": f"{type(e).__name__}: {str(e)[:100]}"}
                return
            raise


def _measure_flashcupy(c: _Cell, compile_rows: dict) -> None:
    """Each forward family that applies to the dtype, and its backward (mma: both dQ paths)."""
    causal = c.causal
    for fam_name in ("fwd_wgmma", "fwd_mma", "fwd_simt"):
        fam = FAMILIES[fam_name]
        if c.dname not in fam.dtypes or (fam.kind == "simt" and c.n > SIMT_MAX_N):
            continue
        if fam.kind == "wgmma" and not _wgmma_runs(c):
            continue
        kernel = fam.kind
        prov = f"flashcupy {kernel}"
        c.measure(prov, "fwd", lambda s, kernel=kernel: flashcupy.attention(s[0], s[1], s[2], causal=causal,
                                                                             kernel=kernel))
        if fam.kind == "wgmma" and c.d in FP8_HEAD_DIMS:
            _measure_fp8(c)
        _note_compile(compile_rows, prov, "fwd", c, _variant_report(fam_name, c.dname, "fp32", c.d, causal),
                      False)
        if f"bwd_{kernel}" not in FAMILIES:
            continue
        outs = [flashcupy.attention(s[0], s[1], s[2], causal=causal, kernel=kernel, return_lse=True)
                for s in c.sets]
        bsets = [(*s, *o) for s, o in zip(c.sets, outs)]
        for name, det in [(prov, False)] + ([(f"{prov} det", True)] if kernel in ("mma", "wgmma") else []):
            def bwd(s, kernel=kernel, det=det):
                return flashcupy.attention_backward(s[3], s[0], s[1], s[2], s[4], s[5], causal=causal,
                                                    kernel=kernel, deterministic=det)
            try:
                c.res[(name, "bwd")] = c.timed(bwd, bsets, "bwd")
            except ValueError as e:
                c.res[(name, "bwd")] = {"error": str(e)[:100]}
            _note_compile(compile_rows, name, "bwd", c,
                          _variant_report(f"bwd_{kernel}", c.dname, "fp32", c.d, causal), det)
        del outs, bsets


def _note_compile(compile_rows, prov, direction, c, vr, det):
    """One compile-report row per provider, direction, dtype, D, mask and set of kernels launched (the
    wgmma backward's atomic path launches its rotated twin up to some lengths), with the lengths N it
    covers."""
    v = vr[0]
    roles = launch_roles(v, det, c.n) if v is not None else ()
    row = compile_rows.setdefault((prov, direction, c.dname, c.d, c.causal, roles), (vr, det, []))
    row[2].append(c.n)


FP8_HEAD_DIMS = (128, 256)   # the fp8 wgmma forward's head dims (two-level accumulation at D=128 only)
FP8_PROVIDERS = {"flashcupy wgmma fp8": "single", "flashcupy wgmma fp8 2lvl": "tile"}


def _measure_fp8(c: _Cell) -> None:
    """The fp8 (e4m3) wgmma forward on the cell's inputs quantized per tensor (outside the timing), output
    in the cell's dtype: single-level accumulation (the default) and two-level ("2lvl")."""
    from flashcupy import fp8

    out = {"f16": "float16", "bf16": "bfloat16"}[c.dname]
    qsets = [tuple(fp8.quantize(x, "e4m3", "tensor") for x in s[:3]) for s in c.sets]
    for prov, acc in FP8_PROVIDERS.items():
        if acc == "tile" and c.d != 128:
            c.res[(prov, "fwd")] = {"error": "two-level accumulation runs at D=128 only"}
            continue
        c.measure(prov, "fwd", lambda s, acc=acc: fp8.attention_fp8(*s, causal=c.causal, accumulation=acc,
                                                                    out_dtype=out), qsets)
    del qsets


def _wgmma_runs(c: _Cell) -> bool:
    """The wgmma family has this cell's variant and the device is a Hopper GPU."""
    if c.ctx.backend != "cuda" or c.d not in WGMMA_HEAD_DIMS:
        return False
    import cupy

    return int(cupy.cuda.Device().compute_capability) == 90


def _measure_naive(c: _Cell) -> None:
    """Naive attention (flashcupy.naive) where its 4 (fwd) / 6 (bwd) fp32 N x N matrices fit."""
    if _fits_naive(c.ctx, c.b, c.h, c.n, 4):
        c.measure("naive", "fwd", lambda s: naive.attention(s[0], s[1], s[2], causal=c.causal))
    else:
        c.res[("naive", "fwd")] = {"error": "does not fit in memory"}
    if _fits_naive(c.ctx, c.b, c.h, c.n, 6):
        c.measure("naive", "bwd", lambda s: naive.attention_backward(s[3], s[0], s[1], s[2], causal=c.causal))
    else:
        c.res[("naive", "bwd")] = {"error": "does not fit in memory"}


def _measure_sdpa(c: _Cell, torch) -> None:
    """Each torch SDPA backend on the same memory (DLPack); its backward only where its forward ran."""
    tsets = [sdpa.to_torch(torch, s) for s in c.sets]
    for short in sdpa.BACKENDS:
        prov, peer = f"torch {short}", sdpa.Sdpa(torch, short, c.causal)
        c.measure(prov, "fwd", lambda s, peer=peer: peer.forward(s[0], s[1], s[2]), tsets)
        if "error" in c.res[(prov, "fwd")]:
            c.res[(prov, "bwd")] = {"error": "forward failed"}
            continue
        gsets = [peer.graph(*s) for s in tsets]
        c.measure(prov, "bwd", peer.backward, gsets)
        del gsets


def _measure(ctx: Context, cells, b: int, h: int, torch) -> tuple[list, dict]:
    """(raw, compile_rows): a row per cell and direction holding every provider's result, and the
    compile report of each flashcupy variant run, keyed by (provider, direction, dtype, D, causal)."""
    cuda = ctx.backend == "cuda"
    timer = Timer(ctx, budget_s=0.3 if cuda else 0.05, min_reps=5 if cuda else 2, max_reps=50 if cuda else 3)
    l2 = 50 * 2 ** 20
    if cuda:
        import cupy

        l2 = cupy.cuda.Device().attributes.get("L2CacheSize", l2)
    raw, compile_rows = [], {}
    for ci, cell in enumerate(cells):
        c = _Cell(ctx, timer, cell, b, h, l2)
        _measure_flashcupy(c, compile_rows)
        _measure_naive(c)
        if torch is not None:
            _measure_sdpa(c, torch)
        providers = sorted({p for p, _ in c.res}, key=lambda p: (not p.startswith("flashcupy"), p))
        for direction in ("fwd", "bwd"):
            row = {"dtype": c.dname, "N": c.n, "D": c.d, "causal": c.causal, "direction": direction}
            for p in providers:
                row[p] = c.res.get((p, direction), {})
            raw.append(row)
        unit, key, fmt_ = ("TFLOP/s", "tflops", ".1f") if cuda else ("ms (NumPy wall clock)", "ms", ".3g")
        log(f"[bench] {ci + 1}/{len(cells)} {c.dname} N={c.n} D={c.d} causal={c.causal}: "
            + ", ".join(f"{p} {d_}: {r[key]:{fmt_}}" for (p, d_), r in c.res.items() if key in r)
            + f" {unit}")
        del c
        if cuda:
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()
    return raw, compile_rows


# ---------------------------------------------------------------------------------------------------
# compile reports of the variants run


@functools.lru_cache(maxsize=None)
def _variant_report(family, dname, accum, d, causal):
    """(variant, report): the variant a default call runs, with its registers / shared memory / spills
    and NVRTC compile time; (None, None) for a family the build layer does not have."""
    fam = FAMILIES.get(family)
    if fam is None:
        return None, None
    try:
        bm, bn = default_blocks(family, dname, d, accum, causal)
        v = Variant(family, dname, accum, bm, bn, d, causal)
        t0 = time.perf_counter()
        rep = compile_report(v)
        rep["nvrtc_compile_s"] = time.perf_counter() - t0
        return v, rep
    except (ValueError, CompileError, ImportError) as e:  # a cell the family refuses, NVRTC failing or absent
        return None, {"key": f"{family}.{dname}", "error": f"{type(e).__name__}: {str(e)[:120]}"}


def _summarize_report(v, rep, deterministic, n=None):
    """key, kernels launched for n query rows, registers, shared memory, spill bytes ('/'-joined per
    launched kernel)."""
    if rep is None:
        return ["n/a"] * 5
    if "error" in rep:
        return [rep["key"], rep["error"], None, None, None]
    names = [v.kernel_name(role) for role in launch_roles(v, deterministic, n)]
    kernels = [rep["kernels"][name] for name in names]
    regs = "/".join(str(k["registers"]) for k in kernels)
    smem = "/".join(str(k["smem_static"] + k["smem_dynamic"]) for k in kernels)
    spills = sum(k["spill_stores"] + k["spill_loads"] for k in kernels)
    return [rep["key"], "/".join(n.replace("flash_", "") for n in names), regs, smem, spills]


# ---------------------------------------------------------------------------------------------------
# tables, finding, figure

MINE = ["flashcupy wgmma", "flashcupy wgmma det", "flashcupy mma", "flashcupy mma det", "flashcupy simt",
        *FP8_PROVIDERS]
OURS = "flashcupy mma"
HOPPER = "flashcupy wgmma"
HOPPER_PEERS = ["torch flash", "torch cudnn"]  # the wgmma family against FlashAttention-2 and cuDNN


def _tables(raw, compile_rows, peers) -> tuple[list, list, list, list]:
    """(columns, rows) of the TFLOP/s table with the ratios ours / peer, the compile-report rows and
    the first-call rows (the largest over cells per provider and direction)."""
    hopper_peers = [p for p in HOPPER_PEERS if p in peers]
    columns = ["dtype", "N", "D", "causal", "direction"] + [f"{p} TFLOP/s" for p in MINE] + \
              [f"{p} TFLOP/s" for p in peers] + [f"mma / {p}" for p in peers] + \
              [f"wgmma / {p}" for p in hopper_peers]

    def ratio(tf, ours, p):
        return (tf[ours] / tf[p]) if tf.get(ours) and tf.get(p) else None

    table_rows = []
    for r in raw:
        tf = {p: (r.get(p) or {}).get("tflops") for p in MINE + peers}
        table_rows.append([r["dtype"], r["N"], r["D"], r["causal"], r["direction"]] + [tf[p] for p in MINE]
                          + [tf[p] for p in peers] + [ratio(tf, OURS, p) for p in peers]
                          + [ratio(tf, HOPPER, p) for p in hopper_peers])
    comp = [[prov, direction, dname, d, causal, ", ".join(str(n) for n in sorted(set(ns)))]
            + _summarize_report(v, rep, det, ns[0])
            + [None if rep is None or "error" in rep else rep.get("nvrtc_compile_s")]
            for (prov, direction, dname, d, causal, _), ((v, rep), det, ns) in compile_rows.items()]
    first = {}
    for r in raw:
        for p, v in r.items():
            if isinstance(v, dict) and "first_call_s" in v:
                first[(p, r["direction"])] = max(first.get((p, r["direction"]), 0.0), v["first_call_s"])
    first_rows = [[p, dr, s] for (p, dr), s in sorted(first.items())]
    return columns, table_rows, comp, first_rows


def _finding(ctx: Context, raw, columns, table_rows, b: int, h: int, with_torch: bool) -> str:
    if ctx.backend != "cuda":
        return (f"NumPy backend: tiny configuration (B={b}, H={h}, N=128, D=64), wall-clock timings of the "
                "NumPy twin and naive NumPy attention; the plumbing is real, the numbers mean nothing.")
    if not with_torch:
        return "torch is not importable: flashcupy measured against naive CuPy attention only."
    fa = [(r, r[columns.index("mma / torch flash")]) for r in table_rows if r[0] == "f16"]
    fa = [(r, x) for r, x in fa if x is not None and x == x]  # cells both providers timed
    if not fa:
        errors = sorted({str(r.get("torch flash", {}).get("error")) for r in raw if r.get("torch flash")})
        return f"torch SDPA flash produced no timing ({'; '.join(errors)[:200]})."
    fwd = [x for r, x in fa if r[4] == "fwd"]
    bwd = [x for r, x in fa if r[4] == "bwd"]
    miss = [r for r, x in fa if x < 1.0]
    finding = (f"fp16 grid, flashcupy mma / torch SDPA flash (FlashAttention-2): forward "
               f"{min(fwd, default=float('nan')):.2f}x to {max(fwd, default=float('nan')):.2f}x, "
               f"backward {min(bwd, default=float('nan')):.2f}x to "
               f"{max(bwd, default=float('nan')):.2f}x; {len(miss)} of {len(fa)} (cell, direction) "
               "pairs below 1.0x.")
    cu = [x for r in table_rows if r[0] == "f16" and (x := r[columns.index("mma / torch cudnn")])]
    if cu:
        finding += f" Against cuDNN: {min(cu):.2f}x to {max(cu):.2f}x."
    if "wgmma / torch cudnn" in columns:
        for direction, what in (("fwd", "forward"), ("bwd", "backward")):
            hw = [(r, x) for r in table_rows
                  if r[4] == direction and (x := r[columns.index("wgmma / torch cudnn")])]
            big = [x for r, x in hw if r[1] >= 4096]
            if hw:
                finding += (f" Hopper {what} (flashcupy wgmma) / cuDNN: {min(x for _, x in hw):.2f}x to "
                            f"{max(x for _, x in hw):.2f}x over {len(hw)} cells"
                            + (f", {min(big):.2f}x to {max(big):.2f}x at N >= 4096" if big else "") + ".")
        i_det, i_atomic = (columns.index(f"flashcupy wgmma{x} TFLOP/s") for x in (" det", ""))
        det = [x / y for r in table_rows if r[4] == "bwd" and (x := r[i_det]) and (y := r[i_atomic])]
        if det:
            finding += (f" Its deterministic backward runs at {min(det):.2f}x to {max(det):.2f}x the "
                        "atomic-dQ path's speed.")
    fp8 = _fp8_rows(raw)
    for d in sorted({r[2] for r in fp8}):
        rows = [r for r in fp8 if r[2] == d]
        ratios = [r[7] for r in rows if r[7]]
        top = max(rows, key=lambda r: (r[1], not r[3]))
        if ratios:
            finding += (f" fp8 (e4m3) forward at D={d}: {min(ratios):.2f}x to {max(ratios):.2f}x the 16-bit "
                        f"wgmma forward ({top[4]:.0f} TFLOP/s at N={top[1]}{' causal' if top[3] else ''}, "
                        f"{top[7]:.2f}x).")
    return finding


def _fp8_rows(raw) -> list:
    """The fp8 table: (dtype, N, D, causal, fp8 TFLOP/s, fp8 two-level TFLOP/s (None at D=256), 16-bit
    wgmma TFLOP/s, fp8 / wgmma, two-level / wgmma, cuDNN TFLOP/s, fp8 / cuDNN) per forward cell where the
    fp8 kernel ran."""
    rows = []
    for r in raw:
        tf = {p: (r.get(p) or {}).get("tflops") for p in [HOPPER, *FP8_PROVIDERS, "torch cudnn"]}
        one, two = (tf[p] for p in FP8_PROVIDERS)
        if r["direction"] != "fwd" or not one:
            continue
        w, cu = tf[HOPPER], tf["torch cudnn"]
        rows.append([r["dtype"], r["N"], r["D"], r["causal"], one, two, w, w and one / w,
                     w and two and two / w, cu, cu and one / cu])
    return rows


def _cell_label(dname, n, d, causal) -> str:
    return f"N={n // 1024}k\nD={d}" + ("\ncausal" if causal else "")


def _figure(ctx: Context, columns, table_rows, raw, names):
    """CUDA: one panel per (dtype, direction), grouped bars of flashcupy / peer per cell (the fastest
    flashcupy family of the direction: wgmma where it ran, else mma) against FlashAttention-2
    and cuDNN, with the parity line. NumPy: milliseconds per provider (the twin's wall clock)."""
    if ctx.backend != "cuda" or not any(f"mma / {p}" in columns for p in HOPPER_PEERS):
        return _figure_ms(ctx, raw, names)
    dtypes = sorted({r[0] for r in table_rows}, key=["f16", "bf16"].index)
    fig, axes = new_figure(ncols=2, width=7.0, height=3.6 * len(dtypes))
    fig.clf()
    axes = fig.subplots(len(dtypes), 2, squeeze=False)
    peers = [p for p in HOPPER_PEERS if f"mma / {p}" in columns]
    labels = {"torch flash": "FlashAttention-2 (SDPA flash)", "torch cudnn": "cuDNN (SDPA cudnn)"}
    for row, dname in enumerate(dtypes):
        for col, direction in enumerate(("fwd", "bwd")):
            ax = axes[row][col]
            rs = [r for r in table_rows if r[0] == dname and r[4] == direction]
            x = np.arange(len(rs))
            width, top = 0.8 / len(peers), 1.0
            for i, p in enumerate(peers):
                def ratio(r, p=p):
                    w = f"wgmma / {p}"
                    if w in columns and r[columns.index(w)]:
                        return r[columns.index(w)]
                    return r[columns.index(f"mma / {p}")] or np.nan
                ys = [ratio(r) for r in rs]
                top = max([top] + [y for y in ys if y == y])
                ax.bar(x + (i - (len(peers) - 1) / 2) * width, ys, width,
                       label=f"flashcupy / {labels.get(p, p)}")
            ax.axhline(1.0, color="k", lw=1, ls="--")
            ax.set_ylim(0, 1.25 * top)
            ax.set_xticks(x, [_cell_label(*r[:4]) for r in rs], fontsize=7)
            ax.set_ylabel("speed ratio (> 1: flashcupy faster)")
            ours = "wgmma (Hopper) where it runs, else mma" + ("" if direction == "fwd" else "; atomic dQ")
            ax.set_title(f"{dname} {'forward' if direction == 'fwd' else 'backward'}: flashcupy {ours}",
                         fontsize=9)
            ax.legend(fontsize=7, loc="upper center", ncol=2)
    commit = git_commit() or "commit unknown"
    commit = commit[:7] + commit[40:] if len(commit) >= 40 else commit  # (a full sha, maybe "+dirty")
    fig.suptitle("flashcupy against FlashAttention-2 and cuDNN (torch SDPA), same run, device time: "
                 f"{ctx.device_name()}, {commit}")
    fig.tight_layout()
    return fig


def _figure_ms(ctx: Context, raw, names):
    """Milliseconds per call and provider, one panel per direction (the NumPy backend's only honest
    number: wall-clock time of the twin and of naive NumPy attention)."""
    fig, axes = new_figure(ncols=2, width=6.0)
    for ax, direction in zip(axes, ("fwd", "bwd")):
        rs = [r for r in raw if r["direction"] == direction]
        shown = [n for n in names if any("ms" in (r.get(n) or {}) for r in rs)]
        x = np.arange(len(rs))
        width = 0.8 / max(1, len(shown))
        for i, name in enumerate(shown):
            ax.bar(x + (i - (len(shown) - 1) / 2) * width,
                   [(r.get(name) or {}).get("ms", np.nan) for r in rs], width, label=name)
        ax.set_xticks(x, [f"{r['dtype']} N={r['N']} D={r['D']}" + (" causal" if r["causal"] else "")
                          for r in rs], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("milliseconds per call (wall clock)")
        ax.set_title("forward" if direction == "fwd" else "backward")
        ax.legend(fontsize=7)
    fig.suptitle("NumPy backend: wall-clock ms of the twin and naive NumPy (not a speed measurement)"
                 if ctx.backend != "cuda" else "milliseconds per call")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------------
# small calls: host overhead per call (wall time), flashcupy against torch SDPA

SMALL_SHAPES = [(1, 1, 128, 64), (1, 8, 256, 64), (2, 8, 512, 128), (8, 16, 512, 128),
                (4, 16, 2048, 128)]  # (B, H, N, D)
SMALL_ROUNDS, SMALL_CALLS = 7, 400
SMALL_DIRECTIONS = ("fwd", "bwd", "step")


def _wall_us(ctx: Context, fns, calls: int = SMALL_CALLS, rounds: int = SMALL_ROUNDS) -> list:
    """Wall time per call of each of ``fns`` over ``calls`` back-to-back calls, synchronized before and
    after each round (what a loop of small calls costs, host and device together). The rounds of the
    functions alternate (a drift of the machine's speed hits every function alike) and Python's garbage
    collector is paused during them (a collection inside one round would be charged to whichever function
    it interrupts). Returns one (median, min) pair of us per call for each function."""
    import gc

    for fn in fns:
        for _ in range(20):
            fn()
    out = [[] for _ in fns]
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            for fn, times in zip(fns, out):
                ctx.sync()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                ctx.sync()
                times.append((time.perf_counter() - t0) / calls * 1e6)
    finally:
        if enabled:
            gc.enable()
    return [(float(np.median(t)), float(np.min(t))) for t in out]


def _device_us(fn, calls: int = 50, *, host_us: bool = False, hold_ms_per_call: float = 0.3):
    """Device time per call: ``calls`` calls enqueued behind a GPU-holding kernel long enough to cover
    their dispatch, between two CUDA events (the GPU's own time, with no host gaps). The hold lasts
    ``hold_ms_per_call`` per call (at least ``HOLD_MS``): about 300 us of enqueue per call by default, more
    for a call whose host path is longer (a call that takes longer to enqueue than its share of the hold
    is timed partly as host time). With ``host_us``, returns (device us, host us): the host's time per
    call is time.perf_counter around the same ``calls`` calls as they are enqueued, nothing synchronized
    before the end (the GPU is held, so the host never waits for it)."""
    import cupy

    fn()
    a, b = cupy.cuda.Event(), cupy.cuda.Event()
    _hold_gpu(max(HOLD_MS, calls * hold_ms_per_call))
    a.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) * 1e6 / calls
    b.record()
    b.synchronize()
    device = cupy.cuda.get_elapsed_time(a, b) * 1e3 / calls
    return (device, host) if host_us else device


def _small_calls(ctx: Context, torch) -> list:
    """Rows (B, H, N, D, direction, flashcupy us, SDPA us, ratio, flashcupy min us, SDPA min us, ratio of the
    minima, flashcupy device us, SDPA device us, flashcupy.torch us, flashcupy.torch / SDPA) on fp16 inputs
    with a causal mask and default knobs (what a language model's training loop runs): wall times are the
    median (and the fastest) of the rounds of ``_wall_us``; SDPA picks its own backend. "bwd" is
    ``torch.autograd.grad`` of one retained graph (SDPA's, the torch bridge's); "step" a training step's
    attention: a forward of inputs that require grad, then ``backward`` with a given dO into the inputs'
    ``.grad`` (flashcupy: ``attention`` then ``attention_backward``)."""
    import cupy

    rows = []
    rng = np.random.default_rng(ctx.seed)
    for b, h, n, d in SMALL_SHAPES:
        q, k, v, do = (cupy.asarray(rng.standard_normal((b, h, n, d)).astype(np.float16)) for _ in range(4))
        o, lse = flashcupy.attention(q, k, v, causal=True, return_lse=True)

        def step():
            o, lse = flashcupy.attention(q, k, v, causal=True, return_lse=True)
            flashcupy.attention_backward(do, q, k, v, o, lse, causal=True)

        mine = {"fwd": lambda: flashcupy.attention(q, k, v, causal=True),
                "bwd": lambda: flashcupy.attention_backward(do, q, k, v, o, lse, causal=True), "step": step}
        peer, bridge = {}, {}
        if torch is not None:
            import flashcupy.torch as fct

            sdpa_fn = torch.nn.functional.scaled_dot_product_attention
            tq, tk, tv, tdo = sdpa.to_torch(torch, (q, k, v, do))
            rq, rk, rv = (t.clone().requires_grad_() for t in (tq, tk, tv))
            out = sdpa_fn(rq, rk, rv, is_causal=True)
            peer = {"fwd": lambda: sdpa_fn(tq, tk, tv, is_causal=True),
                    "bwd": lambda: torch.autograd.grad(out, (rq, rk, rv), tdo, retain_graph=True),
                    "step": lambda: sdpa_fn(rq, rk, rv, is_causal=True).backward(tdo)}
            bq, bk, bv = (t.clone().requires_grad_() for t in (tq, tk, tv))
            bout = fct.attention(bq, bk, bv, causal=True)
            bridge = {"fwd": lambda: fct.attention(tq, tk, tv, causal=True),
                      "bwd": lambda: torch.autograd.grad(bout, (bq, bk, bv), tdo, retain_graph=True),
                      "step": lambda: fct.attention(bq, bk, bv, causal=True).backward(tdo)}
        for direction in SMALL_DIRECTIONS:
            fns = [mine[direction]] + ([peer[direction], bridge[direction]] if peer else [])
            walls = _wall_us(ctx, fns)
            (ours, ours_min), (theirs, theirs_min), (bridged, _) = walls + [(None, None)] * (3 - len(walls))
            rows.append([b, h, n, d, direction, ours, theirs, ours / theirs if theirs else None,
                         ours_min, theirs_min, ours_min / theirs_min if theirs_min else None,
                         _device_us(mine[direction]), _device_us(peer[direction]) if peer else None, bridged,
                         bridged / theirs if theirs else None])
            log(f"small call {(b, h, n, d)} {direction}: flashcupy {ours:.1f} us, SDPA "
                f"{'-' if theirs is None else f'{theirs:.1f}'} us, flashcupy.torch "
                f"{'-' if bridged is None else f'{bridged:.1f}'} us")
    return rows


def _load_torch():
    try:
        return sdpa.load_torch()
    except Exception:
        return None


def run_bench(ctx: Context, cells=None) -> Report:
    b, h = (4, 32) if ctx.backend == "cuda" else (1, 2)
    if cells is None:
        if ctx.backend == "cuda":
            cells = full_grid() if not ctx.quick else [("f16", 1024, 64, False), ("f16", 1024, 64, True)]
        else:
            cells = tiny_grid()
    torch = _load_torch() if ctx.backend == "cuda" else None
    raw, compile_rows = _measure(ctx, cells, b, h, torch)
    small = _small_calls(ctx, torch) if ctx.backend == "cuda" else []
    peers = ["naive"] + ([f"torch {short}" for short in sdpa.BACKENDS] if torch is not None else [])
    columns, table_rows, comp, first_rows = _tables(raw, compile_rows, peers)
    finding = _finding(ctx, raw, columns, table_rows, b, h, torch is not None)
    fig = _figure(ctx, columns, table_rows, raw, MINE + peers)
    setup = {"grid": f"B={b}, H={h}, cells (dtype, N, D, causal) = {cells}",
             "providers": "flashcupy wgmma (forward; Hopper GPUs, D 64, 128 and 256; its fp8 forward at "
                          "D=128 and 256, single-level accumulation, and two-level at D=128), mma and simt "
                          f"(simt only for N <= {SIMT_MAX_N} to fit the time budget), "
                          "naive attention (flashcupy.naive) where 4 (fwd) / 6 (bwd) fp32 N x N matrices "
                          "fit, torch SDPA flash / cuDNN / mem-efficient when torch is importable "
                          "(on CUDA only)",
             "timing": ("CUDA events behind a 2 ms GPU-holding kernel (device time)" if ctx.backend == "cuda"
                        else "time.perf_counter") +
                       ", warm-up first, median of repeated calls (about 0.3 s of calls per provider, "
                       "5 to 50), inputs rotated through enough sets to exceed twice the L2 cache "
                       "(at most 4)",
             "flops": "fwd 4 B H N^2 D (halved when causal), bwd 2.5x fwd",
             "compile": "NVRTC compile time from flashcupy.inspect.compile_report (no cache); first-call "
                        "time separately (compile or CuPy's disk cache + load + one run)"}
    tables = [Table("TFLOP/s per cell and ratios flashcupy mma / peer", columns, table_rows),
              Table("Per variant (default tiles, fp32 accumulators): compile report",
                    ["provider", "direction", "dtype", "D", "causal", "N", "variant key", "kernels launched",
                     "registers per thread", "shared memory bytes", "spill bytes", "NVRTC compile s"], comp),
              Table("First call (compile or cache + load + run), largest over cells",
                    ["provider", "direction", "seconds"], first_rows)]
    fp8 = _fp8_rows(raw)
    if fp8:
        tables.append(Table("fp8 (e4m3) forward, D=128 and 256: inputs quantized per tensor (outside the "
                            "timing), output in the cell's dtype; single-level accumulation (the tensor "
                            "core's) and two-level (fp32 every 128 keys, D=128 only)",
                            ["dtype", "N", "D", "causal", "fp8 TFLOP/s", "fp8 two-level TFLOP/s",
                             "16-bit wgmma TFLOP/s", "fp8 / wgmma", "two-level / wgmma",
                             "cuDNN (16-bit) TFLOP/s", "fp8 / cuDNN"], fp8))
    if small:
        tables.append(Table("Small calls: wall time per call (us; host and device, median and fastest of "
                            f"{SMALL_ROUNDS} rounds of {SMALL_CALLS} synchronized calls, the providers' "
                            "rounds alternating, garbage collection paused), fp16, causal, default "
                            "knobs; bwd: autograd.grad of a retained graph; step: forward of inputs that "
                            "require grad, then backward(dO) into .grad; device us: the GPU's own time per "
                            "call",
                            ["B", "H", "N", "D", "direction", "flashcupy us", "SDPA us", "flashcupy / SDPA",
                             "flashcupy min us", "SDPA min us", "min / min", "flashcupy device us",
                             "SDPA device us", "flashcupy.torch us", "flashcupy.torch / SDPA"], small))
    return Report("bench", "Speed: flashcupy against naive attention and torch SDPA, same run", finding,
                  setup, tables, data={"cells": raw, "batch": b, "heads": h, "small_calls": small},
                  figure=fig,
                  figure_caption=("flashcupy / FlashAttention-2 and flashcupy / cuDNN per cell (bars above "
                                  "the dashed line: flashcupy faster); TFLOP/s of every provider in the "
                                  "table." if ctx.backend == "cuda" else "NumPy backend: ms per call."),
                  notes=[__doc__.split("\n\n")[1].replace("\n", " "),
                         "Why cells miss: hardware counters of the same kernels on the same inputs are in "
                         f"profile.md (python -m {__package__}.profile_ncu under Nsight Compute)."])

"""``bench``: forward and backward speed of flashcupy against naive attention and torch SDPA, measured in
one process on the same inputs, reported as TFLOP/s and as ratios flashcupy / peer.

FLOPs: forward 4 B H N^2 D (halved when causal), backward 2.5x the forward. Time: CUDA events around
each call, after a warm-up call (compilation excluded; the compile time is measured on its own, once
through NVRTC without any cache and once as the first call), median of repeated calls, cycling through
enough input sets to exceed the L2 cache. Before each timed call a one-thread kernel holds the GPU for
2 ms, so that the host has enqueued the whole call before the start event fires: the events measure
device time, not Python, CuPy or torch dispatch (nvbench's blocking-kernel method). torch SDPA runs on the CuPy arrays through DLPack (zero
copy) with one backend forced by ``torch.nn.attention.sdpa_kernel``; its backward is
``torch.autograd.grad`` of the same call. On the NumPy backend a tiny configuration runs through the
same code with wall-clock timing: the plumbing is real, the numbers mean nothing.
"""
from __future__ import annotations

import functools
import math
import time
from types import SimpleNamespace

import numpy as np

import flashcupy
from flashcupy import naive
from flashcupy._build import FAMILIES, Variant, compile_report

from .backward import naive_backward
from .common import Context, Report, Table, log, new_figure, np_dtype

TORCH_BACKENDS = [("torch flash", "FLASH_ATTENTION"), ("torch cudnn", "CUDNN_ATTENTION"),
                  ("torch mem-efficient", "EFFICIENT_ATTENTION")]


def flops(b, h, n, d, causal, direction):
    f = 4.0 * b * h * n * n * d / (2 if causal else 1)
    return f * (2.5 if direction == "bwd" else 1.0)


def full_grid():
    return [(dname, n, d, causal) for dname in ("f16", "bf16") for n in (1024, 4096, 16384)
            for d in (64, 128) for causal in (False, True)]


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
# providers: name -> (fwd fn(set), bwd fn(set)) where a set is the tuple of device arrays


def _torch():
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if not torch.cuda.is_available():
            return None
        return torch, SDPBackend, sdpa_kernel
    except Exception:
        return None


def _random_set(ctx, rng, shape, dname):
    """q, k, v, dO ~ N(0,1): drawn on the device when there is one (host generation of the largest
    cells would take longer than timing them)."""
    dt = np_dtype(dname)
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


@functools.lru_cache(maxsize=None)
def _variant_report(family, dname, accum, d, causal):
    """Registers / shared memory / spills of the variant a default call runs, and NVRTC compile time."""
    fam = FAMILIES.get(family)
    if fam is None:
        return None
    try:
        bm, bn = fam.default_blocks(dname, d)
        v = Variant(family, dname, accum, bm, bn, d, causal)
        t0 = time.perf_counter()
        rep = compile_report(v)
        rep["nvrtc_compile_s"] = time.perf_counter() - t0
        return rep
    except Exception as e:  # no NVRTC here, or a family the build layer cannot report
        return {"key": f"{family}.{dname}", "error": f"{type(e).__name__}: {str(e)[:120]}"}


def _summarize_report(rep, deterministic):
    """key, kernels launched, registers, shared memory, spill bytes ('/'-joined per launched kernel)."""
    if rep is None:
        return ["n/a"] * 5
    if "error" in rep:
        return [rep["key"], rep["error"], None, None, None]
    kernels = rep["kernels"]
    if rep["key"].startswith("bwd_mma"):
        from flashcupy._launch import backward_kernels

        names = backward_kernels(SimpleNamespace(kernels=tuple(kernels), family="bwd_mma"), deterministic)
        kernels = {n: kernels[n] for n in ("flash_bwd_prep",) + names}
    regs = "/".join(str(k["registers"]) for k in kernels.values())
    smem = "/".join(str(k["smem_static"] + k["smem_dynamic"]) for k in kernels.values())
    spills = sum(k["spill_stores"] + k["spill_loads"] for k in kernels.values())
    return [rep["key"], "/".join(n.replace("flash_", "") for n in kernels), regs, smem, spills]


def run_bench(ctx: Context, cells=None) -> Report:
    b, h = (4, 32) if ctx.backend == "cuda" and not ctx.quick else ((4, 32) if ctx.backend == "cuda" else (1, 2))
    if cells is None:
        if ctx.backend == "cuda":
            cells = full_grid() if not ctx.quick else [("f16", 1024, 64, False), ("f16", 1024, 64, True)]
        else:
            cells = tiny_grid()
    timer = Timer(ctx, budget_s=0.3 if ctx.backend == "cuda" else 0.05,
                  min_reps=5 if ctx.backend == "cuda" else 2, max_reps=50 if ctx.backend == "cuda" else 3)
    tor = _torch() if ctx.backend == "cuda" else None
    has_bwd = hasattr(flashcupy, "attention_backward")
    simt_max_n = 4096   # the scalar family is a readable reference, not a fast path: capped to fit the budget
    l2 = 50 * 2 ** 20
    if ctx.backend == "cuda":
        import cupy

        l2 = cupy.cuda.Device().attributes.get("L2CacheSize", l2)
    rows, compile_rows, raw = [], {}, []
    for ci, (dname, n, d, causal) in enumerate(cells):
        rng = ctx.rng(f"bench.{dname}.{n}.{d}")
        set_bytes = 4 * b * h * n * d * 2
        nsets = int(min(4, max(1, math.ceil(2 * l2 / set_bytes))))
        sets = []
        for i in range(nsets):
            sets.append(_random_set(ctx, rng, (b, h, n, d), dname))   # q, k, v, do
        res = {}   # (provider, direction) -> dict

        def measure(provider, direction, fn, inputs=None):
            inputs = sets if inputs is None else inputs
            try:
                first = timer.first_call(fn, inputs[0])
                ms, reps = timer.median_ms(fn, inputs)
            except Exception as e:
                if ctx.backend == "cuda":
                    import cupy

                    if isinstance(e, cupy.cuda.memory.OutOfMemoryError):
                        res[(provider, direction)] = {"error": "out of memory"}
                        return
                if provider.startswith("torch"):
                    res[(provider, direction)] = {"error": f"{type(e).__name__}: {str(e)[:100]}"}
                    return
                raise
            fl = flops(b, h, n, d, causal, direction)
            res[(provider, direction)] = {"ms": ms, "tflops": fl / (ms * 1e-3) / 1e12, "reps": reps,
                                          "first_call_s": first}

        # flashcupy, each forward family that applies to the dtype
        for fam_name in ("fwd_mma", "fwd_simt"):
            fam = FAMILIES[fam_name]
            if dname not in fam.dtypes or (fam_name == "fwd_simt" and n > simt_max_n):
                continue
            kernel = fam_name.split("_")[1]
            prov = f"flashcupy {kernel}"
            measure(prov, "fwd", lambda s, kernel=kernel: flashcupy.attention(s[0], s[1], s[2], causal=causal,
                                                                               kernel=kernel))
            compile_rows[(prov, "fwd", dname, d, causal)] = (_variant_report(fam_name, dname, "fp32", d, causal), False)
            if has_bwd and f"bwd_{kernel}" in FAMILIES:
                outs = [flashcupy.attention(s[0], s[1], s[2], causal=causal, kernel=kernel, return_lse=True)
                        for s in sets]
                bsets = [(*s, *o) for s, o in zip(sets, outs)]

                def bwd(s, kernel=kernel):
                    return flashcupy.attention_backward(s[3], s[0], s[1], s[2], s[4], s[5], causal=causal,
                                                        kernel=kernel)
                def bwd_det(s, kernel=kernel):
                    return flashcupy.attention_backward(s[3], s[0], s[1], s[2], s[4], s[5], causal=causal,
                                                        kernel=kernel, deterministic=True)
                runs = [(prov, bwd, False)] + ([(f"{prov} det", bwd_det, True)] if kernel == "mma" else [])
                for name, fn, det in runs:
                    try:
                        first = timer.first_call(fn, bsets[0])
                        ms, reps = timer.median_ms(fn, bsets)
                        res[(name, "bwd")] = {"ms": ms, "tflops": flops(b, h, n, d, causal, "bwd") / (ms * 1e-3) / 1e12,
                                              "reps": reps, "first_call_s": first}
                    except ValueError as e:
                        res[(name, "bwd")] = {"error": str(e)[:100]}
                    compile_rows[(name, "bwd", dname, d, causal)] = (
                        _variant_report(f"bwd_{kernel}", dname, "fp32", d, causal), det)
                del outs, bsets
        # naive attention where it fits
        if _fits_naive(ctx, b, h, n, 4):
            measure("naive", "fwd", lambda s: naive.attention(s[0], s[1], s[2], causal=causal))
        else:
            res[("naive", "fwd")] = {"error": "does not fit in memory"}
        if _fits_naive(ctx, b, h, n, 6):
            measure("naive", "bwd", lambda s: naive_backward(s[3], s[0], s[1], s[2], causal=causal))
        else:
            res[("naive", "bwd")] = {"error": "does not fit in memory"}
        # torch SDPA backends on the same memory (DLPack)
        if tor is not None:
            torch, SDPBackend, sdpa_kernel = tor
            tsets = [tuple(torch.from_dlpack(x) for x in s) for s in sets]
            sdpa = torch.nn.functional.scaled_dot_product_attention
            for prov, backend_name in TORCH_BACKENDS:
                backend = getattr(SDPBackend, backend_name)

                def tf(s, backend=backend):
                    with sdpa_kernel(backend):
                        return sdpa(s[0], s[1], s[2], is_causal=causal)
                measure(prov, "fwd", tf, tsets)
                if "error" in res[(prov, "fwd")]:
                    res[(prov, "bwd")] = {"error": "forward failed"}
                    continue
                gsets = []
                for s in tsets:
                    q, k, v = (x.detach().requires_grad_() for x in s[:3])
                    with sdpa_kernel(backend):
                        out = sdpa(q, k, v, is_causal=causal)
                    gsets.append((q, k, v, s[3], out))

                def tb(s):
                    return torch.autograd.grad(s[4], (s[0], s[1], s[2]), s[3], retain_graph=True)
                measure(prov, "bwd", tb, gsets)
                del gsets
            del tsets
        providers = sorted({p for p, _ in res}, key=lambda p: (not p.startswith("flashcupy"), p))
        for direction in ("fwd", "bwd"):
            row = {"dtype": dname, "N": n, "D": d, "causal": causal, "direction": direction}
            for p in providers:
                row[p] = res.get((p, direction), {})
            raw.append(row)
        log(f"[bench] {ci + 1}/{len(cells)} {dname} N={n} D={d} causal={causal}: "
            + ", ".join(f"{p} {d_}: {r['tflops']:.1f}" for (p, d_), r in res.items() if "tflops" in r)
            + " TFLOP/s")
        del sets
        if ctx.backend == "cuda":
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()

    peers = ["naive"] + ([p for p, _ in TORCH_BACKENDS] if tor is not None else [])
    ours = "flashcupy mma"
    mine = ["flashcupy mma", "flashcupy mma det", "flashcupy simt"]
    columns = ["dtype", "N", "D", "causal", "direction"] + [f"{p} TFLOP/s" for p in mine] + \
              [f"{p} TFLOP/s" for p in peers] + [f"mma / {p}" for p in peers]
    table_rows = []
    for r in raw:
        tf = {p: (r.get(p) or {}).get("tflops") for p in mine + peers}
        ratios = [(tf[ours] / tf[p]) if tf.get(ours) and tf.get(p) else None for p in peers]
        table_rows.append([r["dtype"], r["N"], r["D"], r["causal"], r["direction"]] + [tf[p] for p in mine]
                          + [tf[p] for p in peers] + ratios)
    comp = [[prov, direction, dname, d, causal] + _summarize_report(rep, det)
            + [None if rep is None or "error" in rep else rep.get("nvrtc_compile_s")]
            for (prov, direction, dname, d, causal), (rep, det) in compile_rows.items()]
    # first-call (compile + load + run) times per provider, the largest over cells
    first = {}
    for r in raw:
        for p, v in r.items():
            if isinstance(v, dict) and "first_call_s" in v:
                first[(p, r["direction"])] = max(first.get((p, r["direction"]), 0.0), v["first_call_s"])
    first_rows = [[p, dr, s] for (p, dr), s in sorted(first.items())]
    if ctx.backend != "cuda":
        finding = (f"NumPy backend: tiny configuration (B={b}, H={h}, N=128, D=64), wall-clock timings of the "
                   "NumPy twin and naive NumPy attention; the plumbing is real, the numbers mean nothing.")
    elif tor is None:
        finding = "torch is not importable: flashcupy measured against naive CuPy attention only."
    else:
        fa = [(r, r[columns.index("mma / torch flash")]) for r in table_rows if r[0] == "f16"]
        fa = [(r, x) for r, x in fa if x is not None and x == x]  # cells both providers timed
        fwd = [x for r, x in fa if r[4] == "fwd"]
        bwd = [x for r, x in fa if r[4] == "bwd"]
        miss = [r for r, x in fa if x < 1.0]
        if not fa:
            errors = sorted({str(r.get("torch flash", {}).get("error")) for r in raw if r.get("torch flash")})
            finding = f"torch SDPA flash produced no timing ({'; '.join(errors)[:200]})."
        else:
            finding = (f"fp16 grid, flashcupy mma / torch SDPA flash (FlashAttention-2): forward "
                       f"{min(fwd, default=float('nan')):.2f}x to {max(fwd, default=float('nan')):.2f}x, "
                       f"backward {min(bwd, default=float('nan')):.2f}x to "
                       f"{max(bwd, default=float('nan')):.2f}x; {len(miss)} of {len(fa)} (cell, direction) "
                       "pairs below 1.0x.")
            cu = [x for r in table_rows if r[0] == "f16" and (x := r[columns.index("mma / torch cudnn")])]
            if cu:
                finding += f" Against cuDNN: {min(cu):.2f}x to {max(cu):.2f}x."
    if not has_bwd:
        finding += " Backward not available (flashcupy.attention_backward missing): backward columns are peers only."
    fig, axes = new_figure(ncols=2, width=6.5)
    for ax, direction in zip(axes, ("fwd", "bwd")):
        rs = [r for r in table_rows if r[4] == direction]
        x = np.arange(len(rs))
        for j, name in enumerate(mine + peers):
            col = columns.index(f"{name} TFLOP/s")
            ys = [r[col] if r[col] else np.nan for r in rs]
            if not np.all(np.isnan(ys)):
                ax.plot(x, ys, "o-" if name.startswith("flashcupy") else "s--", ms=4, label=name)
        ax.set_xticks(x, [f"{r[0]} N{r[1]}\nD{r[2]}{' c' if r[3] else ''}" for r in rs], fontsize=6, rotation=90)
        ax.set_yscale("log")
        ax.set_ylabel("TFLOP/s (4BHN^2D fwd, 2.5x bwd; causal halved)")
        ax.set_title(f"{'forward' if direction == 'fwd' else 'backward'}")
        ax.legend(fontsize=7)
    fig.suptitle("Throughput per cell, same process and inputs" + (" (NumPy twin: meaningless)" if
                                                                     ctx.backend != "cuda" else ""))
    setup = {"grid": f"B={b}, H={h}, cells (dtype, N, D, causal) = {cells}",
             "providers": "flashcupy mma and simt (simt only for N <= 4096 to fit the time budget), naive "
                          "attention (flashcupy.naive; backward: analysis.backward.naive_backward) where 4 (fwd) / "
                          "6 (bwd) fp32 N x N matrices fit, torch SDPA flash / cuDNN / mem-efficient when torch "
                          "is importable (on CUDA only)",
             "timing": ("CUDA events behind a 2 ms GPU-holding kernel (device time)" if ctx.backend == "cuda"
                        else "time.perf_counter") +
                       ", warm-up first, median of repeated calls (about 0.3 s of calls per provider, "
                       "5 to 50), inputs rotated through enough sets to exceed twice the L2 cache (at most 4)",
             "flops": "fwd 4 B H N^2 D (halved when causal), bwd 2.5x fwd",
             "compile": "NVRTC compile time from flashcupy._build.compile_report (no cache); first-call time "
                        "separately (compile or CuPy's disk cache + load + one run)"}
    tables = [Table("TFLOP/s per cell and ratios flashcupy mma / peer", columns, table_rows),
              Table("Per variant (default tiles, fp32 accumulators): compile report",
                    ["provider", "direction", "dtype", "D", "causal", "variant key", "kernels launched",
                     "registers per thread", "shared memory bytes", "spill bytes", "NVRTC compile s"], comp),
              Table("First call (compile or cache + load + run), largest over cells",
                    ["provider", "direction", "seconds"], first_rows)]
    return Report("bench", "Speed: flashcupy against naive attention and torch SDPA, same run", finding, setup,
                  tables, data={"cells": raw, "batch": b, "heads": h}, figure=fig,
                  figure_caption="TFLOP/s per cell for every provider, forward and backward.",
                  notes=[__doc__.split("\n\n")[1].replace("\n", " "),
                         "Why cells miss: hardware counters of the same kernels on the same inputs are in "
                         "profile.md (python -m analysis.profile_ncu under Nsight Compute)."])

"""``memory``: peak memory of naive attention (the N x N score matrix exists) and of flashcupy (it never
does) over N.

On CUDA the peak is the high-water mark of CuPy's memory pool during the call (a MemoryHook adds every
pool malloc and subtracts every free), on a pool emptied before each measurement, minus what was
allocated before the call (the inputs). On the NumPy backend there is no device: the peak is the host
memory NumPy allocates during the call, measured with ``tracemalloc`` (NumPy reports its array
buffers to it), which tracks the same arrays the CUDA path would allocate on the device.
"""
from __future__ import annotations

import gc
import tracemalloc

import numpy as np

import flashcupy
from flashcupy import naive
from flashcupy.inspect import numpy_dtype

from .common import Context, Report, Table, log, new_figure


def _slope(ns, ys):
    pts = [(n, y) for n, y in zip(ns, ys) if y]
    if len(pts) < 2:
        return float("nan")
    a = np.log([p[0] for p in pts])
    b = np.log([p[1] for p in pts])
    return float(np.polyfit(a, b, 1)[0])


def _peak_cuda(fn):
    """(peak bytes allocated from the pool during fn beyond what was live before, or None on OOM)."""
    import cupy
    from cupy.cuda import memory_hook

    class PeakHook(memory_hook.MemoryHook):
        name = "analysis.memory.PeakHook"

        def __init__(self):
            self.cur = 0
            self.peak = 0

        def malloc_postprocess(self, **kw):
            self.cur += kw["mem_size"]
            self.peak = max(self.peak, self.cur)

        def free_postprocess(self, **kw):
            self.cur -= kw["mem_size"]

    hook = PeakHook()
    try:
        with hook:
            out = fn()
            cupy.cuda.Device().synchronize()
        del out
    except cupy.cuda.memory.OutOfMemoryError:
        return None
    return hook.peak


def _peak_numpy(fn):
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        out = fn()
        peak = tracemalloc.get_traced_memory()[1] - base
        del out
    finally:
        tracemalloc.stop()
    return peak


def run_memory(ctx: Context) -> Report:
    b, h, d = ctx.sizes((1, 2, 64), (1, 8, 128))
    ns = ctx.sizes([256, 512, 1024, 2048], [1024, 2048, 4096, 8192, 16384, 32768, 65536])
    dname = "f16"
    es = 2
    rows, naive_failed_at = [], None
    for n in ns:
        if ctx.backend == "cuda":
            import cupy

            pool = cupy.get_default_memory_pool()
            pool.free_all_blocks()
            rng = cupy.random.default_rng(ctx.seed + n)
            q, k, v = (rng.standard_normal((b, h, n, d), dtype=cupy.float32).astype(cupy.float16)
                       for _ in range(3))
            cupy.cuda.Device().synchronize()
            measure = _peak_cuda
        else:
            rng = ctx.rng(f"memory.{n}")
            q, k, v = (rng.standard_normal((b, h, n, d)).astype(numpy_dtype(dname)) for _ in range(3))
            measure = _peak_numpy
        fc = measure(lambda: flashcupy.attention(q, k, v))
        fc_lse = measure(lambda: flashcupy.attention(q, k, v, return_lse=True))
        nv = None
        if naive_failed_at is None:
            nv = measure(lambda: naive.attention(q, k, v))
            if nv is None:
                naive_failed_at = n
        out_bytes = b * h * n * d * es
        rows.append([n, 3 * b * h * n * d * es, fc, fc - out_bytes if fc is not None else None, fc_lse, nv,
                     b * h * n * n * 4, (nv / fc) if (nv and fc) else None])
        log(f"[memory] N={n}: flashcupy {fc / 2**20:.1f} MiB, naive "
            + (f"{nv / 2**20:.1f} MiB" if nv is not None else "out of memory / skipped"))
        q = k = v = None
        if ctx.backend == "cuda":
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()
    where = "device memory pool high-water mark (cupy MemoryHook)" if ctx.backend == "cuda" else \
        "host bytes of NumPy arrays allocated during the call (tracemalloc), standing in for device memory"
    s_fc = _slope([r[0] for r in rows], [r[2] for r in rows])
    s_nv = _slope([r[0] for r in rows], [r[5] for r in rows])
    last = [r for r in rows if r[5]][-1]
    finding = (f"Peak memory during the call grows like N^{s_fc:.2f} for flashcupy and N^{s_nv:.2f} for "
               f"naive attention; at N={last[0]} naive needs {last[7]:.0f}x flashcupy's"
               + (f"; naive runs out of memory at N={naive_failed_at}" if naive_failed_at else
                  (f"; naive did not run out of memory up to N={ns[-1]}" if ctx.backend == "cuda" else ""))
               + (" (measured on the device)." if ctx.backend == "cuda"
                  else " (NumPy twin, host arrays via tracemalloc)."))
    fig, (ax,) = new_figure()
    nn = np.array([r[0] for r in rows], float)
    ax.plot(nn, [r[2] for r in rows], "o-", label="flashcupy (peak during call)")
    ax.plot([r[0] for r in rows if r[5]], [r[5] for r in rows if r[5]], "s-", label="naive attention")
    ax.plot(nn, b * h * nn ** 2 * 4, "k:", label="one fp32 N x N score matrix, B H N^2 4 bytes")
    ax.plot(nn, b * h * nn * d * es, "k--", label="one (B, H, N, D) fp16 tensor (the output)")
    if naive_failed_at:
        ax.axvline(naive_failed_at, color="tab:red", ls="-.",
                   label=f"naive out of memory (N={naive_failed_at})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("peak memory allocated during the call (bytes)")
    ax.set_title("Naive attention grows like N^2, flashcupy like N")
    ax.legend(fontsize=8)
    setup = {"shapes": f"B={b}, H={h}, D={d}, fp16, non-causal, N in {ns}",
             "kernel": "kernel='auto', default tiles",
             "measured": where,
             "columns": "peak = bytes allocated during the call beyond the inputs (includes the output); "
                        "extra = peak minus the output"}
    return Report("memory", "Peak memory: naive attention against flashcupy", finding, setup,
                  [Table("Peak memory during one forward call (bytes)",
                         ["N", "inputs q,k,v", "flashcupy peak", "flashcupy extra beyond output",
                          "flashcupy peak with lse", "naive peak", "one fp32 N x N matrix",
                          "naive / flashcupy"],
                         rows)],
                  data={"naive_failed_at": naive_failed_at, "slope_flashcupy": s_fc, "slope_naive": s_nv},
                  figure=fig, figure_caption="Peak memory against N, log-log.",
                  notes=[__doc__.split("\n\n")[1].replace("\n", " ")])

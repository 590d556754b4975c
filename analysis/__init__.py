"""analysis: the break-it experiments and numerical reports of flashcupy, and the benchmark.

``python -m analysis <experiment> [--backend auto|cuda|numpy] [--quick] [--out DIR] [--seed S]`` runs one
experiment (``all`` runs every one and writes ``index.md``). Each writes ``<name>.json`` (all numbers),
``<name>.md`` (the table a person reads, with a one-line finding) and ``<name>.png``.

Experiments use only the public API of ``flashcupy`` (``attention``, ``attention_backward``,
``reference``, ``naive``, ``fp8``, ``transforms``) and ``flashcupy.inspect`` (variants, family table,
compile reports, builds, and the tensor cores' accumulation model the NumPy twin uses,
``inspect.tensorcore``).
"""
from __future__ import annotations

# name -> (module, function, one-line description); imported lazily so that one broken experiment
# never stops the others from running.
EXPERIMENTS = {
    "overflow": ("breaks", "run_overflow", "no max subtraction: rows break past ln(max finite)"),
    "rescaling": ("breaks", "run_rescaling", "no rescaling: finite and wrong with two or more KV tiles"),
    "blocks": ("accuracy", "run_blocks", "intact kernels over every tile size, dtype and accumulator"),
    "accum": ("accuracy", "run_accum", "fp16 vs fp32 accumulators: error against N"),
    "outliers": ("accuracy", "run_outliers", "FlashAttention-3's outlier inputs: RMSE beside the paper"),
    "bounds": ("bounds", "run_bounds", "softmax probabilities against the Blanchard-Higham-Higham bound"),
    "backward": ("backward", "run_backward", "dQ, dK, dV against float64 and a naive backward"),
    "memory": ("memory", "run_memory", "peak memory of naive attention and flashcupy over N"),
    "drift": ("accuracy", "run_drift", "Wasserstein distance of the output distributions"),
    "tensorcore": ("tensorcore", "run_tensorcore", "how mma.sync and wgmma accumulate, measured"),
    "fp8": ("fp8", "run_fp8", "e4m3 attention: scales, outlier treatments, one- and two-level sums"),
    "window": ("window", "run_window", "sliding windows: error and cost against the width"),
    "softcap": ("softcap", "run_softcap", "the softcap: error against the cap, tanh.approx or tanhf, cost"),
    "alibi": ("alibi", "run_alibi", "ALiBi: the rule near the diagonal, rows far from their keys, cost"),
    "sinks": ("sinks", "run_sinks", "attention sinks: the P-collapse against the sink's strength"),
    "merge": ("merge", "run_merge", "merged partial softmaxes: error against the number of parts"),
    "ring": ("ring", "run_ring", "ring attention simulated: error against the number of ranks"),
    "fp8_backward": ("fp8_backward", "run_fp8_backward", "which backward products can take fp8 operands"),
    "decode": ("decode", "run_decode", "decoding: share of the copy bandwidth, host time, peers (KV cache)"),
    "bench": ("bench", "run_bench", "speed against naive CuPy and torch SDPA, same run"),
}
# Reports that python -m analysis.profile_ncu writes into a report folder, listed in its index.md when they
# are there: every <name>.json whose name starts with this (summarize: Nsight Compute counters beside
# FlashAttention-2 and cuDNN, "profile" for the default kernels and "profile_mma" for the mma family;
# sass: warp samples per SASS instruction, e.g. "profile_sass_d64").
OTHER_REPORTS_PREFIX = "profile"

__all__ = ["EXPERIMENTS", "OTHER_REPORTS_PREFIX", "run_experiment"]


def run_experiment(name, ctx):
    """Run one experiment in ``ctx`` and write its report; returns the written paths."""
    import importlib
    import time

    from .common import log, write_report

    mod, fn, _ = EXPERIMENTS[name]
    func = getattr(importlib.import_module(f"{__name__}.{mod}"), fn)
    t0 = time.perf_counter()
    log(f"[{name}] start ({ctx.backend}, {'quick' if ctx.quick else 'full'} sizes, seed {ctx.seed})")
    rep = func(ctx)
    elapsed = time.perf_counter() - t0
    paths = write_report(ctx, rep, elapsed)
    log(f"[{name}] done in {elapsed:.1f} s: {rep.finding}")
    return paths, rep

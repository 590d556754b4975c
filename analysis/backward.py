"""``backward``: dQ, dK, dV of flashcupy against float64, beside the naive same-precision backward of
``flashcupy.naive`` (every product accumulated in float32 and rounded to the input dtype where a
framework would store it, the full score matrix materialised)."""
from __future__ import annotations

import numpy as np

import flashcupy
from flashcupy import naive, reference
from flashcupy._build import FAMILIES

from .common import Context, Report, Table, errors, log, new_figure, normal_inputs


def backward_variants():
    """(kernel, dtype, accum, block_m, block_n) to try: every tile of every backward family."""
    out = []
    for fam in FAMILIES.values():
        if fam.direction != "bwd":
            continue
        for dname in fam.dtypes:
            for accum in fam.accums(dname):
                for bm in fam.block_m:
                    for bn in fam.block_n:
                        out.append((fam.kind, dname, accum, bm, bn))
    return out


def run_backward(ctx: Context) -> Report:
    b, h, n, d = ctx.sizes((1, 2, 256, 64), (2, 8, 2048, 64))
    names = ("dq", "dk", "dv")
    inputs, naive_rows, naive_err = {}, [], {}
    for dname in ("f16", "bf16", "f32"):
        rng = ctx.rng(f"backward.{dname}")
        q, k, v = normal_inputs(rng, (b, h, n, d), (b, h, n, d), dname)
        do = rng.standard_normal((b, h, n, d)).astype(q.dtype)
        refs = reference.attention_backward(do, q, k, v)
        dev = ctx.dev(do, q, k, v)
        nb = naive.attention_backward(*dev)
        errs = [errors(x, r) for x, r in zip(nb, refs)]
        naive_err[dname] = errs
        naive_rows.append([dname] + [e["max_abs"] for e in errs] + [e["rmse"] for e in errs])
        inputs[dname] = (dev, refs)
        log(f"[backward] naive {dname}: "
            + ", ".join(f"{nm} {e['max_abs']:.2e}" for nm, e in zip(names, errs)))
    rows, skipped = [], []
    variants = backward_variants()
    for i, (kernel, dname, accum, bm, bn) in enumerate(variants):
        (do, q, k, v), refs = inputs[dname]
        try:
            o, lse = flashcupy.attention(q, k, v, accum=accum, return_lse=True)
            grads = flashcupy.attention_backward(do, q, k, v, o, lse, causal=False, scale=None,
                                                 block_m=bm, block_n=bn, accum=accum, kernel=kernel,
                                                 deterministic=False)
        except ValueError as e:
            skipped.append([kernel, dname, accum, bm, bn, str(e).split(";")[0][:80]])
            continue
        errs = [errors(x, r) for x, r in zip(grads, refs)]
        ratios = [e["max_abs"] / ne["max_abs"] for e, ne in zip(errs, naive_err[dname])]
        rows.append([kernel, dname, accum, bm, bn] + [e["max_abs"] for e in errs]
                    + [e["rmse"] for e in errs] + ratios)
        log(f"[backward] {i + 1}/{len(variants)} {kernel} {dname} acc{accum[2:]} bm{bm} bn{bn}: "
            + ", ".join(f"{nm} {e['max_abs']:.2e} ({r:.2f}x naive)" for nm, e, r in zip(names, errs, ratios)))
    if not rows:
        finding = "backward not available: every backward variant raised ValueError (see the skipped table)."
    else:
        acc32 = [r for r in rows if r[2] == "fp32"]
        worst = max((r for r in acc32), key=lambda r: max(r[11:14]), default=None)
        finding = (f"{len(rows)} backward variants measured; with fp32 accumulators the worst gradient error "
                   f"is {max(worst[11:14]):.2f}x the naive same-precision backward's ({worst[1]}, "
                   f"bm={worst[3]}, bn={worst[4]}), "
                   + ("within" if max(worst[11:14]) <= 3 else "outside")
                   + " the 3x rule of the tests" if worst else f"{len(rows)} backward variants measured.")
        for dname in ("f16", "bf16", "f32"):
            f16acc = [r for r in rows if r[2] == "fp16" and r[1] == dname]
            if f16acc:
                finding += (f"; fp16 accumulators, {dname} inputs: up to "
                            f"{max(max(r[11:14]) for r in f16acc):.1f}x")
        finding += "."
    tables = [Table("Naive same-precision backward (baseline)",
                    ["dtype", "dQ max abs", "dK max abs", "dV max abs", "dQ RMSE", "dK RMSE", "dV RMSE"],
                    naive_rows)]
    if rows:
        tables.append(Table("flashcupy.attention_backward against float64",
                            ["kernel", "dtype", "accum", "block_m", "block_n", "dQ max abs", "dK max abs",
                             "dV max abs", "dQ RMSE", "dK RMSE", "dV RMSE", "dQ / naive", "dK / naive",
                             "dV / naive"], rows))
    if skipped:
        tables.append(Table("Variants that raised ValueError (skipped)",
                            ["kernel", "dtype", "accum", "block_m", "block_n", "reason"], skipped))
    fig, (ax,) = new_figure(width=8)
    if rows:
        x = np.arange(len(rows))
        for j, (nm, mk) in enumerate(zip(("dQ", "dK", "dV"), ("o", "s", "^"))):
            ax.plot(x, [r[11 + j] for r in rows], mk, label=f"{nm} / naive")
        ax.axhline(3.0, color="k", ls="--", lw=1, label="3x (the backward accuracy rule)")
        ax.axhline(1.0, color="gray", ls=":", lw=1)
        ax.set_xticks(x, [f"{r[1]} a{r[2][2:]}\n{r[3]}x{r[4]}" for r in rows], fontsize=6, rotation=90)
        ax.set_ylabel("max abs error / naive same-precision max abs error")
        ax.set_title("Backward: gradient error relative to a naive same-precision backward")
    else:
        x = np.arange(len(naive_rows))
        for j, nm in enumerate(("dQ", "dK", "dV")):
            ax.plot(x, [r[1 + j] for r in naive_rows], "o-", label=f"naive {nm}")
        ax.set_xticks(x, [r[0] for r in naive_rows])
        ax.set_ylabel("max abs error vs float64 (gradient units)")
        ax.set_title("No backward variant ran: naive same-precision baseline only")
    ax.set_yscale("log")
    ax.set_xlabel("variant (dtype, accum, block_m x block_n)" if rows else "dtype")
    ax.legend(fontsize=8)
    setup = {"shapes": f"B={b}, H={h}, N={n}, D={d}, non-causal, scale 1/sqrt(D)",
             "inputs": "q, k, v, dO ~ N(0,1) rounded to the dtype",
             "flashcupy": "o, lse from flashcupy.attention (same accum), then flashcupy.attention_backward "
                          "with each backward family's tiles (build layer FAMILIES, direction 'bwd')",
             "naive backward": "flashcupy.naive.attention_backward: float32 products, results rounded to "
                               "the dtype",
             "truth": "flashcupy.reference.attention_backward (float64)"}
    return Report("backward", "Backward: dQ, dK, dV against float64", finding, setup, tables,
                  figure=fig, figure_caption="Gradient error over the naive same-precision backward's.")

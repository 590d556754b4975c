"""``backward``: dQ, dK, dV of flashcupy against float64, beside the naive same-precision backward of
``flashcupy.naive`` (every product accumulated in float32 and rounded to the input dtype where a
framework would store it, the full score matrix materialised)."""
from __future__ import annotations

import math
import re

import numpy as np

import flashcupy
from flashcupy import naive, reference
from flashcupy.accuracy import FACTOR, tolerance
from flashcupy.inspect import FAMILIES

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


# The backward accuracy rule (flashcupy.accuracy, rule 1): max|g - ref| <= 3 * max|naive - ref| + floor.
BWD_FACTOR = FACTOR["bwd"]


def backward_bound(dname: str, accum: str, naive_err: float, magnitude: float, reduction: int) -> float:
    """The bound on max|g - ref| of one gradient (``flashcupy.accuracy.tolerance``, the rule the tests
    hold the kernels to): ``naive_err`` the naive same-precision backward's max abs error,
    ``magnitude`` max|ref| of that gradient, ``reduction`` the backward's longest accumulation."""
    return tolerance(dname, accum, naive_err, "bwd", magnitude, reduction)


def skip_reason(e: Exception) -> str:
    """Why a variant was skipped: the whole first sentence of the error's message (all of the message where
    it has no sentence end), never cut in the middle."""
    msg = " ".join(str(e).split())
    return re.split(r"(?<=[.!?])\s", msg, maxsplit=1)[0] or type(e).__name__


_GRADS = (("dQ", "o", "tab:blue"), ("dK", "s", "tab:orange"), ("dV", "^", "tab:green"))
_COMBO_ORDER = [("f16", "fp32"), ("bf16", "fp32"), ("f32", "fp32"), ("f16", "fp16"), ("bf16", "fp16"),
                ("f32", "fp16")]


def _pos(x) -> float:
    x = float(x)
    return x if math.isfinite(x) and x > 0 else math.nan


def _ratio_text(x: float) -> str:
    """A ratio for a label: 3 significant digits, thousands with commas (2,480x, not 2.48e+03x)."""
    return f"{x:.3g}x" if x < 100 else f"{float(f'{x:.3g}'):,.0f}x"


def backward_figure(rows, naive_rows, ref_max_abs=None, reduction=None):
    """dQ, dK, dV error over the naive same-precision backward's, on a log axis: one x group per (input
    dtype, accumulator), one slot per kernel family in it, its block sizes pooled (marker: median over the
    tiles, capped bar: min to max); the rule's 3x factor as a dashed line and, per group, the full bound
    (3x naive + floor, the lowest of dQ, dK, dV) as a solid step. ``rows``: the "flashcupy.attention_backward"
    table, ``naive_rows``: the "Naive same-precision backward" table (as in the report and its JSON);
    ``ref_max_abs``: {dtype: [max|dQ|, max|dK|, max|dV|] of the float64 reference} and ``reduction``: the
    longest accumulation, both needed for the floor (without them only the 3x line is drawn)."""
    from matplotlib.lines import Line2D

    naive = {r[0]: [float(x) for x in r[1:4]] for r in naive_rows}
    if not rows:
        fig, (ax,) = new_figure(width=7, height=4.5)
        x = np.arange(len(naive_rows))
        for j, (nm, mk, color) in enumerate(_GRADS):
            ax.plot(x, [_pos(r[1 + j]) for r in naive_rows], mk + "-", color=color, label=f"naive {nm}")
        ax.set_xticks(x, [r[0] for r in naive_rows])
        ax.set_yscale("log")
        ax.set_xlabel("input dtype")
        ax.set_ylabel("max abs error vs float64 (gradient units)")
        ax.set_title("No backward variant ran: the naive same-precision baseline only", fontsize=10)
        ax.legend(fontsize=8)
        return fig

    def bound_ratio(dname, accum, j):
        """The rule's bound over the naive error, for gradient j; None where the floor is unknown."""
        if not (ref_max_abs and reduction and dname in naive and dname in ref_max_abs):
            return None
        ne = naive[dname][j]
        return backward_bound(dname, accum, ne, float(ref_max_abs[dname][j]), int(reduction)) / ne

    combos = [c for c in _COMBO_ORDER if any((r[1], r[2]) == c for r in rows)]
    combos += sorted({(r[1], r[2]) for r in rows} - set(combos))
    kinds = list(dict.fromkeys(r[0] for r in rows))
    # x layout: a slot per family inside each (dtype, accum) group, wider gaps between groups and between
    # the fp32- and fp16-accumulator halves
    slots, centers, x, prev_acc = {}, {}, 0.0, None
    for dname, accum in combos:
        if prev_acc is not None:
            x += 1.0 if accum == prev_acc else 1.6
        fams = [k for k in kinds if any((r[0], r[1], r[2]) == (k, dname, accum) for r in rows)]
        for i, k in enumerate(fams):
            slots[(k, dname, accum)] = x + i
        centers[(dname, accum)] = x + (len(fams) - 1) / 2
        x += len(fams) - 1
        prev_acc = accum
    fig, (ax,) = new_figure(width=9.5, height=5.6)
    offsets = (-0.24, 0.0, 0.24)
    worst, over, nonfinite, spread = {}, 0, 0, 1.0
    for (kind, dname, accum), xs in slots.items():
        rs = [r for r in rows if (r[0], r[1], r[2]) == (kind, dname, accum)]
        for j, (nm, mk, color) in enumerate(_GRADS):
            vals = np.array([_pos(r[11 + j]) for r in rs])
            nonfinite += int((~np.isfinite(vals)).sum())
            vals = vals[np.isfinite(vals)]
            if not len(vals):
                continue
            lo, med, hi = vals.min(), float(np.median(vals)), vals.max()
            spread = max(spread, hi / lo)
            worst[(dname, accum)] = max(worst.get((dname, accum), 0.0), hi)
            xj = xs + offsets[j]
            if hi / lo > 1.001:
                ax.vlines(xj, lo, hi, color=color, lw=1.4, zorder=2)
                ax.hlines([lo, hi], xj - 0.07, xj + 0.07, color=color, lw=1.4, zorder=2)
            ax.plot(xj, med, mk, color=color, ms=5, mec="k", mew=0.4, zorder=3)
            b = bound_ratio(dname, accum, j)
            if b is not None and (vals > b).any():
                over += int((vals > b).sum())
                ax.plot([xj] * int((vals > b).sum()), vals[vals > b], "x", color="red", ms=9, mew=2, zorder=4)
    ax.axhline(1.0, color="gray", ls=":", lw=1)
    ax.axhline(BWD_FACTOR, color="k", ls="--", lw=1)
    have_bound = all(bound_ratio(d, a, 0) is not None for d, a in combos)
    top = max(worst.values()) * 4
    for (dname, accum), c in centers.items():
        bs = [bound_ratio(dname, accum, j) for j in range(3)]
        if None in bs:
            continue
        xs = [v for (k, d, a), v in slots.items() if (d, a) == (dname, accum)]
        ax.hlines(min(bs), min(xs) - 0.42, max(xs) + 0.42, colors="k", lw=1.8)
        ax.annotate(_ratio_text(min(bs)), (c, min(bs)), xytext=(0, 2), textcoords="offset points",
                    ha="center", va="bottom", fontsize=7)
        top = max(top, min(bs) * 4)
    ax.set_yscale("log")
    ax.set_ylim(min(0.1, min(worst.values()) / 3), top)
    ax.set_xlim(-0.6, x + 0.6)
    ax.set_ylabel("max abs error / naive same-precision backward's")
    # family names under each slot, the (dtype, accum) group under those, the accumulator halves on top
    ax.set_xticks(list(slots.values()), [k for k, _, _ in slots], fontsize=8)
    sec = ax.secondary_xaxis(location=0)
    width = {c: sum(1 for (k, d, a) in slots if (d, a) == c) for c in centers}  # slots under each group
    sec.set_xticks(list(centers.values()),
                   [f"{d} inputs" if width[(d, a)] > 1 else f"{d}\ninputs" for d, a in centers], fontsize=9)
    sec.tick_params(axis="x", length=0, pad=16)
    sec.spines["bottom"].set_visible(False)
    sec.set_xlabel("input dtype and backward kernel family; block sizes pooled"
                   + (" (they change no ratio)" if spread <= 1.001 else
                      f" (they change a ratio by at most {spread:.2g}x)")
                   + "\nthe rule (flashcupy.accuracy): max|g - ref| <= 3 max|naive - ref| + floor, the floor "
                     "a few roundings of the dtype\ntimes max|ref| (fp16 accumulators: at least "
                     "2 u16 sqrt(reduction / 16))", fontsize=8)
    for acc in dict.fromkeys(a for _, a in combos):
        cs = [v for (d, a), v in centers.items() if a == acc]
        ax.text((min(cs) + max(cs)) / 2, 0.98, f"{acc} accumulators", transform=ax.get_xaxis_transform(),
                ha="center", va="top", fontsize=9, weight="bold")
    for prev, cur in zip(combos, combos[1:]):
        if prev[1] != cur[1]:
            ax.axvline((max(v for (k, d, a), v in slots.items() if (d, a) == prev)
                        + min(v for (k, d, a), v in slots.items() if (d, a) == cur)) / 2, color="0.6", lw=1)
    # the title: whether every variant meets the rule, then how: fp32 accumulators with a margin, fp16 ones
    # past 3x only through the floor (a non-finite gradient breaks the rule; it has no place on the axis)
    broken = over + nonfinite
    if broken:
        head = (f"{broken} of {3 * len(rows)} gradient errors break the backward rule (3x naive + floor"
                + ("; red x" if over else "") + ("; non-finite ones not drawn" if nonfinite else "") + ")")
    elif not have_bound:
        head = "Backward gradient error over the naive same-precision backward's (the rule's floor unknown)"
    else:
        head = f"All {len(rows)} backward variants meet the rule (3x naive + floor) on dQ, dK and dV"
    parts = []
    w32 = max((v for (d, a), v in worst.items() if a == "fp32"), default=None)
    if w32 is not None:
        parts.append(f"fp32 accumulators: at most {_ratio_text(w32)} naive")
    w16 = {d: v for (d, a), v in worst.items() if a == "fp16"}
    past = [(d, v) for d, v in w16.items() if v > BWD_FACTOR]
    if past:
        parts.append("fp16 accumulators: past 3x ("
                     + ", ".join(f"{d} {_ratio_text(v)}" for d, v in past) + ")"
                     + (", inside only through the floor" if have_bound and not broken else ""))
    elif w16:
        parts.append(f"fp16 accumulators: at most {_ratio_text(max(w16.values()))} naive")
    ax.set_title(head + "\n" + "; ".join(parts), fontsize=10)
    handles = [Line2D([], [], marker=mk, color=color, mec="k", mew=0.4, ls="none", label=f"{nm} / naive")
               for nm, mk, color in _GRADS]
    handles.append(Line2D([], [], color="0.3", ls="none", marker="|", ms=11, mew=1.4,
                          label="over block sizes: median (marker),\nmin to max (bar, where they differ)"))
    handles.append(Line2D([], [], color="k", ls="--", lw=1, label="3x naive (the rule's factor)"))
    if have_bound:
        handles.append(Line2D([], [], color="k", lw=1.8, label="3x naive + floor: the rule\n"
                                                               "(lowest of dQ, dK, dV; value above)"))
    handles.append(Line2D([], [], color="gray", ls=":", lw=1, label="1x (as accurate as naive)"))
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def run_backward(ctx: Context) -> Report:
    b, h, n, d = ctx.sizes((1, 2, 256, 64), (2, 8, 2048, 64))
    names = ("dq", "dk", "dv")
    inputs, naive_rows, naive_err, ref_max_abs = {}, [], {}, {}
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
        ref_max_abs[dname] = [float(np.abs(r).max(initial=0.0)) for r in refs]
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
            reason = skip_reason(e)
            skipped.append([kernel, dname, accum, bm, bn, reason])
            log(f"[backward] {i + 1}/{len(variants)} {kernel} {dname} acc{accum[2:]} bm{bm} bn{bn}: "
                f"skipped: {reason}")
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
    fig = backward_figure(rows, naive_rows, ref_max_abs, n)
    setup = {"shapes": f"B={b}, H={h}, N={n}, D={d}, non-causal, scale 1/sqrt(D)",
             "inputs": "q, k, v, dO ~ N(0,1) rounded to the dtype",
             "flashcupy": "o, lse from flashcupy.attention (same accum), then flashcupy.attention_backward "
                          "with each backward family's tiles (build layer FAMILIES, direction 'bwd')",
             "naive backward": "flashcupy.naive.attention_backward: float32 products, results rounded to "
                               "the dtype",
             "truth": "flashcupy.reference.attention_backward (float64)"}
    data = {"ref_max_abs": ref_max_abs, "reduction": n}
    return Report("backward", "Backward: dQ, dK, dV against float64", finding, setup, tables, data=data,
                  figure=fig,
                  figure_caption="Gradient error over the naive same-precision backward's, per input dtype, "
                                 "accumulator and kernel family (block sizes pooled: median and min to max), "
                                 "against the backward accuracy rule (3x naive + floor).")

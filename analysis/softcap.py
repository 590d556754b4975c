"""``softcap``: flash_attn_func's softcap, S <- c tanh(S / c) on the scaled scores, the error against
float64 against the cap c, and which tanh the kernels take; the fp8 forward with a cap.

Error: per (dtype, accumulator) and cap, the forward's max |o - o_ref| and each gradient's, as multiples of
the naive same-precision attention's error on the same call (the accuracy rule's measure: at most 2x
forward, 3x backward). The scores are drawn so that the cap matters: q, k ~ N(0, 1) with the scale set so
that the scaled scores have a standard deviation of 8, so that a cap of 1 to 5 saturates most of them and
a cap of 100 hardly bends them.

The tanh: the kernels take the MUFU's tanh.approx.f32 (one instruction; PTX documents a relative error of
about 2^-11, and on an H100 its largest absolute error measured 2^-17, ``accuracy.TANH_ABS``) for
16-bit inputs and the accurate tanhf for float32 ones (``kernels_cu/flash_common.cuh``, FC_TANH_APPROX).
An absolute error e in tanh moves a capped score by c e, so P by a relative c e: the approximation's cost
grows with the cap while a 16-bit rounding of the capped score grows with it too (c 2^-11 in fp16); the
backward's 1 - tanh^2 takes an absolute error of about 2 e, which is large against 1 - tanh^2 itself where
tanh saturates. On the CUDA backend each 16-bit combination is also run with the accurate tanh
(``inspect.kernel_build({"FC_TANH_APPROX": 0})``), same inputs; the NumPy twin's tanh is NumPy's.

Cost (the CUDA backend): the wgmma forward and backward with a cap of 30 against the same kernels
without, fp16, on the same inputs (the issue's targets: at most 8% forward, 10% backward). The floor: the
forward's exp2 and tanh both run on the MUFU (16 results per clock per SM), the two of them take 1/8
clock per score element against the tensor cores' 4 D / 4096 = 1/8 clock at D = 128 and 1/16 at D = 64:
unhidden, a softcap could cost up to 2x at D = 64.
"""
from __future__ import annotations

import math

import numpy as np

import flashcupy
from flashcupy import reference
from flashcupy.inspect import kernel_build, numpy_dtype

from .common import (
    Context,
    Report,
    Table,
    errors,
    finish_log_axes,
    log,
    new_figure,
    plot_cost_ratios,
    plot_rule_ratios,
    rule_ratios,
)

COMBOS = [("f16", "fp32"), ("bf16", "fp32"), ("f16", "fp16"), ("f32", "fp32")]
SCORE_STD = 8.0  # standard deviation of the scaled scores


def _error_rows(ctx: Context, b, h, n, d, caps):
    rows = []
    scale = SCORE_STD / math.sqrt(d)
    for dname, accum in COMBOS:
        rng = ctx.rng(f"softcap.{dname}.{accum}")
        dt = numpy_dtype(dname)
        host = tuple(rng.standard_normal((b, h, n, d)).astype(dt) for _ in range(4))
        dev = ctx.dev(*host)
        for cap in caps:
            kw = dict(causal=True, scale=scale, softcap=cap)
            r, within = rule_ratios(dev, host, kw, dname, accum)
            accurate, within_accurate = [math.nan] * 4, None
            if ctx.backend == "cuda" and dname != "f32" and cap:
                with kernel_build(defines={"FC_TANH_APPROX": 0}):
                    accurate, within_accurate = rule_ratios(dev, host, kw, dname, accum)
            rows.append([dname, accum, cap, *r, within, *accurate, within_accurate])
            log(f"[softcap] {dname} acc{accum[2:]} cap={cap}: o {r[0]:.2f}x naive, gradients "
                + ", ".join(f"{x:.2f}x" for x in r[1:])
                + ("" if math.isnan(accurate[0]) else f"; accurate tanh o {accurate[0]:.2f}x, gradients "
                   + ", ".join(f"{x:.2f}x" for x in accurate[1:])))
    return rows


def _fp8_rows(ctx: Context, b, h, n, d, caps):
    """The fp8 (e4m3) forward with each cap, against float64 softcapped attention of what its quantized
    inputs stand for: the relative RMS and the max abs error of o, per accumulation; beside it the fp16
    kernel (fp32 accumulators) on the same dequantized values rounded to fp16, for scale. q, k per token,
    v per head, the scale as in the 16-bit sweep."""
    from flashcupy import fp8

    rng = ctx.rng("softcap.fp8")
    scale = SCORE_STD / math.sqrt(d)
    x = [rng.standard_normal((b, h, n, d)).astype(np.float32) for _ in range(3)]
    qd = [fp8.quantize(a, "e4m3", g) for a, g in zip(x, ("token", "token", "head"))]
    deq = [fp8.dequantize(a).astype(np.float64) for a in qd]
    dev = [fp8.quantize(a, "e4m3", g) for a, g in zip(ctx.dev(*x), ("token", "token", "head"))]
    f16 = ctx.dev(*(a.astype(np.float16) for a in deq))
    rows = []
    for cap in caps:
        ref = reference.attention(*deq, causal=True, scale=scale, softcap=cap)
        rms = float(np.sqrt(np.mean(ref ** 2)))
        o16 = flashcupy.attention(*f16, causal=True, scale=scale, softcap=cap)
        e16 = errors(o16, ref)
        for acc in ("single", "tile"):
            o = flashcupy.attention_fp8(*dev, causal=True, scale=scale, softcap=cap, accumulation=acc)
            e = errors(o, ref)
            rows.append([acc, cap, e["rmse"] / rms, e["max_abs"], e16["rmse"] / rms])
            log(f"[softcap] fp8 {acc} cap={cap}: o relative RMS error {e['rmse'] / rms:.2e} "
                f"(fp16 {e16['rmse'] / rms:.2e}), max abs {e['max_abs']:.2e}")
    return rows


def _break_rows(ctx: Context, n, d, caps):
    """The mask-order break (``ablate="softcap_after_mask"``, on the NumPy twin: no kernel compiles it),
    causal: per cap, the probability mass that leaks onto masked keys, measured per row as
    1 - exp(lse_ref - lse_broken) (the broken denominator over the true one), against the prediction
    M e^(-c - lse_ref) / (1 + M e^(-c - lse_ref)) for a row with M masked keys, each leaking e^-c."""
    rng = ctx.rng("softcap.break")
    q, k, v = (rng.standard_normal((1, 2, n, d)).astype(np.float32) for _ in range(3))
    scale = SCORE_STD / math.sqrt(d)
    masked = (n - 1 - np.arange(n)).astype(np.float64)  # masked keys of each causal row
    rows = []
    for cap in caps:
        kw = dict(causal=True, scale=scale, softcap=cap)
        o_ref, lse_ref = reference.attention(q, k, v, return_lse=True, **kw)
        o, lse = flashcupy.attention(q, k, v, return_lse=True, ablate="softcap_after_mask", **kw)
        leak = 1.0 - np.exp(lse_ref - lse.astype(np.float64))
        x = masked * np.exp(-cap - lse_ref)
        pred = x / (1.0 + x)
        half = n // 2
        rows.append([cap, float(leak.max()), float(np.median(leak[..., :half])),
                     float(np.median(leak[..., half:])), float(np.abs(leak - pred).max()),
                     float(np.abs(o - o_ref).max())])
        log(f"[softcap] mask-order break, cap={cap}: leaked mass up to {rows[-1][1]:.3g}, |measured - "
            f"predicted| <= {rows[-1][4]:.2g}, o off by up to {rows[-1][5]:.3g}")
    return rows


def _cost_rows(ctx: Context, b, h, shapes, cap):
    import cupy

    from .bench import _device_us

    rows = []
    for n, d, causal in shapes:
        rng = ctx.rng(f"softcap.cost.{n}.{d}")
        q, k, v, do = (cupy.asarray(rng.standard_normal((b, h, n, d)).astype(np.float16)) for _ in range(4))
        res = {}
        for c in (0.0, cap):
            kw = dict(causal=causal, softcap=c, kernel="wgmma")
            o, lse = flashcupy.attention(q, k, v, return_lse=True, **kw)
            fwd = [_device_us(lambda: flashcupy.attention(q, k, v, **kw), 10) for _ in range(3)]
            bwd = [_device_us(lambda: flashcupy.attention_backward(do, q, k, v, o, lse, **kw), 10)
                   for _ in range(3)]
            res[c] = (float(np.median(fwd)), float(np.median(bwd)))
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        (pf, pb), (cf, cb) = res[0.0], res[cap]
        rows.append([n, d, "causal" if causal else "full", pf, cf, cf / pf, flops / cf / 1e6, pb, cb, cb / pb,
                     2.5 * flops / cb / 1e6])
        log(f"[softcap] cost N={n} D={d} causal={causal}: fwd {cf:.0f} us ({cf / pf:.3f}x plain), "
            f"bwd {cb:.0f} us ({cb / pb:.3f}x)")
    return rows


def run_softcap(ctx: Context) -> Report:
    b, h, n, d = ctx.sizes((1, 2, 256, 32), (1, 4, 2048, 64))
    # cap 0 first: the same calls without a softcap, the control each capped row is read against
    caps = ctx.sizes([0.0, 1.0, 5.0, 30.0, 100.0], [0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 50.0, 100.0])
    rows = _error_rows(ctx, b, h, n, d, caps)
    capped = [r for r in rows if r[2]]
    what = "the kernels" if ctx.backend == "cuda" else "the NumPy twin"

    def worst(sel, cols):
        return max(max(r[cols]) for r in sel)

    finding = (f"Over caps {caps[1]:g} to {caps[-1]:g} (scaled scores of standard deviation {SCORE_STD:g}), "
               f"the worst error of {what} over the naive same-precision error is "
               + ", ".join(f"{worst(sel, slice(3, 4)):.2f}x forward / {worst(sel, slice(4, 7)):.2f}x "
                           f"backward for {c[0]} acc {c[1]} (without a cap {worst(ctl, slice(3, 4)):.2f}x / "
                           f"{worst(ctl, slice(4, 7)):.2f}x)"
                           for c in COMBOS
                           for sel, ctl in [([r for r in capped if (r[0], r[1]) == c],
                                             [r for r in rows if (r[0], r[1]) == c and not r[2]])])
               + f" (the rule: 2x, 3x, plus its noise floor; capped cells within it: "
               f"{sum(bool(r[7]) for r in capped)} of {len(capped)})")
    if ctx.backend == "cuda":
        arms = [r for r in capped if r[0] != "f32" and r[1] == "fp32"]
        gap = max(abs(a - b_) for r in arms for a, b_ in zip(r[3:7], r[8:12]))
        finding += (f"; tanh.approx against the accurate tanh, 16-bit inputs with fp32 accumulators: the "
                    f"ratios differ by at most {gap:.2f}")
    tables = [Table(f"Error against float64 by cap (causal, B x H = {b} x {h}, N = {n}, D = {d}; scaled "
                    f"scores of standard deviation {SCORE_STD:g}); max error over the naive same-precision "
                    "max error",
                    ["dtype", "accum", "cap", "o", "dQ", "dK", "dV", "within the rule", "o (accurate tanh)",
                     "dQ (accurate)", "dK (accurate)", "dV (accurate)", "within the rule (accurate)"], rows)]
    fb, fh, fn, fd = ctx.sizes((1, 2, 128, 128), (1, 4, 2048, 128))  # the fp8 kernel runs D 128, 256
    f8 = _fp8_rows(ctx, fb, fh, fn, fd, caps)
    ctl = max(r[2] for r in f8 if not r[1])
    worst8 = max(r[2] for r in f8 if r[1])
    finding += (f"; the fp8 forward's relative RMS error over the caps is at most {worst8:.2e}, against "
                f"{ctl:.2e} without a cap (fp16 inputs of the same values: "
                f"{max(r[4] for r in f8):.2e})")
    tables.append(Table(f"The fp8 (e4m3) forward by cap (causal, B x H = {fb} x {fh}, N = {fn}, D = {fd}; "
                        f"q, k per token, v per head; scaled scores of standard deviation {SCORE_STD:g}), "
                        "against float64 on the dequantized inputs",
                        ["accumulation", "cap", "o relative RMS error", "o max abs error",
                         "fp16 kernel, same values: relative RMS error"], f8))
    bn = ctx.sizes(256, 1024)
    brk = _break_rows(ctx, bn, 64, caps[1:])
    worst_gap = max(r[4] for r in brk)
    leaky = [r[0] for r in brk if r[1] > 1e-4]  # (below, the float32 LSE's own rounding, about 1e-5)
    finding += (f"; the mask-order break (the softcap after the mask: masked keys at -c) leaks up to "
                f"{brk[0][1]:.3g} of the probability mass at a cap of {brk[0][0]:g}, more than 1e-4 at "
                f"caps up to {max(leaky, default=float('nan')):g} and less from "
                f"{min((r[0] for r in brk if r[0] not in leaky), default=float('nan')):g}, as the "
                f"prediction of e^-c per masked key says, to within {worst_gap:.1g}")
    tables.append(Table(f"The mask-order break on the twin (causal, N = {bn}, D = 64, float32, scaled scores "
                        f"of standard deviation {SCORE_STD:g}): probability leaked onto masked keys, "
                        "1 - exp(lse_ref - lse_broken)",
                        ["cap", "leaked, worst row", "leaked, median of the first half of the rows (most "
                         "masked keys)", "leaked, median of the second half", "|measured - predicted|, worst",
                         "o max abs error"], brk))
    cost = []
    if ctx.backend == "cuda":
        cb, ch = ctx.sizes((1, 16), (1, 16))
        shapes = ctx.sizes([(4096, 64, True), (4096, 128, True)],
                           [(n_, d_, c_) for n_ in (4096, 16384) for d_ in (64, 128) for c_ in (False, True)])
        cost = _cost_rows(ctx, cb, ch, shapes, 30.0)
        worst_fc = max(r[5] for r in cost)
        worst_bc = max(r[9] for r in cost)
        finding += (f"; a cap of 30 costs the wgmma forward up to {worst_fc:.3f}x its plain time and the "
                    f"backward up to {worst_bc:.3f}x (targets 1.08x, 1.10x)")
        tables.append(Table(f"Cost of a cap of 30 on the wgmma kernels, fp16, B x H = {cb} x {ch} (device "
                            "time per call, median of 3 x 10)",
                            ["N", "D", "mask", "plain fwd us", "softcap fwd us", "fwd / plain", "fwd TFLOP/s",
                             "plain bwd us", "softcap bwd us", "bwd / plain", "bwd TFLOP/s"], cost))
    else:
        finding += "; the timing runs on the CUDA backend only"
    finding += "."

    fig, axes = new_figure(ncols=3 if cost else 2, width=6.5)
    ax = axes[0]
    sels = [(f"{dn} acc {ac}", [r for r in capped if (r[0], r[1]) == (dn, ac)]) for dn, ac in COMBOS]
    plot_rule_ratios(ax, [(label, [r[2] for r in sel], [r[3] for r in sel], [max(r[4:7]) for r in sel])
                          for label, sel in sels])
    ax.set_xlabel("softcap c")
    ax.set_title("Error against the cap", fontsize=10)
    ax = axes[1]
    ax.plot([r[0] for r in brk], [r[1] for r in brk], marker="o", label="worst row")
    ax.plot([r[0] for r in brk], [r[2] for r in brk], marker="s",
            label="median, rows with the most masked keys")
    ax.plot([r[0] for r in brk], [r[3] for r in brk], marker="x", label="median, rows with the fewest")
    ax.axhline(1e-5, color="k", lw=1, ls=":", label="the float32 LSE's resolution (about 1e-5): noise below")
    finish_log_axes(ax, "softcap c", "probability mass on masked keys", "The softcap after the mask (twin)")
    if cost:
        plot_cost_ratios(axes[2], [f"N={r[0]} D={r[1]} {r[2]}" for r in cost], [r[5] for r in cost],
                         [r[9] for r in cost], "time with a cap of 30 / time without",
                         "The softcap's cost (wgmma, fp16)", targets=(1.08, 1.10))
    setup = {"error shapes": f"B={b}, H={h}, Nq=Nk={n}, D={d}, causal; q, k, v, dO ~ N(0, 1) rounded to the "
                             f"dtype; scale {SCORE_STD:g} / sqrt(D)",
             "caps": str(caps),
             "kernel": "kernel='auto', default tiles (the wgmma backward takes 64 query rows with a softcap)",
             "error measure": "max |x - x_ref| over the naive same-precision attention's, x_ref float64"}
    if cost:
        setup["cost"] = ("fp16, kernel='wgmma', default tiles (the backward with a cap on 64 query rows, "
                         "without on 80 or 128: the ratio includes the tile), cap 30; device time per call "
                         "between CUDA events, median of 3 rounds of 10")
    return Report("softcap", "Softcap: error against the cap, the tanh, and the cost", finding, setup, tables,
                  figure=fig, figure_caption="Left: error over the naive baseline's against the cap; right: "
                  "time with a cap over the plain kernel's.",
                  notes=[__doc__.split("\n\n")[2].replace("\n", " ")])

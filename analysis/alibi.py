"""``alibi``: ALiBi (flash_attn_func's ``alibi_slopes``: the scaled score of query i and key j loses
a |i + Nk - Nq - j|) against float64, where the kernels' rounding of the biased score matters, and the
cost.

The rule: per (dtype, accumulator) and case, the forward's and the gradients' max error over the naive
same-precision attention's (the accuracy rule's measure: at most 2x forward, 3x backward). The naive adds
the bias in float32 to its rounded scores. The cases: a causal square, a square without a mask, a
(64, 64) window, and Nq > Nk without a mask, where the first Nq - Nk rows see only keys ahead of their
diagonal, far from it. The slopes are ALiBi's 2^(-8 h / H), h = 1 .. H.

Far rows: row i of that last case sits at d0 = Nq - Nk - i from its nearest key. The kernels hold the
biased score in the accumulator type. Measured from i' itself, t = s - (a / scale) |i' - j| is about
-(a / scale) d0 in such a row, and with fp16 accumulators every logit then carries a rounding of up to
scale * spacing_fp16(|t|) / 2: a limit that grows with the distance and that the naive, adding the
bias in float32, does not have. The kernels measure from max(i', 0) instead: softmax is shift-invariant,
so taking a d0 off every score of the row (and giving it back to the LSE) changes nothing but the
rounding. The table bins the rows by d0 and gives each bin's worst error of o for the kernels with fp16
and fp32 accumulators, for fp16 accumulators measured from i' (``ablate="alibi_unshifted"``, on the
twin), and the predicted rounding of the unshifted score for the steepest head (a = 2^(-8/H)).

Cost (the CUDA backend): the wgmma forward and backward with ALiBi against the same kernels without, fp16.
"""
from __future__ import annotations

import math

import numpy as np

import flashcupy
from flashcupy import reference
from flashcupy.inspect import numpy_dtype

from .common import Context, Report, Table, finish_log_axes, log, new_figure, plot_cost_ratios, rule_ratios

COMBOS = [("f16", "fp32"), ("bf16", "fp32"), ("f16", "fp16"), ("f32", "fp32")]


def slopes(h: int) -> np.ndarray:
    """ALiBi's geometric slopes for H heads (Press et al.): 2^(-8 h / H), h = 1 .. H, float32."""
    return (2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32)


def _rule_rows(ctx: Context, b, h, d, cases):
    rows = []
    sl = slopes(h)
    for dname, accum in COMBOS:
        dt = numpy_dtype(dname)
        for name, nq, nk, mask in cases:
            rng = ctx.rng(f"alibi.{dname}.{accum}.{name}")
            q, do = (rng.standard_normal((b, h, nq, d)).astype(dt) for _ in range(2))
            k, v = (rng.standard_normal((b, h, nk, d)).astype(dt) for _ in range(2))
            host = (q, k, v, do)
            kw = dict(mask, alibi_slopes=sl)
            r, within = rule_ratios(ctx.dev(*host), host, kw, dname, accum)
            rows.append([dname, accum, name, nq, nk, *r, within])
            log(f"[alibi] {dname} acc{accum[2:]} {name}: o {r[0]:.2f}x naive, gradients "
                + ", ".join(f"{x:.2f}x" for x in r[1:]) + ("" if within else " (outside the rule)"))
    return rows


def _logit_rounding(dist: float, slope: float, scale: float) -> float:
    """Half the fp16 spacing at the biased raw score of a key ``dist`` away, in logit units."""
    t = slope / scale * dist
    return scale * 2.0 ** (math.floor(math.log2(t)) - 11) if t > 0 else 0.0


def _far_rows(ctx: Context, h, nk, far, d):
    """Nq = Nk + far queries, no mask, fp16 inputs: per bin of d0 (powers of 4), the worst max |o - o_ref|
    of its rows for fp16 and fp32 accumulators, and the predicted logit rounding at the bin's largest
    d0 for the steepest head."""
    sl = slopes(h)
    nq = nk + far
    scale = 1.0 / math.sqrt(d)
    rng = ctx.rng("alibi.far")
    q = rng.standard_normal((1, h, nq, d)).astype(np.float16)
    k, v = (rng.standard_normal((1, h, nk, d)).astype(np.float16) for _ in range(2))
    ref = reference.attention(q, k, v, alibi_slopes=sl)
    d0 = np.maximum(nq - nk - np.arange(nq), 0)  # distance of each row from its nearest key
    err = {}
    for arm, accum, inputs, ablate in (("fp16", "fp16", ctx.dev(q, k, v), None),
                                       ("fp32", "fp32", ctx.dev(q, k, v), None),
                                       ("unshifted", "fp16", (q, k, v), "alibi_unshifted")):  # (the twin)
        o = flashcupy.attention(*inputs, accum=accum, alibi_slopes=sl, ablate=ablate,
                                kernel="auto" if ablate is None else "mma")
        err[arm] = errors_rows(o, ref).max(axis=(0, 1, 3))  # per row, over batch, heads and columns
    rows = []
    edges = [0, 1] + [4 ** e for e in range(1, 12) if 4 ** (e - 1) < far + 1]
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (d0 >= lo) & (d0 < hi)
        if not sel.any():
            continue
        top = int(d0[sel].max())
        rounding = _logit_rounding(top, float(sl[0]), scale) if top else 0.0
        rows.append([f"[{lo}, {hi})", int(sel.sum()), float(err["fp16"][sel].max()),
                     float(err["fp32"][sel].max()), float(err["unshifted"][sel].max()), rounding])
        log(f"[alibi] far rows d0 in [{lo}, {hi}): o error {rows[-1][2]:.2e} (fp16 accumulators), "
            f"{rows[-1][3]:.2e} (fp32), {rows[-1][4]:.2e} (fp16 measured from i'); logit rounding "
            f"{rows[-1][5]:.1e}")
    return rows, d0, err


def errors_rows(o, ref) -> np.ndarray:
    """|o - ref| elementwise in float64, o from either backend."""
    from flashcupy.reference import to_float64

    return np.abs(to_float64(o) - np.asarray(ref, dtype=np.float64))


def _cost_rows(ctx: Context, b, h, shapes):
    import cupy

    from .bench import _device_us

    rows = []
    for n, d, causal in shapes:
        rng = ctx.rng(f"alibi.cost.{n}.{d}")
        q, k, v, do = (cupy.asarray(rng.standard_normal((b, h, n, d)).astype(np.float16)) for _ in range(4))
        sl = cupy.asarray(slopes(h))
        res = {}
        for arm in ("plain", "alibi"):
            kw = dict(causal=causal, kernel="wgmma", **({"alibi_slopes": sl} if arm == "alibi" else {}))
            o, lse = flashcupy.attention(q, k, v, return_lse=True, **kw)
            fwd = [_device_us(lambda: flashcupy.attention(q, k, v, **kw), 10) for _ in range(3)]
            bwd = [_device_us(lambda: flashcupy.attention_backward(do, q, k, v, o, lse, **kw), 10)
                   for _ in range(3)]
            res[arm] = (float(np.median(fwd)), float(np.median(bwd)))
        (pf, pb), (af, ab) = res["plain"], res["alibi"]
        rows.append([n, d, "causal" if causal else "full", pf, af, af / pf, pb, ab, ab / pb])
        log(f"[alibi] cost N={n} D={d} causal={causal}: fwd {af / pf:.3f}x plain, bwd {ab / pb:.3f}x")
    return rows


def run_alibi(ctx: Context) -> Report:
    b, h, d = ctx.sizes((1, 4, 32), (1, 8, 64))
    n = ctx.sizes(128, 1024)
    cases = [("causal", n, n, dict(causal=True)), ("no mask", n, n, {}),
             ("window (64, 64)", n, n, dict(window_size=(64, 64))),
             ("Nq > Nk, no mask", n + n // 2, n // 2, {})]
    rule = _rule_rows(ctx, b, h, d, cases)
    what = "the kernels" if ctx.backend == "cuda" else "the NumPy twin"
    outside = sorted({f"{r[0]} acc {r[1]} ({r[2]})" for r in rule if not r[9]})
    finding = (f"{sum(bool(r[9]) for r in rule)} of {len(rule)} cells of {what} lie within the accuracy rule "
               f"(worst {max(r[5] for r in rule):.2f}x forward, {max(max(r[6:9]) for r in rule):.2f}x "
               "backward, noise floor included; Nq > Nk included); outside it: "
               + (", ".join(outside) if outside else "none"))
    fh, fnk, far = ctx.sizes((4, 32, 256), (8, 256, 4096))
    far_rows, d0, ferr = _far_rows(ctx, fh, fnk, far, 64)
    worst = max(far_rows, key=lambda r: r[4])
    finding += (f"; rows up to {far} places from their keys keep fp16 accumulators at "
                f"{max(r[2] for r in far_rows):.2e} at worst (fp32 accumulators "
                f"{max(r[3] for r in far_rows):.2e}) because the kernels measure them from key 0; measured "
                f"from i' they reach {worst[4]:.2e} "
                f"(d0 in {worst[0]}), in step with the fp16 rounding of the biased score there "
                f"({worst[5]:.1e} per logit)")
    tables = [
        Table(f"The accuracy rule with ALiBi (B x H = {b} x {h}, D = {d}; slopes 2^(-8h/{h})): max error "
              "over the naive same-precision max error",
              ["dtype", "accum", "case", "Nq", "Nk", "o", "dQ", "dK", "dV", "within the rule"], rule),
        Table(f"Rows far from their keys (fp16 inputs, H = {fh}, Nk = {fnk}, Nq = Nk + {far}, D = 64, no "
              "mask): worst max |o - o_ref| per bin of d0, the distance to the nearest key",
              ["d0", "rows", "fp16 accumulators", "fp32 accumulators",
               "fp16 accumulators, measured from i' (twin)",
               "fp16 rounding of the score measured from i', steepest head (logit units)"], far_rows)]
    cost = []
    if ctx.backend == "cuda":
        cb, ch = 1, 16
        shapes = ctx.sizes([(4096, 64, True), (4096, 128, True)],
                           [(n_, d_, c_) for n_ in (4096, 16384) for d_ in (64, 128) for c_ in (False, True)])
        cost = _cost_rows(ctx, cb, ch, shapes)
        fwd, bwd = [r[5] for r in cost], [r[8] for r in cost]
        finding += (f"; ALiBi costs the wgmma forward {min(fwd):.2f}-{max(fwd):.2f}x its plain time and the "
                    f"backward {min(bwd):.2f}-{max(bwd):.2f}x")
        tables.append(Table(f"Cost of ALiBi on the wgmma kernels, fp16, B x H = {cb} x {ch} (device time per "
                            "call, median of 3 x 10)",
                            ["N", "D", "mask", "plain fwd us", "ALiBi fwd us", "fwd / plain", "plain bwd us",
                             "ALiBi bwd us", "bwd / plain"], cost))
    else:
        finding += "; the timing runs on the CUDA backend only"
    finding += "."

    fig, axes = new_figure(ncols=2 if cost else 1, width=6.5)
    ax = axes[0]
    keep = d0 > 0
    for arm, marker, label in (("unshifted", "^", "fp16 accumulators, measured from i' (twin)"),
                               ("fp16", "o", "fp16 accumulators (the kernels: from max(i', 0))"),
                               ("fp32", "x", "fp32 accumulators")):
        ax.scatter(d0[keep], ferr[arm][keep], s=6, marker=marker, label=label)
    xs = np.unique(d0[keep])
    ax.plot(xs, [_logit_rounding(x, float(slopes(fh)[0]), 1.0 / math.sqrt(64)) for x in xs], color="k", lw=1,
            label="fp16 rounding of the score measured from i' (logit units)")
    finish_log_axes(ax, "d0: distance from the row's nearest key", "max |o - o_ref| of the row",
                    "ALiBi far from the diagonal (fp16 inputs)")
    if cost:
        plot_cost_ratios(axes[1], [f"N={r[0]} D={r[1]} {r[2]}" for r in cost], [r[5] for r in cost],
                         [r[8] for r in cost], "time with ALiBi / time without",
                         "The cost of ALiBi (wgmma, fp16)")
    setup = {"rule shapes": f"B={b}, H={h}, D={d}; q, k, v, dO ~ N(0, 1) rounded to the dtype; default "
                            f"scale; cases {[c[:3] for c in cases]}",
             "slopes": f"2^(-8 h / H), h = 1 .. H (the steepest {float(slopes(h)[0]):g})",
             "far rows": f"fp16 inputs, B=1, H={fh}, Nk={fnk}, Nq={fnk + far}, D=64, no mask, kernel='auto'",
             "error measure": "max |x - x_ref| over the naive same-precision attention's, x_ref float64"}
    if cost:
        setup["cost"] = ("fp16, kernel='wgmma', default tiles; device time per call between CUDA events, "
                         "median of 3 rounds of 10")
    return Report("alibi", "ALiBi: the accuracy rule, rows far from their keys, the cost", finding, setup,
                  tables, figure=fig, figure_caption="Left: each row's error against its distance from its "
                  "nearest key; right: time with ALiBi over the plain kernel's.",
                  notes=[__doc__.split("\n\n")[2].replace("\n", " ")])

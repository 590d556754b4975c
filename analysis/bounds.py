"""``bounds``: the softmax probabilities the kernel computes, against the Blanchard-Higham-Higham bound.

The public API returns o and lse, not P. But o = P V, so with V the one-hot columns of a block of D keys
(v_j = e_{j - j0} for j0 <= j < j0 + D, 0 elsewhere) the output *is* the block's columns of P, as the
kernel computes them: exp(s - m) rounded to the element type before P V, accumulated (one nonzero
product per output element, so exact in any accumulator), divided by the kernel's running sum l and
rounded to the element type on output. Nk / D such runs recover the whole of P.

Per softmax row we report max_j |P^_ij - P_ij| / P_ij over the unit roundoff u of the computation's
lowest precision (element type or accumulator), with P in float64 from the same rounded inputs, over
the entries whose true value is a normal number of the output type (subnormal outputs carry no
relative accuracy and the bound does not cover underflow; their count is reported). The bound for the
shifted softmax is (n + 2 + 2 (x_max - x_min)) u, Blanchard, Higham and Higham, "Accurately computing
the log-sum-exp and softmax functions", IMA J. Numer. Anal. 41 (2021), with n = Nk and x the row's
scaled scores.
"""
from __future__ import annotations

import numpy as np

import flashcupy
from flashcupy.inspect import numpy_dtype
from flashcupy.reference import to_float64

from .accuracy import COMBOS
from .common import SMALLEST_NORMAL, UNIT_ROUNDOFF, Context, Report, Table, log, new_figure


def kernel_probabilities(ctx, q, k, accum, scale=None):
    """P (B, H, Nq, Nk) as flashcupy computes it, read through one-hot value blocks (see module doc)."""
    b, h, nq, d = q.shape
    nk = k.shape[2]
    qx, kx = ctx.dev(q, k)
    blocks = []
    for j0 in range(0, nk, d):
        j1 = min(nk, j0 + d)
        v = np.zeros((b, k.shape[1], nk, d), dtype=q.dtype)
        idx = np.arange(j0, j1)
        v[:, :, idx, idx - j0] = 1
        o = flashcupy.attention(qx, kx, ctx.dev(v), accum=accum, scale=scale)
        blocks.append(to_float64(o)[..., : j1 - j0])
    return np.concatenate(blocks, axis=-1)


def run_bounds(ctx: Context) -> Report:
    b, h, nq, nk, d = ctx.sizes((1, 2, 256, 512, 64), (1, 4, 1024, 2048, 128))
    q_scales = ctx.sizes([1.0, 3.0, 6.0], [1.0, 3.0, 6.0])
    rows, scatter = [], {}
    for dname, accum in COMBOS:
        for qs in q_scales:
            rng = ctx.rng(f"bounds.{dname}.{qs}")
            dt = numpy_dtype(dname)
            q = (qs * rng.standard_normal((b, h, nq, d))).astype(dt)
            k = rng.standard_normal((b, h, nk, d)).astype(dt)
            scale = 1.0 / np.sqrt(d)
            x = scale * np.matmul(to_float64(q), np.swapaxes(to_float64(k), -1, -2))
            p = np.exp(x - x.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            p_hat = kernel_probabilities(ctx, q, k, accum)
            u = max(UNIT_ROUNDOFF[dname], UNIT_ROUNDOFF[accum])
            tiny = SMALLEST_NORMAL[dname] if accum == "fp32" else max(SMALLEST_NORMAL[dname],
                                                                      SMALLEST_NORMAL["f16"])
            normal = p >= tiny
            with np.errstate(divide="ignore", invalid="ignore"):
                rel = np.where(normal, np.abs(p_hat - p) / p, 0.0)
            measured = rel.max(axis=-1).ravel() / u
            bound = (nk + 2 + 2 * (x.max(axis=-1) - x.min(axis=-1))).ravel()
            over = int((measured > bound).sum())
            rows.append([dname, accum, qs, u, float(np.median(measured)), float(np.quantile(measured, 0.99)),
                         float(measured.max()), float(bound.min()), float(bound.max()), over,
                         measured.size, int((~normal).sum()), float((measured / bound).max())])
            scatter[(dname, accum, qs)] = (bound, measured)
            log(f"[bounds] {dname} acc{accum[2:]} q x{qs}: max rel err {measured.max():.2f} u, "
                f"bound >= {bound.min():.0f} u, {over} rows over")
    total_over = sum(r[9] for r in rows)
    worst = max(rows, key=lambda r: r[12])
    finding = (f"{total_over} of {sum(r[10] for r in rows)} softmax rows exceed the Blanchard-Higham-Higham "
               f"bound (n + 2 + 2(x_max - x_min))u; the measured relative error of the kernel's "
               f"probabilities stays at most {max(r[6] for r in rows):.1f} u (worst fraction of the bound: "
               f"{worst[12]:.3f}, {worst[0]} accum {worst[1]}, q x{worst[2]:g}).")
    # one column per (dtype, accumulator): each row's measured error over its own bound, jittered sideways,
    # so that no configuration hides another; the bound is the line at 1
    fig, (ax,) = new_figure()
    jitter = np.random.default_rng(0)
    labels, worst = [], 0.0
    for (dname, accum, qs), (bound, measured) in scatter.items():
        if qs != q_scales[-1]:
            continue
        worst = max(worst, float(np.nanmax(measured / bound)))
        sel = jitter.permutation(bound.size)[:2000]
        x = len(labels) + jitter.uniform(-0.3, 0.3, sel.size)
        ax.scatter(x, np.maximum(measured[sel], 1e-3) / bound[sel], s=4, alpha=0.4)
        labels.append(f"{dname}\nacc {accum}")
    ax.axhline(1.0, color="k", lw=1.5, label="the bound: (n + 2 + 2(x_max - x_min)) u")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("input dtype and accumulator (each dot: one softmax row)")
    ax.set_ylabel("max relative error of P in the row / the row's bound")
    verdict = (f"every row below it (the largest at {worst:.2g} of its bound)" if worst <= 1.0 else
               f"rows above it (up to {worst:.3g}x its bound)")
    ax.set_title(f"Softmax rows (q x{q_scales[-1]}) against the Blanchard-Higham-Higham bound:\n{verdict}",
                 fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    setup = {"shapes": f"B={b}, H={h}, Nq={nq}, Nk=n={nk}, D={d}, non-causal, scale 1/sqrt(D)",
             "inputs": f"q ~ c * N(0,1) with c in {q_scales} (wider score ranges), k ~ N(0,1), rounded to "
                       "the dtype",
             "what is measured": "the kernel's own P, read through one-hot V blocks (o = P V with "
                                 "V = [I; 0]); per row max_j |P^_ij - P_ij| / P_ij over entries with P_ij "
                                 "a normal number of the output type, divided by u = max(u(dtype), u(accum))",
             "bound": "(n + 2 + 2(x_max - x_min)) u, x = the row's scaled scores "
                      "(Blanchard, Higham, Higham 2021)",
             "kernel": "kernel='auto', default tiles"}
    return Report("bounds", "Softmax probabilities against the Blanchard-Higham-Higham bound", finding, setup,
                  [Table("Per (dtype, accum, q scale): relative error of P per row, in units of u",
                         ["dtype", "accum", "q scale", "u", "median", "99th percentile", "max", "bound min",
                          "bound max", "rows over bound", "rows", "subnormal entries excluded",
                          "max measured/bound"], rows)],
                  figure=fig, figure_caption="Each point is one softmax row; the line is the bound.",
                  notes=[__doc__.split("\n\n")[1].replace("\n", " ")])

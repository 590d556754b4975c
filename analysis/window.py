"""``window``: sliding windows (``window_size=(w, 0)`` with ``causal=True``: each query row sees its
own key and the w before it), the error against float64 and the cost, against the window's width.

Error: per (dtype, accumulator), the forward's max |o - o_ref| and each gradient's, as multiples of the
naive same-precision attention's error on the same call (the accuracy rule's measure: at most 2x
forward, 3x backward with fp32 accumulators). A window shortens every row's sums to at most w + 1 keys:
the naive and the tiled computations both see shorter sums, so the ratio should stay put while both
errors fall with w.

Cost (the CUDA backend): the default (wgmma on Hopper) forward and backward, fp16, timed with CUDA events
against the causal kernel on the same inputs. The kernels visit only the key tiles that the window
reaches, so the time should follow the visible score elements, (w + 1) N - w (w + 1) / 2 of the causal
kernel's N (N + 1) / 2, plus a cost per query tile that a short row no longer hides
(``docs/design/score_variants.md``). The NumPy backend skips the timing.
"""
from __future__ import annotations

import numpy as np

import flashcupy
from flashcupy import naive, reference
from flashcupy.inspect import numpy_dtype

from .common import Context, Report, Table, errors, finish_log_axes, log, new_figure, plot_rule_ratios

COMBOS = [("f16", "fp32"), ("bf16", "fp32"), ("f16", "fp16"), ("f32", "fp32")]


def _visible(n: int, w: int | None) -> int:
    """Score elements a causal window of w keys (None: causal) leaves visible in an N x N problem."""
    if w is None or w >= n - 1:
        return n * (n + 1) // 2
    return (w + 1) * n - w * (w + 1) // 2


def _error_rows(ctx: Context, b, h, n, d, windows):
    rows = []
    for dname, accum in COMBOS:
        rng = ctx.rng(f"window.{dname}")
        dt = numpy_dtype(dname)
        q, k, v, do = (rng.standard_normal((b, h, n, d)).astype(dt) for _ in range(4))
        dev = ctx.dev(q, k, v, do)
        for w in windows:
            kw = dict(causal=True, window_size=(-1, -1) if w is None else (w, 0))
            o, lse = flashcupy.attention(*dev[:3], accum=accum, return_lse=True, **kw)
            o_ref = reference.attention(q, k, v, **kw)
            o_naive = naive.attention(*dev[:3], **kw)
            grads = flashcupy.attention_backward(dev[3], *dev[:3], o, lse, accum=accum, **kw)
            refs = reference.attention_backward(do, q, k, v, **kw)
            naives = naive.attention_backward(dev[3], *dev[:3], **kw)
            e_o, n_o = errors(o, o_ref)["max_abs"], errors(o_naive, o_ref)["max_abs"]
            ratios = [errors(g, r)["max_abs"] / max(errors(x, r)["max_abs"], 1e-300)
                      for g, r, x in zip(grads, refs, naives)]
            rows.append([dname, accum, "causal" if w is None else w, _visible(n, w) / n, e_o, n_o, e_o / n_o,
                         *ratios])
            log(f"[window] {dname} acc{accum[2:]} w={w}: o {e_o:.2e} ({e_o / n_o:.2f}x naive), gradients "
                + ", ".join(f"{r:.2f}x" for r in ratios))
    return rows


def _cost_rows(ctx: Context, b, h, n, d, windows):
    import cupy

    from .bench import _device_us

    rng = ctx.rng("window.cost")
    q, k, v, do = (cupy.asarray(rng.standard_normal((b, h, n, d)).astype(np.float16)) for _ in range(4))
    rows, base = [], None
    for w in [None, *windows]:
        kw = dict(causal=True, window_size=(-1, -1) if w is None else (w, 0))
        o, lse = flashcupy.attention(q, k, v, return_lse=True, **kw)
        fwd = [_device_us(lambda: flashcupy.attention(q, k, v, **kw), 10) for _ in range(3)]
        bwd = [_device_us(lambda: flashcupy.attention_backward(do, q, k, v, o, lse, **kw), 10)
               for _ in range(3)]
        t_f, t_b = float(np.median(fwd)), float(np.median(bwd))
        vis = _visible(n, w) * b * h
        if base is None:
            base = (t_f, t_b, vis)
        rows.append(["causal" if w is None else w, vis / base[2], t_f, t_f / base[0], 4 * d * vis / t_f / 1e6,
                     t_b, t_b / base[1], 10 * d * vis / t_b / 1e6])
        log(f"[window] cost w={w}: fwd {t_f:.0f} us ({t_f / base[0]:.3f}x causal), bwd {t_b:.0f} us "
            f"({t_b / base[1]:.3f}x), visible {vis / base[2]:.3f}x")
    return rows


def run_window(ctx: Context) -> Report:
    b, h, n, d = ctx.sizes((1, 2, 384, 32), (1, 4, 2048, 64))
    windows = ctx.sizes([4, 31, 64, 200, None], [16, 63, 128, 255, 1024, None])
    rows = _error_rows(ctx, b, h, n, d, windows)
    acc32 = [r for r in rows if r[1] == "fp32"]
    worst_f = max(acc32, key=lambda r: r[6])
    worst_b = max(acc32, key=lambda r: max(r[7:10]))
    what = "the kernels" if ctx.backend == "cuda" else "the NumPy twin"
    acc16 = [r for r in rows if r[1] == "fp16"]
    finding = (f"With fp32 accumulators the error of {what} stays within {worst_f[6]:.2f}x (forward) and "
               f"{max(worst_b[7:10]):.2f}x (gradients) the naive same-precision error at every width "
               f"(the rule: 2x, 3x); with fp16 accumulators the worst gradient goes from "
               f"{max(acc16[0][7:10]):.2f}x the naive error at w = {acc16[0][2]} to "
               f"{max(acc16[-1][7:10]):.2f}x at {acc16[-1][2]} (longer sums in fp16)")
    tables = [Table("Error against float64 by window width (causal window (w, 0); 'causal': no window)",
                    ["dtype", "accum", "window w", "visible keys per row", "o max abs", "naive o max abs",
                     "o / naive", "dQ / naive", "dK / naive", "dV / naive"], rows)]
    cost = []
    if ctx.backend == "cuda":
        cb, ch, cn, cd = ctx.sizes((1, 16, 4096, 128), (1, 16, 16384, 128))
        cost_windows = ctx.sizes([256, 1024], [256, 1024, 4096])
        cost = _cost_rows(ctx, cb, ch, cn, cd, cost_windows)
        w1024 = next(r for r in cost if r[0] == 1024)
        finding += (f"; at N = {cn}, D = {cd} a window of 1024 keys costs {w1024[3]:.2f}x the causal "
                    f"kernel's forward time and {w1024[6]:.2f}x its backward's, for {w1024[1]:.2f}x its "
                    "visible scores")
        tables.append(Table(f"Cost by window width, fp16, B x H = {cb} x {ch}, N = {cn}, D = {cd} "
                            "(device time per call, median of 3 x 10)",
                            ["window w", "visible / causal", "fwd us", "fwd / causal",
                             "fwd TFLOP/s (visible)", "bwd us", "bwd / causal", "bwd TFLOP/s (visible)"],
                            cost))
    else:
        finding += "; the timing runs on the CUDA backend only"
    finding += "."

    fig, axes = new_figure(ncols=2 if cost else 1, width=6.5)
    ax = axes[0]
    sels = [(f"{dn} acc {ac}", [r for r in rows if (r[0], r[1]) == (dn, ac)]) for dn, ac in COMBOS]
    plot_rule_ratios(ax, [(label, [r[3] for r in sel], [r[6] for r in sel], [max(r[7:10]) for r in sel])
                          for label, sel in sels])
    ax.set_xlabel("visible keys per row (mean over the rows)")
    ax.set_title("Error against the window's width (the rules: fp32 accumulators)", fontsize=10)
    if cost:
        ax = axes[1]
        vis = [r[1] for r in cost]
        ax.plot(vis, [r[3] for r in cost], marker="o", label="forward time / causal")
        ax.plot(vis, [r[6] for r in cost], marker="s", label="backward time / causal")
        ax.plot(vis, vis, color="k", lw=1, label="visible scores / causal")
        finish_log_axes(ax, "visible score elements / the causal kernel's", "time / the causal kernel's",
                        "The cost follows the window")
    setup = {"error shapes": f"B={b}, H={h}, Nq=Nk={n}, D={d}; q, k, v, dO ~ N(0, 1) rounded to the dtype",
             "windows": f"causal windows (w, 0), w in {[w for w in windows if w is not None]}, and causal",
             "kernel": "kernel='auto', default tiles; the backward's default dQ path",
             "error measure": "max |x - x_ref| over the naive same-precision attention's, x_ref float64"}
    if cost:
        setup["cost"] = ("fp16, kernel='auto'; device time per call between CUDA events, median of 3 rounds "
                         "of 10")
    return Report("window", "Sliding windows: error and cost against the width", finding, setup, tables,
                  figure=fig, figure_caption="Left: error over the naive baseline's; right: time over the "
                  "causal kernel's, against the visible scores.",
                  notes=[__doc__.split("\n\n")[1].replace("\n", " ")])

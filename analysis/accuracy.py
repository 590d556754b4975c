"""The intact kernels' accuracy: ``blocks`` (tile sizes), ``accum`` (accumulator precision against N),
``outliers`` (FlashAttention-3's outlier inputs) and ``drift`` (Wasserstein distance of outputs)."""
from __future__ import annotations

import numpy as np

import flashcupy
from flashcupy import naive, reference
from flashcupy.inspect import FAMILIES, numpy_dtype
from flashcupy.reference import to_float64

from .common import UNIT_ROUNDOFF, Context, Report, Table, errors, log, new_figure, normal_inputs

COMBOS = [("f16", "fp32"), ("f16", "fp16"), ("bf16", "fp32"), ("bf16", "fp16"), ("f32", "fp32"),
          ("f32", "fp16")]


# ---------------------------------------------------------------------------------------------------
# blocks


# one colour per input dtype, one line style per accumulator (fp32 solid with open markers, fp16 dashed
# with filled ones: the series that lie on top of each other stay apart), one marker (and a small sideways
# offset) per family
_DTYPE_COLORS = {"f16": "tab:blue", "bf16": "tab:green", "f32": "tab:red"}
_COMBO_COLORS = {(d, a): c for d, c in _DTYPE_COLORS.items() for a in ("fp32", "fp16")}
_ACCUM_STYLE = {"fp32": ("-", "none"), "fp16": ("--", None)}  # (line style, marker face: None = filled)
_DTYPE_DX = {"f16": -0.03, "bf16": 0.0, "f32": 0.03}  # and a smaller sideways offset per dtype
_FAMILY_MARKERS = {"mma": ("o", -0.1), "wgmma": ("s", 0.0), "simt": ("^", 0.1)}


def _family_kind(fam_name: str) -> str:
    return FAMILIES[fam_name].kind if fam_name in FAMILIES else fam_name.removeprefix("fwd_")


def _finite(x) -> float:
    x = float(x)
    return x if np.isfinite(x) and x > 0 else np.nan


def blocks_figure(rows, naive_rows):
    """RMSE against block_n, one line per (family, dtype, accum), every block_m of a block_n drawn at the
    same place (they coincide wherever block_m does not change the numerics); the naive same-precision
    RMSE per dtype as a dashed line. ``rows``: the "Every supported tile size" table, ``naive_rows``: the
    "Naive same-precision attention" table (as in the report and its JSON)."""
    from matplotlib.lines import Line2D

    groups = {}
    for r in rows:
        groups.setdefault(tuple(r[:3]), []).append(r)
    bns = sorted({r[4] for r in rows})
    xpos = {bn: i for i, bn in enumerate(bns)}
    # how much block_m (at a fixed block_n) and block_n (block_m pooled) move the RMSE, per group
    bm_spread, bn_spread = 1.0, (1.0, None)
    for key, rs in groups.items():
        by_bn = {}
        for r in rs:
            by_bn.setdefault(r[4], []).append(_finite(r[6]))
        for vals in by_bn.values():
            if len(vals) > 1 and np.all(np.isfinite(vals)):
                bm_spread = max(bm_spread, max(vals) / min(vals))
        means = [np.nanmean(v) for v in by_bn.values()]
        if len(means) > 1 and np.all(np.isfinite(means)) and max(means) / min(means) > bn_spread[0]:
            bn_spread = (max(means) / min(means), key)
    fig, (ax,) = new_figure(width=10, height=5)
    for (fam_name, dname, accum), rs in groups.items():
        kind = _family_kind(fam_name)
        marker, dx = _FAMILY_MARKERS.get(kind, ("D", 0.0))
        dx += _DTYPE_DX.get(dname, 0.0)
        color = _COMBO_COLORS.get((dname, accum), "k")
        ls, face = _ACCUM_STYLE.get(accum, ("-", "none"))
        ax.plot([xpos[r[4]] + dx for r in rs], [_finite(r[6]) for r in rs], marker, ms=5,
                mfc=color if face is None else face, color=color, ls="none")
        line_bns = sorted({r[4] for r in rs})
        ax.plot([xpos[bn] + dx for bn in line_bns],
                [np.nanmean([_finite(r[6]) for r in rs if r[4] == bn]) for bn in line_bns],
                ls, lw=1, color=color, alpha=0.7)
    for dname, _, rmse in naive_rows:
        ax.axhline(_finite(rmse), ls="--", lw=1, color="gray")
        ax.annotate(f"naive {dname}", (0, _finite(rmse)), xycoords=("axes fraction", "data"),
                    xytext=(3, 2), textcoords="offset points", fontsize=7, color="gray", va="bottom")
    ax.set_yscale("log")
    ax.set_xticks(range(len(bns)), [str(bn) for bn in bns])
    ax.set_xlim(-0.5, len(bns) - 0.5)
    ax.set_xlabel("block_n (keys per tile); every block_m of the family is drawn at its block_n")
    ax.set_ylabel("RMSE vs float64 (output units)")
    bm_text = "block_m never does" if bm_spread < 1.0005 else f"block_m up to {bm_spread:.3g}x"
    bn_text = (f"block_n moves it up to {bn_spread[0]:.2g}x ({_family_kind(bn_spread[1][0])}, "
               f"{bn_spread[1][1]}, {bn_spread[1][2]} acc)" if bn_spread[1] else "block_n never moves it")
    ax.set_title(f"dtype and accumulator set the error; {bn_text}; {bm_text}", fontsize=10)
    combos = [c for c in _COMBO_COLORS if any(k[1:] == c for k in groups)]
    h1 = [Line2D([], [], color=_COMBO_COLORS[c], lw=1.5, ls=_ACCUM_STYLE[c[1]][0], marker="o", ms=4,
                 mfc=_COMBO_COLORS[c] if _ACCUM_STYLE[c[1]][1] is None else "none",
                 label=f"{c[0]} inputs, acc {c[1]}") for c in combos]
    kinds = {}
    for r in rows:
        kinds.setdefault(_family_kind(r[0]), set()).add(r[3])
    h2 = [Line2D([], [], marker=_FAMILY_MARKERS.get(k, ("D", 0))[0], mfc="none", color="k", ls="none",
                 label=f"{k} (block_m {', '.join(str(m) for m in sorted(ms))})") for k, ms in kinds.items()]
    h3 = [Line2D([], [], ls="--", lw=1, color="gray", label="naive, same precision")]
    leg = ax.legend(handles=h1, title="dtype, accumulator", fontsize=8, title_fontsize=8,
                    loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.add_artist(leg)
    ax.legend(handles=h2 + h3, title="family (tiles swept)", fontsize=8, title_fontsize=8,
              loc="lower left", bbox_to_anchor=(1.01, 0.0))
    return fig


def run_blocks(ctx: Context) -> Report:
    from scipy.stats import spearmanr

    b, h, n, d = ctx.sizes((1, 2, 256, 64), (2, 8, 2048, 64))
    rows, skipped, naive_rows = [], [], []
    fams = [name for name, f in FAMILIES.items() if f.direction == "fwd"]
    for dname in ("f16", "bf16", "f32"):
        rng = ctx.rng(f"blocks.{dname}")
        q, k, v = normal_inputs(rng, (b, h, n, d), (b, h, n, d), dname)
        qx, kx, vx = ctx.dev(q, k, v)
        ref = reference.attention(q, k, v)
        ne = errors(naive.attention(qx, kx, vx), ref)
        naive_rows.append([dname, ne["max_abs"], ne["rmse"]])
        for fam_name in fams:
            fam = FAMILIES[fam_name]
            if dname not in fam.dtypes:
                continue
            for accum in fam.accums(dname):
                for bm in fam.block_m:
                    for bn in fam.block_n:
                        try:
                            o = flashcupy.attention(qx, kx, vx, kernel=fam.kind, accum=accum,
                                                    block_m=bm, block_n=bn)
                        except ValueError as e:
                            skipped.append([fam_name, dname, accum, bm, bn, str(e).split(";")[0][:80]])
                            continue
                        e = errors(o, ref)
                        rows.append([fam_name, dname, accum, bm, bn, e["max_abs"], e["rmse"],
                                     e["max_abs"] / ne["max_abs"]])
                log(f"[blocks] {fam_name} {dname} acc{accum[2:]}: {len(rows)} variants so far")
    # Golden et al.: larger tiles -> less deviation; swapped tile dims -> a different deviation
    groups, trend, swaps = {}, [], []
    for r in rows:
        groups.setdefault(tuple(r[:3]), []).append(r)
    for key, rs in groups.items():
        area = [r[3] * r[4] for r in rs]
        rmse = [r[6] for r in rs]
        rho = float(spearmanr(area, rmse).statistic) if len(set(area)) > 1 and len(set(rmse)) > 1 else 0.0
        big = min(rs, key=lambda r: (-r[3] * r[4], r[6]))
        small = min(rs, key=lambda r: (r[3] * r[4], r[6]))
        trend.append([*key, len(rs), rho, small[6], big[6], big[6] < small[6]])
        by_tile = {(r[3], r[4]): r for r in rs}
        for (bm, bn), r in by_tile.items():
            if bm < bn and (bn, bm) in by_tile:
                s = by_tile[(bn, bm)]
                swaps.append([*key, bm, bn, r[6], s[6], s[6] / r[6]])
    n_less = sum(1 for t in trend if t[-1])
    n_neg = sum(1 for t in trend if t[4] < 0)
    ratios = [s[-1] for s in swaps]
    more = sum(1 for x in ratios if x > 1.0)
    finding = (f"'Larger tiles, less deviation' (Golden et al. 2024) "
               f"{'held' if n_less > len(trend) / 2 else 'did not hold'} "
               f"here: the largest tile's RMSE is below the smallest tile's in {n_less}/{len(trend)} "
               f"(family, dtype, accum) groups (Spearman rho(tile area, RMSE) < 0 in {n_neg}); 'swapping "
               f"the tile dims gives more deviation' "
               f"{'held' if ratios and more > len(ratios) / 2 else 'did not hold'}: "
               f"RMSE(bm>bn)/RMSE(bm<bn) > 1 in {more}/{len(ratios)} swapped pairs (median "
               f"{np.median(ratios) if ratios else float('nan'):.3f}); every variant's max abs error is "
               f"{max(r[7] for r in rows if r[2] == 'fp32'):.2f}x the naive same-precision error or less "
               f"with fp32 accumulators.")
    tables = [
        Table("Naive same-precision attention (baseline)", ["dtype", "max abs error", "RMSE"], naive_rows),
        Table("Every supported tile size", ["family", "dtype", "accum", "block_m", "block_n",
                                            "max abs error", "RMSE", "max abs error / naive"], rows),
        Table("Larger tiles (Golden et al.: less deviation)",
              ["family", "dtype", "accum", "tiles", "Spearman rho(area, RMSE)", "RMSE smallest tile",
               "RMSE largest tile", "largest < smallest"], trend),
        Table("Swapped tile dims (Golden et al.: more deviation)",
              ["family", "dtype", "accum", "bm", "bn", "RMSE (bm, bn)", "RMSE (bn, bm)",
               "ratio swapped/original"],
              swaps),
    ]
    if skipped:
        tables.append(Table("Variants that raised ValueError (skipped)",
                            ["family", "dtype", "accum", "block_m", "block_n", "reason"], skipped))
    fig = blocks_figure(rows, naive_rows)
    setup = {"shapes": f"B={b}, H={h}, N={n}, D={d}, non-causal",
             "inputs": "q, k, v ~ N(0,1), rounded to the dtype",
             "variants": "every (block_m, block_n) of every forward family in flashcupy.inspect.FAMILIES, "
                         "per dtype and accumulator the family supports",
             "Golden et al. 2024": "'Is Flash Attention Stable?' (arXiv 2405.02803) report less deviation "
                                   "with larger tiles and more when the tile dims are swapped"}
    notes = []
    if ctx.backend == "numpy":
        notes.append("On the NumPy twin block_m never changes the numerics (query rows are independent); "
                     "only block_n does, and the two families share one twin.")
    return Report("blocks", "Tile sizes: every supported variant against float64", finding, setup, tables,
                  figure=fig, notes=notes,
                  figure_caption="RMSE of every tile variant; dashed: naive same-precision attention.")


# ---------------------------------------------------------------------------------------------------
# accum


def _slope(ns, ys):
    ns, ys = np.log(np.asarray(ns, float)), np.log(np.maximum(np.asarray(ys, float), 1e-300))
    return float(np.polyfit(ns, ys, 1)[0])


def run_accum(ctx: Context) -> Report:
    ns = ctx.sizes([128, 256, 512, 1024, 2048], [128, 256, 512, 1024, 2048, 4096, 8192, 16384])
    h, d, nq_cap = ctx.sizes(2, 4), 64, ctx.sizes(256, 1024)
    rows = []
    for dname in ("f16", "f32"):
        for n in ns:
            rng = ctx.rng(f"accum.{dname}.{n}")
            q, k, _ = normal_inputs(rng, (1, h, min(n, nq_cap), d), (1, h, n, d), dname)
            # v ~ U(0, 1): outputs stay near 0.5 at every N, so absolute error reads as relative error
            v = rng.uniform(0.0, 1.0, (1, h, n, d)).astype(numpy_dtype(dname))
            qx, kx, vx = ctx.dev(q, k, v)
            ref = reference.attention(q, k, v)
            ne = errors(naive.attention(qx, kx, vx), ref)
            res = {acc: errors(flashcupy.attention(qx, kx, vx, accum=acc), ref) for acc in ("fp32", "fp16")}
            rows.append([dname, n, res["fp32"]["max_abs"], res["fp32"]["rmse"], res["fp16"]["max_abs"],
                         res["fp16"]["rmse"], res["fp16"]["rmse"] / res["fp32"]["rmse"], ne["rmse"]])
            log(f"[accum] {dname} N={n}: rmse fp32 {res['fp32']['rmse']:.2e} fp16 {res['fp16']['rmse']:.2e}")
    f16 = [r for r in rows if r[0] == "f16"]
    worse = sum(1 for r in rows if r[5] > r[3])
    s16 = _slope([r[1] for r in f16], [r[5] for r in f16])
    s16m = _slope([r[1] for r in f16], [r[4] for r in f16])
    finding = (f"fp16 accumulators give a larger RMSE than fp32 at {worse}/{len(rows)} (dtype, N) points "
               f"(fp16 inputs: {min(r[6] for r in f16):.1f}x to {max(r[6] for r in f16):.1f}x); with fp16 "
               f"inputs the fp16-accumulator error grows like N^{s16:.2f} (RMSE) and N^{s16m:.2f} (max abs), "
               f"well below the N*u worst case.")
    u = UNIT_ROUNDOFF["fp16"]
    fig, (ax,) = new_figure()
    nn = np.array(ns, float)
    ax.plot(nn, [r[4] for r in f16], "o-", color="tab:red", label="fp16 inputs, accum fp16 (max abs)")
    ax.plot(nn, [r[2] for r in f16], "o-", color="tab:blue", label="fp16 inputs, accum fp32 (max abs)")
    ax.plot(nn, [r[5] for r in f16], "s--", color="tab:red", label="accum fp16 (RMSE)")
    ax.plot(nn, [r[3] for r in f16], "s--", color="tab:blue", label="accum fp32 (RMSE)")
    ax.plot(nn, np.sqrt(nn) * u, "k:", label="sqrt(N) u, u = 2^-11")
    ax.plot(nn, nn * u, "k-.", label="N u")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N (keys)")
    ax.set_ylabel("error vs float64 (output units)")
    ax.set_title("fp16 accumulators: error grows with N, far below N u")
    ax.legend(fontsize=8)
    setup = {"shapes": f"B=1, H={h}, Nq=min(N, {nq_cap}), Nk=N in {ns}, D={d}, non-causal",
             "inputs": "q, k ~ N(0,1), v ~ U(0,1) (outputs near 0.5 at every N, so the absolute error is "
                       "also the relative error), rounded to the dtype",
             "kernel": "kernel='auto', default tiles",
             "reference lines": "sqrt(N) u and N u with u = 2^-11 (fp16 unit roundoff), no constants"}
    return Report("accum", "fp16 against fp32 accumulators over N", finding, setup,
                  [Table("Error against float64", ["dtype", "N", "max abs (fp32 acc)", "RMSE (fp32 acc)",
                                                   "max abs (fp16 acc)", "RMSE (fp16 acc)",
                                                   "RMSE ratio fp16/fp32", "RMSE naive"], rows)],
                  data={"slope_rmse_f16_acc16": s16, "slope_maxabs_f16_acc16": s16m}, figure=fig,
                  figure_caption="Error against N, log-log, with sqrt(N) u and N u (u = 2^-11).")


# ---------------------------------------------------------------------------------------------------
# outliers

PUBLISHED = {"baseline fp16": 3.2e-4, "FlashAttention-2 fp16": 1.9e-4, "FlashAttention-3 fp16": 1.9e-4}


def outlier_inputs(rng, shape, dname):
    """N(0,1) plus, with probability 0.001, an N(0, 10^2) value (FlashAttention-3, section 4.3)."""
    x = rng.standard_normal(shape)
    x += 10.0 * rng.standard_normal(shape) * (rng.random(shape) < 0.001)
    return x.astype(numpy_dtype(dname))


def run_outliers(ctx: Context) -> Report:
    b, h, n, d = ctx.sizes((1, 2, 512, 128), (2, 8, 4096, 128))
    rows = []
    res = {}
    for dname in ("f16", "bf16"):
        rng = ctx.rng(f"outliers.{dname}")
        q, k, v = (outlier_inputs(rng, (b, h, n, d), dname) for _ in range(3))
        qx, kx, vx = ctx.dev(q, k, v)
        ref = reference.attention(q, k, v)
        e = errors(naive.attention(qx, kx, vx), ref)
        rows.append(["naive (same precision)", dname, "n/a", e["rmse"], e["max_abs"]])
        res[(dname, "naive")] = e["rmse"]
        for accum in ("fp32", "fp16"):
            e = errors(flashcupy.attention(qx, kx, vx, accum=accum), ref)
            rows.append(["flashcupy", dname, accum, e["rmse"], e["max_abs"]])
            res[(dname, accum)] = e["rmse"]
        log(f"[outliers] {dname}: " + ", ".join(f"{k[1]} {v:.2e}" for k, v in res.items() if k[0] == dname))
    pub = [[k, v] for k, v in PUBLISHED.items()]
    ratio = res[("f16", "fp32")] / res[("f16", "naive")]
    held = ratio < 1.0
    finding = (f"fp16, N={n}, D={d}: flashcupy (fp32 accum) RMSE {res[('f16', 'fp32')]:.2e} vs naive "
               f"{res[('f16', 'naive')]:.2e} (ratio {ratio:.2f}; paper: 1.9e-4 vs 3.2e-4, ratio 0.59): the "
               f"paper's 'flash beats the fp16 baseline' {'held' if held else 'did not hold'}; fp16 "
               f"accumulators give {res[('f16', 'fp16')]:.2e}.")
    fig, (ax,) = new_figure()
    labels = [f"{r[0].split(' ')[0]}\n{r[1]} {('acc' + r[2][2:]) if r[2] != 'n/a' else ''}" for r in rows]
    ax.bar(range(len(rows)), [r[3] for r in rows], color=["gray" if r[0].startswith("naive") else "tab:blue"
                                                          for r in rows])
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    for name, val in PUBLISHED.items():
        if name.startswith("baseline"):
            ax.axhline(val, color="gray", ls="--", lw=1, label=f"paper: {name} {val:.1e}")
        elif name.startswith("FlashAttention-3"):
            ax.axhline(val, color="tab:blue", ls="--", lw=1,
                       label=f"paper: FlashAttention-2/3 fp16 {val:.1e}")
    ax.set_yscale("log")
    ax.set_ylabel("RMSE vs float64 (output units)")
    ax.set_title(f"Outlier inputs (FlashAttention-3 sec. 4.3), N={n}, D={d}")
    ax.legend(fontsize=8)
    setup = {"shapes": f"B={b}, H={h}, N={n}, D={d}, non-causal, scale 1/sqrt(D) "
                       "(the paper does not state N and D)",
             "inputs": "q, k, v entries N(0,1) + N(0,100) * Bernoulli(0.001): with probability 0.001 an "
                       "N(0, 10^2) value is added; rounded to the dtype",
             "kernel": "kernel='auto' (fp16: tensor cores for both accumulators; bf16 + fp16 "
                       "accumulators: simt)"}
    return Report("outliers", "Outlier inputs beside FlashAttention-3's published RMSE", finding, setup,
                  [Table("Measured", ["method", "dtype", "accum", "RMSE", "max abs error"], rows),
                   Table("Published (FlashAttention-3 paper, section 4.3, fp16; N and D not stated)",
                         ["method", "RMSE"], pub)],
                  figure=fig, figure_caption="RMSE under outlier inputs; dashed lines: the paper's numbers.")


# ---------------------------------------------------------------------------------------------------
# drift

_DRIFT_BARS = [("naive", "n/a", "naive, same precision", "gray"),
               ("flashcupy", "fp32", "flashcupy, fp32 accumulators", "tab:blue"),
               ("flashcupy", "fp16", "flashcupy, fp16 accumulators", "tab:orange")]


def drift_figure(rows):
    """Grouped bars: one group per input dtype, one bar per method (naive, flashcupy fp32 / fp16
    accumulators), W1 distance on a log axis, and 0.01 u(dtype) drawn over each group. ``rows``: the
    "Wasserstein distance" table (as in the report and its JSON)."""
    dtypes = [d for d in ("f16", "bf16", "f32") if any(r[1] == d for r in rows)]
    dtypes += sorted({r[1] for r in rows} - set(dtypes))
    w = {(r[0], r[1], r[2]): _finite(r[3]) for r in rows}
    fig, (ax,) = new_figure(width=7.5, height=4.5)
    width = 0.8 / len(_DRIFT_BARS)
    for i, (method, acc, label, color) in enumerate(_DRIFT_BARS):
        ax.bar([j + (i - (len(_DRIFT_BARS) - 1) / 2) * width for j in range(len(dtypes))],
               [w.get((method, d, acc), np.nan) for d in dtypes], width * 0.92, color=color, label=label)
    for j, d in enumerate(dtypes):
        if d in UNIT_ROUNDOFF:
            ax.hlines(0.01 * UNIT_ROUNDOFF[d], j - 0.45, j + 0.45, colors="k", linestyles=":", lw=1.2,
                      label="0.01 u (u: unit roundoff of the dtype)" if j == 0 else None)
    ax.set_yscale("log")
    ax.set_xticks(range(len(dtypes)),
                  [f"{d} inputs\nu = 2^{int(np.log2(UNIT_ROUNDOFF[d]))}" if d in UNIT_ROUNDOFF else d
                   for d in dtypes])
    ax.set_xlim(-0.6, len(dtypes) - 0.4)
    ax.set_ylabel("W1 distance to float64 outputs (output units)")
    ratios = [w[("flashcupy", d, "fp32")] / w[("naive", d, "n/a")] for d in dtypes
              if ("flashcupy", d, "fp32") in w and ("naive", d, "n/a") in w]
    acc16 = [(w[("flashcupy", d, "fp16")] / w[("flashcupy", d, "fp32")], d) for d in dtypes
             if ("flashcupy", d, "fp16") in w and ("flashcupy", d, "fp32") in w]
    title = "Output drift: "
    if ratios:
        title += f"flashcupy (fp32 acc) is {min(ratios):.2f}x to {max(ratios):.2f}x naive's"
    if acc16:
        worst = max(acc16)
        title += f"; fp16 accumulators up to {worst[0]:.3g}x fp32's ({worst[1]} inputs)"
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def run_drift(ctx: Context) -> Report:
    from scipy.stats import wasserstein_distance

    b, h, n, d = ctx.sizes((1, 2, 512, 64), (2, 8, 4096, 64))
    rows = []
    for dname in ("f16", "bf16", "f32"):
        rng = ctx.rng(f"drift.{dname}")
        q, k, v = normal_inputs(rng, (b, h, n, d), (b, h, n, d), dname)
        qx, kx, vx = ctx.dev(q, k, v)
        ref = reference.attention(q, k, v).ravel()
        outs = [("naive", "n/a", naive.attention(qx, kx, vx))]
        outs += [("flashcupy", acc, flashcupy.attention(qx, kx, vx, accum=acc)) for acc in ("fp32", "fp16")]
        for method, acc, o in outs:
            o64 = to_float64(o).ravel()
            w = float(wasserstein_distance(o64, ref))
            rows.append([method, dname, acc, w, float(np.sqrt(np.mean((o64 - ref) ** 2))),
                         w / UNIT_ROUNDOFF[dname]])
        log(f"[drift] {dname}: " + ", ".join(f"{r[0]}/{r[2]} {r[3]:.2e}" for r in rows[-3:]))
    fc = [r for r in rows if r[0] == "flashcupy" and r[2] == "fp32"]
    nv = {r[1]: r[3] for r in rows if r[0] == "naive"}
    finding = ("Wasserstein distance between flashcupy's and float64's output distributions (fp32 accum): "
               + ", ".join(f"{r[1]} {r[3]:.1e} ({r[3] / nv[r[1]]:.2f}x naive)" for r in fc)
               + f"; W1 is {min(r[3] / r[4] for r in rows):.2f} to {max(r[3] / r[4] for r in rows):.2f} "
                 "of the elementwise RMSE (rounding errors move values both ways, so the distribution "
                 "shifts less than the values do).")
    fig = drift_figure(rows)
    setup = {"shapes": f"B={b}, H={h}, N={n}, D={d}, non-causal",
             "inputs": "q, k, v ~ N(0,1) rounded to the dtype",
             "metric": "scipy.stats.wasserstein_distance between all output values of a method and of "
                       "the float64 reference (as Golden et al. 2024 measure drift)",
             "kernel": "kernel='auto', default tiles"}
    return Report("drift", "Distribution drift (Wasserstein distance) against float64", finding, setup,
                  [Table("Wasserstein distance", ["method", "dtype", "accum", "W1 distance", "RMSE",
                                                  "W1 / u(dtype)"], rows)],
                  figure=fig, figure_caption="Wasserstein-1 distance of output value distributions.")

"""The two lines that keep FlashAttention alive, each removed on the real kernels: ``overflow``
(ablate="max_subtraction") and ``rescaling`` (ablate="rescaling")."""
from __future__ import annotations

import math

import numpy as np

import flashcupy
from flashcupy import reference
from flashcupy.inspect import numpy_dtype
from flashcupy.reference import to_float64

from .common import MAX_FINITE, Context, Report, Table, errors, log, new_figure, normal_inputs

# ---------------------------------------------------------------------------------------------------
# overflow

OVERFLOW_COMBOS = [("f16", "fp32"), ("bf16", "fp32"), ("f32", "fp32"), ("f16", "fp16"), ("f32", "fp16")]
BLOCK_N = 64  # both families support it; the first-tile prediction uses it


def _limits(dname: str, accum: str) -> tuple[float, float]:
    """(largest finite P before P V, largest finite running sum l)."""
    lim_p = min(MAX_FINITE[dname], MAX_FINITE["f32"])
    lim_l = MAX_FINITE[accum]
    return lim_p, lim_l


def predicted_threshold(dname: str, accum: str) -> float:
    return math.log(min(_limits(dname, accum)))


def _broken_rows(o, ref) -> tuple[np.ndarray, np.ndarray]:
    """(non-finite rows, finite rows whose max abs error exceeds 0.1), flattened over B, H, Nq."""
    o = to_float64(o)
    d = o.shape[-1]
    o = o.reshape(-1, d)
    ref = ref.reshape(-1, d)
    nonfinite = ~np.all(np.isfinite(o), axis=1)
    with np.errstate(invalid="ignore"):
        wrong = ~nonfinite & (np.abs(np.where(np.isfinite(o), o, 0) - ref).max(axis=1) > 0.1)
    return nonfinite, wrong


def _float64_truth_and_model(q, k, v, scale, dname, accum):
    """From one float64 score matrix: the reference output, and per query row the first key at which
    the float64 model of the broken kernel overflows: exp(s_j) above the largest finite P (P is rounded
    to the element type before P V) or the running sum sum_{i<=j} exp(s_i) above the accumulator's
    largest finite value (-1 where it never does)."""
    lim_p, lim_l = _limits(dname, accum)
    s = scale * np.matmul(to_float64(q), np.swapaxes(to_float64(k), -1, -2))
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    ref = np.matmul(e / e.sum(axis=-1, keepdims=True), to_float64(v))
    del e
    e = np.exp(s)
    bad = (e > lim_p) | (np.cumsum(e, axis=-1) > lim_l)
    first = np.where(bad.any(axis=-1), bad.argmax(axis=-1), -1).reshape(-1)
    return ref, first


def _first_broken_tile(ctx, q, k, v, kw, block_n):
    """Smallest number of KV tiles t such that running the broken kernel on the first t * block_n keys
    breaks a row (bisection over prefixes; a broken row stays broken as keys are added). Returns the
    0-based tile index, or None when even the full sequence does not break."""
    nk = k.shape[2]
    ntiles = -(-nk // block_n)

    def breaks(t):
        j = min(nk, t * block_n)
        kk, vv = k[:, :, :j], v[:, :, :j]
        o = flashcupy.attention(*ctx.dev(q, kk, vv), **kw)
        ref = reference.attention(q, kk, vv, scale=kw["scale"])
        nf, wr = _broken_rows(o, ref)
        return bool(nf.any() or wr.any())

    if not breaks(ntiles):
        return None
    lo, hi = 0, ntiles  # breaks(lo) is False (no keys), breaks(hi) is True
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if breaks(mid):
            hi = mid
        else:
            lo = mid
    return hi - 1


def _intact_frac_broken(r: dict) -> float:
    """The intact kernel's share of broken rows at one sweep point. Reports written before the run
    collected it hold only the intact kernel's overall max abs error and non-finite count: zero broken
    rows follows exactly from no non-finite element and a max abs error <= 0.1 (a row breaks on a
    non-finite element or a row error > 0.1); otherwise it is unknown (NaN)."""
    if "intact_frac_broken" in r:
        return float(r["intact_frac_broken"])
    return 0.0 if r["intact_nonfinite"] == 0 and r["intact_max_abs"] <= 0.1 else math.nan


def _intact_words(fracs: list[float]) -> str:
    if any(math.isnan(f) for f in fracs):
        return "broken rows not known at every point"
    return "no row broken" if max(fracs) == 0 else f"up to {max(fracs):.2g} of the rows broken"


def _largest(thr: float) -> str:
    v = math.exp(thr)
    return f"{v:.0f}" if v < 1e6 else f"{v:.2e}"


def overflow_figure(sweep: list[dict]):
    """Share of broken rows against the largest scaled score measured from its threshold, at the
    largest N of ``sweep`` (the rows of data["sweep"]): the no-max-subtraction kernel per (dtype, accum),
    and the intact kernel on the same inputs (worst over the combos at each offset)."""
    nmax = max(r["N"] for r in sweep)
    pts = [r for r in sweep if r["N"] == nmax]
    combos = list(dict.fromkeys((r["dtype"], r["accum"]) for r in pts))
    offsets = sorted({round(r["max_score"] - r["threshold"], 9) for r in pts})
    fig, (ax,) = new_figure(width=7.5, height=6.6)
    ax.axvline(0.0, color="0.35", ls="--", lw=1.2, zorder=1,
               label="predicted threshold: max score = ln(largest finite value)")
    # distinct markers, drawn from large to small, so that coinciding curves stay visible
    for i, (dname, accum) in enumerate(combos):
        c = sorted((r for r in pts if (r["dtype"], r["accum"]) == (dname, accum)),
                   key=lambda r: r["max_score"])
        thr = c[0]["threshold"]
        ax.plot([r["max_score"] - thr for r in c], [r["frac_broken"] for r in c], "o^vDP"[i % 5] + "-",
                ms=max(8 - 1.0 * i, 4), zorder=3,
                label=f"no max subtraction, {dname} inputs, accum {accum}: "
                      f"threshold ln({_largest(thr)}) = {thr:.2f}")
    intact = {}  # offset -> worst share over the combos (NaN where any is unknown)
    for r in pts:
        x = round(r["max_score"] - r["threshold"], 9)
        intact[x] = float(np.max([intact.get(x, 0.0), _intact_frac_broken(r)]))
    worst_err = max(r["intact_max_abs"] for r in pts)
    early = min((r["max_score"] - r["threshold"] for r in pts if r["frac_broken"] > 0), default=0.0)
    ax.plot(offsets, [intact[x] for x in offsets], "s--", color="k", mfc="none", ms=10, lw=1.5, zorder=4,
            label=f"intact kernel, same inputs (worst of the {len(combos)} combos): "
                  f"{_intact_words(list(intact.values()))}, "
                  f"max abs err <= {worst_err:.1e}")
    ax.set_xscale("symlog", linthresh=0.1, linscale=0.6)
    ticks = sorted(set(offsets) | {0.0})
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t:+g}" if t else "0" for t in ticks])
    ax.minorticks_off()
    ax.set_yscale("symlog", linthresh=1e-3, linscale=0.5)
    ax.set_ylim(-1e-4, 1.5)
    ax.grid(True, which="major", color="0.9", lw=0.8, zorder=0)
    ax.set_xlabel("largest scaled score minus its threshold, max(scale * q.k) - ln(max finite)\n"
                  "(dimensionless, symlog scale)")
    ax.set_ylabel("broken output rows (fraction of all rows;\nbroken = inf/NaN, or max abs error > 0.1)")
    ax.set_title("Without max subtraction, rows break at ln(max finite)"
                 + (f" (or up to {-early:.2g} below it, where\nthe running sum of several large terms "
                    "overflows first)" if early < 0 else "")
                 + f"; the intact kernel breaks none (N = {nmax} keys)", fontsize=10)
    fig.subplots_adjust(left=0.12, right=0.97, top=0.9, bottom=0.33)
    fig.legend(*ax.get_legend_handles_labels(), fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 0.0),
               frameon=False)
    return fig


def run_overflow(ctx: Context) -> Report:
    ns = ctx.sizes([256, 1024], [256, 1024, 4096, 16384])
    heads, d = ctx.sizes(2, 4), 64
    nq_cap = ctx.sizes(128, 512)
    offsets = ctx.sizes([-2.0, -0.5, -0.1, 0.1, 0.5, 2.0, 8.0],
                        [-4.0, -1.0, -0.5, -0.1, 0.1, 0.5, 2.0, 8.0])
    sweep, summary = [], []
    total = len(OVERFLOW_COMBOS) * len(ns) * len(offsets)
    step = 0
    for dname, accum in OVERFLOW_COMBOS:
        thr = predicted_threshold(dname, accum)
        for n in ns:
            rng = ctx.rng(f"overflow.{dname}.{n}")
            nq = min(n, nq_cap)
            dt = numpy_dtype(dname)
            q = rng.standard_normal((1, heads, nq, d)).astype(dt)
            k = rng.standard_normal((1, heads, n, d)).astype(dt)
            v = rng.uniform(-1.0, 1.0, (1, heads, n, d)).astype(dt)
            raw_max = float((to_float64(q) @ np.swapaxes(to_float64(k), -1, -2)).max())
            rows = heads * nq
            onset, last_clean, tile_pred, tile_meas, t_for_tile = None, None, None, None, None
            intact_worst, intact_finite = 0.0, True
            for off in offsets:
                step += 1
                target = thr + off
                scale = target / raw_max
                kw = dict(scale=scale, block_n=BLOCK_N, accum=accum, kernel="auto")
                qx, kx, vx = ctx.dev(q, k, v)
                ref, first = _float64_truth_and_model(q, k, v, scale, dname, accum)
                o = flashcupy.attention(qx, kx, vx, ablate="max_subtraction", **kw)
                nf, wr = _broken_rows(o, ref)
                o_intact = flashcupy.attention(qx, kx, vx, **kw)
                intact = errors(o_intact, ref)
                inf_i, wr_i = _broken_rows(o_intact, ref)
                intact_worst = max(intact_worst, intact["max_abs"])
                intact_finite &= intact["nonfinite"] == 0
                broken = int(nf.sum() + wr.sum())
                if broken and onset is None:
                    onset = target
                if not broken:
                    last_clean = target
                if off > 0 and tile_pred is None and (first >= 0).any():
                    # first sweep point past the threshold: locate the first overflowing tile
                    tile_pred = int(first[first >= 0].min() // BLOCK_N)
                    tile_meas = _first_broken_tile(ctx, q, k, v,
                                                   dict(kw, ablate="max_subtraction"), BLOCK_N)
                    t_for_tile = target
                sweep.append(dict(dtype=dname, accum=accum, N=n, rows=rows, max_score=target,
                                  threshold=thr, frac_nonfinite=nf.mean(), frac_broken=broken / rows,
                                  frac_predicted=float((first >= 0).mean()),
                                  intact_max_abs=intact["max_abs"], intact_nonfinite=intact["nonfinite"],
                                  intact_frac_broken=int(inf_i.sum() + wr_i.sum()) / rows))
                log(f"[overflow] {step}/{total} {dname} acc{accum[2:]} N={n} max score {target:.2f}: "
                    f"{broken}/{rows} rows broken, intact err {intact['max_abs']:.2e}")
            summary.append([dname, accum, n, thr, onset, last_clean, t_for_tile, tile_pred, tile_meas,
                            intact_finite, intact_worst])
    # "at the threshold": the first broken sweep point is the first one past ln(max finite), or one
    # just below it where the running sum of several large terms overflows first (the float64 model
    # predicts those; the slack is ln(2) for two equal terms, 1.0 allowed)
    first_above = min(o for o in offsets if o > 0)
    n_at = sum(1 for s in summary if s[4] is not None and s[3] - 1.0 <= s[4] <= s[3] + first_above + 1e-9)
    tiles_ok = sum(1 for s in summary if s[7] is not None and s[8] is not None and abs(s[7] - s[8]) <= 1)
    agree = sum(1 for r in sweep if abs(r["frac_broken"] - r["frac_predicted"]) * r["rows"] < 0.5)
    finding = (f"Without max subtraction the output breaks at the predicted ln(max finite) threshold in "
               f"{n_at}/{len(summary)} (dtype, accum, N) cases (11.09 for fp16 inputs or fp16 "
               f"accumulators, 88.72 otherwise); the measured first overflowing KV tile matches the "
               f"float64 prediction within one tile in {tiles_ok}/{len(summary)}; the broken-row count "
               f"equals the float64 model's at {agree}/{len(sweep)} sweep points; the intact kernel stays "
               f"finite on the same inputs ({'all' if all(s[9] for s in summary) else 'NOT all'}), "
               f"worst max abs error {max(s[10] for s in summary):.2e}.")
    tables = [
        Table("Onset of the overflow per dtype, accumulator and N",
              ["dtype", "accum", "N", "predicted threshold", "first broken max score",
               "last clean max score", "max score for tile test", "first overflow tile (float64 model)",
               "first overflow tile (kernel, prefix bisection)", "intact finite", "intact max abs err"],
              summary),
        Table("Every sweep point",
              ["dtype", "accum", "N", "max score", "rows", "frac rows inf/NaN", "frac rows broken",
               "frac predicted (float64 model)", "intact max abs err", "intact frac rows broken"],
              [[r["dtype"], r["accum"], r["N"], r["max_score"], r["rows"], r["frac_nonfinite"],
                r["frac_broken"], r["frac_predicted"], r["intact_max_abs"], r["intact_frac_broken"]]
               for r in sweep]),
    ]
    fig = overflow_figure(sweep)
    setup = {
        "shapes": f"B=1, H={heads}, Nq=min(N, {nq_cap}) query rows, Nk=N in {ns}, D={d}",
        "inputs": "q, k ~ N(0,1); v ~ U(-1,1) (so the fp16 output accumulator cannot overflow before the "
                  "running sum); rounded to the dtype; the score scale is set so that the largest "
                  "scaled score equals threshold + offset",
        "offsets from the threshold": offsets,
        "combos (dtype, accum)": OVERFLOW_COMBOS,
        "kernel": f"kernel='auto', block_n={BLOCK_N}, default block_m",
        "broken row": "any non-finite element, or finite with max abs error > 0.1 against float64",
        "first overflowing tile": "float64 model: first key j with exp(s_j) > largest finite P "
                                  "(element type, as P is rounded before P V) or cumsum exp(s) > largest "
                                  "finite accumulator, tile = j // block_n, minimum over rows (the same "
                                  "float64 scores give the reference output); kernel: bisection over key "
                                  "prefixes of t*block_n keys for the smallest t that breaks a row",
    }
    return Report("overflow", "Break 1: no max subtraction, the exponentials overflow", finding, setup,
                  tables, data={"sweep": sweep}, figure=fig,
                  figure_caption="Share of broken output rows (inf/NaN, or max abs error > 0.1 against "
                                 "float64) against the largest scaled score measured from its predicted "
                                 "threshold ln(max finite) (dashed line; 11.09 or 88.72 per combo, in the "
                                 "legend), at the largest N; solid: ablate='max_subtraction', one curve "
                                 "per (dtype, accum); black: the intact kernel on the same inputs, worst "
                                 "of the combos.",
                  notes=["With ablate='max_subtraction' P is rounded to the element type before P V, so "
                         "fp16 inputs overflow at 11.09 whatever the accumulator; fp16 accumulators hold "
                         "the running sum in fp16, so every dtype overflows at 11.09 with accum='fp16'.",
                         "A row whose running sum overflowed but whose P V accumulator did not comes out "
                         "as 0 (finite, wrong): counted as broken, not as inf/NaN."])


# ---------------------------------------------------------------------------------------------------
# rescaling


def _rescaling_families(dname):
    from flashcupy.inspect import FAMILIES

    fam = FAMILIES["fwd_simt"] if dname == "f32" else FAMILIES["fwd_mma"]
    return fam.kind, fam.block_n


def run_rescaling(ctx: Context) -> Report:
    # first the claimed setup (max abs error 0.1 to 0.5): B=2, H=4, N=256, D=32, blocks of 32, fp32;
    # five input draws
    claim_rows = []
    for i in range(5):
        rng = ctx.rng(f"rescaling.claim.{i}")
        q, k, v = normal_inputs(rng, (2, 4, 256, 32), (2, 4, 256, 32), "f32")
        qx, kx, vx = ctx.dev(q, k, v)
        ref = reference.attention(q, k, v)
        c = errors(flashcupy.attention(qx, kx, vx, ablate="rescaling", kernel="simt", block_m=32,
                                       block_n=32), ref)
        ci = errors(flashcupy.attention(qx, kx, vx, kernel="simt", block_m=32, block_n=32), ref)
        claim_rows.append([i, 2, 4, 256, 32, c["max_abs"], c["rmse"], ci["max_abs"],
                           0.1 <= c["max_abs"] <= 0.5])
    n_held = sum(r[8] for r in claim_rows)
    held = n_held > len(claim_rows) / 2
    lo_c, hi_c = min(r[5] for r in claim_rows), max(r[5] for r in claim_rows)
    log(f"[rescaling] seed claim setup: max abs error {lo_c:.3f} to {hi_c:.3f}")

    ns = ctx.sizes([16, 32, 64, 128, 256, 512], [16, 32, 64, 128, 256, 1024, 4096, 16384])
    heads, d, nq_cap = 4, 32, ctx.sizes(256, 1024)
    rows = []
    for dname in ("f32", "f16"):
        kernel, bns = _rescaling_families(dname)
        for n in ns:
            rng = ctx.rng(f"rescaling.{dname}.{n}")
            q, k, v = normal_inputs(rng, (1, heads, min(n, nq_cap), d), (1, heads, n, d), dname)
            qx, kx, vx = ctx.dev(q, k, v)
            ref = reference.attention(q, k, v)
            for bn in bns:
                e = errors(flashcupy.attention(qx, kx, vx, ablate="rescaling", kernel=kernel, block_n=bn),
                           ref)
                ok = errors(flashcupy.attention(qx, kx, vx, kernel=kernel, block_n=bn), ref)
                rows.append([dname, kernel, n, bn, -(-n // bn), e["max_abs"], e["rmse"], ok["max_abs"]])
            log(f"[rescaling] {dname} N={n}: " + ", ".join(f"bn{r[3]} {r[5]:.2e}" for r in rows[-len(bns):]))
    f32 = [r for r in rows if r[0] == "f32"]
    one = max(r[5] for r in f32 if r[4] == 1)
    multi = min(r[5] for r in f32 if r[4] >= 2)
    finding = (f"Dropping the rescaling leaves every output finite but wrong once a row spans two or more "
               f"KV tiles (fp32: smallest max abs error over those cases {multi:.3g}), and exact to "
               f"rounding with one tile (largest {one:.2e}); the claim of the tutorial it reproduces (Under "
               f"The Hood, ch. 8: 0.1 to 0.5 on B=2, H=4, N=256, D=32, blocks of 32) "
               f"{'held' if held else 'did not hold'}: measured "
               f"{lo_c:.3f} to {hi_c:.3f} over 5 input draws, inside the range in {n_held}/5.")
    tables = [
        Table("The tutorial's setup (Under The Hood, ch. 8: fp32, kernel='simt', block_m = block_n = 32), "
              "five input draws",
              ["draw", "B", "H", "N", "D", "max abs error (broken)", "RMSE (broken)",
               "max abs error (intact)", "in 0.1 to 0.5"], claim_rows),
        Table("Error against float64 over N and block_n",
              ["dtype", "kernel", "N", "block_n", "KV tiles", "max abs error (broken)", "RMSE (broken)",
               "max abs error (intact)"], rows),
    ]
    fig, (ax,) = new_figure()
    _, bns = _rescaling_families("f32")
    for bn in bns:
        pts = [r for r in f32 if r[3] == bn]
        line, = ax.plot([r[2] for r in pts], [max(r[5], 1e-9) for r in pts], "o-", label=f"block_n={bn}")
        ax.axvline(bn, color=line.get_color(), ls=":", lw=1)
    ax.plot([r[2] for r in f32 if r[3] == bns[0]], [max(r[7], 1e-9) for r in f32 if r[3] == bns[0]], "k--",
            label="intact kernel")
    ax.axhspan(0.1, 0.5, color="tab:red", alpha=0.1, label="seed claim: 0.1 to 0.5")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N (keys)")
    ax.set_ylabel("max abs error vs float64 (output units)")
    ax.set_title("ablate='rescaling', fp32: exact with one tile (N <= block_n, dotted), wrong with two")
    ax.legend(fontsize=8)
    setup = {"seed claim": "B=2, H=4, N=256, D=32, fp32, q, k, v ~ N(0,1) (five draws), kernel='simt', "
                           "block_m=block_n=32; the chapter compared with its naive fp32 attention, we with "
                           "float64 (they differ by ~1e-6)",
             "sweep": f"B=1, H={heads}, Nq=min(N, {nq_cap}), Nk=N in {ns}, D={d}, q, k, v ~ N(0,1); "
                      f"fp32 on kernel='simt' (block_n {bns}), fp16 on kernel='mma' "
                      f"(block_n {_rescaling_families('f16')[1]})"}
    return Report("rescaling", "Break 2: keep the max, drop the rescaling", finding, setup, tables,
                  data={"claim": {"max_abs": [r[5] for r in claim_rows], "held": held,
                                  "draws_in_range": n_held}},
                  figure=fig,
                  figure_caption="Max abs error of the no-rescaling kernel against N; dotted lines mark "
                                 "N = block_n, the last length one tile covers.")

"""fp8 (e4m3) attention: scale granularity, incoherent processing, smoothing and the accumulation, side by
side against float64, beside the published numbers; and the error of single- against two-level
accumulation as the number of keys grows.

Every fp8 arm runs ``flashcupy.attention_fp8``, today the NumPy twin (the fp8 wgmma kernel is issue 13's
next step), which accumulates Q K^T and P V with the e4m3 wgmma accumulation measured on the H200
(``python -m analysis tensorcore``: 32 products aligned to 14 bits, the sum truncated to 14 bits). So
this report is the measured model's prediction; the kernel, once built, must agree with the twin. The
reference rows are fp16 attention (``flashcupy.attention``: the kernels on a GPU, the fp16 twin on the
CPU). Every error is against float64 attention of the original (unquantized, untransformed) inputs.

Arms (q and k quantized at one granularity; v per tensor or per head, as the twin requires): granularity
"tensor" / "block" (64 tokens, FlashAttention-3's block quantization) / "token"; incoherent processing
(random signs times a Hadamard matrix on q and k; the scores are unchanged) on or off; smoothing (k minus
its token mean; the output is unchanged) on or off; accumulation "single" (the tensor core's accumulator
across all keys) or "tile" (promoted to fp32 every 128 keys).
Metrics (SageAttention's): RMSE, cosine similarity and relative L1 (sum |o - ref| / sum |ref|).
"""
from __future__ import annotations

import numpy as np

import flashcupy
from flashcupy import fp8, reference, transforms

from .accuracy import outlier_inputs
from .common import Context, Report, Table, log, new_figure

GRANULARITIES = ("tensor", "block", "token")
BLOCK = 64
# published, each in its own setting (issue 13): FlashAttention-3 (fp8, outlier inputs, RMSE) and
# SageAttention (INT8 Q K^T, e4m3 P V)
PUBLISHED = [["FlashAttention-3: baseline fp8 (per-tensor)", "RMSE", 2.4e-2],
             ["FlashAttention-3: block quantization + incoherent processing", "RMSE", 9.1e-3],
             ["FlashAttention-3: without block quantization", "RMSE", 9.3e-3],
             ["FlashAttention-3: without incoherent processing", "RMSE", 2.4e-2],
             ["SageAttention: INT8 QK, e4m3 PV", "cosine similarity", 0.9994],
             ["SageAttention: INT8 QK, e4m3 PV", "relative L1", 0.0345],
             ["SageAttention: INT8 QK, e4m3 PV", "RMSE", 3.53e-3]]


def metrics(o, ref) -> dict:
    o, ref = np.asarray(o, dtype=np.float64).ravel(), np.asarray(ref, dtype=np.float64).ravel()
    d = o - ref
    return {"rmse": float(np.sqrt(np.mean(d * d))),
            "cosine": float(o @ ref / (np.linalg.norm(o) * np.linalg.norm(ref))),
            "rel_l1": float(np.abs(d).sum() / np.abs(ref).sum())}


def fp8_arm(q, k, v, granularity, incoherent, smooth, accumulation, seed=0):
    """o of one arm (float64 inputs (B, H, N, D); transforms applied in float64 before quantizing)."""
    if incoherent:
        q, k = transforms.incoherent(q, k, seed)
    if smooth:
        k, _ = transforms.smooth_keys(k)
    block = BLOCK if granularity == "block" else None
    qq, kq = (fp8.quantize(x.astype(np.float32), "e4m3", granularity, block) for x in (q, k))
    vq = fp8.quantize(v.astype(np.float32), "e4m3", "tensor" if granularity == "tensor" else "head")
    return flashcupy.attention_fp8(qq, kq, vq, accumulation=accumulation, block_n=128)


def channel_biased(rng, shape):
    """N(0,1) plus a per-channel offset N(0, 4^2) shared by every token (the channel outliers of K that
    SageAttention smooths away)."""
    return rng.standard_normal(shape) + 4.0 * rng.standard_normal((*shape[:2], 1, shape[3]))


def run_fp8(ctx: Context) -> Report:
    b, h, nq, nk, d = ctx.sizes((1, 1, 32, 256, 64), (1, 2, 128, 2048, 128))
    rows, data = [], {}
    inputs = {"outliers": lambda rng: tuple(outlier_inputs(rng, s, "f32").astype(np.float64)
                                            for s in ((b, h, nq, d), (b, h, nk, d), (b, h, nk, d))),
              "channel-biased k, v": lambda rng: (rng.standard_normal((b, h, nq, d)),
                                                  channel_biased(rng, (b, h, nk, d)),
                                                  channel_biased(rng, (b, h, nk, d)))}
    for dist, make in inputs.items():
        q, k, v = make(ctx.rng(f"fp8.{dist}"))
        ref = reference.attention(q, k, v)
        for dname in ("f16", "bf16"):
            dt = flashcupy._checks.numpy_dtype(dname)
            o = flashcupy.attention(*ctx.dev(*(x.astype(dt) for x in (q, k, v))))
            m = metrics(o.get() if hasattr(o, "get") else o, ref)
            rows.append([dist, f"{dname} ({'kernel' if ctx.backend == 'cuda' else 'twin'})", "n/a", False,
                         False, "n/a", m["rmse"], m["cosine"], m["rel_l1"]])
        for gran in GRANULARITIES:
            for inc in (False, True):
                for smooth in (False, True):
                    for acc in ("single", "tile"):
                        m = metrics(fp8_arm(q, k, v, gran, inc, smooth, acc, ctx.seed), ref)
                        rows.append([dist, "e4m3 (twin)", gran, inc, smooth, acc, m["rmse"], m["cosine"],
                                     m["rel_l1"]])
        log(f"[fp8] {dist}: " + ", ".join(f"{r[2]}/{int(r[3])}{int(r[4])}/{r[5]} {r[6]:.1e}"
                                          for r in rows if r[0] == dist and r[1].startswith("e4m3")))

    # error against the number of keys: single- and two-level accumulation, v with mean 0 and mean 1;
    # end to end (against float64) and the accumulation alone (against the exact-sum twin, same inputs)
    ns = ctx.sizes((256, 512, 1024), (1024, 2048, 4096, 8192, 16384, 32768))
    rq, dq = ctx.sizes((4, 64), (8, 64))
    sweep = []
    for v_mean in (0.0, 1.0):
        rng = ctx.rng(f"fp8.sweep.{v_mean}")
        for n in ns:
            q, k = rng.standard_normal((1, 1, rq, dq)), rng.standard_normal((1, 1, n, dq))
            v = rng.standard_normal((1, 1, n, dq)) + v_mean
            ref = reference.attention(q, k, v)
            exact = fp8_arm(q, k, v, "tensor", False, False, "exact")
            scale = np.sqrt(np.mean(ref * ref))
            point = {"v mean": v_mean, "N": n}
            for acc in ("single", "tile"):
                o = fp8_arm(q, k, v, "tensor", False, False, acc)
                point[acc] = metrics(o, ref)["rmse"] / scale
                point[f"{acc} accumulation"] = metrics(o, exact)["rmse"] / scale
            sweep.append(point)
            log(f"[fp8] v mean {v_mean:g}, N={n}: relative RMSE single {point['single']:.2e} "
                f"(accumulation {point['single accumulation']:.2e}), tile {point['tile']:.2e} "
                f"(accumulation {point['tile accumulation']:.2e})")
    data["sweep"] = sweep

    def pick(dist, gran, inc, smooth, acc):
        return next(r for r in rows if r[:6] == [dist, "e4m3 (twin)", gran, inc, smooth, acc])[6]

    base = pick("outliers", "tensor", False, False, "single")
    best = pick("outliers", "block", True, False, "tile")
    long = sweep[-1]
    finding = (f"e4m3 on FlashAttention-3's outlier inputs (twin of the measured accumulation): per-tensor "
               f"RMSE {base:.1e} (paper 2.4e-2), block + incoherent with two-level accumulation "
               f"{best:.1e} (paper 9.1e-3); over N = {long['N']} keys (v of mean 1) the accumulation alone "
               f"costs "
               f"{long['single accumulation']:.1e} of the output's RMS single-level against "
               f"{long['tile accumulation']:.1e} two-level (end to end {long['single']:.1e} / "
               f"{long['tile']:.1e}).")

    fig, (ax1, ax2) = new_figure(ncols=2, width=6.5)
    arms = [r for r in rows if r[0] == "outliers"]
    labels = [r[1].split(" ")[0] if r[2] == "n/a"
              else f"{r[2][:3]} {'I' if r[3] else '-'}{'S' if r[4] else '-'} {r[5][0]}" for r in arms]
    ax1.bar(range(len(arms)), [r[6] for r in arms],
            color=["gray" if r[2] == "n/a" else ("tab:blue" if r[5] == "single" else "tab:orange")
                   for r in arms])
    ax1.set_xticks(range(len(arms)), labels, rotation=90, fontsize=6)
    for name, _, val in PUBLISHED[:2]:
        ax1.axhline(val, ls="--", lw=1, color="k" if "baseline" in name else "tab:green",
                    label=f"{name}: {val:.1e}")
    ax1.set_yscale("log")
    ax1.set_ylabel("RMSE vs float64")
    ax1.set_title("Outlier inputs: arms (I incoherent, S smoothing; s single, t tile)", fontsize=8)
    ax1.legend(fontsize=6)
    for acc, color in (("single", "tab:blue"), ("tile", "tab:orange")):
        for v_mean, style in ((0.0, "o--"), (1.0, "o-")):
            pts = [p for p in sweep if p["v mean"] == v_mean]
            ax2.plot([p["N"] for p in pts], [p[f"{acc} accumulation"] for p in pts], style, color=color,
                     label=f"{acc}-level, v mean {v_mean:g}")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("keys N")
    ax2.set_ylabel("accumulation's RMSE / RMS(o)")
    ax2.set_title(f"e4m3 per-tensor; q, k N(0,1), v N(0,1) (dashed) or N(1,1); {rq} rows, D={dq}", fontsize=8)
    ax2.legend(fontsize=7)

    setup = {"shapes": f"B={b}, H={h}, {nq} query rows, {nk} keys, D={d}, non-causal, scale 1/sqrt(D); the "
                       f"N sweep: {rq} query rows, D={dq}, N in {list(ns)}, q, k N(0,1), v N(0,1) or N(1,1), "
                       "per-tensor scales",
             "inputs": "outliers: N(0,1) + N(0,100) * Bernoulli(0.001) (FlashAttention-3, section 4.3); "
                       "channel-biased: q N(0,1), k and v N(0,1) plus a per-channel N(0, 16) offset",
             "fp8": "flashcupy.attention_fp8 (NumPy twin of the measured e4m3 wgmma accumulation), "
                    f"block_n 128, p_scale 256; block granularity: {BLOCK} tokens",
             "reference rows": "flashcupy.attention in fp16 / bf16 (kernel on a GPU, twin on the CPU)"}
    cols = ["inputs", "method", "q, k scales", "incoherent", "smoothing", "accumulation", "RMSE",
            "cosine similarity", "relative L1"]
    return Report("fp8", "fp8 (e4m3) attention: scales, outlier treatments and accumulation", finding, setup,
                  [Table("Arms against float64", cols, rows),
                   Table("Published (each in its own setting)", ["source", "metric", "value"], PUBLISHED),
                   Table("Error against N (RMSE / RMS of o; accumulation: against the exact-sum twin)",
                         ["v mean", "N", "single-level", "two-level (tile)", "single-level accumulation",
                          "two-level accumulation"],
                         [[p["v mean"], p["N"], p["single"], p["tile"], p["single accumulation"],
                           p["tile accumulation"]] for p in sweep])],
                  data=data, figure=fig,
                  figure_caption="Left: RMSE per arm on outlier inputs (gray: fp16 / bf16 references; "
                                 "dashed: FlashAttention-3's fp8 numbers). Right: single- against two-level "
                                 "accumulation as the keys grow.")

"""fp8 (e4m3) attention: scale granularity, incoherent processing, smoothing and the accumulation, side by
side against float64, beside the published numbers; and the error of single- against two-level
accumulation as the number of keys grows.

Every fp8 arm runs ``flashcupy.attention_fp8``: on a Hopper GPU the fp8 wgmma kernel (D=128), elsewhere
its NumPy twin, which accumulates Q K^T and P V with the e4m3 wgmma accumulation measured on the H200
(``python -m analysis tensorcore``: 32 products aligned to 14 bits, the sum truncated to 14 bits; the GPU
tests check that kernel and twin agree). The reference rows are fp16 / bf16 attention
(``flashcupy.attention``: the kernels on a GPU, the twin on the CPU). Every error is against float64
attention of the original (unquantized, untransformed) inputs.

Arms (q and k quantized at one granularity; v per tensor or per head, as the twin requires): granularity
"tensor" / "block" (64 tokens, FlashAttention-3's block quantization) / "token"; incoherent processing
(random signs times a Hadamard matrix on q and k; the scores are unchanged) on or off; smoothing (k minus
its token mean; the output is unchanged) on or off; accumulation "single" (the tensor core's accumulator
across all keys) or "tile" (promoted to fp32 every 128 keys).
Metrics (SageAttention's): RMSE, cosine similarity and relative L1 (sum |o - ref| / sum |ref|).
"""
from __future__ import annotations

import dataclasses

import numpy as np

import flashcupy
import flashcupy.inspect
from flashcupy import fp8, reference, transforms

from .accuracy import outlier_inputs
from .common import Context, Report, Table, log, new_figure

GRANULARITIES = ("tensor", "block", "token")
BLOCK = 64
EXACT_ROWS, EXACT_MAX_N = 16, 32768  # the exact-sum twin beside the kernel: query rows and keys it runs
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


def quantize_arm(q, k, v, granularity, incoherent, smooth, seed=0):
    """The quantized (q, k, v) of one arm (float64 inputs (B, H, N, D); transforms applied in float64
    before quantizing), on the host."""
    if incoherent:
        q, k = transforms.incoherent(q, k, seed)
    if smooth:
        k, _ = transforms.smooth_keys(k)
    block = BLOCK if granularity == "block" else None
    qq, kq = (fp8.quantize(x.astype(np.float32), "e4m3", granularity, block) for x in (q, k))
    vq = fp8.quantize(v.astype(np.float32), "e4m3", "tensor" if granularity == "tensor" else "head")
    return qq, kq, vq


def fp8_arm(q, k, v, granularity, incoherent, smooth, accumulation, seed=0, kernel=False, quantized=None):
    """o of one arm as a float64 NumPy array: the fp8 wgmma kernel with ``kernel`` (the quantized data moved
    to the GPU), else the twin; ``quantized`` (from quantize_arm) instead of quantizing q, k, v here."""
    qq, kq, vq = quantized or quantize_arm(q, k, v, granularity, incoherent, smooth, seed)
    if kernel:
        import cupy

        qq, kq, vq = (fp8.Quantized(cupy.asarray(x.data.view(np.uint8)), cupy.asarray(x.scale), x.fmt,
                                    x.granularity, x.block) for x in (qq, kq, vq))
        return cupy.asnumpy(flashcupy.attention_fp8(qq, kq, vq, accumulation=accumulation)).astype(np.float64)
    return flashcupy.attention_fp8(qq, kq, vq, accumulation=accumulation, block_n=128).astype(np.float64)


def _kernel_runs(ctx: Context) -> bool:
    """The fp8 wgmma kernel runs here: a Hopper GPU (compute capability 9.0)."""
    if ctx.backend != "cuda":
        return False
    import cupy

    return int(cupy.cuda.Device().compute_capability) == 90


def channel_biased(rng, shape):
    """N(0,1) plus a per-channel offset N(0, 4^2) shared by every token (the channel outliers of K that
    SageAttention smooths away)."""
    return rng.standard_normal(shape) + 4.0 * rng.standard_normal((*shape[:2], 1, shape[3]))


def run_fp8(ctx: Context) -> Report:
    kernel = _kernel_runs(ctx)
    method = "e4m3 (kernel)" if kernel else "e4m3 (twin)"
    b, h, nq, nk, d = ctx.sizes((1, 1, 32, 256, 128 if kernel else 64), (1, 2, 128, 2048, 128))
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
            dt = flashcupy.inspect.numpy_dtype(dname)
            o = flashcupy.attention(*ctx.dev(*(x.astype(dt) for x in (q, k, v))))
            m = metrics(o.get() if hasattr(o, "get") else o, ref)
            rows.append([dist, f"{dname} ({'kernel' if ctx.backend == 'cuda' else 'twin'})", "n/a", False,
                         False, "n/a", m["rmse"], m["cosine"], m["rel_l1"]])
        for gran in GRANULARITIES:
            for inc in (False, True):
                for smooth in (False, True):
                    for acc in ("single", "tile"):
                        m = metrics(fp8_arm(q, k, v, gran, inc, smooth, acc, ctx.seed, kernel), ref)
                        rows.append([dist, method, gran, inc, smooth, acc, m["rmse"], m["cosine"],
                                     m["rel_l1"]])
        log(f"[fp8] {dist}: " + ", ".join(f"{r[2]}/{int(r[3])}{int(r[4])}/{r[5]} {r[6]:.1e}"
                                          for r in rows if r[0] == dist and r[1].startswith("e4m3")))

    # error against the number of keys: single- and two-level accumulation, v with mean 0 and mean 1;
    # end to end (against float64) and the accumulation alone (against the twin's exact-sum accumulation
    # of the same quantized inputs; on the kernel, on its first EXACT_ROWS rows up to EXACT_MAX_N keys,
    # where the NumPy twin stays affordable)
    if kernel:
        ns = ctx.sizes((1024, 4096), tuple(2 ** e for e in range(10, 18)))  # 1k .. 128k keys
        rq, dq = ctx.sizes((64, 128), (192, 128))
    else:
        ns = ctx.sizes((256, 512, 1024), (1024, 2048, 4096, 8192, 16384, 32768))
        rq, dq = ctx.sizes((4, 64), (8, 64))
    sweep = []
    for v_mean in (0.0, 1.0):
        rng = ctx.rng(f"fp8.sweep.{v_mean}")
        for n in ns:
            q, k = rng.standard_normal((1, 1, rq, dq)), rng.standard_normal((1, 1, n, dq))
            v = rng.standard_normal((1, 1, n, dq)) + v_mean
            ref = reference.attention(q, k, v)
            qkv = quantize_arm(q, k, v, "tensor", False, False)
            rows_x = slice(0, EXACT_ROWS) if kernel else slice(None)
            # the exact sums of the same quantized inputs (q's first rows: the same data and scale)
            first = (dataclasses.replace(qkv[0], data=qkv[0].data[:, :, rows_x]), *qkv[1:])
            exact = (fp8_arm(None, None, None, "tensor", False, False, "exact", quantized=first)
                     if not kernel or n <= EXACT_MAX_N else None)
            scale = np.sqrt(np.mean(ref * ref))
            point, outs = {"v mean": v_mean, "N": n}, {}
            for acc in ("single", "tile"):
                o = outs[acc] = fp8_arm(None, None, None, "tensor", False, False, acc, kernel=kernel,
                                        quantized=qkv)
                point[acc] = metrics(o, ref)["rmse"] / scale
                point[f"{acc} accumulation"] = (None if exact is None else
                                                metrics(o[:, :, rows_x], exact)["rmse"] / scale)
            if kernel:  # at every N: single- against two-level on all rows (two-level's own part is small)
                point["single - tile"] = metrics(outs["single"], outs["tile"])["rmse"] / scale
            sweep.append(point)
            def e(x):  # the accumulation alone is measured up to some N only
                return "-" if x is None else f"{x:.2e}"

            log(f"[fp8] v mean {v_mean:g}, N={n}: relative RMSE single {point['single']:.2e}, tile "
                f"{point['tile']:.2e}; accumulation alone single {e(point['single accumulation'])}, tile "
                f"{e(point['tile accumulation'])}")
    data["sweep"] = sweep

    def pick(dist, gran, inc, smooth, acc):
        return next(r for r in rows if r[:6] == [dist, method, gran, inc, smooth, acc])[6]

    base = pick("outliers", "tensor", False, False, "single")
    best = pick("outliers", "block", True, False, "tile")
    long = sweep[-1]
    exact_pts = [p for p in sweep if p["v mean"] == 1.0 and p["single accumulation"] is not None]
    alone = exact_pts[-1]
    source = "fp8 wgmma kernel" if kernel else "twin of the measured accumulation"
    finding = (f"e4m3 on FlashAttention-3's outlier inputs ({source}): per-tensor RMSE {base:.1e} (paper "
               f"2.4e-2), block + incoherent with two-level accumulation {best:.1e} (paper 9.1e-3). v of "
               f"mean 1: end to end over N = {long['N']} keys {long['single']:.1e} of the output's RMS "
               f"single-level against {long['tile']:.1e} two-level; "
               f"the accumulation alone (against exact sums, N = {alone['N']}) "
               f"{alone['single accumulation']:.1e} against {alone['tile accumulation']:.1e}.")

    fig, (ax1, ax2) = new_figure(ncols=2, width=6.5)
    arms = [r for r in rows if r[0] == "outliers"]

    def arm_label(r):
        if r[2] == "n/a":  # a 16-bit reference row
            return r[1]
        return f"{r[2]} scales" + (" + incoherent" if r[3] else "") + (" + smoothing" if r[4] else "")

    colors = {"single": "tab:blue", "tile": "tab:orange"}
    ax1.barh(range(len(arms)), [r[6] for r in arms],
             color=["gray" if r[2] == "n/a" else colors.get(r[5], "tab:purple") for r in arms])
    ax1.set_yticks(range(len(arms)), [arm_label(r) for r in arms], fontsize=6)
    ax1.invert_yaxis()
    for name, _, val in PUBLISHED[:2]:
        ax1.axvline(val, ls="--", lw=1, color="k" if "baseline" in name else "tab:green",
                    label=f"{name}: {val:.1e}")
    from matplotlib.patches import Patch

    handles = [Patch(color="gray", label="16-bit reference"),
               Patch(color=colors["single"], label="e4m3, single-level accumulation"),
               Patch(color=colors["tile"], label="e4m3, two-level accumulation")]
    ax1.set_xscale("log")
    ax1.set_xlabel("RMSE vs float64")
    ax1.set_title("Outlier inputs: each treatment's error", fontsize=8)
    ax1.legend(handles=handles + ax1.get_legend_handles_labels()[0], fontsize=6, loc="upper center",
               bbox_to_anchor=(0.5, -0.13), ncol=2)
    for acc, color in (("single", "tab:blue"), ("tile", "tab:orange")):
        for v_mean, style in ((0.0, "o--"), (1.0, "o-")):
            pts = [p for p in sweep if p["v mean"] == v_mean]
            ax2.plot([p["N"] for p in pts], [p[acc] for p in pts], style, color=color,
                     label=f"{acc}-level end to end, v mean {v_mean:g}")
        pts = [p for p in sweep if p["v mean"] == 1.0 and p[f"{acc} accumulation"] is not None]
        ax2.plot([p["N"] for p in pts], [p[f"{acc} accumulation"] for p in pts], "x:", color=color,
                 label=f"{acc}-level accumulation alone, v mean 1")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("keys N")
    ax2.set_ylabel("RMSE / RMS(o)")
    ax2.set_title(f"e4m3 per-tensor; q, k N(0,1), v N(0,1) (dashed) or N(1,1); {rq} rows, D={dq}", fontsize=8)
    ax2.legend(fontsize=7)

    setup = {"shapes": f"B={b}, H={h}, {nq} query rows, {nk} keys, D={d}, non-causal, scale 1/sqrt(D); the "
                       f"N sweep: {rq} query rows, D={dq}, N in {list(ns)}, q, k N(0,1), v N(0,1) or N(1,1), "
                       "per-tensor scales",
             "inputs": "outliers: N(0,1) + N(0,100) * Bernoulli(0.001) (FlashAttention-3, section 4.3); "
                       "channel-biased: q N(0,1), k and v N(0,1) plus a per-channel N(0, 16) offset",
             "fp8": "flashcupy.attention_fp8: " + ("the fp8 wgmma kernel (D=128)" if kernel else
                                                   "the NumPy twin of the measured e4m3 wgmma accumulation")
                    + f", block_n 128, p_scale 256; block granularity: {BLOCK} tokens"
                    + ("; accumulation alone: the twin's exact-sum accumulation of the same quantized "
                       f"inputs on the first {EXACT_ROWS} query rows, N <= {EXACT_MAX_N}" if kernel else ""),
             "reference rows": "flashcupy.attention in fp16 / bf16 (kernel on a GPU, twin on the CPU)"}
    cols = ["inputs", "method", "q, k scales", "incoherent", "smoothing", "accumulation", "RMSE",
            "cosine similarity", "relative L1"]
    return Report("fp8", "fp8 (e4m3) attention: scales, outlier treatments and accumulation", finding, setup,
                  [Table("Arms against float64", cols, rows),
                   Table("Published (each in its own setting)", ["source", "metric", "value"], PUBLISHED),
                   Table("Error against N (RMSE / RMS of o; accumulation: against the exact-sum twin; "
                         "single - two-level: the kernel's two outputs against each other)",
                         ["v mean", "N", "single-level", "two-level (tile)", "single-level accumulation",
                          "two-level accumulation", "single - two-level"],
                         [[p["v mean"], p["N"], p["single"], p["tile"], p["single accumulation"],
                           p["tile accumulation"], p.get("single - tile")] for p in sweep])],
                  data=data, figure=fig,
                  figure_caption="Left: RMSE per arm on outlier inputs (gray: fp16 / bf16 references; "
                                 "dashed: FlashAttention-3's fp8 numbers). Right: single- against two-level "
                                 "accumulation as the keys grow (end to end against float64; dotted: the "
                                 "accumulation alone, against exact sums).")

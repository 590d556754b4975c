"""``fp8_backward``: which of the backward's five products can take fp8 operands (issue 38, the study
before any kernel), on NumPy models of the products with the tensor core's measured fp8 accumulation.

The backward's products, per head (P recomputed from the saved LSE, delta = rowsum(dO * O)):

    S  = Q K^T      (reduced over d)          dP = dO V^T   (over d)
    dV = P^T dO     (over the queries)        dK = dS^T Q   (over the queries)     dQ = dS K   (over keys)

with dS = P * (dP - delta). An fp8 operand carries a scale, and a scale can be folded out of a product
only if it is constant along the reduction axis, so each product quantizes its operands its own way:
Q and K per token for S, dO and V per token for dP; for dV, P with FlashAttention-3's static scale
(P * 256 in e4m3, as the fp8 forward) and dO per head dimension (constant over the queries); for dK, dS
per key (a column of dS) and Q per head dimension; for dQ, dS per query (a row) and K per head dimension.
Q, dO and dS are thus quantized twice. dO and dS carry gradient ranges: each arm takes them in e4m3 or
e5m2. An fp8 product runs with the accumulation the probe measured for e4m3 wgmma
(``flashcupy.inspect.tensorcore``: k32 steps, 14-bit truncated sums; applied to e5m2 too, not measured) or
exactly (float64), to separate the 14-bit accumulator's loss from the quantization's; the other products
take bf16 operands (rounded), summed exactly (float64: float32 accumulation would add far less than the
bf16 rounding of the operands).

Every gradient's error is the RMS of its difference to the float64 reference over the RMS of the
reference, beside the package's bf16 backward (the NumPy twin's) on the same inputs.

Two more studies, on exact accumulation (the quantization alone). The scale's granularity, for each
product alone and all five (dO, dS in e4m3): one scale per head ("tensor"); one per slice along the
reduction axis ("slice", the arms above); one per 64 x 64 tile ("block64", DeepSeek-V3's blocks: a scale
that changes along the reduction axis is applied to each 64-long partial product before the partials
are added, as a kernel would); and one per element ("element": every value keeps its own power of two
and only its mantissa is rounded, with no range effect at all; no product can run it, and P in dV keeps
its static 256).
And stochastic rounding of dS (in dK and dQ, e4m3 with slice scales): rounded up or down with the
probabilities that make the rounding unbiased, against round-to-nearest: the error of one draw, and of
the mean of many draws (what many optimizer steps see).
"""
from __future__ import annotations

import numpy as np

import flashcupy
from flashcupy import reference
from flashcupy.inspect import numpy_dtype, tensorcore

from .common import Context, Report, Table, log, new_figure

PRODUCTS = ("S", "dP", "dV", "dK", "dQ")
P_SCALE = 256.0


# (largest finite, mantissa bits, smallest normal exponent) of the two fp8 formats
_FORMATS = {"e4m3": (448.0, 3, -6), "e5m2": (57344.0, 2, -14)}
GRANULARITIES = ("tensor", "slice", "block64", "element")
BLOCK = 64


def _round_fp8(y, fmt: str, rng=None):
    """y (float64, already scaled) rounded to ``fmt`` (saturating at its largest finite value): to
    nearest even, or stochastically with ``rng`` (up with probability (y - down) / ulp: unbiased)."""
    import ml_dtypes

    fmax, mant, emin = _FORMATS[fmt]
    y = np.clip(y, -fmax, fmax)
    if rng is None:
        dt = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt]
        return y.astype(np.float32).astype(dt).astype(np.float64)
    with np.errstate(divide="ignore"):
        e = np.maximum(np.floor(np.log2(np.abs(y))), emin)  # subnormals share the smallest normal's ulp
    ulp = np.exp2(e - mant)
    down = np.floor(y / ulp) * ulp
    up = rng.random(y.shape) < (y - down) / ulp
    return np.clip(np.where(up, down + ulp, down), -fmax, fmax)


def _fp8(x, fmt: str, reduce_axis: int | None, granularity: str = "slice", rng=None):
    """x (float64) in ``fmt``: (the fp8 values as float64, the scales, broadcastable to x). One scale per
    slice along ``reduce_axis`` ("slice"; None: per head), per head ("tensor"), per 64 x 64 tile of the
    last two axes ("block64"), or per element ("element": each value's own power of two times a
    mantissa rounded to the format's bits, with no range limit). ``rng``:
    stochastic rounding (``_round_fp8``)."""
    fmax, mant, _ = _FORMATS[fmt]
    if granularity == "element":
        with np.errstate(divide="ignore"):
            s = np.where(x != 0, np.exp2(np.floor(np.log2(np.abs(np.where(x != 0, x, 1.0))))), 1.0)
        return _round_fp8(x / s, fmt, rng), s
    if granularity == "block64":
        r, c = x.shape[-2:]
        pad = [(0, 0)] * (x.ndim - 2) + [(0, -r % BLOCK), (0, -c % BLOCK)]
        t = np.pad(np.abs(x), pad).reshape(*x.shape[:-2], -(-r // BLOCK), BLOCK, -(-c // BLOCK), BLOCK)
        amax = t.max(axis=(-3, -1))
        amax = np.repeat(np.repeat(amax, BLOCK, axis=-2), BLOCK, axis=-1)[..., :r, :c]
    else:
        axes = (-2, -1) if reduce_axis is None or granularity == "tensor" else (reduce_axis,)
        amax = np.abs(x).max(axis=axes, keepdims=True)
    s = np.where(amax > 0, amax / fmax, 1.0).astype(np.float32).astype(np.float64)
    return _round_fp8(x / s, fmt, rng), s


def _bf16(x):
    return x.astype(numpy_dtype("bf16")).astype(np.float64)


def _mm(a, b, accumulation: str):
    """a @ b of fp8 values: the tensor core's e4m3 accumulation, or exact."""
    return tensorcore.matmul(a, b, None, "e4m3", "fp32") if accumulation == "tc" else np.matmul(a, b)


def _product(a, b, fmt_a: str, fmt_b: str, accumulation: str, granularity: str = "slice", rng=None):
    """a @ b on fp8 operands: a scaled along its last axis, b along its first (the reduction axis) at
    ``granularity``; scales constant along the reduction (slice, tensor) come out of the product, the
    others (block64, element) are applied before it (dequantized, exact accumulation). ``rng``: a
    rounded stochastically."""
    (qa, sa), (qb, sb) = _fp8(a, fmt_a, -1, granularity, rng), _fp8(b, fmt_b, -2, granularity)
    if granularity in ("slice", "tensor"):
        return _mm(qa, qb, accumulation) * sa * sb
    if accumulation != "exact":
        raise ValueError(f"scales per {granularity} are modelled with exact accumulation only")
    return np.matmul(qa * sa, qb * sb)


def fp8_backward_model(do, q, k, v, o, lse, scale: float, fp8: set, grad_fmt: str, accumulation: str,
                       granularity: str = "slice", ds_rng=None):
    """(dq, dk, dv) float64 of the backward with the products in ``fp8`` on e4m3 operands (dO and dS in
    ``grad_fmt``), the rest on bf16 operands; scales at ``granularity`` (see the module docstring; P
    keeps the forward's static scale); ``ds_rng``: dS rounded stochastically."""
    q, k, v, do, o = (x.astype(np.float64) for x in (q, k, v, do, o))
    lse = lse.astype(np.float64)[..., None]
    kt, vt = np.swapaxes(k, -1, -2), np.swapaxes(v, -1, -2)
    if "S" in fp8:
        s = _product(q, kt, "e4m3", "e4m3", accumulation, granularity)
    else:
        s = _bf16(q) @ _bf16(kt)
    p = np.exp(s * scale - lse).astype(np.float32).astype(np.float64)
    if "dP" in fp8:
        dp = _product(do, vt, grad_fmt, "e4m3", accumulation, granularity)
    else:
        dp = _bf16(do) @ _bf16(vt)
    delta = (do * o).sum(axis=-1, keepdims=True)
    ds = (p * (dp - delta)).astype(np.float32).astype(np.float64)
    pt, dst = np.swapaxes(p, -1, -2), np.swapaxes(ds, -1, -2)
    if "dV" in fp8:  # P * 256 in e4m3 (the forward's static scale), dO per head dimension
        a = _round_fp8(pt * P_SCALE, "e4m3")
        b, sb = _fp8(do, grad_fmt, -2, granularity)
        if granularity not in ("slice", "tensor") and accumulation != "exact":
            raise ValueError(f"scales per {granularity} are modelled with exact accumulation only")
        dv = (_mm(a, b, accumulation) * sb if granularity in ("slice", "tensor")
              else np.matmul(a, b * sb)) / P_SCALE
    else:
        dv = _bf16(pt) @ _bf16(do)
    if "dK" in fp8:
        dk = _product(dst, q, grad_fmt, "e4m3", accumulation, granularity, ds_rng) * scale
    else:
        dk = (_bf16(dst) @ _bf16(q)) * scale
    if "dQ" in fp8:
        dq = _product(ds, k, grad_fmt, "e4m3", accumulation, granularity, ds_rng) * scale
    else:
        dq = (_bf16(ds) @ _bf16(k)) * scale
    return dq, dk, dv


def _rel_rms(x, ref) -> float:
    return float(np.sqrt(np.mean((np.asarray(x, dtype=np.float64) - ref) ** 2) / np.mean(ref ** 2)))


def run_fp8_backward(ctx: Context) -> Report:
    b, h, n, d = ctx.sizes((1, 2, 256, 64), (1, 4, 1024, 64))
    rng = ctx.rng("fp8_backward")
    bf16 = numpy_dtype("bf16")
    q, k, v, do = (rng.standard_normal((b, h, n, d)).astype(bf16) for _ in range(4))
    scale = 1.0 / np.sqrt(d)
    refs = reference.attention_backward(do, q, k, v)
    o_ref, lse_ref = reference.attention(q, k, v, return_lse=True)
    # the package's bf16 backward (the twin on the NumPy backend, the kernels on CUDA)
    dev = ctx.dev(q, k, v, do)
    o, lse = flashcupy.attention(*dev[:3], return_lse=True)
    grads = flashcupy.attention_backward(dev[3], *dev[:3], o, lse)
    host = (lambda x: x) if ctx.backend == "numpy" else __import__("cupy").asnumpy
    base = [_rel_rms(host(g), r) for g, r in zip(grads, refs)]
    rows = [["package bf16 backward", "-", "-", *base, 1.0]]
    log(f"[fp8_backward] bf16 backward: dq {base[0]:.2e}, dk {base[1]:.2e}, dv {base[2]:.2e}")
    o64 = o_ref.astype(bf16)
    arms = [("model, all bf16", set(), "e4m3")]
    arms += [(f"{p} in fp8", {p}, fmt) for fmt in ("e4m3", "e5m2") for p in PRODUCTS]
    arms += [("all five in fp8", set(PRODUCTS), fmt) for fmt in ("e4m3", "e5m2")]
    results = {}
    for name, fp8, fmt in arms:
        for acc in ("exact", "tc") if fp8 else ("exact",):
            errs = [_rel_rms(g, r) for g, r in zip(fp8_backward_model(do, q, k, v, o64, lse_ref, scale, fp8,
                                                                      fmt, acc), refs)]
            worst = max(e / b_ for e, b_ in zip(errs, base))
            rows.append([name, fmt if fp8 else "-", acc if fp8 else "-", *errs, worst])
            results[(name, fmt, acc)] = worst
            log(f"[fp8_backward] {name}, dO/dS {fmt}, {acc}: "
                + ", ".join(f"{g} {e:.2e}" for g, e in zip(("dq", "dk", "dv"), errs))
                + f" ({worst:.1f}x bf16)")
    singles = [(p, fmt, acc, results[(f"{p} in fp8", fmt, acc)]) for p in PRODUCTS for fmt in ("e4m3", "e5m2")
               for acc in ("exact", "tc")]
    within = sorted({p for p, fmt, acc, w in singles if acc == "tc" and w <= 3.0})
    all_best = min(results[("all five in fp8", fmt, "tc")] for fmt in ("e4m3", "e5m2"))
    e4 = [w for p, fmt, acc, w in singles if fmt == "e4m3" and acc == "tc"]
    e5 = [w for p, fmt, acc, w in singles if fmt == "e5m2" and acc == "tc"]
    acc_share = max(abs(results[(f"{p} in fp8", f, "tc")] / results[(f"{p} in fp8", f, "exact")] - 1)
                    for p in PRODUCTS for f in ("e4m3", "e5m2"))
    finding = (f"Products within 3x the bf16 backward's worst gradient error on their own: "
               f"{', '.join(within) or 'none'}. One product on e4m3 operands costs {min(e4):.0f}x to "
               f"{max(e4):.0f}x (dO and dS in e5m2: {min(e5):.0f}x to {max(e5):.0f}x), all five "
               f"{all_best:.0f}x: the quantization of any operand, not the 14-bit accumulator (at most "
               f"{acc_share:.1%} of the error at N = {n}), sets the error.")
    # the scale's granularity (exact accumulation, dO and dS in e4m3)
    gran_rows, gran = [], {}
    for name, fp8 in [*((f"{p} in fp8", {p}) for p in PRODUCTS), ("all five in fp8", set(PRODUCTS))]:
        for g in GRANULARITIES:
            errs = [_rel_rms(x, r) for x, r in zip(fp8_backward_model(do, q, k, v, o64, lse_ref, scale, fp8,
                                                                      "e4m3", "exact", g), refs)]
            gran[(name, g)] = max(e / b_ for e, b_ in zip(errs, base))
            gran_rows.append([name, g, *errs, gran[(name, g)]])
        log(f"[fp8_backward] {name}, scales per "
            + ", ".join(f"{g} {gran[(name, g)]:.1f}x" for g in GRANULARITIES))
    # stochastic rounding of dS (dK and dQ on fp8 operands, e4m3, slice scales, exact accumulation)
    draws = ctx.sizes(8, 16)
    sr_rng = ctx.rng("fp8_backward.sr")
    fp8 = {"dK", "dQ"}
    rn = fp8_backward_model(do, q, k, v, o64, lse_ref, scale, fp8, "e4m3", "exact")
    sr = [fp8_backward_model(do, q, k, v, o64, lse_ref, scale, fp8, "e4m3", "exact", ds_rng=sr_rng)
          for _ in range(draws)]
    sr_mean = [np.mean([x[i] for x in sr], axis=0) for i in range(2)]
    sr_rows = [["round to nearest", 1, *(_rel_rms(rn[i], refs[i]) for i in range(2))],
               ["stochastic, one draw", 1, *(_rel_rms(sr[0][i], refs[i]) for i in range(2))],
               [f"stochastic, mean of {draws} draws", draws,
                *(_rel_rms(sr_mean[i], refs[i]) for i in range(2))],
               ["package bf16 backward", 1, base[0], base[1]]]
    log("[fp8_backward] dS stochastic rounding: " + "; ".join(f"{r[0]}: dq {r[2]:.2e}, dk {r[3]:.2e}"
                                                               for r in sr_rows))
    element = min(gran[(f"{p} in fp8", "element")] for p in PRODUCTS)
    best = min(gran[(f"{p} in fp8", g)] for p in PRODUCTS for g in GRANULARITIES)
    best_g = {p: min(GRANULARITIES, key=lambda g: gran[(f"{p} in fp8", g)]) for p in PRODUCTS}
    finding += (f" Scale granularity (exact accumulation, e4m3): one product alone costs "
                f"{min(gran[(f'{p} in fp8', 'slice')] for p in PRODUCTS):.0f}x to "
                f"{max(gran[(f'{p} in fp8', 'slice')] for p in PRODUCTS):.0f}x with slice scales, "
                f"{min(gran[(f'{p} in fp8', 'block64')] for p in PRODUCTS):.0f}x to "
                f"{max(gran[(f'{p} in fp8', 'block64')] for p in PRODUCTS):.0f}x with 64 x 64 blocks, and at "
                f"least {element:.0f}x with a scale per element (no range effect at all): "
                + ("no granularity brings a product within 3x" if best > 3 else
                   f"a product comes within 3x ({best:.1f}x)")
                + " (best granularity per product: "
                + ", ".join(f"{p} {g}" for p, g in best_g.items()) + "). Stochastic rounding of dS: one "
                f"draw {max(sr_rows[1][2:4]) / max(sr_rows[0][2:4]):.2f}x round-to-nearest's error, the mean "
                f"of {draws} draws {max(sr_rows[2][2:4]) / max(sr_rows[0][2:4]):.2f}x (Q and K, the other "
                "operands, keep round-to-nearest).")
    fig, (ax,) = new_figure()
    x = np.arange(len(PRODUCTS) + 1)
    labels = [*PRODUCTS, "all"]
    for i, (fmt, acc) in enumerate([(f, a) for f in ("e4m3", "e5m2") for a in ("exact", "tc")]):
        vals = [results[(f"{p} in fp8", fmt, acc)] for p in PRODUCTS]
        vals.append(results[("all five in fp8", fmt, acc)])
        ax.bar(x + 0.2 * i - 0.3, vals, width=0.2, label=f"dO, dS {fmt}, {acc} accumulation")
    ax.axhline(3.0, color="k", lw=1, label="3x the bf16 backward")
    ax.set_xticks(x, labels)
    ax.set_yscale("log")
    ax.set_xlabel("the product(s) run on fp8 operands")
    ax.set_ylabel("worst gradient error / the bf16 backward's")
    ax.set_title("fp8 backward, product by product (NumPy model)", fontsize=10)
    ax.legend(fontsize=7)
    setup = {"shapes": f"B={b}, H={h}, N={n}, D={d}, non-causal, q, k, v, dO ~ N(0, 1) rounded to bf16",
             "scales": "per the reduction axis of each product (module docstring); P with the static 256",
             "accumulation": "tc: the e4m3 wgmma accumulation measured on the H200 (14 bits, truncated); "
                             "exact: float64",
             "error": "RMS(x - x_ref) / RMS(x_ref), x_ref float64; the last column: the worst gradient's "
                      "over the package's bf16 backward's"}
    return Report("fp8_backward", "fp8 backward: which products can take fp8", finding, setup,
                  [Table("Gradient errors against float64 (relative RMS)",
                         ["arm", "dO, dS format", "accumulation", "dQ", "dK", "dV", "worst / bf16"], rows),
                   Table("Scale granularity (dO, dS in e4m3; exact accumulation): gradient errors against "
                         "float64 (relative RMS)",
                         ["arm", "scales per", "dQ", "dK", "dV", "worst / bf16"], gran_rows),
                   Table("Stochastic rounding of dS (dK and dQ on e4m3 operands, slice scales, exact "
                         "accumulation): errors against float64 (relative RMS)",
                         ["dS rounding", "draws averaged", "dQ", "dK"], sr_rows)],
                  figure=fig, figure_caption="Each product alone in fp8, and all five.",
                  notes=[__doc__.split("\n\n")[1].replace("\n", " ")])

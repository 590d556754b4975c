"""``sinks``: attention sinks (a logit z per head in each row's softmax denominator, no value row) against
their strength, and where the sink enters the softmax.

Strength: delta = z - max_i lse_i, the sink's logit above the largest LSE of the head's rows over their
keys; at delta the sink takes at least e^delta / (1 + e^delta) of every row, and the keys' probabilities
shrink by e^-delta or more.

Two orders. The package's kernels merge the sink after the key loop (``flashcupy._sinks``): the keys'
P keep their own row max, and only o' = e^(lse - lse') o is small, rounded once more to the output dtype.
Reference implementations of gpt-oss start the online softmax from the sink (m = z, l = 1): then every
P = e^(s - z) of the loop shrinks with the sink, and a P stored in a narrow format underflows - fp16 below
6.1e-5 (its normal range), e4m3 below 2^-9 / p_scale - the "P-collapse" that Lau 2026 (arXiv
2606.06521) reports for fp8 with dominant sinks, with reverse key order lowering the MSE 3-10x there. The
sink-first order runs on the NumPy twin (``flashcupy.inspect.sink_first_forward``, ``_fp8``), which
follows the kernels' rounding (16-bit P, e4m3 P times p_scale, the fp8 accumulator's 14-bit sums); the
merge order runs on the kernels on the CUDA backend (the fp8 forward kernel at D = 128) and on the twin
on the NumPy backend.

Backward (merge order, the 16-bit kernels): the backward recomputes P = e^(s - lse') from the saved lse',
which holds the sink, so a dominant sink shrinks the backward's P and dS too: dV = P^T dO and dK, dQ from
dS meet the same 16-bit range. The gradients of q, k, v and of the sinks are measured against float64,
beside naive same-precision attention's (which stores P in the dtype as well).

Inputs: q, k ~ N(0, 1), v ~ N(0.5, 1) (so that o is not near zero and its relative error means
something), no mask; errors are max |x - x_ref| / max |x_ref| with x_ref float64 on the rounded inputs.
"""
from __future__ import annotations

import numpy as np

import flashcupy
from flashcupy import fp8, inspect, naive, reference
from flashcupy.inspect import numpy_dtype

from .common import Context, Report, Table, log, new_figure

DTYPES = ("f16", "bf16")


def _rel(x, ref) -> float:
    x = np.asarray(x.get() if hasattr(x, "get") else x, dtype=np.float64)
    return float(np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-300))


def run_sinks(ctx: Context) -> Report:
    b, h, n, d = ctx.sizes((1, 2, 192, 128), (1, 4, 2048, 128))
    deltas = ctx.sizes([-4.0, 0.0, 8.0, 16.0], [-4.0, -2.0, 0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0,
                                                          14.0, 16.0, 18.0])
    rng = ctx.rng("sinks")
    x32 = [rng.standard_normal((b, h, n, d)).astype(np.float32) for _ in range(4)]
    x32[2] += 0.5
    fwd_rows, bwd_rows, curves = [], [], {}

    def add(key, err):
        curves.setdefault(key, []).append(err)

    for dname in DTYPES:
        dt = numpy_dtype(dname)
        q, k, v, do = (x.astype(dt) for x in x32)
        q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, do))
        lse_keys = reference.attention(q64, k64, v64, return_lse=True)[1]
        dev = ctx.dev(q, k, v, do)
        rev = [np.ascontiguousarray(x[:, :, ::-1]) for x in (k, v)]
        for delta in deltas:
            z = (lse_keys.max(axis=(0, 2)) + delta).astype(np.float32)
            o_ref = reference.attention(q64, k64, v64, sinks=z)
            o, lse = flashcupy.attention(*dev[:3], sinks=z, return_lse=True)
            first = inspect.sink_first_forward(q, k, v, z)
            first_rev = inspect.sink_first_forward(q, *rev, z)
            e = [_rel(o, o_ref), _rel(first, o_ref), _rel(first_rev, o_ref),
                 _rel(naive.attention(*dev[:3], sinks=z), o_ref)]
            for order, err in zip(("merge", "sink first", "sink first, keys reversed", "naive"), e):
                fwd_rows.append([dname, "-", delta, order, err])
                add((dname, order), err)
            grads = flashcupy.attention_backward(dev[3], *dev[:3], o, lse, sinks=z)
            refs = reference.attention_backward(do64, q64, k64, v64, sinks=z)
            naives = naive.attention_backward(dev[3], *dev[:3], sinks=z)
            g = [_rel(a, r) for a, r in zip(grads, refs)]
            gn = [_rel(a, r) for a, r in zip(naives, refs)]
            bwd_rows.append([dname, delta, *g, *gn])
            for name, err in zip(("dq", "dk", "dv", "dsinks"), g):
                add((dname, "bwd " + name), err)
            log(f"[sinks] {dname} delta={delta:+.0f}: o merge {e[0]:.1e}, sink first {e[1]:.1e} "
                f"(reversed {e[2]:.1e}), naive {e[3]:.1e}; grads " + ", ".join(f"{x:.1e}" for x in g))

    # fp8 (e4m3, per-token q and k scales, per-head v scale), D = 128, on fewer rows and strengths than
    # the 16-bit dtypes: the sink-first arms run the twin's model of the fp8 accumulator (k32 steps,
    # 14-bit sums), seconds per call at N = 512
    n8 = ctx.sizes(n, 512)
    deltas8 = ctx.sizes(deltas, [-4.0, 0.0, 4.0, 8.0, 12.0, 16.0])
    x32 = [np.ascontiguousarray(x[:, :2, :n8]) for x in x32]
    qh, kh = (fp8.quantize(x, "e4m3", "token") for x in x32[:2])
    vh = fp8.quantize(x32[2], "e4m3", "head")
    deq = [fp8.dequantize(x).astype(np.float64) for x in (qh, kh, vh)]
    lse_keys = reference.attention(*deq, return_lse=True)[1]
    qk8 = (qh, kh, vh)
    if ctx.backend == "cuda":
        import cupy

        grans = ("token", "token", "head")
        qk8 = tuple(fp8.quantize(cupy.asarray(x), "e4m3", g) for x, g in zip(x32[:3], grans))
    k_rev = fp8.quantize(np.ascontiguousarray(x32[1][:, :, ::-1]), "e4m3", "token")
    v_rev = fp8.quantize(np.ascontiguousarray(x32[2][:, :, ::-1]), "e4m3", "head")
    for delta in deltas8:
        z = (lse_keys.max(axis=(0, 2)) + delta).astype(np.float32)
        o_ref = reference.attention(*deq, sinks=z)
        arms = [("merge", 256.0, flashcupy.attention_fp8(*qk8, sinks=z)),
                ("sink first", 256.0, inspect.sink_first_forward_fp8(qh, kh, vh, z)[0]),
                ("sink first", 448.0, inspect.sink_first_forward_fp8(qh, kh, vh, z, p_scale=448.0)[0]),
                ("sink first, keys reversed", 256.0, inspect.sink_first_forward_fp8(qh, k_rev, v_rev, z)[0])]
        for order, p_scale, o in arms:
            err = _rel(o, o_ref)
            fwd_rows.append(["e4m3", p_scale, delta, order, err])
            add(("e4m3", order + ("" if p_scale == 256.0 else f", p_scale {p_scale:.0f}")), err)
        log(f"[sinks] e4m3 delta={delta:+.0f}: " + ", ".join(f"{a} (p {p:.0f}) {_rel(o, o_ref):.1e}"
                                                              for a, p, o in arms))

    def at(key, delta):
        return curves[key][(deltas8 if key[0] == "e4m3" else deltas).index(delta)]

    mid = 8.0 if 8.0 in deltas else deltas[len(deltas) // 2]
    top = deltas[-1]
    f16_first, f16_merge = at(("f16", "sink first"), mid), at(("f16", "merge"), mid)
    e4_first, e4_merge = at(("e4m3", "sink first"), mid), at(("e4m3", "merge"), mid)
    finding = (f"With a sink e^{mid:.0f} above every row's keys (delta = {mid:.0f}), the sink-first order "
               f"loses o to the P-collapse: fp16 {f16_first:.1e} and e4m3 {e4_first:.1e} relative error "
               f"against {f16_merge:.1e} and {e4_merge:.1e} for the kernels' merge after the loop (bf16 "
               f"{at(('bf16', 'sink first'), mid):.1e} vs {at(('bf16', 'merge'), mid):.1e}: its range holds "
               f"the small P); e4m3 sink-first with the keys reversed gives "
               f"{at(('e4m3', 'sink first, keys reversed'), mid):.1e}, with p_scale 448 "
               f"{at(('e4m3', 'sink first, p_scale 448'), mid):.1e}; at delta = {top:.0f} the merge holds "
               f"bf16 at {at(('bf16', 'merge'), top):.1e} while fp16's output itself underflows "
               f"({at(('f16', 'merge'), top):.1e}); the merge-order backward, whose P carry the sink, "
               f"keeps dV at {at(('f16', 'bwd dv'), mid):.1e} (fp16) and {at(('bf16', 'bwd dv'), mid):.1e} "
               f"(bf16) at delta = {mid:.0f}, {at(('f16', 'bwd dv'), top):.1e} and "
               f"{at(('bf16', 'bwd dv'), top):.1e} at {top:.0f}.")
    fig, (ax0, ax1) = new_figure(2, width=6.0)
    styles = {"merge": "-", "sink first": "--", "sink first, keys reversed": ":", "naive": "-."}
    colors = {"f16": "C0", "bf16": "C1", "e4m3": "C2"}
    for (dname, order), errs in curves.items():
        if order.startswith("bwd"):
            continue
        ls = styles.get(order, (0, (5, 1, 1, 1)))  # e4m3 sink first with p_scale 448
        ax0.plot(deltas8 if dname == "e4m3" else deltas, errs, ls=ls, marker="o", ms=3, color=colors[dname],
                 label=f"{dname}, {order}")
    ax0.set_title("Forward: where the sink enters the softmax", fontsize=10)
    for dname in DTYPES:
        for name, mk in (("dq", "o"), ("dk", "s"), ("dv", "^"), ("dsinks", "x")):
            ax1.plot(deltas, curves[(dname, "bwd " + name)], marker=mk, ms=4, color=colors[dname],
                     label=f"{dname} {name}")
    ax1.set_title("Backward (merge order): the sink is in every P", fontsize=10)
    for ax in (ax0, ax1):
        ax.set_yscale("log")
        ax.set_xlabel("sink strength delta = z - max lse over the keys")
        ax.set_ylabel("max |x - x_ref| / max |x_ref|")
        ax.legend(fontsize=6)
    setup = {"shapes": f"B={b}, H={h}, N={n}, D={d}, no mask; q, k ~ N(0, 1), v ~ N(0.5, 1), rounded to the "
                       f"dtype; e4m3: the first 2 heads and {n8} rows and keys of the same draws, "
                       "per-token q and k scales, a per-head v scale",
             "strengths": f"delta in {deltas} (e4m3: {deltas8}): z_h = max over the head's rows of lse_keys "
                          "+ delta",
             "merge order": "flashcupy.attention / attention_fp8 with sinks (kernel='auto'; the twin on "
                            "NumPy), fp32 accumulators, p_scale 256 for e4m3",
             "sink-first order": "flashcupy.inspect.sink_first_forward(_fp8): the twin with m = z, l = 1 "
                                 "before the first key",
             "error": "max |x - x_ref| / max |x_ref|, x_ref float64 (flashcupy.reference) on the rounded "
                      "inputs"}
    return Report("sinks", "Attention sinks: the P-collapse against the sink's strength, and where the sink "
                  "enters", finding, setup,
                  [Table("Forward: relative error of o against the sink strength",
                         ["dtype", "p_scale", "delta", "order", "o error"], fwd_rows),
                   Table("Backward (merge order, the 16-bit kernels): relative errors, and naive "
                         "same-precision attention's",
                         ["dtype", "delta", "dQ", "dK", "dV", "d sinks", "naive dQ", "naive dK", "naive dV",
                          "naive d sinks"], bwd_rows)],
                  figure=fig, figure_caption="Relative error against the sink's strength: forward (left, "
                  "both orders) and backward (right, merge order).",
                  notes=[__doc__.split("\n\n")[2].replace("\n", " ")])

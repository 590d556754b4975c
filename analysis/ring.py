"""``ring``: ring attention's error against the number of ranks, simulated in one process
(``flashcupy.parallel.simulate_ring``: each rank's chunk-pair calls at each step, merged in the ring's
order, the gradients added in the ring's order), with the running output and the travelling gradients
held in float32 or bf16.

bf16 inputs, causal, the zigzag layout; every error is against the float64 attention of the whole
sequence, row by row relative to the row's largest reference value, beside the single call of the whole
sequence (one
rank, no ring). The question (ring-flash-attention issue 42 reports errors growing with the ring size,
catastrophic in the backward at 4 to 8 ranks with bf16): which of the ring's steps, if any, makes the
error grow with the ranks. The merge experiment measured the merge alone: parts stored in bf16 and
merged in float32 keep their error, a bf16 running output grows with the parts. Here the same with the
ring's own parts, and the backward, whose dK and dV are sums over every rank's queries.
"""
from __future__ import annotations

import numpy as np

import flashcupy
from flashcupy import parallel, reference
from flashcupy.inspect import numpy_dtype

from .common import Context, Report, Table, log, new_figure

NAMES = ("o", "dq", "dk", "dv")


def _errors(out, ref) -> list[float]:
    """Per output: the largest row error relative to the row's own largest reference value (rows of o
    and dq are queries, of dk and dv keys): a late query row of a causal sequence averages many values
    and is small, and an error measured against the largest row of all would hide it."""
    errs = []
    for a, r in zip(out, ref):
        scale = np.abs(r).max(axis=-1)
        err = np.abs(np.asarray(a, dtype=np.float64) - r).max(axis=-1)
        errs.append(float((err[scale > 0] / scale[scale > 0]).max()))
    return errs


BREAK_WORLD = 4
SINK_LOGITS = (40.0, 80.0, 100.0, 120.0)


def _softplus_break(ctx: Context, b, h, n, d, host):
    """The ring with and without the stable softplus in its LSE update (``merge_ablate``), on inputs with
    a sink: key 0 scores about ``logit`` (scaled) against every query, as a BOS token with a large logit
    does. In the zigzag ring every rank but 0 merges key 0's chunk after its own parts, a gap of about
    logit - 5 in LSE: past 88.72 the naive log(1 + exp(gap)) overflows. Errors here are relative to the
    largest reference value (rows that attend to the sink alone have gradients near 0, whose own scale
    would make any rounding look huge)."""
    rng = ctx.rng("ring-softplus")
    bf16 = numpy_dtype("bf16")
    scale = 1.0 / np.sqrt(d)
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    rows, table = {}, []
    for logit in SINK_LOGITS:
        q = (rng.standard_normal((b, h, n, d)) + 3.0 * u).astype(bf16)
        k = rng.standard_normal((b, h, n, d))
        k[:, :, 0] = logit / (3.0 * scale) * u
        k = k.astype(bf16)
        v, do = (rng.standard_normal((b, h, n, d)).astype(bf16) for _ in range(2))
        ref = (reference.attention(q, k, v, causal=True),
               *reference.attention_backward(do, q, k, v, causal=True))
        dev = ctx.dev(q, k, v, do)
        for ablate in (None, "stable_softplus"):
            out = parallel.simulate_ring(*dev[:3], BREAK_WORLD, causal=True, do=dev[3], merge_ablate=ablate)
            errs = [float(np.abs(np.asarray(host(x), np.float64) - r).max() / np.abs(r).max())
                    for x, r in zip((out[0], *out[2:]), ref)]
            inf_rows = int(np.isposinf(host(out[1])).sum())
            name = "stable (logsigmoid)" if ablate is None else "log(1 + exp(d)) (break)"
            table.append([logit, name, inf_rows, *errs])
            rows[(logit, ablate)] = (inf_rows, errs)
            log(f"[ring] sink logit {logit:.0f}, {name}: {inf_rows} rows at lse = inf, "
                + ", ".join(f"{nm} {e:.2e}" for nm, e in zip(NAMES, errs)))
    top = SINK_LOGITS[-1]
    inf_rows, broken = rows[(top, "stable_softplus")]
    _, intact = rows[(top, None)]
    finding = ("Without the stable softplus in the fold's LSE update (lse + log(1 + exp(d)), the update "
               f"of an early ring-flash-attention), a sink key of logit {top:.0f} sends {inf_rows} rows' LSE "
               f"to inf at {BREAK_WORLD} ranks: o is unchanged ({broken[0]:.1e}, intact {intact[0]:.1e}) "
               f"while dV goes from {intact[3]:.1e} to {broken[3]:.2g} (those rows' P, recomputed from "
               "lse = inf, are 0, so the sink key's dV loses them): a backward that fails behind a forward "
               "that looks right.")
    return table, finding


def run_ring(ctx: Context) -> Report:
    b, h, n, d = ctx.sizes((1, 2, 512, 32), (1, 8, 8192, 64))
    worlds = ctx.sizes([1, 2, 4, 8, 16], [1, 2, 4, 8, 16, 32, 64])
    rng = ctx.rng("ring")
    bf16 = numpy_dtype("bf16")
    q, k, v, do = (rng.standard_normal((b, h, n, d)).astype(bf16) for _ in range(4))
    ref = (reference.attention(q, k, v, causal=True), *reference.attention_backward(do, q, k, v, causal=True))
    dev = ctx.dev(q, k, v, do)

    def host(x):
        return x if ctx.backend == "numpy" else __import__("cupy").asnumpy(x)

    o1, lse1 = flashcupy.attention(*dev[:3], causal=True, return_lse=True)
    single = _errors([host(x) for x in (o1, *flashcupy.attention_backward(dev[3], *dev[:3], o1, lse1,
                                                                          causal=True))], ref)
    rows = [["single call", "-", *single]]
    curves = {}
    for dt in ("float32", "bfloat16"):
        for w in worlds:
            out = parallel.simulate_ring(*dev[:3], w, causal=True, do=dev[3], state_dtype=dt, grad_dtype=dt)
            errs = _errors([host(x) for x in (out[0], *out[2:])], ref)
            rows.append([w, dt, *errs])
            curves.setdefault(dt, []).append(errs)
            log(f"[ring] {w} ranks, {dt} state and gradients: "
                + ", ".join(f"{nm} {e:.2e}" for nm, e in zip(NAMES, errs)))
    f32, bf = np.array(curves["float32"]), np.array(curves["bfloat16"])
    finding = (f"Over {worlds[-1]} simulated ranks (N = {n}, causal, bf16 inputs), with float32 running "
               f"output and gradients the ring stays at {f32[:, 0].max() / single[0]:.1f}x (o) and "
               f"{(f32[:, 1:] / np.array(single[1:])).max():.1f}x (worst gradient) the single call's error; "
               f"held in bf16 they grow to {bf[-1, 0] / single[0]:.1f}x (o) and "
               f"{(bf[-1, 1:] / np.array(single[1:])).max():.1f}x (worst gradient, "
               f"{NAMES[1 + int(np.argmax(bf[-1, 1:] / np.array(single[1:])))]}) at {worlds[-1]} ranks.")
    breaks, break_finding = _softplus_break(ctx, b, h, n, d, host)
    finding += " " + break_finding
    fig, (ax,) = new_figure()
    for i, name in enumerate(NAMES):
        ax.plot(worlds, f32[:, i], marker="o", color=f"C{i}", label=f"{name}, float32 state")
        ax.plot(worlds, bf[:, i], marker="x", ls="--", color=f"C{i}", label=f"{name}, bf16 state")
        ax.axhline(single[i], color=f"C{i}", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks (simulated)")
    ax.set_ylabel("max over rows of the row's error / its max |x_ref|")
    ax.set_title("Ring attention against the ranks (dotted: one call of the whole sequence)", fontsize=10)
    ax.legend(fontsize=6, ncol=2)
    setup = {"shapes": f"B={b}, H={h}, N={n}, D={d}, causal, q, k, v, dO ~ N(0, 1) rounded to bf16",
             "ring": "flashcupy.parallel.simulate_ring: zigzag layout, the chunk pairs of each rank and "
                     "step, merge_states(form='logsigmoid') in the ring's order; dq, dk, dv added in the "
                     "ring's order into accumulators held in the state dtype",
             "kernel": "kernel='auto', default tiles (the NumPy twin on the NumPy backend)",
             "ranks": str(worlds)}
    return Report("ring", "Ring attention against the number of ranks (simulated)", finding, setup,
                  [Table("Error against float64 of the whole sequence (largest row error over the row's "
                         "max |x_ref|)",
                         ["ranks", "state and gradient dtype", "o", "dQ", "dK", "dV"], rows),
                   Table("The fold's LSE update without its stable form, against a sink key's logit "
                         f"({BREAK_WORLD} ranks, float32 state and gradients; errors max |x - x_ref| / "
                         "max |x_ref|: a row that attends to the sink alone has gradients near 0)",
                         ["sink logit", "LSE update", "rows with lse = inf", "o", "dQ", "dK", "dV"], breaks)],
                  figure=fig, figure_caption="Error of ring attention against the simulated ranks.",
                  notes=[__doc__.split("\n\n")[1].replace("\n", " ")])

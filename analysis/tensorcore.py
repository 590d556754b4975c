"""How the tensor cores accumulate, measured: one k16 step of mma.sync (the mma family) and of wgmma (the
wgmma family), fp16 and bf16 inputs, fp32 and fp16 accumulators.

Each case computes d = sum_{k<16} a_k b_k + c with one instruction (kernels_cu/tc_probe.cu). The products of
two 16-bit values are exact; what the hardware does with them is the question. The candidate models are

    align(ref, W), round(R):  every term (the 16 products and c) is truncated toward zero to a multiple
                         of 2^(E - W + 1), E the largest exponent among the terms (ref "exponent sum":
                         a product's exponent taken as exp(a) + exp(b), before its significand product
                         in [1, 4) is normalized; ref "value": the exponent of the product itself), the
                         truncated terms are summed exactly, and the sum is rounded to the accumulator's
                         precision with R (toward zero "rz" or to nearest even "rn"),

with W = 24 + 2 meaning "fp32's significand and 2 guard bits". Two kinds of inputs decide W and R:
directed cases (c = 2^12 and 16 equal products 2^-s accumulator ulps of c, s = 1 ..; sums of 1 + a
fraction of an ulp, of both signs) and random cases (products between 2^-20 and 2^8, a quarter with
c cancelling the products). The report gives, per (instruction, dtype, accumulator), the model that
explains every case (or the best and how often it misses), the rounding the NumPy twin assumes (exact
sum, round to nearest) beside it, and whether mma.sync and wgmma give the same bits.
"""
from __future__ import annotations

import numpy as np

from flashcupy._checks import numpy_dtype

from .common import Context, Report, Table, log, new_figure

CONFIGS = [("f16", "fp32"), ("bf16", "fp32"), ("f16", "fp16")]  # (inputs, accumulator)
PRECISION = {"fp32": 24, "fp16": 11}  # significant bits of the accumulator
C_BIG = 2.0 ** 12                      # the large term of the directed alignment cases
ALIGN_STEPS = 20                       # s = 1 .. ALIGN_STEPS bits below c's ulp
ACC_DTYPE = {"fp32": np.float32, "fp16": np.float16}


# ---------------------------------------------------------------------------------------------------
# the model

MIN_ULP = {"fp32": 2.0 ** -149, "fp16": 2.0 ** -24}  # the subnormal spacing of the accumulator


def round_to_bits(x: np.ndarray, bits: int, mode: str, min_ulp: float = 0.0) -> np.ndarray:
    """x rounded to ``bits`` significant bits (and to a multiple of ``min_ulp``: subnormal results),
    toward zero ("rz") or to nearest even ("rn"); no overflow (the cases stay in range)."""
    _, e = np.frexp(x)                       # x = m 2^e, 0.5 <= |m| < 1
    ulp = np.maximum(np.ldexp(1.0, e - bits), min_ulp)
    q = x / ulp
    return np.where(x == 0, 0.0, (np.trunc(q) if mode == "rz" else np.rint(q)) * ulp)


def _exponent(x: np.ndarray) -> np.ndarray:
    """floor(log2 |x|) for x != 0 (a very small number for 0, which never leads)."""
    return np.where(x != 0, np.frexp(x)[1] - 1, -(10 ** 6))


def accumulate(a: np.ndarray, b: np.ndarray, c: np.ndarray, align_bits: int | None, acc: str, mode: str,
               ref: str = "exponent sum") -> np.ndarray:
    """The candidate model for d = sum_k a_k b_k + c, ``a``, ``b`` (n, 16), ``c`` (n,), all float64.

    Every term is truncated toward zero to a multiple of 2^(E - align_bits + 1), where E is the largest
    exponent among the terms: with ref="exponent sum" a product's exponent is exp(a) + exp(b) (its
    significand product, in [1, 4), is not normalized first), with ref="value" it is the exponent of the
    product's value; c's is its own. align_bits=None keeps every term exactly. The truncated terms are
    summed exactly and the sum is rounded to the accumulator ``acc`` with ``mode``. Exact in float64
    for the ranges used here."""
    prod = a * b
    terms = np.concatenate([prod, c[:, None]], axis=1)
    if align_bits is not None:
        ep = _exponent(a) + _exponent(b) if ref == "exponent sum" else _exponent(prod)
        ep = np.where(prod != 0, ep, -(10 ** 6))
        e = np.maximum(ep.max(axis=1), _exponent(c))[:, None]
        grid = np.ldexp(1.0, e - (align_bits - 1))
        terms = np.trunc(terms / grid) * grid
    return round_to_bits(terms.sum(axis=1), PRECISION[acc], mode, MIN_ULP[acc])


def fit(a, b, c, measured, acc):
    """Agreement of every candidate (reference, W from p to 39 or exact, rz or rn) with the
    measured results: [(ref, W, mode, fraction equal)], best first (ties: rz, then the smaller W)."""
    p = PRECISION[acc]
    out = []
    for ref in ("exponent sum", "value"):
        for mode in ("rz", "rn"):
            for w in [*range(p, 40), None]:
                pred = accumulate(a, b, c, w, acc, mode, ref)
                out.append((ref, w, mode, float(np.mean(pred == measured))))
    return sorted(out, key=lambda r: (-r[3], r[0] != "exponent sum", r[2] != "rz",
                                      r[1] if r[1] is not None else 99))


# ---------------------------------------------------------------------------------------------------
# the cases


def _pow2_pair(log2v: np.ndarray, lo: int) -> tuple[np.ndarray, np.ndarray]:
    """Factors a, b (powers of two, each >= 2^lo: normal in fp16 for lo = -14) with a b = 2^log2v."""
    a = np.maximum(np.ceil(log2v / 2), lo)
    return np.ldexp(1.0, a.astype(int)), np.ldexp(1.0, (log2v - a).astype(int))


def directed_cases(acc: str):
    """(names, a (n,16), b (n,16), c (n,)) exact float64 values, each exactly representable in fp16 (and
    bf16) inputs and the accumulator."""
    p = PRECISION[acc]
    names, a, b, c = [], [], [], []
    for sign, tag in ((-1.0, "-"), (1.0, "+")):
        for s in range(1, ALIGN_STEPS + 1):
            # c = 2^12 and 16 products of sign 2^-s of c's ulp (2^(12 - (p - 1) - s))
            av, bv = _pow2_pair(np.full(16, 12 - (p - 1) - s, float), -14)
            names.append(f"align {tag}{s}")
            a.append(sign * av), b.append(bv), c.append(C_BIG)
    for tag, extra, sign in (("1+0.75ulp", (1, 2), 1.0), ("1+0.25ulp", (2,), 1.0),
                             ("-(1+0.75ulp)", (1, 2), -1.0), ("-(1+0.25ulp)", (2,), -1.0)):
        # products 1 and 2^-(p-1) 2^-e for each e in extra; c = 0, then the same with c = the 1
        for c_is_one in (False, True):
            av, bv = np.zeros(16), np.zeros(16)
            if not c_is_one:
                av[0], bv[0] = sign, 1.0
            for i, e in enumerate(extra, start=1):
                x, y = _pow2_pair(np.array([-(p - 1) - e], float), -14)
                av[i], bv[i] = sign * x[0], y[0]
            names.append(f"{tag}, c={'1' if c_is_one else '0'}")
            a.append(av), b.append(bv), c.append(sign if c_is_one else 0.0)
    return names, np.array(a), np.array(b), np.array(c)


def random_cases(rng, n: int, dname: str, acc: str):
    """n cases: a and b of random sign with magnitudes in [2^-2, 2^4) (for a quarter of the cases
    [2^-10, 2^4)), rounded to the inputs' type, so products in [2^-4, 2^8) ([2^-20, 2^8)); c of random
    sign in [2^-4, 2^8), or (a quarter) minus the products' sum rounded to the accumulator, times
    1 + U(-2^-8, 2^-8) and rounded again: cancellation, where the alignment shows."""
    dt, acc_dt = numpy_dtype(dname), ACC_DTYPE[acc]

    def draw(lo):
        mag = np.ldexp(1.0 + rng.random((n, 16)), rng.integers(lo, 4, (n, 16)))
        return (rng.choice([-1.0, 1.0], (n, 16)) * mag).astype(dt).astype(np.float64)

    wide = rng.random(n) < 0.25
    a = np.where(wide[:, None], draw(-10), draw(-2))
    b = np.where(wide[:, None], draw(-10), draw(-2))
    c = (rng.choice([-1.0, 1.0], n) * np.ldexp(1.0 + rng.random(n), rng.integers(-4, 8, n)))
    cancel = rng.random(n) < 0.25
    s = (a * b).sum(axis=1).astype(acc_dt).astype(np.float64)
    c = np.where(cancel, -s * (1.0 + rng.uniform(-2.0 ** -8, 2.0 ** -8, n)), c)
    return a, b, c.astype(acc_dt).astype(np.float64)


# ---------------------------------------------------------------------------------------------------
# the GPU side


def _modules(dname: str, acc: str):
    import cupy

    from flashcupy._build import DTYPES, nvrtc_options, source_text

    defines = {"FC_DTYPE": DTYPES[dname][0], "FC_ACCUM_F16": int(acc == "fp16"), "FC_HEAD_DIM": 64,
               "FC_HEAD_DIM_PAD": 64, "FC_NUM_THREADS": 128, "FC_ABLATE_MAX_SUBTRACTION": 0,
               "FC_ABLATE_RESCALING": 0}
    hopper = int(cupy.cuda.Device().compute_capability) == 90
    arch = ("-arch=sm_90a",) if hopper else ()
    if not hopper:  # wgmma needs sm_90a: compile the mma probe alone
        defines["FC_TC_PROBE_NO_WGMMA"] = 1
    mod = cupy.RawModule(code=source_text("tc_probe.cu"), options=nvrtc_options(defines) + arch)
    return mod, hopper


def measure(dname: str, acc: str, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> dict:
    """{"mma": d, "wgmma": d (Hopper only)} for the cases (a, b, c), float64."""
    import cupy

    dt = numpy_dtype(dname)
    ad = cupy.asarray(a.astype(dt).view(np.uint16))
    bd = cupy.asarray(b.astype(dt).view(np.uint16))
    cd = cupy.asarray(c.astype(np.float32))
    n = len(c)
    mod, hopper = _modules(dname, acc)
    out = {}
    for name in ("mma", "wgmma") if hopper else ("mma",):
        d = cupy.full(n, np.nan, dtype=np.float32)
        if name == "mma":
            mod.get_function("tc_probe_mma")(((n + 3) // 4,), (128,), (ad, bd, cd, d, np.int32(n)))
        else:
            mod.get_function("tc_probe_wgmma")((n,), (128,), (ad, bd, cd, d, np.int32(n)))
        out[name] = cupy.asnumpy(d).astype(np.float64)
    return out


# ---------------------------------------------------------------------------------------------------
# the experiment


def _model_name(ref, w, mode):
    if w is None:
        return f"exact sum, {mode}"
    return f"align to the largest {ref}, {w} bits (24 + {w - 24}), {mode}"


def run_tensorcore(ctx: Context) -> Report:
    rng = np.random.default_rng(ctx.seed)
    n_random = 512 if ctx.quick else 8192
    on_gpu = ctx.backend == "cuda"
    rows, series, data = [], {}, {}
    for dname, acc in CONFIGS:
        p = PRECISION[acc]
        names, da, db, dc = directed_cases(acc)
        ra, rb, rc = random_cases(rng, n_random, dname, acc)
        a, b, c = np.concatenate([da, ra]), np.concatenate([db, rb]), np.concatenate([dc, rc])
        twin = accumulate(a, b, c, None, acc, "rn")          # what the NumPy twin assumes
        if on_gpu:
            got = measure(dname, acc, a, b, c)
        else:  # no device: the model measured on the H200 stands in (a prediction, not a measurement)
            got = {"model (no GPU)": accumulate(a, b, c, p + 2, acc, "rz" if acc == "fp32" else "rn")}
        same = (bool(np.array_equal(got["mma"], got["wgmma"], equal_nan=True))
                if "wgmma" in got else None)
        for instr, d in got.items():
            ranking = fit(a, b, c, d, acc)
            ref, w, mode, agree = ranking[0]
            by_value = max(r[3] for r in ranking if r[0] == "value")
            nan = int(np.isnan(d).sum())
            rows.append([instr, dname, acc, _model_name(ref, w, mode), agree, len(c), by_value,
                         float(np.mean(twin == d)), same, nan])
            series[(instr, dname, acc)] = (d[:ALIGN_STEPS] - C_BIG) / (C_BIG * 2.0 ** (1 - p))  # ulps of c
            data[f"{instr} {dname} acc {acc}"] = {
                "best": {"reference": ref, "align_bits": w, "mode": mode, "agreement": agree},
                "ranking": [{"reference": r[0], "align_bits": r[1], "mode": r[2], "agreement": r[3]}
                            for r in ranking[:8]],
                "directed": {nm: float(x) for nm, x in zip(names, d[:len(names)])},
                "twin_agreement": float(np.mean(twin == d)), "nan": nan}
            log(f"[tensorcore] {instr} {dname} acc {acc}: {_model_name(ref, w, mode)} explains "
                f"{agree:.4f} of {len(c)} cases; the twin's exact-sum-rn {np.mean(twin == d):.4f}")

    cols = ["instruction", "inputs", "accum", "model that fits best", "cases it explains", "cases",
            "best model aligned to the largest product value instead", "twin's model (exact sum, rn)",
            "mma == wgmma bitwise", "NaN results"]
    tables = [Table("Accumulation of one k16 step: the best model per instruction", cols, rows)]
    fig, (ax,) = new_figure()
    steps = np.arange(1, ALIGN_STEPS + 1)
    for (instr, dname, acc), inc in series.items():
        ax.plot(steps, inc, marker="o", ms=3, label=f"{instr} {dname}/{acc}")
    ax.set_xlabel("s: each of the 16 products is -2^-s ulp of c")
    ax.set_ylabel("d - c, in ulps of c (exact: -16 2^-s)")
    ax.set_title("Alignment: where small negative terms stop counting")
    ax.legend(fontsize=7)
    if on_gpu:
        fp32 = [r for r in rows if r[2] == "fp32"]
        fp16 = [r for r in rows if r[2] == "fp16"]
        def say(rs):
            models = sorted({r[3] for r in rs})
            lo, hi = min(r[4] for r in rs), max(r[4] for r in rs)
            return f"{' / '.join(models)} explains {lo:.4f} to {hi:.4f} of the {rs[0][5]} cases of each"
        finding = (f"fp32 accumulators: {say(fp32)}; fp16 accumulators: {say(fp16)}. "
                   "mma.sync and wgmma give the same bits in every case: "
                   + ("yes" if all(r[8] for r in rows if r[0] == "mma") else "no")
                   + f". The twin's exact-sum-rn model explains {min(r[7] for r in rows):.2f} to "
                     f"{max(r[7] for r in rows):.2f}.")
    else:
        finding = ("No CUDA device: no measurement; the table shows the models measured on the H200 "
                   "(align to the largest exponent sum, 24+2 bits; rz into fp32, rn into fp16) as a "
                   "prediction only.")
    setup = {"instructions": "mma.sync.m16n8k16 (one warp per case), wgmma.mma_async m64n64k16 with A and B "
                             "from shared memory (one warpgroup per case; Hopper only): element (0, 0)",
             "cases": f"{len(names)} directed (alignment s = 1..{ALIGN_STEPS} of both signs with c = 2^12; "
                      f"1 +- 0.25 / 0.75 ulp with c = 0 or 1) + {n_random} random per configuration",
             "models": "every term truncated toward zero to W bits below the largest exponent (of the "
                       "exponent sums exp(a) + exp(b), or of the products' values), exact sum, result "
                       "rounded (rz or rn) to the accumulator, subnormals kept; W from p to 39, or "
                       "no alignment (exact sum)"}
    return Report(name="tensorcore", title="Tensor-core accumulation, measured (one k16 step)",
                  finding=finding, setup=setup, tables=tables, data=data, figure=fig,
                  figure_caption="d - c for c = 2^12 and 16 products of -2^-s ulp of c each, per "
                                 "instruction and configuration")

"""How the tensor cores accumulate, measured: one k step of mma.sync (the mma family) and of wgmma (the
wgmma family), fp16 and bf16 inputs (k = 16), e4m3 inputs on wgmma (k = 32; the fp8 kernels' instruction),
fp32 and fp16 accumulators.

Each case computes d = sum_{k<K} a_k b_k + c with one instruction (kernels_cu/tc_probe.cu). The products of
two 16-bit (or 8-bit) values are exact; what the hardware does with them is the question. The candidate
models are

    align(ref, W), round(R):  every term (the 16 products and c) is truncated toward zero to a multiple
                         of 2^(E - W + 1), E the largest exponent among the terms (ref "exponent sum":
                         a product's exponent taken as exp(a) + exp(b), before its significand product
                         in [1, 4) is normalized; ref "value": the exponent of the product itself), the
                         truncated terms are summed exactly, and the sum is rounded to the accumulator's
                         precision with R (toward zero "rz" or to nearest even "rn"),

with W = 24 + 2 meaning "fp32's significand and 2 guard bits". For e4m3 inputs two more knobs are fitted,
since published work reports a narrower accumulator there (SageAttention2: 13 mantissa bits, truncated;
DeepSeek-V3: about 14 bits): the precision P the sum is rounded to (P = 24 for a true fp32 accumulator,
down to 13) and the group g of products aligned together (all K at once, or g = 16 with the partial
rounded to P between groups). Two kinds of inputs decide W and R:
directed cases (c = 2^12 and 16 equal products 2^-s accumulator ulps of c, s = 1 ..; sums of 1 + a
fraction of an ulp, of both signs) and random cases (products between 2^-20 and 2^8, a quarter with
c cancelling the products). The report gives, per (instruction, dtype, accumulator), the model that
explains every case (or the best and how often it misses), the rounding the NumPy twin assumes (exact
sum, round to nearest) beside it, and whether mma.sync and wgmma give the same bits.

Measured on the H200 (reports/tensorcore.json, 2026-11-23; every case explained): 16-bit inputs align to
the largest exponent sum with W = 26 (2 guard bits), rz into fp32 and rn into fp16, mma.sync and wgmma
bit for bit alike; e4m3 on wgmma aligns with W = 14 (no guard bit) and, into fp32, truncates the sum to
P = 14 significant bits (the "FP22" of SageAttention2: 13 stored mantissa bits), into fp16 rounds to
nearest, all 32 products of the k step aligned together.
"""
from __future__ import annotations

import numpy as np

from flashcupy.inspect import numpy_dtype, tensorcore

from .common import Context, Report, Table, log, new_figure

K_STEP, MEASURED, PRECISION, accumulate = (  # the model, in one place
    tensorcore.K_STEP, tensorcore.MEASURED, tensorcore.PRECISION, tensorcore.accumulate)

CONFIGS = [("f16", "fp32"), ("bf16", "fp32"), ("f16", "fp16"),  # (inputs, accumulator)
           ("e4m3", "fp32"), ("e4m3", "fp16")]
C_BIG = 2.0 ** 12                      # the large term of the 16-bit inputs' directed alignment cases
ALIGN_STEPS = 20                       # s = 1 .. ALIGN_STEPS bits below c's ulp (fewer where the inputs
                                       # cannot make products that small)
ACC_DTYPE = {"fp32": np.float32, "fp16": np.float16}
MIN_NORMAL_EXP = {"f16": -14, "bf16": -14, "e4m3": -6}  # the directed cases' factors stay normal (bf16:
                                                         # fp16's range, so that both share the cases)


def input_dtype(dname: str):
    """NumPy dtype of the probe's inputs: fp16, bfloat16 or float8_e4m3fn (ml_dtypes)."""
    if dname == "e4m3":
        import ml_dtypes

        return np.dtype(ml_dtypes.float8_e4m3fn)
    return numpy_dtype(dname)


def align_setup(dname: str, acc: str) -> tuple[float, int]:
    """(c, steps) of the directed alignment cases: c = 2^12 for 16-bit inputs; for e4m3 the largest power
    of two whose ulp, 2^-steps of it, is still a product of two normal e4m3 values (ulp 2^8: c = 2^31 in
    fp32; 2^15 in fp16, ulp 2^5, 17 steps)."""
    if dname != "e4m3":
        return C_BIG, ALIGN_STEPS
    p, lo = PRECISION[acc], 2 * MIN_NORMAL_EXP[dname]
    e = min(lo + ALIGN_STEPS + p - 1, 31 if acc == "fp32" else 15)
    return 2.0 ** e, min(ALIGN_STEPS, e - (p - 1) - lo)


# ---------------------------------------------------------------------------------------------------
# the model

def fit(a, b, c, measured, acc, narrow: bool = False):
    """Agreement of every candidate (reference, W from p to 39 or exact, rz or rn) with the
    measured results: [(ref, W, mode, fraction equal)], best first (ties: rz, then the smaller W).
    ``narrow`` (e4m3): the result precision P from 13 bits (fp16 accumulators: 8) up to the
    accumulator's p and the groups (all at once, 16) are fitted too, and the tuples grow to
    (ref, W, mode, fraction, P, g); ties prefer P = p and no groups."""
    p = PRECISION[acc]
    out = []
    for ref in ("exponent sum", "value"):
        for mode in ("rz", "rn"):
            for bits in (range(13 if acc == "fp32" else 8, p + 1) if narrow else (p,)):
                for group in ((None, 16) if narrow else (None,)):
                    for w in [*range(bits, 40), None]:
                        pred = accumulate(a, b, c, w, acc, mode, ref, out_bits=bits, group=group)
                        agree = float(np.mean(pred == measured))
                        out.append((ref, w, mode, agree, bits, group) if narrow else (ref, w, mode, agree))
    return sorted(out, key=lambda r: (-r[3], r[0] != "exponent sum", r[2] != "rz",
                                      *((r[4] != p, r[5] is not None) if narrow else ()),
                                      r[1] if r[1] is not None else 99))


# ---------------------------------------------------------------------------------------------------
# the cases


def _pow2_pair(log2v: np.ndarray, lo: int) -> tuple[np.ndarray, np.ndarray]:
    """Factors a, b (powers of two, each >= 2^lo: normal in fp16 for lo = -14, in e4m3 for lo = -6) with
    a b = 2^log2v (a the larger, at most 2^8 for the exponents used here)."""
    a = np.maximum(np.ceil(log2v / 2), lo)
    return np.ldexp(1.0, a.astype(int)), np.ldexp(1.0, (log2v - a).astype(int))


def directed_cases(acc: str, dname: str = "f16"):
    """(names, a (n,K), b (n,K), c (n,)) exact float64 values, each exactly representable in the inputs
    (fp16 and bf16 share the 16-bit cases; e4m3 has its own, K = 32, scaled into its range) and in the
    accumulator."""
    p, kk, lo = PRECISION[acc], K_STEP[dname], MIN_NORMAL_EXP[dname]
    c_big, steps = align_setup(dname, acc)
    ulp_e = int(np.log2(c_big)) - (p - 1)
    # the "1 + a fraction of an ulp" cases, scaled by 2^base so that their small products stay normal
    base = max(0, (p - 1) + 2 + 2 * lo)
    scale = "" if base == 0 else f"2^{base}*"
    names, a, b, c = [], [], [], []
    for sign, tag in ((-1.0, "-"), (1.0, "+")):
        for s in range(1, steps + 1):
            # c and K products of sign 2^-s of c's ulp
            av, bv = _pow2_pair(np.full(kk, ulp_e - s, float), lo)
            names.append(f"align {tag}{s}")
            a.append(sign * av), b.append(bv), c.append(c_big)
    for tag, extra, sign in (("1+0.75ulp", (1, 2), 1.0), ("1+0.25ulp", (2,), 1.0),
                             ("-(1+0.75ulp)", (1, 2), -1.0), ("-(1+0.25ulp)", (2,), -1.0)):
        # products 2^base and 2^base 2^-(p-1) 2^-e for each e in extra; c = 0, then the same with c = 2^base
        for c_is_one in (False, True):
            av, bv = np.zeros(kk), np.zeros(kk)
            if not c_is_one:
                x, y = _pow2_pair(np.array([base], float), lo)
                av[0], bv[0] = sign * x[0], y[0]
            for i, e in enumerate(extra, start=1):
                x, y = _pow2_pair(np.array([base - (p - 1) - e], float), lo)
                av[i], bv[i] = sign * x[0], y[0]
            names.append(f"{scale}{tag}, c={scale + '1' if c_is_one else '0'}" if base else
                         f"{tag}, c={'1' if c_is_one else '0'}")
            a.append(av), b.append(bv), c.append(sign * 2.0 ** base if c_is_one else 0.0)
    return names, np.array(a), np.array(b), np.array(c)


def random_cases(rng, n: int, dname: str, acc: str):
    """n cases: a and b of random sign with magnitudes in [2^-2, 2^4) (for a quarter of the cases
    [2^-10, 2^4), e4m3: [2^-6, 2^4)), rounded to the inputs' type, so products in [2^-4, 2^8) (down to
    2^-20, e4m3 2^-12); c of random sign in [2^-4, 2^8), or (a quarter) minus the products' sum rounded
    to the accumulator, times 1 + U(-2^-8, 2^-8) and rounded again: cancellation, where the alignment
    shows."""
    dt, acc_dt, kk = input_dtype(dname), ACC_DTYPE[acc], K_STEP[dname]

    def draw(lo):
        mag = np.ldexp(1.0 + rng.random((n, kk)), rng.integers(lo, 4, (n, kk)))
        return (rng.choice([-1.0, 1.0], (n, kk)) * mag).astype(dt).astype(np.float64)

    wide_lo = max(-10, MIN_NORMAL_EXP[dname])
    wide = rng.random(n) < 0.25
    a = np.where(wide[:, None], draw(wide_lo), draw(-2))
    b = np.where(wide[:, None], draw(wide_lo), draw(-2))
    c = (rng.choice([-1.0, 1.0], n) * np.ldexp(1.0 + rng.random(n), rng.integers(-4, 8, n)))
    cancel = rng.random(n) < 0.25
    s = (a * b).sum(axis=1).astype(acc_dt).astype(np.float64)
    c = np.where(cancel, -s * (1.0 + rng.uniform(-2.0 ** -8, 2.0 ** -8, n)), c)
    return a, b, c.astype(acc_dt).astype(np.float64)


# ---------------------------------------------------------------------------------------------------
# the GPU side


def probe_defines(dname: str, acc: str, hopper: bool = True) -> dict[str, int]:
    """The -D knobs of kernels_cu/tc_probe.cu for one configuration: a kernel variant's (so the shared
    headers apply), FC_FP8 for e4m3 inputs (the wgmma probe alone), FC_TC_PROBE_NO_WGMMA off Hopper."""
    from flashcupy.inspect import DTYPES

    defines = {"FC_DTYPE": DTYPES["f16" if dname == "e4m3" else dname][0], "FC_ACCUM_F16": int(acc == "fp16"),
               "FC_HEAD_DIM": 64, "FC_HEAD_DIM_PAD": 64, "FC_NUM_THREADS": 128,
               "FC_ABLATE_MAX_SUBTRACTION": 0, "FC_ABLATE_RESCALING": 0, "FC_FP8": int(dname == "e4m3")}
    if not hopper:  # wgmma needs sm_90a: compile the mma probe alone
        defines["FC_TC_PROBE_NO_WGMMA"] = 1
    return defines


def instructions(dname: str, hopper: bool) -> tuple[str, ...]:
    """The instructions probed for these inputs: wgmma only for e4m3 (what the fp8 kernels use) and
    only on Hopper."""
    if dname == "e4m3":
        return ("wgmma",) if hopper else ()
    return ("mma", "wgmma") if hopper else ("mma",)


def _modules(dname: str, acc: str):
    import cupy

    from flashcupy.inspect import nvrtc_options, source_text

    hopper = int(cupy.cuda.Device().compute_capability) == 90
    arch = ("-arch=sm_90a",) if hopper else ()
    defines = probe_defines(dname, acc, hopper)
    mod = cupy.RawModule(code=source_text("tc_probe.cu"), options=nvrtc_options(defines) + arch)
    return mod, hopper


def measure(dname: str, acc: str, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> dict:
    """{"mma": d, "wgmma": d} for the cases (a, b, c), float64, for the instructions this GPU has
    (``instructions``)."""
    import cupy

    dt = input_dtype(dname)
    bits = np.uint8 if dt.itemsize == 1 else np.uint16
    ad = cupy.asarray(np.ascontiguousarray(a.astype(dt).view(bits)))
    bd = cupy.asarray(np.ascontiguousarray(b.astype(dt).view(bits)))
    cd = cupy.asarray(c.astype(np.float32))
    n = len(c)
    mod, hopper = _modules(dname, acc)
    out = {}
    for name in instructions(dname, hopper):
        d = cupy.full(n, np.nan, dtype=np.float32)
        if name == "mma":
            mod.get_function("tc_probe_mma")(((n + 3) // 4,), (128,), (ad, bd, cd, d, np.int32(n)))
        else:
            mod.get_function("tc_probe_wgmma")((n,), (128,), (ad, bd, cd, d, np.int32(n)))
        out[name] = cupy.asnumpy(d).astype(np.float64)
    return out


# ---------------------------------------------------------------------------------------------------
# the experiment


def _model_name(ref, w, mode, bits=None, p=None, group=None):
    tail = ""
    if bits is not None and bits != p:
        tail += f", result {bits} bits"
    if group is not None:
        tail += f", groups of {group}"
    if w is None:
        return f"exact sum, {mode}{tail}"
    base = 24 if bits is None or bits == p else bits  # fp32's significand, or the narrower result's
    sign = "+" if w >= base else "-"
    return f"align to the largest {ref}, {w} bits ({base} {sign} {abs(w - base)}), {mode}{tail}"


def _prediction(dname, acc, a, b, c):
    """What stands in for a measurement without a GPU (labelled a prediction): the models measured on
    the H200 (reports/tensorcore.json, 2026-11-23). 16-bit inputs: align to the largest exponent sum
    with 24 + 2 bits, for both accumulators; rz into fp32, rn into fp16. e4m3 (wgmma k32): align to the
    largest exponent sum with 14 bits and no guard bit; into fp32 the sum is truncated to 14 significant
    bits (SageAttention2's "FP22", DeepSeek-V3's "about 14 bits"), into fp16 rounded to nearest."""
    w, mode, bits = MEASURED[(dname, acc)]
    return accumulate(a, b, c, w, acc, mode, out_bits=bits)


def run_tensorcore(ctx: Context) -> Report:
    rng = np.random.default_rng(ctx.seed)
    n_random = 512 if ctx.quick else 8192
    on_gpu = ctx.backend == "cuda"
    rows, series, data = [], {}, {}
    for dname, acc in CONFIGS:
        p, narrow = PRECISION[acc], dname == "e4m3"
        names, da, db, dc = directed_cases(acc, dname)
        c_big, steps = align_setup(dname, acc)
        ra, rb, rc = random_cases(rng, n_random, dname, acc)
        a, b, c = np.concatenate([da, ra]), np.concatenate([db, rb]), np.concatenate([dc, rc])
        twin = accumulate(a, b, c, None, acc, "rn")          # what the NumPy twin assumes
        if on_gpu:
            got = measure(dname, acc, a, b, c)
            if not got:
                log(f"[tensorcore] {dname} acc {acc}: nothing to probe on this GPU (wgmma needs sm_90a)")
        else:  # no device: a model stands in (a prediction, not a measurement)
            got = {"model (no GPU)": _prediction(dname, acc, a, b, c)}
        same = (bool(np.array_equal(got["mma"], got["wgmma"], equal_nan=True))
                if "wgmma" in got and "mma" in got else None)
        for instr, d in got.items():
            ranking = fit(a, b, c, d, acc, narrow=narrow)
            ref, w, mode, agree = ranking[0][:4]
            bits, group = ranking[0][4:6] if narrow else (p, None)
            by_value = max(r[3] for r in ranking if r[0] == "value")
            nan = int(np.isnan(d).sum())
            name = _model_name(ref, w, mode, bits, p, group)
            rows.append([instr, dname, acc, name, agree, len(c), by_value, float(np.mean(twin == d)), same,
                         nan])
            series[(instr, dname, acc)] = (d[:steps] - c_big) / (c_big * 2.0 ** (1 - p))  # ulps of c
            data[f"{instr} {dname} acc {acc}"] = {
                "best": {"reference": ref, "align_bits": w, "mode": mode, "agreement": agree,
                         **({"result_bits": bits, "group": group} if narrow else {})},
                "ranking": [{"reference": r[0], "align_bits": r[1], "mode": r[2], "agreement": r[3],
                             **({"result_bits": r[4], "group": r[5]} if narrow else {})}
                            for r in ranking[:8]],
                "directed": {nm: float(x) for nm, x in zip(names, d[:len(names)])},
                "twin_agreement": float(np.mean(twin == d)), "nan": nan}
            log(f"[tensorcore] {instr} {dname} acc {acc}: {name} explains "
                f"{agree:.4f} of {len(c)} cases; the twin's exact-sum-rn {np.mean(twin == d):.4f}")

    cols = ["instruction", "inputs", "accum", "model that fits best", "cases it explains", "cases",
            "best model aligned to the largest product value instead", "twin's model (exact sum, rn)",
            "mma == wgmma bitwise", "NaN results"]
    tables = [Table("Accumulation of one k step (16 products; 32 for e4m3): the best model per instruction",
                    cols, rows)]
    fig, (ax,) = new_figure()
    # one line per distinct curve: the configurations (and instructions) that give the same bits share it
    curves: dict = {}
    for (instr, dname, acc), inc in series.items():
        curves.setdefault(tuple(np.asarray(inc, dtype=np.float64).tolist()), []).append((instr, dname, acc))
    for inc, members in curves.items():
        configs = ", ".join(dict.fromkeys(f"{d} into {a}" for _, d, a in members))
        instrs = " = ".join(dict.fromkeys(i for i, _, _ in members))
        ax.plot(np.arange(1, len(inc) + 1), inc, marker="o", ms=3, label=f"{configs} ({instrs})")
    s_max = max(len(inc) for inc in curves)
    s_grid = np.arange(1, s_max + 1)
    for k_products, style in zip(sorted({K_STEP[d] for _, d, _ in series}), (":", "--")):
        ax.plot(s_grid, -k_products * 2.0 ** -s_grid, style, color="black", lw=0.9,
                label=f"exact sum of {k_products} products")
    ax.set_xticks(s_grid[::2] if s_max > 12 else s_grid)
    ax.set_xlabel("s (each of the K products of one instruction is -2^-s ulps of c)")
    ax.set_ylabel("d - c, ulps of c")
    ax.set_title("Tensor-core sums drop products below their alignment window\n"
                 "(the curve leaves the exact sum where a product stops counting)", fontsize=10)
    ax.legend(fontsize=7)
    wide = [r for r in rows if r[1] != "e4m3"]
    fp8 = [r for r in rows if r[1] == "e4m3"]
    if on_gpu:
        def say(rs):
            models = sorted({r[3] for r in rs})
            lo, hi = min(r[4] for r in rs), max(r[4] for r in rs)
            return f"{' / '.join(models)} explains {lo:.4f} to {hi:.4f} of the {rs[0][5]} cases of each"
        fp32 = [r for r in wide if r[2] == "fp32"]
        fp16 = [r for r in wide if r[2] == "fp16"]
        finding = (f"16-bit inputs, fp32 accumulators: {say(fp32)}; fp16 accumulators: {say(fp16)}. "
                   "mma.sync and wgmma give the same bits in every case: "
                   + ("yes" if all(r[8] for r in wide if r[0] == "mma") else "no")
                   + f". The twin's exact-sum-rn model explains {min(r[7] for r in wide):.2f} to "
                     f"{max(r[7] for r in wide):.2f}.")
        for acc in ("fp32", "fp16"):
            rs = [r for r in fp8 if r[2] == acc]
            finding += (f" e4m3 (wgmma k32), {acc} accumulators: {say(rs)}." if rs else
                        f" e4m3, {acc} accumulators: not measured (no sm_90a GPU).")
    else:
        finding = ("No CUDA device: no measurement; the table shows predictions only: for 16-bit inputs "
                   "the models measured on the H200 (align to the largest exponent sum, 24 + 2 bits; rz into "
                   "fp32, rn into fp16), for e4m3 with fp32 accumulators the published hypothesis (a 14-bit "
                   "sum, truncated; SageAttention2, DeepSeek-V3).")
    n16 = len(directed_cases("fp32")[0])
    setup = {"instructions": "mma.sync.m16n8k16 (one warp per case; 16-bit inputs), wgmma.mma_async "
                             "m64n64k16 (16-bit inputs) and m64n64k32 (e4m3) with A and B from shared memory "
                             "(one warpgroup per case; Hopper only): element (0, 0)",
             "cases": f"{n16} directed for 16-bit inputs (alignment s = 1..{ALIGN_STEPS} of both signs with "
                      f"c = 2^12; 1 +- 0.25 / 0.75 ulp with c = 0 or 1), the same scaled into e4m3's range "
                      f"for e4m3 (c = 2^31 in fp32, 2^15 in fp16; 32 products) + {n_random} random per "
                      "configuration",
             "models": "every term truncated toward zero to W bits below the largest exponent (of the "
                       "exponent sums exp(a) + exp(b), or of the products' values), exact sum, result "
                       "rounded (rz or rn) to the accumulator, subnormals kept; W from p to 39, or "
                       "no alignment (exact sum); for e4m3 also the result precision P (13 bits to p) and "
                       "groups of 16 products rounded between"}
    return Report(name="tensorcore", title="Tensor-core accumulation, measured (one k step)",
                  finding=finding, setup=setup, tables=tables, data=data, figure=fig,
                  figure_caption="d - c for a large c and K products of -2^-s ulp of c each, per "
                                 "instruction and configuration")

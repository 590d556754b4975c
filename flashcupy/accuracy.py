"""The accuracy rules flashcupy's kernels are held to, in one place: every test states what it compares
and takes the bound it compares against from here, the analysis draws the same bounds, and a kernel
writer can hold their own kernel to them (``tolerance``, ``assert_accurate``).

1. The accuracy rule (flash-attention's own): the error of flashcupy against the float64 reference may
   be at most FACTOR times the error of a naive attention computed in the same input precision
   (``flashcupy.naive``), plus a noise floor:

       max|out - ref| <= factor * max|naive - ref| + floor,     factor = 2 (forward), 3 (backward).

   The floor is 1e-6 for float32 (an fp32 kernel must land near 1e-6 on O(1) outputs) and 1e-5 for
   16-bit inputs with fp32 accumulators. With fp16 accumulators (``accum="fp16"``) the kernels round the
   score and output accumulators to fp16 after every 16 products and hold the running sum in fp16 too,
   while the naive baseline accumulates in fp32; the documented bound adds eight fp16 unit roundoffs,
   8 * 2^-11 ~ 3.9e-3, for those extra roundings (measured: ~1e-3 at N = 203, ~1.5e-3 at N = 2048).

   Gradients are not O(1): dK and dV sum over every query row that sees a key, so for the backward the
   floor is taken relative to the largest reference gradient, floor * max(1, max|ref|). With fp16
   accumulators the backward's reductions are long (dK, dV over all Nq * group query rows, dQ over all
   Nk keys): an fp16 accumulator that takes n/16 partial sums picks up one rounding per sum, a random
   walk of about sqrt(n/16) unit roundoffs of the running value. The backward fp16 floor is therefore
   2 * sqrt(n/16) * 2^-11 * max(1, max|ref|), n the longest reduction (at least the forward's 8 u).

2. The LSE (natural log, float32) against the float64 reference's, on the rows that see a key:

       max|lse - lse_ref| <= LSE_ROUNDOFFS[accum] * (1 + max|lse_ref|).

   The LSE is m * scale + ln(l), stored in float32: its rounding, that of m * scale and of ln(l) grow
   with |LSE| (about 8 on N(0, 1) inputs at N = 2048), hence the relative form. fp32 accumulators: 32
   float32 unit roundoffs, 32 * 2^-24 ~ 1.9e-6 (measured on the H200, every family, the GPU tests'
   shapes, head dims and tiles: at most 5.0e-6 at |LSE| = 8.5, i.e. 9 roundoffs; the twin: 2).
   fp16 accumulators: the running sum l is held in fp16, so ln(l) is off by up to the forward's eight
   fp16 unit roundoffs: 8 * 2^-11.

3. GPU kernel against the NumPy twin (same tiles, same breaks): the two compute the same function in
   different rounding orders (and the twin models, not reproduces, the tensor cores' accumulation), so
   they agree to a per-dtype relative tolerance (``TWIN_GPU``), at least ``TWIN_GPU_FP16_ACCUM`` with
   fp16 accumulators, times max(1, max|twin|).

4. Smaller rules: fp32 kernels against float64 (``F32_NEAR_FLOAT64``), fp32 results that must not depend
   on the tile sizes (``F32_BLOCK_INVARIANCE``), and the atomic-dQ path against the deterministic one
   (``dq_order_tolerance``).
"""
from __future__ import annotations

import math

import numpy as np

U16 = 2.0 ** -11                      # fp16 unit roundoff
U32 = 2.0 ** -24                      # float32 unit roundoff
EPS = {"f16": 2.0 ** -10, "bf16": 2.0 ** -7}   # machine epsilon (ulp of 1) of the 16-bit types
OUTPUT_ROUNDING = {"f16": U16, "bf16": 2.0 ** -8}   # unit roundoff of the 16-bit output types
FACTOR = {"fwd": 2.0, "bwd": 3.0}
FLOORS = {("f32", "fp32"): 1e-6, ("f16", "fp32"): 1e-5, ("bf16", "fp32"): 1e-5}
FP16_ACCUM_FLOOR = 8 * U16

LSE_ROUNDOFFS = {"fp32": 32 * U32, "fp16": 8 * U16}

# The absolute error of the kernels' tanh on float32 arguments (|tanh| <= 1), bounds over the largest error
# measured on an H100 (tests/kernels/test_score_hook_gpu.py measures it again on 4.5 million arguments):
# "approx", the MUFU's tanh.approx.f32, measured 7.8e-6 = 2^-16.97 (at x = -1.2185); "accurate",
# libdevice's tanhf, measured 1.04e-7 = 2^-23.19, bounded by its documented 2 ulp of 1
TANH_ABS = {"approx": 2.0 ** -16.5, "accurate": 2.0 ** -22}

TWIN_GPU = {"fwd": {"f32": 2e-6, "f16": 2e-3, "bf16": 1.6e-2},
            "bwd": {"f32": 1e-5, "f16": 4e-3, "bf16": 3e-2}}
TWIN_GPU_FP16_ACCUM = {"fwd": 4e-3, "bwd": 1e-2}

# fp32 kernels against float64 on O(1) inputs: the output (absolute) and the gradients (relative to
# max(1, max|ref|)): "near 1e-6" (GUIDE.md).
F32_NEAR_FLOAT64 = {"fwd": 2e-6, "bwd": 2e-5}
# fp32 results at two tile sizes: the same function, only the rounding order differs.
F32_BLOCK_INVARIANCE = {"fwd": 1e-6, "bwd": 1e-5}


def to_f64(x) -> np.ndarray:
    from flashcupy.reference import to_float64

    return to_float64(x)


def max_abs_err(x, ref) -> float:
    x = to_f64(x)
    ref = to_f64(ref)
    finite = np.isfinite(ref)
    if not np.array_equal(np.isfinite(x), finite):
        return float("inf")
    return float(np.max(np.abs(x[finite] - ref[finite]), initial=0.0))


def tolerance(dname: str, accum: str, naive_err: float, kind: str = "fwd", magnitude: float = 1.0,
              reduction: int = 0) -> float:
    """Rule 1: the bound on max|out - ref| given the naive same-precision error ``naive_err``;
    ``magnitude`` is max|ref|."""
    floor = FP16_ACCUM_FLOOR if accum == "fp16" else FLOORS[(dname, "fp32")]
    if kind == "bwd":
        if accum == "fp16":
            floor = max(floor, 2.0 * math.sqrt(reduction / 16) * U16)
        floor *= max(1.0, magnitude)
    if accum == "fp32":  # one rounding of the largest output (see rule 1)
        floor = max(floor, OUTPUT_ROUNDING.get(dname, 0.0) * magnitude)
    return FACTOR[kind] * naive_err + floor


def assert_accurate(out, ref, naive, dname: str, accum: str, kind: str = "fwd", what: str = "",
                    reduction: int = 0, naive_ref=None):
    """Assert rule 1; the message carries both errors and the bound. ``reduction``: the longest
    accumulation of the backward (``backward_reduction``), used by its fp16-accumulator floor.
    ``naive_ref``: the float64 result the naive baseline computes, when it computes another quantity
    than ``ref`` (the naive backward has no LSE gradient: its error is measured against the plain
    gradients, and flashcupy's with dlse against the gradients with the LSE term)."""
    err = max_abs_err(out, ref)
    nerr = max_abs_err(naive, ref if naive_ref is None else naive_ref)
    tol = tolerance(dname, accum, nerr, kind, float(np.max(np.abs(to_f64(ref)), initial=0.0)), reduction)
    assert err <= tol, (f"{what}: max abs error {err:.3e} > bound {tol:.3e} "
                        f"(naive same-precision error {nerr:.3e}, {dname}, accum={accum})")
    return err, nerr


def backward_reduction(q, k) -> int:
    """The longest accumulation of the backward: dK, dV over Nq * group query rows, dQ over Nk keys."""
    return max(q.shape[2] * (q.shape[1] // k.shape[1]), k.shape[2])


def lse_tolerance(accum: str, lse_ref) -> float:
    """Rule 2, for the finite entries ``lse_ref`` of the reference LSE."""
    return LSE_ROUNDOFFS[accum] * (1.0 + float(np.max(np.abs(lse_ref), initial=0.0)))


def softcap_score_error(dname: str, softcap: float) -> float:
    """A bound on the absolute error the kernels' tanh puts into each capped score c tanh(S / c): c times
    the tanh's (``TANH_ABS``: tanh.approx for 16-bit inputs, tanhf for float32 ones, as
    kernels_cu/flash_common.cuh picks them). 0 without a softcap."""
    return softcap * TANH_ABS["accurate" if dname == "f32" else "approx"]


def assert_lse_accurate(lse, lse_ref, accum: str, what: str = "", score_error: float = 0.0) -> float:
    """Rule 2: the same rows are empty (-inf), the others within ``lse_tolerance``, plus ``score_error``:
    a bound on what a score variant adds to every score the kernel exponentiates (``softcap_score_error``);
    the LSE, a smooth maximum of the scores, moves by at most that much."""
    lse, lse_ref = to_f64(lse), to_f64(lse_ref)
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref)), f"{what}: empty (-inf) LSE rows differ"
    fin = np.isfinite(lse_ref)
    err = max_abs_err(lse[fin], lse_ref[fin])
    tol = lse_tolerance(accum, lse_ref[fin]) + score_error
    assert err <= tol, f"{what}: lse error {err:.3e} > {tol:.3e} (accum={accum})"
    return err


def twin_gpu_tolerance(dname: str, accum: str, magnitude: float, kind: str = "fwd") -> float:
    """Rule 3: the bound on max|gpu - twin| given ``magnitude`` = max|twin|."""
    rel = TWIN_GPU[kind][dname]
    if accum == "fp16":
        rel = max(rel, TWIN_GPU_FP16_ACCUM[kind])
    return rel * max(1.0, magnitude)


def assert_matches_twin(gpu, twin, dname: str, accum: str, kind: str = "fwd", what: str = "") -> float:
    """Rule 3. The GPU result and the twin's are non-finite at the same elements (an ablation breaks
    the same ones; a gradient has none) and within ``twin_gpu_tolerance`` elsewhere. Returns the bound."""
    g, t = to_f64(gpu), to_f64(twin)
    fin = np.isfinite(t)
    assert np.array_equal(np.isfinite(g), fin), f"{what}: the breaks break different elements"
    if kind == "bwd":
        assert fin.all(), f"{what}: non-finite gradients"
    diff = float(np.max(np.abs(g[fin] - t[fin]), initial=0.0))
    tol = twin_gpu_tolerance(dname, accum, float(np.max(np.abs(t[fin]), initial=0.0)), kind)
    assert diff <= tol, f"{what}: gpu vs twin {diff:.3e} > {tol:.3e}"
    return tol


def dq_order_tolerance(dname: str, magnitude: float) -> float:
    """dQ of the atomic path against the deterministic path: each element sums the same fp32 terms in
    another order, then rounds once to the element type: two ulps of the largest value."""
    return 2 * EPS[dname] * magnitude

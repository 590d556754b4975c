"""The accuracy rule, in one place (GUIDE.md, after flash-attention's own tests).

The error of flashcupy against the float64 reference may be at most FACTOR times the error of a naive
attention computed in the same input precision (``flashcupy.naive``), plus a noise floor:

    max|out - ref| <= factor * max|naive - ref| + floor,     factor = 2 (forward), 3 (backward).

The floor is 1e-6 for float32 (an fp32 kernel must land near 1e-6 on O(1) outputs) and 1e-5 for
16-bit inputs with fp32 accumulators. With fp16 accumulators (``accum="fp16"``) the kernels round the
score and output accumulators to fp16 after every 16 products and hold the running sum in fp16 too,
while the naive baseline accumulates in fp32; the documented bound adds eight fp16 unit roundoffs,
8 * 2^-11 ~ 3.9e-3, for those extra roundings (measured: ~1e-3 at N = 203, ~1.5e-3 at N = 2048).

Gradients are not O(1): dK and dV sum over every query row that sees a key, so for the backward the
floor is taken relative to the largest reference gradient, floor * max(1, max|ref|). With fp16
accumulators the backward's reductions are long (dK, dV over all Nq * group query rows, dQ over all Nk
keys): an fp16 accumulator that takes n/16 partial sums picks up one rounding per sum, a random walk of
about sqrt(n/16) unit roundoffs of the running value. The backward fp16 floor is therefore
2 * sqrt(n/16) * 2^-11 * max(1, max|ref|), n the longest reduction (at least the forward's 8 u).
"""
from __future__ import annotations

import math

import numpy as np

U16 = 2.0 ** -11
FLOORS = {("f32", "fp32"): 1e-6, ("f16", "fp32"): 1e-5, ("bf16", "fp32"): 1e-5}
FP16_ACCUM_FLOOR = 8 * U16


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
    factor = {"fwd": 2.0, "bwd": 3.0}[kind]
    floor = FP16_ACCUM_FLOOR if accum == "fp16" else FLOORS[(dname, "fp32")]
    if kind == "bwd":
        if accum == "fp16":
            floor = max(floor, 2.0 * math.sqrt(reduction / 16) * U16)
        floor *= max(1.0, magnitude)
    return factor * naive_err + floor


def assert_accurate(out, ref, naive, dname: str, accum: str, kind: str = "fwd", what: str = "",
                    reduction: int = 0):
    """Assert the GUIDE.md rule; the message carries both errors and the bound. ``reduction``: the
    longest accumulation of the backward (max(Nq * group, Nk)), used by its fp16-accumulator floor."""
    err = max_abs_err(out, ref)
    nerr = max_abs_err(naive, ref)
    tol = tolerance(dname, accum, nerr, kind, float(np.max(np.abs(to_f64(ref)), initial=0.0)), reduction)
    assert err <= tol, (f"{what}: max abs error {err:.3e} > bound {tol:.3e} "
                        f"(naive same-precision error {nerr:.3e}, {dname}, accum={accum})")
    return err, nerr

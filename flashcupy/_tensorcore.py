"""The tensor cores' accumulation, as measured on the H200 (``python -m analysis tensorcore``, which fits
these models to the hardware's bits; reports/tensorcore.md), and matrix products that follow it.

One k step of an instruction computes d = sum_k a_k b_k + c as follows (``accumulate``): every term (the
K products and c) is truncated toward zero to a multiple of 2^(E - W + 1), E the largest exponent among
them (a product's exponent taken as exp(a) + exp(b)), the truncated terms are summed exactly and the sum
is rounded (toward zero or to nearest even) to P significant bits on the accumulator's grid. Measured:

    fp16 / bf16 inputs (mma.sync k16 and wgmma k16)  W = 26, fp32 accumulator: rz to 24 bits;
                                                      fp16 accumulator: rn to 11 bits
    e4m3 inputs (wgmma k32)                          W = 14, fp32 accumulator: rz to 14 bits (an fp32
                                                      register holding a 14-bit value: "FP22");
                                                      fp16 accumulator: rn to 11 bits

``matmul`` applies one such step per K_STEP slice of the reduction axis, carrying the partial as c, which
is what a chain of instructions accumulating into the same registers computes.
"""
from __future__ import annotations

import numpy as np

PRECISION = {"fp32": 24, "fp16": 11}  # significant bits of the accumulator
# (W, rounding, P) measured per (inputs, accumulator); P None: the accumulator's precision
MEASURED = {("f16", "fp32"): (26, "rz", None), ("bf16", "fp32"): (26, "rz", None),
            ("f16", "fp16"): (26, "rn", None),
            ("e4m3", "fp32"): (14, "rz", 14), ("e4m3", "fp16"): (14, "rn", None)}
K_STEP = {"f16": 16, "bf16": 16, "e4m3": 32}  # products per instruction (k of the wgmma shape)

MIN_ULP = {"fp32": 2.0 ** -149, "fp16": 2.0 ** -24}  # the subnormal spacing of the accumulator


def round_to_bits(x: np.ndarray, bits: int, mode: str, min_ulp: float = 0.0) -> np.ndarray:
    """x rounded to ``bits`` significant bits (and to a multiple of ``min_ulp``: subnormal results),
    toward zero ("rz") or to nearest even ("rn"); no overflow (the cases stay in range)."""
    _, e = np.frexp(x)                       # x = m 2^e, 0.5 <= |m| < 1
    ulp = np.maximum(np.ldexp(1.0, e - bits), min_ulp)
    q = x / ulp
    return np.where(x == 0, 0.0, (np.trunc(q) if mode == "rz" else np.rint(q)) * ulp)


def exponent(x: np.ndarray) -> np.ndarray:
    """floor(log2 |x|) for x != 0 (a very small number for 0, which never leads)."""
    return np.where(x != 0, np.frexp(x)[1] - 1, -(10 ** 6))


def accumulate(a: np.ndarray, b: np.ndarray, c: np.ndarray, align_bits: int | None, acc: str, mode: str,
               ref: str = "exponent sum", out_bits: int | None = None,
               group: int | None = None) -> np.ndarray:
    """The candidate model for d = sum_k a_k b_k + c, ``a``, ``b`` (n, K), ``c`` (n,), all float64.

    Every term is truncated toward zero to a multiple of 2^(E - align_bits + 1), where E is the largest
    exponent among the terms: with ref="exponent sum" a product's exponent is exp(a) + exp(b) (its
    significand product is not normalized first), with ref="value" it is the exponent of the product's
    value; c's is its own. align_bits=None keeps every term exactly. The truncated terms are summed
    exactly and the sum is rounded with ``mode`` to ``out_bits`` significant bits (default: the
    accumulator ``acc``'s precision) on ``acc``'s subnormal grid. ``group`` g: the products are taken g
    at a time, each group aligned and summed with the running partial (c first) and rounded as above
    before the next. Exact in float64 for the ranges used here."""
    bits = PRECISION[acc] if out_bits is None else out_bits
    g = a.shape[1] if group is None else group
    part = c
    for k0 in range(0, a.shape[1], g):
        aa, bb = a[:, k0:k0 + g], b[:, k0:k0 + g]
        prod = aa * bb
        terms = np.concatenate([prod, part[:, None]], axis=1)
        if align_bits is not None:
            ep = exponent(aa) + exponent(bb) if ref == "exponent sum" else exponent(prod)
            ep = np.where(prod != 0, ep, -(10 ** 6))
            e = np.maximum(ep.max(axis=1), exponent(part))[:, None]
            grid = np.ldexp(1.0, np.maximum(e - (align_bits - 1), -1074))  # all-zero terms: any grid
            terms = np.trunc(terms / grid) * grid
        part = round_to_bits(terms.sum(axis=1), bits, mode, MIN_ULP[acc])
    return part


def matmul(a: np.ndarray, b: np.ndarray, c: np.ndarray | None, inputs: str, acc: str = "fp32",
           model: tuple | None = None) -> np.ndarray:
    """c + a @ b (a (..., M, K), b (..., K, N), c (..., M, N) or None for zeros; float64 arrays holding
    the inputs' values) as the tensor cores compute it: one ``accumulate`` step per K_STEP[inputs]
    products of the reduction axis (K is padded with zeros, which change nothing), the partial carried
    as c. ``model`` (W, rounding, P) overrides MEASURED[(inputs, acc)]; (None, "rn", None) is an exact
    sum rounded to the accumulator each step. Returns float64 values on the accumulator's grid."""
    w, mode, bits = MEASURED[(inputs, acc)] if model is None else model
    ks = K_STEP[inputs]
    lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    part = np.zeros((*lead, m, n)) if c is None else np.broadcast_to(c, (*lead, m, n)).astype(np.float64)
    bt = np.swapaxes(b, -1, -2)
    for k0 in range(0, k, ks):
        step = (*lead, m, n, min(ks, k - k0))
        aa = np.broadcast_to(a[..., :, None, k0:k0 + ks], step).reshape(-1, step[-1])
        bb = np.broadcast_to(bt[..., None, :, k0:k0 + ks], step).reshape(-1, step[-1])
        part = accumulate(aa, bb, part.reshape(-1), w, acc, mode, out_bits=bits).reshape(*lead, m, n)
    return part

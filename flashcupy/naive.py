"""Naive attention in the inputs' own precision: the baseline every accuracy claim is put next to.

    S = round(q k^T),  P = round(softmax(scale * S)),  o = round(P v)

Each product is accumulated in float32 (as cuBLAS and NumPy do for 16-bit inputs) and rounded to the
input dtype once, where a framework's attention would store it. The full (Nq x Nk) score matrix is
materialised: this is the memory behaviour flashcupy avoids. Works on NumPy and CuPy arrays alike;
causal masking as in ``flashcupy.reference``.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["attention", "attention_backward"]


def _xp(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy


def _probabilities(q, k, causal, scale, rnd):
    """Same-precision P (rounded) for grouped q (B, Hkv, G, Nq, D) and k (B, Hkv, 1, Nk, D)."""
    xp = _xp(q)
    nq, nk = q.shape[-2], k.shape[-2]
    s = rnd(xp.matmul(q, xp.swapaxes(k, -1, -2))) * xp.float32(scale)
    if causal:
        visible = xp.arange(nk)[None, :] <= (xp.arange(nq)[:, None] + (nk - nq))
        s = xp.where(visible, s, xp.float32(-xp.inf))
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, xp.float32(0))
    e = xp.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    return rnd(e / xp.where(l > 0, l, xp.float32(1)))


def _setup(q, k, v, scale):
    """Array module, the rounding to q's dtype, the scale, and float32 views grouped for GQA:
    q (B, Hkv, G, Nq, D), k and v (B, Hkv, 1, Nk, D)."""
    xp = _xp(q)
    dtype = q.dtype
    b, hq, nq, d = q.shape
    hkv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)

    def rnd(x):
        return x.astype(dtype).astype(xp.float32)

    qf = q.astype(xp.float32).reshape(b, hkv, hq // hkv, nq, d)
    return xp, rnd, scale, qf, k.astype(xp.float32)[:, :, None], v.astype(xp.float32)[:, :, None]


def attention(q, k, v, causal: bool = False, scale: float | None = None):
    """Naive attention; returns o in q's dtype (float16, bfloat16 or float32)."""
    xp, rnd, scale, qf, kf, vf = _setup(q, k, v, scale)
    p = _probabilities(qf, kf, causal, scale, rnd)
    o = rnd(xp.matmul(p, vf))
    return o.reshape(q.shape).astype(q.dtype)


def attention_backward(do, q, k, v, causal: bool = False, scale: float | None = None):
    """Naive same-precision gradients (dq, dk, dv) of sum(do * attention(q, k, v)).

    P, O, dV, dP, dS, dQ, dK are each rounded to the input dtype once, as a framework's autograd of
    naive attention stores them; delta = rowsum(dO * O) in float32. dk, dv are summed over the query
    heads that share a kv head.
    """
    xp, rnd, scale, qf, kf, vf = _setup(q, k, v, scale)
    dtype = q.dtype
    dof = do.astype(xp.float32).reshape(qf.shape)
    p = _probabilities(qf, kf, causal, scale, rnd)
    o = rnd(xp.matmul(p, vf))
    dv = rnd(xp.matmul(xp.swapaxes(p, -1, -2), dof).sum(axis=2))
    dp = rnd(xp.matmul(dof, xp.swapaxes(vf, -1, -2)))
    delta = (dof * o).sum(axis=-1, keepdims=True)
    ds = rnd(p * (dp - delta))
    dq = rnd(xp.float32(scale) * xp.matmul(ds, kf))
    dk = rnd(xp.float32(scale) * xp.matmul(xp.swapaxes(ds, -1, -2), qf).sum(axis=2))
    return (dq.reshape(q.shape).astype(dtype), dk.astype(dtype), dv.astype(dtype))

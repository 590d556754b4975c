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

__all__ = ["attention"]


def _xp(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy


def attention(q, k, v, causal: bool = False, scale: float | None = None):
    """Naive attention; returns o in q's dtype (float16, bfloat16 or float32)."""
    xp = _xp(q)
    dtype = q.dtype
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)

    def rnd(x):
        return x.astype(dtype).astype(xp.float32)

    qf = q.astype(xp.float32).reshape(b, hkv, hq // hkv, nq, d)
    kf = k.astype(xp.float32)[:, :, None]
    vf = v.astype(xp.float32)[:, :, None]
    s = rnd(xp.matmul(qf, xp.swapaxes(kf, -1, -2))) * xp.float32(scale)
    if causal:
        visible = xp.arange(nk)[None, :] <= (xp.arange(nq)[:, None] + (nk - nq))
        s = xp.where(visible, s, xp.float32(-xp.inf))
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, xp.float32(0))
    e = xp.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    p = rnd(e / xp.where(l > 0, l, xp.float32(1)))
    o = rnd(xp.matmul(p, vf))
    return o.reshape(b, hq, nq, d).astype(dtype)

"""Naive attention in the inputs' own precision: the baseline every accuracy claim is put next to.

    S = round(q k^T),  P = round(softmax(scale * S)),  o = round(P v)

Each product is accumulated in float32 (as cuBLAS and NumPy do for 16-bit inputs) and rounded to the
input dtype once, where a framework's attention would store it. The full (Nq x Nk) score matrix is
materialised: this is the memory behaviour flashcupy avoids. Works on NumPy and CuPy arrays alike;
causal masking and the score variants (``window_size``, ``softcap``, ``sinks``, ``alibi_slopes``) as in
``flashcupy.reference``, in float32 on the rounded scores (a softcapped score is rounded again, as a
framework's tanh would store it).
"""
from __future__ import annotations

import math

import numpy as np

from .reference import _variants
from .transforms import _xp

__all__ = ["attention", "attention_backward"]



_NO_VARIANTS = ((-1, -1), 0.0, None, None)


def _probabilities(q, k, causal, scale, rnd, variants=_NO_VARIANTS):
    """Same-precision P (rounded) for grouped q (B, Hkv, G, Nq, D) and k (B, Hkv, 1, Nk, D); also the
    sink's probability and the softcap's derivative (None without them)."""
    xp = _xp(q)
    window, cap, sinks, slopes = variants
    nq, nk = q.shape[-2], k.shape[-2]
    f32 = xp.float32
    s = rnd(xp.matmul(q, xp.swapaxes(k, -1, -2))) * f32(scale)
    dcap = None
    if cap:
        th = xp.tanh(s / f32(cap))
        s, dcap = rnd(f32(cap) * th), f32(1) - th * th
    if slopes is not None:
        dist = xp.abs(xp.arange(nq)[:, None] + (nk - nq) - xp.arange(nk)[None, :]).astype(f32)
        s = s - xp.asarray(slopes, dtype=f32) * dist
    if causal or window != (-1, -1):
        from .reference import visible_mask

        s = xp.where(xp.asarray(visible_mask(np.arange(nq), nq, nk, causal, window)), s, f32(-xp.inf))
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        sinks = xp.asarray(sinks, dtype=f32)
        m = xp.maximum(m, sinks)
    m = xp.where(xp.isfinite(m), m, f32(0))
    e = xp.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        l = l + xp.exp(sinks - m)
    l = xp.where(l > 0, l, f32(1))
    return rnd(e / l), (None if sinks is None else xp.exp(sinks - m) / l), dcap


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


def attention(q, k, v, causal: bool = False, scale: float | None = None, *, window_size=(-1, -1),
              softcap: float = 0.0, sinks=None, alibi_slopes=None):
    """Naive attention; returns o in q's dtype (float16, bfloat16 or float32)."""
    xp, rnd, scale, qf, kf, vf = _setup(q, k, v, scale)
    p, _, _ = _probabilities(qf, kf, causal, scale, rnd,
                             _variants(qf.shape[:3], window_size, softcap, sinks, alibi_slopes))
    o = rnd(xp.matmul(p, vf))
    return o.reshape(q.shape).astype(q.dtype)


def attention_backward(do, q, k, v, causal: bool = False, scale: float | None = None, *, window_size=(-1, -1),
                       softcap: float = 0.0, sinks=None, alibi_slopes=None):
    """Naive same-precision gradients (dq, dk, dv) of sum(do * attention(q, k, v)), and d sinks (float32
    (Hq,)) with ``sinks``.

    P, O, dV, dP, dS, dQ, dK are each rounded to the input dtype once, as a framework's autograd of
    naive attention stores them; delta = rowsum(dO * O) in float32. dk, dv are summed over the query
    heads that share a kv head. A softcap multiplies dS by 1 - tanh^2 before its rounding; d sinks =
    -sum over the head's rows of P_sink delta.
    """
    xp, rnd, scale, qf, kf, vf = _setup(q, k, v, scale)
    dtype = q.dtype
    dof = do.astype(xp.float32).reshape(qf.shape)
    p, p_sink, dcap = _probabilities(qf, kf, causal, scale, rnd,
                                     _variants(qf.shape[:3], window_size, softcap, sinks, alibi_slopes))
    o = rnd(xp.matmul(p, vf))
    dv = rnd(xp.matmul(xp.swapaxes(p, -1, -2), dof).sum(axis=2))
    dp = rnd(xp.matmul(dof, xp.swapaxes(vf, -1, -2)))
    delta = (dof * o).sum(axis=-1, keepdims=True)
    ds = rnd(p * (dp - delta) if dcap is None else p * (dp - delta) * dcap)
    dq = rnd(xp.float32(scale) * xp.matmul(ds, kf))
    dk = rnd(xp.float32(scale) * xp.matmul(xp.swapaxes(ds, -1, -2), qf).sum(axis=2))
    grads = (dq.reshape(q.shape).astype(dtype), dk.astype(dtype), dv.astype(dtype))
    if p_sink is None:
        return grads
    return (*grads, -(p_sink * delta).sum(axis=(0, 3, 4)).reshape(q.shape[1]).astype(xp.float32))

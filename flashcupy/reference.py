"""The float64 truth: plain attention in NumPy, forward and backward.

Everything flashcupy measures is measured against these two functions. They compute

    S = scale * Q K^T,   P = softmax(S) row-wise (masked entries excluded),   O = P V,
    LSE_i = ln sum_j exp(S_ij)

in float64, one chunk of query rows at a time, so the N x N score matrix never exists whole (N = 16384
fits in a few GB). Shapes follow the package: q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) with Hq % Hkv == 0
(query head h reads key/value head h // (Hq // Hkv)). With ``causal=True`` key j is visible to query i
iff j <= i + (Nk - Nq): the mask is aligned to the bottom-right corner when Nq != Nk, as in
FlashAttention-2. A query row that sees no key gets output 0 and LSE -inf.

Inputs may be NumPy or CuPy arrays of any float dtype (bfloat16 through ml_dtypes included); they are
copied to host float64. Outputs are NumPy float64.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["attention", "attention_backward", "causal_mask", "to_float64"]

# Row chunks are sized so one chunk's score block holds about this many float64 values (256 MB).
_CHUNK_ELEMENTS = 1 << 25


def to_float64(x) -> np.ndarray:
    """Host float64 copy of a NumPy or CuPy array (any float dtype, bfloat16 included)."""
    if hasattr(x, "get") and not isinstance(x, np.ndarray):  # a CuPy array
        x = x.get()
    return np.asarray(x).astype(np.float64)


def causal_mask(rows: np.ndarray, nq: int, nk: int) -> np.ndarray:
    """Boolean (len(rows), nk): True where query row ``rows[i]`` may see key j (bottom-right aligned)."""
    cols = np.arange(nk)
    return cols[None, :] <= (np.asarray(rows)[:, None] + (nk - nq))


def _prepare(q, k, v, scale):
    q, k, v = to_float64(q), to_float64(k), to_float64(v)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be 4-D (B, H, N, D)")
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k and v must be (B, Hkv, Nk, D) with q's B and D; got q {q.shape}, k {k.shape}, "
                         f"v {v.shape}")
    if min(b, hq, nq, d, hkv, nk) < 1:
        raise ValueError(f"every extent must be >= 1 (an empty sequence has no softmax); got q {q.shape}, "
                         f"k {k.shape}")
    if hq % hkv:
        raise ValueError(f"Hq={hq} is not a multiple of Hkv={hkv}")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    # Group query heads by the kv head they read: (B, Hkv, G, Nq, D).
    qg = q.reshape(b, hkv, hq // hkv, nq, d)
    return qg, k[:, :, None], v[:, :, None], float(scale), (b, hq, nq, d, hkv, nk)


def _chunks(nq, b, hq, nk):
    step = max(1, _CHUNK_ELEMENTS // max(1, b * hq * nk))
    for r0 in range(0, nq, step):
        yield r0, min(nq, r0 + step)


def _probabilities(qg_chunk, k, scale, rows, nq, nk, causal):
    """P (softmax of the scaled scores) and LSE for one chunk of rows; empty rows give P = 0, LSE = -inf."""
    s = scale * np.matmul(qg_chunk, np.swapaxes(k, -1, -2))
    if causal:
        s = np.where(causal_mask(rows, nq, nk), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m_safe)
    l = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(l > 0, e / np.where(l > 0, l, 1.0), 0.0)
        lse = np.where(l > 0, m_safe + np.log(np.where(l > 0, l, 1.0)), -np.inf)
    return p, lse[..., 0]


def attention(q, k, v, causal: bool = False, scale: float | None = None, return_lse: bool = False):
    """Float64 attention. Returns o (B, Hq, Nq, D), and with ``return_lse`` also lse (B, Hq, Nq).

    o_i = sum_j P_ij v_j with P_ij = exp(S_ij - LSE_i), S = scale * q k^T (default scale 1/sqrt(D)),
    LSE_i = ln sum_j exp(S_ij) over the keys row i may see; rows that see none: o_i = 0, LSE_i = -inf.
    """
    qg, k, v, scale, (b, hq, nq, d, hkv, nk) = _prepare(q, k, v, scale)
    o = np.empty(qg.shape, dtype=np.float64)
    lse = np.empty(qg.shape[:-1], dtype=np.float64)
    for r0, r1 in _chunks(nq, b, hq, nk):
        rows = np.arange(r0, r1)
        p, lse[..., r0:r1] = _probabilities(qg[..., r0:r1, :], k, scale, rows, nq, nk, causal)
        o[..., r0:r1, :] = np.matmul(p, v)
    o = o.reshape(b, hq, nq, d)
    return (o, lse.reshape(b, hq, nq)) if return_lse else o


def attention_backward(do, q, k, v, causal: bool = False, scale: float | None = None, dlse=None):
    """Float64 gradients (dq, dk, dv) of ``sum(do * attention(q, k, v))``, plus ``sum(dlse * lse)``
    when ``dlse`` (B, Hq, Nq) is given (d lse_i / d S_ij = P_ij adds dlse_i * P_ij to dS).

    With P the probabilities and O = P V:
        dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D_i),   D_i = sum_j P_ij dP_ij = rowsum(dO * O),
        dQ = scale * dS K,   dK = scale * dS^T Q,
    where dK and dV are summed over the query heads that share a key/value head (GQA).
    """
    qg, k, v, scale, (b, hq, nq, d, hkv, nk) = _prepare(q, k, v, scale)
    do = to_float64(do)
    if do.shape != (b, hq, nq, d):
        raise ValueError(f"do has shape {do.shape}; expected {(b, hq, nq, d)}")
    dog = do.reshape(qg.shape)
    dlg = np.zeros(qg.shape[:-1] + (1,)) if dlse is None else to_float64(dlse).reshape(qg.shape[:-1] + (1,))
    dq = np.empty(qg.shape, dtype=np.float64)
    dk = np.zeros((b, hkv, nk, d), dtype=np.float64)
    dv = np.zeros((b, hkv, nk, d), dtype=np.float64)
    vt = np.swapaxes(v, -1, -2)
    for r0, r1 in _chunks(nq, b, hq, nk):
        rows = np.arange(r0, r1)
        p, _ = _probabilities(qg[..., r0:r1, :], k, scale, rows, nq, nk, causal)
        g = dog[..., r0:r1, :]
        dv += np.matmul(np.swapaxes(p, -1, -2), g).sum(axis=2)
        dp = np.matmul(g, vt)
        ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True) + dlg[..., r0:r1, :])
        dq[..., r0:r1, :] = scale * np.matmul(ds, k)
        dk += scale * np.matmul(np.swapaxes(ds, -1, -2), qg[..., r0:r1, :]).sum(axis=2)
    return dq.reshape(b, hq, nq, d), dk, dv

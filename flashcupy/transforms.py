"""Exact transforms of attention inputs that tame outliers before low-precision attention.

Both leave the attention output unchanged in exact arithmetic; what they change is the range of the
values a kernel has to round, which is what the low-precision studies measure.

* ``incoherent(q, k, seed)``, FlashAttention-3's incoherent processing: q and k times the same random
  orthogonal matrix M = diag(s) H / sqrt(D) (s random signs, H the Sylvester-Hadamard matrix, D a power
  of two). (q M)(k M)^T = q M M^T k^T = q k^T, so the scores, and with them o and the LSE, are those of
  q and k; an outlier channel of q or k is spread over all D channels.
* ``smooth_keys(k)``, SageAttention's smoothing of K: subtract the mean of k over the tokens of each kv
  head. Every score of a query row changes by the same q . mean(k), and softmax is invariant to a
  per-row shift, so o is unchanged (the LSE shifts by q . mean(k) * scale, returned for undoing it);
  a channel bias shared by all keys is removed.

Both work on NumPy and CuPy arrays (B, H, N, D) and return arrays of the input dtype (the transform is
computed in float32, or float64 for float64 inputs, and rounded once).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ._types import Array

__all__ = ["hadamard", "incoherent", "rotation", "smooth_keys"]


def _xp(x):
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy
    if isinstance(x, np.ndarray):
        return np
    raise TypeError(f"expected a numpy.ndarray or cupy.ndarray, got {type(x).__name__}")


def _wide(xp, dtype):
    """The precision a transform is computed in: float64 for float64 inputs, else float32."""
    return xp.float64 if dtype == xp.float64 else xp.float32


def hadamard(d: int) -> np.ndarray:
    """The Sylvester-Hadamard matrix of order d (a power of two), entries +-1, float64: H H^T = d I."""
    if not isinstance(d, (int, np.integer)) or d < 1 or d & (d - 1):
        raise ValueError(f"the Hadamard transform needs a head dim that is a power of two, got {d}")
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


def rotation(d: int, seed: int = 0) -> np.ndarray:
    """M = diag(s) H / sqrt(d), s random signs drawn from ``seed``: orthogonal, float64 (d, d)."""
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=d)
    return signs[:, None] * hadamard(d) / np.sqrt(d)


def incoherent(q: Array, k: Array, seed: int = 0) -> tuple[Array, Array]:
    """(q M, k M) with M = ``rotation(D, seed)``: the same scores q k^T, outlier channels spread out.
    q (B, Hq, Nq, D) and k (B, Hkv, Nk, D) of one array module and dtype; D a power of two."""
    xp = _xp(q)
    if _xp(k) is not xp or q.dtype != k.dtype or q.ndim != 4 or k.ndim != 4 or q.shape[-1] != k.shape[-1]:
        raise ValueError("q and k must be 4-D arrays of one array module and dtype with the same head dim; "
                         f"got {type(q).__name__} {q.dtype} {q.shape} and "
                         f"{type(k).__name__} {k.dtype} {k.shape}")
    wide = _wide(xp, q.dtype)
    m = xp.asarray(rotation(q.shape[-1], seed), dtype=wide)
    return ((q.astype(wide) @ m).astype(q.dtype), (k.astype(wide) @ m).astype(k.dtype))


def smooth_keys(k: Array) -> tuple[Array, Array]:
    """(k - mean_tokens(k), mean_tokens(k)): k (B, Hkv, Nk, D) smoothed per kv head, and the mean
    (B, Hkv, 1, D) in float32 (float64 for float64 k). The output of attention is unchanged; its LSE shifts by
    scale * q . mean (the row-wise shift softmax ignores)."""
    xp = _xp(k)
    if k.ndim != 4:
        raise ValueError(f"k must be a 4-D (B, Hkv, Nk, D) array, got shape {k.shape}")
    if not (np.issubdtype(k.dtype, np.floating) or k.dtype.name == "bfloat16"):
        raise TypeError(f"k must be a floating-point array (the smoothed keys keep k's dtype: integers "
                        f"would truncate them); got {k.dtype}")
    kf = k.astype(_wide(xp, k.dtype))
    mean = kf.mean(axis=2, keepdims=True)
    return (kf - mean).astype(k.dtype), mean

"""The float64 truth: plain attention in NumPy, forward and backward.

Everything flashcupy measures is measured against these two functions. They compute

    S = scale * Q K^T,   P = softmax(S) row-wise (masked entries excluded),   O = P V,
    LSE_i = ln sum_j exp(S_ij)

in float64, one chunk of query rows at a time, so the N x N score matrix never exists whole (N = 16384
fits in a few GB). Shapes follow the package: q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) with Hq % Hkv == 0
(query head h reads key/value head h // (Hq // Hkv)). With ``causal=True`` key j is visible to query i
iff j <= i + (Nk - Nq): the mask is aligned to the bottom-right corner when Nq != Nk, as in
FlashAttention-2. A query row that sees no key gets output 0 and LSE -inf. Both functions also take
flash_attn_func's score variants (sliding window, softcap, ALiBi slopes) and gpt-oss's per-head attention
sinks, with d sinks from the backward (see ``attention``).

Inputs may be NumPy or CuPy arrays of any float dtype (bfloat16 through ml_dtypes included); they are
copied to host float64. Outputs are NumPy float64.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["attention", "attention_backward", "causal_mask", "to_float64", "visible_mask"]

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


def visible_mask(rows: np.ndarray, nq: int, nk: int, causal: bool = False,
                 window_size: tuple[int, int] = (-1, -1)) -> np.ndarray:
    """Boolean (len(rows), nk): True where query row i = ``rows[..]`` may see key j. With i' = i + Nk - Nq
    (the bottom-right alignment): ``causal`` asks j <= i'; ``window_size = (left, right)`` asks
    i' - left <= j <= i' + right, -1 meaning unbounded on that side (flash_attn_func's convention: causal
    is the window (-1, 0))."""
    left, right = window_size
    ip = np.asarray(rows)[:, None] + (nk - nq)
    cols = np.arange(nk)[None, :]
    seen = np.ones((ip.shape[0], nk), dtype=bool)
    if causal:
        seen &= cols <= ip
    if left >= 0:
        seen &= cols >= ip - left
    if right >= 0:
        seen &= cols <= ip + right
    return seen


def check_window(window_size) -> tuple[int, int]:
    """``window_size`` checked: a pair of ints (left, right), each -1 (unbounded) or a reach of 0 to
    2^30 - 1 keys. The one check of it (the kernels' problem check calls it too)."""
    try:
        left, right = window_size
        if not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in (left, right)):
            raise TypeError
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}") from None
    left, right = int(left), int(right)
    if not (-1 <= left < 1 << 30 and -1 <= right < 1 << 30):
        raise ValueError(f"window_size entries must be -1 (unbounded) or 0 to 2^30 - 1, got {window_size!r}")
    return left, right


def check_softcap(softcap) -> float:
    """``softcap`` checked: a real number (not a bool), finite and >= 0 (0: off); returned as a float.
    The one check of its kind (the kernels' problem check adds their range)."""
    number = (int, float, np.floating, np.integer)
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, number):
        raise TypeError(f"softcap must be a number (0: off), got {type(softcap).__name__}")
    softcap = float(softcap)
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0: off), got {softcap}")
    return softcap


def _variants(groups, window_size, softcap, sinks, alibi_slopes):
    """The variant arguments checked and shaped for the grouped heads ``groups`` = (B, Hkv, G) (query
    head h = G kv + g): (window, softcap, sinks (1, Hkv, G, 1, 1) or None, slopes (B or 1, Hkv, G, 1, 1) or
    None). The one check of these arguments: naive and the twin call it too."""
    b, hkv, g = groups
    hq = hkv * g
    left, right = check_window(window_size)
    softcap = check_softcap(softcap)
    if sinks is not None:
        sinks = to_float64(sinks)
        if sinks.shape != (hq,):
            raise ValueError(f"sinks must have shape (Hq,) = ({hq},); got shape {sinks.shape}")
        if not np.isfinite(sinks).all():
            bad = np.count_nonzero(~np.isfinite(sinks))
            raise ValueError(f"sinks must be finite; got {bad} non-finite values")
        sinks = sinks.reshape(1, hkv, g, 1, 1)
    if alibi_slopes is not None:
        alibi_slopes = to_float64(alibi_slopes)
        if alibi_slopes.shape not in ((hq,), (b, hq)):
            raise ValueError(f"alibi_slopes must have shape (Hq,) = ({hq},) or (B, Hq) = ({b}, {hq}); got "
                             f"shape {alibi_slopes.shape}")
        if not np.isfinite(alibi_slopes).all():
            bad = np.count_nonzero(~np.isfinite(alibi_slopes))
            raise ValueError(f"alibi_slopes must be finite; got {bad} non-finite values")
        alibi_slopes = alibi_slopes.reshape(-1, hkv, g, 1, 1)
    return (left, right), softcap, sinks, alibi_slopes


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


def _probabilities(qg_chunk, k, scale, rows, nq, nk, causal, variants=((-1, -1), 0.0, None, None)):
    """For one chunk of rows: P (the softmax of the scores over the keys a row sees, the sink in the
    denominator), LSE, the sink's probability exp(sink - LSE) (None without sinks) and the softcap's
    derivative 1 - tanh^2 (None without softcap). A row that sees no key: P = 0, LSE = -inf (the sink's
    logit with sinks)."""
    window, softcap, sinks, slopes = variants
    s = scale * np.matmul(qg_chunk, np.swapaxes(k, -1, -2))
    dcap = None
    if softcap:
        th = np.tanh(s / softcap)
        s, dcap = softcap * th, 1.0 - th * th
    if slopes is not None:
        s = s - slopes * np.abs(np.asarray(rows)[:, None] + (nk - nq) - np.arange(nk)[None, :])
    if causal or window != (-1, -1):
        s = np.where(visible_mask(rows, nq, nk, causal, window), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, sinks)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m_safe)
    l = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        l = l + np.exp(sinks - m_safe)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(l > 0, e / np.where(l > 0, l, 1.0), 0.0)
        lse = np.where(l > 0, m_safe + np.log(np.where(l > 0, l, 1.0)), -np.inf)
    p_sink = None if sinks is None else np.exp(sinks - lse)
    return p, lse[..., 0], p_sink, dcap


def attention(q, k, v, causal: bool = False, scale: float | None = None, return_lse: bool = False, *,
              window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, sinks=None, alibi_slopes=None):
    """Float64 attention. Returns o (B, Hq, Nq, D), and with ``return_lse`` also lse (B, Hq, Nq).

    o_i = sum_j P_ij v_j with P_ij = exp(S_ij - LSE_i), S = scale * q k^T (default scale 1/sqrt(D)),
    LSE_i = ln sum_j exp(S_ij) over the keys row i may see; rows that see none: o_i = 0, LSE_i = -inf.

    The variants, in flash_attn_func's names and order (i' = i + Nk - Nq, the bottom-right alignment):

    * ``softcap = c > 0``: S_ij <- c tanh(S_ij / c) on the scaled scores (0: off);
    * ``alibi_slopes`` (Hq,) or (B, Hq): S_ij <- S_ij - slope_h |i' - j|, after the softcap;
    * ``window_size = (left, right)``: key j visible iff i' - left <= j <= i' + right (-1: unbounded;
      with ``causal`` also j <= i'), masked after both;
    * ``sinks`` (Hq,): a logit per head in the denominator with no value row,
      LSE_i = ln(sum_j exp(S_ij) + exp(sink_h)), so the P_ij = exp(S_ij - LSE_i) sum to
      1 - exp(sink_h - LSE_i); a row that sees no key then has o_i = 0 and LSE_i = sink_h.
    """
    qg, k, v, scale, (b, hq, nq, d, hkv, nk) = _prepare(q, k, v, scale)
    variants = _variants(qg.shape[:3], window_size, softcap, sinks, alibi_slopes)
    o = np.empty(qg.shape, dtype=np.float64)
    lse = np.empty(qg.shape[:-1], dtype=np.float64)
    for r0, r1 in _chunks(nq, b, hq, nk):
        rows = np.arange(r0, r1)
        p, lse[..., r0:r1], _, _ = _probabilities(qg[..., r0:r1, :], k, scale, rows, nq, nk, causal, variants)
        o[..., r0:r1, :] = np.matmul(p, v)
    o = o.reshape(b, hq, nq, d)
    return (o, lse.reshape(b, hq, nq)) if return_lse else o


def attention_backward(do, q, k, v, causal: bool = False, scale: float | None = None, dlse=None, *,
                       window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, sinks=None,
                       alibi_slopes=None):
    """Float64 gradients (dq, dk, dv) of ``sum(do * attention(q, k, v))``, plus ``sum(dlse * lse)``
    when ``dlse`` (B, Hq, Nq) is given (d lse_i / d S_ij = P_ij adds dlse_i * P_ij to dS); with
    ``sinks`` also d sinks (Hq,), a fourth output. The variants as in ``attention``.

    With P the probabilities and O = P V:
        dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D_i),   D_i = sum_j P_ij dP_ij = rowsum(dO * O),
        dQ = scale * dS K,   dK = scale * dS^T Q,
    where dK and dV are summed over the query heads that share a key/value head (GQA). A softcap
    multiplies dS by its derivative 1 - tanh^2(S_ij / c) (ALiBi's bias and the mask add none), and a
    sink, whose probability is P_sink,i = exp(sink_h - LSE_i), takes
        d sink_h = sum over the head's rows of P_sink,i (dlse_i - D_i).
    """
    qg, k, v, scale, (b, hq, nq, d, hkv, nk) = _prepare(q, k, v, scale)
    variants = _variants(qg.shape[:3], window_size, softcap, sinks, alibi_slopes)
    do = to_float64(do)
    if do.shape != (b, hq, nq, d):
        raise ValueError(f"do has shape {do.shape}; expected {(b, hq, nq, d)}")
    dog = do.reshape(qg.shape)
    dlg = np.zeros(qg.shape[:-1] + (1,)) if dlse is None else to_float64(dlse).reshape(qg.shape[:-1] + (1,))
    dq = np.empty(qg.shape, dtype=np.float64)
    dk = np.zeros((b, hkv, nk, d), dtype=np.float64)
    dv = np.zeros((b, hkv, nk, d), dtype=np.float64)
    dsinks = np.zeros(qg.shape[1:3], dtype=np.float64)
    vt = np.swapaxes(v, -1, -2)
    for r0, r1 in _chunks(nq, b, hq, nk):
        rows = np.arange(r0, r1)
        p, _, p_sink, dcap = _probabilities(qg[..., r0:r1, :], k, scale, rows, nq, nk, causal, variants)
        g = dog[..., r0:r1, :]
        dv += np.matmul(np.swapaxes(p, -1, -2), g).sum(axis=2)
        dp = np.matmul(g, vt)
        delta = (p * dp).sum(axis=-1, keepdims=True)
        ds = p * (dp - delta + dlg[..., r0:r1, :])
        if p_sink is not None:
            dsinks += (p_sink * (dlg[..., r0:r1, :] - delta)).sum(axis=(0, 3, 4))
        if dcap is not None:
            ds = ds * dcap
        dq[..., r0:r1, :] = scale * np.matmul(ds, k)
        dk += scale * np.matmul(np.swapaxes(ds, -1, -2), qg[..., r0:r1, :]).sum(axis=2)
    grads = (dq.reshape(b, hq, nq, d), dk, dv)
    return grads if sinks is None else (*grads, dsinks.reshape(hq))

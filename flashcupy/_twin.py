"""The NumPy twin: the tiled online-softmax algorithm of the CUDA kernels, on the CPU.

The twin runs the same algorithm as ``kernels_cu/fwd_*.cu`` with the same knobs, vectorised over
batch, heads and query rows, looping over key/value tiles of ``block_n`` keys. For each tile j, with
S_j the raw scores q k_j^T (masked entries -inf) and c = scale * log2(e):

    m_new = max(m, rowmax(S_j))
    alpha = 2^(c*(m - m_new))                      (ablate="rescaling" or "max_subtraction": 1)
    P     = 2^(c*(S_j - m_new))                    ("rescaling": m_new -> rowmax(S_j); "max_subtraction": 0)
    l     = alpha * l + rowsum(P)
    O     = alpha * O + round_elem(P) V_j
    m     = m_new

and at the end o = O / l (o = 0 where l = 0), lse = m*scale + ln(l) ("max_subtraction": ln(l)).
A value of m that is still -inf (no key seen yet) is replaced by 0 where it is subtracted.

Rounding model (the one the kernels implement, see ``kernels_cu/flash_common.cuh``):

* ``round_elem``: P is rounded to the input element type (fp16 / bf16; nothing for fp32) before P V,
  because the tensor-core kernels feed P to the matrix units in that type. This is where fp16 without
  max subtraction overflows: 2^(c*s) > 65504 once scale*s > ln(65504) ~ 11.09.
* ``accum="fp32"``: S, m, l, O are float32; sums are exact products accumulated in float32.
* ``accum="fp16"``: S and O are fp16 accumulators, rounded after each group of 16 products along the
  reduction axis (head dim for S, keys for O), as ``mma.m16n8k16`` with f16 accumulators does; m and l
  are stored in fp16, each update computed in float32 and rounded once; alpha*O is rounded once.

Numerics do not depend on ``block_m`` (query rows are independent); ``block_n`` sets the tiles the
running statistics are updated over, which is what the "rescaling" break exposes.
"""
from __future__ import annotations

import math

import numpy as np

from ._checks import Problem, numpy_dtype

_LOG2E = 1.0 / math.log(2.0)
_CHUNK = 16  # products per fp16 accumulator rounding


def _round_to(x: np.ndarray, dtype) -> np.ndarray:
    """Round float32 values to ``dtype`` and back (round to nearest even; overflow gives inf)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(dtype).astype(np.float32)


def _fp16_accumulate(acc, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """acc + a @ b in an fp16 accumulator, rounded after every 16 products of the reduction axis
    (``acc`` None means a fresh accumulator of zeros)."""
    for c0 in range(0, a.shape[-1], _CHUNK):
        part = np.matmul(a[..., c0:c0 + _CHUNK], b[..., c0:c0 + _CHUNK, :])
        acc = _round_to(part if acc is None else acc + part, np.float16)
    return acc


def forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, p: Problem):
    """Run the twin for a checked problem. Returns (o in q's dtype, lse float32 (B, Hq, Nq))."""
    var = p.variant
    elem = numpy_dtype(var.dtype)
    f16 = var.accum == "fp16"
    rnd_acc = (lambda x: _round_to(x, np.float16)) if f16 else (lambda x: x)
    rnd_elem = (lambda x: x) if var.dtype == "f32" else (lambda x: _round_to(x, elem))
    ablate = var.ablate

    b, hq, hkv, nq, nk, d = p.batch, p.heads_q, p.heads_kv, p.nq, p.nk, p.head_dim
    g = p.group
    # (B, Hkv, G, Nq, D) against (B, Hkv, 1, Nk, D): GQA by broadcasting, no copy of k/v per head.
    qf = q.astype(np.float32).reshape(b, hkv, g, nq, d)
    kf = k.astype(np.float32)[:, :, None]
    vf = v.astype(np.float32)[:, :, None]
    c = np.float32(p.scale * _LOG2E)

    m = np.full((b, hkv, g, nq, 1), -np.inf, dtype=np.float32)
    l = np.zeros((b, hkv, g, nq, 1), dtype=np.float32)
    acc = np.zeros((b, hkv, g, nq, d), dtype=np.float32)
    rows = np.arange(nq)[:, None]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for j0 in range(0, nk, var.block_n):
            j1 = min(nk, j0 + var.block_n)
            kt = np.swapaxes(kf[..., j0:j1, :], -1, -2)
            s = _fp16_accumulate(None, qf, kt) if f16 else np.matmul(qf, kt)   # raw scores (.., Nq, bn)
            if var.causal:
                visible = np.arange(j0, j1)[None, :] <= rows + (nk - nq)
                s = np.where(visible, s, np.float32(-np.inf))
            m_tile = s.max(axis=-1, keepdims=True)
            m_new = np.maximum(m, m_tile)
            if ablate == "max_subtraction":
                shift = np.float32(0.0)
                alpha = np.float32(1.0)
            elif ablate == "rescaling":
                shift = np.where(m_tile == -np.inf, np.float32(0), m_tile)
                alpha = np.float32(1.0)
            else:
                shift = np.where(m_new == -np.inf, np.float32(0), m_new)
                alpha = np.exp2(m * c - shift * c)
            pr = np.exp2(s * c - shift * c).astype(np.float32)
            l = rnd_acc(alpha * l + pr.sum(axis=-1, keepdims=True, dtype=np.float32))
            acc = rnd_acc(alpha * acc)
            if f16:
                acc = _fp16_accumulate(acc, rnd_elem(pr), vf[..., j0:j1, :])
            else:
                acc = acc + np.matmul(rnd_elem(pr), vf[..., j0:j1, :])
            m = m_new

        empty = l == 0
        o = np.where(empty, np.float32(0), acc / np.where(empty, np.float32(1), l))
        if ablate == "max_subtraction":
            lse = np.log(l.astype(np.float64))
        else:
            lse = m.astype(np.float64) * p.scale + np.log(l.astype(np.float64))
        lse = np.where(empty, -np.inf, lse)
    o = o.reshape(b, hq, nq, d).astype(elem)
    return o, lse.reshape(b, hq, nq).astype(np.float32)

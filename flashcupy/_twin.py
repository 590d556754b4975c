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

What the tensor cores do, measured on the H200 (``python -m analysis tensorcore``; one k16 step of
``mma.sync`` (mma family) and of ``wgmma`` (wgmma family), which gave the same bits in every case): the 16
products and the accumulator are aligned to the largest exponent, a product's exponent taken as
exp(a) + exp(b), keeping 26 bits (fp32's 24 and 2 guard bits), each truncated toward zero, summed, and the
sum is rounded toward zero into an fp32 accumulator, or to nearest even into an fp16 accumulator. This
model explains every one of 8240 cases per (instruction, inputs, accumulator). The twin does not run it:
it sums in float32 (fp32 accumulators) or rounds a float32 sum of each 16 products plus the accumulator to
nearest fp16 (fp16 accumulators), so it agrees with both tensor-core families to within the tests' twin
tolerance, not bitwise (on the probe's random cases the twin's model gives the same bits 42-65 % of the
time with fp32 accumulators, 98 % with fp16 ones). The simt family sums its fp32 partials in ordinary
fp32 FMAs and rounds fp16 accumulators to nearest, as the twin does.

fp8 (e4m3) inputs: ``forward_fp8`` runs the fp8 forward of ``flashcupy.attention_fp8`` with the e4m3
wgmma accumulation that the probe measured (k32 steps, terms aligned to 14 bits, the sum truncated to 14
bits) through ``flashcupy._tensorcore.matmul``: there the twin follows the hardware's model step by step
instead of summing in float32, since the fp8 accumulator's loss is the effect being studied.

Numerics do not depend on ``block_m`` (query rows are independent); ``block_n`` sets the tiles the
running statistics are updated over, which is what the "rescaling" break exposes.

Score variants (issue 35; the window comes with the problem's variant, ``forward`` and ``backward`` take
``reference.attention``'s ``softcap``, ``sinks`` and ``alibi_slopes``): applied to the raw scores as the
kernels apply them,
the scale staying folded into c (``_score_variants``): softcap t = (cap / scale) tanh(scale s / cap),
ALiBi t - (slope / scale) |i' - j|, then the mask (causal, window). A sink logit z is merged into each
row's (o, lse) after the key loop, as on the kernels (``flashcupy._sinks``: lse includes it, a row that sees
no key gets lse = z and o = 0); ``forward(sink_first=True)`` starts the online softmax from it instead
(m = z / scale, l = 1). The backward multiplies dS by the softcap's 1 - tanh^2 and returns d sinks =
-sum P_sink delta. Every kernel family runs the window, the softcap, the sinks and ALiBi (the fp8 forward:
the window, the softcap and the sinks).
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


def _score_variants(p: Problem, softcap, sinks, alibi_slopes):
    """The score variants (``reference.attention``'s arguments, checked there) as the kernels will apply
    them to raw scores s = q k^T, the scale folded into the exponent's c: a softcap of c_s on the scaled
    scores is t = (c_s / scale) tanh(scale s / c_s) (float32 tanh: the kernels' tanh is their own choice
    to model), an ALiBi slope a subtracts (a / scale) |i' - j|, a sink logit z starts the online softmax
    at m = z / scale with l = 1 (its term, exp(z - m scale), counted before any key). Returns (window,
    softcap, sinks (B?, Hkv, G, 1, 1) float32 raw units or None, slopes likewise or None)."""
    from .reference import _variants

    softcap = p.variant.softcap if softcap is None else softcap
    window, cap, sink, slope = _variants((p.batch, p.heads_kv, p.group), p.variant.window or (-1, -1),
                                         softcap, sinks, alibi_slopes)
    f32 = np.float32
    return (window, cap, None if sink is None else (sink / p.scale).astype(f32),
            None if slope is None else (slope / p.scale).astype(f32))


def _hooked_scores(s, rows, j0, j1, nq, nk, scale, causal, variants, after_mask: bool = False,
                   f16: bool = False, unshifted: bool = False):
    """Raw scores of key tile [j0, j1) through the softcap and the ALiBi bias, then masked (-inf where
    the row does not see the key: causal, window, keys past nk); also the softcap's derivative
    1 - tanh^2 (None without one). ``after_mask`` (the break ``softcap_after_mask``): the mask first,
    then the softcap, so that a masked key scores tanh(-inf) = -1 times the cap instead of -inf. ``f16``
    (fp16 accumulators): the capped score, and the biased one, are rounded to fp16, as the kernels'
    tiles hold them (the derivative comes from the unrounded tanh, as theirs does). ALiBi measures from
    max(i', 0), as the kernels do (``_row_shift``: a row with i' < 0 loses a d0 from every score and its
    LSE gets it back); ``unshifted`` (the twin-only ``ablate="alibi_unshifted"``) from i' itself."""
    from .reference import visible_mask

    window, cap, _, slope = variants
    f32 = np.float32
    dcap = None
    masked = causal or window != (-1, -1)
    if masked and after_mask:  # BROKEN ORDER: the mask before the softcap
        s = np.where(visible_mask(rows[:, 0], nq, nk, causal, window)[:, j0:j1], s, f32(-np.inf))
    if cap:
        th = np.tanh(s * f32(scale / cap))
        s, dcap = th * f32(cap / scale), f32(1) - th * th
        if f16:
            s = _round_to(s, np.float16)
    if slope is not None:
        pos = rows + (nk - nq) if unshifted else np.maximum(rows + (nk - nq), 0)
        s = s - slope * np.abs(pos - np.arange(j0, j1)[None, :]).astype(f32)
        if f16:  # (the kernels' hook rounds its result to the accumulator type)
            s = _round_to(s, np.float16)
    if masked and not after_mask:
        s = np.where(visible_mask(rows[:, 0], nq, nk, causal, window)[:, j0:j1], s, f32(-np.inf))
    return s, dcap


_NO_VARIANTS = ((-1, -1), 0.0, None, None)


def _row_shift(variants, nq: int, nk: int, unshifted: bool = False):
    """What the ALiBi hook takes off every score of each query row, in raw units: a d0 with
    d0 = max(nq - nk - i, 0), float32 (B?, Hkv, G, Nq, 1), the kernels' one rounding of the product; None
    without ALiBi or with ``unshifted``."""
    slope = variants[3]
    if slope is None or unshifted:
        return None
    d0 = np.maximum(nq - nk - np.arange(nq), 0).astype(np.float32)[:, None]
    return (slope * d0).astype(np.float32)


def forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, p: Problem, *, softcap: float | None = None,
            sinks=None, alibi_slopes=None, sink_first: bool = False):
    """Run the twin for a checked problem. Returns (o in q's dtype, lse float32 (B, Hq, Nq)). The score
    variants are ``reference.attention``'s, applied as the kernels will (``_score_variants``); the
    softcap is the problem's (``p.variant.softcap``) unless ``softcap`` is given. Sinks are merged after
    the key loop, as on the kernels (``flashcupy._sinks``); ``sink_first`` instead starts the online
    softmax from the sink (m = z, l = 1), the order whose 16-bit P collapse under a dominant sink."""
    var = p.variant
    variants = _score_variants(p, softcap, sinks, alibi_slopes)
    sink = variants[2]
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
    row_shift = _row_shift(variants, nq, nk, p.twin_ablate == "alibi_unshifted")
    if sink is not None and sink_first:  # the sink's term first: m = z / scale, l = exp2(0)
        # (with the max-subtraction break: l = exp2(z c); with ALiBi, in the units of the row's scores,
        # which the hook raised by a d0: z / scale + a d0)
        m = np.broadcast_to(sink, m.shape).astype(np.float32)
        if row_shift is not None:
            m = (m + row_shift).astype(np.float32)
        l = np.exp2(m * c) if ablate == "max_subtraction" else np.ones_like(l)
    acc = np.zeros((b, hkv, g, nq, d), dtype=np.float32)
    rows = np.arange(nq)[:, None]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for j0 in range(0, nk, var.block_n):
            j1 = min(nk, j0 + var.block_n)
            kt = np.swapaxes(kf[..., j0:j1, :], -1, -2)
            s = _fp16_accumulate(None, qf, kt) if f16 else np.matmul(qf, kt)   # raw scores (.., Nq, bn)
            s, _ = _hooked_scores(s, rows, j0, j1, nq, nk, p.scale, var.causal, variants,
                                  after_mask=p.twin_ablate == "softcap_after_mask", f16=f16,
                                  unshifted=p.twin_ablate == "alibi_unshifted")
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
        if row_shift is not None:  # (what the ALiBi hook took off the row, given back, as fc_hook_lse does)
            lse = lse - row_shift.astype(np.float64) * p.scale
        lse = np.where(empty, -np.inf, lse)
    o, lse = o.reshape(b, hq, nq, d).astype(elem), lse.reshape(b, hq, nq).astype(np.float32)
    if sink is not None and not sink_first:
        from . import _sinks

        _sinks.apply(o, lse, np.asarray(sinks, dtype=np.float32))
    return o, lse


def _fp16_accumulate_rows(acc, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """acc + a^T b over query rows (axis -2 of a and b) in an fp16 accumulator, rounded after every 16
    rows; a, b are (..., G, rows, x) and the sum also runs over the group axis G, head by head, as the
    dK/dV kernel loops over the query heads that share a kv head."""
    rows = a.shape[-2]
    for g in range(a.shape[-3]):
        for r0 in range(0, rows, _CHUNK):
            part = np.matmul(np.swapaxes(a[..., g, r0:r0 + _CHUNK, :], -1, -2), b[..., g, r0:r0 + _CHUNK, :])
            acc = _round_to(acc + part, np.float16)
    return acc


def backward(do, q, k, v, o, lse, p: Problem, dlse=None, *, softcap: float | None = None, sinks=None,
             alibi_slopes=None):
    """The twin of the backward kernels. Returns (dq, dk, dv) in q's dtype; with ``sinks`` also d sinks
    (float32 (Hq,)) = -sum over the head's rows of P_sink * delta, P_sink = 2^(c z / scale - lse log2 e)
    the sink's probability (delta = rowsum(dO * O) - dlse, as below). The score variants as in
    ``forward``; a softcap multiplies dS by 1 - tanh^2.

    Per key tile j (``block_n`` keys), for all query rows at once, with c = scale * log2(e):
        P  = 2^(c*S - lse*log2(e))   (0 where masked or where lse = -inf)
        dV_j += P^T dO,   dP = dO V_j^T,   dS = P * (dP - delta),   delta = rowsum(dO * O)
        dK_j += dS^T Q,   dQ += dS K_j;    finally dK and dQ are multiplied by scale.
    P and dS are rounded to the element type before each product; accumulators (S, dP, dV, dK, dQ)
    are fp32, or with accum="fp16" fp16 rounded every 16 products of their reduction axis. ``dlse``
    (the LSE's gradient) is subtracted from delta in fp32, as the kernels do.
    """
    var = p.variant
    variants = _score_variants(p, softcap, sinks, alibi_slopes)
    elem = numpy_dtype(var.dtype)
    f16 = var.accum == "fp16"
    rnd_elem = (lambda x: x) if var.dtype == "f32" else (lambda x: _round_to(x, elem))
    b, hq, hkv, nq, nk, d = p.batch, p.heads_q, p.heads_kv, p.nq, p.nk, p.head_dim
    g = p.group
    shape_q = (b, hkv, g, nq, d)
    qf = q.astype(np.float32).reshape(shape_q)
    dof = do.astype(np.float32).reshape(shape_q)
    kf = k.astype(np.float32)[:, :, None]
    vf = v.astype(np.float32)[:, :, None]
    delta = (dof * o.astype(np.float32).reshape(shape_q)).sum(axis=-1, keepdims=True, dtype=np.float32)
    if dlse is not None:
        delta = delta - dlse.astype(np.float32).reshape(delta.shape)
    lse2 = (lse.astype(np.float32) * np.float32(_LOG2E)).reshape(b, hkv, g, nq, 1)
    row_empty = np.isneginf(lse2)
    lse2 = np.where(row_empty, np.float32(0), lse2)
    c = np.float32(p.scale * _LOG2E)
    shift = _row_shift(variants, nq, nk)
    if shift is not None:  # the exponent offset of the hook's shifted scores (fc_hook_lq)
        lse2 = (lse2 + (shift * c).astype(np.float32)).astype(np.float32)

    dq = np.zeros(shape_q, dtype=np.float32)
    dk = np.zeros((b, hkv, nk, d), dtype=np.float32)
    dv = np.zeros((b, hkv, nk, d), dtype=np.float32)
    rows = np.arange(nq)[:, None]
    with np.errstate(over="ignore", invalid="ignore"):
        for j0 in range(0, nk, var.block_n):
            j1 = min(nk, j0 + var.block_n)
            kj, vj = kf[..., j0:j1, :], vf[..., j0:j1, :]
            kt, vt = np.swapaxes(kj, -1, -2), np.swapaxes(vj, -1, -2)
            s = _fp16_accumulate(None, qf, kt) if f16 else np.matmul(qf, kt)
            s, dcap = _hooked_scores(s, rows, j0, j1, nq, nk, p.scale, var.causal, variants, f16=f16)
            pr = np.where(row_empty | np.isneginf(s), np.float32(0), np.exp2(s * c - lse2)).astype(np.float32)
            dp = _fp16_accumulate(None, dof, vt) if f16 else np.matmul(dof, vt)
            ds = (pr * (dp - delta)).astype(np.float32)
            if dcap is not None:
                ds = (ds * dcap).astype(np.float32)
            pe, dse = rnd_elem(pr), rnd_elem(ds)
            if f16:
                dv[:, :, j0:j1] = _fp16_accumulate_rows(np.zeros_like(dv[:, :, j0:j1]), pe, dof)
                dk[:, :, j0:j1] = _fp16_accumulate_rows(np.zeros_like(dk[:, :, j0:j1]), dse, qf)
                dq = _fp16_accumulate(dq, dse, kj)
            else:
                dv[:, :, j0:j1] = np.einsum("bhgik,bhgid->bhkd", pe, dof, dtype=np.float32)
                dk[:, :, j0:j1] = np.einsum("bhgik,bhgid->bhkd", dse, qf, dtype=np.float32)
                dq = dq + np.matmul(dse, kj)
    scale = np.float32(p.scale)
    grads = ((dq * scale).reshape(b, hq, nq, d).astype(elem), (dk * scale).astype(elem), dv.astype(elem))
    if variants[2] is None:
        return grads
    from . import _sinks

    return (*grads, _sinks.grad(do, o, lse, np.asarray(sinks, dtype=np.float32), dlse))


def forward_fp8(q8, k8, v8, sq, sk, sv, *, causal: bool, scale: float, block_n: int, p_scale: float,
                accumulation: str, model=None, ablate=None, window=(-1, -1), sink_first=None,
                softcap: float = 0.0):
    """The twin of the fp8 (e4m3) forward: q8, k8, v8 float64 arrays of e4m3 values (B, H, N, D), sq, sk
    their float32 scales broadcastable to (B, H, N, 1), sv (B, Hkv, 1, 1) or (1, 1, 1, 1) (constant over
    keys). Returns (o float32, lse float32). Per tile of ``block_n`` keys, with c = scale * log2(e):

        S     = mm(Q8, K8^T) * (sq sk)             (the raw e4m3 product, descaled per row and column;
                                                   with ``softcap`` c_s, then (c_s / scale) tanh(scale S /
                                                   c_s) in float32, as ``forward``'s hook)
        m'    = max(m, rowmax S),  alpha = 2^(c (m - m')),  P = 2^(c (S - m'))      (fp32)
        l     = alpha l + rowsum(P)                (fp32, from P before its rounding)
        P8    = e4m3(P * p_scale)                  (round to nearest even; P * p_scale <= p_scale <= 448;
                                                   with a break P may exceed 1: saturated at 448, as the
                                                   kernel's cvt.rn.satfinite does)
        O     = mm(P8, V8, alpha O)                (accumulation "single": the tensor core's accumulator
                                                   carries O across tiles, rescaled in place)
              = alpha O + mm(P8, V8, 0)            ("tile": each tile's product in a fresh accumulator,
                                                   added to O by an fp32 add: two-level accumulation)

    and o = O * (sv / (p_scale l)), lse = m scale + ln(l). The breaks (``ablate``) act as in ``forward``:
    "max_subtraction" exponentiates the raw scores (m' = 0, alpha = 1, lse = ln l), "rescaling" subtracts
    each tile's own max and never rescales (alpha = 1). mm is ``_tensorcore.matmul`` with the
    accumulation measured for e4m3 wgmma (k32 steps, W = 14, the partial truncated to 14 bits), or
    ``model`` (W, rounding, P) instead; (None, "rn", None) sums exactly and rounds to fp32 per step.
    ``window``: a sliding window as in ``forward`` (a tile no row sees changes nothing: P = 0, alpha = 1,
    and the accumulator it leaves was truncated already). ``sink_first``: sink logits (Hq,) that start the
    online softmax (m = z / scale, l = 1; lse then includes them), the order whose e4m3 P collapse under
    a dominant sink (``attention_fp8`` merges its sinks after the loop instead: ``flashcupy._sinks``)."""
    import ml_dtypes

    from ._tensorcore import matmul

    b, hq, nq, d = q8.shape
    hkv, nk = k8.shape[1], k8.shape[2]
    g = hq // hkv
    f32 = np.float32
    qf = q8.reshape(b, hkv, g, nq, d)
    sqf = np.broadcast_to(sq, (b, hq, nq, 1)).astype(f32).reshape(b, hkv, g, nq, 1)
    kf, vf = k8[:, :, None], v8[:, :, None]
    skf = np.broadcast_to(sk, (b, hkv, nk, 1)).astype(f32)[:, :, None]
    c = f32(scale * _LOG2E)
    m = np.full((b, hkv, g, nq, 1), -np.inf, dtype=f32)
    l = np.zeros((b, hkv, g, nq, 1), dtype=f32)
    if sink_first is not None:
        m = np.broadcast_to((np.asarray(sink_first, dtype=f32) / f32(scale)).reshape(1, hkv, g, 1, 1),
                            m.shape).astype(f32)
        l = np.ones_like(l)
    acc = np.zeros((b, hkv, g, nq, d), dtype=f32)
    rows = np.arange(nq)[:, None]
    e4m3 = np.dtype(ml_dtypes.float8_e4m3fn)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for j0 in range(0, nk, block_n):
            j1 = min(nk, j0 + block_n)
            kt = np.swapaxes(kf[..., j0:j1, :], -1, -2)
            s_raw = matmul(qf, kt, None, "e4m3", "fp32", model).astype(f32)
            s = s_raw * (sqf * np.swapaxes(skf[..., j0:j1, :], -1, -2))
            s, _ = _hooked_scores(s, rows, j0, j1, nq, nk, scale, causal, (window, softcap, None, None))
            m_tile = s.max(axis=-1, keepdims=True)
            m_new = np.maximum(m, m_tile)
            if ablate == "max_subtraction":
                shift, alpha = f32(0), f32(1)
            elif ablate == "rescaling":
                shift, alpha = np.where(m_tile == -np.inf, f32(0), m_tile), f32(1)
            else:
                shift = np.where(m_new == -np.inf, f32(0), m_new)
                alpha = np.exp2(m * c - shift * c)
            pr = np.exp2(s * c - shift * c).astype(f32)
            l = alpha * l + pr.sum(axis=-1, keepdims=True, dtype=f32)
            p8 = np.clip(pr * f32(p_scale), -448, 448).astype(e4m3).astype(np.float64)
            if accumulation == "single":
                acc = matmul(p8, vf[..., j0:j1, :], alpha * acc, "e4m3", "fp32", model).astype(f32)
            else:
                acc = alpha * acc + matmul(p8, vf[..., j0:j1, :], None, "e4m3", "fp32", model).astype(f32)
            m = m_new
        empty = l == 0
        svf = np.broadcast_to(sv, (b, hkv, 1, 1)).astype(f32)[:, :, None]
        o = np.where(empty, f32(0), acc * (svf / (f32(p_scale) * np.where(empty, f32(1), l))))
        lse = np.log(l.astype(np.float64))
        if ablate != "max_subtraction":
            lse = m.astype(np.float64) * scale + lse
        lse = np.where(empty, -np.inf, lse)
    return o.reshape(b, hq, nq, d).astype(f32), lse.reshape(b, hq, nq).astype(f32)

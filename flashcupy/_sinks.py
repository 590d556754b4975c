"""Attention sinks (gpt-oss style), applied after the key loop: one place for their math, on NumPy (the twin)
and CuPy (after any kernel family's forward, before and after its backward).

A sink is a logit z_h per query head that joins each row's softmax denominator with no value row:

    P_ij = exp(s_ij - lse'_i),   lse'_i = log(exp(lse_i) + exp(z_h)),   o'_i = sum_j P_ij v_j,

with s the scaled scores and lse_i the LSE over the keys alone. So the sink rescales the keys' attention
(o_i, lse_i) by one weight per row, a merge of (o_i, lse_i) with a state of no value and LSE z_h:

    o'_i = w_i o_i,   w_i = exp(lse_i - lse'_i) = sigmoid(lse_i - z_h),
    lse'_i = max(lse_i, z_h) + log1p(exp(-|lse_i - z_h|))        (float32; lse_i = -inf gives z_h, w_i = 0).

Where the sink goes is a numerical choice. Started as the online softmax's first term (m = z, l = 1, as
reference implementations of gpt-oss do), a sink that dominates its row shrinks every P = exp(s - m) of the
key loop; in a 16-bit P those underflow ("P-collapse"). Merged after the loop, the keys' P keep their own
row max and o_i its full precision; only o'_i = w_i o_i is small, rounded once more to the output dtype.
The twin keeps the first-term order for the study of that collapse (``_twin.forward(sink_first=True)``).

Backward. With lse' saved, the kernels' backward needs nothing new: it recomputes P from lse', so the
sink's share of the denominator is already in every P, and dS = P (dP - delta) with delta_i = rowsum(dO_i
o'_i) (minus the LSE's gradient) holds as without a sink (o' has no sink term). The sink's gradient is

    d z_h = -sum_{b, i} P_sink,i delta_i,    P_sink,i = exp(z_h - lse'_i),

``grad`` below.
"""
from __future__ import annotations

import numpy as np

from .transforms import _xp


def check(sinks, heads_q: int, like) -> object:
    """The sink logits of a call on ``like``'s arrays, as a float32 (Hq,) array of the same kind: a NumPy
    array (checked finite here) or, for CuPy calls, a CuPy array on the same device (its values are not
    read: that would synchronize; a non-finite sink gives non-finite rows). ValueError/TypeError name
    ``sinks`` before any launch."""
    xp = _xp(like)
    if isinstance(sinks, (list, tuple)):
        sinks = np.asarray(sinks)
    try:
        on_host = _xp(sinks) is np
    except TypeError:
        raise TypeError(f"sinks must be a NumPy or CuPy array, got {type(sinks).__name__}") from None
    if sinks.shape != (heads_q,):
        raise ValueError(f"sinks must have shape (Hq,) = ({heads_q},); got {tuple(sinks.shape)}")
    if sinks.dtype.kind != "f":
        raise TypeError(f"sinks must be a float array, got {sinks.dtype}")
    if on_host:
        if not np.isfinite(sinks).all():
            raise ValueError("sinks must be finite")
        return xp.asarray(sinks, dtype=np.float32)
    if xp is np:
        raise TypeError("sinks is a CuPy array but q, k, v are NumPy arrays: pass NumPy sinks")
    if sinks.data.device_id != like.data.device_id:
        raise ValueError(f"sinks is on GPU {sinks.data.device_id} but q on GPU {like.data.device_id}")
    return sinks.astype(np.float32, copy=False)


# The CuPy kernels. 16-bit arrays travel as their uint16 bits; fc_load_bits/fc_store_bits convert (fp16
# by cvt, bf16 by a shift and cvt.rn.bf16.f32).
_PREAMBLE = r"""
__device__ __forceinline__ float fc_load_bits(unsigned short h, bool bf16) {
    if (bf16) return __uint_as_float(((unsigned)h) << 16);
    float x; asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(h)); return x;
}
__device__ __forceinline__ unsigned short fc_store_bits(float x, bool bf16) {
    unsigned short r;
    if (bf16) asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}
"""
# per row: lse' and w = exp(lse - lse') from the keys' lse and the sink z (lse = -inf: lse' = z, w = 0)
_ROW = r"""
    const float hi = fmaxf(lse, z);
    const float lse2 = hi + log1pf(expf(-fabsf(lse - z)));
    w = expf(lse - lse2);
    lse_out = lse2;
"""
# o <- w[row] o over C-contiguous o with rows of d (a multiple of 8): a thread per 16 bytes, all of one
# row (a thread per element is bound by load instructions: docs/design/score_variants.md, "Speed")
_SCALE = {
    "f32": r"""
    float4 *p = reinterpret_cast<float4 *>(&o[(size_t)i * 4]);
    const float s = w[(size_t)i * 4 / d];
    float4 x = *p;
    x.x *= s; x.y *= s; x.z *= s; x.w *= s;
    *p = x;
""",
    "16": r"""
    uint4 *p = reinterpret_cast<uint4 *>(&o[(size_t)i * 8]);
    const float s = w[(size_t)i * 8 / d];
    uint4 x = *p;
    unsigned *u = reinterpret_cast<unsigned *>(&x);
    for (int e = 0; e < 4; ++e) {
        const unsigned lo = fc_store_bits(fc_load_bits(u[e] & 0xFFFF, BF16) * s, BF16);
        const unsigned hi = fc_store_bits(fc_load_bits(u[e] >> 16, BF16) * s, BF16);
        u[e] = lo | (hi << 16);
    }
    *p = x;
"""}
# per row i of C-contiguous do, o (rows of d, 16-byte aligned, d a multiple of 8): the sink's share of
# d z, -exp(z - lse) (rowsum(dO o) - dlse), the row sum in float32 in order, 16 bytes per load
_GRAD_ROW = r"""
    const VEC *a = reinterpret_cast<const VEC *>(&dout[(size_t)i * d]);
    const VEC *b = reinterpret_cast<const VEC *>(&out[(size_t)i * d]);
    float acc = 0.f;
    for (int j = 0; j < d / PER_LOAD; ++j) {
        const VEC x = a[j], y = b[j];
        DOT
    }
    t = -expf(z - lse) * (acc - dl);
"""
# each 16-byte load's products, added to acc in order: (VEC, PER_LOAD, DOT) of float32 and 16-bit rows
_GRAD_LOADS = {
    "f32": ("float4", 4, "acc += x.x * y.x; acc += x.y * y.y; acc += x.z * y.z; acc += x.w * y.w;"),
    "16": ("uint4", 8, r"""const unsigned xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
        for (int e = 0; e < 4; ++e) {
            acc += fc_load_bits(xs[e] & 0xFFFF, BF16) * fc_load_bits(ys[e] & 0xFFFF, BF16);
            acc += fc_load_bits(xs[e] >> 16, BF16) * fc_load_bits(ys[e] >> 16, BF16);
        }"""),
}


def _grad_row(kind: str) -> str:
    """``_GRAD_ROW`` for float32 ("f32") or 16-bit ("16") rows."""
    vec, per_load, dot = _GRAD_LOADS[kind]
    return _GRAD_ROW.replace("PER_LOAD", str(per_load)).replace("VEC", vec).replace("DOT", dot)


_KERNELS: dict = {}


def _kernel(name: str):
    import cupy

    kern = _KERNELS.get(name)
    if kern is not None:
        return kern
    if name == "row":
        kern = cupy.ElementwiseKernel("float32 lse, float32 z", "float32 w, float32 lse_out", _ROW,
                                      "flashcupy_sink_row")
    elif name.startswith("scale_"):
        dname = name[6:]
        t = "float32" if dname == "f32" else "uint16"
        body = _SCALE["f32" if dname == "f32" else "16"].replace("BF16", str(dname == "bf16").lower())
        kern = cupy.ElementwiseKernel("raw float32 w, int64 d", f"raw {t} o", body,
                                      f"flashcupy_sink_{name}", preamble=_PREAMBLE)
    else:  # grad_<dname>
        dname = name[5:]
        t = "float32" if dname == "f32" else "uint16"
        body = _grad_row("f32" if dname == "f32" else "16").replace("BF16", str(dname == "bf16").lower())
        params = f"raw {t} dout, raw {t} out, float32 lse, float32 z, float32 dl, int32 d"
        kern = cupy.ElementwiseKernel(params, "float32 t", body, f"flashcupy_sink_{name}", preamble=_PREAMBLE)
    _KERNELS[name] = kern
    return kern


def apply(o, lse, sinks, scratch=None, packed: bool = False):
    """Merge the sinks into a forward's (o (B, Hq, N, D), lse (B, Hq, N) float32) in place and return
    them: o <- w o, lse <- lse' (module docstring). ``packed``: a packed forward's (o (total, Hq, D),
    lse (Hq, total), ``attention_varlen``'s). On CuPy arrays two kernels on the current stream: one
    per row (w into a temporary from ``scratch``, ``_launch._Scratch``'s interface, graph-safe under stream
    capture; one of the current stream by default; and lse'), one per element of o (packed: after w is
    copied into o's row order); o must be the call's own output (C-contiguous, 16-byte aligned)."""
    xp = _xp(o)
    if xp is np:
        f32 = np.float32
        z = sinks.astype(f32)[:, None] if packed else sinks.astype(f32)[None, :, None]
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            lse2 = np.maximum(lse, z) + np.log1p(np.exp(-np.abs(lse - z)))
            w = np.exp(lse - lse2)
        o[...] = (o.astype(f32) * (w.T if packed else w)[..., None]).astype(o.dtype)
        lse[...] = lse2
        return o, lse
    import cupy

    from ._checks import dtype_name
    from ._launch import _Scratch

    name = dtype_name(o.dtype)
    with cupy.cuda.Device(o.data.device_id):
        scratch = _Scratch(cupy.cuda.get_current_stream()) if scratch is None else scratch
        w = scratch.empty(lse.shape, np.float32)
        _kernel("row")(lse, sinks.reshape(-1, 1) if packed else sinks.reshape(1, -1, 1), w, lse)
        if packed:  # w per (head, token) into o's rows, per (token, head)
            rows = scratch.empty(w.shape[::-1], np.float32)
            cupy.copyto(rows, w.T)
            w = rows
        flat = o.reshape(-1) if name == "f32" else o.reshape(-1).view(np.uint16)
        per_thread = 4 if name == "f32" else 8  # 16 bytes
        _kernel("scale_" + name)(w, np.int64(o.shape[-1]), flat, size=flat.size // per_thread)
    return o, lse


def grad(do, o, lse, sinks, dlse=None, scratch=None, out=None):
    """d sinks (float32 (Hq,)) of a backward call: -sum over batch and rows of exp(z - lse') delta with
    delta_i = rowsum(dO_i o'_i) - dlse_i in float32 (``lse``, ``o``: the forward's, sinks merged).
    On CuPy arrays one kernel forms each row's term (a thread per row: it repeats the backward's own
    delta, one more read of dO and O) and a sum over batch and rows adds them, in a fixed order; the
    temporaries (the terms (B, Hq, N); copies of a dO or o that is not C-contiguous and 16-byte aligned)
    come from ``scratch`` (``_launch._Scratch``, graph-safe under stream capture; one of the current
    stream by default); ``out``: where d sinks goes on CuPy (a float32 (Hq,) array; a new one by
    default)."""
    xp = _xp(o)
    f32 = np.float32
    if xp is np:
        delta = (do.astype(f32) * o.astype(f32)).sum(axis=-1, dtype=f32)
        if dlse is not None:
            delta = delta - dlse.astype(f32)
        with np.errstate(over="ignore", invalid="ignore"):
            p_sink = np.exp(sinks.astype(f32)[None, :, None] - lse)
        return -(p_sink * delta).sum(axis=(0, 2), dtype=f32)
    import cupy

    from ._checks import dtype_name
    from ._launch import _copy, _Scratch

    name = dtype_name(do.dtype)
    with cupy.cuda.Device(o.data.device_id):
        scratch = _Scratch(cupy.cuda.get_current_stream()) if scratch is None else scratch
        do, o = (x if x.flags.c_contiguous and x.data.ptr % 16 == 0 else _copy(x, scratch) for x in (do, o))
        terms = scratch.empty(lse.shape, f32)
        if name != "f32":
            do, o = do.view(np.uint16), o.view(np.uint16)
        _kernel("grad_" + name)(do, o, lse, sinks.reshape(1, -1, 1), f32(0) if dlse is None else dlse,
                                np.int32(do.shape[-1]), terms)
        dz = cupy.empty(sinks.shape, f32) if out is None else out
        terms.sum(axis=(0, 2), out=dz)
    return dz

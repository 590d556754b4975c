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


_LOAD = {"f16": "float x; asm(\"cvt.f32.f16 %0, %1;\" : \"=f\"(x) : \"h\"(o));",
         "bf16": "const float x = __uint_as_float(((unsigned)o) << 16);",
         "f32": "const float x = o;"}
_STORE = {"f16": "unsigned short r; asm(\"cvt.rn.f16.f32 %0, %1;\" : \"=h\"(r) : \"f\"(x * w)); y = r;",
          "bf16": "unsigned short r; asm(\"cvt.rn.bf16.f32 %0, %1;\" : \"=h\"(r) : \"f\"(x * w)); y = r;",
          "f32": "y = x * w;"}
# lse' and w = exp(lse - lse') of a row from its keys' lse and the sink z (lse = -inf: lse' = z, w = 0)
_MERGE = """
    const float hi = fmaxf(lse, z);
    const float lse2 = hi + log1pf(expf(-fabsf(lse - z)));
    const float w = expf(lse - lse2);
"""
_KERNELS: dict = {}


def _kernel(name: str):
    import cupy

    kern = _KERNELS.get(name)
    if kern is not None:
        return kern
    if name == "lse":
        kern = cupy.ElementwiseKernel("float32 lse, float32 z", "float32 y", _MERGE + "y = lse2;",
                                      "flashcupy_sink_lse")
    elif name == "grad":
        kern = cupy.ReductionKernel("float32 lse, float32 z, float32 delta", "float32 dz",
                                    "-expf(z - lse) * delta", "a + b", "dz = a", "0", "flashcupy_sink_grad")
    else:
        t = "float32" if name == "f32" else "uint16"
        kern = cupy.ElementwiseKernel(f"{t} o, float32 lse, float32 z", f"{t} y",
                                      _MERGE + _LOAD[name] + _STORE[name], f"flashcupy_sink_o_{name}")
    _KERNELS[name] = kern
    return kern


def apply(o, lse, sinks):
    """Merge the sinks into a forward's (o (B, Hq, N, D), lse (B, Hq, N) float32) in place and return
    them: o <- w o, lse <- lse' (module docstring). On CuPy arrays two elementwise kernels on the current
    stream, no temporaries (a captured call stays capturable); o must be the call's own output."""
    xp = _xp(o)
    if xp is np:
        f32 = np.float32
        z = sinks.astype(f32)[None, :, None]
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            lse2 = np.maximum(lse, z) + np.log1p(np.exp(-np.abs(lse - z)))
            w = np.exp(lse - lse2)
        o[...] = (o.astype(f32) * w[..., None]).astype(o.dtype)
        lse[...] = lse2
        return o, lse
    import cupy

    from ._checks import dtype_name

    name = dtype_name(o.dtype)
    z = sinks.reshape(1, -1, 1)
    view = o if name == "f32" else o.view(np.uint16)
    with cupy.cuda.Device(o.data.device_id):
        _kernel(name)(view, lse[..., None], z[..., None], view)
        _kernel("lse")(lse, z, lse)
    return o, lse


def grad(do, o, lse, sinks, dlse=None, scratch=None):
    """d sinks (float32 (Hq,)) of a backward call: -sum over batch and rows of exp(z - lse') delta with
    delta_i = rowsum(dO_i o'_i) - dlse_i in float32 (``lse``, ``o``: the forward's, sinks merged).
    On CuPy arrays the temporary delta (B, Hq, N) comes from ``scratch`` (``_launch._Scratch``, graph-safe
    under stream capture; one of the current stream by default); it repeats the backward's own delta
    (one more read of dO and O)."""
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
    from ._launch import _Scratch

    name = dtype_name(do.dtype)
    with cupy.cuda.Device(o.data.device_id):
        scratch = _Scratch(cupy.cuda.get_current_stream()) if scratch is None else scratch
        delta = scratch.empty(lse.shape, f32)
        if name != "f32":
            do, o = do.view(np.uint16), o.view(np.uint16)
        _delta_kernel(name)(do, o, delta, axis=3)
        if dlse is not None:
            cupy.subtract(delta, dlse, out=delta)
        dz = cupy.empty(sinks.shape, f32)
        _kernel("grad")(lse, sinks.reshape(1, -1, 1), delta, dz, axis=(0, 2))
    return dz


def _delta_kernel(dname: str):
    """rowsum(dO * O) in float32 over the last axis, for 16-bit (as uint16 bits) or float32 inputs."""
    import cupy

    name = "delta_" + dname
    kern = _KERNELS.get(name)
    if kern is None:
        t = "float32" if name == "delta_f32" else "uint16"
        load = {"delta_f32": "(float)a * (float)b",
                "delta_bf16": "__uint_as_float(((unsigned)a) << 16) * __uint_as_float(((unsigned)b) << 16)",
                "delta_f16": "fc_h2f(a) * fc_h2f(b)"}[name]
        pre = ("__device__ float fc_h2f(unsigned short h) { float x; "
               "asm(\"cvt.f32.f16 %0, %1;\" : \"=f\"(x) : \"h\"(h)); return x; }")
        kern = _KERNELS[name] = cupy.ReductionKernel(f"{t} a, {t} b", "float32 delta", load, "a + b",
                                                     "delta = a", "0", f"flashcupy_sink_{name}",
                                                     preamble=pre)
    return kern

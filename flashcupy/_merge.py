"""``merge_states``: the attention over a union of disjoint key sets from the attentions over each set.

Split-KV decoding, ring attention and users' own pipelines each compute attention over part of the keys
and combine. With o_s and lse_s the output and log-sum-exp of part s (natural log, -inf for a part that
saw no key), the whole's are

    lse = log sum_s exp(lse_s),     o = sum_s exp(lse_s - lse) o_s,

a softmax over the parts' LSEs used as weights. Two ways to compute it, both in float32:

* ``form="exp"`` (one pass, FlashAttention's split-KV combine): m = max_s lse_s, w_s = exp(lse_s - m),
  lse = m + log(sum_s w_s), o = sum_s w_s o_s / sum_s w_s.
* ``form="logsigmoid"`` (a pairwise fold over the parts in order, the form torch's context parallelism
  uses): merging (o, lse) with (o_s, lse_s) gives o - sigmoid(lse_s - lse) (o - o_s) and
  lse - logsigmoid(lse - lse_s), i.e. the new part's weight sigmoid(lse_s - lse) = e^lse_s / (e^lse +
  e^lse_s) and log(e^lse + e^lse_s).

``ablate="max_subtraction"`` removes the max from the one-pass form (w_s = exp(lse_s)): it overflows once
an LSE passes ln(float32 max) = 88.72, as the kernels' own break does for scores.
``ablate="stable_softplus"`` removes the stable softplus from the pairwise fold: lse + log(1 + exp(lse_s -
lse)), the update of an early ring-flash-attention (which also weighted o by exp(lse - new_lse)). It
overflows once a part's LSE exceeds the running one by more than 88.72: the running LSE becomes inf, the
output still takes the new part's weight (the sigmoid does not overflow), so the forward's o can look
right while every later part is dropped and a backward that recomputes P from that LSE gets P = 0.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .transforms import _xp

if TYPE_CHECKING:
    from ._types import Array

FORMS = ("exp", "logsigmoid")
_OUT_DTYPES = ("float16", "bfloat16", "float32")



def merge_states(o_parts: Array, lse_parts: Array, *, out_dtype: str | None = None, form: str = "exp",
                 state_dtype: str = "float32", ablate: str | None = None) -> tuple[Array, Array]:
    """Merge S partial attention states over disjoint key sets into the state over their union.

    Parameters
    ----------
    o_parts : (S, B, H, N, D) float16, bfloat16 or float32, NumPy or CuPy: part s's output (0 for a
        query row that saw none of its keys).
    lse_parts : (S, B, H, N) float32 (or float64), the same array kind: part s's log-sum-exp (natural log;
        -inf where the row saw none of its keys), as ``flashcupy.attention(..., return_lse=True)``
        returns it.
    out_dtype : the output's dtype name ("float16", "bfloat16", "float32"); default o_parts' dtype.
    form : "exp" or "logsigmoid" (module docstring); both compute in float32.
    state_dtype : "float32" (default), "bfloat16" or "float16": the dtype the merged output is held in
        while the parts are added one by one, rounded after each (the weights stay float32): a merge
        whose running output lives in the inputs' dtype, as in ring implementations that accumulate
        their output in bf16. "float32" is the one-pass float32 sum.
    ablate : None, "max_subtraction" (form "exp" only): the weights exp(lse_s) without the max, or
        "stable_softplus" (form "logsigmoid" only): the LSE update log(1 + exp(d)) without its stable form.

    Returns (o (B, H, N, D) in ``out_dtype``, lse (B, H, N) float32). A row that no part saw gets o = 0
    and lse = -inf. The math and the two forms: ``flashcupy._merge``.
    """
    xp = _xp(o_parts)
    if _xp(lse_parts) is not xp:
        raise TypeError("o_parts and lse_parts must both be NumPy arrays or both CuPy arrays")
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if ablate not in (None, "max_subtraction", "stable_softplus"):
        raise ValueError(f"ablate must be None, 'max_subtraction' or 'stable_softplus', got {ablate!r}")
    if ablate == "max_subtraction" and form != "exp":
        raise ValueError("ablate='max_subtraction' breaks the one-pass form: use form='exp'")
    if ablate == "stable_softplus" and form != "logsigmoid":
        raise ValueError("ablate='stable_softplus' breaks the pairwise fold: use form='logsigmoid'")
    if xp is not np and lse_parts.data.device_id != o_parts.data.device_id:
        raise ValueError(f"lse_parts is on GPU {lse_parts.data.device_id} but o_parts on GPU "
                         f"{o_parts.data.device_id}")
    if o_parts.ndim != 5 or lse_parts.shape != o_parts.shape[:4] or o_parts.shape[0] < 1:
        raise ValueError(f"o_parts must be (S, B, H, N, D) with S >= 1 and lse_parts (S, B, H, N); got "
                         f"{tuple(o_parts.shape)} and {tuple(lse_parts.shape)}")
    from ._checks import dtype_name, numpy_dtype

    dname = dtype_name(o_parts.dtype)
    if dname is None:
        raise TypeError(f"o_parts must be float16, bfloat16 or float32, got {o_parts.dtype}")
    if lse_parts.dtype not in (np.float32, np.float64):
        raise TypeError(f"lse_parts must be float32 or float64, got {lse_parts.dtype}")
    if state_dtype not in _OUT_DTYPES:
        raise ValueError(f"state_dtype must be one of {_OUT_DTYPES}, got {state_dtype!r}")
    names = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
    state = None if state_dtype == "float32" else numpy_dtype(names[state_dtype])
    if out_dtype is None:
        out = numpy_dtype(dname)
    elif out_dtype in _OUT_DTYPES:
        out = numpy_dtype(names[out_dtype])
    else:
        raise ValueError(f"out_dtype must be None or one of {_OUT_DTYPES}, got {out_dtype!r}")

    f32 = xp.float32
    if xp is not np and form == "exp" and ablate is None and state is None and o_parts.size:
        return _merge_exp_cupy(o_parts, lse_parts.astype(f32, copy=False), out)
    o = o_parts.astype(f32)
    lse = lse_parts.astype(f32)
    if form == "exp":
        if ablate is None:
            m = lse.max(axis=0)
            m = xp.where(xp.isneginf(m), f32(0), m)  # no part saw the row: every weight is exp(-inf) = 0
        else:
            m = xp.zeros(lse.shape[1:], dtype=f32)  # REMOVED: the max subtraction
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            w = xp.exp(lse - m)
            total = w.sum(axis=0)
            if state is None:
                merged = (w[..., None] * o).sum(axis=0) / xp.where(total == 0, f32(1), total)[..., None]
            else:  # the parts added one by one into a running output held in state_dtype
                w = w / xp.where(total == 0, f32(1), total)
                merged = xp.zeros(o.shape[1:], dtype=f32)
                for s in range(o.shape[0]):
                    merged = (merged + w[s][..., None] * o[s]).astype(state).astype(f32)
            lse_out = xp.where(total == 0, f32(-np.inf), m + xp.log(total))
        return merged.astype(out), lse_out.astype(f32)
    acc_o, acc_lse = o[0], lse[0]
    if state is not None:
        acc_o = acc_o.astype(state).astype(f32)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for s in range(1, o.shape[0]):
            o_s, lse_s = o[s], lse[s]
            # (a side at -inf takes no weight; both at -inf stay at -inf with o = 0)
            both_empty = xp.isneginf(acc_lse) & xp.isneginf(lse_s)
            d = xp.where(both_empty, f32(0), lse_s - acc_lse)                  # +inf where acc is empty
            weight = f32(1) / (f32(1) + xp.exp(-d))                             # sigmoid(lse_s - lse)
            acc_o = acc_o - weight[..., None] * (acc_o - o_s)
            if state is not None:
                acc_o = acc_o.astype(state).astype(f32)
            if ablate is None:
                softplus = xp.where(d > 0, d + xp.log1p(xp.exp(-d)), xp.log1p(xp.exp(d)))  # -logsigmoid(-d)
            else:  # REMOVED: the stable form (exp(d) overflows past 88.72)
                softplus = xp.log(f32(1) + xp.exp(d))
            acc_lse = xp.where(xp.isneginf(acc_lse), lse_s,
                               xp.where(xp.isneginf(lse_s), acc_lse, acc_lse + softplus))
    return acc_o.astype(out), acc_lse.astype(f32)


# The one-pass merge on CuPy arrays as one kernel (the array expression above is ~20 launches and their
# host time, more than a decoding step's attention). A CTA per row (b, h, n), a thread per d (256 columns
# at a time): the row's
# S LSEs staged in shared memory (FC_MERGE_CHUNK at a time), then each thread adds its column over the
# parts in order s = 0 .. S - 1 with the same float32 arithmetic as above, eight parts' loads in flight
# (a thread per element walking the parts one load at a time waited on each: 27 us for S = 33, 32 rows
# of 128 on an H200, docs/design/merge.md). The parts are read through their strides (elements); 16-bit
# arrays travel as their uint16 bits; o and lse are written C-contiguous.
_MERGE_SOURCE = r"""
#define FC_NEG_INF __int_as_float(0xff800000)
#define FC_MERGE_CHUNK 2048
extern "C" __global__ void flashcupy_merge_exp(
        const FC_MERGE_IN *__restrict__ op, const float *__restrict__ lp, FC_MERGE_OUT *__restrict__ o,
        float *__restrict__ lse, const int S, const int D, const long long H, const long long N,
        const long long os, const long long ob, const long long oh, const long long on,
        const long long od, const long long ls, const long long lb, const long long lh,
        const long long ln) {
    __shared__ float part_lse[FC_MERGE_CHUNK];
    const long long r = blockIdx.x, n = r % N, h = (r / N) % H, b = r / (N * H);
    const float *lrow = lp + b * lb + h * lh + n * ln;
    const bool staged = S <= FC_MERGE_CHUNK;  // (all S LSEs stay in shared memory between the passes)
    float m = FC_NEG_INF;
    for (int c0 = 0; c0 < S; c0 += FC_MERGE_CHUNK) {
        const int cn = min(FC_MERGE_CHUNK, S - c0);
        __syncthreads();
        for (int s = threadIdx.x; s < cn; s += blockDim.x) part_lse[s] = lrow[(c0 + s) * ls];
        __syncthreads();
        for (int s = 0; s < cn; ++s) m = fmaxf(m, part_lse[s]);
    }
    if (m == FC_NEG_INF) m = 0.f;  // no part saw the row: every weight is exp(-inf) = 0
    for (int d0 = 0; d0 < D; d0 += blockDim.x) {
        // (threads past D load column D - 1 and store nothing: every thread reaches each barrier)
        const int d = min(d0 + (int)threadIdx.x, D - 1);
        const FC_MERGE_IN *col = op + b * ob + h * oh + n * on + d * od;
        float total = 0.f, acc = 0.f;
        for (int c0 = 0; c0 < S; c0 += FC_MERGE_CHUNK) {
            const int cn = min(FC_MERGE_CHUNK, S - c0);
            if (!staged) {
                __syncthreads();
                for (int s = threadIdx.x; s < cn; s += blockDim.x) part_lse[s] = lrow[(c0 + s) * ls];
                __syncthreads();
            }
#pragma unroll 8
            for (int s = 0; s < cn; ++s) {
                const float w = expf(part_lse[s] - m);
                total += w;
                acc += w * FC_MERGE_LOAD(col[(c0 + s) * os]);
            }
        }
        if (d0 + threadIdx.x < D)
            o[r * D + d0 + threadIdx.x] = FC_MERGE_STORE(acc / (total == 0.f ? 1.f : total));
        if (d0 == 0 && threadIdx.x == 0) lse[r] = total == 0.f ? FC_NEG_INF : m + logf(total);
    }
}
"""
_MERGE_KERNELS: dict = {}   # (source dtype, output dtype) -> cupy.RawKernel
_MERGE_LAUNCHES: dict = {}  # (dtypes, shapes, strides) -> its launcher (_launch.small_launcher)


def _merge_exp_cupy(o_parts, lse_parts, out):
    """``merge_states(form="exp")`` with a float32 state on CuPy arrays: one launch on the current stream
    of o_parts' GPU (through the driver, its strides and sizes written once per layout). Returns (o
    (B, H, N, D) in ``out``, lse (B, H, N) float32), both C-contiguous."""
    import cupy

    from ._checks import dtype_name
    from ._launch import PTR, small_launcher

    src, dst = dtype_name(o_parts.dtype), dtype_name(out)
    s, b, h, n, d = o_parts.shape
    with cupy.cuda.Device(o_parts.data.device_id):
        o = cupy.empty((b, h, n, d), dtype=out)
        lse = cupy.empty((b, h, n), dtype=np.float32)
        if not o.size:
            return o, lse
        kern = _MERGE_KERNELS.get((src, dst))
        if kern is None:
            from ._sinks import _PREAMBLE

            types = {"f32": "float", "f16": "unsigned short", "bf16": "unsigned short"}
            bf16 = {"f16": "false", "bf16": "true"}
            load = "(h)" if src == "f32" else f"fc_load_bits(h, {bf16[src]})"
            store = "(x)" if dst == "f32" else f"fc_store_bits(x, {bf16[dst]})"
            macros = (f"#define FC_MERGE_IN {types[src]}\n#define FC_MERGE_OUT {types[dst]}\n"
                      f"#define FC_MERGE_LOAD(h) {load}\n#define FC_MERGE_STORE(x) {store}\n")
            kern = _MERGE_KERNELS[(src, dst)] = cupy.RawKernel(_PREAMBLE + macros + _MERGE_SOURCE,
                                                               "flashcupy_merge_exp")
        key = (src, dst, o_parts.shape, o_parts.strides, lse_parts.strides)
        launch = _MERGE_LAUNCHES.get((key, cupy.cuda.runtime.getDevice()))
        if launch is None:
            ostr = [x // o_parts.itemsize for x in o_parts.strides]
            lstr = [x // 4 for x in lse_parts.strides]
            layout = (PTR,) * 4 + (np.int32(s), np.int32(d), np.int64(h), np.int64(n),
                                   *(np.int64(x) for x in ostr + lstr))
            launch = small_launcher(kern, (b * h * n,), min(256, -(-d // 32) * 32), layout, _MERGE_LAUNCHES,
                                    key)
        launch(cupy.cuda.get_current_stream().ptr, (o_parts.data.ptr, lse_parts.data.ptr, o.data.ptr,
                                                    lse.data.ptr))
    return o, lse

"""fp8 quantization of attention inputs (issue 13's first step): scales, rounding and the round trip.

``quantize(x, fmt, granularity)`` returns x's fp8 data and the float32 scales that undo it:

    s = amax(|x| over a group) / FMAX,        x_q = fp8(x / s),        x ~ x_q * s,

with FMAX the largest finite value of the format (e4m3: 448, e5m2: 57344), so every group's largest
value lands on FMAX and nothing overflows. A group is the whole tensor (``"tensor"``), one (b, h) head
(``"head"``), ``block`` consecutive tokens of one head (``"block"``, FlashAttention-3's block
quantization) or one token (``"token"``, a row of D values). A group of zeros gets scale 1.

Rounding: x / s is computed in float32 and rounded to nearest, ties to even, into the format (the
conversion of ``ml_dtypes``, the same rule as the hardware's ``cvt.rn.satfinite`` on values inside the
range); e4m3 keeps 3 mantissa bits, so a normal value is off by at most 2^-4 of itself and a subnormal
one by at most 2^-10 (half of e4m3's smallest subnormal, 2^-9) in units of s.

Storage: NumPy arrays come back as ``ml_dtypes.float8_e4m3fn`` / ``float8_e5m2`` arrays; CuPy arrays as
uint8 arrays of the same bit patterns (what a kernel reads and TMA moves as bytes). On a GPU of compute
capability 8.9 or more a CuPy array is quantized there (the group maxima by CuPy reductions, x / s by an
IEEE float32 division and the rounding by ``cvt.rn.satfinite``, the same bits as ``ml_dtypes``: the GPU
tests compare them, ties included); on older GPUs, and for inputs holding a nonzero value below
fmax * 2^-126 (which CuPy's flush-to-zero arithmetic would zero), through NumPy on the host.
``dequantize`` gives float32 back.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from .transforms import _xp

if TYPE_CHECKING:
    from ._types import Array

__all__ = ["ACCUMULATIONS", "FORMATS", "GRANULARITIES", "Quantized", "attention_fp8", "dequantize",
           "expand_scale", "quantize"]

FORMATS = {"e4m3": ("float8_e4m3fn", 448.0), "e5m2": ("float8_e5m2", 57344.0)}
GRANULARITIES = ("tensor", "head", "block", "token")
ACCUMULATIONS = ("single", "tile", "exact")
FP8_HEAD_DIMS = (64, 128, 256)
FP8_BLOCK_N = (64, 128)
OUT_DTYPES = ("float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Quantized:
    """fp8 data with the float32 scales that undo it: x ~ data * scale (``scale`` broadcast over D and,
    for "block", repeated over the ``block`` tokens of each group)."""

    data: object           # (B, H, N, D): ml_dtypes fp8 (NumPy) or uint8 bit patterns (CuPy)
    scale: object          # float32, (1, 1, 1, 1) | (B, H, 1, 1) | (B, H, ceil(N / block), 1) | (B, H, N, 1)
    fmt: str
    granularity: str
    block: int | None = None
    # the largest scale (a Python float), read when the object is made: attention_fp8 checks its range
    scale_max: float = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        # Checked once, here, not on every attention_fp8 call: on CuPy scales the check reads the device
        # (a synchronization), which cost the fp8 kernel path 6.5x its time at N=1024 when made per call
        # (measured on the H200). One read brings both the check and the largest scale.
        # Read from the bits: positive finite float32 values are the int32 patterns in (0, 0x7F800000)
        # (a float comparison on the GPU would flush a subnormal scale to 0 under CuPy's -ftz), and the
        # largest of them is the largest pattern.
        scale = self.scale
        bits = scale.view(np.int32) if getattr(scale, "dtype", None) == np.float32 else None
        if bits is None or bits.size == 0:
            ok, top = False, 0
        else:
            xp = _xp(scale)
            both = xp.stack([xp.all((bits > 0) & (bits < 0x7F800000)).astype(np.int32), bits.max()])
            ok, top = (int(x) for x in (both if xp is np else both.get()))
        if not ok:
            got = getattr(scale, "dtype", type(scale).__name__)
            raise ValueError("scale must be a float32 array of positive, finite values (amax / fmax per "
                             "group, 1 for an all-zero group: the kernel scales each row's maximum by it, "
                             f"which needs a positive factor); got {got}")
        object.__setattr__(self, "scale_max", float(np.array(top, dtype=np.int32).view(np.float32)))

    @property
    def shape(self) -> tuple:
        return tuple(self.data.shape)


def _fp8_dtype(fmt: str):
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, FORMATS[fmt][0]))


def _check(x, fmt, granularity, block):
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {tuple(FORMATS)}, got {fmt!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity == "block":
        if isinstance(block, (bool, np.bool_)) or not isinstance(block, (int, np.integer)) or block < 1:
            raise ValueError("granularity='block' needs block, a positive int (tokens per group); "
                             f"got {block!r}")
    elif block is not None:
        raise ValueError(f"block is only for granularity='block'; got block={block!r} with {granularity!r}")
    if getattr(x, "ndim", None) != 4:
        raise ValueError(f"x must be a 4-D (B, H, N, D) array; got shape {getattr(x, 'shape', None)}")
    if min(x.shape) < 1:
        raise ValueError(f"x must have every extent >= 1 (each group needs a value); got shape {x.shape}")
    if np.dtype(x.dtype).kind != "f" and np.dtype(x.dtype).name != "bfloat16":
        raise TypeError(f"x must be a floating-point array; got {x.dtype}")


# What quantize takes: the scales are float32, so a group's largest magnitude must fit float32 and
# leave a positive scale amax / fmax (float32's smallest subnormal is 2^-149).
_F32_MAX = float(np.finfo(np.float32).max)


def _check_range(x, fmt: str, granularity: str, block: int | None) -> None:
    """ValueError unless a float64 (or wider) x is finite and fits what float32 scales carry: every value
    at most float32's largest, and every group's largest magnitude 0 or at least fmax * 2^-149 (below it
    the group's float32 scale amax / fmax would be 0 and the group would quantize to zeros silently).
    float32 and narrower inputs fit float32 by their type; a float32 group below that bound is refused
    when its scale (0) is checked (``Quantized``). (A value far below its group's maximum rounds to
    fp8's zero as any value below half its smallest subnormal does.)"""
    if np.dtype(x.dtype).itemsize <= 4:
        return
    xp = _xp(x)
    ax = xp.abs(x)
    fmax = FORMATS[fmt][1]
    tiny = fmax * 2.0 ** -149
    amax = _group_amax(ax, granularity, block)
    bad = xp.stack([~xp.isfinite(ax).all(), (amax > _F32_MAX).any(), ((amax > 0) & (amax < tiny)).any()])
    nonfinite, big, small = (bool(b) for b in (bad if xp is np else bad.get()))
    if nonfinite:
        raise ValueError("x holds inf or NaN; fp8 scales cannot represent them")
    if big or small:
        raise ValueError("quantize takes groups whose largest magnitude is 0 or in "
                         f"[{tiny:.3g}, {_F32_MAX:.4g}] ({fmt}'s largest value times float32's smallest "
                         "subnormal, and float32's largest value): its scales are float32; x holds "
                         + ("a larger value" if big else "a group whose largest magnitude is smaller"))


def _group_amax(x, granularity: str, block: int | None):
    """max |x| per group, keepdims (NumPy or CuPy, x's own)."""
    xp = _xp(x)
    ax = xp.abs(x)
    if granularity == "tensor":
        return ax.max(axis=(0, 1, 2, 3), keepdims=True)
    if granularity == "head":
        return ax.max(axis=(2, 3), keepdims=True)
    if granularity == "token":
        return ax.max(axis=3, keepdims=True)
    b, h, n, _ = x.shape
    groups = -(-n // block)
    padded = xp.zeros((b, h, groups * block), dtype=ax.dtype)
    padded[:, :, :n] = ax.max(axis=3)
    return padded.reshape(b, h, groups, block).max(axis=3, keepdims=True)


_CVT = {"e4m3": "e4m3x2", "e5m2": "e5m2x2"}


def _gpu_rounding(x) -> bool:
    """Whether the GPU holding CuPy array x rounds to fp8 itself (cvt to e4m3 / e5m2: sm_89 and later)."""
    from ._checks import _capability_of

    return _capability_of(x.data.device_id) >= 89


def _round_kernel(fmt: str):
    """y = the fp8 bits of clip(x / s, -fmax, fmax), rounded to nearest even (an elementwise CuPy kernel;
    cvt's second source goes to the low byte)."""
    import cupy

    return cupy.ElementwiseKernel(
        "float32 x, float32 s, float32 fmax", "uint8 y",
        f"""
        const float v = fminf(fmaxf(__fdiv_rn(x, s), -fmax), fmax);
        unsigned short h;
        asm("cvt.rn.satfinite.{_CVT[fmt]}.f32 %0, %1, %2;" : "=h"(h) : "f"(0.f), "f"(v));
        y = (unsigned char)(h & 0xFF);
        """, f"flashcupy_quantize_{fmt}")


_ROUND_KERNELS: dict = {}


def expand_scale(q: Quantized) -> object:
    """The scale broadcastable against the data (B, H, N, 1) or smaller: "block" scales repeated over
    their tokens (and cut at N)."""
    if q.granularity != "block":
        return q.scale
    xp = _xp(q.scale)
    return xp.repeat(q.scale, q.block, axis=2)[:, :, :q.shape[2]]


def quantize(x: Array, fmt: str = "e4m3", granularity: str = "tensor", block: int | None = None) -> Quantized:
    """Quantize a (B, H, N, D) array to fp8 with one float32 scale per group (see the module docstring
    for the math, the groups and the rounding). Raises ValueError/TypeError for an unknown format or
    granularity, a missing or stray ``block``, a non-4-D, empty or non-float array, and ValueError when x
    holds inf or NaN (no scale can represent them) or, for float64 inputs, a magnitude outside what a
    float32 scale can carry: a value above float32's largest, or a group whose largest magnitude is
    nonzero but below fmax * 2^-149 (e4m3: 6.3e-43). x / s is computed in float32."""
    _check(x, fmt, granularity, block)
    _check_range(x, fmt, granularity, block)
    xp = _xp(x)
    if xp is not np and _gpu_rounding(x):
        out = _quantize_on_gpu(x, fmt, granularity, block)
        if out is not None:
            return out
    host = np.asarray(x.get() if xp is not np else x).astype(np.float32)
    if not np.isfinite(host).all():
        raise ValueError("x holds inf or NaN; fp8 scales cannot represent them")
    fmax = np.float32(FORMATS[fmt][1])
    amax = _group_amax(host, granularity, block)
    scale = np.where(amax > 0, amax / fmax, np.float32(1)).astype(np.float32)
    full = np.repeat(scale, block, axis=2)[:, :, :host.shape[2]] if granularity == "block" else scale
    y = np.clip(host / full, -fmax, fmax).astype(_fp8_dtype(fmt))
    if xp is np:
        return Quantized(y, scale, fmt, granularity, block)
    return Quantized(xp.asarray(y.view(np.uint8)), xp.asarray(scale), fmt, granularity, block)


def _has_tiny_values(x, fmt: str) -> bool:
    """Whether CuPy array x holds a nonzero value below fmax * 2^-126 in magnitude: the GPU path would flush
    it (or its group's scale amax / fmax) to zero, as CuPy compiles with -ftz. Read from the bits (a
    comparison of floats would flush subnormals too); float16 holds no such value."""
    import cupy

    tiny = np.float64(FORMATS[fmt][1]) * 2.0 ** -126
    for width, uint in ((4, np.uint32), (8, np.uint64)):
        if x.dtype.kind == "f" and x.dtype.itemsize == width:
            sign_off = uint(np.iinfo(uint).max >> 1)
            bits = cupy.bitwise_and(x.view(uint), sign_off)
            limit = np.array(tiny, dtype=x.dtype).view(uint)
            return bool(((bits > 0) & (bits < limit)).any())
    return False


def _quantize_on_gpu(x, fmt, granularity, block) -> Quantized | None:
    """quantize() of a CuPy array on its own GPU: the host path's arithmetic, step for step. None when x
    holds values the GPU's flush-to-zero arithmetic would round differently (the caller takes the host
    path)."""
    import cupy

    with cupy.cuda.Device(x.data.device_id):
        if _has_tiny_values(x, fmt):
            return None
        xf = x.astype(cupy.float32)
        if not bool(cupy.isfinite(xf).all()):
            raise ValueError("x holds inf or NaN; fp8 scales cannot represent them")
        fmax = np.float32(FORMATS[fmt][1])
        amax = _group_amax(xf, granularity, block)
        scale = cupy.where(amax > 0, amax / fmax, cupy.float32(1)).astype(cupy.float32)
        full = cupy.repeat(scale, block, axis=2)[:, :, :x.shape[2]] if granularity == "block" else scale
        kern = _ROUND_KERNELS.get(fmt)
        if kern is None:
            kern = _ROUND_KERNELS[fmt] = _round_kernel(fmt)
        data = kern(xf, full, fmax)
    return Quantized(data, scale, fmt, granularity, block)


def dequantize(q: Quantized) -> Array:
    """float32 data * scale, on the data's side (NumPy or CuPy)."""
    xp = _xp(q.data)
    if xp is np:
        values = q.data.astype(np.float32)
    else:
        values = xp.asarray(xp.asnumpy(q.data).view(_fp8_dtype(q.fmt)).astype(np.float32))
    return values * expand_scale(q)



def _check_scale(name: str, x: Quantized) -> None:
    """x's scale is what its granularity says (the kernel picks its descale reads from the label; its
    values were checked when x was made: Quantized.__post_init__); x's data is fp8 on the host (uint8 bit
    patterns would be read as the numbers 0..255)."""
    b, h, n, _ = x.shape
    want = {"tensor": (1, 1, 1, 1), "head": (b, h, 1, 1), "token": (b, h, n, 1),
            "block": (b, h, -(-n // x.block), 1) if x.block else None}.get(x.granularity)
    if want is None or tuple(x.scale.shape) != want:
        raise ValueError(f"{name}.scale must have shape {want} for granularity {x.granularity!r} "
                         f"(block={x.block}), got {tuple(x.scale.shape)}")
    if _xp(x.data) is np and x.data.dtype != _fp8_dtype(x.fmt):
        raise TypeError(f"{name}.data on the host must be {_fp8_dtype(x.fmt)} values, got {x.data.dtype} "
                        "(uint8 bit patterns are for CuPy arrays)")


def _check_magnitudes(q: Quantized, k: Quantized, v: Quantized, scale: float, d: int, out_dtype: str) -> None:
    """ValueError when the inputs' magnitudes leave what the fp8 forward computes in float32: the scores
    S = (Q8 K8^T) sq sk scale log2(e), at most 448^2 D max(sq) max(sk) scale log2(e), must stay finite
    (the twin and the kernel hold them in float32), and o, at most 448 max(sv), must fit ``out_dtype``.
    Tiny magnitudes need no check: the kernel keeps its folded descale at least FLT_MIN (fwd_wgmma.cu;
    where it descales element by element instead, per key or with a softcap, a flushed descale gives
    S = 0 before the mask, never -inf times 0), and scores that small give P = 1, as the true ones do."""
    f32_max = _F32_MAX
    score_max = 448.0 ** 2 * d * q.scale_max * k.scale_max * scale / np.log(2.0)
    if not score_max < f32_max:
        raise ValueError(f"q's and k's magnitudes are too large for float32 scores: 448^2 * D * max(q.scale) "
                         f"* max(k.scale) * scale * log2(e) = {score_max:.3g} exceeds {f32_max:.4g} (for "
                         f"D={d} and this scale, max|q| * max|k| must stay below "
                         f"{f32_max / (d * scale / np.log(2.0)):.3g})")
    out_max = float(np.finfo(np.float16).max) if out_dtype == "float16" else f32_max
    if not 448.0 * v.scale_max <= out_max:
        raise ValueError(f"v's magnitude ({448.0 * v.scale_max:.3g}) exceeds the largest {out_dtype} "
                         f"({out_max:.4g}): the output would overflow; use out_dtype='bfloat16'")


def attention_fp8(q: Quantized, k: Quantized, v: Quantized, *, causal: bool = False,
                  scale: float | None = None, block_n: int = 128, p_scale: float = 256.0,
                  accumulation: str = "single", out_dtype: str = "float16", return_lse: bool = False,
                  block_m: int | None = None, ablate: str | None = None,
                  window_size: tuple[int, int] = (-1, -1), sinks: Array | None = None,
                  softcap: float = 0.0) -> Array | tuple[Array, Array]:
    """Attention on e4m3 inputs, FlashAttention-3's fp8 forward: ``o = softmax(scale * q k^T) v`` with
    q = q.data * q.scale and so on (the outputs of ``quantize``), o in ``out_dtype``.

    The products Q K^T and P V run on e4m3 values; the scales are folded in: S = (Q8 K8^T) * (sq sk) per
    row and column, P (in [0, 1] after the running max is subtracted) is multiplied by the static
    ``p_scale`` and rounded to e4m3 before P V (FlashAttention-3 keeps P in [0, 256]), and the output is
    O * sv / (p_scale l). The tensor core's fp8 accumulator keeps 14 significant bits, truncated
    (measured on the H200: reports/tensorcore.md), so how O is accumulated matters:

    * ``accumulation="single"``: the tensor core's accumulator carries O across all key tiles (rescaled
      in place by the online softmax), every k32 step truncating the running sum to 14 bits;
    * ``accumulation="tile"``: two-level: each tile of ``block_n`` keys (64 or 128) is accumulated in a
      fresh accumulator and added to an fp32 O by an ordinary fp32 add (DeepSeek-V3's promotion every
      128 elements; SageAttention2's every 64 keys);
    * ``accumulation="exact"`` (the twin only, no kernel does it): every k32 step summed exactly and
      rounded to fp32, what an fp32 accumulator would give; the difference to it isolates the
      accumulation's error from the quantization's.

    The full algorithm and rounding model: ``flashcupy._twin.forward_fp8``.

    ``ablate`` breaks the algorithm as in ``flashcupy.attention``: "max_subtraction" or "rescaling" (P may
    then exceed 1: P * p_scale saturates at e4m3's 448).

    Parameters: q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) ``Quantized`` e4m3 (Hq % Hkv == 0; D 64, 128 or
    256); q and k at any granularity, v at "tensor" or "head" (its scale must be constant over keys, the
    reduction axis of P V); ``causal`` bottom-right aligned, ``window_size``, ``softcap`` and ``sinks`` as
    in ``flashcupy.attention`` (the softcap c tanh(S / c) on the descaled scaled scores S before the mask,
    the kernel descaling S element by element then, in float32 with the 16-bit kernels' tanh; sinks merged
    after the key loop, ``flashcupy._sinks``, on the twin and the kernel alike: P keeps the keys' own max,
    so a dominant sink cannot underflow the e4m3 P); ``scale``
    default 1/sqrt(D); ``p_scale`` in (0, 448]; ``out_dtype`` "float16" or "bfloat16". Returns o (and
    lse, float32 (B, Hq, Nq), with ``return_lse``).

    Runs the NumPy twin on NumPy inputs and the fp8 wgmma kernel (``kernels_cu/fwd_wgmma.cu`` built with
    FC_FP8, Hopper only) on CuPy inputs (uint8 bit patterns). The kernel runs D 128 and 256, ``block_n`` 128
    and ``block_m`` 64, 128 or 192 (query rows per CTA, one consumer warpgroup per 64: no effect on the
    result; default 192 at D=128, the fastest measured on the H200, and 128 for two-level accumulation,
    which does not run 192, and with a softcap), accumulation "single" or "tile" (D=256: single-level with
    block_m 128 only); it reads V transposed (a second, small kernel writes V^T first: e4m3 wgmma takes
    K-major operands only). On the twin ``block_m`` is ignored. A call on CuPy inputs can be captured in a
    CUDA graph, as ``flashcupy.attention`` can: its temporaries (the flattened descales, V^T, the tile
    counter) are then the capture's own, and a replay reads the inputs and scales at their addresses. Its
    launches go through a plan remembered per variant, shapes, strides, scale and p_scale, as the 16-bit
    forward's do.
    """
    return _attention_fp8(q, k, v, causal=causal, scale=scale, block_n=block_n, p_scale=p_scale,
                          accumulation=accumulation, out_dtype=out_dtype, return_lse=return_lse,
                          block_m=block_m, ablate=ablate, window_size=window_size, sinks=sinks,
                          softcap=softcap)


def _attention_fp8(q, k, v, *, causal, scale, block_n, p_scale, accumulation, out_dtype, return_lse, block_m,
                   ablate, window_size, sinks, softcap, sink_first: bool = False):
    """``attention_fp8``'s body; ``sink_first`` (NumPy inputs with sinks, for
    ``inspect.sink_first_forward_fp8``): the twin starts its online softmax from the sinks instead of
    merging them after the key loop."""
    from ._checks import _check_bool, check_kernel_softcap, check_scale, check_tile, window_of

    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Quantized):
            raise TypeError(f"{name} must be a flashcupy.fp8.Quantized (from quantize()), "
                            f"got {type(x).__name__}")
        if x.fmt != "e4m3":
            raise ValueError(f"{name} must be e4m3 (the format of the fp8 wgmma kernels), got {x.fmt!r}")
        _check_scale(name, x)
    if v.granularity not in ("tensor", "head"):
        raise ValueError(f"v's granularity must be 'tensor' or 'head' (its scale is factored out of P V, a "
                         f"sum over keys), got {v.granularity!r}")
    (b, hq, _, d), (bk, hkv, _, dk) = q.shape, k.shape
    if k.shape != v.shape or bk != b or dk != d:
        raise ValueError(f"k and v must be (B, Hkv, Nk, D) with q's B and D; got q {q.shape}, k {k.shape}, "
                         f"v {v.shape}")
    if hq % hkv:
        raise ValueError(f"q's heads ({hq}) must be a multiple of k's ({hkv})")
    if d not in FP8_HEAD_DIMS:
        raise ValueError(f"fp8 attention runs head dims {FP8_HEAD_DIMS}, not {d}")
    _check_bool("causal", causal)
    _check_bool("return_lse", return_lse)
    causal, window = window_of(window_size, bool(causal), q.shape[2], k.shape[2])
    scale = check_scale(scale, d)
    softcap = float(np.float32(check_kernel_softcap(softcap)))  # (the float32 cap the kernel compiles)
    block_n = check_tile("block_n", block_n, FP8_BLOCK_N)
    block_m = check_tile("block_m", block_m, (64, 128, 192))
    if isinstance(p_scale, (bool, np.bool_)) or not isinstance(p_scale, (int, float, np.number)):
        raise TypeError(f"p_scale must be a float, got {type(p_scale).__name__}")
    if not 0 < float(p_scale) <= FORMATS["e4m3"][1]:
        raise ValueError(f"p_scale must be in (0, 448] (P * p_scale must fit e4m3), got {p_scale}")
    if accumulation not in ACCUMULATIONS:
        raise ValueError(f"accumulation must be one of {ACCUMULATIONS}, got {accumulation!r}")
    from ._families import ABLATIONS

    if ablate not in ABLATIONS:
        raise ValueError(f"ablate must be one of {ABLATIONS}, got {ablate!r}")
    if not isinstance(out_dtype, str) or out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of the names {OUT_DTYPES}, got {out_dtype!r}")
    _check_magnitudes(q, k, v, scale, d, out_dtype)
    if sinks is not None:
        from . import _sinks

        sinks = _sinks.check(sinks, hq, q.data)
    if block_m is None:
        from ._policy import fp8_block_m

        block_m = fp8_block_m(accumulation, q.shape[3], bool(softcap))
    sides = {_xp(x.data) is np for x in (q, k, v)} | {_xp(x.scale) is np for x in (q, k, v)}
    if len(sides) > 1:
        raise TypeError("q, k and v (data and scales) must all be NumPy arrays (the twin) or all CuPy "
                        "arrays (the kernel)")
    if sink_first and (sinks is None or _xp(q.data) is not np or ablate is not None):
        raise ValueError("sink_first runs on the NumPy twin, with sinks and without a break")
    if _xp(q.data) is not np:
        o, lse = _attention_fp8_kernel(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n,
                                       p_scale=float(p_scale), accumulation=accumulation, out_dtype=out_dtype,
                                       ablate=ablate, window=window, softcap=softcap)
        if sinks is not None:
            _sinks.apply(o, lse, sinks)
        return (o, lse) if return_lse else o
    from . import _twin
    from ._checks import numpy_dtype

    exact = accumulation == "exact"
    o, lse = _twin.forward_fp8(*(x.data.astype(np.float64) for x in (q, k, v)), expand_scale(q),
                               expand_scale(k), v.scale, causal=causal, scale=scale, block_n=block_n,
                               p_scale=float(p_scale), accumulation="tile" if exact else accumulation,
                               model=(None, "rn", None) if exact else None, ablate=ablate,
                               window=window or (-1, -1), sink_first=sinks if sink_first else None,
                               softcap=softcap)
    o = o.astype(numpy_dtype({"float16": "f16", "bfloat16": "bf16"}[out_dtype]))
    if sinks is not None and not sink_first:  # merged after the key loop, as on the kernel
        _sinks.apply(o, lse, sinks)
    return (o, lse) if return_lse else o


def _attention_fp8_kernel(q, k, v, *, causal, scale, block_m, block_n, p_scale, accumulation, out_dtype,
                          ablate, window, softcap=0.0):
    """attention_fp8 on CuPy inputs (arguments checked): (o, lse) of this call's fp8 fwd_wgmma variant."""
    import cupy

    from ._checks import Problem, _common_device, _device_capability
    from ._launch import forward
    from ._policy import fp8_kscale
    from ._variant import Variant

    if accumulation not in ("single", "tile"):
        raise ValueError(f"accumulation={accumulation!r} runs on the NumPy twin only; the fp8 kernel runs "
                         "'single' and 'tile'")
    from ._families import FP8_HEAD_DIMS as KERNEL_HEAD_DIMS

    (b, hq, nq, d), (hkv, nk) = q.shape, k.shape[1:3]
    if d not in KERNEL_HEAD_DIMS or block_n != 128:
        raise ValueError(f"the fp8 wgmma kernel runs D {KERNEL_HEAD_DIMS} with block_n=128; got D={d}, "
                         f"block_n={block_n} (NumPy inputs run the twin at D 64, 128, 256 and block_n 64, "
                         "128)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.data.dtype != cupy.uint8:
            raise TypeError(f"{name}.data must hold e4m3 bit patterns as uint8 on the GPU, "
                            f"got {x.data.dtype}")
    device = _common_device({"q": q.data, "k": k.data, "v": v.data, "q.scale": q.scale, "k.scale": k.scale,
                           "v.scale": v.scale})
    if _device_capability(device) != 90:
        raise ValueError("the fp8 wgmma kernel needs a Hopper GPU (compute capability 9.0, sm_90a); "
                         "NumPy inputs run the twin anywhere")
    kscale = fp8_kscale(k.granularity, k.block, block_n, d, bool(softcap))
    var = Variant("fwd_wgmma", {"float16": "f16", "bfloat16": "bf16"}[out_dtype], "fp32", block_m, block_n, d,
                  causal, ablate, fp8=accumulation, fp8_kscale=kscale, window=window, softcap=softcap)
    p = Problem("cuda", b, hq, hkv, nq, nk, d, scale, var, device, p_scale=p_scale)
    blocks = tuple(x.block if x.granularity == "block" else None for x in (q, k))
    return forward(q.data, k.data, v.data, p, fp8=(q.scale, k.scale, v.scale, blocks))

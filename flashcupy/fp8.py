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
uint8 arrays of the same bit patterns (what a kernel reads and TMA moves as bytes; the rounding is done
through NumPy on the host, the same function). ``dequantize`` gives float32 back.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .transforms import _xp

__all__ = ["FORMATS", "GRANULARITIES", "Quantized", "dequantize", "expand_scale", "quantize"]

FORMATS = {"e4m3": ("float8_e4m3fn", 448.0), "e5m2": ("float8_e5m2", 57344.0)}
GRANULARITIES = ("tensor", "head", "block", "token")


@dataclasses.dataclass(frozen=True)
class Quantized:
    """fp8 data with the float32 scales that undo it: x ~ data * scale (``scale`` broadcast over D and,
    for "block", repeated over the ``block`` tokens of each group)."""

    data: object           # (B, H, N, D): ml_dtypes fp8 (NumPy) or uint8 bit patterns (CuPy)
    scale: object          # float32, (1, 1, 1, 1) | (B, H, 1, 1) | (B, H, ceil(N / block), 1) | (B, H, N, 1)
    fmt: str
    granularity: str
    block: int | None = None

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
    if np.dtype(x.dtype).kind != "f" and np.dtype(x.dtype).name != "bfloat16":
        raise TypeError(f"x must be a floating-point array; got {x.dtype}")


def _group_amax(x: np.ndarray, granularity: str, block: int | None) -> np.ndarray:
    ax = np.abs(x)
    if granularity == "tensor":
        return ax.max(axis=(0, 1, 2, 3), keepdims=True)
    if granularity == "head":
        return ax.max(axis=(2, 3), keepdims=True)
    if granularity == "token":
        return ax.max(axis=3, keepdims=True)
    b, h, n, _ = x.shape
    groups = -(-n // block)
    padded = np.zeros((b, h, groups * block), dtype=ax.dtype)
    padded[:, :, :n] = ax.max(axis=3)
    return padded.reshape(b, h, groups, block).max(axis=3, keepdims=True)


def expand_scale(q: Quantized) -> object:
    """The scale broadcastable against the data (B, H, N, 1) or smaller: "block" scales repeated over
    their tokens (and cut at N)."""
    if q.granularity != "block":
        return q.scale
    xp = _xp(q.scale)
    return xp.repeat(q.scale, q.block, axis=2)[:, :, :q.shape[2]]


def quantize(x, fmt: str = "e4m3", granularity: str = "tensor", block: int | None = None) -> Quantized:
    """Quantize a (B, H, N, D) array to fp8 with one float32 scale per group (see the module docstring
    for the math, the groups and the rounding). Raises ValueError/TypeError for an unknown format or
    granularity, a missing or stray ``block``, a non-4-D or non-float array, and ValueError when x holds
    inf or NaN (no scale can represent them)."""
    _check(x, fmt, granularity, block)
    xp = _xp(x)
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


def dequantize(q: Quantized):
    """float32 data * scale, on the data's side (NumPy or CuPy)."""
    xp = _xp(q.data)
    if xp is np:
        values = q.data.astype(np.float32)
    else:
        values = xp.asarray(xp.asnumpy(q.data).view(_fp8_dtype(q.fmt)).astype(np.float32))
    return values * expand_scale(q)


"""TMA tensor maps for the wgmma kernels, built on the host with ``cuda.bindings``.

A Hopper kernel loads its tiles with ``cp.async.bulk.tensor`` from a *tensor map* (``CUtensorMap``, 128
bytes) that describes a tensor in global memory: its base address, extents, strides in bytes, the box one
load copies and the shared-memory swizzle. CuPy has no encoder, so :func:`tensor_map` calls the driver's
``cuTensorMapEncodeTiled`` (package ``cuda-bindings``, imported only when a map is built) and returns the
map as a 128-byte NumPy void scalar: the argument CuPy passes by value to a kernel parameter
``const __grid_constant__ FcTensorMap``.

The map of a (B, H, N, D) array is 4-D, innermost first: (D, N, H, B) with the array's own strides, so a
(B, N, H, D) layout viewed as (B, H, N, D) needs no copy, and each (b, h) is addressed by coordinates:
rows past N are outside the tensor and arrive as zeros (TMA's out-of-bounds fill), never as the next
head's rows. The map holds the array's address: keep the array alive while a launch that uses the map
may run.
"""
from __future__ import annotations

import ctypes

import numpy as np

__all__ = ["TMA_MAP_BYTES", "MapTemplate", "tensor_map"]

TMA_MAP_BYTES = 128
STRIDE_LIMIT = 1 << 40    # strides must be below 2^40 bytes
_DIM_LIMIT = 1 << 32      # extents at most 2^32
_BOX_LIMIT = 256          # each box dimension at most 256 elements
_SWIZZLE_SPAN = {0: None, 32: 32, 64: 64, 128: 128}


def _data_type(driver, dt, name: str):
    if dt == np.float16:
        return driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16
    if dt.name == "bfloat16":
        return driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    if dt == np.float32:
        return driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32
    if dt.itemsize == 1:  # fp8 (e4m3 / e5m2) and other bytes: moved as raw bytes
        return driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8
    raise ValueError(f"{name}: TMA tensor maps here support float16, bfloat16, float32 and 1-byte "
                     f"types; got {dt}")


def tensor_map(x, box_rows: int, *, box_cols: int = 64, swizzle: int = 128, name: str = "x") -> np.void:
    """The TMA tensor map of a 4-D CuPy array ``x`` of shape (B, H, N, D), as a 128-byte NumPy void.

    The map is 4-D (D, N, H, B) over ``x``'s real strides; one load copies a box of ``box_cols``
    elements of D by ``box_rows`` rows of N of one (b, h), written to shared memory with the given
    swizzle (128: each row of the box is 128 bytes and 16-byte chunk c of row r lands at c ^ (r % 8)).
    Elements outside (N, D) are filled with zeros.

    Raises ValueError naming ``name`` when TMA cannot describe ``x``: not a 4-D device array, the last
    axis not contiguous, a base address or a stride (of an axis longer than 1) not a multiple of 16
    bytes or not below 2^40, an extent above 2^32, a box dimension outside 1..256, or a box row wider
    than the swizzle span.
    """
    if not hasattr(x, "data") or not hasattr(x.data, "ptr"):
        raise ValueError(f"{name}: a TMA tensor map needs a CuPy array, got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(f"{name}: a TMA tensor map needs a 4-D (B, H, N, D) array, "
                         f"got shape {tuple(x.shape)}")
    tmpl = MapTemplate(x.shape, x.strides, x.dtype, box_rows, box_cols=box_cols, swizzle=swizzle, name=name)
    return np.frombuffer(tmpl.encode(int(x.data.ptr)), dtype=np.dtype((np.void, TMA_MAP_BYTES)))[0]


class MapTemplate:
    """Everything of a TMA tensor map but its base address, checked once: the maps of arrays of one
    shape, strides and dtype then differ only in the address, and ``encode(ptr)`` asks the driver for
    one (about a microsecond plus the binding's call) with arguments built here. A launch plan keeps one
    per mapped argument, so a call whose arrays moved (torch's allocator hands out new outputs on every
    call) pays an encode and no checks. The arguments are as in ``tensor_map``; ``strides`` in bytes."""

    __slots__ = ("name", "_encode", "_args", "_dtype", "_ok", "raw")

    def __init__(self, shape, strides, dtype, box_rows: int, *, box_cols: int = 64, swizzle: int = 128,
                 name: str = "x"):
        dtype = np.dtype(dtype)
        item = dtype.itemsize
        bsz, heads, n, d = (int(s) for s in shape)
        self.name = name
        if min(bsz, heads, n, d) < 1:
            raise ValueError(f"{name}: every extent must be >= 1 for a TMA tensor map, "
                             f"got shape {tuple(shape)}")
        if any(s > _DIM_LIMIT for s in (bsz, heads, n, d)):
            raise ValueError(f"{name}: TMA extents are at most 2^32, got shape {tuple(shape)}")
        if d > 1 and strides[3] != item:
            raise ValueError(f"{name}: the last axis must be contiguous (stride {item} bytes), got strides "
                             f"{tuple(strides)}")
        if (d * item) % 16:
            raise ValueError(f"{name}: TMA needs rows of a multiple of 16 bytes; D={d} x {item} bytes is not")
        # strides (bytes) of N, H, B; an axis of extent 1 is never stepped, so any valid stride serves
        steps = []
        for axis, label in ((2, "N"), (1, "H"), (0, "B")):
            st = int(strides[axis])
            if shape[axis] == 1:
                st = max(16, -(-abs(st) // 16) * 16) if st else d * item
            if st <= 0 or st % 16 or st >= STRIDE_LIMIT:
                raise ValueError(f"{name}: TMA needs the {label} stride to be a positive multiple of 16 "
                                 f"bytes below 2^40; got {strides[axis]} bytes (strides {tuple(strides)})")
            steps.append(st)
        if swizzle not in _SWIZZLE_SPAN:
            raise ValueError(f"{name}: swizzle must be 0, 32, 64 or 128 (bytes), got {swizzle}")
        for label, val in (("box_rows", box_rows), ("box_cols", box_cols)):
            if not 1 <= int(val) <= _BOX_LIMIT:
                raise ValueError(f"{name}: {label} must be in 1..{_BOX_LIMIT}, got {val}")
        if (box_cols * item) % 16:
            raise ValueError(f"{name}: a box row must be a multiple of 16 bytes; box_cols={box_cols} x "
                             f"{item} bytes is not")
        span = _SWIZZLE_SPAN[swizzle]
        if span is not None and box_cols * item > span:
            raise ValueError(f"{name}: with {swizzle}-byte swizzle a box row is at most {span} bytes; "
                             f"box_cols={box_cols} x {item} bytes is wider")

        from cuda.bindings import driver  # lazily: only the wgmma family needs it

        swz = {0: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
               32: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B,
               64: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
               128: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B}[swizzle]
        self._encode = driver.cuTensorMapEncodeTiled
        self._args = (
            [driver.cuuint64_t(v) for v in (d, n, heads, bsz)],
            [driver.cuuint64_t(v) for v in steps],
            [driver.cuuint32_t(v) for v in (box_cols, box_rows, 1, 1)],
            [driver.cuuint32_t(1)] * 4,
            driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            swz,
            driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        self._dtype = _data_type(driver, dtype, name)
        self._ok = driver.CUresult.CUDA_SUCCESS
        # the same arguments as plain integers, for encoders outside Python (flashcupy/_torch_node.cpp):
        # data type, interleave, swizzle, L2 promotion, out-of-bounds fill, extents, strides, box
        self.raw = (int(self._dtype), *(int(e) for e in self._args[4:]), [int(v) for v in self._args[0]],
                    [int(v) for v in self._args[1]], [int(v) for v in self._args[2]])

    def encode(self, ptr: int) -> bytes:
        """The 128 bytes of the map at device address ``ptr`` (ValueError unless 16-byte aligned)."""
        if ptr % 16:
            raise ValueError(f"{self.name}: TMA needs a 16-byte aligned base address; {self.name} starts at "
                             f"{ptr:#x}")
        err, tmap = self._encode(self._dtype, 4, ptr, *self._args)
        if err != self._ok:
            dims, steps, box = ([int(v) for v in a] for a in self._args[:3])
            raise ValueError(f"{self.name}: cuTensorMapEncodeTiled failed with {err} (extents {dims}, "
                             f"strides {steps}, box {box[:2]})")
        return ctypes.string_at(tmap.getPtr(), TMA_MAP_BYTES)

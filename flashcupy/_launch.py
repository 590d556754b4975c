"""Launching the kernels on CuPy arrays (shapes and knobs already checked)."""
from __future__ import annotations

import math

import numpy as np

from ._build import get_kernel
from ._checks import Problem

_LOG2E = 1.0 / math.log(2.0)


def _rows_aligned(x) -> bool:
    """Every (b, h, n) row of x starts on a 16-byte boundary (the kernels load 16 bytes at a time)."""
    if x.data.ptr % 16:
        return False
    return all(s % 16 == 0 for s, n in zip(x.strides[:-1], x.shape[:-1]) if n > 1)


def element_strides(x) -> tuple[np.int64, np.int64, np.int64]:
    """(batch, head, row) strides of a 4-D array in elements, as 64-bit kernel arguments."""
    return tuple(np.int64(s // x.itemsize) for s in x.strides[:3])


def forward(q, k, v, p: Problem, o=None, lse=None):
    """Run the variant of ``p`` on the current CuPy stream. Returns (o, lse).

    ``o`` and ``lse`` may be given preallocated (contiguous, right shape and dtype): the tests pass
    NaN-poisoned buffers to check that the kernel writes every element.
    """
    import cupy

    # A view whose rows are not 16-byte aligned is copied once; (B, N, H, D) views are aligned.
    q, k, v = (x if _rows_aligned(x) else cupy.ascontiguousarray(x) for x in (q, k, v))
    var = p.variant
    kern = get_kernel(var)  # compiled (and checked against the device) before anything is allocated
    if o is None:
        o = cupy.empty((p.batch, p.heads_q, p.nq, p.head_dim), dtype=q.dtype)
    if lse is None:
        lse = cupy.empty((p.batch, p.heads_q, p.nq), dtype=cupy.float32)
    assert o.flags.c_contiguous and o.shape == (p.batch, p.heads_q, p.nq, p.head_dim) and o.dtype == q.dtype
    assert lse.flags.c_contiguous and lse.shape == (p.batch, p.heads_q, p.nq) and lse.dtype == cupy.float32
    grid = ((p.nq + var.block_m - 1) // var.block_m, p.heads_q, p.batch)
    args = (q, k, v, o, lse, np.int32(p.nq), np.int32(p.nk), np.int32(p.group),
            *element_strides(q), *element_strides(k), *element_strides(v),
            np.float32(p.scale * _LOG2E))
    kern(grid, args)
    return o, lse


def backward(do, q, k, v, o, lse, p: Problem, grads=None):
    """dq, dk, dv of the variant of ``p`` on the current CuPy stream.

    delta_i = rowsum(dO_i * O_i) is computed here in fp32 (one CuPy reduction, O(N) memory); then the
    dK/dV kernel (key-tile outer) and the dQ kernel (query-tile outer) run, neither with atomics, so the
    gradients are bitwise reproducible. ``grads`` may hold preallocated (dq, dk, dv) (poisoned by tests).
    """
    import cupy

    do, q, k, v = (x if _rows_aligned(x) else cupy.ascontiguousarray(x) for x in (do, q, k, v))
    var = p.variant
    k_dkdv, k_dq = (get_kernel(var, name) for name in var.fam.kernels)
    delta = cupy.sum(do.astype(cupy.float32) * o.astype(cupy.float32), axis=-1)
    lse = cupy.ascontiguousarray(lse)
    if grads is None:
        grads = (cupy.empty((p.batch, p.heads_q, p.nq, p.head_dim), dtype=q.dtype),
                 cupy.empty((p.batch, p.heads_kv, p.nk, p.head_dim), dtype=q.dtype),
                 cupy.empty((p.batch, p.heads_kv, p.nk, p.head_dim), dtype=q.dtype))
    dq, dk, dv = grads
    args = (q, k, v, do, lse, delta, dq, dk, dv, np.int32(p.nq), np.int32(p.nk), np.int32(p.group),
            *element_strides(q), *element_strides(k), *element_strides(v), *element_strides(do),
            np.float32(p.scale * _LOG2E))
    k_dkdv(((p.nk + var.block_n - 1) // var.block_n, p.heads_kv, p.batch), args)
    k_dq(((p.nq + var.block_m - 1) // var.block_m, p.heads_q, p.batch), args)
    return dq, dk, dv

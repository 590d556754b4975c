"""Launching the kernels on CuPy arrays (shapes and knobs already checked)."""
from __future__ import annotations

import functools
import math

import numpy as np

from ._build import ATOMIC_DQ_ROLES, DETERMINISTIC_DQ_ROLES, get_kernel, wgmma_persistent
from ._checks import Problem

_LOG2E = 1.0 / math.log(2.0)


def _rows_aligned(x) -> bool:
    """Every (b, h, n) row of x starts on a 16-byte boundary (the kernels load 16 bytes at a time)."""
    if x.data.ptr % 16:
        return False
    return all(s % 16 == 0 for s, n in zip(x.strides[:-1], x.shape[:-1]) if n > 1)


def _wgmma_ctas(tiles: int) -> int:
    """CTAs of a persistent wgmma forward launch over ``tiles`` tiles: one per SM, at most one per tile
    (the kernel runs on any grid size and writes the same bits)."""
    import cupy

    return min(tiles, _sm_count(cupy.cuda.Device().id))


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    """Streaming multiprocessors of a device."""
    import cupy

    return cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id)


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
    kern = get_kernel(var, "fwd")  # compiled (and checked against the device) before anything is allocated
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
    if var.fam.kind == "wgmma":
        # The Hopper kernels load q, k, v by TMA: tensor maps over their real strides come first, by
        # value (the pointers and strides that follow are not read). q, k, v stay alive until return.
        # It takes the head and batch counts; a persistent variant loops over the tiles on one CTA per SM.
        from ._tma import tensor_map

        args = (tensor_map(q, var.block_m, name="q"), tensor_map(k, var.block_n, name="k"),
                tensor_map(v, var.block_n, name="v")) + args + (np.int32(p.heads_q), np.int32(p.batch))
        if wgmma_persistent(var):
            grid = (_wgmma_ctas(grid[0] * grid[1] * grid[2]), 1, 1)
    kern(grid, args)
    return o, lse


def backward(do, q, k, v, o, lse, p: Problem, *, deterministic: bool, grads=None):
    """dq, dk, dv of the variant of ``p`` on the current CuPy stream.

    First flash_bwd_prep computes delta_i = rowsum(dO_i * O_i) in fp32 (O(N) memory) and zeroes the
    atomic path's fp32 dQ buffer. Then:

    * ``deterministic=True``, or fp16 accumulators, or a family without the atomic kernel: the dK/dV
      kernel (key-tile outer) and the dQ kernel (query-tile outer), neither with atomics: bitwise
      reproducible, at the price of computing S and dP twice.
    * otherwise (mma, fp32 accumulators): one key-tile-outer kernel computes dK, dV and adds each
      tile's dQ partial to an fp32 buffer with atomic reductions (FlashAttention-2's scheme), then
      a conversion kernel scales and rounds it into dq. The order of the additions varies between
      runs, so dq may differ in the last bits from run to run.

    ``grads`` may hold preallocated (dq, dk, dv) (poisoned by tests).
    """
    import cupy

    do, q, k, v, o = (x if _rows_aligned(x) else cupy.ascontiguousarray(x) for x in (do, q, k, v, o))
    var = p.variant
    roles = backward_roles(var, deterministic)
    lse = cupy.ascontiguousarray(lse)
    rows = p.batch * p.heads_q * p.nq
    delta = cupy.empty((p.batch, p.heads_q, p.nq), dtype=cupy.float32)
    dq_accum = cupy.empty((p.batch, p.heads_q, p.nq, p.head_dim), dtype=cupy.float32) \
        if roles == ATOMIC_DQ_ROLES else None
    get_kernel(var, "prep")(((8 * rows + var.threads - 1) // var.threads,),
                                      (do, o, delta, np.uint64(0) if dq_accum is None else dq_accum,
                                       np.int64(rows), np.int32(p.heads_q), np.int32(p.nq),
                                       *element_strides(do), *element_strides(o)))
    if grads is None:
        grads = (cupy.empty((p.batch, p.heads_q, p.nq, p.head_dim), dtype=q.dtype),
                 cupy.empty((p.batch, p.heads_kv, p.nk, p.head_dim), dtype=q.dtype),
                 cupy.empty((p.batch, p.heads_kv, p.nk, p.head_dim), dtype=q.dtype))
    dq, dk, dv = grads
    scale_log2 = np.float32(p.scale * _LOG2E)
    args = (q, k, v, do, lse, delta, dq, dk, dv, np.int32(p.nq), np.int32(p.nk), np.int32(p.group),
            *element_strides(q), *element_strides(k), *element_strides(v), *element_strides(do), scale_log2)
    kv_grid = ((p.nk + var.block_n - 1) // var.block_n, p.heads_kv, p.batch)
    k_kv, k_q = (get_kernel(var, role) for role in roles)
    if dq_accum is not None:
        k_kv(kv_grid, args + (dq_accum,))
        n4 = dq_accum.size // 4
        k_q((min((n4 + 255) // 256, 65536),), (dq_accum, dq, np.int64(n4), scale_log2))
    else:
        k_kv(kv_grid, args)
        k_q(((p.nq + var.block_m - 1) // var.block_m, p.heads_q, p.batch), args)
    return dq, dk, dv


def backward_roles(var, deterministic: bool) -> tuple[str, str]:
    """The roles of the two kernels a backward call of ``var`` launches after "prep", in order: the
    atomic-dQ pair where the variant has it and determinism is not asked for, else dK/dV then dQ."""
    if not deterministic and set(ATOMIC_DQ_ROLES) <= set(var.roles):
        return ATOMIC_DQ_ROLES
    return DETERMINISTIC_DQ_ROLES


def launch_roles(var, deterministic: bool = False) -> tuple[str, ...]:
    """The roles of every kernel a call of ``var`` launches, in order (``forward``, ``backward``)."""
    if var.fam.direction == "fwd":
        return ("fwd",)
    return ("prep", *backward_roles(var, deterministic))

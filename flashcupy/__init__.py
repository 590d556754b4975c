"""flashcupy: FlashAttention's numerics on real GPU kernels.

``attention`` runs the CUDA kernels (Hopper ``wgmma`` + TMA, tensor-core ``mma``, or scalar ``simt``
family, compiled at run time with NVRTC) on CuPy arrays, and the NumPy twin of the same tiled algorithm on
NumPy arrays. ``flashcupy.reference`` is the float64 truth everything is measured against.
"""
from __future__ import annotations

import typing as _typing

from . import _launch, _sinks, _twin, inspect, reference
from ._checks import _check_bool
from ._checks import backward_problem as _backward_problem
from ._checks import check_alibi_slopes as _check_alibi_slopes
from ._checks import check_lse_origin as _check_lse_origin
from ._checks import forward_problem as _forward_problem
from ._checks import remember_lse_origin as _remember_lse_origin
from ._kvcache import KVCachePlan, attention_with_kvcache, plan_kvcache
from ._merge import merge_states
from ._varlen import attention_varlen, attention_varlen_backward
from .fp8 import attention_fp8, dequantize, quantize

__all__ = ["KVCachePlan", "attention", "attention_backward", "attention_fp8", "attention_varlen",
           "attention_with_kvcache", "attention_varlen_backward", "dequantize", "inspect", "merge_states",
           "plan_kvcache", "quantize", "reference"]
__version__ = "0.1.0"
del annotations  # the __future__ import's name: not part of the package's namespace

if _typing.TYPE_CHECKING:  # the annotations' names (not evaluated at run time)
    from typing import Literal

    from ._types import Array


_NO_WINDOW, _NO_CAP = (-1, -1), 0.0  # the score variants' defaults


def attention(q: Array, k: Array, v: Array, *, causal: bool = False, scale: float | None = None,
              block_m: int | None = None, block_n: int | None = None, accum: Literal["fp32", "fp16"] = "fp32",
              kernel: Literal["auto", "wgmma", "mma", "simt"] = "auto",
              ablate: Literal["max_subtraction", "rescaling", "softcap_after_mask", "alibi_unshifted"]
              | None = None,
              return_lse: bool = False, window_size: tuple[int, int] = _NO_WINDOW, softcap: float = _NO_CAP,
              sinks: Array | None = None, alibi_slopes: Array | None = None) -> Array | tuple[Array, Array]:
    """FlashAttention forward: ``o = softmax(scale * q k^T) v`` computed tile by tile.

    Parameters
    ----------
    q : (B, Hq, Nq, D) array; k, v : (B, Hkv, Nk, D) arrays, Hq % Hkv == 0 (GQA/MQA without copies).
        All CuPy (CUDA kernels, on the current stream) or all NumPy (the NumPy twin, same knobs).
        dtype float16, bfloat16 or float32, the same for all three; D a multiple of 8 up to 256;
        Nq, Nk >= 1. Any strides and any start address: (B, N, H, D) buffers viewed as (B, H, N, D) are
        read in place; an array whose last axis is not contiguous, or whose start or other strides are
        not multiples of 16 bytes, is first copied once into a contiguous array (one read and one write
        of it), and so, for kernel 'wgmma' (whose TMA loads take positive strides), is one with a zero
        stride (``broadcast_to``, torch's ``expand``) or a negative one (``x[:, :, ::-1]``); the other
        families read those in place.
    causal : key j is visible to query i iff j <= i + (Nk - Nq) (bottom-right aligned). A query row
        that sees no key gets output 0 and LSE -inf.
    scale : score scale, default 1/sqrt(D); must lie in [2^-64, 2^12] (``flashcupy._checks.SCALE_RANGE``;
        outside it a ValueError names the range). The kernels fold scale * log2(e) into one float32
        factor and exponentiate the float32 product with the scores: results are finite and accurate
        while the scaled scores |scale q.k| stay below 2^20, which unit-variance inputs do at every
        accepted scale.
    block_m, block_n : tile sizes (query rows per block, keys per inner step); None picks a default per
        (kernel, dtype, D, accum, causal) and, for the wgmma forward, the query length (D=64 causal:
        128 rows up to 1024 query rows, 192 above) (a block_m given alone keeps the default key tile
        where the family runs it with that block_m, else takes the widest it does). Unsupported values
        raise ValueError listing the supported ones. The wgmma forward also picks how its CTAs walk
        the tiles by D, causal and the query length (flashcupy._policy.wgmma_schedule); that choice
        never changes a bit of the result.
    accum : "fp32" or "fp16": precision of the on-chip accumulators (scores, running max and sum,
        output accumulator). The rounding model is written in ``flashcupy._twin``.
    kernel : "wgmma" (Hopper only: wgmma + TMA + warp specialization, FlashAttention-3's design;
        float16/bfloat16, D 64, 128 or 256; accum="fp16" with float16 only), "mma" (tensor cores
        through mma.sync, float16/bfloat16), "simt" (scalar, every dtype) or "auto": wgmma on a
        compute-capability-9.0 GPU where it has the variant, else mma where tensor cores apply, else
        simt.
    ablate : None, "max_subtraction" (exponentiate raw scores, no running max, no rescaling) or
        "rescaling" (subtract each tile's own max, never rescale the running sum and output); on NumPy
        inputs only (the twin), "softcap_after_mask" (with a softcap and a mask: the mask before the
        softcap, so every masked key scores -c, tanh(-inf) = -1, instead of -inf, and leaks e^-c of weight;
        with ALiBi, e^(-c - slope |i' - j|)), "alibi_unshifted" (with ALiBi: the bias measured from i'
        itself in rows with i' < 0, as the kernels did before they measured from max(i', 0): exact in
        exact arithmetic, it holds those rows' scores near -slope d0 where fp16 accumulators round them;
        ``python -m analysis alibi``).
    return_lse : also return lse, float32 (B, Hq, Nq), the natural log of the softmax denominator.
    window_size : (left, right), a sliding window (flash_attn_func's): key j is visible to query i iff
        i' - left <= j <= i' + right, i' = i + Nk - Nq, a side of -1 unbounded; with ``causal`` the
        window (left, 0). Every family runs it, forward and backward: key tiles wholly outside the window
        are never visited, so the cost follows the window, not Nk. Each window is compiled into its
        kernel (one module per (left, right), cached like the rest); a side that reaches past every key
        of the call runs as unbounded, so a window wider than the problem runs the plain kernel.
    softcap : flash_attn_func's softcap: S <- c tanh(S / c) on the scaled scores, before the mask (0: off;
        c in [2^-16, 2^32]). Every family runs it, forward and backward (not the fp8 forward yet),
        compiled into the kernel like the window (one module per cap). The kernels take tanh from the
        MUFU's tanh.approx.f32 (largest absolute error measured on an H100: 2^-17) for 16-bit inputs
        and the accurate tanhf for float32 inputs (``python -m analysis softcap`` measures both).
    sinks : per-head attention sink logits z (Hq,) (gpt-oss's): each row's softmax denominator gains
        e^z with no value row, lse' = log(e^lse + e^z) is returned. A NumPy array (checked finite) or,
        for CuPy inputs, a CuPy float array on q's GPU (its values are not read: a non-finite sink gives
        non-finite rows). Every family runs them: the kernel's (o, lse) over the keys is merged with the
        sink after the key loop, o' = o e^(lse - lse'), in float32 by two CuPy kernels (a row kernel and
        one over o; ``flashcupy._sinks``: why after the loop, and the cost, one more rounding of o).
        A row that sees no key gets o = 0 and lse = z.
    alibi_slopes : ALiBi slopes (Hq,) or (B, Hq), float32 or float64 (semantics and math:
        ``flashcupy.reference.attention``): S_ij - slope |i + Nk - Nq - j| on the scaled scores, after
        the softcap. Every family but the fp8 forward runs them, compiled into the score hook
        (``FC_ALIBI``; the slopes travel as slope / scale in float32, computed in float64).

    The algorithm, per tile of keys j, with running max m, sum l and output accumulator O:
    m' = max(m, rowmax(S_j)), P = exp(S_j - m'), l = e^(m - m') l + rowsum(P),
    O = e^(m - m') O + P V_j; finally o = O / l and lse = m + ln(l), with S = scale * q k^T.

    A call on CuPy arrays can be captured into a CUDA graph (``cupy.cuda.Stream.begin_capture``) and
    replayed: its temporaries (copies, the scheduler's tile counter) then come from memory kept for the
    life of the process (never returned to the pool; one set per thread, stream and call signature),
    shared by the graphs captured on one stream (replay those one at a time); the outputs are the
    caller's to keep alive.
    """
    _check_bool("return_lse", return_lse)
    problem = _forward_problem(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n,
                              accum=accum, kernel=kernel, ablate=ablate, window_size=window_size,
                              softcap=softcap, alibi=alibi_slopes is not None)
    variants = _score_variants(problem, sinks, alibi_slopes, q)
    if problem.backend == "numpy":
        o, lse = _twin.forward(q, k, v, problem, **variants)
    else:
        o, lse = _launch.forward(q, k, v, problem, alibi=variants.get("alibi_slopes"))
        if "sinks" in variants:
            _sinks.apply(o, lse, variants["sinks"])
    if return_lse:
        _remember_lse_origin(lse, problem)  # (for the backward's check of its contract)
        return o, lse
    return o


def _score_variants(problem, sinks, alibi_slopes, q) -> dict:
    """The array-valued score variants a call asks for (sinks, ALiBi slopes), as keyword arguments of
    the twin or, for sinks, of ``_sinks`` and, for the slopes, of ``_launch``; checked before any launch
    (the twin's: ``reference``'s checks). (The window, the softcap and whether ALiBi is on are part of
    the problem's variant, which every family compiles.)"""
    asked = {}
    if sinks is not None:
        asked["sinks"] = _sinks.check(sinks, problem.heads_q, q)
    if alibi_slopes is not None:
        asked["alibi_slopes"] = (alibi_slopes if problem.backend == "numpy" else
                                 _check_alibi_slopes(alibi_slopes, problem.batch, problem.heads_q, q))
    return asked


def attention_backward(do: Array, q: Array, k: Array, v: Array, o: Array, lse: Array, *, causal: bool = False,
                       scale: float | None = None, block_m: int | None = None, block_n: int | None = None,
                       accum: Literal["fp32", "fp16"] = "fp32",
                       kernel: Literal["auto", "wgmma", "mma", "simt"] = "auto", deterministic: bool = False,
                       dlse: Array | None = None, window_size: tuple[int, int] = _NO_WINDOW,
                       softcap: float = _NO_CAP, sinks: Array | None = None,
                       alibi_slopes: Array | None = None) -> tuple[Array, ...]:
    """FlashAttention backward: the gradients (dq, dk, dv) of ``sum(do * attention(q, k, v))``
    (plus ``sum(dlse * lse)`` when ``dlse`` is given).

    ``o`` and ``lse`` must be what ``attention(q, k, v, ..., return_lse=True)`` returned for the same q,
    k, v, scale, causal, window_size, softcap and ALiBi slopes: the backward recomputes P from them. An
    lse that ``attention`` returned (that very array) is checked: another scale, mask, window, softcap
    or ALiBi is a ValueError naming it. A copy or view of it, or an lse from elsewhere, cannot be
    checked (nor can o, q, k, v or the slopes' values): the gradients are then silently wrong.

    Shapes, dtypes, strides (do and o too: any strides, copied where a family cannot read them, as in
    ``attention``), GQA and causal as in ``attention``; dk and dv have k's shape and are summed over the
    query heads that share a key/value head. CuPy arrays run the backward kernels, NumPy arrays the
    NumPy twin, with the same knobs. A call can be captured into a CUDA graph and replayed, as
    ``attention``'s: its temporaries (the fp32 dQ buffer, delta, counters, copies) live as long as the
    process, shared by the graphs captured on one stream.

    The algorithm (FlashAttention-2's): delta_i = rowsum(dO_i * O_i) in fp32, then, recomputing
    P = exp(scale * q k^T - lse) tile by tile from the saved LSE (P, dP and dS never reach device memory):
    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta),  dK = scale * dS^T Q,  dQ = scale * dS K.
    dK/dV are accumulated on chip by a key-tile-outer kernel. dQ, a sum over key tiles, is formed one of
    two ways:

    * ``deterministic=False`` (default; kernels 'wgmma' and 'mma' with fp32 accumulators): the same
      kernel adds each key tile's share dS K to an fp32 buffer, as FlashAttention-2 and -3 do (5 matrix
      products per tile pair; mma: the threads' atomic reductions, wgmma: TMA reduce-adds of whole
      tiles); the order of those additions varies, so dq may differ in its last bits between runs.
    * ``deterministic=True``: kernel 'wgmma' runs a twin of the same kernel (one source, a compile-time
      switch) with the additions into each query tile ordered by key tile (a counter per query tile,
      FlashAttention-3's scheme). A CTA only ever waits for CTAs of lower block index, which started
      before it, so the call needs no co-residency and cannot hang beside other kernels (another
      stream's, a collective, a second backward); without a causal mask the blocks take the heads in
      sections, key tile slowest, so that a key tile starts after its predecessor has added to the
      first query tiles (``flashcupy._policy.bwd_wgmma_ordered_heads``). Kernel 'mma' (and always 'simt'
      and accum 'fp16') runs a second, query-tile-outer kernel that recomputes S and dP and accumulates
      dQ on chip in a fixed order (7 products per tile pair, no atomics). Either way the result is
      bitwise reproducible, and dk, dv are the same bits as the default path's, except for 'wgmma'
      without a causal mask up to 2048 query rows, where the default path starts its key tiles rotated
      (measured faster there) and so sums dk, dv over the query tiles in another order.

    kernel='auto' runs 'wgmma' on a Hopper GPU for float16/bfloat16 with D 64 or 128 and fp32
    accumulators, else 'mma' (16-bit inputs) or 'simt'.

    ``dlse``: optional float32 (B, Hq, Nq) gradient of the loss with respect to the LSE that the
    forward returned. Since d lse_i / d S_ij = P_ij, it adds dlse_i * P_ij to dS, which is the same as
    replacing delta_i by delta_i - dlse_i: dS = P * (dP - (delta - dlse)). The torch bridge passes it
    when its caller differentiates through the returned LSE.

    ``window_size``, ``softcap``: as in ``attention`` (every family; the softcap multiplies dS by its
    derivative 1 - tanh^2); ``sinks``, ``alibi_slopes``: as in ``attention`` (a bias: dS is unchanged).
    With ``sinks``, ``o`` and ``lse`` are the sink forward's (lse includes the sinks): the kernels
    recompute P from that lse, so they need nothing more, and the gradient of the sink logits, d z_h =
    -sum_{b,i} e^(z_h - lse_i) delta_i (float32 (Hq,), ``flashcupy._sinks.grad``), is a fourth output.
    """
    problem = _backward_problem(do, q, k, v, o, lse, causal=causal, scale=scale, block_m=block_m,
                               block_n=block_n, accum=accum, kernel=kernel, deterministic=deterministic,
                               dlse=dlse, window_size=window_size, softcap=softcap,
                               alibi=alibi_slopes is not None)
    _check_lse_origin(lse, problem)
    variants = _score_variants(problem, sinks, alibi_slopes, q)
    if problem.backend == "numpy":  # one fixed order: deterministic either way
        return _twin.backward(do, q, k, v, o, lse, problem, dlse=dlse, **variants)
    grads = _launch.backward(do, q, k, v, o, lse, problem, deterministic=deterministic, dlse=dlse,
                             alibi=variants.get("alibi_slopes"))
    if "sinks" not in variants:
        return grads
    return (*grads, _sinks.grad(do, o, lse, variants["sinks"], dlse))

"""``flashcupy.torch.attention``: flashcupy's kernels as a ``torch.autograd.Function``.

Tensors cross between torch and CuPy through DLPack without copies, and every kernel runs on torch's
current CUDA stream (wrapped as a CuPy ``ExternalStream``), so ``loss.backward()`` works and the
kernels order correctly with the surrounding torch work, inside ``torch.cuda.stream(...)`` too.
Import this module only where torch is installed (``pip install "flashcupy[torch]"``); nothing else
in flashcupy imports torch.
"""
from __future__ import annotations

import cupy
import torch

import flashcupy

__all__ = ["attention"]

_FWD_KNOBS = {"block_m", "block_n", "accum", "kernel", "ablate"}
_BWD_KNOBS = {"accum", "kernel", "deterministic"}  # the backward runs its own default tiles


def _stream():
    return cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)


def _cp(t: torch.Tensor):
    return cupy.from_dlpack(t.detach())


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, knobs):
        fwd = {name: val for name, val in knobs.items() if name in _FWD_KNOBS}
        with _stream():
            o, lse = flashcupy.attention(_cp(q), _cp(k), _cp(v), causal=causal, scale=scale,
                                         return_lse=True, **fwd)
        o_t, lse_t = torch.from_dlpack(o), torch.from_dlpack(lse)
        ctx.save_for_backward(q, k, v, o_t, lse_t)
        ctx.causal, ctx.scale, ctx.knobs = causal, scale, knobs
        return o_t

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        if do.stride(-1) != 1:
            do = do.contiguous()
        bwd = {name: val for name, val in ctx.knobs.items() if name in _BWD_KNOBS}
        with _stream():
            dq, dk, dv = flashcupy.attention_backward(_cp(do), _cp(q), _cp(k), _cp(v), _cp(o), _cp(lse),
                                                      causal=ctx.causal, scale=ctx.scale, **bwd)
        return torch.from_dlpack(dq), torch.from_dlpack(dk), torch.from_dlpack(dv), None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None, **knobs) -> torch.Tensor:
    """Differentiable flashcupy attention on CUDA tensors (B, Hq, Nq, D) / (B, Hkv, Nk, D).

    ``knobs`` are ``flashcupy.attention``'s block_m, block_n, accum, kernel and ablate, and
    ``attention_backward``'s deterministic; the backward uses the same accum and kernel with its own
    default tiles.
    """
    unknown = set(knobs) - _FWD_KNOBS - _BWD_KNOBS
    if unknown:
        raise TypeError(f"unknown knobs {sorted(unknown)}; allowed: {sorted(_FWD_KNOBS | _BWD_KNOBS)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_cuda:
            raise TypeError(f"{name} must be a CUDA torch.Tensor")
    return _FlashAttention.apply(q, k, v, causal, scale, knobs)

"""``flashcupy.torch.attention``: flashcupy's kernels as torch custom operators with autograd.

The forward and the backward are registered as ``torch.library.custom_op`` s (``flashcupy::attention``
and ``flashcupy::attention_backward``) with fake (meta) implementations and ``register_autograd``, so
``loss.backward()`` works and ``torch.compile(fullgraph=True)`` traces a model that calls them without a
graph break. The kernels read torch's tensors through CuPy views of their memory and write outputs that
torch allocated (no copies; the memory stays with torch's caching allocator), on torch's current CUDA
stream of the tensors' device (wrapped with ``cupy.cuda.Stream.from_external``), so they order correctly
with the surrounding torch work, inside ``torch.cuda.stream(...)`` too. Their temporaries (the backward's
fp32 dQ buffer, delta and counters, copies of layouts a kernel cannot read) come from torch's allocator
as well, so that under torch's CUDA graphs (``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``)
they live in the graph's own memory pool for as long as the graph does.

Import this module only where torch is installed (``pip install "flashcupy[torch]"``); nothing else in
flashcupy imports torch.
"""
from __future__ import annotations

from typing import Optional

import cupy
import numpy as np
import torch

from . import _launch
from ._checks import backward_problem, forward_problem, numpy_dtype

__all__ = ["attention"]

_FWD_KNOBS = ("block_m", "block_n", "accum", "kernel", "ablate")
_BWD_KNOBS = ("accum", "kernel", "deterministic")  # the backward runs its own default tiles
LAYOUTS = ("bhnd", "bnhd")


class _TorchStream:
    """A torch stream seen through the CUDA stream protocol (``__cuda_stream__``) that CuPy's
    ``Stream.from_external`` reads; it holds the torch stream, which therefore outlives the wrapper."""

    __slots__ = ("stream",)

    def __init__(self, stream):
        self.stream = stream

    def __cuda_stream__(self):
        return (0, self.stream.cuda_stream)


_STREAMS: dict = {}


def _stream(device: torch.device) -> cupy.cuda.Stream:
    """torch's current stream on ``device`` as a CuPy stream (wrappers remembered per stream handle)."""
    ts = torch.cuda.current_stream(device)
    key = (ts.device_index, ts.cuda_stream)
    cs = _STREAMS.get(key)
    if cs is None:
        with cupy.cuda.Device(ts.device_index):
            cs = cupy.cuda.Stream.from_external(_TorchStream(ts))
        if len(_STREAMS) >= 64:
            _STREAMS.clear()
        _STREAMS[key] = cs
    return cs


_NP_DTYPES = {torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32),
              torch.bfloat16: numpy_dtype("bf16"), torch.int32: np.dtype(np.int32),
              torch.uint8: np.dtype(np.uint8)}
_TORCH_DTYPES = {v: k for k, v in _NP_DTYPES.items()}


class _TorchScratch:
    """Where the kernels' temporaries come from in the bridge (``_launch._Scratch``'s interface): torch's
    caching allocator on ``device``, whose blocks are reused in the order of the current stream, the one
    the kernels run on. Under torch's stream capture they come from the graph's private pool, which keeps
    them for as long as the graph lives; CuPy's pool would give them to other arrays after the call (and
    may not even allocate there: a cudaMalloc inside torch's capture is refused)."""

    __slots__ = ("device", "capturing")

    def __init__(self, device: torch.device):
        self.device = device
        self.capturing = torch.cuda.is_current_stream_capturing()

    def empty(self, shape, dtype):
        return _cp(torch.empty(shape, dtype=_TORCH_DTYPES[np.dtype(dtype)], device=self.device))

    def zeros(self, shape, dtype):
        return _cp(torch.zeros(shape, dtype=_TORCH_DTYPES[np.dtype(dtype)], device=self.device))

    def copy(self, x):
        out = self.empty(x.shape, x.dtype)
        cupy.copyto(out, x)
        return out


def _cp(t: torch.Tensor):
    """A CuPy view of a CUDA tensor's memory (no copy; the view holds the tensor). Built directly from the
    tensor's address, shape and strides: DLPack's import costs 16 us a tensor on the H200, this about 5;
    both need the kernels to run on torch's current stream, as they do here. Other dtypes and empty
    tensors go through DLPack (the checks then say what is allowed)."""
    dt = _NP_DTYPES.get(t.dtype)
    if dt is None or t.numel() == 0:
        return cupy.from_dlpack(t.detach())
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    mem = cupy.cuda.UnownedMemory(t.data_ptr(), span * dt.itemsize, t, t.device.index)
    return cupy.ndarray(tuple(t.shape), dt, cupy.cuda.MemoryPointer(mem, 0),
                        tuple(st * dt.itemsize for st in t.stride()))


@torch.library.custom_op("flashcupy::attention", mutates_args=(), device_types="cuda")
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: Optional[float],
                  block_m: Optional[int], block_n: Optional[int], accum: str, kernel: str,
                  ablate: Optional[str], deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # ``deterministic`` is the backward's knob, kept by the forward for its autograd context. The outputs
    # come from torch's allocator; the kernels write them through CuPy views.
    cq, ck, cv = _cp(q), _cp(k), _cp(v)
    p = forward_problem(cq, ck, cv, causal=causal, scale=scale, block_m=block_m, block_n=block_n, accum=accum,
                        kernel=kernel, ablate=ablate)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    with cupy.cuda.Device(q.device.index), _stream(q.device):
        _launch.forward(cq, ck, cv, p, o=_cp(o), lse=_cp(lse), scratch=_TorchScratch(q.device))
    return o, lse


@_attention_op.register_fake
def _(q, k, v, causal, scale, block_m, block_n, accum, kernel, ablate, deterministic):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("flashcupy::attention_backward", mutates_args=(), device_types="cuda")
def _attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           o: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor], causal: bool,
                           scale: Optional[float], accum: str, kernel: str,
                           deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # do may come with any strides (autograd hands o.mean()'s a stride-0 one): the launch copies what the
    # kernels cannot read
    arrays = [_cp(x) for x in (do, q, k, v, o, lse)]
    cdlse = None if dlse is None else _cp(dlse)
    p = backward_problem(*arrays, causal=causal, scale=scale, block_m=None, block_n=None, accum=accum,
                         kernel=kernel, deterministic=deterministic, dlse=cdlse)
    grads = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    with cupy.cuda.Device(q.device.index), _stream(q.device):
        _launch.backward(*arrays, p, deterministic=deterministic, grads=tuple(map(_cp, grads)), dlse=cdlse,
                         scratch=_TorchScratch(q.device))
    return grads


@_attention_backward_op.register_fake
def _(do, q, k, v, o, lse, dlse, causal, scale, accum, kernel, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, _, _, accum, kernel, ablate, deterministic = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.knobs = (causal, scale, accum, kernel, deterministic)
    ctx.ablate = ablate


def _no_backward(ablate) -> str:
    return (f"flashcupy.torch: ablate={ablate!r} has no backward: the broken forward is not the function "
            "attention_backward differentiates, so its gradients would be the intact attention's. Run the "
            "break without gradients (torch.no_grad(), or inputs that do not require grad)")


def _backward(ctx, do, dlse):
    if ctx.ablate is not None:
        raise RuntimeError(_no_backward(ctx.ablate))
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(do, q, k, v, o, lse, dlse, *ctx.knobs)
    return dq, dk, dv, None, None, None, None, None, None, None, None


torch.library.register_autograd("flashcupy::attention", _backward, setup_context=_setup_context)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None, *, layout: str = "bhnd", return_lse: bool = False,
              deterministic: bool = False, **knobs):
    """Differentiable flashcupy attention on CUDA tensors.

    ``layout="bhnd"`` (default): q is (B, Hq, Nq, D), k and v (B, Hkv, Nk, D), as in
    ``flashcupy.attention`` and torch SDPA; ``layout="bnhd"``: q is (B, Nq, Hq, D), k and v
    (B, Nk, Hkv, D), as in flash-attn's ``flash_attn_func``, read through strided views without copies,
    and the output comes back in the same layout (a view of a (B, H, N, D) buffer). The causal mask is
    bottom-right aligned when Nq != Nk (flash-attn's; SDPA's ``is_causal`` is top-left).

    ``knobs`` are ``flashcupy.attention``'s block_m, block_n, accum, kernel and ablate; the backward uses
    the same accum and kernel with its own default tiles, and ``deterministic`` as in
    ``flashcupy.attention_backward``. ``ablate`` (a broken forward) has no backward: with gradients
    enabled and an input that requires grad it raises ValueError.

    Any strides are accepted (``expand`` for GQA, storage offsets, stride-0 gradients from autograd);
    what a kernel family cannot read is copied once (``flashcupy.attention``'s docstring says when). The
    op can be captured in torch's CUDA graphs (``torch.cuda.graph``,
    ``torch.compile(mode="reduce-overhead")``): its temporaries come from the graph's memory pool.

    ``return_lse=True`` also returns the LSE, float32 (B, Hq, Nq) in both layouts (natural log of the
    softmax denominator); gradients flow through it too (d lse_i / d s_ij = P_ij, folded into the
    backward's delta; where the LSE is not used, autograd hands the backward a zero gradient, which costs
    one subtraction).
    """
    unknown = set(knobs) - set(_FWD_KNOBS)
    if unknown:
        raise TypeError(f"unknown knobs {sorted(unknown)}; allowed: {sorted(_FWD_KNOBS + _BWD_KNOBS)}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_cuda:
            raise TypeError(f"{name} must be a CUDA torch.Tensor, got "
                            f"{type(t).__name__ if not isinstance(t, torch.Tensor) else t.device}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    kw = {"block_m": None, "block_n": None, "accum": "fp32", "kernel": "auto", "ablate": None, **knobs}
    if kw["ablate"] is not None and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError(_no_backward(kw["ablate"]))
    if layout == "bnhd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    o, lse = _attention_op(q, k, v, causal, scale, kw["block_m"], kw["block_n"], kw["accum"], kw["kernel"],
                           kw["ablate"], deterministic)
    if layout == "bnhd":
        o = o.transpose(1, 2)
    return (o, lse) if return_lse else o

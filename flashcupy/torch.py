"""``flashcupy.torch.attention``: flashcupy's kernels on CUDA tensors, with autograd.

Two paths run the same two functions (``_forward``, ``_backward``), so they give the same bits:

* eager calls: an autograd node of their own (or, without gradients, the forward alone), without the
  dispatcher's custom-op machinery, whose alias checks, dynamo guards and generated autograd node cost
  about as much as a whole small call. That node is the compiled one (``_torch_node.cpp``: the launch
  plans run from C++, forward and backward) where it builds, else ``_EagerAttention``, a plain
  ``torch.autograd.Function``: the same bits;
* under ``torch.compile`` (and functorch transforms, torch function and dispatch modes): the custom
  operators ``flashcupy::attention`` and ``flashcupy::attention_backward``, with fake implementations and
  ``register_autograd``, so ``torch.compile(fullgraph=True)`` traces a model that calls them without a
  graph break and ``mode="reduce-overhead"`` replays them in CUDA graphs.

A call remembers its launch plan per signature of its tensors and knobs (as the CuPy entry points
remember their checks and plans): a known signature is not checked again, and its kernels are launched by
address on torch's current CUDA stream of the tensors' device, so they order with the surrounding torch
work, inside ``torch.cuda.stream(...)`` too. Outputs and temporaries (the backward's fp32 buffer, the
counters, contiguous copies of what a kernel cannot read) come from torch's caching allocator, so that
under torch's CUDA graphs they live in the graph's own memory pool for as long as the graph does. The
design and its measured host costs: ``docs/design/torch_bridge.md``.

Import this module only where torch is installed (``pip install "flashcupy[torch]"``); nothing else in
flashcupy imports torch.
"""
from __future__ import annotations

import sys
import threading
from typing import Optional

import cupy
import numpy as np

try:
    import torch
except ImportError as e:  # pragma: no cover - the torch extra
    raise ImportError("flashcupy.torch needs torch: pip install 'flashcupy[torch]'") from e

from . import _launch, _sinks, _torch_node
from ._checks import backward_problem, check_kernel_softcap, forward_problem, numpy_dtype
from ._variant import current_build, kernel_build
from .reference import check_window

__all__ = ["attention"]

_FWD_KNOBS = ("block_m", "block_n", "accum", "kernel", "ablate")
_NO_WINDOW = (-1, -1)  # window_size's default (a call that leaves it pays one identity test)
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

    __slots__ = ("device", "capturing", "keep")

    def __init__(self, device: torch.device):
        self.device = device
        self.capturing = None  # asked when a launch needs to know
        self.keep = []

    def is_capturing(self) -> bool:
        if self.capturing is None:
            self.capturing = torch.cuda.is_current_stream_capturing()
        return self.capturing

    def buffer(self, shape, dtype, zero: bool = False) -> int:
        make = torch.zeros if zero else torch.empty
        t = make(shape, dtype=_TORCH_DTYPES[np.dtype(dtype)], device=self.device)
        self.keep.append(t)
        return t.data_ptr()

    def empty(self, shape, dtype):
        """A CuPy view of a new tensor (``_launch._copy``'s destination)."""
        return _cp(torch.empty(shape, dtype=_TORCH_DTYPES[np.dtype(dtype)], device=self.device))


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


# --------------------------------------------------------------------------------------------------
# the calls: launch plans remembered per signature of the tensors and knobs, as the CuPy entry points
# remember their checks and plans; a call with a known signature checks nothing again, makes no CuPy
# objects and launches on torch's current stream by its raw handle. The first call of a signature makes
# its entry (CuPy views of the tensors, the checks, the plan); a call whose tensors start off the
# 16-byte grid takes the general path (views, checks, ``_launch.forward`` / ``backward``, copies).

_FORWARD_SIGNATURES: dict = {}
_BACKWARD_SIGNATURES: dict = {}
_SIGNATURE_LIMIT = 1024  # signatures remembered per direction; past that the memo starts over


def _signature(tensors, knobs) -> tuple:
    """What a call's checks and plan read: every tensor's shape, strides, dtype and device, every knob's
    value and type, and the enclosing ``kernel_build``."""
    return (*(x for t in tensors for x in (t.shape, t.stride(), t.dtype, t.get_device())), knobs,
            tuple(map(type, knobs)), current_build())


class _Entry:
    """A remembered signature: its checked Problem, its launch plan and which inputs the plan reads as
    contiguous copies (those whose strides the kernels cannot read: one ``contiguous()`` each, on torch's
    side; None: none). A forward entry whose plan reads its inputs in place also holds the plan as a
    program of the compiled node (``program``; None without one) and, made by the first call with
    gradients, the backward's program per ``deterministic`` (``backward``)."""

    __slots__ = ("problem", "plan", "copies", "program", "backward")

    def __init__(self, problem, plan, copies, program=None):
        self.problem, self.plan, self.copies = problem, plan, (copies if any(copies) else None)
        self.program, self.backward = program, {}


def _entry(memo: dict, key, make) -> _Entry:
    """The entry of signature ``key`` in ``memo``, made by ``make`` on a miss (and not remembered where a
    knob is unhashable: the checks then say what is allowed)."""
    try:
        entry = memo.get(key)
    except TypeError:
        return make()
    if entry is None:
        entry = make()
        if len(memo) >= _SIGNATURE_LIMIT:
            memo.clear()
        memo[key] = entry
    return entry


def _copies(views, tmas) -> tuple[tuple, tuple]:
    """Per view (and whether TMA reads it): whether the kernels need a contiguous copy of it, and the
    strides they then read."""
    copies = tuple(not _launch._strides_readable(x.shape, x.strides, x.itemsize, tma)
                   for x, tma in zip(views, tmas))
    strides = tuple(_launch._contiguous_strides(x.shape, x.itemsize) if c else x.strides
                    for x, c in zip(views, copies))
    return copies, strides


def _contiguous_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized C-contiguous tensor of t's shape, dtype and device (``empty_like`` keeps the
    strides of a permuted t, and costs half of ``torch.empty``'s keyword parsing where t is contiguous)."""
    return torch.empty_like(t) if t.is_contiguous() else t.new_empty(t.shape)


def _forward_entry(q, k, v, knobs, alibi: bool = False) -> _Entry:
    """The remembered entry of a forward call (``knobs``: causal, scale, block_m, block_n, accum, kernel,
    ablate, window, softcap; ``alibi``: whether the call has ALiBi slopes, which the compiled node does not
    take: no program then)."""

    def make() -> _Entry:
        causal, scale, block_m, block_n, accum, kernel, ablate, window, softcap = knobs
        views = tuple(map(_cp, (q, k, v)))
        p = forward_problem(*views, causal=causal, scale=scale, block_m=block_m, block_n=block_n,
                            accum=accum, kernel=kernel, ablate=ablate, window_size=window, softcap=softcap,
                            alibi=alibi)
        copies, strides = _copies(views, (p.variant.fam.kind == "wgmma",) * 3)
        with cupy.cuda.Device(p.device):
            plan = _launch.forward_plan(p, *strides, views[0].itemsize)
            node = None if any(copies) or alibi else _torch_node.module()
            return _Entry(p, plan, copies, None if node is None else node.program(**plan.program()))

    return _entry(_FORWARD_SIGNATURES, _signature((q, k, v), (*knobs, alibi)), make)


def _alibi_raw(slopes, p, scratch):
    """The kernels' slopes (``_launch.alibi_raw``: slope / scale, (B, Hq) float32) of a checked slopes
    tensor, made on torch's current stream from ``scratch``; None without slopes."""
    if slopes is None:
        return None
    with cupy.cuda.Device(slopes.get_device()), _stream(slopes.device):
        return _launch.alibi_raw(_cp(slopes.detach()), p, scratch)


def _forward(q, k, v, causal, scale, block_m, block_n, accum, kernel, ablate, window, softcap, sinks=None,
             slopes=None):
    """(o, lse) of ``flashcupy.attention`` on tensors (the custom op's and the eager path's body;
    ``window``: a checked (left, right) pair; ``softcap``: a float; ``sinks``: a checked (Hq,) tensor or
    None, merged by ``flashcupy._sinks.apply`` as on CuPy; ``slopes``: checked ALiBi slopes (Hq,) or
    (B, Hq), or None)."""
    knobs = (causal, scale, block_m, block_n, accum, kernel, ablate, window, softcap)
    entry = _forward_entry(q, k, v, knobs, slopes is not None)
    if entry.program is not None and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        o, lse = _torch_node.module().forward(q, k, v, entry.program)  # on q's device, from C++
        return (o, lse) if sinks is None else _merge_sinks(o, lse, sinks)
    device = q.get_device()
    if torch._C._cuda_getDevice() != device:  # the driver launches on the current device's context
        with torch.cuda.device(device):
            return _forward(q, k, v, *knobs, sinks, slopes)
    if entry.copies:
        q, k, v = (t.contiguous() if c else t for t, c in zip((q, k, v), entry.copies))
    o = _contiguous_like(q)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
    scratch = _TorchScratch(q.device)
    if (qp | kp | vp) & 15:  # off the 16-byte grid: the general path, which copies
        with _stream(q.device):
            _launch.forward(_cp(q), _cp(k), _cp(v), entry.problem, o=_cp(o), lse=_cp(lse), scratch=scratch,
                            alibi=None if slopes is None else _cp(slopes.detach()))
    else:
        raw = _alibi_raw(slopes, entry.problem, scratch)  # (held until the launch)
        entry.plan.run(torch._C._cuda_getCurrentRawStream(device), qp, kp, vp, o.data_ptr(), lse.data_ptr(),
                       scratch, 0 if raw is None else raw.data.ptr)
    return (o, lse) if sinks is None else _merge_sinks(o, lse, sinks)


def _sinks32(sinks: torch.Tensor) -> torch.Tensor:
    return sinks.detach().to(torch.float32).contiguous()


def _merge_sinks(o, lse, sinks):
    """The forward's (o, lse), C-contiguous and its own, with the sinks merged in place by
    ``flashcupy._sinks.apply`` on torch's current stream (the CuPy path's kernels, so the same bits)."""
    with cupy.cuda.Device(o.get_device()), _stream(o.device):
        _sinks.apply(_cp(o), _cp(lse), _cp(_sinks32(sinks)), scratch=_TorchScratch(o.device))
    return o, lse


def _backward(do, q, k, v, o, lse, dlse, causal, scale, accum, kernel, deterministic, window, softcap,
              sinks=None, slopes=None):
    """(dq, dk, dv) of ``flashcupy.attention_backward`` on tensors (``dlse`` may be None), and d sinks
    (float32 (Hq,), ``flashcupy._sinks.grad``) after them where ``sinks`` is given (o, lse: the sink
    forward's, as on CuPy); ``slopes``: the forward's ALiBi slopes or None (no gradient of theirs)."""
    tensors = (do, q, k, v, o, lse) if dlse is None else (do, q, k, v, o, lse, dlse)

    def make() -> _Entry:
        views = [_cp(x) for x in tensors]
        dlse_view = views[6] if dlse is not None else None
        p = backward_problem(*views[:6], causal=causal, scale=scale, block_m=None, block_n=None,
                             accum=accum, kernel=kernel, deterministic=deterministic, dlse=dlse_view,
                             window_size=window, softcap=softcap, alibi=slopes is not None)
        tma = p.variant.fam.kind == "wgmma"
        copies, strides = _copies(views[:5], (tma,) * 4 + (False,))  # o: read by the prep kernel alone
        # lse and dlse: read as rows, C-contiguous
        copies += tuple(not x.flags.c_contiguous for x in views[5:])
        with cupy.cuda.Device(p.device):
            return _Entry(p, _launch.backward_plan(p, deterministic, strides, views[1].itemsize), copies)

    knobs = (causal, scale, accum, kernel, deterministic, window, softcap)
    entry = _entry(_BACKWARD_SIGNATURES, _signature(tensors, (*knobs, slopes is not None)), make)
    device = q.get_device()
    if torch._C._cuda_getDevice() != device:
        with torch.cuda.device(device):
            return _backward(do, q, k, v, o, lse, dlse, *knobs, sinks, slopes)
    if entry.copies:
        do, q, k, v, o, lse, *dlse_ = (t.contiguous() if c else t for t, c in zip(tensors, entry.copies))
        dlse = dlse_[0] if dlse_ else None
    grads = (_contiguous_like(q), _contiguous_like(k), _contiguous_like(v))
    ptrs = (do.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr())
    rows = (lse.data_ptr(), 0 if dlse is None else dlse.data_ptr())
    scratch = _TorchScratch(q.device)
    if (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4]) & 15 or (rows[0] | rows[1]) & 3:
        # off the 16-byte grid: the general path, which copies
        with _stream(q.device):
            _launch.backward(*map(_cp, (do, q, k, v, o, lse)), entry.problem, deterministic=deterministic,
                             grads=tuple(map(_cp, grads)), dlse=None if dlse is None else _cp(dlse),
                             scratch=scratch, alibi=None if slopes is None else _cp(slopes.detach()))
    else:
        raw = _alibi_raw(slopes, entry.problem, scratch)  # (held until the launches)
        entry.plan.run(torch._C._cuda_getCurrentRawStream(device), *ptrs, *rows, grads[0].data_ptr(),
                       grads[1].data_ptr(), grads[2].data_ptr(), scratch, 0 if raw is None else raw.data.ptr)
    if sinks is None:
        return grads
    dz = q.new_empty(sinks.shape, dtype=torch.float32)
    with cupy.cuda.Device(device), _stream(q.device):
        _sinks.grad(_cp(do), _cp(o), _cp(lse), _cp(_sinks32(sinks)), None if dlse is None else _cp(dlse),
                    scratch=_TorchScratch(q.device), out=_cp(dz))
    return (*grads, dz)


# --------------------------------------------------------------------------------------------------
# the custom operators: what torch.compile traces, opcheck checks and CUDA graphs of compiled code run


@torch.library.custom_op("flashcupy::attention", mutates_args=(), device_types="cuda")
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: Optional[float],
                  block_m: Optional[int], block_n: Optional[int], accum: str, kernel: str,
                  ablate: Optional[str], deterministic: bool, window_left: int = -1,
                  window_right: int = -1, softcap: float = 0.0, sinks: Optional[torch.Tensor] = None,
                  alibi_slopes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    # ``deterministic`` is the backward's knob, kept by the forward for its autograd context
    if alibi_slopes is not None:  # (the operator called directly: ``attention`` checked them already)
        _check_op_slopes(alibi_slopes, q)
    return _forward(q, k, v, causal, scale, block_m, block_n, accum, kernel, ablate,
                    (window_left, window_right), softcap, sinks, alibi_slopes)


@_attention_op.register_fake
def _(q, k, v, causal, scale, block_m, block_n, accum, kernel, ablate, deterministic, window_left=-1,
      window_right=-1, softcap=0.0, sinks=None, alibi_slopes=None):
    if alibi_slopes is not None:
        _check_op_slopes(alibi_slopes, q)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("flashcupy::attention_backward", mutates_args=(), device_types="cuda")
def _attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           o: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor], causal: bool,
                           scale: Optional[float], accum: str, kernel: str, deterministic: bool,
                           window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                           sinks: Optional[torch.Tensor] = None,
                           alibi_slopes: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    # do may come with any strides (autograd hands o.mean()'s a stride-0 one): what the kernels cannot
    # read is copied. [dq, dk, dv], and d sinks (float32) after them where sinks is given
    if alibi_slopes is not None:
        _check_op_slopes(alibi_slopes, q)
    return list(_backward(do, q, k, v, o, lse, dlse, causal, scale, accum, kernel, deterministic,
                          (window_left, window_right), softcap, sinks, alibi_slopes))


@_attention_backward_op.register_fake
def _(do, q, k, v, o, lse, dlse, causal, scale, accum, kernel, deterministic, window_left=-1,
      window_right=-1, softcap=0.0, sinks=None, alibi_slopes=None):
    grads = [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)]
    return grads if sinks is None else [*grads, q.new_empty(sinks.shape, dtype=torch.float32)]


def _backward_op(do, q, k, v, o, lse, dlse, causal, scale, accum, kernel, deterministic, window, softcap,
                 sinks=None, slopes=None):
    """``_backward``'s arguments through the backward operator (whose schema takes the window's sides as
    two ints)."""
    return _attention_backward_op(do, q, k, v, o, lse, dlse, causal, scale, accum, kernel, deterministic,
                                  *window, softcap, sinks, slopes)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, _, _, accum, kernel, ablate, deterministic, *rest = inputs
    o, lse = output
    sinks = rest[3] if len(rest) > 3 else None
    slopes = rest[4] if len(rest) > 4 else None
    ctx.save_for_backward(q, k, v, o, lse, sinks, slopes)
    window = tuple(rest[:2]) if len(rest) >= 2 else (-1, -1)
    ctx.knobs = (causal, scale, accum, kernel, deterministic, window, rest[2] if len(rest) > 2 else 0.0)
    ctx.ablate = ablate


def _no_backward(ablate) -> str:
    return (f"flashcupy.torch: ablate={ablate!r} has no backward: the broken forward is not the function "
            "attention_backward differentiates, so its gradients would be the intact attention's. Run the "
            "break without gradients (torch.no_grad(), or inputs that do not require grad)")


def _backward_of_op(ctx, do, dlse):
    if ctx.ablate is not None:
        raise RuntimeError(_no_backward(ctx.ablate))
    q, k, v, o, lse, sinks, slopes = ctx.saved_tensors
    # the backward kernels need o and lse alone, not the sinks (needs_input_grad stops at the last
    # argument passed that is not its default, so it reaches the sinks where they are given)
    if sinks is not None and not ctx.needs_input_grad[14]:
        sinks = None
    dq, dk, dv, *dz = _backward_op(do, q, k, v, o, lse, dlse, *ctx.knobs, sinks, slopes)
    dz = dz[0].to(sinks.dtype) if dz else None
    if len(ctx.needs_input_grad) > 15 and ctx.needs_input_grad[15]:  # (``attention`` refuses them earlier)
        raise ValueError(_NO_SLOPE_GRAD)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None, dz, None


torch.library.register_autograd("flashcupy::attention", _backward_of_op, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------------
# eager autograd: the same two functions under a plain autograd.Function, without the dispatcher's
# custom-op machinery (its alias checks, dynamo guards and generated autograd node cost about as much as
# the whole attention call at small shapes); gradients of unused outputs arrive as None (no zeros made)


class _EagerAttention(torch.autograd.Function):
    """``apply(q, k, v, sinks, knobs, slopes)``, knobs = (causal, scale, block_m, block_n, accum, kernel,
    ablate, window, softcap, deterministic): one argument for the ten, since ``apply`` inspects each
    argument it is given; ``sinks``: a checked (Hq,) tensor or None; ``slopes``: checked ALiBi slopes
    (no gradient) or None."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, knobs, slopes=None):
        causal, scale, block_m, block_n, accum, kernel, ablate, window, softcap, deterministic = knobs
        o, lse = _forward(q, k, v, causal, scale, block_m, block_n, accum, kernel, ablate, window, softcap,
                          sinks, slopes)
        ctx.save_for_backward(q, k, v, o, lse, sinks, slopes)
        ctx.knobs = (causal, scale, accum, kernel, deterministic, window, softcap)
        ctx.ablate = ablate
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        # gradients computed without a graph: under create_graph=True (grad mode on here) they come back
        # through once_differentiable, so that differentiating them raises instead of giving zeros; the
        # usual backward skips its wrapping (17 us a call on an H100)
        if torch.is_grad_enabled():
            return _eager_grads_once(ctx, do, dlse)
        return _eager_grads(ctx, do, dlse)


def _eager_grads(ctx, do, dlse):
    if ctx.ablate is not None:
        raise RuntimeError(_no_backward(ctx.ablate))
    if do is None and dlse is None:
        return None, None, None, None, None, None
    q, k, v, o, lse, *extra = ctx.saved_tensors  # (+ sinks and slopes, each maybe None: the Python node)
    sinks, slopes = (extra + [None, None])[:2]
    # d sinks where the sinks need it (the backward kernels read o and lse alone, sinks merged)
    sinks = sinks if sinks is not None and ctx.needs_input_grad[3] else None
    if do is None:
        do = torch.zeros_like(o)
    # a backward run under a mode or compiled autograd goes through the operator those can see
    backward = _backward if _plain_torch() else _backward_op
    dq, dk, dv, *dz = backward(do, q, k, v, o, lse, dlse, *ctx.knobs, sinks, slopes)
    return dq, dk, dv, dz[0].to(sinks.dtype) if dz else None, None, None


_eager_grads_once = torch.autograd.function.once_differentiable(_eager_grads)


# --------------------------------------------------------------------------------------------------
# the compiled node (flashcupy/_torch_node.cpp, built by _torch_node): the forward's and the backward's
# plans written out as programs, run from C++ forward and backward; the Python node where it is not built


def _compiled_autograd() -> bool:
    """Whether torch's compiled autograd may trace this call's backward (enabled now, or by the dynamo
    config that ``torch.compile`` reads): it cannot trace the compiled node, whose context holds its
    backward program; the Python node it traces."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    config = sys.modules.get("torch._dynamo.config")
    return bool((ca is not None and getattr(ca, "compiled_autograd_enabled", False))
                or (config is not None and getattr(config, "compiled_autograd", False)))


def _autograd(q, k, v, knobs, sinks=None, slopes=None):
    """(o, lse) of an eager call with gradients: the compiled node where the forward's entry has a
    program, q, k, v start on the 16-byte grid, there are no sinks or ALiBi slopes and compiled autograd
    is off; ``_EagerAttention`` otherwise (the same bits)."""
    if sinks is not None or slopes is not None:
        return _EagerAttention.apply(q, k, v, sinks, knobs, slopes)
    entry = _forward_entry(q, k, v, knobs[:-1])
    if entry.program is None or (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15 or _compiled_autograd():
        return _EagerAttention.apply(q, k, v, None, knobs)
    deterministic = knobs[-1]
    bwd = entry.backward.get(deterministic)
    if bwd is None:
        bwd = entry.backward[deterministic] = _backward_program(q, k, v, knobs)
    return tuple(_torch_node.module().apply(q, k, v, entry.program, bwd))


_NODE_KNOBS: list = []  # the backward knobs of the compiled node's programs, by index (one per distinct
_NODE_KNOB_INDEX: dict = {}  # knob tuple: few)
_NODE_KNOB_LOCK = threading.Lock()


def _knob_index(bwd_knobs) -> int:
    with _NODE_KNOB_LOCK:
        index = _NODE_KNOB_INDEX.get(bwd_knobs)
        if index is None:
            index = _NODE_KNOB_INDEX[bwd_knobs] = len(_NODE_KNOBS)
            _NODE_KNOBS.append(bwd_knobs)
        return index


def _backward_program(q, k, v, knobs):
    """The compiled node's backward program for a forward entry's call: the backward plan with the
    gradient of o and o itself C-contiguous (the node's own o is; the node copies a gradient that is
    not), lse C-contiguous, of the package's own kernels (as the Python node's backward, which runs on
    autograd's thread, outside any ``kernel_build`` block). Where the checks refuse, the plan cannot
    read q, k, v in place or cannot be made, a program without launches: every backward then takes the
    fallback, which copies, or raises the error, as the Python node does."""
    causal, scale, _, _, accum, kernel, _, window, softcap, deterministic = knobs
    spec = dict(forward=False, launches=[], maps=[], dynamic=False, dq_floats=0, delta_floats=0, sem_shape=[])
    o = _contiguous_like(q)
    views = tuple(map(_cp, (o, q, k, v, o, q.new_empty(q.shape[:3], dtype=torch.float32))))
    try:
        with kernel_build():
            p = backward_problem(*views, causal=causal, scale=scale, block_m=None, block_n=None,
                                 accum=accum, kernel=kernel, deterministic=deterministic, window_size=window,
                                 softcap=softcap)
            copies, strides = _copies(views[:5], (p.variant.fam.kind == "wgmma",) * 4 + (False,))
            if not any(copies):
                with cupy.cuda.Device(p.device):
                    spec = _launch.backward_plan(p, deterministic, strides, views[1].itemsize).program()
    except (ValueError, TypeError, RuntimeError):  # checks, limits, NVRTC: raised again by the fallback
        pass  # when a backward runs, as the Python node raises them
    index = _knob_index((causal, scale, accum, kernel, deterministic, window, softcap))
    return _torch_node.module().program(**spec, bwd_knobs=index)


class _SavedContext:
    """What ``_eager_grads`` reads of an autograd context, for the compiled node's fallback."""

    __slots__ = ("saved_tensors", "knobs", "ablate")

    def __init__(self, saved, knobs):
        self.saved_tensors, self.knobs, self.ablate = saved, knobs, None


def _node_fallback(index, do, dlse, q, k, v, o, lse):
    """The compiled node's backward where its program does not run: a gradient of o it does not read in
    place (stride 0, another layout, off the 16-byte grid, missing), or ``create_graph=True`` (grad
    mode on: the gradients come back through ``once_differentiable``, so differentiating them raises).
    The Python node's code, called from the node with the GIL taken."""
    ctx = _SavedContext((q, k, v, o, lse), _NODE_KNOBS[index])
    grads = (_eager_grads_once if torch.is_grad_enabled() else _eager_grads)(ctx, do, dlse)
    return list(grads[:3])


def _plain_torch() -> bool:
    """Whether nothing above this call needs to see the custom operators: no torch.compile (dynamo) or
    TorchScript tracing, no functorch transform, no torch function or dispatch mode (FlopCounterMode,
    ``with torch.device(...)``, compiled autograd's tracing). Elsewhere the operators run."""
    return (not torch.compiler.is_compiling() and not torch._C._is_tracing()
            and not torch._C._are_functorch_transforms_active() and not torch._C._len_torch_dispatch_stack()
            and not torch._C._len_torch_function_stack())


def _eager(q, k, v) -> bool:
    """Whether a call may bypass the custom operator: plain CUDA tensors, and ``_plain_torch()``."""
    return (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
            and _plain_torch())


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None, *, layout: str = "bhnd", return_lse: bool = False,
              deterministic: bool = False, window_size: tuple[int, int] = _NO_WINDOW, softcap: float = 0.0,
              sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None, **knobs):
    """Differentiable flashcupy attention on CUDA tensors.

    ``layout="bhnd"`` (default): q is (B, Hq, Nq, D), k and v (B, Hkv, Nk, D), as in
    ``flashcupy.attention`` and torch SDPA; ``layout="bnhd"``: q is (B, Nq, Hq, D), k and v
    (B, Nk, Hkv, D), as in flash-attn's ``flash_attn_func``, read through strided views without copies,
    and the output comes back in the same layout (a view of a (B, H, N, D) buffer). The causal mask is
    bottom-right aligned when Nq != Nk (flash-attn's; SDPA's ``is_causal`` is top-left).

    ``window_size`` (left, right): a sliding window as in ``flashcupy.attention`` (bottom-right aligned,
    with ``causal`` the window (left, 0)), forward and backward, in every family. ``softcap``: c tanh(S / c)
    on the scaled scores as in ``flashcupy.attention`` (0: off), forward and backward, in every family.

    ``sinks``: per-head sink logits (Hq,), a floating CUDA tensor on q's device, as in
    ``flashcupy.attention``, with its gradient (in the sinks' dtype): the operators merge them and form
    d sinks with ``flashcupy._sinks``'s kernels, as the CuPy entry points do (the same bits), eager and
    compiled. (Eager calls with sinks run ``_EagerAttention``, not the compiled node. The merge is not
    written in torch ops on purpose: torch 2.11's inductor, with comprehensive padding, compiled that
    merge's backward into a reduction that read a buffer with padded strides it had written dense,
    docs/design/torch_bridge.md.)

    ``alibi_slopes``: ALiBi slopes (Hq,) or (B, Hq), a float32 or float64 CUDA tensor on q's device, as in
    ``flashcupy.attention`` (S_ij - slope |i + Nk - Nq - j| on the scaled scores), forward and backward,
    in every 16-bit family. They are constants here, as in flash_attn_func: slopes that require grad are
    refused (detach them); their values are not checked (finite), which would synchronize. Eager calls
    with slopes run ``_EagerAttention``.

    ``knobs`` are ``flashcupy.attention``'s block_m, block_n, accum, kernel and ablate; the backward uses
    the same accum and kernel with its own default tiles, and ``deterministic`` as in
    ``flashcupy.attention_backward``. ``ablate`` (a broken forward) has no backward: with gradients
    enabled and an input that requires grad it raises ValueError.

    Eager calls run an autograd node of their own (compiled C++ where it builds: ``_torch_node``, the
    environment variable ``FLASHCUPY_TORCH_NODE``); under torch.compile, TorchScript tracing, functorch
    transforms and torch function or dispatch modes (``torch.set_default_device`` and ``with
    torch.device(...)`` are such modes) the custom operators run instead: the same results, with the
    dispatcher's host cost (``docs/design/torch_bridge.md``).

    Any strides are accepted (``expand`` for GQA, storage offsets, stride-0 gradients from autograd);
    what a kernel family cannot read is copied once (``flashcupy.attention``'s docstring says when). The
    op can be captured in torch's CUDA graphs (``torch.cuda.graph``,
    ``torch.compile(mode="reduce-overhead")``): its temporaries come from the graph's memory pool.

    ``return_lse=True`` also returns the LSE, float32 (B, Hq, Nq) in both layouts (natural log of the
    softmax denominator); gradients flow through it too (d lse_i / d s_ij = P_ij, folded into the
    backward's delta; where the LSE is not used, autograd hands the backward a zero gradient, which costs
    one subtraction).
    """
    if knobs and not set(knobs) <= set(_FWD_KNOBS):
        raise TypeError(f"unknown knobs {sorted(set(knobs) - set(_FWD_KNOBS))}; allowed: "
                        f"{sorted(_FWD_KNOBS + _BWD_KNOBS)}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_cuda:
            raise TypeError(f"{name} must be a CUDA torch.Tensor, got "
                            f"{type(t).__name__ if not isinstance(t, torch.Tensor) else t.device}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    ablate = knobs.get("ablate")
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (sinks is not None and sinks.requires_grad))
    if ablate is not None and grad:
        raise ValueError(_no_backward(ablate))
    window = _NO_WINDOW if window_size is _NO_WINDOW or window_size is None else check_window(window_size)
    if not (type(softcap) is float and softcap == 0.0) and not torch.compiler.is_compiling():
        softcap = check_kernel_softcap(softcap)  # (traced, a float may be symbolic: the operator checks it)
    if q.dim() == 4:  # (other ranks: the problem's checks name q)
        heads = q.shape[2] if layout == "bnhd" else q.shape[1]
        if sinks is not None:
            _check_sinks(sinks, heads, q.device)
        if alibi_slopes is not None:
            _check_alibi_slopes(alibi_slopes, q.shape[0], heads, q.device)
    if layout == "bnhd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    fwd = (causal, scale, knobs.get("block_m"), knobs.get("block_n"), knobs.get("accum", "fp32"),
           knobs.get("kernel", "auto"), ablate)
    if not _eager(q, k, v):
        o, lse = _attention_op(q, k, v, *fwd, deterministic, *window, softcap, sinks, alibi_slopes)
    elif grad:
        o, lse = _autograd(q, k, v, (*fwd, window, softcap, deterministic), sinks, alibi_slopes)
    else:
        o, lse = _forward(q, k, v, *fwd, window, softcap, sinks, alibi_slopes)
    if layout == "bnhd":
        o = o.transpose(1, 2)
    return (o, lse) if return_lse else o


_NO_SLOPE_GRAD = ("alibi_slopes has no gradient in flashcupy (constants, as in flash_attn_func): pass "
                  "alibi_slopes.detach()")


def _check_op_slopes(slopes, q) -> None:
    """The custom operators' check of their slopes (q in (B, Hq, N, D); another rank is the problem
    checks' to name)."""
    if q.dim() == 4:
        _check_alibi_slopes(slopes, q.shape[0], q.shape[1], q.device, grad=False)


def _check_alibi_slopes(slopes, batch: int, heads: int, device, grad: bool = True) -> None:
    """alibi_slopes: a float32 or float64 (Hq,) or (B, Hq) tensor on the inputs' device (that does not
    require grad, with ``grad``: the autograd entry's check); else TypeError/ValueError naming it."""
    if not isinstance(slopes, torch.Tensor) or slopes.device != device:
        raise TypeError(f"alibi_slopes must be a torch.Tensor on {device}, got "
                        f"{slopes.device if isinstance(slopes, torch.Tensor) else type(slopes).__name__}")
    if slopes.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"alibi_slopes must be float32 or float64, got {slopes.dtype}")
    # one comparison per dimension: torch 2.11's Dynamo misjudged ``tuple(shape) in (...)`` (a (2, 4)
    # refused against (B, Hq) = (2, 4) under fullgraph compile)
    if not ((slopes.dim() == 1 and slopes.shape[0] == heads)
            or (slopes.dim() == 2 and slopes.shape[0] == batch and slopes.shape[1] == heads)):
        raise ValueError(f"alibi_slopes must have shape (Hq,) = ({heads},) or (B, Hq) = ({batch}, {heads}); "
                         f"got {tuple(slopes.shape)}")
    if grad and slopes.requires_grad and torch.is_grad_enabled():
        raise ValueError(_NO_SLOPE_GRAD)


def _check_sinks(sinks, heads: int, device) -> None:
    """sinks: a floating (Hq,) tensor on the inputs' device; else TypeError/ValueError naming it."""
    if not isinstance(sinks, torch.Tensor) or sinks.device != device:
        raise TypeError(f"sinks must be a torch.Tensor on {device}, got "
                        f"{sinks.device if isinstance(sinks, torch.Tensor) else type(sinks).__name__}")
    if not sinks.is_floating_point() or tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must be a floating tensor of shape (Hq,) = ({heads},), got {sinks.dtype} "
                         f"{tuple(sinks.shape)}")


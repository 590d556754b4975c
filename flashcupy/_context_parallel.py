"""Context parallelism over a torch.distributed process group: the bodies of
``flashcupy.parallel.ring_attention`` and ``ulysses_attention``.

Ring attention.
The arithmetic is ``flashcupy.parallel.simulate_ring``'s, rank by rank: the same chunk-pair calls of
``flashcupy.attention`` / ``attention_backward``, the same fold of each query chunk's parts in the
ring's order (``merge_states(form="logsigmoid")``, one part at a time, the running output held in
``state_dtype``), the same roundings of the gradient accumulators (``grad_dtype``). So on the same inputs
the distributed ring gives ``simulate_ring``'s bits, which the tests check on CPU (gloo, the NumPy twin)
and on GPUs (NCCL, the kernels).

Tensors are the transport; the arithmetic runs on array views of them without copies (NumPy for CPU
tensors, where the twin runs; CuPy for CUDA tensors, where the kernels run on torch's current stream).
Each step posts the K/V block's transfer to the next rank (``batch_isend_irecv``) before the step's
chunk pairs, so the transfer overlaps them; the backward sends the block's dK/dV after its pairs have
added to them, and one last transfer hands each block's dK/dV back to its owner.

Ulysses attention (DeepSpeed-Ulysses' scheme): an all-to-all turns the sequence shards of all heads into
the whole sequence of a group of heads (H / W heads a rank), one ``flashcupy.attention`` call runs there,
and a second all-to-all turns the output back into sequence shards; the backward does the same with
the gradients. Attention is per head, so every rank's shard is the bits of one call over the whole
sequence (the tests check it).

This module imports torch; ``flashcupy.parallel`` imports it only when one of the two is called.
"""
from __future__ import annotations

import pickle

import numpy as np
import torch
import torch.distributed as dist

from ._checks import numpy_dtype
from ._merge import merge_states
from .parallel import zigzag_chunks

_NAMES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
_TORCH = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
KNOBS = ("kernel", "accum", "scale")


def _view(t: torch.Tensor):
    """An array view of a tensor's memory (no copy): CuPy for a CUDA tensor, NumPy otherwise."""
    if t.is_cuda:
        from .torch import _cp

        return _cp(t)
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(numpy_dtype("bf16"))
    return t.numpy()


def _from(a, like: torch.Tensor) -> torch.Tensor:
    """A new tensor on ``like``'s device holding array ``a`` (a copy, in a's dtype)."""
    dtypes = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
              numpy_dtype("bf16"): torch.bfloat16}
    out = torch.empty(a.shape, dtype=dtypes[np.dtype(a.dtype)], device=like.device)
    _view(out)[...] = a
    return out


def _xp(t: torch.Tensor):
    if t.is_cuda:
        import cupy

        return cupy
    return np


class _OnStream:
    """CuPy work on torch's current stream of a CUDA tensor's device (nothing for CPU tensors)."""

    def __init__(self, t: torch.Tensor):
        self.cms = []
        if t.is_cuda:
            import cupy

            from .torch import _stream

            self.cms = [cupy.cuda.Device(t.get_device()), _stream(t.device)]

    def __enter__(self):
        for cm in self.cms:
            cm.__enter__()

    def __exit__(self, *exc):
        for cm in reversed(self.cms):
            cm.__exit__(*exc)


def _peers(group) -> tuple[int, int, int, int]:
    """(rank in the group, its size, the global ranks of the next and the previous rank in the ring)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    return rank, world, glob((rank + 1) % world), glob((rank - 1) % world)


def _exchange(send: torch.Tensor, nxt: int, prv: int, group):
    """Post send -> next rank and a receive of the same shape from the previous one; (buffer, requests)."""
    recv = torch.empty_like(send)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, group),
                                   dist.P2POp(dist.irecv, recv, prv, group)])
    return recv, reqs


def _visible(causal: bool, qc: int, kc: int):
    """The pair's kind: None (query chunk qc sees nothing of key chunk kc), False (all), True (causal)."""
    if not causal or kc < qc:
        return False
    return True if kc == qc else None


def check(q, k, v, group, causal, state_dtype, grad_dtype, deterministic, knobs) -> None:
    """ring_attention's checks: the local ones (before any communication), then ``_agree``."""
    _check_local(q, k, v, causal, deterministic, knobs, "ring_attention")
    for name, value in (("state_dtype", state_dtype), ("grad_dtype", grad_dtype)):
        if value not in _NAMES:
            raise ValueError(f"{name} must be one of {tuple(_NAMES)}, got {value!r}")
    _check_group("ring_attention")
    if q.shape[2] == 0 or (q.shape[2] % 2 and dist.get_world_size(group) > 1):
        raise ValueError(f"a rank's shard holds two equal chunks (zigzag_shard): its length must be even "
                         f"and > 0, got {q.shape[2]}")
    c = max(q.shape[2] // 2, 1)
    grad = _check_calls(q[:, :, :c], k[:, :, :c], v[:, :, :c], knobs)
    _agree(group, "ring_attention", (tuple(q.shape), tuple(k.shape), str(q.dtype), q.device.type, causal,
                                     state_dtype, grad_dtype, deterministic, sorted(knobs.items()), grad))


def _check_calls(q, k, v, knobs) -> bool:
    """The checks of ``flashcupy.attention`` (and of its backward where gradients are asked) on tensors
    shaped as one of this rank's calls, so that a bad knob value or shape raises here, before any
    transfer, not in the middle of the ring; returns whether gradients are asked."""
    from ._checks import check_forward

    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    views = [_view(t) for t in (q, k, v)]
    for direction in ("fwd", "bwd") if grad else ("fwd",):
        check_forward(*views, causal=False, scale=knobs.get("scale"), block_m=None, block_n=None,
                      accum=knobs.get("accum", "fp32"), kernel=knobs.get("kernel", "auto"), ablate=None,
                      direction=direction)
    return grad


def _check_group(what: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{what} needs an initialized torch.distributed process group "
                           "(torch.distributed.init_process_group; under torchrun, with backend='nccl')")


def _agree(group, what: str, call: tuple) -> None:
    """One all_gather_object of every rank's call (shapes, dtype, knobs, whether gradients are asked):
    a rank whose call differs from rank 0's is named in a ValueError on every rank. (Compared as pickled
    bytes: a NaN scale equals itself there.)"""
    calls = [None] * dist.get_world_size(group)
    dist.all_gather_object(calls, call, group=group)
    for r, other in enumerate(calls):
        if pickle.dumps(other) != pickle.dumps(calls[0]):
            raise ValueError(f"{what}: rank {r} of the group called with {other}, rank 0 with "
                             f"{calls[0]} (shapes (q, k), dtype, device type, every knob and whether "
                             "gradients are asked must agree)")


def _check_local(q, k, v, causal, deterministic, knobs, what: str) -> None:
    """The checks of one rank's arguments (no communication): TypeError/ValueError naming them."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _TORCH:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
        if t.ndim != 4:
            raise ValueError(f"{name} must be (B, H, N_local, D), got shape {tuple(t.shape)}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.is_cuda and q.get_device() != torch.cuda.current_device():
        raise ValueError(f"q is on {q.device} but this rank's current CUDA device is "
                         f"cuda:{torch.cuda.current_device()} (NCCL sends from the current device: "
                         f"torch.cuda.set_device(local_rank) first)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape or (k.shape[0], k.shape[2], k.shape[3]) != (q.shape[0], q.shape[2], q.shape[3]):
        raise ValueError(f"{what} is self-attention on sequence shards: k and v must be (B, Hkv, "
                         f"N_local, D) with q's B, N_local and D; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    for name, flag in (("causal", causal), ("deterministic", deterministic)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    bad = set(knobs) - set(KNOBS)
    if bad:
        raise TypeError(f"{what} takes the knobs {KNOBS}; got {sorted(bad)}")


def _forward_step(qa, kva, acc, mine, world, src, c, causal, knobs, state_dtype, xp) -> None:
    """One step of the ring's forward on this rank: each of its query chunks (``mine``) against the
    chunks of rank ``src``'s K/V block (``kva``: (2, B, Hkv, 2c, D) views) that it sees, each part folded
    into ``acc`` (query chunk -> (o, lse) float32) in the ring's order."""
    import flashcupy

    for i, qc in enumerate(mine):
        for j, kc in enumerate(zigzag_chunks(world, src)):
            kind = _visible(causal, qc, kc)
            if kind is None:
                continue
            sl = slice(j * c, (j + 1) * c)
            o_p, lse_p = flashcupy.attention(qa[:, :, i * c:(i + 1) * c], kva[0][:, :, sl], kva[1][:, :, sl],
                                             causal=kind, return_lse=True, **knobs)
            if qc not in acc:
                acc[qc] = merge_states(o_p[None], lse_p[None], form="logsigmoid", state_dtype=state_dtype,
                                       out_dtype="float32")
            else:
                a_o, a_l = acc[qc]
                acc[qc] = merge_states(xp.stack([a_o, o_p.astype(xp.float32)]), xp.stack([a_l, lse_p]),
                                       form="logsigmoid", state_dtype=state_dtype, out_dtype="float32")


def forward(q, k, v, group, causal, knobs, state_dtype):
    """(o, lse) of this rank's queries over the whole ring (tensors: o in q's dtype, lse float32)."""

    rank, world, nxt, prv = _peers(group)
    if world == 1:  # one rank: one call over the whole sequence, as simulate_ring
        return _one_call(q, k, v, causal, knobs)
    c = q.shape[2] // 2
    xp = _xp(q)
    mine = zigzag_chunks(world, rank)
    qa = _view(q)
    acc = {}  # query chunk -> (o float32, lse float32): the fold so far
    kv = torch.stack([k, v]).contiguous()
    with _OnStream(q):
        for s in range(world):
            recv, reqs = _exchange(kv, nxt, prv, group) if s < world - 1 else (None, ())
            try:
                _forward_step(qa, _view(kv), acc, mine, world, (rank - s) % world, c, causal, knobs,
                              state_dtype, xp)
            finally:  # (the posted transfers complete even where a step raises: the group stays usable)
                for req in reqs:
                    req.wait()
            kv = recv if recv is not None else kv
        o = torch.empty_like(q)
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
        oa, la = _view(o), _view(lse)
        for i, qc in enumerate(mine):
            oa[:, :, i * c:(i + 1) * c] = acc[qc][0].astype(oa.dtype)
            la[:, :, i * c:(i + 1) * c] = acc[qc][1]
    return o, lse


def backward(do, q, k, v, o, lse, dlse, group, causal, knobs, grad_dtype, deterministic):
    """(dq, dk, dv) of this rank's shards: dq added up on this rank, dk and dv travelling with their
    K/V block and handed back to its owner at the end; every sum held in ``grad_dtype``, rounded after
    each addition, in ``simulate_ring``'s order."""
    import flashcupy

    rank, world, nxt, prv = _peers(group)
    if world == 1:
        return _one_call_backward(do, q, k, v, o, lse, dlse, causal, deterministic, knobs)
    c = q.shape[2] // 2
    f32 = np.float32
    gt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[grad_dtype]
    mine = zigzag_chunks(world, rank)
    dq = torch.zeros(q.shape, dtype=gt, device=q.device)
    dkv = torch.zeros((2, *k.shape), dtype=gt, device=q.device)
    kv = torch.stack([k, v]).contiguous()
    qa, doa, oa, la = _view(q), _view(do.contiguous()), _view(o), _view(lse)
    dla = None if dlse is None else _view(dlse.contiguous())
    dqa = _view(dq)
    with _OnStream(q):
        for s in range(world):
            recv, reqs = _exchange(kv, nxt, prv, group) if s < world - 1 else (None, [])
            kva, dkva = _view(kv), _view(dkv)
            try:
                for i, qc in enumerate(mine):
                    sq = slice(i * c, (i + 1) * c)
                    for j, kc in enumerate(zigzag_chunks(world, (rank - s) % world)):
                        kind = _visible(causal, qc, kc)
                        if kind is None:
                            continue
                        sk = slice(j * c, (j + 1) * c)
                        g = flashcupy.attention_backward(
                            doa[:, :, sq], qa[:, :, sq], kva[0][:, :, sk], kva[1][:, :, sk], oa[:, :, sq],
                            la[:, :, sq], causal=kind, dlse=None if dla is None else dla[:, :, sq],
                            deterministic=deterministic, **knobs)
                        sums = ((dqa[:, :, sq], g[0]), (dkva[0][:, :, sk], g[1]), (dkva[1][:, :, sk], g[2]))
                        for total, part in sums:
                            total[...] = (total.astype(f32) + part.astype(f32)).astype(total.dtype)
            except BaseException:  # (the posted K/V transfers complete before the error leaves)
                for req in reqs:
                    req.wait()
                raise
            # this step's block leaves with its dK/dV; after the last step they go home, to the next rank
            drecv, dreqs = _exchange(dkv, nxt, prv, group)
            for req in [*reqs, *dreqs]:
                req.wait()
            kv = recv if recv is not None else kv
            dkv = drecv
        grads = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]
        dkva = _view(dkv)
        for out, acc in zip(grads, (dqa, dkva[0], dkva[1])):
            _view(out)[...] = acc.astype(_view(out).dtype)
    return grads


def _keep(ctx, saved, meta: tuple) -> None:
    """What both context-parallel Functions keep for their backward: the tensors, the call's other
    arguments (``ctx.meta``), and no zero-filled gradient for an unused output (None reaches the
    backward, which then skips that term or returns no gradient at all)."""
    ctx.save_for_backward(*saved)
    ctx.meta = meta
    ctx.set_materialize_grads(False)


class _Ring(torch.autograd.Function):
    """apply(q, k, v, group, causal, knobs, state_dtype, grad_dtype, deterministic) -> (o, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, knobs, state_dtype, grad_dtype, deterministic):
        o, lse = forward(q, k, v, group, causal, knobs, state_dtype)
        _keep(ctx, (q, k, v, o, lse), (group, causal, knobs, grad_dtype, deterministic))
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        group, causal, knobs, grad_dtype, deterministic = ctx.meta
        if do is None and dlse is None:
            return (None,) * 9
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = backward(do, q, k, v, o, lse, dlse, group, causal, knobs, grad_dtype, deterministic)
        return dq, dk, dv, None, None, None, None, None, None


def ring_attention(q, k, v, group=None, *, causal=False, return_lse=False, state_dtype="float32",
                   grad_dtype="float32", deterministic=False, **knobs):
    check(q, k, v, group, causal, state_dtype, grad_dtype, deterministic, knobs)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        o, lse = _Ring.apply(q, k, v, group, causal, dict(knobs), state_dtype, grad_dtype, deterministic)
    else:
        o, lse = forward(q, k, v, group, causal, knobs, state_dtype)
    return (o, lse) if return_lse else o


# --------------------------------------------------------------------------------------------------
# Ulysses: all-to-all between sequence shards and head groups around one call of the whole sequence

def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """All-to-all over dim 0 of a contiguous (W, ...) tensor: row i goes to rank i, and row i of the
    result came from rank i. Sent as bytes (every backend moves uint8, gloo included)."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out.view(torch.uint8), x.view(torch.uint8), group=group)
    return out


def _seq_to_head(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """(B, H, n, ...) sequence shards of every head -> (B, H / W, W n, ...): the whole sequence (the
    ranks' shards in rank order) of this rank's group of H / W heads."""
    b, h, n, *rest = x.shape
    parts = x.reshape(b, world, h // world, n, *rest).movedim(1, 0).contiguous()
    got = _all_to_all(parts, group)  # (W, B, H / W, n, ...): rank i's shard of this rank's heads
    return got.movedim(0, 2).reshape(b, h // world, world * n, *rest)


def _head_to_seq(y: torch.Tensor, world: int, group) -> torch.Tensor:
    """_seq_to_head's inverse: (B, H / W, W n, ...) -> (B, H, n, ...)."""
    b, hw, nn, *rest = y.shape
    n = nn // world
    parts = y.reshape(b, hw, world, n, *rest).movedim(2, 0).contiguous()
    got = _all_to_all(parts, group)  # (W, B, H / W, n, ...): head group i of this rank's shard
    return got.movedim(0, 1).reshape(b, world * hw, n, *rest)


def _one_call(qh, kh, vh, causal, knobs):
    """(o, lse) tensors of one flashcupy.attention call on the tensors' array views."""
    import flashcupy

    with _OnStream(qh):
        o, lse = flashcupy.attention(_view(qh), _view(kh), _view(vh), causal=causal, return_lse=True, **knobs)
        return _from(o, qh), _from(lse, qh)


def _one_call_backward(doh, qh, kh, vh, oh, lseh, dlseh, causal, deterministic, knobs):
    """[dq, dk, dv] tensors of one flashcupy.attention_backward call on the tensors' array views."""
    import flashcupy

    with _OnStream(qh):
        grads = flashcupy.attention_backward(_view(doh), _view(qh), _view(kh), _view(vh), _view(oh),
                                             _view(lseh), causal=causal,
                                             dlse=None if dlseh is None else _view(dlseh),
                                             deterministic=deterministic, **knobs)
        return [_from(g, x) for g, x in zip(grads, (qh, kh, vh))]


def _ulysses_forward(q, k, v, group, causal, knobs):
    """(o, lse) sequence shards, and the head-group tensors the backward reads (q, k, v, o, lse)."""
    world = dist.get_world_size(group)
    qh, kh, vh = (_seq_to_head(x.detach().contiguous(), world, group) for x in (q, k, v))
    oh, lseh = _one_call(qh, kh, vh, causal, knobs)
    return _head_to_seq(oh, world, group), _head_to_seq(lseh, world, group), (qh, kh, vh, oh, lseh)


class _Ulysses(torch.autograd.Function):
    """apply(q, k, v, group, causal, knobs, deterministic) -> (o, lse), sequence shards in and out."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, knobs, deterministic):
        o, lse, saved = _ulysses_forward(q, k, v, group, causal, knobs)
        _keep(ctx, saved, (group, causal, knobs, deterministic))
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dlse):
        qh, kh, vh, oh, lseh = ctx.saved_tensors
        group, causal, knobs, deterministic = ctx.meta
        world = dist.get_world_size(group)
        if do is None and dlse is None:
            return (None,) * 7
        doh = torch.zeros_like(oh) if do is None else _seq_to_head(do.contiguous(), world, group)
        dlseh = None if dlse is None else _seq_to_head(dlse.contiguous(), world, group)
        grads = _one_call_backward(doh, qh, kh, vh, oh, lseh, dlseh, causal, deterministic, knobs)
        return (*(_head_to_seq(g, world, group) for g in grads), None, None, None, None)


def ulysses_attention(q, k, v, group=None, *, causal=False, return_lse=False, deterministic=False, **knobs):
    _check_local(q, k, v, causal, deterministic, knobs, "ulysses_attention")
    _check_group("ulysses_attention")
    world = dist.get_world_size(group)
    if q.shape[1] % world or k.shape[1] % world:
        raise ValueError(f"ulysses_attention shards the heads over the {world} ranks: Hq = {q.shape[1]} and "
                         f"Hkv = {k.shape[1]} must be multiples of {world}")
    if q.shape[2] == 0:
        raise ValueError("a rank's sequence shard must not be empty")
    hq, hkv = q.shape[1] // world, k.shape[1] // world
    grad = _check_calls(q[:, :hq], k[:, :hkv], v[:, :hkv], knobs)
    _agree(group, "ulysses_attention", (tuple(q.shape), tuple(k.shape), str(q.dtype), q.device.type, causal,
                                        deterministic, sorted(knobs.items()), grad))
    if grad:
        o, lse = _Ulysses.apply(q, k, v, group, causal, dict(knobs), deterministic)
    else:
        o, lse, _ = _ulysses_forward(q, k, v, group, causal, knobs)
    return (o, lse) if return_lse else o

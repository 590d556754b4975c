"""Context parallelism (issue 37): zigzag sharding, ring attention simulated in one process, and ring and
Ulysses attention across the ranks of a torch.distributed process group.

Ring attention splits the sequence over W ranks. Each rank keeps its queries and passes its K/V block
around the ring; at each of the W steps it attends its queries to the block it holds and merges the
result into its running (o, lse) (``flashcupy.merge_states``); the backward sends dK/dV around the ring
the same way, each rank adding its share. With a causal mask the zigzag layout balances the ranks: the
sequence is cut into 2W chunks and rank r holds chunks r and 2W - 1 - r (one early, one late).

``simulate_ring`` runs exactly that arithmetic in one process, rank by rank and step by step, on NumPy
(the twin) or CuPy (the kernels) arrays: the same chunk-pair calls, the same merge order, the same
roundings of the running output and of the travelling gradients, without the communication. It is the
numerical model of the distributed version, and how the ``ring`` experiment reaches 64 ranks on one
device. Chunk pairs: a query chunk c sees key chunk c' fully when c' < c, causally when c' = c (equal
lengths: top-left and bottom-right alignment agree), not at all when c' > c; every pair without a
causal mask.
"""
from __future__ import annotations

import numpy as np

from .transforms import _xp

__all__ = ["ring_attention", "simulate_ring", "ulysses_attention", "zigzag_chunks", "zigzag_shard",
           "zigzag_unshard"]


def zigzag_chunks(world_size: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2 * world_size) that ``rank`` holds in the zigzag layout: rank and
    2 * world_size - 1 - rank."""
    if not isinstance(world_size, (int, np.integer)) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    return int(rank), int(2 * world_size - 1 - rank)


def _chunk_len(n: int, world_size: int, name: str) -> int:
    zigzag_chunks(world_size, 0)  # (world_size checked first)
    if n % (2 * world_size):
        raise ValueError(f"{name}'s sequence length {n} must be a multiple of 2 * world_size = "
                         f"{2 * world_size} (the zigzag layout cuts it into 2 * world_size equal chunks)")
    return n // (2 * world_size)


def _narrow(x, start: int, length: int, axis: int):
    """x's entries [start, start + length) along ``axis``: NumPy, CuPy or a torch tensor."""
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, start + length)
    return x[tuple(index)]


def _concatenate(parts, axis: int):
    if type(parts[0]).__module__.startswith("torch"):
        import torch

        return torch.cat(parts, dim=axis)
    return _xp(parts[0]).concatenate(parts, axis=axis)


def zigzag_shard(x, world_size: int, rank: int, axis: int = 2):
    """Rank ``rank``'s shard of ``x`` along ``axis`` (the sequence axis of (B, H, N, D)): its two chunks,
    concatenated (a copy). NumPy, CuPy or torch (``ring_attention``'s inputs)."""
    c = _chunk_len(x.shape[axis], world_size, "x")
    return _concatenate([_narrow(x, i * c, c, axis) for i in zigzag_chunks(world_size, rank)], axis)


def zigzag_unshard(shards, axis: int = 2):
    """The whole sequence from every rank's shard (``shards[r]`` from ``zigzag_shard(x, W, r)``): one
    shape for all, an even length along ``axis`` (two chunks)."""
    world = len(shards)
    if world < 1:
        raise ValueError("zigzag_unshard needs the shards of at least one rank")
    shape = tuple(shards[0].shape)
    if any(tuple(s.shape) != shape for s in shards) or shape[axis] % 2:
        raise ValueError(f"every shard must have one shape with an even length along axis {axis} (two "
                         f"chunks); got {[tuple(s.shape) for s in shards]}")
    c = shape[axis] // 2
    chunks = [None] * (2 * world)
    for r, s in enumerate(shards):
        a, b = zigzag_chunks(world, r)
        chunks[a], chunks[b] = _narrow(s, 0, c, axis), _narrow(s, c, c, axis)
    return _concatenate(chunks, axis)



def simulate_ring(q, k, v, world_size: int, *, causal: bool = False, do=None, state_dtype: str = "float32",
                  grad_dtype: str = "float32", deterministic: bool = False, merge_ablate: str | None = None,
                  **knobs):
    """Ring attention over ``world_size`` ranks, simulated in one process: returns (o, lse) of the whole
    sequence, and with ``do`` also (dq, dk, dv).

    q (B, Hq, N, D), k, v (B, Hkv, N, D) with N a multiple of 2 * world_size (self-attention: the ranks
    shard queries and keys alike), NumPy or CuPy. Each chunk pair runs ``flashcupy.attention`` (and
    ``attention_backward``) with ``knobs``: ``kernel``, ``accum``, ``scale``; per query
    chunk the ring's parts are merged in the ring's order by the pairwise fold
    (``merge_states(form="logsigmoid")``) with the running output held in ``state_dtype``. In the
    backward each pair's dq, dk, dv (in the inputs' dtype, as the kernels write them) are added into
    accumulators held in ``grad_dtype`` and rounded after every addition, in the ring's order: dq on the
    query's rank, dk and dv travelling with their K/V block; ``deterministic`` is each pair's
    ``attention_backward``'s (the ring's own order is fixed either way). One rank is one call of
    ``flashcupy.attention`` (and ``attention_backward``) over the whole sequence: its bits.
    ``merge_ablate="stable_softplus"`` breaks the fold's LSE update (``merge_states``'s ``ablate``).
    """
    import flashcupy

    from ._checks import numpy_dtype

    names = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
    for name, value in (("state_dtype", state_dtype), ("grad_dtype", grad_dtype)):
        if value not in names:
            raise ValueError(f"{name} must be one of {tuple(names)}, got {value!r}")
    bad = set(knobs) - {"kernel", "accum", "scale"}
    if bad:
        raise TypeError(f"simulate_ring takes the knobs kernel, accum and scale; got {sorted(bad)}")
    xp = _xp(q)
    n = q.shape[2]
    if k.shape[2] != n:
        raise ValueError(f"simulate_ring runs self-attention: q and k must have one length, got {n} and "
                         f"{k.shape[2]}")
    if v.shape != k.shape or (do is not None and do.shape != q.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)} and do q's {tuple(q.shape)}; got v "
                         f"{tuple(v.shape)}" + ("" if do is None else f", do {tuple(do.shape)}"))
    zigzag_chunks(world_size, 0)
    if world_size == 1:  # one rank: one call over the whole sequence (no chunks, nothing to merge)
        o, lse = flashcupy.attention(q, k, v, causal=causal, return_lse=True, **knobs)
        if do is None:
            return o, lse
        return (o, lse, *flashcupy.attention_backward(do, q, k, v, o, lse, causal=causal,
                                                      deterministic=deterministic, **knobs))
    c = _chunk_len(n, world_size, "q")
    chunk = [slice(i * c, (i + 1) * c) for i in range(2 * world_size)]
    owner = {}
    for r in range(world_size):
        for i in zigzag_chunks(world_size, r):
            owner[i] = r

    def pairs(qc):
        """The key chunks query chunk qc attends to, in the ring's order on its rank (steps s = 0 ..
        W - 1: the block of rank (r - s) mod W, its two chunks in order), with the pair's causality."""
        r = owner[qc]
        for s in range(world_size):
            for kc in zigzag_chunks(world_size, (r - s) % world_size):
                if not causal or kc < qc:
                    yield kc, False
                elif kc == qc:
                    yield kc, True

    o = xp.empty(q.shape, dtype=q.dtype)
    lse = xp.empty(q.shape[:3], dtype=xp.float32)
    for qc in range(2 * world_size):
        parts = [flashcupy.attention(q[:, :, chunk[qc]], k[:, :, chunk[kc]], v[:, :, chunk[kc]], causal=diag,
                                     return_lse=True, **knobs) for kc, diag in pairs(qc)]
        o_c, lse_c = flashcupy.merge_states(xp.stack([p[0] for p in parts]), xp.stack([p[1] for p in parts]),
                                            form="logsigmoid", state_dtype=state_dtype, ablate=merge_ablate)
        o[:, :, chunk[qc]] = o_c
        lse[:, :, chunk[qc]] = lse_c
    if do is None:
        return o, lse

    acc = numpy_dtype(names[grad_dtype])
    dq = xp.zeros(q.shape, dtype=acc)
    dk = xp.zeros(k.shape, dtype=acc)
    dv = xp.zeros(v.shape, dtype=acc)
    # the ring's order: at step s rank r holds rank (r - s)'s K/V block and adds its share to the block's
    # travelling dk, dv and to its own dq
    for s in range(world_size):
        for r in range(world_size):
            for qc in zigzag_chunks(world_size, r):
                for kc in zigzag_chunks(world_size, (r - s) % world_size):
                    if causal and kc > qc:
                        continue
                    sq, sk = chunk[qc], chunk[kc]
                    g = flashcupy.attention_backward(do[:, :, sq], q[:, :, sq], k[:, :, sk], v[:, :, sk],
                                                     o[:, :, sq], lse[:, :, sq], causal=causal and kc == qc,
                                                     deterministic=deterministic, **knobs)
                    for total, part, sl in ((dq, g[0], sq), (dk, g[1], sk), (dv, g[2], sk)):
                        total[:, :, sl] = (total[:, :, sl].astype(xp.float32)
                                           + part.astype(xp.float32)).astype(acc)
    return o, lse, dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def ring_attention(q, k, v, group=None, *, causal: bool = False, return_lse: bool = False,
                   state_dtype: str = "float32", grad_dtype: str = "float32", deterministic: bool = False,
                   **knobs):
    """Ring attention across the ranks of a torch.distributed process group (``group``; None: the
    default group), differentiable: this rank's zigzag shards in, this rank's output shard out.

    q (B, Hq, 2c, D), k, v (B, Hkv, 2c, D): torch tensors, the rank's shard of one sequence of 2 W c
    tokens in the zigzag layout (``zigzag_shard(x, W, rank)``, which takes torch tensors too: chunks rank
    and 2W - 1 - rank), on this rank's current CUDA device (NCCL; the kernels run on torch's current
    stream) or on the CPU (gloo; the NumPy twin runs, for tests and study). Returns o (B, Hq, 2c, D) in
    q's dtype, the same shard of the whole sequence's attention, and with ``return_lse`` its LSE, float32
    (B, Hq, 2c). ``causal``: the whole sequence's causal mask (chunk pairs as in ``simulate_ring``).

    The arithmetic is ``simulate_ring``'s, with the same ``state_dtype``, ``grad_dtype``,
    ``deterministic`` and ``knobs`` (kernel, accum, scale): on the same inputs every rank's o, lse and
    gradients are the bits of the matching shard of ``simulate_ring``'s (with ``deterministic=True``
    where the chunk pairs' backward would otherwise vary in its last bits: the kernels' atomic dQ).
    The K/V block travels to the next rank while the current one is attended (``batch_isend_irecv``); the
    backward sends each block's dK/dV with it and hands them back to the owner at the end. Gradients of o
    and of the LSE flow (the LSE's through every chunk pair's ``dlse``).

    Before any transfer the call checks its arguments (TypeError/ValueError naming them) and compares
    every rank's shapes, dtype and knobs (one ``all_gather_object``: a rank that differs is named).
    A rank that fails later leaves the others waiting until the process group's timeout
    (``init_process_group(timeout=...)``), which then raises.

    Needs torch (``pip install "flashcupy[torch]"``); imported only when this function is called.
    """
    from ._context_parallel import ring_attention as run

    return run(q, k, v, group, causal=causal, return_lse=return_lse, state_dtype=state_dtype,
               grad_dtype=grad_dtype, deterministic=deterministic, **knobs)


def ulysses_attention(q, k, v, group=None, *, causal: bool = False, return_lse: bool = False,
                      deterministic: bool = False, **knobs):
    """Ulysses attention (DeepSpeed-Ulysses) across the ranks of a torch.distributed process group,
    differentiable: this rank's sequence shard in, this rank's output shard out.

    q (B, Hq, n, D), k, v (B, Hkv, n, D): torch tensors, tokens [r n, (r + 1) n) of one sequence of W n
    (contiguous shards, not zigzag: each rank attends whole sequences), on this rank's current CUDA device
    (NCCL) or on the CPU (gloo; the NumPy twin runs). Hq and Hkv must be multiples of W. An all-to-all
    gives each rank the whole sequence of Hq / W query heads and their Hkv / W KV heads; one
    ``flashcupy.attention`` call (``knobs``: kernel, accum, scale; ``causal`` over the whole sequence)
    runs there; a second all-to-all returns o (B, Hq, n, D) and with ``return_lse`` the LSE (B, Hq, n),
    float32. The backward moves dO (and the LSE's gradient) the same way around one
    ``attention_backward`` (``deterministic`` as there). Attention is per head, so every shard is the bits
    of one call over the whole sequence.

    Checks as ``ring_attention``'s: arguments first, then one ``all_gather_object`` comparing the ranks'
    calls. Needs torch; imported only when this function is called.
    """
    from ._context_parallel import ulysses_attention as run

    return run(q, k, v, group, causal=causal, return_lse=return_lse, deterministic=deterministic, **knobs)

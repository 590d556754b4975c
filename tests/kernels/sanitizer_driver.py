"""Small ragged launches of every kernel family, for compute-sanitizer (see test_sanitizer.py).

Run as ``python -m tests.kernels.sanitizer_driver`` from the repository root.
"""
from __future__ import annotations

import numpy as np


def main() -> None:
    import cupy

    import flashcupy

    rng = np.random.default_rng(7)
    configs = [  # (kernel, dtype, accum, block_m, block_n, d)
        ("wgmma", np.float16, "fp32", 128, 64, 64),
        ("wgmma", np.float16, "fp32", 192, 128, 128),
        ("wgmma", np.float16, "fp32", 128, 176, 128),
        ("wgmma", np.float16, "fp16", 128, 128, 64),
        ("wgmma", np.float16, "fp32", 128, 80, 256),
        ("mma", np.float16, "fp16", 128, 64, 40),
        ("simt", np.float32, "fp32", 32, 16, 64),
        ("simt", np.float16, "fp16", 16, 32, 40),
    ]
    for kernel, dt, accum, bm, bn, d in configs:
        for causal in (False, True):
            for nq, nk in ((77, 130), (130, 77)):
                q = cupy.asarray(rng.standard_normal((1, 4, nq, d)).astype(dt))
                k = cupy.asarray(rng.standard_normal((1, 2, nk, d)).astype(dt))
                v = cupy.asarray(rng.standard_normal((1, 2, nk, d)).astype(dt))
                o, lse = flashcupy.attention(q, k, v, causal=causal, kernel=kernel, accum=accum,
                                             block_m=bm, block_n=bn, return_lse=True)
                bwd_tiles = [{}]
                if kernel == "wgmma":  # the backward family's own tiles, where it runs this case
                    if d not in (64, 128) or accum != "fp32":
                        continue
                    bwd_tiles = ([{"block_m": 64, "block_n": 128}, {"block_m": 80, "block_n": 128}]
                                 if d == 128 else
                                 [{"block_m": 64, "block_n": 64}, {"block_m": 128, "block_n": 128}])
                do = cupy.asarray(rng.standard_normal(q.shape).astype(dt))
                # mma / wgmma fp32: the atomic dQ path, then the deterministic one
                for bwd_tile in bwd_tiles:
                    for det in (False, True):
                        flashcupy.attention_backward(do, q, k, v, o, lse, causal=causal, kernel=kernel,
                                                     accum=accum, deterministic=det, **bwd_tile)
    # sliding windows (issue 35): both edges inside the tiles, and a left edge only, in each family
    # (default tiles), forward and both dQ paths, Nq above and below Nk (rows that see no key); the
    # softcap (its score hook and the derivative kept beside P) with the first window and with none
    for kernel, dt in (("wgmma", np.float16), ("mma", np.float16), ("simt", np.float32)):
        for causal, window, cap in ((False, (20, 5), 0.0), (True, (40, -1), 0.0), (False, (20, 5), 5.0),
                                    (True, (-1, -1), 5.0)):
            for nq, nk in ((77, 330), (330, 77)):
                q = cupy.asarray(rng.standard_normal((1, 4, nq, 64)).astype(dt))
                k = cupy.asarray(rng.standard_normal((1, 2, nk, 64)).astype(dt))
                do = cupy.asarray(rng.standard_normal(q.shape).astype(dt))
                o, lse = flashcupy.attention(q, k, k, causal=causal, kernel=kernel, window_size=window,
                                             softcap=cap, return_lse=True)
                for det in (False, True):
                    flashcupy.attention_backward(do, q, k, k, o, lse, causal=causal, kernel=kernel,
                                                 deterministic=det, window_size=window, softcap=cap)
    # ALiBi (its slopes read per head, set where the head changes: the dK/dV loops over the GQA group),
    # per batch and head, with a causal mask and with a window, each family, forward and both dQ paths
    for kernel, dt in (("wgmma", np.float16), ("mma", np.float16), ("simt", np.float32)):
        # (130 queries on 77 keys without a mask: rows above the diagonal's start, measured from key 0)
        for causal, window, nq, nk in ((True, (-1, -1), 77, 130), (False, (20, 5), 77, 130),
                                       (False, (-1, -1), 130, 77)):
            q = cupy.asarray(rng.standard_normal((2, 4, nq, 64)).astype(dt))
            k = cupy.asarray(rng.standard_normal((2, 2, nk, 64)).astype(dt))
            do = cupy.asarray(rng.standard_normal(q.shape).astype(dt))
            slopes = cupy.asarray(rng.uniform(0.01, 0.5, (2, 4)).astype(np.float32))
            o, lse = flashcupy.attention(q, k, k, causal=causal, kernel=kernel, window_size=window,
                                         alibi_slopes=slopes, return_lse=True)
            for det in (False, True):
                flashcupy.attention_backward(do, q, k, k, o, lse, causal=causal, kernel=kernel,
                                             deterministic=det, window_size=window, alibi_slopes=slopes)
    # the persistent wgmma forward (D=64) on 3 CTAs, so that each runs several tiles: the static split
    # (with a window too: tiles that see no key) and, with a causal mask, the dynamic scheduler's tile
    # slot and counter
    from flashcupy import _launch

    ctas = _launch._wgmma_ctas
    _launch._wgmma_ctas = lambda tiles: min(tiles, 3)
    try:
        for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (50, 10))):
            for nq, nk in ((301, 130), (130, 301)):
                q = cupy.asarray(rng.standard_normal((1, 4, nq, 64)).astype(np.float16))
                k = cupy.asarray(rng.standard_normal((1, 2, nk, 64)).astype(np.float16))
                flashcupy.attention(q, k, k, causal=causal, kernel="wgmma", block_m=128, block_n=64,
                                    window_size=window)
                flashcupy.attention(q, k, k, causal=causal, kernel="wgmma", block_m=128, block_n=64,
                                    window_size=window, alibi_slopes=cupy.full(4, 0.125, cupy.float32))
        # packed sequences (one launch for the batch): lengths 0, 1 and ragged, a sequence without keys,
        # every family (wgmma at D 64 and 128: the backward's three dQ forms), causal, none, a window with
        # ALiBi per sequence, forward and backward; the wgmma walks on 3 CTAs
        lq, lk = [5, 0, 130, 1, 77, 64], [9, 4, 140, 0, 77, 200]
        cq, ck = (cupy.asarray(np.concatenate([[0], np.cumsum(n)]).astype(np.int32)) for n in (lq, lk))
        for kernel, dt, d in (("wgmma", np.float16, 64), ("wgmma", np.float16, 128), ("mma", np.float16, 64),
                              ("simt", np.float32, 64)):
            q = cupy.asarray(rng.standard_normal((sum(lq), 4, d)).astype(dt))
            k = cupy.asarray(rng.standard_normal((sum(lk), 2, d)).astype(dt))
            do = cupy.asarray(rng.standard_normal(q.shape).astype(dt))
            for causal, window, slopes in ((False, (-1, -1), None), (True, (-1, -1), None),
                                           (False, (20, 5), cupy.full((6, 4), 0.125, cupy.float32))):
                o, lse = flashcupy.attention_varlen(q, k, k, cq, ck, causal=causal, kernel=kernel,
                                                    window_size=window, alibi_slopes=slopes, return_lse=True)
                for det in (False, True):  # (the packed backward: atomic and ordered dQ)
                    flashcupy.attention_varlen_backward(do, q, k, k, o, lse, cq, ck, causal=causal,
                                                        kernel=kernel, window_size=window,
                                                        alibi_slopes=slopes, deterministic=det)
        # decoding against a contiguous cache read in place (NaN in its unused slots; the wgmma kernel
        # zeroes the V rows past each entry's keys), GQA-packed, with 1 and 3 key ranges in one launch
        cache = cupy.full((3, 300, 2, 64), np.nan, np.float16)
        lengths = np.array([0, 77, 300], np.int32)
        for i, n in enumerate(lengths):
            cache[i, :n] = cupy.asarray(rng.standard_normal((n, 2, 64)).astype(np.float16))
        qd = cupy.asarray(rng.standard_normal((3, 1, 8, 64)).astype(np.float16))
        for kernel in ("wgmma", "mma"):
            for splits in (1, 3):
                od = flashcupy.attention_with_kvcache(qd, cache, cache, cache_seqlens=cupy.asarray(lengths),
                                                      kernel=kernel, num_splits=splits)
                assert bool(cupy.isfinite(od).all()), (kernel, splits)  # (the NaN past the keys stays out)
        # a paged cache of 128-row pages read in place by the wgmma kernel through a shuffled table
        # (NaN in the unused slots and in the pages no entry names; the last page of each entry partial)
        pages = cupy.full((12, 128, 2, 64), np.nan, np.float16)
        table = np.random.default_rng(1).permutation(12)[:9].reshape(3, 3).astype(np.int32)
        for i, n in enumerate(lengths):
            for j in range(-(-int(n) // 128)):
                rows = min(128, int(n) - 128 * j)
                pages[int(table[i, j]), :rows] = cache[i, 128 * j:128 * j + rows]
        for splits in (1, 3):
            od = flashcupy.attention_with_kvcache(qd, pages, pages, cache_seqlens=lengths, block_table=table,
                                                  kernel="wgmma", block_n=128, num_splits=splits)
            assert bool(cupy.isfinite(od).all()), ("paged", splits)
        # a plan made once and run as two layers: one key appended per entry (the append kernel) into
        # pages of 64 read in place at the policy's 64-key tile, the policy's splits (the merge kernel)
        k64, v64 = (cupy.full((20, 64, 2, 64), np.nan, np.float16) for _ in range(2))
        table64 = rng.permutation(20)[:15].reshape(3, 5).astype(np.int32)
        for i, n in enumerate(lengths):
            for j in range(-(-int(n) // 64)):
                rows = min(64, int(n) - 64 * j)
                for c in (k64, v64):
                    c[int(table64[i, j]), :rows] = cache[i, 64 * j:64 * j + rows]
        new = cupy.asarray(rng.standard_normal((3, 1, 2, 64)).astype(np.float16))
        plan = flashcupy.plan_kvcache(qd, k64, v64, cache_seqlens=lengths, block_table=table64, k=new,
                                      v=new, num_splits=0)
        for _ in range(2):
            od = plan.run(qd, k64, v64, k=new, v=new)
            assert bool(cupy.isfinite(od).all()), "plan"
    finally:
        _launch._wgmma_ctas = ctas
    # fp8 (e4m3) forward: both accumulations, k descales per tile and per key, every tile, GQA, ragged
    from flashcupy import fp8

    def e4m3(shape, *granularity):
        return fp8.quantize(cupy.asarray(rng.standard_normal(shape).astype(np.float32)), "e4m3", *granularity)

    fp8_cases = (("single", ("tensor",), 192), ("tile", ("token",), 128), ("single", ("block", 64), 64))
    for acc, kg, bm in fp8_cases:
        for causal in (False, True):
            for nq, nk in ((77, 203), (203, 77)):
                q, k = e4m3((1, 4, nq, 128), "token"), e4m3((1, 2, nk, 128), *kg)
                v = e4m3((1, 2, nk, 128), "head")
                flashcupy.attention_fp8(q, k, v, causal=causal, accumulation=acc, block_m=bm)
        q, k = e4m3((1, 2, 77, 256), "tensor"), e4m3((1, 1, 203, 256), "token")
        v = e4m3((1, 1, 203, 256), "head")
        flashcupy.attention_fp8(q, k, v, causal=causal)  # D=256
    # the softcap on fp8 operands: k's descale per tile and per key, and D = 256 with a window
    for kg in (("head",), ("token",)):
        q, k, v = e4m3((1, 4, 203, 128), "token"), e4m3((1, 2, 77, 128), *kg), e4m3((1, 2, 77, 128), "head")
        flashcupy.attention_fp8(q, k, v, causal=False, softcap=2.0)
    q, k, v = e4m3((1, 2, 77, 256), "tensor"), e4m3((1, 1, 203, 256), "head"), e4m3((1, 1, 203, 256), "head")
    flashcupy.attention_fp8(q, k, v, window_size=(40, 0), softcap=2.0)
    # layouts the kernels copy or read in place (issue 33): a misaligned q, a broadcast k, a reversed v,
    # a misaligned o and a stride-0 do, every family, both directions; the fp8 forward on misaligned and
    # reversed data
    def misaligned(x):
        flat = cupy.empty(x.size + 8, dtype=x.dtype)
        view = flat[1:1 + x.size].reshape(x.shape)
        view[...] = x
        return view

    def randn(shape, dt):
        return cupy.asarray(rng.standard_normal(shape).astype(dt))

    for kernel, dt in (("wgmma", np.float16), ("mma", np.float16), ("simt", np.float32)):
        for causal in (False, True):
            q = misaligned(randn((1, 4, 77, 64), dt))
            k = cupy.broadcast_to(randn((1, 1, 130, 64), dt), (1, 2, 130, 64))
            v = cupy.ascontiguousarray(randn((1, 2, 130, 64), dt)[:, :, ::-1])[:, :, ::-1]
            o, lse = flashcupy.attention(q, k, v, causal=causal, kernel=kernel, return_lse=True)
            do = cupy.broadcast_to(randn((1, 1, 1, 64), dt), q.shape)
            for det in (False, True):
                flashcupy.attention_backward(do, q, k, v, misaligned(o), lse, causal=causal, kernel=kernel,
                                             deterministic=det)
    for causal in (False, True):
        q, k = e4m3((1, 4, 77, 128), "token"), e4m3((1, 2, 203, 128), "token")
        v = e4m3((1, 2, 203, 128), "head")
        v = fp8.Quantized(misaligned(v.data), v.scale, v.fmt, v.granularity)
        k = fp8.Quantized(k.data[:, :, ::-1], k.scale[:, :, ::-1], k.fmt, k.granularity)
        flashcupy.attention_fp8(q, k, v, causal=causal)
    # a forward and backward captured into a CUDA graph (layout copies inside), replayed twice
    stream = cupy.cuda.Stream(non_blocking=True)
    q = misaligned(randn((1, 4, 77, 64), np.float16))
    k = cupy.broadcast_to(randn((1, 1, 130, 64), np.float16), (1, 2, 130, 64))
    do = randn(q.shape, np.float16)
    for kernel in ("wgmma", "mma"):
        with stream:
            o, lse = flashcupy.attention(q, k, k, kernel=kernel, return_lse=True)
            flashcupy.attention_backward(do, q, k, k, o, lse, kernel=kernel, deterministic=True)
            stream.begin_capture()
            o, lse = flashcupy.attention(q, k, k, kernel=kernel, return_lse=True)
            flashcupy.attention_backward(do, q, k, k, o, lse, kernel=kernel, deterministic=True)
            graph = stream.end_capture()
        for _ in range(2):
            graph.launch(stream)
        stream.synchronize()
    cupy.cuda.Device().synchronize()
    print("sanitizer driver: all launches done")


if __name__ == "__main__":
    main()

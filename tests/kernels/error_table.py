"""Error of every forward variant family against float64 at one size: the table for closing notes.

Run on a GPU machine: ``python -m tests.kernels.error_table [N] [D]`` (default N=4096, D=128).
"""
from __future__ import annotations

import sys

import numpy as np


def main(n: int = 4096, d: int = 128) -> None:
    import cupy

    import flashcupy
    from flashcupy import naive, reference
    from flashcupy._checks import numpy_dtype

    rng = np.random.default_rng(2026)
    b, h = 1, 4
    print(f"| kernel | dtype | accum | max abs err | RMSE | naive same-precision max abs err | (B={b}, H={h}, N={n}, D={d}, N(0,1) inputs, seed 2026)")
    print("|---|---|---|---|---|---|")
    for kernel, dname, accum in (("mma", "f16", "fp32"), ("mma", "f16", "fp16"), ("mma", "bf16", "fp32"),
                                 ("simt", "f16", "fp32"), ("simt", "f16", "fp16"), ("simt", "bf16", "fp32"),
                                 ("simt", "bf16", "fp16"), ("simt", "f32", "fp32"), ("simt", "f32", "fp16")):
        dt = numpy_dtype(dname)
        qh, kh, vh = (rng.standard_normal((b, h, n, d)).astype(dt) for _ in range(3))
        ref = reference.attention(qh, kh, vh)
        q, k, v = (cupy.asarray(x) for x in (qh, kh, vh))
        o = reference.to_float64(flashcupy.attention(q, k, v, kernel=kernel, accum=accum))
        nv = reference.to_float64(naive.attention(q, k, v))
        e = o - ref
        print(f"| {kernel} | {dname} | {accum} | {np.abs(e).max():.2e} | {np.sqrt((e ** 2).mean()):.2e} | "
              f"{np.abs(nv - ref).max():.2e} |")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))

"""Quick forward timing against torch SDPA's flash backend, same process, same inputs (dev aid;
the full benchmark is `python -m analysis bench`, a later issue). Run on a GPU machine:
``python -m tests.kernels.quick_bench``."""
from __future__ import annotations

import numpy as np


def _median_ms(fn, reps=20):
    import cupy

    fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b))
    return float(np.median(times))


def main():
    import cupy
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashcupy

    print("| N | D | causal | flashcupy mma TFLOP/s | torch flash TFLOP/s | ratio |")
    print("|---|---|---|---|---|---|")
    b, h = 4, 32
    for n in (1024, 4096):
        for d in (64, 128):
            for causal in (False, True):
                q, k, v = (cupy.random.standard_normal((b, h, n, d), dtype=cupy.float32).astype(cupy.float16)
                           for _ in range(3))
                tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                t_fc = _median_ms(lambda: flashcupy.attention(q, k, v, causal=causal))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    t_fa = _median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                        tq, tk, tv, is_causal=causal))
                print(f"| {n} | {d} | {causal} | {flops / t_fc / 1e9:.0f} | {flops / t_fa / 1e9:.0f} | "
                      f"{t_fa / t_fc:.2f} |")


if __name__ == "__main__":
    main()

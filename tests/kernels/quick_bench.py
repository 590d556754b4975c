"""Development probe on a GPU machine: flashcupy's mma kernels (forward at several tiles, backward with
both dQ paths) against torch SDPA's flash and cuDNN backends, same process, same inputs, timed as
``python -m analysis bench`` times (CUDA events behind a GPU-holding kernel, median, inputs rotated).
The committed numbers come from ``python -m analysis bench``; this is the quick loop for tuning.

``python -m tests.kernels.quick_bench [N ...]`` (default N = 1024 4096 16384; B=4, H=32, fp16).
"""
from __future__ import annotations

import sys

FWD_TILES = [(128, 64), (128, 128), (128, 32), (64, 64)]


def main(ns=(1024, 4096, 16384)):
    import cupy
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashcupy
    from analysis.bench import Timer, flops
    from analysis.common import Context

    timer = Timer(Context.make("cuda", True, 0, "/tmp"), budget_s=0.15, min_reps=5, max_reps=30)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    b, h = 4, 32
    rows = []
    for n in ns:
        for d in (64, 128):
            for causal in (False, True):
                sets = [tuple(cupy.random.standard_normal((b, h, n, d), dtype=cupy.float32).astype(cupy.float16)
                              for _ in range(4)) for _ in range(2 if n >= 4096 else 4)]
                res = {}

                def tf(ms, direction):
                    return flops(b, h, n, d, causal, direction) / (ms * 1e-3) / 1e12

                for bm, bn in FWD_TILES:
                    try:
                        ms, _ = timer.median_ms(lambda s: flashcupy.attention(s[0], s[1], s[2], causal=causal,
                                                                               block_m=bm, block_n=bn), sets)
                        res[f"fwd {bm}x{bn}"] = tf(ms, "fwd")
                    except ValueError:
                        pass
                outs = [flashcupy.attention(s[0], s[1], s[2], causal=causal, return_lse=True) for s in sets]
                bsets = [(*s, *o) for s, o in zip(sets, outs)]
                for det in (False, True):
                    ms, _ = timer.median_ms(lambda s: flashcupy.attention_backward(
                        s[3], s[0], s[1], s[2], s[4], s[5], causal=causal, deterministic=det), bsets)
                    res["bwd det" if det else "bwd"] = tf(ms, "bwd")
                tsets = [tuple(torch.from_dlpack(x) for x in s) for s in sets]
                for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    def fw(s, be=be):
                        with sdpa_kernel(be):
                            return sdpa(s[0], s[1], s[2], is_causal=causal)
                    ms, _ = timer.median_ms(fw, tsets)
                    res[f"{name} fwd"] = tf(ms, "fwd")
                    g = []
                    for s in tsets:
                        q, k, v = (x.detach().requires_grad_() for x in s[:3])
                        g.append((q, k, v, s[3], fw((q, k, v))))
                    ms, _ = timer.median_ms(lambda s: torch.autograd.grad(s[4], s[:3], s[3], retain_graph=True), g)
                    res[f"{name} bwd"] = tf(ms, "bwd")
                    del g
                rows.append((n, d, causal, res))
                best = max((v, k) for k, v in res.items() if k.startswith("fwd "))
                print(f"N={n} D={d} causal={causal}: " + ", ".join(f"{k} {v:.0f}" for k, v in res.items())
                      + f" | best fwd {best[1]} {best[0] / res['flash fwd']:.2f}x flash, bwd "
                      f"{res['bwd'] / res['flash bwd']:.2f}x flash", flush=True)
                del sets, outs, bsets, tsets
                cupy.get_default_memory_pool().free_all_blocks()
    print("\n| N | D | causal | fwd 128x64 / flash | best fwd tile / flash | bwd / flash | bwd det / flash | "
          "fwd / cudnn | bwd / cudnn |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, d, causal, r in rows:
        best = max((v, k) for k, v in r.items() if k.startswith("fwd "))
        print(f"| {n} | {d} | {causal} | {r['fwd 128x64'] / r['flash fwd']:.2f} | {best[0] / r['flash fwd']:.2f} "
              f"({best[1][4:]}) | {r['bwd'] / r['flash bwd']:.2f} | {r['bwd det'] / r['flash bwd']:.2f} | "
              f"{r['fwd 128x64'] / r['cudnn fwd']:.2f} | {r['bwd'] / r['cudnn bwd']:.2f} |")


if __name__ == "__main__":
    main(tuple(int(a) for a in sys.argv[1:]) or (1024, 4096, 16384))

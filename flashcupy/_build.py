"""The kernel build layer: variant keys, compile options, memoized modules, compile reports.

Every kernel flashcupy launches is one *variant* of one *family* source in ``kernels_cu/``. A variant is
a readable key, e.g. ``fwd_mma.f16.acc32.bm128.bn64.d128.causal``, and this module is the one place
that turns a key into ``-D`` options, compiles it (NVRTC through ``cupy.RawModule``, memoized per
device), sets the dynamic shared-memory limit and reports registers / shared memory / spills.

``compile_report`` works on a machine with no GPU: CuPy's NVRTC bindings need no driver, only the
NVRTC library and the CUDA headers (the ``nvidia-cuda-nvrtc`` and ``nvidia-cuda-runtime`` wheels).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib.resources
import os
import re
import threading
from typing import Callable

__all__ = [
    "ATOMIC_DQ_ROLES", "Build", "DETERMINISTIC_DQ_ROLES", "DTYPES", "FAMILIES", "Family",
    "ORDERED_DQ_ROLES", "ROTATED_DQ_ROLES", "Variant", "bwd_wgmma_ordered_heads", "bwd_wgmma_rotated",
    "compile_report",
    "covering_variants", "current_build", "get_kernel", "kernel_build", "ptx", "source_text",
    "variant_source",
]

# Element types by short name: the name used in variant keys -> (FC_DTYPE code, bytes).
DTYPES = {"f32": (0, 4), "f16": (1, 2), "bf16": (2, 2)}
ACCUMS = ("fp32", "fp16")
ABLATIONS = (None, "max_subtraction", "rescaling")

_DEFAULT_SMEM_LIMIT = 48 * 1024        # without opting in
# cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90 (227 KiB); the kernels see it as FC_SMEM_LIMIT
SMEM_LIMIT = 227 * 1024
CHECK_ARCH = "sm_90"                   # what the CPU compile check targets: the H200's architecture


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclasses.dataclass(frozen=True)
class Family:
    """One kernel source and what its variants may be.

    ``kind`` is the ``kernel=`` name of the public API ("mma", "simt", ...) and ``direction`` "fwd" or
    "bwd"; ``roles`` maps each kernel's role to its name in the source: "fwd" for a forward family;
    "prep", "dkdv", "dq" (and, in bwd_mma and bwd_wgmma, "dkdvdq" and "dq_convert"; bwd_wgmma's ordered twin
    "dkdvdq_ordered" and, without a causal mask, its rotated atomic twin "dkdvdq_rotated") for a backward
    one.
    ``threads``, ``smem_bytes`` and ``head_dim_pad`` restate the formulas written at the top of the
    source file (``smem_bytes(variant, role)``: a backward source holds several kernels);
    ``no_spill`` says for which variants the compile check treats spills as a failure.
    """

    kind: str
    direction: str
    source: str
    roles: dict[str, str]
    dtypes: tuple[str, ...]
    block_m: tuple[int, ...]
    block_n: tuple[int, ...]
    accums: Callable[[str], tuple[str, ...]]
    head_dim_pad: Callable[[int], int]
    threads: Callable[["Variant"], int]
    smem_bytes: Callable[["Variant", str], int]
    # (dtype, head dim, accum, causal, n): n the query rows of the call, or None (a default for any length)
    default_blocks: Callable[[str, int, str, bool, int | None], tuple[int, int]]
    no_spill: Callable[["Variant"], bool]
    limits: Callable[["Variant"], str | None] = lambda v: None
    # NVRTC's -arch. None: the device's own, which CuPy appends at run time (the CPU compile check
    # targets CHECK_ARCH). A family that needs an arch-specific target (wgmma: "sm_90a") names it.
    arch: str | None = None
    # Which of ``roles`` a variant's module defines (default: all of them).
    roles_of: Callable[["Variant"], tuple[str, ...]] | None = None
    # Knobs the family derives from a variant (-D NAME=value), beyond the common ones.
    extra_defines: Callable[["Variant"], dict[str, int]] = lambda v: {}
    # A backward family whose atomic-dQ kernel has a twin that orders its dQ additions by key tile with
    # a counter per query tile (bwd_wgmma): deterministic calls launch ORDERED_DQ_ROLES.
    ordered_dq: bool = False

    @property
    def name(self) -> str:
        """The family's name in variant keys, e.g. ``fwd_mma``."""
        return f"{self.direction}_{self.kind}"


def _mma_threads(v: "Variant") -> int:
    # 4 warps (16 or 32 query rows each); 8 warps of 16 rows when a 128-row tile meets D > 128,
    # so that the output accumulator stays in registers.
    return 256 if (v.block_m == 128 and v.head_dim_pad > 128) else 128


def _mma_smem(v: "Variant", role: str) -> int:
    return (v.block_m + 2 * v.block_n) * v.head_dim_pad * DTYPES[v.dtype][1]


def _mma_defaults(dtype: str, d: int, accum: str, causal: bool, n: int | None = None) -> tuple[int, int]:
    return (128, 64)


def _simt_threads(v: "Variant") -> int:
    # half a warp (16 lanes) per 4 query rows, at most 256 threads (8 rows per half-warp at BM=128)
    return min(4 * v.block_m, 256)


def _simt_smem(v: "Variant", role: str) -> int:
    # fp32 tiles: Q (BM x DP), one K_j-then-V_j buffer (BN x (DP+4)), S_j/P_j (BM x (BN+4))
    dp = _round_up(v.head_dim, 16)
    return 4 * (v.block_m * dp + v.block_n * (dp + 4) + v.block_m * (v.block_n + 4))


def _simt_limits(v: "Variant") -> str | None:
    if v.block_m == 128 and v.head_dim > 128:
        return ("kernel='simt' with block_m=128 supports D <= 128 (the output accumulator would leave "
                "registers); use block_m <= 64")
    return None


def _bwd_mma_smem(v: "Variant", role: str) -> int:
    # Resident tiles plus one or two stages of streamed tiles (two when they fit), per kernel:
    # dK/dV keeps K, V and streams Q, dO, lse, delta (dkdvdq: plus the dS^T tile); dQ keeps Q, dO and
    # streams K, V; the dQ conversion needs none.
    row = v.head_dim_pad * 2
    if role in ("prep", "dq_convert"):
        return 0
    if role in ("dkdv", "dkdvdq"):
        resident, stage = 2 * v.block_n * row, 2 * v.block_m * row + 8 * v.block_m
        if role == "dkdvdq":
            resident += 2 * v.block_n * v.block_m
    else:
        resident, stage = 2 * v.block_m * row, 2 * v.block_n * row
    stages = 2 if resident + 2 * stage <= SMEM_LIMIT else 1
    return resident + stages * stage


# The two ways a backward call forms dQ, as the roles it launches after "prep": deterministic (dK/dV,
# then dQ) and atomic (dK/dV with dQ partials added to an fp32 buffer, then its conversion), the latter
# in bwd_mma with fp32 accumulators only. Every backward module also holds "prep" (bwd_prep.cuh: delta,
# and zeroing the dQ buffer).
DETERMINISTIC_DQ_ROLES = ("dkdv", "dq")
ATOMIC_DQ_ROLES = ("dkdvdq", "dq_convert")
ORDERED_DQ_ROLES = ("dkdvdq_ordered", "dq_convert")
ROTATED_DQ_ROLES = ("dkdvdq_rotated", "dq_convert")


def bwd_wgmma_rotated(d: int, causal: bool, n: int | None = None) -> bool:
    """Whether the wgmma backward's atomic path runs its rotated twin (ROTATED_DQ_ROLES) at head dim ``d``
    for ``n`` query rows (None: any length): CTA kt starts at query tile kt * n_qt / n_kt instead of 0,
    so that the CTAs of a head do not add into the same dQ rows at the same time. Without a causal mask
    only (the causal order is FlashAttention-3's LPT), and up to 2048 query rows. Measured (same process,
    fp16, B=4, H=32; docs/design/wgmma_backward.md): D=64 1.053x / 1.003x / 0.989x / 0.962x at N = 1024 /
    2048 / 4096 / 16384 (H200, before dQ by rows), 1.13x / 1.08x at N = 1024 / 2048 (H100), and with dQ
    by rows 1.042x / 1.007x / 0.985x at N = 1024 / 4096 / 16384 (H100); D=128 1.013x / 1.018x / 1.031x /
    1.019x at the four lengths (H200, 2026-11-24's kernels), then 0.984x / 0.979x at N = 4096 / 16384
    (H100, 54d6950's kernels), so D=128 no longer rotates from N = 4096 (its 1024 and 2048 keep the
    earlier gain, not remeasured)."""
    return not causal and n is not None and n <= 2048


def bwd_wgmma_ordered_heads(heads: int, key_tiles: int, tiles_per_cta: int, sms: int) -> int:
    """Heads per section of the wgmma backward's deterministic path without a causal mask (its last
    argument, dq_heads; kernels_cu/bwd_wgmma.cu's header): the blocks take the ``heads`` (batch, KV head)
    pairs in sections of this many and, inside a section, the key tile slowest, so that key tile kt + 1
    of a head starts after key tile kt has added into the first query tiles instead of waiting for it
    (each CTA runs ``tiles_per_cta`` = group * n_qt query tiles; ``key_tiles`` CTAs a head). Whatever
    this number, every CTA waits only on CTAs of lower block index.
    The rule: about one section's worth of CTAs starts per tile-step, sms / tiles_per_cta heads (rounded;
    at least 1), and every head when the grid fits in two waves of the SMs, where the first wave's start
    dominates. More heads cost L2 reuse of Q and dO (a head's key tiles then run far apart: all 128
    heads in one section ran at 0.47x to 0.65x the atomic path), fewer cost waits (one head per section,
    FlashAttention-3's order, 0.76x to 0.97x). Measured (fp16, non-causal, against the atomic path in
    alternating rounds; docs/design/wgmma_backward.md): on an H200, sections of 1 to 16 heads, the
    best of each B=4, H=32 cell near sms / tiles_per_cta; on an H100 this rule at 0.91x to 0.97x for
    B=4, H=32, N = 1024 to 16384, D 64 and 128, 0.88x to 0.90x at B * H = 8 and 16, and 0.65x for one
    head of 16384 queries (128 key tiles that all start at once and queue at every query tile)."""
    if heads * key_tiles <= 2 * sms:
        return max(1, heads)
    return max(1, min(heads, round(sms / max(tiles_per_cta, 1))))


def _bwd_wgmma_roles(v: "Variant") -> tuple[str, ...]:
    roles = FAMILIES["bwd_wgmma"].roles
    return tuple(r for r in roles if not (v.causal and r == "dkdvdq_rotated"))


def _bwd_mma_roles(v: "Variant") -> tuple[str, ...]:
    roles = FAMILIES["bwd_mma"].roles
    return tuple(r for r in roles if v.accum == "fp32" or r not in ATOMIC_DQ_ROLES)


def _bwd_simt_smem(v: "Variant", role: str) -> int:
    # fp32 tiles. dK/dV: K, V | Q, dO | P, dS | lse, delta. dQ: Q, dO | K, V | dS^T | lse, delta.
    dp, bm, bn = _round_up(v.head_dim, 16), v.block_m, v.block_n
    if role == "prep":
        return 0
    if role == "dkdv":
        return 4 * (2 * bn * (dp + 4) + 2 * bm * dp + 2 * bm * (bn + 4) + 2 * bm)
    return 4 * (2 * bm * dp + 2 * bn * (dp + 4) + bn * (bm + 4) + 2 * bm)


def _bwd_simt_limits(v: "Variant") -> str | None:
    dp = _round_up(v.head_dim, 16)
    if v.block_n * dp > 16384 or v.block_m * dp > 32768:
        return (f"kernel='simt' backward keeps block_n x D <= 16384 and block_m x D <= 32768 values in "
                f"registers; block_m={v.block_m}, block_n={v.block_n} with D={v.head_dim} does not fit")
    return None


def _simt_defaults(dtype: str, d: int, accum: str, causal: bool, n: int | None = None) -> tuple[int, int]:
    return (64, 64)


# fwd_wgmma.cu: K and V stream through this many shared-memory buffers (its FC_KV_STAGES default).
WGMMA_KV_STAGES = 2
WGMMA_HEAD_DIMS = (64, 128, 256)


def _wgmma_smem_tiles(v: "Variant") -> int:
    # 1024 bytes of alignment slack, the Q tile and WGMMA_KV_STAGES K and V tiles (2-byte elements, 1 byte
    # with fp8), the mbarriers (q_full, q_empty; k_full, k_empty, v_full, v_empty per stage) and 8 bytes
    # for the next tile's index
    st = v.switch("FC_KV_STAGES", WGMMA_KV_STAGES)
    return 1024 + (v.block_m + 2 * st * v.block_n) * v.head_dim * (1 if v.fp8 else 2) + 8 * (2 + 4 * st) + 8


def wgmma_o_stage(v: "Variant") -> int:
    """FC_WG_O_STAGE of a fwd_wgmma variant, how o leaves the CTA: 1 through the Q buffer and a TMA store
    (one tile per CTA), 2 through a buffer of its own and a TMA store (the tile loops, where it fits in
    shared memory), 0 straight from registers (4 bytes of half a 32-byte sector per lane and store).
    Measured on the H200 against the register stores (same process, fp16, B=4, H=32, o bitwise equal;
    docs/design/wgmma_forward.md): one tile per CTA +2.2% / +2.6% at D=128 N=4096 (non-causal / causal), +3.2%
    at N=16384, +5.2% / +6.4% at D=256 N=4096; the dynamic scheduler +14% at D=128 causal N=1024, +6.8% /
    +3.2% at D=64 causal N = 1024 / 4096. Register stores stay for e4m3 variants, loops on tiles that
    leave no room (128 x 176, D=256 with 128 rows), and the static split at D=64, where the TMA store
    measured 0.98x (a 128-byte row of o per lane group there: the register stores fill whole sectors)."""
    persistent = wgmma_persistent(v)
    if v.fp8 or (persistent == 1 and v.head_dim == 64):
        stage = 0
    elif not persistent:
        stage = 1
    else:
        stage = 2 if _wgmma_smem_tiles(v) + v.block_m * v.head_dim * 2 <= SMEM_LIMIT else 0
    return v.switch("FC_WG_O_STAGE", stage)


def _wgmma_smem(v: "Variant", role: str) -> int:
    # the tiles and barriers, and with FC_WG_O_STAGE 2 the o tile (2-byte elements); the fp8 V
    # transposition uses static shared memory only
    if role != "fwd":
        return 0
    return _wgmma_smem_tiles(v) + (v.block_m * v.head_dim * 2 if wgmma_o_stage(v) == 2 else 0)


# fp8 (e4m3) variants of fwd_wgmma: the accumulation of O (FC_FP8_TWO_LEVEL) and whether k's descale
# varies within a key tile (FC_FP8_KSCALE_KEY); flashcupy.fp8.attention_fp8 picks them.
FP8_ACCUMULATIONS = ("single", "tile")
# The default fp8 tiles (fp8_block_m): single-level accumulation at D=128 three consumer warpgroups (192
# query rows), each with its own softmax and no pingpong: measured on the H200 833 / 926 / 896 TFLOP/s at
# N = 4096 / 16384 / 16384 causal against 730 / 827 / 821 with two (128 rows, pingpong, overlap) and
# 582 / 653 / 602 with one. Two-level accumulation and D=256: two (a second O accumulator, or D=256's
# O, does not fit three).
FP8_HEAD_DIMS = (128, 256)


def fp8_block_m(accumulation: str, head_dim: int) -> int:
    """The default fp8 tile (query rows per CTA): 192 for single-level accumulation at D=128, else 128."""
    return 192 if accumulation == "single" and head_dim == 128 else 128
FP8_KSCALES = ("tile", "key")


def _wgmma_fp8_limits(v: "Variant") -> str | None:
    if v.fp8 not in FP8_ACCUMULATIONS:
        return f"fp8 accumulation must be one of {FP8_ACCUMULATIONS}, got {v.fp8!r}"
    if v.fp8_kscale not in FP8_KSCALES:
        return f"fp8_kscale must be one of {FP8_KSCALES}, got {v.fp8_kscale!r}"
    if v.head_dim not in FP8_HEAD_DIMS or v.block_n != 128 or v.block_m not in (64, 128, 192):
        return ("the fp8 wgmma forward runs D 128 and 256 with block_n 128 and block_m 64, 128 or 192; got "
                f"D={v.head_dim}, "
                f"block_m={v.block_m}, block_n={v.block_n} (other head dims: the NumPy twin)")
    if v.accum != "fp32":
        return "the fp8 wgmma forward runs fp32 accumulators"
    if v.head_dim == 256 and (v.fp8 != "single" or v.block_m != 128):
        # O alone takes 128 registers a thread: a second accumulator (two-level) spills 0.7 to 2 KB, and
        # one consumer warpgroup spills 16 bytes (measured locally)
        return (f"the fp8 wgmma forward at D=256 runs single-level accumulation with block_m 128; got "
                f"accumulation={v.fp8!r}, block_m={v.block_m}")
    if v.fp8 == "tile" and v.block_m > 128:
        # a second O accumulator (the tile's P V) does not fit three consumer warpgroups' 160 registers a
        # thread: ptxas spills 16 to 24 bytes (measured locally)
        return (f"the fp8 wgmma forward with two-level accumulation runs block_m 64 or 128, not {v.block_m} "
                "(its second O accumulator needs the registers of two consumer warpgroups)")
    return None


def _wgmma_limits(v: "Variant") -> str | None:
    if v.fp8 is not None:
        return _wgmma_fp8_limits(v)
    if v.head_dim not in WGMMA_HEAD_DIMS:
        return f"fwd_wgmma runs head dims {WGMMA_HEAD_DIMS}, not {v.head_dim}"
    if v.head_dim == 256 and (v.block_m > 128 or v.block_n not in (64, 80)):
        # 128 fp32 O registers a thread and 2 stages of K and V (80 KB each at block_n=80) leave no room
        return (f"kernel='wgmma' with D=256 supports block_m 64 or 128 and block_n 64 or 80; got "
                f"block_m={v.block_m}, block_n={v.block_n}")
    if v.block_n == 80 and v.head_dim != 256:
        return f"kernel='wgmma' runs block_n=80 at D=256 only (block_m={v.block_m}, D={v.head_dim})"
    if v.block_n == 176 and (v.head_dim != 128 or v.block_m > 128):
        # FlashAttention-3's D=128 tile: 88 fp32 S registers a thread beside O and P need the registers of
        # at most two consumer warpgroups (three have 160 a thread)
        return (f"kernel='wgmma' runs block_n=176 at D=128 with block_m 64 or 128; got block_m={v.block_m}, "
                f"D={v.head_dim}")
    if v.accum == "fp16" and v.block_m > 128:
        # ptxas serializes every wgmma of that tile for want of registers (C7511), measured locally
        return f"kernel='wgmma' with accum='fp16' supports block_m 64 or 128, not {v.block_m}"
    return None


# bwd_wgmma.cu: Q, dO (with L and delta) stream through this many buffers (its FC_BWD_STAGES default).
WGMMA_BWD_STAGES = 2
WGMMA_BWD_HEAD_DIMS = (64, 128)
# bwd_wgmma.cu's FC_BWD_DQ_ROWS: at block_m=128 with two consumer warpgroups (D=64) each forms the dQ
# share of its 64 query rows (1) or of its half of the columns (0).
WGMMA_BWD_DQ_ROWS = 1


def bwd_wgmma_dq_box_rows(v: "Variant") -> int:
    """The rows of the fp32 dQ buffer's TMA box in bwd_wgmma (the rows of a consumer's dQ share): 64 with
    FC_BWD_DQ_ROWS at block_m = block_n = 128, else block_m. Passed as FC_BWD_DQ_BOX_ROWS, which the kernel
    checks against its own layout (a mismatch does not compile) and the host reads back (_launch.py).
    A source older than the switch (54d6950) boxes block_m rows: an A/B arm of one sets FC_BWD_DQ_ROWS=0."""
    rows_split = v.block_m == 128 and v.block_n == 128 and v.switch("FC_BWD_DQ_ROWS", WGMMA_BWD_DQ_ROWS)
    return 64 if rows_split else v.block_m


def _bwd_wgmma_smem(v: "Variant", role: str) -> int:
    # 1024 bytes of alignment slack, K and V, the stages of Q, dO (2-byte elements) and of L, delta
    # (fp32), two dS^T tiles, the fp32 dQ tile and the mbarriers (kv_full; q_full, q_empty per stage)
    if role not in ("dkdvdq", "dkdvdq_rotated", "dkdvdq_ordered"):
        return 0
    bm, bn, d, st = v.block_m, v.block_n, v.head_dim, v.switch("FC_BWD_STAGES", WGMMA_BWD_STAGES)
    return (1024 + 2 * bn * d * 2 + st * (2 * bm * d * 2 + 8 * bm) + 2 * bn * bm * 2 + bm * d * 4
            + 8 * (1 + 2 * st))


def _bwd_wgmma_limits(v: "Variant") -> str | None:
    if v.head_dim not in WGMMA_BWD_HEAD_DIMS:
        return (f"kernel='wgmma' backward runs head dims {WGMMA_BWD_HEAD_DIMS}, not {v.head_dim}; "
                "kernel='mma' runs the others")
    if v.head_dim == 128 and v.block_n != 128:
        # one consumer warpgroup would hold dK, dV and a 64 x 128 dQ share: ptxas spills and serializes
        # every wgmma (C7512), measured locally
        return f"kernel='wgmma' backward with D=128 supports block_n=128, not {v.block_n}"
    if v.block_m == 128 and (v.head_dim != 64 or v.block_n != 128):
        # S^T and dP^T of 128 queries (64 registers each) beside dK and dV of D=128 exceed 240 registers;
        # with block_n=64 one warpgroup also holds a 128 x 64 dQ share: ptxas serializes every wgmma
        # (C7512), measured locally
        return ("kernel='wgmma' backward runs block_m=128 at D=64 with block_n=128 only, not "
                f"D={v.head_dim}, block_n={v.block_n}; block_m=64 runs both head dims")
    if v.block_m == 80 and (v.head_dim != 128 or v.block_n != 128):
        # FlashAttention-3's tile at D=128: dQ formed transposed by m64n80k16 per 64 columns of D, which
        # the two consumer warpgroups of a 128-key tile split
        return ("kernel='wgmma' backward runs block_m=80 at D=128 with block_n=128 only, not "
                f"D={v.head_dim}, block_n={v.block_n}")
    return None


def _fp8_defines(v: "Variant") -> dict[str, int]:
    if not v.fp8:
        return {}
    return {"FC_FP8": 1, "FC_FP8_TWO_LEVEL": int(v.fp8 == "tile"),
            "FC_FP8_KSCALE_KEY": int(v.fp8_kscale == "key")}


# How a fwd_wgmma variant walks its tiles (FC_WG_PERSISTENT 0, 1, 2): one tile per CTA ("tile"), or one CTA
# per SM looping over the tiles, a static split ("static") or handed out by a global counter, heaviest
# first ("dynamic", FlashAttention-3's scheduler).
SCHEDULES = ("tile", "static", "dynamic")


def wgmma_schedule(d: int, causal: bool, n: int | None = None, tile: tuple[int, int] = (128, 128)) -> str:
    """The default schedule of the wgmma forward at head dim ``d`` for ``n`` query rows (None: any) on
    ``tile`` (block_m, block_n).
    Measured on the H200 (same process, fp16 and bf16, B=4, H=32; docs/design/wgmma_forward.md):
    - D=64 without a causal mask, "static": 1.11x / 1.04x one tile per CTA at N = 1024 / 4096, 0.99x
      at 16384; "dynamic" 0.95-0.97x "static" there (the static order runs a head's query tiles side
      by side, so the CTAs running at once share its K and V in L2).
    - D=64 causal, "dynamic": 1.22x / 1.11x / 1.04x one tile per CTA at N = 1024 / 4096 / 16384 (a
      static split gave 0.56x: the tiles' costs differ).
    - D=128 causal, "dynamic" up to N = 2048 (1.05x at 1024, 1.02x at 2048), one tile per CTA above
      (the loop's bookkeeping in the consumers: dynamic 0.98x / 0.97x / 0.95x at 4096 / 8192 / 16384)
      and on tiles wider than 128 x 128 (the loop spills 8-16 bytes there).
    - D=128 without a mask, "static" up to N = 1024 (1.02x, fp16 and bf16) on tiles of at most 128
      query rows (three consumer warpgroups spill in the loop), one tile per CTA above (static 0.99x at
      2048, 0.96x at 4096; dynamic 0.92x at 1024).
    - D=256, one tile per CTA (the loop spills)."""
    if d == 64:
        return "dynamic" if causal else "static"
    if d == 128 and n is not None:
        if causal and n <= 2048 and max(tile) <= 128:
            return "dynamic"
        if not causal and n <= 1024 and tile[0] <= 128:
            return "static"
    return "tile"


def wgmma_persistent(v: "Variant") -> int:
    """FC_WG_PERSISTENT of a fwd_wgmma variant: 0 one tile per CTA, 1 a static split over one CTA per SM,
    2 the dynamic scheduler (its ``schedule``; None: ``wgmma_schedule`` for any length)."""
    return v.switch("FC_WG_PERSISTENT", SCHEDULES.index(v.schedule or wgmma_schedule(v.head_dim, v.causal)))


def _wgmma_defaults(dtype: str, d: int, accum: str, causal: bool, n: int | None = None) -> tuple[int, int]:
    # D=64: three consumer warpgroups (192 query rows) feed the tensor cores better than two
    # (measured on the H200: 1.02-1.10x the 128-row tile at N = 4096 and 16384 in 7 of 8 cells), with
    # fp32 accumulators (fp16 ones cannot take that tile, _wgmma_limits). FlashAttention-3's wide key
    # tiles, measured on the H200 against the 128- and 64-key tiles (same process, B=4, H=32):
    # D=128 without a causal mask 128 x 176 (1.02x at N=4096, 1.03-1.05x at 16384, fp16 and bf16; with
    # one 0.99x at N=4096: 128 x 128 stays), D=256 128 x 80 (1.04-1.05x at N = 1024, 4096 and 16384,
    # causal or not; the largest tile that fits in shared memory). fp16 accumulators keep the tiles
    # measured with them. D=64 causal up to 1024 query rows: 128 rows (the 192-row tiles leave the
    # heaviest query tile two thirds empty there; with the dynamic scheduler 1.07x the 192-row tile at
    # N=1024, 0.93x at 2048). D=128 without a mask up to 1024 query rows: 128 x 128, whose static split
    # stores o by TMA from a buffer of its own (no room beside 128 x 176): 1.08x 128 x 176 at N=1024.
    if d == 64 and accum == "fp32":
        return (128, 128) if causal and n is not None and n <= 1024 else (192, 128)
    if d == 256:
        return (128, 80) if accum == "fp32" else (128, 64)
    short = n is not None and n <= 1024
    return (128, 176) if d == 128 and accum == "fp32" and not causal and not short else (128, 128)


def default_tile(family: str, dtype: str, d: int, accum: str, causal: bool, block_m=None,
                 block_n=None, n: int | None = None) -> tuple:
    """(block_m, block_n) of a call that gives ``block_m`` and ``block_n`` or leaves them None: the
    family's default tile (``default_blocks``) for what is left None. A caller's block_m alone: the
    default key tile where the family runs it with that block_m, else the widest key tile it runs with it
    (e.g. block_m=192 at D=128 takes 128 keys: 176 needs two consumer warpgroups); block_n alone, the same
    the other way (e.g. the wgmma backward at D=64 with block_n=64 takes 64 query rows: 128 needs
    block_n=128). ``n``: the call's query rows, where a default depends on them. Values are not checked
    here: the caller's checks report a bad one. Inside a ``kernel_build`` whose defines set FC_BLOCK_M or
    FC_BLOCK_N, those are the call's tile where the caller left it None (an analysis.ab arm of another
    tile: the variant is then made with that tile, so the host launches its grid). The build's defines
    still compile every variant made inside it, so a call there that names another tile, or a family that
    does not run that tile (an FC_BLOCK_M=80 build's forward), fails instead of running: give none."""
    build = current_build()
    if build is not None and (block_m is None or block_n is None):
        over = dict(build.defines)
        block_m = over.get("FC_BLOCK_M") if block_m is None else block_m
        block_n = over.get("FC_BLOCK_N") if block_n is None else block_n
    fam = FAMILIES[family]
    dm, dn = fam.default_blocks(dtype, d, accum, causal, n)
    if block_m is None and block_n is None:
        return dm, dn
    if block_m is not None and block_n is not None:
        return block_m, block_n

    def runs(bm, bn):
        try:
            return Variant(family, dtype, accum, bm, bn, d, causal).fits()
        except (ValueError, TypeError):
            return False

    if block_n is None:
        return block_m, next((bn for bn in (dn, *sorted(fam.block_n, reverse=True)) if runs(block_m, bn)), dn)
    return next((bm for bm in (dm, *sorted(fam.block_m, reverse=True)) if runs(bm, block_n)), dm), block_n


_FAMILIES = (
    Family(
        kind="mma", direction="fwd", source="fwd_mma.cu", roles={"fwd": "flash_fwd_mma"},
        dtypes=("f16", "bf16"), block_m=(64, 128), block_n=(32, 64, 128),
        # mma.sync has no bf16 x bf16 -> f16 form: bf16 needs f32 accumulators.
        accums=lambda dtype: ("fp32", "fp16") if dtype == "f16" else ("fp32",),
        head_dim_pad=lambda d: _round_up(d, 32),
        threads=_mma_threads, smem_bytes=_mma_smem, default_blocks=_mma_defaults,
        # The tuned tile (128 x 64) must not spill at any head dim; other tiles may spill a few bytes
        # (BN=128 with fp32 accumulators at D 96/128, some fp16-accumulator tiles): reported, allowed.
        no_spill=lambda v: v.block_m == 128 and v.block_n == 64,
    ),
    Family(
        kind="wgmma", direction="fwd", source="fwd_wgmma.cu",
        roles={"fwd": "flash_fwd_wgmma", "v_transpose": "flash_fwd_fp8_v_transpose"},
        dtypes=("f16", "bf16"), block_m=(64, 128, 192), block_n=(64, 80, 128, 176),
        # wgmma has fp16 accumulators for fp16 inputs only, as mma.sync
        accums=lambda dtype: ("fp32", "fp16") if dtype == "f16" else ("fp32",),
        head_dim_pad=lambda d: d,
        # a producer warpgroup and one consumer warpgroup per 64 query rows
        threads=lambda v: 128 * (1 + v.block_m // 64),
        smem_bytes=_wgmma_smem, default_blocks=_wgmma_defaults,
        # Three consumer warpgroups at D=128 hold 128 registers a thread (overlap off there): with the
        # rescaling break and a causal mask ptxas spills 8 bytes. Reported, allowed; the others must not.
        no_spill=lambda v: v.fp8 is not None or not (v.block_m == 192 and v.head_dim == 128),
        limits=_wgmma_limits, arch="sm_90a",
        extra_defines=lambda v: {"FC_WG_PERSISTENT": int(wgmma_persistent(v)),
                                 "FC_WG_O_STAGE": wgmma_o_stage(v), **_fp8_defines(v)},
        roles_of=lambda v: ("fwd", "v_transpose") if v.fp8 else ("fwd",),
    ),
    Family(
        kind="simt", direction="fwd", source="fwd_simt.cu", roles={"fwd": "flash_fwd_simt"},
        dtypes=("f32", "f16", "bf16"), block_m=(16, 32, 64, 128), block_n=(16, 32, 64, 128),
        accums=lambda dtype: ACCUMS,
        head_dim_pad=lambda d: d,
        threads=_simt_threads, smem_bytes=_simt_smem, default_blocks=_simt_defaults,
        no_spill=lambda v: True, limits=_simt_limits,
    ),
    # Backward families: formulas restated from the headers of bwd_mma.cu / bwd_simt.cu.
    Family(
        kind="mma", direction="bwd", source="bwd_mma.cu",
        roles={"dkdv": "flash_bwd_dkdv_mma", "dq": "flash_bwd_dq_mma", "prep": "flash_bwd_prep",
               "dkdvdq": "flash_bwd_dkdvdq_mma", "dq_convert": "flash_bwd_dq_convert"},
        roles_of=_bwd_mma_roles,
        dtypes=("f16", "bf16"), block_m=(64, 128), block_n=(64, 128),
        accums=lambda dtype: ("fp32", "fp16") if dtype == "f16" else ("fp32",),
        head_dim_pad=lambda d: _round_up(d, 32),
        threads=lambda v: 256,
        smem_bytes=_bwd_mma_smem,
        default_blocks=lambda dtype, d, accum, causal, n=None: (64, 128) if d <= 128 else (64, 64),
        no_spill=lambda v: True,
        limits=lambda v: ("kernel='mma' backward with D > 128 supports block_n=64 only"
                          if v.head_dim_pad > 128 and v.block_n != 64 else None),
    ),
    Family(
        kind="wgmma", direction="bwd", source="bwd_wgmma.cu",
        roles={"prep": "flash_bwd_prep", "dkdvdq": "flash_bwd_dkdvdq_wgmma",
               "dkdvdq_rotated": "flash_bwd_dkdvdq_rotated_wgmma",
               "dkdvdq_ordered": "flash_bwd_dkdvdq_ordered_wgmma", "dq_convert": "flash_bwd_dq_convert"},
        roles_of=_bwd_wgmma_roles,
        # query tiles of 64 rows (or 128 at D=64, 80 at D=128); one consumer warpgroup per 64 keys of the
        # key tile
        dtypes=("f16", "bf16"), block_m=(64, 80, 128), block_n=(64, 128),
        # fp32 accumulators only: accum='fp16' runs on the mma family (_checks.py says so)
        accums=lambda dtype: ("fp32",),
        head_dim_pad=lambda d: d,
        threads=lambda v: 128 * (1 + v.block_n // 64),
        smem_bytes=_bwd_wgmma_smem,
        # D=64: 128 queries a tile, twice the products for the same per-tile waits and barriers (measured
        # on the H200: 1.07-1.14x the 64-query tile, 1.15-1.26x deterministic; docs/design/wgmma_backward.md).
        # D=128: FlashAttention-3's 80-query tile (dQ formed transposed), on an H100 without a causal mask
        # 1.01-1.04x the 64-query tile and 1.06-1.07x deterministic (a6c6dc3:reports/h100/bm80.md); with
        # one above N=2048 (1.00-1.04x; 0.98x at N=1024, 0.995x at 2048: a6c6dc3:reports/h100/bm80_causal*.md)
        default_blocks=lambda dtype, d, accum, causal, n=None: (
            (128, 128) if d == 64 else (80, 128) if not causal or n is None or n > 2048 else (64, 128)),
        no_spill=lambda v: True,
        limits=_bwd_wgmma_limits, arch="sm_90a",
        extra_defines=lambda v: {"FC_BWD_DQ_ROWS": WGMMA_BWD_DQ_ROWS,
                                 "FC_BWD_DQ_BOX_ROWS": bwd_wgmma_dq_box_rows(v)},
        # one kernel forms dQ both ways: its additions in any order, or in key-tile order (deterministic)
        ordered_dq=True,
    ),
    Family(
        kind="simt", direction="bwd", source="bwd_simt.cu",
        roles={"dkdv": "flash_bwd_dkdv_simt", "dq": "flash_bwd_dq_simt", "prep": "flash_bwd_prep"},
        dtypes=("f32", "f16", "bf16"), block_m=(16, 32, 64, 128), block_n=(16, 32, 64, 128),
        accums=lambda dtype: ACCUMS,
        head_dim_pad=lambda d: d,
        threads=lambda v: 256,
        smem_bytes=_bwd_simt_smem,
        default_blocks=lambda dtype, d, accum, causal, n=None: (64, 64) if d <= 160 else (32, 64),
        no_spill=lambda v: True,
        limits=_bwd_simt_limits,
    ),
)
FAMILIES: dict[str, Family] = {f.name: f for f in _FAMILIES}


_DEFINE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class Build:
    """How a variant's module is compiled beyond what its knobs say: for experiments on the kernels
    themselves (``python -m analysis.ab`` times and compares builds in one process).

    ``defines`` (name, value) pairs are passed after the variant's own -D options and replace them;
    ``kernels_dir`` is a folder that holds the family's source and every header it includes, compiled
    in place of the package's kernels_cu/. The host side of a call stays the package's: each kernel is
    launched with the dynamic shared memory its module was compiled for (its FC_SMEM_<ROLE>, which a
    define may replace), and a switch that changes anything else the host does needs host code that
    reads it from ``KernelHandle.defines``.
    """

    defines: tuple[tuple[str, int], ...] = ()
    kernels_dir: str | None = None

    def __post_init__(self):
        if not isinstance(self.defines, tuple):
            raise TypeError(f"defines must be a tuple of (name, int) pairs, got "
                            f"{type(self.defines).__name__}")
        for pair in self.defines:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise TypeError(f"defines must be (name, int) pairs, got {pair!r}")
            name, value = pair
            if not isinstance(name, str) or not _DEFINE_NAME.fullmatch(name):
                raise ValueError(f"a define's name must be a C identifier, got {name!r}")
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"define {name} must have an int value, got {value!r}")
        if len({name for name, _ in self.defines}) != len(self.defines):
            raise ValueError(f"each define may appear once, got {self.defines}")
        if self.kernels_dir is not None:
            if not isinstance(self.kernels_dir, str) or not os.path.isdir(self.kernels_dir):
                raise ValueError(f"kernels_dir must be an existing folder, got {self.kernels_dir!r}")
            object.__setattr__(self, "kernels_dir", os.path.abspath(self.kernels_dir))
        object.__setattr__(self, "defines", tuple(sorted(self.defines)))

    @property
    def label(self) -> str:
        """What a variant key gains: +NAME=value per define, @folder for a kernels folder."""
        parts = [f"+{n}={v}" for n, v in self.defines]
        if self.kernels_dir:
            parts.append("@" + self.kernels_dir)
        return "".join(parts)


_BUILD: contextvars.ContextVar[Build | None] = contextvars.ContextVar("flashcupy_build", default=None)


# current_build(): the Build that variants made now take (``kernel_build``), or None (the package's own).
# The ContextVar's own method, with no Python frame: the memoized checks of every call read it.
current_build = _BUILD.get


@contextlib.contextmanager
def kernel_build(defines: dict[str, int] | None = None, kernels_dir: str | None = None):
    """Inside this block every variant made, so every call of flashcupy made from this thread (the
    block is a ContextVar: threads started elsewhere, such as torch autograd's backward thread, run the
    package's kernels), compiles with these extra ``defines`` and from ``kernels_dir`` (see ``Build``);
    its modules, plans and memoized checks are their own, apart from the package's. Blocks do not nest
    into a merge: the inner one replaces the outer. With neither argument the block runs the package's
    own kernels. A ``kernels_dir`` must take the arguments this host passes (``_launch``'s argument
    layouts): a folder from a commit whose kernels have other parameter lists runs with wrong arguments
    (e.g. ``flash_bwd_prep`` takes ``dlse`` in every family since 215ec27)."""
    if defines is not None and not isinstance(defines, dict):
        raise TypeError(f"defines must be a dict of name -> int, got {type(defines).__name__}")
    build = Build(tuple((defines or {}).items()), kernels_dir)
    token = _BUILD.set(build if build != Build() else None)
    try:
        yield build
    finally:
        _BUILD.reset(token)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compile-time specialization of a family. ``key`` names it everywhere."""

    family: str
    dtype: str
    accum: str
    block_m: int
    block_n: int
    head_dim: int
    causal: bool = False
    ablate: str | None = None
    # fwd_wgmma only: e4m3 operands with this accumulation of O ("single" / "tile", FP8_ACCUMULATIONS), and
    # k's descale per key tile or per key (FP8_KSCALES); the dtype is then the output's
    fp8: str | None = None
    fp8_kscale: str = "tile"
    # fwd_wgmma only: how the CTAs walk the tiles (SCHEDULES); None, or the value equal to it, is the
    # default for any length, wgmma_schedule(head_dim, causal)
    schedule: str | None = None
    # compiled otherwise than the package does (experiments on the kernels; see Build). None: the
    # Build of the enclosing kernel_build block, if any
    build: Build | None = None

    def __post_init__(self):
        if self.build is None:
            object.__setattr__(self, "build", _BUILD.get())
        elif not isinstance(self.build, Build):
            raise TypeError(f"build must be a Build or None, got {type(self.build).__name__}")
        elif self.build == Build():  # the package's own: one key, one module
            object.__setattr__(self, "build", None)
        fam = FAMILIES.get(self.family)
        if fam is None:
            raise ValueError(f"unknown kernel family {self.family!r}; known: {sorted(FAMILIES)}")
        if self.fp8 is not None and self.family != "fwd_wgmma":
            raise ValueError(f"fp8 variants exist in fwd_wgmma only, not {self.family}")
        if self.dtype not in fam.dtypes:
            raise ValueError(f"{self.family} supports dtypes {fam.dtypes}, not {self.dtype!r}")
        if self.accum not in fam.accums(self.dtype):
            raise ValueError(f"{self.family} with {self.dtype} supports accum {fam.accums(self.dtype)}, "
                             f"not {self.accum!r}")
        if self.block_m not in fam.block_m or self.block_n not in fam.block_n:
            raise ValueError(f"{self.family} supports block_m in {fam.block_m} and block_n in "
                             f"{fam.block_n}; got block_m={self.block_m}, block_n={self.block_n}")
        if self.head_dim % 8 or not 8 <= self.head_dim <= 256:
            raise ValueError(f"head dim must be a multiple of 8 from 8 to 256, got {self.head_dim}")
        if self.ablate not in ABLATIONS:
            raise ValueError(f"ablate must be one of {ABLATIONS}, got {self.ablate!r}")
        if self.schedule is not None:
            if self.family != "fwd_wgmma" or self.schedule not in SCHEDULES:
                raise ValueError(f"schedule must be None or, in fwd_wgmma, one of {SCHEDULES}; got "
                                 f"{self.schedule!r} in {self.family}")
            if self.schedule == wgmma_schedule(self.head_dim, self.causal):
                object.__setattr__(self, "schedule", None)  # one key per kernel
        problem = fam.limits(self)
        if problem:
            raise ValueError(problem)

    @property
    def fam(self) -> Family:
        return FAMILIES[self.family]

    @property
    def head_dim_pad(self) -> int:
        return self.fam.head_dim_pad(self.head_dim)

    @property
    def threads(self) -> int:
        return self.fam.threads(self)

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles of the kernels this variant's module defines."""
        return self.fam.roles_of(self) if self.fam.roles_of else tuple(self.fam.roles)

    def kernel_name(self, role: str) -> str:
        """The name in the source of the kernel with this role, e.g. "dq" -> "flash_bwd_dq_mma"."""
        return self.fam.roles[role]

    @property
    def kernels(self) -> tuple[str, ...]:
        """The names of the kernels this variant's module defines."""
        return tuple(self.kernel_name(r) for r in self.roles)

    @property
    def smem_bytes(self) -> int:
        """The largest dynamic shared memory any kernel of the variant needs."""
        return max(self.smem_for(role) for role in self.roles)

    def smem_for(self, role: str) -> int:
        """Bytes of dynamic shared memory the kernel with this role is launched with."""
        return self.fam.smem_bytes(self, role)

    @property
    def key(self) -> str:
        parts = [self.family, self.dtype, "acc" + self.accum[2:], f"bm{self.block_m}",
                 f"bn{self.block_n}", f"d{self.head_dim}"]
        if self.causal:
            parts.append("causal")
        if self.ablate:
            parts.append("ablate_" + self.ablate)
        if self.fp8:
            parts.append(f"e4m3_{self.fp8}" + ("_kkey" if self.fp8_kscale == "key" else ""))
        if self.schedule:
            parts.append(self.schedule)
        return ".".join(parts) + (self.build.label if self.build else "")

    def __str__(self) -> str:
        return self.key

    def defines(self) -> dict[str, int]:
        """The -D options: the knobs, and each kernel's dynamic shared memory (FC_SMEM_<ROLE>) with the
        device limit (FC_SMEM_LIMIT), against which the kernels check their own layouts at compile time;
        last, the defines of the variant's Build, which replace any of these."""
        return {
            "FC_DTYPE": DTYPES[self.dtype][0],
            "FC_ACCUM_F16": int(self.accum == "fp16"),
            "FC_BLOCK_M": self.block_m,
            "FC_BLOCK_N": self.block_n,
            "FC_HEAD_DIM": self.head_dim,
            "FC_HEAD_DIM_PAD": self.head_dim_pad,
            "FC_NUM_THREADS": self.threads,
            "FC_CAUSAL": int(self.causal),
            "FC_ABLATE_MAX_SUBTRACTION": int(self.ablate == "max_subtraction"),
            "FC_ABLATE_RESCALING": int(self.ablate == "rescaling"),
            **{f"FC_SMEM_{role.upper()}": self.smem_for(role) for role in self.roles},
            **self.fam.extra_defines(self),
            "FC_SMEM_LIMIT": SMEM_LIMIT,
            **dict(self.build.defines if self.build else ()),
        }

    def switch(self, name: str, default: int) -> int:
        """A compile-time switch that the host follows too (a shared-memory layout, a grid): the value
        the variant's Build sets, else ``default``, the package's. Each formula of the host that depends
        on a switch reads it here, so a build may change the switch alone."""
        for n, value in self.build.defines if self.build else ():
            if n == name:
                return value
        return default

    def fits(self, smem_limit: int = SMEM_LIMIT) -> bool:
        return self.smem_bytes <= smem_limit


# --------------------------------------------------------------------------------------------------
# sources and options


def _kernels_dir() -> str:
    return str(importlib.resources.files("kernels_cu"))


def source_text(filename: str, kernels_dir: str | None = None) -> str:
    """A kernel source (of kernels_cu/, or of ``kernels_dir``) with a ``#line`` prefix so NVRTC errors
    name the real file and line, after a comment with a digest of the folder's headers: CuPy's on-disk
    kernel cache is keyed by the source text and the options, not by the files it includes, so without
    it a changed header would load the cubin compiled before the change."""
    if kernels_dir is None:
        return _package_source(filename)
    # read each time: an experiment edits the folder between calls
    path = os.path.join(kernels_dir, filename)
    with open(path) as f:
        text = f.read()
    return f'// headers {_headers_digest(kernels_dir)}\n#line 1 "{path}"\n{text}'


def _headers_digest(folder: str) -> str:
    import hashlib

    h = hashlib.sha1()
    for name in sorted(os.listdir(folder)):
        if name.endswith((".cuh", ".h")):
            with open(os.path.join(folder, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _package_source(filename: str) -> str:
    text = importlib.resources.files("kernels_cu").joinpath(filename).read_text()
    return f'// headers {_headers_digest(_kernels_dir())}\n#line 1 "kernels_cu/{filename}"\n' + text


def variant_source(v: Variant) -> str:
    """The source text a variant compiles: its family's, from its Build's folder if it names one."""
    folder = v.build.kernels_dir if v.build else None
    return source_text(v.fam.source) if folder is None else source_text(v.fam.source, folder)


@functools.lru_cache(maxsize=None)
def _cuda_include_dir() -> str | None:
    """Where cuda_fp16.h lives: CuPy's CUDA path (a toolkit or the nvidia-cuda-runtime wheel)."""
    candidates = []
    try:
        import cupy

        path = cupy.cuda.get_cuda_path()
        if path:
            candidates.append(os.path.join(path, "include"))
    except Exception:  # pragma: no cover - CuPy without a CUDA path
        pass
    try:  # the CUDA 13 wheels share nvidia/cu13/include; CUDA 12's runtime wheel has its own folder
        import nvidia

        for base in nvidia.__path__:
            candidates += [os.path.join(base, sub, "include") for sub in ("cu13", "cuda_runtime")]
    except Exception:
        pass
    for c in candidates:
        if os.path.exists(os.path.join(c, "cuda_fp16.h")):
            return c
    return None


def nvrtc_options(defines: dict[str, int], kernels_dir: str | None = None) -> tuple[str, ...]:
    """NVRTC options for a source of kernels_cu/ (or of ``kernels_dir``, whose headers then replace the
    package's) compiled with these -D knobs (the architecture is added by the caller)."""
    opts = ["-std=c++17", f"-I{kernels_dir or _kernels_dir()}"]
    inc = _cuda_include_dir()
    if inc:
        opts.append(f"-I{inc}")
    opts += [f"-D{k}={val}" for k, val in defines.items()]
    return tuple(opts)


def compile_options(v: Variant) -> tuple[str, ...]:
    """NVRTC options for a variant (the architecture is added by the caller)."""
    return nvrtc_options(v.defines(), v.build.kernels_dir if v.build else None)


# --------------------------------------------------------------------------------------------------
# run time: modules memoized per (variant, device)


class KernelHandle:
    """A compiled kernel with its launch geometry, and ``defines``: the -D values its module was
    compiled with (host code that must follow a compile-time switch reads it here)."""

    def __init__(self, variant: Variant, role: str, function, smem_bytes: int, defines: dict[str, int]):
        self.variant = variant
        self.role = role
        self.name = variant.kernel_name(role)
        self.function = function
        self.smem_bytes = smem_bytes
        self.defines = defines
        self.threads = variant.threads
        self.block = (self.threads,)

    def __call__(self, grid, args):
        self.function(grid, self.block, args, shared_mem=self.smem_bytes)


_MODULES: dict = {}                      # (variant, device id) -> {role: KernelHandle}
_MODULE_LOCKS: dict = {}                 # (variant, device id) -> the lock its first build holds
_LOCKS_LOCK = threading.Lock()


def _module_on_device(v: Variant, device_id: int):
    """The variant's kernels on a device, built once per process: threads that ask for the same module
    at once wait for one build (other modules build in parallel)."""
    key = (v, device_id)
    handles = _MODULES.get(key)
    if handles is None:
        with _LOCKS_LOCK:
            lock = _MODULE_LOCKS.setdefault(key, threading.Lock())
        with lock:
            handles = _MODULES.get(key)
            if handles is None:
                handles = _MODULES[key] = _build_module(v, device_id)
    return handles


def _build_module(v: Variant, device_id: int):
    import cupy

    dev = cupy.cuda.Device(device_id)
    limit = dev.attributes.get("MaxSharedMemoryPerBlockOptin", _DEFAULT_SMEM_LIMIT)
    defines = v.defines()
    # each kernel's dynamic shared memory as compiled: the variant's, unless its Build replaced it
    smem_of = {role: defines[f"FC_SMEM_{role.upper()}"] for role in v.roles}
    if max(smem_of.values()) > limit:
        raise ValueError(f"{v.key} needs {max(smem_of.values())} bytes of shared memory per block; this "
                         f"device allows {limit}. Choose smaller block_m/block_n.")
    # The architecture: CuPy appends the device's own -arch; a family that names one (wgmma: sm_90a)
    # passes it here, and an explicit -arch overrides CuPy's.
    arch = (f"-arch={v.fam.arch}",) if v.fam.arch else ()
    module = cupy.RawModule(code=variant_source(v), options=compile_options(v) + arch)
    handles = {}
    for role in v.roles:
        fn = module.get_function(v.kernel_name(role))
        smem = smem_of[role]
        if smem > _DEFAULT_SMEM_LIMIT:
            fn.max_dynamic_shared_size_bytes = smem
        handles[role] = KernelHandle(v, role, fn, smem, defines)
    return handles


def get_kernel(v: Variant, role: str | None = None) -> KernelHandle:
    """A compiled kernel of ``v`` on the current device (the module is compiled once per process and
    device); ``role`` picks one of the family's kernels ("fwd"; "prep", "dkdv", "dq", ...; default: the
    first)."""
    import cupy

    handles = _module_on_device(v, cupy.cuda.Device().id)
    return handles[role or v.roles[0]]


# --------------------------------------------------------------------------------------------------
# compile check without a GPU

_PTXAS_LINE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "smem_static": re.compile(r"(\d+) bytes smem"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


class CompileError(RuntimeError):
    pass


# The options cupy.RawModule appends to every NVRTC compile (CuPy 14, non-jitify): subnormals flushed, and
# unannotated functions compiled as __device__ (NVRTC 13.0 rejects a generic lambda in a kernel without
# it; 13.5 accepts it). The compile check adds them too, so that it compiles the code that runs.
RAWMODULE_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")


def _nvrtc():
    """CuPy's NVRTC binding (no GPU needed), or ImportError saying what to install."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as e:
        raise ImportError("compiling a kernel variant needs CuPy and its NVRTC (pip install "
                          "'flashcupy[cuda13]' or '[cuda12]'; no GPU needed)") from e
    return nvrtc


def _nvrtc_log(variant: Variant, arch: str) -> str:
    """NVRTC's log of one variant, with ptxas's -v resource report."""
    nvrtc = _nvrtc()

    prog = nvrtc.createProgram(variant_source(variant), variant.fam.source, [], [])
    opts = list(compile_options(variant)) + [f"-arch={arch}", *RAWMODULE_OPTIONS, "--ptxas-options=-v"]
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise CompileError(f"{variant.key}: {e}\n{nvrtc.getProgramLog(prog)}") from None
        return nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def _nvrtc_log_fresh_process(variant: Variant, arch: str) -> str:
    """``_nvrtc_log`` in a new Python process with NVRTC's compile cache off (CUDA_CACHE_DISABLE=1), so
    that ptxas runs and reports (see ``compile_report``). Returns "" if that process fails."""
    import pickle
    import subprocess
    import sys

    code = ("import pickle, sys; from flashcupy._build import _nvrtc_log; "
            "sys.stdout.write(_nvrtc_log(*pickle.loads(sys.stdin.buffer.read())))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "CUDA_CACHE_DISABLE": "1"}
    try:
        res = subprocess.run([sys.executable, "-c", code], input=pickle.dumps((variant, arch)),
                             capture_output=True, env=env, timeout=900)
    except (subprocess.SubprocessError, OSError):
        return ""
    return res.stdout.decode(errors="replace") if res.returncode == 0 else ""


def ptx(variant: Variant, arch: str | None = None) -> str:
    """The variant's PTX as NVRTC builds it (no GPU needed), for the CUDA toolkit's ptxas and cuobjdump:
    the cubin bytes of CuPy's NVRTC binding can come back truncated, and NVRTC's log can be empty."""
    nvrtc = _nvrtc()

    prog = nvrtc.createProgram(variant_source(variant), variant.fam.source, [], [])
    arch = arch or variant.fam.arch or CHECK_ARCH
    opts = list(compile_options(variant)) + [f"-arch={arch}", *RAWMODULE_OPTIONS]
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise CompileError(f"{variant.key}: {e}\n{nvrtc.getProgramLog(prog)}") from None
        out = nvrtc.getPTX(prog)
        return out.decode() if isinstance(out, bytes) else out
    finally:
        nvrtc.destroyProgram(prog)


def toolkit_ptxas(ptx_text: str, arch: str, cubin: str):
    """``ptxas -v`` of the CUDA toolkit on PTX text, writing ``cubin``: the CompletedProcess, or None when
    no ptxas is on PATH. A toolkit older than NVRTC refuses the text's ``.version`` ("current version is
    'X'"); the text is then assembled once more at version X (the kernels use no newer PTX feature, and
    ptxas says so if one does)."""
    import shutil
    import subprocess
    import tempfile

    exe = shutil.which("ptxas")
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        for _ in range(2):
            with open(src, "w") as f:
                f.write(ptx_text)
            res = subprocess.run([exe, f"-arch={arch}", "-v", src, "-o", cubin], capture_output=True,
                                 text=True)
            older = re.search(r"Unsupported \.version [\d.]+; current version is '([\d.]+)'", res.stderr)
            if res.returncode == 0 or not older:
                break
            ptx_text = re.sub(r"^\.version [\d.]+", f".version {older.group(1)}", ptx_text, count=1,
                              flags=re.M)
    return res


def _toolkit_ptxas_log(variant: Variant, arch: str) -> str | None:
    """ptxas -v's report of the variant's NVRTC PTX through the CUDA toolkit's ptxas, or None when no
    ptxas is on PATH or it does not assemble this PTX."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        res = toolkit_ptxas(ptx(variant, arch), arch, os.path.join(tmp, "k.cubin"))
    return res.stdout + res.stderr if res is not None and res.returncode == 0 else None


def compile_report(variant: Variant, arch: str | None = None) -> dict:
    """Compile one variant to a cubin with NVRTC (no GPU needed) and read ptxas's resource report.

    Returns a dict with key, registers, smem_static, smem_dynamic, stack, spill_stores, spill_loads (the
    worst over the module's kernels; per kernel under "kernels") and ptxas's warning lines.
    Raises CompileError with the NVRTC log on failure.
    """
    arch = arch or variant.fam.arch or CHECK_ARCH
    log = _nvrtc_log(variant, arch)
    if "Function properties for" not in log:
        # NVRTC >= 12.9 keeps compiled cubins in the CUDA compute cache on disk (shared by processes); a
        # compile served from it never runs ptxas, so the log holds no -v report (measured on the H200
        # machine, NVRTC 13.0: three identical compiles of a one-line kernel log 306, 0, 0 bytes;
        # NVIDIA/cuda-python#1124 describes the same). The report is compiled again in a fresh process
        # with CUDA_CACHE_DISABLE=1; the toolkit's ptxas on NVRTC's PTX is the last resort.
        fresh = _nvrtc_log_fresh_process(variant, arch)
        log = fresh if "Function properties for" in fresh else (_toolkit_ptxas_log(variant, arch) or log)
    # ptxas reports each entry function in turn; a backward source holds several. Per kernel:
    defines = variant.defines()
    rep = {"key": variant.key, "threads": variant.threads, "kernels": {}}
    for role in variant.roles:
        name = variant.kernel_name(role)
        i = log.find(f"Function properties for {name}")
        if i < 0:
            raise CompileError(f"{variant.key}: ptxas reported no resources for {name}; "
                               f"NVRTC log:\n{log[:2000]}")
        section = log[i:]
        j = section.find("Compiling entry function", 1)
        section = section[:j] if j > 0 else section
        krep = {}
        for field, rx in _PTXAS_LINE.items():
            m = rx.search(section)
            krep[field] = int(m.group(1)) if m else 0
        krep["smem_dynamic"] = defines[f"FC_SMEM_{role.upper()}"]
        rep["kernels"][name] = krep
    # ptxas warnings, and the "Potential Performance Loss" notes (C75xx, printed as info lines) that
    # silently serialize wgmma (C7515, C7513, C7511) or ignore setmaxnreg (C7508)
    rep["warnings"] = [line.strip() for line in log.splitlines()
                       if "warning" in line.lower() or re.search(r"\bC75\d\d\b", line)]
    # summary over the kernels: the worst of each
    for field in list(_PTXAS_LINE) + ["smem_dynamic"]:
        rep[field] = max(k[field] for k in rep["kernels"].values())
    return rep


def covering_variants(family: str) -> list[Variant]:
    """A covering set for the compile check: every value of every knob at least once, and the pairs
    dtype x accum, block_m x block_n and causal x ablate in full (variants that do not fit in shared
    memory are left out)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {tuple(FAMILIES)}, got {family!r}")
    fam = FAMILIES[family]
    head_dims = (8, 32, 40, 64, 96, 128, 256)
    base = dict(family=family, dtype=fam.dtypes[0], accum="fp32", head_dim=64, causal=False,
                ablate=None)
    base["block_m"], base["block_n"] = fam.default_blocks(fam.dtypes[0], 64, "fp32", False)
    out: dict[str, Variant] = {}

    def add(**kw):
        args = {**base, **kw}
        if "block_m" not in kw:  # the default tile of this dtype, head dim, accumulator and mask
            args["block_m"], args["block_n"] = fam.default_blocks(args["dtype"], args["head_dim"],
                                                                  args["accum"], args["causal"])
        try:
            v = Variant(**args)
        except ValueError:  # outside the family's limits
            return
        if v.fits():
            out.setdefault(v.key, v)

    for dt in fam.dtypes:
        for acc in fam.accums(dt):
            add(dtype=dt, accum=acc)
    for bm in fam.block_m:
        for bn in fam.block_n:
            add(block_m=bm, block_n=bn)
    for d in head_dims:
        add(head_dim=d)
    for causal in (False, True):
        for ab in ABLATIONS:
            add(causal=causal, ablate=ab)
    # the widest head dim with the largest tiles that fit, in every dtype
    for dt in fam.dtypes:
        add(dtype=dt, head_dim=256, causal=True)
    # the Hopper family's register budget depends on the tile and D together: every tile at D=128,
    # causal, with each break
    if fam.kind == "wgmma":
        for bm in fam.block_m:
            for bn in fam.block_n:
                for ab in ABLATIONS:
                    add(block_m=bm, block_n=bn, head_dim=128, causal=True, ablate=ab)
    # the tile loops at D=128 for short sequences (wgmma_schedule): the dynamic scheduler with a causal
    # mask, the static split without, on every tile they run on, with each break, and fp16 accumulators
    if family == "fwd_wgmma":
        for bm in (64, 128):
            for bn in (64, 128, 176):
                for ab in ABLATIONS:
                    if bn <= 128:
                        add(block_m=bm, block_n=bn, head_dim=128, causal=True, ablate=ab, schedule="dynamic")
                    add(block_m=bm, block_n=bn, head_dim=128, ablate=ab, schedule="static")
        add(head_dim=128, causal=True, accum="fp16", schedule="dynamic")
        add(head_dim=128, accum="fp16", schedule="static")
    # fp8 (fwd_wgmma): every accumulation x k-descale x causal on its default tile, the 64- and 128-row
    # tiles, and the breaks
    if family == "fwd_wgmma":
        for acc in FP8_ACCUMULATIONS:
            for ks in FP8_KSCALES:
                for causal in (False, True):
                    add(head_dim=128, block_m=fp8_block_m(acc, 128), block_n=128, causal=causal, fp8=acc,
                        fp8_kscale=ks)
            for bm in (64, 128):
                add(head_dim=128, block_m=bm, block_n=128, causal=True, fp8=acc)
            for ab in ABLATIONS[1:]:
                add(head_dim=128, block_m=fp8_block_m(acc, 128), block_n=128, causal=True, fp8=acc, ablate=ab)
        for causal in (False, True):
            for ks in FP8_KSCALES:
                add(head_dim=256, block_m=128, block_n=128, causal=causal, fp8="single", fp8_kscale=ks)
    return list(out.values())

"""What each kernel family can do: the family table, and per family its thread count, shared-memory
bytes, head-dim padding, roles and limits, each formula restating the one at the top of its source in
``kernels_cu/`` (whose ``static_assert`` checks the host's number at compile time).

Nothing here is a choice: which family, tile, schedule or kernel roles a call takes is ``_policy``'s;
what a variant is, ``_variant``'s; compiling it, ``_compile``'s.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # the formulas read a Variant's fields; _variant imports this module
    from ._variant import Variant

# Element types by short name: the name used in variant keys -> (FC_DTYPE code, bytes).
DTYPES = {"f32": (0, 4), "f16": (1, 2), "bf16": (2, 2)}
ACCUMS = ("fp32", "fp16")
ABLATIONS = (None, "max_subtraction", "rescaling")
# breaks that run on the NumPy twin only (no kernel compiles them): the softcap applied after the mask
# (tanh(-inf) = -1: every masked key scores -cap instead of -inf)
TWIN_ABLATIONS = ("softcap_after_mask", "alibi_unshifted")
# the families with a varlen variant (FC_VARLEN: packed sequences, flashcupy.attention_varlen)
VARLEN_FAMILIES = ("fwd_simt", "fwd_mma", "fwd_wgmma", "bwd_simt", "bwd_mma", "bwd_wgmma")

# cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90 (227 KiB); the kernels see it as FC_SMEM_LIMIT
SMEM_LIMIT = 227 * 1024


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

def _bwd_wgmma_roles(v: "Variant") -> tuple[str, ...]:
    roles = FAMILIES["bwd_wgmma"].roles
    return tuple(r for r in roles if not ((v.causal or v.window) and r == "dkdvdq_rotated"))


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


# fwd_wgmma.cu: K and V stream through this many shared-memory buffers (its FC_KV_STAGES default).
WGMMA_KV_STAGES = 2
WGMMA_HEAD_DIMS = (64, 128, 256)


def wgmma_smem_tiles(v: "Variant") -> int:
    # 1024 bytes of alignment slack, the Q tile and WGMMA_KV_STAGES K and V tiles (2-byte elements, 1 byte
    # with fp8), the mbarriers (q_full, q_empty; k_full, k_empty, v_full, v_empty per stage) and 8 bytes
    # for the next tile's index
    st = v.switch("FC_KV_STAGES", WGMMA_KV_STAGES)
    return 1024 + (v.block_m + 2 * st * v.block_n) * v.head_dim * (1 if v.fp8 else 2) + 8 * (2 + 4 * st) + 8


def _wgmma_smem(v: "Variant", role: str) -> int:
    # the tiles and barriers, and with FC_WG_O_STAGE 2 (the variant's o_stage: _policy.wgmma_o_stage) the
    # o tile (2-byte elements); the fp8 V transposition uses static shared memory only
    if role != "fwd":
        return 0
    return wgmma_smem_tiles(v) + (v.block_m * v.head_dim * 2 if v.o_stage == 2 else 0)


# fp8 (e4m3) variants of fwd_wgmma: the accumulation of O (FC_FP8_TWO_LEVEL) and whether k's descale
# varies within a key tile (FC_FP8_KSCALE_KEY); flashcupy.fp8.attention_fp8 picks them.
FP8_ACCUMULATIONS = ("single", "tile")
FP8_HEAD_DIMS = (128, 256)
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
    if v.softcap and v.block_m != 64:
        # P hook'(t) in P's registers and P's A fragments beside them spill at 80 and 128 queries
        # (_policy.default_blocks), measured locally
        return f"kernel='wgmma' backward runs a softcap at block_m=64, not {v.block_m}"
    if v.softcap and v.alibi and v.head_dim > 64:
        # ALiBi's slope and offset beside the softcap's P hook'(t) spill 20 bytes at D=128 (ptxas,
        # measured locally)
        return (f"kernel='wgmma' backward runs the softcap with ALiBi at D=64 only, not D={v.head_dim}; "
                "kernel='mma' runs both")
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


_FAMILIES = (
    Family(
        kind="mma", direction="fwd", source="fwd_mma.cu", roles={"fwd": "flash_fwd_mma"},
        dtypes=("f16", "bf16"), block_m=(64, 128), block_n=(32, 64, 128),
        # mma.sync has no bf16 x bf16 -> f16 form: bf16 needs f32 accumulators.
        accums=lambda dtype: ("fp32", "fp16") if dtype == "f16" else ("fp32",),
        head_dim_pad=lambda d: _round_up(d, 32),
        threads=_mma_threads, smem_bytes=_mma_smem,
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
        smem_bytes=_wgmma_smem,
        # Three consumer warpgroups at D=128 hold 128 registers a thread (overlap off there): with the
        # rescaling break and a causal mask ptxas spills 8 bytes. Reported, allowed; the others must not.
        no_spill=lambda v: v.fp8 is not None or not (v.block_m == 192 and v.head_dim == 128),
        limits=_wgmma_limits, arch="sm_90a",
        # the tile walk and the way o leaves, as _policy chose them for the variant
        extra_defines=lambda v: {"FC_WG_PERSISTENT": v.persistent, "FC_WG_O_STAGE": v.o_stage,
                                 **_fp8_defines(v)},
        roles_of=lambda v: ("fwd", "v_transpose") if v.fp8 else ("fwd",),
    ),
    Family(
        kind="simt", direction="fwd", source="fwd_simt.cu", roles={"fwd": "flash_fwd_simt"},
        dtypes=("f32", "f16", "bf16"), block_m=(16, 32, 64, 128), block_n=(16, 32, 64, 128),
        accums=lambda dtype: ACCUMS,
        head_dim_pad=lambda d: d,
        threads=_simt_threads, smem_bytes=_simt_smem,
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
        no_spill=lambda v: True,
        limits=_bwd_simt_limits,
    ),
)
FAMILIES: dict[str, Family] = {f.name: f for f in _FAMILIES}


"""Every measured choice of the build layer, as plain functions with their reasons: the family
``kernel='auto'`` takes, the default tile of each family, the Hopper forward's tile walk and how its o
leaves the CTA, the fp8 tile and how it reads k's descale, and the kernels a backward call launches
(the rotated and ordered twins of the wgmma backward, and the heads per section of the ordered one).

A call consults them once: the checks (memoized per signature) fill a ``Variant``'s explicit fields
(family, tile, schedule), a ``Variant`` computes its derived switches (``persistent``, ``o_stage``)
once, and a launch plan its roles and grid. What each family *can* run is ``_families``'; the
numbers behind each choice are in ``docs/design/`` (the runs are cited there).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ._families import (
    ATOMIC_DQ_ROLES,
    DETERMINISTIC_DQ_ROLES,
    FAMILIES,
    ORDERED_DQ_ROLES,
    ROTATED_DQ_ROLES,
    SCHEDULES,
    SMEM_LIMIT,
    wgmma_smem_tiles,
)

if TYPE_CHECKING:  # the choices read a Variant's fields; _variant imports this module
    from ._variant import Variant

__all__ = [
    "auto_family", "backward_roles", "bwd_wgmma_ordered_heads", "bwd_wgmma_rotated", "default_blocks",
    "default_tile", "fp8_block_m", "fp8_kscale", "kvcache_splits", "launch_roles", "paged_block_n",
    "wgmma_o_stage", "wgmma_persistent", "wgmma_schedule",
]


# --------------------------------------------------------------------------------------------------
# which family


def auto_family(direction: str, dname: str, accum: str, head_dim: int, block_m=None, block_n=None,
                causal: bool = False, *, hopper: bool, softcap: float = 0.0, alibi: bool = False) -> str:
    """The family of ``kernel='auto'``: the Hopper family where ``hopper`` (a Hopper GPU, and the wgmma
    family takes this dtype, accumulator and head dim: ``_checks`` asks) and the requested tile is one
    of its tiles at this head dim; else mma where tensor cores take the dtype and accumulator; else
    simt (every dtype, accumulator and head dim)."""
    if hopper:
        from ._variant import Variant  # _variant reads this module's choices

        wgmma = f"{direction}_wgmma"
        bm, bn = default_tile(wgmma, dname, head_dim, accum, causal, block_m, block_n, softcap=softcap)
        try:
            Variant(wgmma, dname, accum, bm, bn, head_dim, softcap=softcap, alibi=alibi)
            return wgmma
        except ValueError:
            pass
    mma = FAMILIES[f"{direction}_mma"]
    if dname in mma.dtypes and accum in mma.accums(dname):
        return mma.name
    return f"{direction}_simt"


# --------------------------------------------------------------------------------------------------
# tiles


def _fwd_wgmma_blocks(dtype: str, d: int, accum: str, causal: bool, n: int | None) -> tuple[int, int]:
    # D=64: three consumer warpgroups (192 query rows) feed the tensor cores better than two
    # (measured on the H200: 1.02-1.10x the 128-row tile at N = 4096 and 16384 in 7 of 8 cells), with
    # fp32 accumulators (fp16 ones cannot take that tile: _families._wgmma_limits). FlashAttention-3's
    # wide key tiles, measured on the H200 against the 128- and 64-key tiles (same process, B=4, H=32):
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


def _bwd_wgmma_blocks(dtype: str, d: int, accum: str, causal: bool, n: int | None) -> tuple[int, int]:
    # D=64: 128 queries a tile, twice the products for the same per-tile waits and barriers (measured
    # on the H200: 1.07-1.14x the 64-query tile, 1.15-1.26x deterministic; docs/design/wgmma_backward.md).
    # D=128: FlashAttention-3's 80-query tile (dQ formed transposed), on an H100 without a causal mask
    # 1.01-1.04x the 64-query tile and 1.06-1.07x deterministic (a6c6dc3:reports/h100/bm80.md); with
    # one above N=2048 (1.00-1.04x; 0.98x at N=1024, 0.995x at 2048: a6c6dc3:reports/h100/bm80_causal*.md)
    return (128, 128) if d == 64 else (80, 128) if not causal or n is None or n > 2048 else (64, 128)


# (dtype, head dim, accum, causal, n) -> (block_m, block_n) per family; n: the call's query rows, or None
# (a default for any length)
_DEFAULT_BLOCKS = {
    "fwd_mma": lambda dtype, d, accum, causal, n: (128, 64),
    "fwd_wgmma": _fwd_wgmma_blocks,
    "fwd_simt": lambda dtype, d, accum, causal, n: (64, 64),
    "bwd_mma": lambda dtype, d, accum, causal, n: (64, 128) if d <= 128 else (64, 64),
    "bwd_wgmma": _bwd_wgmma_blocks,
    "bwd_simt": lambda dtype, d, accum, causal, n: (64, 64) if d <= 160 else (32, 64),
}


def default_blocks(family: str, dtype: str, d: int, accum: str, causal: bool,
                   n: int | None = None, softcap: bool = False) -> tuple[int, int]:
    """The family's default (block_m, block_n) for this dtype, head dim, accumulator, mask, ``n``
    query rows (None: any length) and softcap; the family may still refuse it (``Variant``'s limits say
    why)."""
    bm, bn = _DEFAULT_BLOCKS[family](dtype, d, accum, causal, n)
    if softcap and family == "bwd_wgmma":
        # a softcap keeps P hook'(t) in P's registers with P's A fragments beside them (the score hook,
        # flash_common.cuh): 64 queries a tile run spill-free, 80 and 128 spill 96-208 bytes (NVRTC 13)
        return 64, bn
    return bm, bn


def default_tile(family: str, dtype: str, d: int, accum: str, causal: bool, block_m=None,
                 block_n=None, n: int | None = None, softcap: float = 0.0) -> tuple:
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
    from ._variant import Variant, current_build  # _variant reads this module's choices

    build = current_build()
    if build is not None and (block_m is None or block_n is None):
        over = dict(build.defines)
        block_m = over.get("FC_BLOCK_M") if block_m is None else block_m
        block_n = over.get("FC_BLOCK_N") if block_n is None else block_n
    fam = FAMILIES[family]
    dm, dn = default_blocks(family, dtype, d, accum, causal, n, bool(softcap))
    if block_m is None and block_n is None:
        return dm, dn
    if block_m is not None and block_n is not None:
        return block_m, block_n

    def runs(bm, bn):
        try:
            return Variant(family, dtype, accum, bm, bn, d, causal, softcap=softcap).fits()
        except (ValueError, TypeError):
            return False

    if block_n is None:
        return block_m, next((bn for bn in (dn, *sorted(fam.block_n, reverse=True)) if runs(block_m, bn)), dn)
    return next((bm for bm in (dm, *sorted(fam.block_m, reverse=True)) if runs(bm, block_n)), dm), block_n


def fp8_block_m(accumulation: str, head_dim: int, softcap: bool = False) -> int:
    """The default fp8 tile (query rows per CTA): 192 for single-level accumulation at D=128 without a
    softcap, else 128. (With the softcap, the 192-row tile's three warpgroups at 128 registers spill 52
    bytes where k's descale is constant over a key tile, ptxas sm_90a; the 128-row tile spills none.)
    Single-level accumulation at D=128 runs three consumer warpgroups, each with its own softmax and no
    pingpong: measured on the H200 833 / 926 / 896 TFLOP/s at N = 4096 / 16384 / 16384 causal against
    730 / 827 / 821 with two (128 rows, pingpong, overlap) and 582 / 653 / 602 with one. Two-level
    accumulation and D=256 take two (a second O accumulator, or D=256's O, does not fit three)."""
    return 192 if accumulation == "single" and head_dim == 128 and not softcap else 128


def fp8_kscale(granularity: str, block: int | None, block_n: int, head_dim: int, softcap: bool) -> str:
    """How the fp8 forward reads k's descale: "tile", one value per key tile, where it is constant over
    each (per tensor, per head, or per block of tokens that a multiple of block_n keys makes), else "key",
    one per key. With a softcap at D = 256 the per-key path runs anyway (the descales are flattened per
    key): the per-tile one spills 8 bytes there (ptxas sm_90a), the per-key one none."""
    constant = granularity in ("tensor", "head") or (granularity == "block" and block % block_n == 0)
    return "tile" if constant and not (softcap and head_dim == 256) else "key"


# --------------------------------------------------------------------------------------------------
# the Hopper forward: how its CTAs walk the tiles, and how o leaves


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



def wgmma_o_stage(v: "Variant") -> int:
    """FC_WG_O_STAGE of a fwd_wgmma variant, how o leaves the CTA: 1 through the Q buffer and a TMA store
    (one tile per CTA), 2 through a buffer of its own and a TMA store (the tile loops, where it fits in
    shared memory), 0 straight from registers (4 bytes of half a 32-byte sector per lane and store).
    Measured on the H200 against the register stores (same process, fp16, B=4, H=32, o bitwise equal;
    docs/design/wgmma_forward.md): one tile per CTA +2.2% / +2.6% at D=128 N=4096 (non-causal / causal), +3.2%
    at N=16384, +5.2% / +6.4% at D=256 N=4096; the dynamic scheduler +14% at D=128 causal N=1024, +6.8% /
    +3.2% at D=64 causal N = 1024 / 4096. Register stores stay for e4m3 variants, loops on tiles that
    leave no room (128 x 176, D=256 with 128 rows), and the static split at D=64, where the TMA store
    measured 0.98x (a 128-byte row of o per lane group there: the register stores fill whole sectors).
    Packed sequences follow the same rule; their kernel stores by TMA only the 64 rows of a warpgroup that
    all lie in its sequence, the others from registers."""
    persistent = v.persistent
    if v.fp8 or (persistent == 1 and v.head_dim == 64):
        stage = 0
    elif not persistent:
        stage = 1
    else:
        stage = 2 if wgmma_smem_tiles(v) + v.block_m * v.head_dim * 2 <= SMEM_LIMIT else 0
    return v.switch("FC_WG_O_STAGE", stage)


# --------------------------------------------------------------------------------------------------
# the backward's kernels


def bwd_wgmma_rotated(d: int, causal: bool, n: int | None = None) -> bool:
    """Whether the wgmma backward's atomic path runs its rotated twin (ROTATED_DQ_ROLES) at head dim ``d``
    for ``n`` query rows (None: any length): CTA kt starts at query tile kt * n_qt / n_kt instead of 0,
    so that the CTAs of a head do not add into the same dQ rows at the same time. Without a causal mask
    only (the causal order is FlashAttention-3's LPT; a window's CTAs start on different query tiles
    anyway, and backward_roles never rotates one), and up to 2048 query rows. Measured (same process,
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


def backward_roles(var, deterministic: bool, n: int | None = None) -> tuple[str, str]:
    """The roles of the two kernels a backward call of ``var`` with ``n`` query rows (None: any length)
    launches after "prep", in order: the atomic-dQ pair where the variant has it and determinism is not
    asked for (in bwd_wgmma its rotated twin where ``bwd_wgmma_rotated`` says so), its ordered twin where
    determinism is asked for and the family has one (``Family.ordered_dq``), else dK/dV then dQ."""
    if var.fam.ordered_dq:
        if deterministic:
            return ORDERED_DQ_ROLES
        rotated = var.window is None and bwd_wgmma_rotated(var.head_dim, var.causal, n)
        return ROTATED_DQ_ROLES if rotated else ATOMIC_DQ_ROLES
    if not deterministic and set(ATOMIC_DQ_ROLES) <= set(var.roles):
        return ATOMIC_DQ_ROLES
    return DETERMINISTIC_DQ_ROLES


def launch_roles(var, deterministic: bool = False, n: int | None = None) -> tuple[str, ...]:
    """The roles of every kernel a call of ``var`` with ``n`` query rows (None: any length) launches, in
    order (``forward``, ``backward``)."""
    if var.fam.direction == "fwd":
        return ("fwd",)
    return ("prep", *backward_roles(var, deterministic, n))


# --------------------------------------------------------------------------------------------------
# decoding against a KV cache


def kvcache_splits(num_splits: int, *, ctas: int = 0, longest: int = 0, sms: int = 0) -> int:
    """The key ranges ``attention_with_kvcache`` runs for ``num_splits`` (0: the policy's choice), where
    one launch without splits would run ``ctas`` CTAs on a GPU of ``sms`` SMs and the longest entry has
    ``longest`` keys (0: unknown, one range). The rule: split only while the launch leaves SMs idle, into
    as many ranges as fit two waves of CTAs (floor: a third, partial wave costs more than it spreads),
    each of at least 1024 keys (a range costs its queries' load and a merge), at most 64. Measured on an
    H200 (wgmma, D 128, Hkv 8, Hq 32; all kernels of the call): one entry of 131,072 keys took 212, 152
    and 156 us at S = 8, 32 and the rule's 33; 8 entries of 32,768 took 395, 272 and 275 us at S = 1, 4
    (the rule's) and 8, and 319 us at S = 5 (320 CTAs: 2.4 waves). docs/design/varlen.md has the table.
    """
    if num_splits > 0:
        return num_splits
    if ctas <= 0 or sms <= 0 or ctas >= sms:
        return 1
    return max(1, min(2 * sms // ctas, longest // 1024, 64))


def paged_block_n(family: str, page: int, block_n: int, runs) -> int:
    """The key tile of a packed launch over a paged cache of ``page``-row pages whose caller left block_n
    to the policy, where the family's default tile is ``block_n``: the wgmma forward reads the pages in
    place when its key tile divides the page (each tile one TMA box inside one page; ``_varlen.
    reads_pages``), so where the default does not, the widest tile of 64 or more that divides the page
    and that ``runs(block_n)`` says the family runs, else the default (the pages are then gathered).
    Measured on an H200 (decoding, Hq 32, Hkv 8, D 128, fp16, every kernel of a call; pages of 64 in a
    shuffled table): at 128 keys a tile (gathered) 3.3-3.7x the contiguous cache's time, at 64 (in
    place) 1.15-1.29x; 64 keys a tile cost the contiguous cache itself 1.07-1.12x (docs/design/varlen.md).
    """
    if family != "fwd_wgmma" or not page or page % block_n == 0:
        return block_n
    narrower = sorted((bn for bn in FAMILIES[family].block_n if 64 <= bn < block_n and page % bn == 0),
                      reverse=True)
    return next((bn for bn in narrower if runs(bn)), block_n)
